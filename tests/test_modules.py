"""Tests of the Flax modules: `MultiHeadAttention`, `make_attention_fn`."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_fa import chunked
from pallas_fa import modules

# Small tiles so short sequences cross several tile boundaries.
_TILES = chunked.ChunkedBlockSizes(
    block_q=8, block_kv=8, block_q_bwd=8, block_kv_bwd=8)
_TOL = dict(rtol=2e-5, atol=2e-5)


# Inputs come from numpy (fresh every run) and every computation is jitted as
# a whole: eager op-by-op execution compiles each primitive separately, which
# dominates the run time of small tests on CPU.
_RNG = np.random.default_rng()


def _normal(shape):
  return jnp.asarray(_RNG.standard_normal(shape), jnp.float32)


def _seed():
  return int(_RNG.integers(1 << 20))


def _assert_trees_close(a, b, **tol):
  jax.tree.map(
      lambda x, y: np.testing.assert_allclose(x, y, **(tol or _TOL)), a, b)


def _padding(b, t):
  """Valid lengths in [1, t] (at least one row padded) and the valid mask."""
  lengths = _RNG.integers(1, t + 1, b)
  lengths[0] = t - 3
  return jnp.asarray(np.arange(t)[None, :] < lengths[:, None])


# --------------------------------------------------------------------------
# nnx.MultiHeadAttention(attention_fn=make_attention_fn()).


def _attention_fn(implementation):
  tiles = _TILES if implementation == "chunked" else None
  return modules.make_attention_fn(
      implementation=implementation, block_sizes=tiles)


def _nnx_pair(seed, implementation="chunked", **kw):
  """Flax's module and the same module (same params) with flash attention."""
  ref = nnx.MultiHeadAttention(rngs=nnx.Rngs(seed), decode=False, **kw)
  ours = nnx.MultiHeadAttention(
      rngs=nnx.Rngs(seed), decode=False,
      attention_fn=_attention_fn(implementation), **kw)
  return ref, ours


def _nnx_loss_and_grads(module, x, row_weights, mask=None, is_causal=False):
  graphdef, params = nnx.split(module)

  @jax.jit
  def run(params, x, row_weights, mask):
    def loss(params, x):
      y = nnx.merge(graphdef, params)(x, mask=mask, is_causal=is_causal)
      return jnp.sum(jnp.sin(y) * row_weights[..., None]), y

    return jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)

  (value, y), grads = run(params, x, row_weights, mask)
  return value, y, grads


# The adapter's job is translating Flax's arguments; the backends' own
# correctness is the conformance suite's. So the simple case runs the
# cheap-to-compile "xla" backend and the causal + padding mask case runs
# "chunked", the CPU default.
@pytest.mark.parametrize(
    "masking, num_kv_heads, implementation",
    [("is_causal", 2, "xla"), ("causal_padding", 4, "chunked")],
)
def test_nnx_attention_fn_matches_flax(masking, num_kv_heads, implementation):
  b, t, d = 3, 21, 32
  x = _normal((b, t, d))
  ref, ours = _nnx_pair(
      _seed(), implementation, num_heads=4,
      in_features=d, qkv_features=32, num_kv_heads=num_kv_heads)
  call_kw, rows = {}, jnp.ones((b, t))
  mask = None
  if "padding" in masking:
    valid = _padding(b, t)
    mask = nnx.make_attention_mask(valid, valid)  # float32 [B, 1, T, T]
    # Padded query rows see no key: Flax returns mean(V), flash attention
    # zeros (the documented difference), so only valid rows are compared.
    rows = valid.astype(jnp.float32)
  if "causal" in masking and masking != "is_causal":
    causal = nnx.make_causal_mask(jnp.ones((b, t)))
    mask = causal if mask is None else nnx.combine_masks(mask, causal)
  if masking == "is_causal":
    call_kw["is_causal"] = True
  if mask is not None:
    call_kw["mask"] = mask
  v_ref, y_ref, g_ref = _nnx_loss_and_grads(ref, x, rows, **call_kw)
  v_ours, y_ours, g_ours = _nnx_loss_and_grads(ours, x, rows, **call_kw)
  np.testing.assert_allclose(
      y_ours * rows[..., None], y_ref * rows[..., None], **_TOL)
  np.testing.assert_allclose(v_ours, v_ref, rtol=1e-5)
  _assert_trees_close(g_ours, g_ref)


def test_nnx_decode_mode_matches_flax():
  b, t, d = 2, 11, 32
  x = _normal((b, t, d))
  ref, ours = _nnx_pair(_seed(), num_heads=4, in_features=d, num_kv_heads=2)
  # One compiled step per module, reused for every position.
  step = nnx.jit(lambda m, x: m(x, decode=True))
  outs = []
  for module in (ref, ours):
    module.init_cache((b, t, d))
    outs.append(jnp.concatenate(
        [step(module, x[:, i:i + 1]) for i in range(t)], axis=1))
  np.testing.assert_allclose(outs[1], outs[0], **_TOL)
  # And decoding equals the causal full forward.
  full = nnx.jit(lambda m, x: m(x, is_causal=True, decode=False))(ours, x)
  np.testing.assert_allclose(full, outs[1], **_TOL)


def test_attention_dropout_in_training_raises():
  d = 16
  x = _normal((2, 5, d))
  module = nnx.MultiHeadAttention(
      num_heads=2, in_features=d, dropout_rate=0.1, decode=False,
      attention_fn=_attention_fn("xla"), rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="dropout"):
    module(x, deterministic=False)
  # Outside training the dropout rate is irrelevant and the call works.
  ref = nnx.MultiHeadAttention(
      num_heads=2, in_features=d, dropout_rate=0.1, decode=False,
      rngs=nnx.Rngs(0))
  run = nnx.jit(lambda m, x: m(x, deterministic=True))
  np.testing.assert_allclose(run(module, x), run(ref, x), **_TOL)


def test_sow_weights_raises():
  d = 16
  module = nnx.MultiHeadAttention(
      num_heads=2, in_features=d, decode=False,
      attention_fn=modules.make_attention_fn(), rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="sow_weights"):
    module(_normal((1, 4, d)), sow_weights=True)


def test_attention_fn_extra_batch_dims_and_bias():
  q = _normal((2, 3, 9, 4, 8))
  k = _normal((2, 3, 13, 2, 8))
  v = _normal((2, 3, 13, 2, 8))
  # Batch dims broadcast in bias and mask; mask is Flax-style float.
  bias = _normal((3, 1, 9, 13))
  mask = _RNG.random((2, 1, 4, 9, 13)) < 0.7
  mask[..., 0] = True
  got = jax.jit(_attention_fn("xla"))(q, k, v, bias, mask.astype(np.float32))
  flat = lambda x, shape: jnp.broadcast_to(x, shape).reshape((6,) + shape[2:])
  want = jax.jit(jax.nn.dot_product_attention)(
      flat(q, q.shape), flat(k, k.shape), flat(v, v.shape),
      flat(bias, (2, 3, 1, 9, 13)), flat(mask, (2, 3, 4, 9, 13)))
  np.testing.assert_allclose(got, want.reshape(q.shape), **_TOL)
  assert got.shape == q.shape


# --------------------------------------------------------------------------
# linen.MultiHeadDotProductAttention(attention_fn=make_attention_fn()).


def test_linen_attention_fn_matches_flax():
  b, t, d = 2, 19, 32
  x = _normal((b, t, d))
  kw = dict(num_heads=4, qkv_features=32)
  ref = nn.MultiHeadDotProductAttention(**kw)
  ours = nn.MultiHeadDotProductAttention(
      attention_fn=_attention_fn("chunked"), **kw)
  params = ref.init(jax.random.key(_seed()), x)
  valid = _padding(b, t)
  mask = nn.combine_masks(nn.make_attention_mask(valid, valid),
                          nn.make_causal_mask(jnp.ones((b, t))))
  rows = valid.astype(jnp.float32)

  def loss(module, params, x):
    y = module.apply(params, x, mask=mask)
    return jnp.sum(jnp.cos(y) * rows[..., None]), y

  grad = lambda m: jax.jit(jax.value_and_grad(
      functools.partial(loss, m), (0, 1), has_aux=True))(params, x)
  (_, y_ref), g_ref = grad(ref)
  (_, y_ours), g_ours = grad(ours)
  np.testing.assert_allclose(
      y_ours * rows[..., None], y_ref * rows[..., None], **_TOL)
  _assert_trees_close(g_ours, g_ref)


# --------------------------------------------------------------------------
# pallas_fa.modules.MultiHeadAttention.


def _mha(seed=0, **kw):
  kw = dict(num_heads=4, in_features=32, num_kv_heads=2, is_causal=True,
            rope=modules.Rope(), implementation="xla") | kw
  return modules.MultiHeadAttention(rngs=nnx.Rngs(seed), **kw)


def test_mha_shapes_and_cross_attention():
  layer = _mha(out_features=24, head_dim=6, is_causal=False,
               in_kv_features=10, rope=None)
  y = nnx.jit(lambda m, x, z: m(x, z))(
      layer, _normal((3, 5, 32)), _normal((3, 9, 10)))
  assert y.shape == (3, 5, 24)
  assert layer.query.kernel.shape == (32, 4, 6)
  assert layer.key.kernel.shape == (10, 2, 6)
  assert layer.out.kernel.shape == (4, 6, 24)
  with pytest.raises(ValueError, match="num_kv_heads"):
    _mha(num_kv_heads=3)


def test_mha_matches_dense_reference():
  """q/k/v projections + RoPE + causal attention, computed by hand."""
  b, t = 2, 19
  x = _normal((b, t, 32))
  layer = _mha(seed=_seed())

  @nnx.jit
  def both(layer, x):
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    proj = lambda p: jnp.einsum("btd,dnh->btnh", x, p.kernel[...])
    q = modules.rope(proj(layer.query), pos)
    k = modules.rope(proj(layer.key), pos)
    o = jax.nn.dot_product_attention(q, k, proj(layer.value), is_causal=True)
    return layer(x), jnp.einsum("btnh,nhd->btd", o, layer.out.kernel[...])

  got, want = both(layer, x)
  np.testing.assert_allclose(got, want, **_TOL)


def test_mha_packed_segments_equal_separate_sequences():
  """Two packed sequences (segment ids + restarting positions) == separate."""
  t1, t2 = 7, 12
  a, c = _normal((1, t1, 32)), _normal((1, t2, 32))
  layer = _mha(seed=_seed())

  @nnx.jit
  def run(layer, a, c):
    packed = layer(
        jnp.concatenate([a, c], axis=1),
        positions=jnp.concatenate([jnp.arange(t1), jnp.arange(t2)])[None],
        segment_ids=jnp.array([[1] * t1 + [2] * t2]),
    )
    return packed, layer(a), layer(c)

  packed, want_a, want_c = run(layer, a, c)
  np.testing.assert_allclose(packed[:, :t1], want_a, **_TOL)
  np.testing.assert_allclose(packed[:, t1:], want_c, **_TOL)


def test_mha_decode_equals_full_forward():
  b, t, prefill = 2, 21, 6
  x = _normal((b, t, 32))
  layer = _mha(seed=_seed(), implementation="chunked", block_sizes=_TILES)
  full = nnx.jit(lambda m, x: m(x))(layer, x)
  layer.init_cache(b, t + 3)
  # Compiled once for the prefill shape and once for the 1-token steps.
  step = nnx.jit(lambda m, x: m(x, decode=True))
  steps = [step(layer, x[:, :prefill])]
  steps += [step(layer, x[:, i:i + 1]) for i in range(prefill, t)]
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, **_TOL)
  assert int(layer.cache_index[...]) == t
  with pytest.raises(ValueError, match="overflow"):
    layer(x[:, :4], decode=True)
  with pytest.raises(ValueError, match="decode"):
    layer(x[:, :1], decode=True, positions=jnp.zeros((b, 1), jnp.int32))


def test_mha_decode_without_cache_raises():
  with pytest.raises(ValueError, match="init_cache"):
    _mha()(jnp.ones((1, 1, 32)), decode=True)


def test_rope_is_relative():
  """<rope(q, m), rope(k, n)> depends on m - n only."""
  q, k = _normal((1, 1, 1, 16)), _normal((1, 1, 1, 16))

  @jax.jit
  def dot(m, n):
    pos = lambda p: jnp.full((1, 1), p, jnp.int32)
    return jnp.sum(modules.rope(q, pos(m)) * modules.rope(k, pos(n)))

  np.testing.assert_allclose(dot(5, 2), dot(103, 100), rtol=1e-4)
  assert abs(float(dot(5, 2)) - float(dot(5, 4))) > 1e-4
  with pytest.raises(ValueError, match="even"):
    modules.rope(jnp.ones((1, 2, 1, 3)), jnp.zeros((1, 2), jnp.int32))
