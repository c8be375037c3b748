"""Tests of `pallas_fa.layout`: tile choice, padded sizes, the prologue."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import rng

from pallas_fa import layout
from pallas_fa import masking

POW2 = layout.Alignment(rows=16, head_dim=16, power_of_two=True)
LANES = layout.Alignment(rows=128, head_dim=128)
BALANCED = layout.Alignment(rows=8, balanced=True)


@pytest.mark.parametrize("x, multiple, want", [
    (0, 8, 0), (1, 8, 8), (8, 8, 8), (9, 8, 16), (300, 128, 384)])
def test_round_up(x, multiple, want):
  assert layout.round_up(x, multiple) == want


@pytest.mark.parametrize("x, want", [
    (0, 1), (1, 1), (2, 2), (3, 4), (16, 16), (17, 32), (1000, 1024)])
def test_next_power_of_2(x, want):
  assert layout.next_power_of_2(x) == want


@pytest.mark.parametrize("align, block, length, want", [
    # Powers of two of at least 16, clipped to short sequences.
    (POW2, 128, 1, (16, 16)),
    (POW2, 128, 33, (64, 64)),
    (POW2, 128, 128, (128, 128)),
    (POW2, 32, 1000, (32, 1024)),
    # Multiples of 128: a short sequence is one tile of its rounded length.
    (LANES, 128, 1, (128, 128)),
    (LANES, 512, 300, (384, 384)),
    (LANES, 256, 1000, (256, 1024)),
    # Balanced: 600 rows in 512-row tiles are two of 304, not 512 + 88; a
    # sequence that fits one tile is not padded at all.
    (BALANCED, 512, 600, (304, 608)),
    (BALANCED, 512, 300, (300, 300)),
    (BALANCED, 16, 45, (16, 48)),
])
def test_tile(align, block, length, want):
  tile, padded = layout.tile(block, length, align)
  assert (tile, padded) == want
  assert padded % tile == 0 and padded >= length and tile <= max(block, 16)


def test_padded_length_fits_every_tile():
  assert layout.padded_length(100, 64) == 128
  assert layout.padded_length(100, 128, 64) == 128
  assert layout.padded_length(100, 128, 192) == 384  # lcm, not max
  assert layout.padded_length(384, 128, 192) == 384


@pytest.mark.parametrize("align, head_dims", [
    (POW2, {1: 16, 8: 16, 16: 16, 40: 64, 72: 128, 256: 256}),
    (layout.Alignment(rows=64, head_dim=64), {1: 64, 64: 64, 72: 128,
                                              160: 192, 256: 256}),
    (LANES, {1: 128, 72: 128, 129: 256, 256: 256}),
    (BALANCED, {1: 1, 72: 72, 200: 200}),
])
def test_padded_head_dim(align, head_dims):
  for head_dim, want in head_dims.items():
    assert layout.padded_head_dim(head_dim, align) == want


def _info(t, s, q_len=None, kv_len=None):
  """A MaskInfo for batch 2 with optional padding lengths."""
  q_seg = masking.padding_segments(
      None, q_len, t, masking.Q_PAD_SEGMENT)
  kv_seg = masking.padding_segments(
      None, kv_len, s, masking.KV_PAD_SEGMENT)
  if q_seg is None and kv_seg is not None:
    q_seg = jnp.zeros((2, t), jnp.int32)
  if kv_seg is None and q_seg is not None:
    kv_seg = jnp.zeros((2, s), jnp.int32)
  return masking.MaskInfo(
      q_positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t)),
      kv_positions=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s)),
      q_segment_ids=q_seg, kv_segment_ids=kv_seg)


def test_padded_zeroes_padding_and_marks_the_tails():
  gen = rng("layout", "padded")
  t, s, n, num_kv, h = 20, 30, 4, 2, 24
  q = jnp.asarray(gen.standard_normal((2, t, n, h)), jnp.float32)
  k = jnp.asarray(gen.standard_normal((2, s, num_kv, h)), jnp.float32)
  q_len = jnp.array([20, 11], jnp.int32)
  kv_len = jnp.array([7, 30], jnp.int32)
  # NaN / inf stored in the caller's padding must not survive.
  q = q.at[1, 11:].set(jnp.nan)
  k = k.at[0, 7:].set(jnp.inf)
  bias = jnp.ones((1, n, 1, s))
  x = layout.Padded(q, k, k, bias, _info(t, s, q_len, kv_len), q_len=32,
                    kv_len=48, align=POW2)
  assert (x.tp, x.sp, x.hp, x.g) == (32, 48, 32, 2)
  assert x.q.shape == (2, 32, n, 32) and x.k.shape == (2, 48, num_kv, 32)
  assert x.bias.shape == (1, n, 1, 48)  # broadcast axes stay 1
  for arr in (x.q, x.k, x.v):
    assert np.all(np.isfinite(np.asarray(arr)))
  np.testing.assert_array_equal(np.asarray(x.q[0, :t, :, :h]), q[0])
  assert np.all(np.asarray(x.q[1, 11:]) == 0)
  assert np.all(np.asarray(x.q[..., h:]) == 0)
  assert np.all(np.asarray(x.k[0, 7:]) == 0)
  # The tails are padding like the caller's own.
  assert np.all(np.asarray(x.info.q_segment_ids[:, t:])
                == masking.Q_PAD_SEGMENT)
  assert np.all(np.asarray(x.info.kv_segment_ids[:, s:])
                == masking.KV_PAD_SEGMENT)
  rows = x.rows(jnp.ones((2, t, n)), -jnp.inf)
  assert rows.shape == (2, n, 32)
  assert np.all(np.isneginf(np.asarray(rows[:, :, t:])))


def test_padded_casts_and_leaves_aligned_inputs_alone():
  q = jnp.ones((1, 256, 2, 128), jnp.float16)
  x = layout.Padded(q, q, q, None, _info(256, 256), q_len=256, kv_len=256,
                    align=LANES, dtype=jnp.float32)
  assert x.q.dtype == jnp.float32 and x.bias is None
  # Nothing to pad and no padding to zero: no pad, no select.
  jaxpr = str(jax.make_jaxpr(x.queries)(q))
  assert "pad" not in jaxpr and "select" not in jaxpr
