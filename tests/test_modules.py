"""Tests of the Flax modules: `MultiHeadAttention`, `make_attention_fn`."""

import functools
import inspect

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_fa import chunked
from pallas_fa import flash_attention
from pallas_fa import flex
from pallas_fa import kv_cache
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


def _np_attention(q, k, v, bias=None, mask=None, sinks=None):
  """float64 numpy attention, [..., T, N, H] x [..., S, K, H]; GQA repeats;
  sinks [N]: a logit column, dropped after the softmax."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  g = q.shape[-2] // k.shape[-2]
  k, v = np.repeat(k, g, axis=-2), np.repeat(v, g, axis=-2)
  s = np.einsum("...tnh,...snh->...nts", q, k) / np.sqrt(q.shape[-1])
  if bias is not None:
    s = s + np.asarray(bias)
  if mask is not None:
    s = np.where(mask, s, -np.inf)
  if sinks is not None:
    column = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None],
                             s.shape[:-1] + (1,))
    s = np.concatenate([s, column], axis=-1)
  p = np.exp(s - s.max(axis=-1, keepdims=True))
  p /= p.sum(axis=-1, keepdims=True)
  if sinks is not None:
    p = p[..., :-1]
  return np.einsum("...nts,...snh->...tnh", p, v)


def _np_rope(x, positions):
  x = np.asarray(x, np.float64)
  half = x.shape[-1] // 2
  freq = 10_000.0 ** (-np.arange(half) / half)
  angle = np.asarray(positions)[..., None, None] * freq  # [B, T, 1, H/2]
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                         x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)


def _np_mha(layer, x):
  """The causal RoPE self-attention layer in float64 numpy (no biases)."""
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  proj = lambda p: np.einsum("btd,dnh->btnh", x, np.asarray(p.kernel[...]))
  pos = np.broadcast_to(np.arange(t), (b, t))
  causal = np.tril(np.ones((t, t), bool))
  sinks = None if layer.sinks is None else layer.sinks[...]
  o = _np_attention(_np_rope(proj(layer.query), pos),
                    _np_rope(proj(layer.key), pos), proj(layer.value),
                    mask=causal, sinks=sinks)
  return np.einsum("btnh,nhd->btd", o, np.asarray(layer.out.kernel[...]))


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
  np.testing.assert_allclose(v_ours, v_ref, **_TOL)
  chex.assert_trees_all_close(g_ours, g_ref, **_TOL)


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


def test_dropout_rate_is_ignored_outside_training():
  """With deterministic=True the module's dropout rate changes nothing
  (training with dropout is covered in test_dropout.py)."""
  d = 16
  x = _normal((2, 5, d))

  def module(rate):
    return nnx.MultiHeadAttention(
        num_heads=2, in_features=d, dropout_rate=rate, decode=False,
        attention_fn=_attention_fn("chunked"), rngs=nnx.Rngs(0))

  with_rate = module(0.3)(x, deterministic=True)
  np.testing.assert_array_equal(with_rate, module(0.0)(x, deterministic=True))
  assert not np.allclose(with_rate, module(0.3)(x, deterministic=False))


def test_sow_weights_raises():
  d = 16
  module = nnx.MultiHeadAttention(
      num_heads=2, in_features=d, decode=False,
      attention_fn=modules.make_attention_fn(), rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="sow_weights"):
    module(_normal((1, 4, d)), sow_weights=True)


@pytest.mark.parametrize("flax_fn", [
    nnx.dot_product_attention, nn.dot_product_attention], ids=["nnx", "linen"])
def test_attention_fn_accepts_every_flax_keyword(flax_fn):
  ours = inspect.signature(modules.make_attention_fn()).parameters
  theirs = inspect.signature(flax_fn).parameters
  assert set(theirs) <= set(ours), set(theirs) - set(ours)
  for name, param in theirs.items():
    if param.default is not inspect.Parameter.empty and name != "promote_dtype":
      assert ours[name].default == param.default, name


@pytest.mark.parametrize("name", [
    "einsum_dot_general", "qk_attn_weights_einsum",
    "attn_weights_value_einsum"])
def test_attention_fn_refuses_custom_einsums(name):
  x = _normal((1, 4, 2, 8))
  fn = modules.make_attention_fn()
  with pytest.raises(NotImplementedError, match=name):
    fn(x, x, x, **{name: jnp.einsum})
  # The default value is accepted.
  out = fn(x, x, x, **{name: None})
  np.testing.assert_allclose(out, _np_attention(x, x, x), **_TOL)


def test_attention_fn_extra_batch_dims_and_bias():
  q = _normal((2, 3, 9, 4, 8))
  k = _normal((2, 3, 13, 2, 8))
  v = _normal((2, 3, 13, 2, 8))
  # Batch dims broadcast in bias and mask; mask is Flax-style float.
  bias = _normal((3, 1, 9, 13))
  mask = _RNG.random((2, 1, 4, 9, 13)) < 0.7
  mask[..., 0] = True
  got = jax.jit(_attention_fn("xla"))(q, k, v, bias, mask.astype(np.float32))
  want = _np_attention(q, k, v, bias=bias, mask=mask)
  np.testing.assert_allclose(got, want, **_TOL)


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
  chex.assert_trees_all_close(g_ours, g_ref, **_TOL)


# --------------------------------------------------------------------------
# pallas_fa.modules.MultiHeadAttention.


def _mha(seed=0, **kw):
  kw = dict(num_heads=4, in_features=32, num_kv_heads=2, is_causal=True,
            rope=modules.Rope(), implementation="xla") | kw
  return modules.MultiHeadAttention(rngs=nnx.Rngs(seed), **kw)


def test_mha_shapes_and_cross_attention():
  layer = _mha(out_features=24, head_dim=6, is_causal=False,
               in_kv_features=10, rope=None)
  y = nnx.eval_shape(lambda m, x, z: m(x, z), layer,
                     _normal((3, 5, 32)), _normal((3, 9, 10)))
  assert y.shape == (3, 5, 24)
  assert layer.query.kernel.shape == (32, 4, 6)
  assert layer.key.kernel.shape == (10, 2, 6)
  assert layer.out.kernel.shape == (4, 6, 24)
  with pytest.raises(ValueError, match="num_kv_heads"):
    _mha(num_kv_heads=3)


def test_mha_matches_numpy_reference():
  """q/k/v projections + RoPE + causal GQA attention, computed by hand."""
  x = _normal((2, 19, 32))
  layer = _mha(seed=_seed())
  np.testing.assert_allclose(
      nnx.jit(lambda m, x: m(x))(layer, x), _np_mha(layer, x), **_TOL)


@pytest.mark.slow
def test_mha_sinks_are_a_zero_initialised_param_per_head():
  """use_sinks=True learns `sinks` [num_heads] (zeros at first), used by
  the full forward and by decoding through `decode_attention`, and given
  a gradient; without it the layer has no such parameter."""
  assert _mha().sinks is None
  assert "sinks" not in nnx.state(_mha(), nnx.Param)
  layer = _mha(seed=_seed(), use_sinks=True, implementation="chunked")
  assert isinstance(layer.sinks, nnx.Param)
  np.testing.assert_array_equal(layer.sinks[...], np.zeros(4, np.float32))
  layer.sinks[...] = _normal((4,)) + 1.0
  b, t, prefill = 2, 9, 4
  x = _normal((b, t, 32))
  want = _np_mha(layer, x)
  np.testing.assert_allclose(
      nnx.jit(lambda m, x: m(x))(layer, x), want, **_TOL)
  layer.init_cache(b, t)
  step = nnx.jit(lambda m, x: m(x, decode=True))
  steps = [step(layer, x[:, :prefill])]
  steps += [step(layer, x[:, i:i + 1]) for i in range(prefill, t)]
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), want, **_TOL)
  grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(layer)
  assert grads["sinks"][...].shape == (4,)
  assert np.all(np.abs(np.asarray(grads["sinks"][...])) > 0)


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


# Tiles given: every call through flash_attention; none: the one-token
# steps through decode_attention.
@pytest.mark.parametrize("tiles", [_TILES, None])
def test_mha_decode_equals_full_forward(tiles):
  b, t, prefill = 2, 21, 6
  x = _normal((b, t, 32))
  layer = _mha(seed=_seed(), implementation="chunked", block_sizes=tiles)
  layer.init_cache(b, t + 3)
  # Compiled once for the prefill shape and once for the 1-token steps.
  step = nnx.jit(lambda m, x: m(x, decode=True))
  steps = [step(layer, x[:, :prefill])]
  steps += [step(layer, x[:, i:i + 1]) for i in range(prefill, t)]
  # The full forward of this layer is checked against the same reference.
  np.testing.assert_allclose(
      jnp.concatenate(steps, axis=1), _np_mha(layer, x), **_TOL)
  np.testing.assert_array_equal(layer.cache_index[...], [t] * b)
  with pytest.raises(ValueError, match="overflow"):
    layer(x[:, :4], decode=True)
  with pytest.raises(ValueError, match="decode"):
    layer(x[:, :1], decode=True, positions=jnp.zeros((b, 1), jnp.int32))


def test_mha_decode_past_the_cache_under_jit_gives_nan_rows():
  """Under jit the cache index is traced, so the eager overflow error cannot
  fire: a row whose call no longer fits (cached + T > entries) comes out
  NaN, as does every later call of that row, while a row that fits stays
  exact."""
  layer = _mha(seed=_seed(), implementation="chunked")
  layer.init_cache(2, 6)
  step = nnx.jit(lambda m, x, n: m(x, decode=True, decode_lengths=n))
  calls = [(_normal((2, 4, 32)), [2, 4]), (_normal((2, 1, 32)), [1, 1]),
           (_normal((2, 2, 32)), [2, 2]), (_normal((2, 1, 32)), [1, 1])]
  outs = [step(layer, x, jnp.array(n)) for x, n in calls]
  # Row 0 holds 2, 3, 5, 6 of its 6 entries: exact throughout.
  row0 = jnp.concatenate([x[:1, :n[0]] for x, n in calls], axis=1)
  want = _np_mha(layer, row0)[0]
  got = jnp.concatenate([o[0, :n[0]] for o, (_, n) in zip(outs, calls)])
  np.testing.assert_allclose(got, want, **_TOL)
  # Row 1 holds 4, 5, then 5 + 2 > 6: NaN from the third call on.
  assert np.isfinite(np.asarray(outs[1][1])).all()
  assert np.isnan(np.asarray(outs[2][1])).all()
  assert np.isnan(np.asarray(outs[3][1])).all()


# A 7-token prompt (rows of 7, 3 and 5 real tokens) into pages of 4 under a
# shuffled block table with spare pages: pages straddle the prompt's end and
# the steps cross page boundaries. Tiles given: every call gathers the pages
# for flash_attention; none: every call reads them in decode_attention.
@pytest.mark.parametrize("tiles", [_TILES, None])
def test_mha_paged_decode_equals_contiguous_and_full_forward(tiles):
  b, p, new, page_size = 3, 7, 5, 4
  lengths = np.array([7, 3, 5])
  x = _normal((b, p + new, 32))
  paged = _mha(seed=_seed(), implementation="chunked", block_sizes=tiles)
  contiguous = nnx.clone(paged)
  max_pages = -(-(p + new) // page_size)
  num_pages = b * max_pages + 2
  table = _RNG.permutation(num_pages)[:b * max_pages].reshape(b, max_pages)
  paged.init_cache(b, p + new, page_size=page_size, num_pages=num_pages,
                   block_table=jnp.asarray(table))
  contiguous.init_cache(b, p + new)
  assert paged.cached_key.shape == (num_pages, page_size, 2, 8)
  for layer in (paged, contiguous):  # Unwritten entries must never leak.
    for cache in (layer.cached_key, layer.cached_value):
      cache[...] = jnp.full(cache.shape, jnp.nan)

  step = nnx.jit(lambda m, x, n: m(x, decode=True, decode_lengths=n))
  x_np = np.asarray(x)

  def decode(layer):
    """Each row's outputs: its real prompt tokens, then `new` steps."""
    prefill = step(layer, x[:, :p], jnp.asarray(lengths))
    steps = [step(layer, x_np[np.arange(b), lengths + j][:, None],
                  jnp.ones((b,), jnp.int32)) for j in range(new)]
    steps = np.concatenate(steps, axis=1)
    return [np.concatenate([prefill[row, :n], steps[row]])
            for row, n in enumerate(lengths)]

  got, want = decode(paged), decode(contiguous)
  for row, n in enumerate(lengths):
    reference = _np_mha(paged, x[row:row + 1, :n + new])[0]
    np.testing.assert_allclose(got[row], reference, **_TOL)
    np.testing.assert_allclose(got[row], want[row], **_TOL)
  np.testing.assert_array_equal(paged.cache_index[...], lengths + new)
  # Row b's entry i sits in page table[b, i // page_size] at i % page_size;
  # the spare pages were never written.
  pages = np.asarray(paged.cached_key[...])
  rows = pages[table].reshape(b, max_pages * page_size, 2, 8)
  dense = np.asarray(contiguous.cached_key[...])
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(rows[row, :n + new], dense[row, :n + new])
  spare = np.setdiff1d(np.arange(num_pages), table)
  assert np.isnan(pages[spare]).all()
  with pytest.raises(ValueError, match="overflow"):
    paged(x[:, :2], decode=True)


@pytest.mark.parametrize("dtype, page_size", [
    (jnp.int8, None), (jnp.int8, 4), (jnp.float8_e4m3fn, None)])
def test_mha_quantized_cache(dtype, page_size):
  """A quantized cache stores `kv_cache.quantize` of what a float cache
  stores (values and scales, exactly), and its prefill and one-token steps
  (the latter through decode_attention, reading the narrow cache) stay
  within the quantization error of the float forward."""
  b, t, prefill = 2, 11, 5
  x = _normal((b, t, 32))
  quantized = _mha(seed=_seed(), implementation="chunked")
  floating = nnx.clone(quantized)
  quantized.init_cache(b, t, dtype, page_size=page_size)
  floating.init_cache(b, t, page_size=page_size)
  assert quantized.cached_key.dtype == dtype
  step = nnx.jit(lambda m, x: m(x, decode=True))

  def decode(layer):
    steps = [step(layer, x[:, :prefill])]
    steps += [step(layer, x[:, i:i + 1]) for i in range(prefill, t)]
    return np.concatenate(steps, axis=1)

  got, want = decode(quantized), decode(floating)
  for name in ("key", "value"):
    values, scale = kv_cache.quantize(
        getattr(floating, f"cached_{name}")[...], dtype)
    np.testing.assert_array_equal(
        np.asarray(getattr(quantized, f"cached_{name}")[...], np.float32),
        np.asarray(values, np.float32))
    np.testing.assert_array_equal(
        getattr(quantized, f"cached_{name}_scale")[...], scale)
  reference = _np_mha(floating, x)
  np.testing.assert_allclose(want, reference, **_TOL)
  err = np.abs(got - reference).max()
  # int8 rounds each element by at most half a step (absmax / 254); float8
  # e4m3 keeps 3 mantissa bits.
  bound = (0.02 if dtype == jnp.int8 else 0.1) * np.abs(reference).max()
  assert 0 < err < bound, (err, bound)


def test_mha_bfloat16_under_strict_promotion(strict_promotion):
  """bfloat16 computation with float32 parameters, prefilling a paged
  cache (projections, RoPE, the cache write, decode_attention), under
  strict dtype promotion: the numbers of the default promotion. (The
  forward's flash_attention runs strict in the conformance suite.)"""
  del strict_promotion  # Active for the whole test, except where reset.
  b, t = 2, 7
  x = _normal((b, t, 32)).astype(jnp.bfloat16)

  def run():
    layer = _mha(seed=1, implementation=None, dtype=jnp.bfloat16)
    layer.init_cache(b, t, page_size=4)
    return nnx.jit(lambda m, x: m(x, decode=True))(layer, x[:, :4])

  strict = run()
  with jax.numpy_dtype_promotion("standard"):
    standard = run()
  chex.assert_type(strict, jnp.bfloat16)
  chex.assert_trees_all_equal(strict, standard)


def test_mha_paged_cache_default_table_and_validation():
  layer = _mha()
  layer.init_cache(2, 10, page_size=4)
  assert layer.cached_value.shape == (6, 4, 2, 8)
  np.testing.assert_array_equal(layer.block_table[...],
                                [[0, 2, 4], [1, 3, 5]])
  layer.init_cache(2, 10)
  assert layer.block_table is None
  assert layer.cached_key.shape == (2, 10, 2, 8)
  table = lambda *rows: jnp.asarray(rows, jnp.int32)
  for kwargs, name in ((dict(page_size=2.5), "page_size"),
                       (dict(page_size=4, num_pages=6.0), "num_pages")):
    with pytest.raises(TypeError, match=f"{name} must be an int"):
      layer.init_cache(2, 10, **kwargs)
  bad = [
      (dict(page_size=0), "page_size"),
      (dict(num_pages=6), "num_pages"),
      (dict(block_table=table([0, 1, 2], [3, 4, 5])), "block_table"),
      (dict(page_size=4, num_pages=5), "num_pages"),
      (dict(page_size=4, block_table=table([0, 1], [2, 3])), "block_table"),
      (dict(page_size=4, block_table=jnp.zeros((2, 3))), "block_table"),
      (dict(page_size=4, block_table=table([0, 1, 2], [3, 4, 6])),
       "block_table"),
      (dict(page_size=4, num_pages=9, block_table=table([0, 1, 2],
                                                        [3, 4, -1])),
       "block_table"),
      (dict(page_size=4, block_table=table([0, 1, 2], [2, 3, 4])),
       "block_table"),
  ]
  for kwargs, name in bad:
    with pytest.raises(ValueError, match=name):
      layer.init_cache(2, 10, **kwargs)


def test_mha_cache_arguments_are_checked():
  layer = _mha()
  for dtype in (jnp.int32, jnp.uint8, jnp.bool_):
    with pytest.raises(TypeError, match="dtype"):
      layer.init_cache(2, 10, dtype)
  for b, length, name in ((0, 10, "batch_size"), (2, 0, "max_length")):
    with pytest.raises(ValueError, match=name):
      layer.init_cache(b, length)
  with pytest.raises(TypeError, match="batch_size must be an int"):
    layer.init_cache(2.0, 10)
  # decode_lengths count real tokens of the call: in [0, T].
  layer.init_cache(2, 16)
  x = _normal((2, 4, 32))
  for lengths in ([5, 4], [-1, 4]):
    with pytest.raises(ValueError, match="decode_lengths"):
      layer(x, decode=True, decode_lengths=jnp.asarray(lengths))
  np.testing.assert_array_equal(layer.cache_index[...], [0, 0])
  layer(x, decode=True, decode_lengths=jnp.asarray([4, 0]))
  np.testing.assert_array_equal(layer.cache_index[...], [4, 0])


@pytest.mark.parametrize("flex_args", [
    dict(local_window_size=(4, 0)),
    dict(score_mod=flex.alibi, score_mod_args=(flex.alibi_slopes(4),)),
])
def test_flax_decode_mode_declines_positional_attention(flex_args):
  """Flax's decode mode passes one query against the whole cache and no
  query position: a window or score_mod would measure the query from 0,
  so make_attention_fn declines (with equal lengths it runs)."""
  b, t, d = 2, 6, 32
  x = _normal((b, t, d))
  module = nnx.MultiHeadAttention(
      num_heads=4, in_features=d, decode=False, rngs=nnx.Rngs(_seed()),
      attention_fn=modules.make_attention_fn(implementation="xla",
                                             **flex_args))
  full = module(x, mask=nnx.make_causal_mask(jnp.ones((b, t))))
  assert np.isfinite(np.asarray(full)).all()
  module.init_cache((b, t, d))
  with pytest.raises(NotImplementedError, match="decode mode"):
    module(x[:, :1], decode=True)


@pytest.mark.parametrize("change, error, match", [
    (dict(head_dim=0), ValueError, "head_dim must be a positive int"),
    (dict(num_heads=0), ValueError, "num_heads must be a positive int"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    (dict(in_features=0), ValueError, "in_features"),
    (dict(out_features=-1), ValueError, "out_features"),
    (dict(num_heads=4.0), TypeError, "num_heads must be an int"),
    (dict(num_heads="4"), TypeError, "num_heads must be an int"),
    (dict(in_features=32.0), TypeError, "in_features"),
    (dict(head_dim=8.0), TypeError, "head_dim"),
    (dict(num_kv_heads=True), TypeError, "num_kv_heads"),
    (dict(in_kv_features="10"), TypeError, "in_kv_features"),
    (dict(out_features=np.float32(24)), TypeError, "out_features"),
    (dict(dropout_rate="0.1"), TypeError, "dropout_rate must be a float"),
    (dict(dropout_rate=1.0), ValueError, r"dropout_rate must be in \[0, 1\)"),
    (dict(dropout_rate=-0.1), ValueError, "dropout_rate"),
    (dict(deterministic="no"), TypeError, "deterministic must be a bool"),
    (dict(use_sinks=1), TypeError, "use_sinks must be a bool"),
    (dict(use_bias="yes"), TypeError, "use_bias must be a bool"),
    (dict(rope=3), TypeError, "rope must be callable or None"),
    (dict(attention_fn=False), TypeError,
     "attention_fn must be callable or None"),
    (dict(dtype=jnp.int32), TypeError,
     "dtype must be None or a floating-point dtype"),
    (dict(dtype="bogus"), TypeError, "dtype must be None or a floating"),
    (dict(param_dtype=jnp.int32), TypeError,
     "param_dtype must be None or a floating"),
])
def test_mha_constructor_arguments_are_checked(change, error, match):
  with pytest.raises(error, match=match):
    _mha(**change)


@pytest.mark.parametrize("rope", [None, modules.Rope()])
@pytest.mark.parametrize("shape", [(5, 32), (1, 2, 5, 32)])
def test_mha_inputs_are_batch_length_features(rope, shape):
  """Positions, segment ids and RoPE read [B, T]: another rank is named,
  with or without RoPE (which would fail unpacking the shape)."""
  layer = _mha(rope=rope)
  with pytest.raises(ValueError, match=r"inputs_q must be \[B, T, in_features"):
    layer(_normal(shape))


def test_attention_fn_checks_is_causal():
  """Flax passes is_causal through; a truthy string is not causal."""
  q = _normal((2, 6, 4, 8))
  fn = modules.make_attention_fn(implementation="xla")
  with pytest.raises(TypeError, match="is_causal must be a bool"):
    fn(q, q, q, is_causal="no")
  np.testing.assert_array_equal(
      fn(q, q, q, is_causal=np.bool_(True)),
      flash_attention(q, q, q, is_causal=True, implementation="xla"))


def test_mha_sizes_may_be_numpy_ints():
  layer = _mha(num_heads=np.int64(4), in_features=np.int32(32),
               head_dim=np.int64(6), out_features=np.int32(24))
  assert layer.query.kernel.shape == (32, 4, 6)
  assert type(layer.head_dim) is int
  y = nnx.eval_shape(lambda m, x: m(x), layer, _normal((2, 5, 32)))
  assert y.shape == (2, 5, 24)


def test_mha_dropout_stream_is_asked_for_where_it_is_needed():
  """Flax's nnx.MultiHeadAttention fails at construction (an AttributeError
  from Rngs) when rngs has no "dropout" stream; this layer builds, runs
  deterministic calls and calls given rngs=, and a call that drops without
  a stream names the missing stream and `rngs`."""
  with pytest.raises(AttributeError, match="dropout"):
    nnx.MultiHeadAttention(4, 32, dropout_rate=0.1, decode=False,
                           rngs=nnx.Rngs(params=0))
  layer = modules.MultiHeadAttention(
      4, 32, num_kv_heads=2, dropout_rate=0.5, implementation="xla",
      rngs=nnx.Rngs(params=_seed()))
  x = _normal((2, 6, 32))
  plain = layer(x, deterministic=True)
  dropped = layer(x, rngs=nnx.Rngs(dropout=_seed()))
  assert np.isfinite(np.asarray(dropped)).all()
  assert not np.allclose(dropped, plain)
  for kwargs, whose in ((dict(), "the layer's rngs"),
                        (dict(rngs=nnx.Rngs(params=1)), "the call's rngs")):
    with pytest.raises(ValueError, match=f"'dropout' RngStream.*{whose}"):
      layer(x, **kwargs)
  with pytest.raises(TypeError, match="deterministic must be a bool"):
    layer(x, deterministic="yes")


def test_mha_dropout_rate_leaves_the_initial_parameters_alone():
  """As in Flax's layer: the dropout stream is forked after the projections
  draw, so turning dropout on keeps a seed's parameters (only a default
  stream here, which the fork would otherwise advance)."""
  seed = _seed()
  params = [nnx.state(modules.MultiHeadAttention(
      4, 32, num_kv_heads=2, dropout_rate=rate, rngs=nnx.Rngs(seed)),
      nnx.Param) for rate in (0.0, 0.1)]
  leaves = [jax.tree.leaves(p) for p in params]
  assert len(leaves[0]) == len(leaves[1]) == 4
  for a, b in zip(*leaves):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", ["inputs_q", "inputs_kv", "self", "decode"])
def test_mha_inputs_of_the_wrong_feature_size_are_named(case):
  layer = _mha(in_kv_features=10 if case == "self" else None)
  x, z = _normal((2, 8, 32)), _normal((2, 5, 32))
  if case == "inputs_q":
    call, match = lambda: layer(x[..., :31], z), r"inputs_q must be .*=32\]"
  elif case == "inputs_kv":
    call, match = lambda: layer(x, z[..., :31]), r"inputs_kv.*=32\].*31\)"
  elif case == "self":
    call, match = lambda: layer(x), "in_kv_features=10.*pass inputs_kv"
  else:
    layer.init_cache(2, 16)
    call, match = lambda: layer(x[..., :15], decode=True), r"inputs_q.*15\)"
  with pytest.raises(ValueError, match=match):
    call()


def test_mha_decode_lengths_and_cache_dtype_are_named():
  layer = _mha()
  layer.init_cache(2, 16)
  x = _normal((2, 2, 32))
  with pytest.raises(ValueError,
                     match="decode_lengths.shape=.*decode_lengths.dtype="
                     "float32"):
    layer(x, decode=True, decode_lengths=jnp.array([1.0, 2.0]))
  for dtype in ("fp8", "float9", object()):
    with pytest.raises(TypeError, match="init_cache's dtype must be"):
      layer.init_cache(2, 16, dtype)
  layer.init_cache(2, 16, "float8_e4m3fn")  # A dtype's name is a dtype.
  assert layer.cached_key.dtype == jnp.float8_e4m3fn


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


# --------------------------------------------------------------------------
# Flex attention in the layer: score_mod (learned or constant arrays) and
# mask_mod (per-call arrays).


def _alibi_layer(slopes, **kw):
  kw = dict(rope=None, score_mod=flex.alibi, score_mod_args=(slopes,),
            mask_mod=flex.document, implementation="chunked",
            block_sizes=_TILES) | kw
  return _mha(seed=_seed(), **kw)


def _documents(b, t):
  """int32 [B, t] ids of packed documents, fresh: a new one starts at each
  position with probability 1/4."""
  return jnp.asarray(np.cumsum(_RNG.random((b, t)) < 0.25, axis=1), jnp.int32)


def _dense_alibi_layer(layer, slopes, x, documents):
  """The causal ALiBi + document-masked layer with
  `jax.nn.dot_product_attention` and the dense bias -slopes[n] |i - j|."""
  t = x.shape[1]
  distance = jnp.abs(jnp.arange(t)[:, None] - jnp.arange(t)[None, :])
  bias = -slopes[:, None, None] * distance[None]  # [N, T, T]
  mask = (documents[:, None, :, None] == documents[:, None, None, :]) & (
      jnp.tril(jnp.ones((1, 1, t, t), bool)))
  o = jax.nn.dot_product_attention(
      layer.query(x), layer.key(x), layer.value(x), bias=bias[None],
      mask=mask)
  return layer.out(o)


def test_mha_alibi_score_mod_with_document_mask_matches_dense():
  """A learned nnx.Param of slopes (fresh values) and per-call document
  ids: the forward and the slopes' gradient are the dense computation's."""
  b, t = 2, 19
  x, documents = _normal((b, t, 32)), _documents(b, t)
  slopes = jnp.asarray(_RNG.uniform(0.05, 1.0, 4), jnp.float32)
  layer = _alibi_layer(nnx.Param(slopes))
  loss = lambda y: jnp.sum(jnp.sin(y))

  @nnx.jit
  def run(layer, x, documents):
    ours = lambda m: loss(m(x, mask_mod_args=(documents,)))
    dense = lambda s: loss(_dense_alibi_layer(layer, s, x, documents))
    return (layer(x, mask_mod_args=(documents,)), nnx.grad(ours)(layer),
            _dense_alibi_layer(layer, slopes, x, documents),
            jax.grad(dense)(slopes))

  y, grads, want_y, want_grad = run(layer, x, documents)
  np.testing.assert_allclose(y, want_y, **_TOL)
  np.testing.assert_allclose(grads["score_mod_args"][0][...], want_grad,
                             **_TOL)
  assert np.all(np.abs(np.asarray(want_grad)) > 0)


def test_mha_score_mod_args_are_learned_params_or_constants():
  """Plain arrays become `Constant`s: module state (split and merged with
  the layer) that is neither an nnx.Param nor given a gradient."""
  slopes = flex.alibi_slopes(4)
  layer = _alibi_layer(slopes)
  (constant,) = layer.score_mod_args
  assert isinstance(constant, modules.Constant)
  np.testing.assert_array_equal(constant[...], slopes)
  assert "score_mod_args" not in nnx.state(layer, nnx.Param)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  again = nnx.merge(graphdef, params, rest)
  np.testing.assert_array_equal(again.score_mod_args[0][...], slopes)
  assert isinstance(_alibi_layer(nnx.Param(slopes)).score_mod_args[0],
                    nnx.Param)


# A 3-token prefill through decode_attention, 17 tokens through
# flash_attention (whose q_idx counts from 0: the layer shifts it to the
# cache index), then single tokens: all equal the full forward.
def test_mha_flex_decode_equals_full_forward():
  b, t, cut = 2, 22, (3, 20)
  x, documents = _normal((b, t, 32)), _documents(b, t + 2)
  layer = _alibi_layer(flex.alibi_slopes(4), block_sizes=None)
  step = nnx.jit(lambda m, x, d: m(x, decode=True, mask_mod_args=(d,)))
  want = nnx.jit(lambda m, x, d: m(x, mask_mod_args=(d,)))(
      layer, x, documents[:, :t])
  layer.init_cache(b, t + 2)
  steps = [step(layer, x[:, :cut[0]], documents),
           step(layer, x[:, cut[0]:cut[1]], documents)]
  steps += [step(layer, x[:, i:i + 1], documents) for i in range(cut[1], t)]
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), want, **_TOL)


def test_nnx_attention_fn_with_flex_equals_direct_call():
  """Flax's MultiHeadAttention with make_attention_fn(score_mod=...,
  mask_mod=...) is flash_attention with them on its projections."""
  b, t, d = 2, 13, 32
  x, documents = _normal((b, t, d)), _documents(b, t)
  flex_args = dict(score_mod=flex.alibi,
                   score_mod_args=(flex.alibi_slopes(4),),
                   mask_mod=flex.document, mask_mod_args=(documents,))
  module = nnx.MultiHeadAttention(
      num_heads=4, in_features=d, decode=False, rngs=nnx.Rngs(_seed()),
      attention_fn=modules.make_attention_fn(implementation="xla",
                                             **flex_args))

  @nnx.jit
  def run(module, x):
    direct = flash_attention(
        module.query(x), module.key(x), module.value(x), is_causal=True,
        implementation="xla", **flex_args)
    return module(x, is_causal=True), module.out(direct)

  got, want = run(module, x)
  np.testing.assert_allclose(got, want, **_TOL)


def test_flex_argument_errors():
  slopes = flex.alibi_slopes(4)
  with pytest.raises(ValueError, match="score_mod_args"):
    _mha(score_mod_args=(slopes,))
  with pytest.raises(TypeError, match="score_mod_args"):
    _mha(score_mod=flex.alibi, score_mod_args=slopes)
  with pytest.raises(TypeError, match="score_mod"):
    _mha(score_mod=flex.alibi)  # Its slopes missing: the wrong arity.
  with pytest.raises(TypeError, match="mask_mod"):
    _mha(mask_mod="document")
  x = jnp.ones((1, 3, 32))
  with pytest.raises(ValueError, match="mask_mod_args"):
    _mha()(x, mask_mod_args=(jnp.zeros((1, 3), jnp.int32),))
  with pytest.raises(ValueError, match="block_mask"):
    _mha()(x, block_mask=object())
  with pytest.raises(TypeError, match="mask_mod_args"):
    _mha(mask_mod=flex.document)(x, mask_mod_args=jnp.zeros((1, 3)))
  layer = _mha(mask_mod=flex.document)
  layer.init_cache(1, 4)
  with pytest.raises(ValueError, match="block_mask"):
    layer(x, decode=True, block_mask=object())
  with pytest.raises(ValueError, match="mask_mod_args"):
    modules.make_attention_fn(mask_mod_args=(jnp.zeros(3),))
  with pytest.raises(TypeError, match="score_mod"):
    modules.make_attention_fn(score_mod=flex.alibi)
