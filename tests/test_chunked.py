"""The chunked backend: memory linearity and tiling details."""

import functools

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from pallas_fa import api
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


@pytest.mark.parametrize("policy", [
    "dots_saveable", "checkpoint_dots", "everything_saveable",
    "nothing_saveable"])
def test_memory_is_linear_under_remat_policies(policy):
  """Under `jax.checkpoint` with a policy that may save dots, the forward's
  tile loops are not rerun for their outputs keeping every tile's logits
  (T x S): (out, lse) come from one opaque call, as without a policy."""
  b, n, h = 1, 2, 16
  loss = jax.checkpoint(
      lambda q, k, v: pallas_fa.flash_attention(
          q, k, v, is_causal=True, implementation="chunked").sum(),
      policy=getattr(jax.checkpoint_policies, policy))
  grad = jax.grad(loss, argnums=(0, 1, 2))

  def temp(t):
    q = jnp.ones((b, t, n, h))
    return _temp_bytes(grad, q, q, q)

  short, long = 1024, 4096
  assert temp(long) < 2 * temp(short)
  assert temp(long) < b * n * long * long * 4 / 2


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


def _recorded_parts(monkeypatch, fn):
  """The (rows, cols) of every logit part the chunked passes compute, as
  run (a callback in each), for the forward and for the backward."""
  parts = {True: [], False: []}
  logits = chunked._Layout.logits

  def record(forward, rows, cols, q0, k0):
    del q0, k0  # Only makes the callback run per visited part.
    parts[forward].append((rows, cols))

  def counted(self, qi, kj, part, params, with_score_mod=True):
    jax.debug.callback(functools.partial(
        record, with_score_mod, part.rows, part.cols), part.q0, part.k0)
    return logits(self, qi, kj, part, params, with_score_mod)

  monkeypatch.setattr(chunked._Layout, "logits", counted)
  api.clear_cache()
  try:
    fn()
  finally:
    api.clear_cache()
  return parts[True], parts[False]


def test_causal_diagonal_tiles_are_visited_in_halves(monkeypatch):
  """With square tiles a causal call computes each diagonal tile as its top
  rows against the left keys plus its bottom rows against all keys (3/4 of
  the tile), the tiles below the diagonal whole, and nothing above it;
  forward and backward, matching the reference."""
  gen = np.random.default_rng(11)
  t, tile = 64, 16
  q, k, v = (jnp.asarray(gen.standard_normal((1, t, 2, 8)), jnp.float32)
             for _ in range(3))
  tiles = chunked.ChunkedBlockSizes(
      block_q=tile, block_kv=tile, block_q_bwd=tile, block_kv_bwd=tile)

  def loss(q, k, v, impl, **kw):
    return (pallas_fa.flash_attention(
        q, k, v, is_causal=True, implementation=impl, **kw) ** 2).sum()

  got = []
  parts = _recorded_parts(monkeypatch, lambda: got.append(jax.grad(
      loss, argnums=(0, 1, 2))(q, k, v, "chunked", block_sizes=tiles)))
  n = t // tile
  below, diagonal = n * (n - 1) // 2, n
  for tiles_of_a_pass in parts:
    assert sorted(tiles_of_a_pass) == sorted(
        [(tile, tile)] * below + [(tile // 2, tile // 2)] * diagonal
        + [(tile // 2, tile)] * diagonal)
  want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "xla")
  for g, w in zip(got[0], want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shift", [-5, 0, 3, 12])
def test_halving_follows_the_positions(monkeypatch, shift):
  """A diagonal moved by the positions (queries ahead of or behind their
  keys) halves only the tiles whose top-right quarter is really empty:
  forward and gradients match the reference, and a tile is halved exactly
  when the quarter has no visible element."""
  gen = np.random.default_rng(12 + shift)
  t, tile = 48, 16
  q, k, v = (jnp.asarray(gen.standard_normal((2, t, 2, 8)), jnp.float32)
             for _ in range(3))
  q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + shift, (2, t))
  kv_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
  tiles = chunked.ChunkedBlockSizes(
      block_q=tile, block_kv=tile, block_q_bwd=tile, block_kv_bwd=tile)

  def loss(q, k, v, impl, **kw):
    return (pallas_fa.flash_attention(
        q, k, v, is_causal=True, query_positions=q_pos, key_positions=kv_pos,
        implementation=impl, **kw) ** 2).sum()

  got = []
  parts = _recorded_parts(monkeypatch, lambda: got.append(
      jax.value_and_grad(loss, argnums=(0, 1, 2))(
          q, k, v, "chunked", block_sizes=tiles)))
  want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, "xla")
  for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=3e-5, rtol=3e-5)
  # Brute force: per tile, is it visited, and is its top-right quarter empty.
  qp, kp = np.arange(t) + shift, np.arange(t)
  visible = kp[None, :] <= qp[:, None]
  want_parts = []
  h = tile // 2
  for i in range(0, t, tile):
    for j in range(0, t, tile):
      block = visible[i:i + tile, j:j + tile]
      if not block.any():
        continue
      if block.all() or block[:h, h:].any():
        want_parts.append((tile, tile))
      else:
        want_parts += [(h, h), (h, tile)]
  for tiles_of_a_pass in parts:
    assert sorted(tiles_of_a_pass) == sorted(want_parts)


def test_float16_gradients_stay_finite_with_large_values():
  """float16 values near 3e4 to 6e4: dP = dO.V, and with it dS, leaves
  float16's range though every input and result fits in it. dS enters the
  backward's products in float32 (dQ and dK were 6-8 % inf and NaN)."""
  ks = jax.random.split(jax.random.PRNGKey(7), 4)
  q = jax.random.normal(ks[0], (1, 48, 2, 32)).astype(jnp.float16)
  k = jax.random.normal(ks[1], (1, 64, 1, 32)).astype(jnp.float16)
  v = (jnp.sign(jax.random.normal(ks[2], (1, 64, 1, 32)))
       * jax.random.uniform(ks[3], (1, 64, 1, 32), minval=3e4, maxval=6e4)
       ).astype(jnp.float16)
  dout = jax.random.normal(jax.random.PRNGKey(8), (1, 48, 2, 32))

  def grads(implementation, q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(pallas_fa.flash_attention(
        q, k, v, implementation=implementation,
        block_sizes=conftest.block_sizes_for(implementation)
    ).astype(jnp.float32) * dout), argnums=(0, 1, 2))(q, k, v)

  want = grads("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
  for name, g, w in zip(("dq", "dk", "dv"), grads("chunked", q, k, v), want):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.all(np.isfinite(g)), name
    rms = np.sqrt(np.mean((g - w) ** 2) / np.mean(w ** 2))
    assert rms < 2e-3, (name, rms)
