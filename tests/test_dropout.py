"""Attention dropout: hashed masks, identical on every backend and tiling."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import Case
from attention_testing import gpu_jax_only
from attention_testing import make_inputs
from attention_testing import rng
from conftest import block_sizes_for
from flax import nnx

import pallas_fa
from pallas_fa import api
from pallas_fa import chunked
from pallas_fa import dropout
from pallas_fa import modules
from pallas_fa import triton

_TILINGS = {
    "xla": None,
    "chunked-small": chunked.ChunkedBlockSizes(
        block_q=8, block_kv=16, block_q_bwd=16, block_kv_bwd=8),
    "chunked-large": chunked.ChunkedBlockSizes(
        block_q=32, block_kv=64, block_q_bwd=64, block_kv_bwd=32),
    # Interpreted on CPU; the tiles of its three kernels all differ.
    "triton": triton.TritonBlockSizes(
        block_q=16, block_kv=32, block_q_dkv=32, block_kv_dkv=16,
        block_q_dq=16, block_kv_dq=32, num_warps=4, num_stages=1),
    # Interpreted on CPU; one 128-row tile here, several in
    # tests/test_mosaic_tpu.py.
    "mosaic_tpu": block_sizes_for("mosaic_tpu"),
}


def _run(name, q, k, v, kw, dout):
  """(out, lse, dq, dk, dv) of one implementation/tiling."""
  fn = functools.partial(
      pallas_fa.flash_attention, implementation=name.split("-")[0],
      block_sizes=_TILINGS[name], return_residual=True, **kw)

  def loss(q, k, v):
    out, lse = fn(q, k, v)
    return (out * dout).sum(), (out, lse)

  grads, (out, lse) = jax.jit(jax.grad(
      loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return (out, lse, *grads)


@pytest.mark.long
@gpu_jax_only  # Every interpreter at once: CI runs it in leg 2.
def test_every_backend_and_tiling_draws_the_same_mask():
  """Outputs and gradients agree across backends and tile sizes (the xla
  backward is autodiff of the materialised forward: an independent check
  of the blockwise backward's dropout)."""
  case = Case(b=2, t=37, s=45, n=4, k=2, h=16, causal=True, window=(20, 3),
              segments=True, lengths=True, soft_cap=8.0, bias="heads")
  gen = rng("dropout", "backends")
  q, k, v, kw = make_inputs(case, jnp.float32, gen)
  kw.update(dropout_rate=0.3, dropout_rng=jax.random.key(gen.integers(99)))
  dout = jnp.asarray(gen.standard_normal(q.shape), jnp.float32)
  results = {name: dict(zip(("out", "lse", "dq", "dk", "dv"),
                            _run(name, q, k, v, kw, dout)))
             for name in _TILINGS}
  for name in [name for name in _TILINGS if name != "xla"]:
    chex.assert_trees_all_close(results[name], results["xla"], rtol=2e-5,
                                atol=2e-5, custom_message=name)
  # Dropout did something.
  no_dropout = pallas_fa.flash_attention(
      q, k, v, **{n: x for n, x in kw.items() if "dropout" not in n})
  assert np.abs(results["xla"]["out"] - no_dropout).max() > 0.1


def test_output_is_the_masked_softmax_in_numpy():
  """out = (softmax(scale q.k) * keep / (1 - rate)) @ v, in float64 numpy
  with the mask from `dropout.keep_mask`, for every backend."""
  b, t, s, n, h, rate = 2, 9, 14, 3, 8, 0.4
  gen = np.random.default_rng()
  q, k, v = (gen.standard_normal((b, x, n, h)) for x in (t, s, s))
  seed = int(gen.integers(1 << 31))
  bi, ni, ti, si = np.meshgrid(np.arange(b), np.arange(n), np.arange(t),
                               np.arange(s), indexing="ij")
  keep = np.asarray(dropout.keep_mask(
      jnp.uint32(seed), rate, bi, ni, ti, si))  # [b, n, t, s]
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = np.einsum("bnts,bsnh->btnh", p * keep / (1 - rate), v)
  for name in _TILINGS:
    got = pallas_fa.flash_attention(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
        implementation=name.split("-")[0], block_sizes=_TILINGS[name],
        dropout_rate=rate, dropout_rng=seed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_within_statistical_bounds(rate):
  gen = np.random.default_rng()
  shape = (2, 4, 256, 512)
  idx = [jax.lax.broadcasted_iota(jnp.int32, shape, a) for a in range(4)]
  keep = np.asarray(dropout.keep_mask(
      jnp.uint32(gen.integers(1 << 32)), rate, *idx))
  n = keep.size
  sigma = np.sqrt(rate * (1 - rate) / n)
  assert abs(keep.mean() - (1 - rate)) < 6 * sigma
  # Independent across heads, rows and neighbouring keys: agreement of two
  # slices is p^2 + (1 - p)^2 up to sampling error.
  agree = (1 - rate) ** 2 + rate ** 2
  for a, b in ((keep[:, 0], keep[:, 1]), (keep[:, :, 0], keep[:, :, 1]),
               (keep[..., :-1], keep[..., 1:]), (keep[0], keep[1])):
    m = a.size
    assert abs((a == b).mean() - agree) < 6 * np.sqrt(agree * (1 - agree) / m)


def test_same_key_same_result_other_key_other_result_zero_rate_exact():
  case = Case(b=1, t=20, s=24, n=2, k=1, h=8, causal=True)
  q, k, v, kw = make_inputs(case, jnp.float32, rng("dropout", "determinism"))
  fn = functools.partial(pallas_fa.flash_attention, q, k, v, **kw)
  a = fn(dropout_rate=0.2, dropout_rng=jax.random.key(1))
  b = fn(dropout_rate=0.2, dropout_rng=jax.random.key(1))
  c = fn(dropout_rate=0.2, dropout_rng=jax.random.key(2))
  np.testing.assert_array_equal(a, b)
  assert np.abs(a - c).max() > 1e-3
  np.testing.assert_array_equal(
      fn(dropout_rate=0.0, dropout_rng=jax.random.key(1)), fn())


# Slow (every backend and tiling): CI runs it in its slow-test leg.
@pytest.mark.slow
def test_fully_masked_rows_stay_zero_and_finite():
  case = Case(b=2, t=16, s=16, n=2, k=2, h=8, causal=True, lengths=True,
              window=(2, 0))
  q, k, v, kw = make_inputs(case, jnp.float32, rng("dropout", "masked"))
  kw["query_positions"] = jnp.broadcast_to(jnp.arange(16) - 4, (2, 16))
  kw.update(dropout_rate=0.5, dropout_rng=7)
  # mosaic_tpu's interpreter is slow; its masked rows are conformance cases.
  for name in [name for name in _TILINGS if name != "mosaic_tpu"]:
    fn = lambda q, k, v, name=name: pallas_fa.flash_attention(
        q, k, v, implementation=name.split("-")[0],
        block_sizes=_TILINGS[name], **kw)
    out = fn(q, k, v)
    grads = jax.grad(lambda *a, fn=fn: fn(*a).sum(), argnums=(0, 1, 2))(
        q, k, v)
    assert np.all(np.asarray(out)[:, :4] == 0)  # rows with no visible key
    chex.assert_tree_all_finite((out, grads))


def test_unbiased_on_average():
  """The mean over many masks approaches the undropped output."""
  case = Case(b=1, t=6, s=8, n=1, k=1, h=4)
  q, k, v, kw = make_inputs(case, jnp.float32, rng("dropout", "mean"))
  plain = pallas_fa.flash_attention(q, k, v)
  keys = jax.random.split(jax.random.key(0), 4000)
  outs = jax.vmap(lambda key: pallas_fa.flash_attention(
      q, k, v, dropout_rate=0.5, dropout_rng=key))(keys)
  spread = np.asarray(outs).std(axis=0) / np.sqrt(len(keys))
  assert np.all(np.abs(outs.mean(axis=0) - plain) < 6 * spread + 1e-6)


def test_a_backend_without_dropout_declines_by_name():
  q = jnp.ones((1, 8, 1, 16))
  backend = dataclasses.replace(chunked.BACKEND, name="plain", dropout=False)
  call = api.canonicalize(q, q, q, dropout_rate=0.1, dropout_rng=0)
  with pytest.raises(NotImplementedError,
                     match="'plain' does not implement attention dropout"):
    backend.check_call(*call.arrays)


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(dropout_rate=1.0, dropout_rng=0), ValueError, "dropout_rate"),
    (dict(dropout_rate=-0.1, dropout_rng=0), ValueError, "dropout_rate"),
    (dict(dropout_rate=0.1), ValueError, "dropout_rng"),
    (dict(dropout_rate=0.1, dropout_rng=jnp.ones((3,))), TypeError,
     "dropout_rng"),
])
def test_bad_arguments(kwargs, error, text):
  q = jnp.ones((1, 4, 1, 8))
  with pytest.raises(error, match=text):
    pallas_fa.flash_attention(q, q, q, **kwargs)


def test_flax_attention_fn_and_module_train_with_dropout():
  d, x = 16, jnp.asarray(np.random.default_rng().standard_normal((2, 7, 16)),
                         jnp.float32)
  q = jnp.asarray(np.random.default_rng().standard_normal((2, 7, 2, 8)),
                  jnp.float32)
  fn = modules.make_attention_fn()
  key = jax.random.key(3)
  np.testing.assert_array_equal(
      fn(q, q, q, dropout_rate=0.3, dropout_rng=key),
      pallas_fa.flash_attention(q, q, q, dropout_rate=0.3, dropout_rng=key))
  np.testing.assert_array_equal(
      fn(q, q, q, dropout_rate=0.3, dropout_rng=key, deterministic=True),
      pallas_fa.flash_attention(q, q, q))
  flax_mha = nnx.MultiHeadAttention(
      num_heads=2, in_features=d, dropout_rate=0.3, decode=False,
      attention_fn=fn, rngs=nnx.Rngs(0))
  ours = modules.MultiHeadAttention(2, d, dropout_rate=0.3,
                                    rngs=nnx.Rngs(0))
  for module in (flax_mha, ours):
    train = module(x, deterministic=False)
    train_again = module(x, deterministic=False)  # the stream advanced
    infer = module(x, deterministic=True)
    assert np.all(np.isfinite(train))
    assert np.abs(train - infer).max() > 1e-3
    assert np.abs(train - train_again).max() > 1e-3
