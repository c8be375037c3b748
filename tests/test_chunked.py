"""The chunked backend: memory linearity and tiling details."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from pallas_fa import chunked
from pallas_fa import layout


def _temp_bytes(fn, *args):
  compiled = jax.jit(fn).lower(*args).compile()
  analysis = compiled.memory_analysis()
  if analysis is None:
    pytest.skip("this jaxlib reports no memory analysis")
  return analysis.temp_size_in_bytes


@pytest.mark.parametrize("causal", [False, True])
def test_memory_is_linear_in_sequence_length(causal):
  """Forward+backward scratch stays flat as T grows; the dense one is T^2."""
  b, n, h = 1, 2, 16

  def loss(q, k, v, impl):
    return pallas_fa.flash_attention(
        q, k, v, is_causal=causal, implementation=impl).sum()

  grad = jax.grad(loss, argnums=(0, 1, 2))

  def temp(t, impl):
    q = jnp.ones((b, t, n, h))
    return _temp_bytes(lambda q, k, v: grad(q, k, v, impl), q, q, q)

  short, long = 1024, 4096  # 16x the logits
  logits_bytes = b * n * long * long * 4
  assert temp(long, "xla") >= logits_bytes  # the reference does hold them
  assert temp(long, "chunked") < 2 * temp(short, "chunked")
  assert temp(long, "chunked") < logits_bytes / 2


def test_tiles_balance_ragged_lengths():
  # 600 rows with 512-row tiles: two tiles of 304, not 512 + 88.
  assert layout.tile(512, 600, chunked.ALIGN) == (304, 608)
  assert layout.tile(512, 300, chunked.ALIGN) == (300, 300)
  assert layout.tile(16, 45, chunked.ALIGN) == (16, 48)


def test_block_sizes_change_tiling_not_results():
  gen = np.random.default_rng(7)
  q = jnp.asarray(gen.standard_normal((1, 100, 2, 8)), jnp.float32)
  k = jnp.asarray(gen.standard_normal((1, 77, 2, 8)), jnp.float32)
  outs = [
      pallas_fa.flash_attention(
          q, k, k, is_causal=True, implementation="chunked",
          block_sizes=chunked.ChunkedBlockSizes(block_q=bq, block_kv=bk))
      for bq, bk in [(8, 8), (24, 40), (512, 512)]
  ]
  for out in outs[1:]:
    np.testing.assert_allclose(out, outs[0], atol=2e-6)
