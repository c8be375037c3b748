"""`merge_attention`: the exact merge of attention over disjoint key sets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from tests.attention_testing import assert_close
from tests.attention_testing import rng

B, T, N, H = 2, 5, 3, 16
CUTS = (0, 7, 8, 20, 29)  # Four key sets, one of a single key.


def _attention(q, k, v, lengths=None):
  return pallas_fa.flash_attention(
      q, k, v, key_value_seq_lengths=lengths, implementation="xla",
      precision="highest", return_residual=True)


def _inputs(name, dtype=jnp.float32):
  gen = rng("merge", name)
  s = CUTS[-1]
  return tuple(jnp.asarray(gen.standard_normal(shape), dtype) for shape in (
      (B, T, N, H), (B, s, N, H), (B, s, N, H)))


def _parts(q, k, v):
  return [_attention(q, k[:, a:b], v[:, a:b])
          for a, b in zip(CUTS[:-1], CUTS[1:])]


@pytest.mark.parametrize("stacked", [False, True])
def test_merge_equals_attention_over_the_union(stacked):
  q, k, v = _inputs("union")
  parts = _parts(q, k, v)
  outs, lses = [p[0] for p in parts], [p[1] for p in parts]
  if stacked:
    outs, lses = jnp.stack(outs), jnp.stack(lses)
  out, lse = pallas_fa.merge_attention(outs, lses)
  ref_out, ref_lse = _attention(q, k, v)
  assert out.shape == (B, T, N, H) and lse.shape == (B, T, N)
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  assert_close("out", out, ref_out)
  assert_close("lse", lse, ref_lse)


def test_empty_parts_and_rows_give_zeros_and_minus_inf():
  q, k, v = _inputs("empty")
  # Row 0 sees no key of the second part; row 1 sees no key at all.
  first = _attention(q, k[:, :10], v[:, :10], jnp.asarray([10, 0]))
  second = _attention(q, k[:, 10:], v[:, 10:], jnp.asarray([0, 0]))
  out, lse = pallas_fa.merge_attention([first[0], second[0]],
                                       [first[1], second[1]])
  assert_close("out", out[0], first[0][0])
  assert_close("lse", lse[0], first[1][0])
  np.testing.assert_array_equal(out[1], 0.0)
  assert np.all(np.isneginf(lse[1]))


def test_gradients_reach_every_part_and_equal_the_union_s():
  q, k, v = _inputs("gradient")
  gen = rng("merge", "cotangents")
  dout = jnp.asarray(gen.standard_normal((B, T, N, H)), jnp.float32)
  dlse = jnp.asarray(gen.standard_normal((B, T, N)), jnp.float32)

  def loss(merged, q, k, v):
    if merged:
      parts = _parts(q, k, v)
      # An extra part that sees no key: zero gradients, never NaN.
      empty = _attention(q, k[:, :3], v[:, :3], jnp.zeros((B,), jnp.int32))
      out, lse = pallas_fa.merge_attention(
          [p[0] for p in parts] + [empty[0]],
          [p[1] for p in parts] + [empty[1]])
    else:
      out, lse = _attention(q, k, v)
    return jnp.sum(out * dout) + jnp.sum(lse * dlse)

  grads = jax.grad(lambda *a: loss(True, *a), argnums=(0, 1, 2))(q, k, v)
  refs = jax.grad(lambda *a: loss(False, *a), argnums=(0, 1, 2))(q, k, v)
  for name, g, r in zip("qkv", grads, refs):
    assert np.all(np.isfinite(g)), name
    assert_close("d" + name, g, r)


def test_low_precision_parts_keep_their_dtype():
  q, k, v = _inputs("bf16", jnp.bfloat16)
  parts = _parts(q, k, v)
  out, lse = pallas_fa.merge_attention([p[0] for p in parts],
                                       [p[1] for p in parts])
  ref = _attention(*(x.astype(jnp.float32) for x in (q, k, v)))
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  same = _attention(q, k, v)
  assert_close("out", out, ref[0], same[0], jnp.bfloat16)


@pytest.mark.parametrize("outs, lses, error, match", [
    ([], [], ValueError, "at least one part"),
    ([np.ones((2, 3, 4))], [np.ones((2, 3)), np.ones((2, 3))], ValueError,
     "as many parts"),
    ([np.ones((2, 3, 4))], [np.ones((2, 4))], ValueError, "without the last"),
    ([np.ones((2, 3, 4)), np.ones((2, 3, 5))], [np.ones((2, 3))] * 2,
     ValueError, "one shape"),
    ([np.ones((2, 3, 4), np.int32)], [np.ones((2, 3))], TypeError, "outs"),
])
def test_bad_parts_are_named(outs, lses, error, match):
  with pytest.raises(error, match=match):
    pallas_fa.merge_attention(outs, lses)
