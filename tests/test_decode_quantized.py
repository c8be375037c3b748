"""Quantized KV caches: `kv_cache.quantize`, `kv_cache.write` with scales,
and `decode_attention` over int8/float8 caches against a float64 oracle of
the dequantized cache."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from pallas_fa import flex
from pallas_fa import kv_cache
from pallas_fa import quantize
from pallas_fa import testing
from pallas_fa.decode import chunked
from tests import attention_testing
from tests.attention_testing import assert_close
from tests.attention_testing import rng

QUANTIZED = [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2]


def _oracle(q, k, v, lengths, q_pos):
  """The float64 oracle on the dequantized caches [B, S, K, H]."""
  return attention_testing.decode_reference(
      q, k, v, lengths, q_pos, q.shape[2] // k.shape[2])


def _dequantized(values, scale):
  scale = np.broadcast_to(np.asarray(scale, np.float64), values.shape[:-1])
  return np.asarray(values.astype(jnp.float32), np.float64) * scale[..., None]


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantize_round_trips_within_one_step(dtype):
  gen = rng("quantize", str(dtype))
  x = gen.standard_normal((3, 5, 2, 64)) * gen.uniform(0.1, 10, (3, 5, 2, 1))
  x[1, 2, 0] = 0.0  # an all-zero row
  values, scale = kv_cache.quantize(jnp.asarray(x, jnp.float32), dtype)
  assert values.dtype == dtype and values.shape == x.shape
  assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
  back = _dequantized(values, scale)
  absmax = np.abs(x).max(-1, keepdims=True)
  np.testing.assert_allclose(np.abs(back).max(-1, keepdims=True), absmax,
                             rtol=1e-6)  # the absmax is exact
  if dtype == jnp.int8:  # rounding to nearest: half a step of absmax / 127
    bound = absmax / 127 / 2 * (1 + 1e-5)
  else:  # float8: half an ulp, relative to the element, or its subnormals
    mantissa = 3 if dtype == jnp.float8_e4m3fn else 2
    bound = np.abs(x) * 2.0 ** -(mantissa + 1) + absmax * 2.0 ** -9
  assert np.all(np.abs(back - x) <= bound)
  assert np.all(back[1, 2, 0] == 0) and scale[1, 2, 0] == 1.0


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantize_keeps_nan_and_inf_visible(dtype):
  # A slice holding NaN or inf dequantizes to NaN (int8 cannot hold NaN:
  # its scale carries it); the other slices are untouched.
  x = jnp.asarray([[1.0, np.nan], [2.0, -np.inf], [0.5, -0.25]])
  values, scale = kv_cache.quantize(x, dtype)
  with np.errstate(invalid="ignore"):  # 0 * inf, as dequantizing does.
    back = np.asarray(values.astype(jnp.float32)) * np.asarray(
        scale)[:, None]
  assert np.isnan(back[:2]).all()
  np.testing.assert_allclose(back[2], [0.5, -0.25], rtol=2 ** -3)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_widens_exactly_from_its_bits(dtype):
  """`quantize.float8_bits_as_float32` (a CPU's float8 cache, sliced as its
  bits: XLA:CPU's own conversion runs an element at a time) gives every
  one of the 256 bit patterns the value ml_dtypes gives it, sign of zero
  and NaN included, eagerly, jitted, and on a strided view."""
  pattern = np.arange(256, dtype=np.uint8)
  want = pattern.view(jnp.dtype(dtype)).astype(np.float32)

  def check(got, want=want):
    got = np.asarray(got, np.float32)
    np.testing.assert_array_equal(got, want)  # NaN where NaN
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))

  bits = jnp.asarray(pattern)
  check(quantize.float8_bits_as_float32(bits, dtype))
  check(jax.jit(quantize.float8_bits_as_float32, static_argnums=1)(
      bits, dtype))
  check(quantize.float8_bits_as_float32(bits.reshape(4, 8, 8)[:, 1:], dtype),
        want.reshape(4, 8, 8)[:, 1:])


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantize_keeps_tiny_slices_finite(dtype):
  """A slice whose largest magnitude is normal but under about 5e-36 has a
  scale below float32's smallest normal, which XLA:CPU flushes to 0: its
  values came out inf (float8: NaN after dequantizing; int8: zeros). Its
  scale is now that smallest normal, and decoding over it matches the
  float cache."""
  gen = rng("quantize tiny", str(dtype))
  x = gen.standard_normal((1, 16, 1, 32)).astype(np.float32)
  x[0, 3] *= np.float32(1e-37)
  values, scale = kv_cache.quantize(jnp.asarray(x), dtype)
  back = _dequantized(values, scale)
  assert np.all(np.isfinite(back))
  # Within a step of the slice's largest magnitude, or of the tiny
  # slice's scale (float32's smallest normal).
  step = 2.0 ** -3 if dtype != jnp.int8 else 1 / 127
  absmax = np.abs(x).max(-1, keepdims=True)
  tiny = float(np.finfo(np.float32).tiny)
  assert np.all(np.abs(back - x) <= step * absmax + tiny)
  assert np.abs(back[0, 3]).max() > 0  # Not flushed to zeros.
  q = jnp.asarray(gen.standard_normal((1, 1, 2, 32)), jnp.float32)
  lengths = jnp.array([16])
  got = pallas_fa.decode_attention(q, values, values, lengths,
                                   key_scale=scale, value_scale=scale)
  dequantized = jnp.asarray(back, jnp.float32)
  want = pallas_fa.decode_attention(q, dequantized, dequantized, lengths)
  assert np.all(np.isfinite(np.asarray(got)))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_float16_unit_takes_a_slice_into_float16_exactly():
  """`quantize.float16_unit`: 2^e takes the largest magnitude into [2^14,
  2^15), 2^-e is its exact inverse, and a bfloat16 slice times 2^e is
  exact in float16 but for entries 2^28 below its largest; a zero or
  non-finite largest gives finite powers of two."""
  gen = rng("float16 unit")
  # (Below 2^-112 the power would pass float32's largest: it is clipped.)
  exponents = gen.integers(-112, 120, 64)
  largest = np.ldexp(gen.uniform(1.0, 2.0, 64), exponents).astype(np.float32)
  up, down = quantize.float16_unit(jnp.asarray(largest))
  up, down = np.asarray(up, np.float64), np.asarray(down, np.float64)
  scaled = largest * up
  assert np.all((scaled >= 2.0 ** 14) & (scaled < 2.0 ** 15))
  np.testing.assert_array_equal(up * down, np.ones(64))
  for x in (0.0, np.inf, np.nan):
    u, d = quantize.float16_unit(jnp.float32(x))
    assert np.isfinite(float(u)) and np.isfinite(float(d))
    assert float(u) > 0 and float(u) * float(d) == 1.0
  # A bfloat16 row, entries from its largest down to 2^-27 of it: exact.
  row = (gen.standard_normal(64) * np.exp2(-gen.uniform(0, 27, 64))
         * 2.0 ** 40)
  row = np.asarray(jnp.asarray(row, jnp.bfloat16).astype(jnp.float32))
  u, d = quantize.float16_unit(jnp.float32(np.abs(row).max()))
  half = jnp.asarray(row * float(u), jnp.float32).astype(jnp.float16)
  np.testing.assert_array_equal(
      np.asarray(half, np.float64) * float(d), row.astype(np.float64))


def test_quantize_rejects_bad_input():
  with pytest.raises(TypeError, match="dtype"):
    kv_cache.quantize(jnp.ones((2, 4)), jnp.int16)
  with pytest.raises(TypeError, match="float"):
    kv_cache.quantize(jnp.ones((2, 4), jnp.int32))
  with pytest.raises(TypeError, match="quantize takes an array x"):
    kv_cache.quantize(None)
  with pytest.raises(ValueError, match="rank >= 1"):
    kv_cache.quantize(3.0)


@pytest.mark.parametrize("paged", [False, True])
def test_write_quantizes_new_entries(paged):
  gen = rng("write quantized", paged)
  b, t, num_kv, h, page_size, max_pages = 2, 3, 2, 16, 4, 3
  new = jnp.asarray(gen.standard_normal((b, t, num_kv, h)), jnp.float32)
  index = jnp.asarray([1, 6], jnp.int32)
  if paged:
    table = jnp.asarray(gen.permutation(b * max_pages).reshape(b, max_pages),
                        jnp.int32)
    cache = jnp.zeros((b * max_pages, page_size, num_kv, h), jnp.int8)
    scales = jnp.ones((b * max_pages, page_size, num_kv), jnp.float32)
  else:
    table = None
    cache = jnp.zeros((b, max_pages * page_size, num_kv, h), jnp.int8)
    scales = jnp.ones((b, max_pages * page_size, num_kv), jnp.float32)
  cache, scales = kv_cache.write(cache, new, index, table, scale=scales)
  values, scale = kv_cache.quantize(new, jnp.int8)
  flat_v, flat_s = cache, scales
  if paged:
    flat_v, flat_s = kv_cache.gather(cache, table), kv_cache.gather(
        scales, table)
  for row in range(b):
    at = slice(int(index[row]), int(index[row]) + t)
    np.testing.assert_array_equal(flat_v[row, at], values[row])
    np.testing.assert_array_equal(flat_s[row, at], scale[row])
  with pytest.raises(ValueError, match="scale="):
    kv_cache.write(cache, new, index, table)
  # Entries already quantized are stored as they are.
  again = kv_cache.write(cache, values, index, table)
  np.testing.assert_array_equal(again, cache)


def _case(gen, *, b=3, t=2, n=4, num_kv=2, h=32, s_max=80, dtype=jnp.int8,
          page_size=None, scale_form="full"):
  """A random quantized cache with garbage past every length (values at
  their extremes, NaN scales), its dequantized contiguous view, and the
  decode arguments."""
  q = gen.standard_normal((b, t, n, h)).astype(np.float32)
  k = gen.standard_normal((b, s_max, num_kv, h)) * gen.uniform(
      0.2, 3, (b, s_max, num_kv, 1))
  v = gen.standard_normal((b, s_max, num_kv, h))
  lengths = gen.integers(t, s_max + 1, b).astype(np.int32)
  lengths[0] = s_max
  if scale_form == "full":
    k_vals, k_scale = kv_cache.quantize(jnp.asarray(k, jnp.float32), dtype)
    v_vals, v_scale = kv_cache.quantize(jnp.asarray(v, jnp.float32), dtype)
    k_scale, v_scale = np.array(k_scale), np.array(v_scale)
  else:  # one scale per K/V head, or one for the cache
    shape = (num_kv,) if scale_form == "head" else ()
    k_scale = gen.uniform(0.01, 0.05, shape).astype(np.float32)
    v_scale = gen.uniform(0.01, 0.05, shape).astype(np.float32)
    limit = 127 if dtype == jnp.int8 else 8
    k_vals = jnp.asarray(np.clip(np.round(k * 20), -limit, limit), dtype)
    v_vals = jnp.asarray(np.clip(np.round(v * 20), -limit, limit), dtype)
  k_vals, v_vals = np.array(k_vals), np.array(v_vals)
  k_deq, v_deq = _dequantized(k_vals, k_scale), _dequantized(v_vals, v_scale)
  past = np.arange(s_max)[None] >= lengths[:, None]
  extreme = np.array(127 if dtype == jnp.int8 else 448, np.float32).astype(
      k_vals.dtype)
  k_vals[past], v_vals[past] = extreme, extreme
  if scale_form == "full":
    k_scale[past], v_scale[past] = np.nan, np.nan
  args = dict(key=k_vals, value=v_vals, key_scale=k_scale,
              value_scale=v_scale, block_table=None)
  if page_size is not None:
    table = attention_testing.page_table(gen, b, -(-s_max // page_size))

    def pages(x, fill):
      return attention_testing.paged(x, table, page_size, fill)

    args.update(key=pages(k_vals, extreme), value=pages(v_vals, extreme),
                block_table=table)
    if scale_form == "full":
      args.update(key_scale=pages(k_scale, np.nan),
                  value_scale=pages(v_scale, np.nan))
  q_pos = lengths[:, None] - t + np.arange(t, dtype=np.int32)[None]
  return q, args, lengths, q_pos, k_deq, v_deq


# (page size, scale form, splits): contiguous and paged caches, scales per
# entry, per K/V head or one for the cache, one split and several.
LAYOUTS = [(None, "full", 1), (None, "head", 3), (16, "full", 2),
           (16, "scalar", 1)]


def kernel_matrix(layouts=LAYOUTS):
  """(dtype, page size, scale form, splits) for an interpreted kernel: int8
  over every layout and float8_e4m3fn over the first in the default run;
  the rest (the same kernel with another element conversion) in the slow
  leg."""
  for dtype in QUANTIZED:
    for i, layout in enumerate(layouts):
      cheap = dtype == jnp.int8 or (dtype == jnp.float8_e4m3fn and i == 0)
      yield pytest.param(dtype, *layout,
                         marks=() if cheap else pytest.mark.slow)


def check_quantized_decode(implementation, dtype, page_size, scale_form,
                           splits, *, h=32, block_kv=16):
  """`decode_attention` of `implementation` over a quantized cache (GQA,
  T_new = 2, ragged lengths, garbage past them) against the float64 oracle
  of the dequantized cache, out and lse."""
  gen = rng("quantized decode", implementation, str(dtype), page_size,
            scale_form, splits, h)
  q, args, lengths, q_pos, k_deq, v_deq = _case(
      gen, dtype=dtype, page_size=page_size, scale_form=scale_form, h=h)
  out, lse = pallas_fa.decode_attention(
      jnp.asarray(q), lengths=jnp.asarray(lengths), num_splits=splits,
      block_kv=None if page_size else block_kv, return_residual=True,
      implementation=implementation,
      **{name: None if x is None else jnp.asarray(x)
         for name, x in args.items()})
  ref_out, ref_lse = _oracle(q, k_deq, v_deq, lengths, q_pos)
  assert out.dtype == jnp.float32
  assert_close("out", out, ref_out)
  assert_close("lse", lse, ref_lse)


def broadcast_scales(gen, args, form):
  """Scales with broadcast dims in place of `args`' full ones (the
  quantized values are kept: any positive scale is a valid cache), the
  cache's leading axis being B (contiguous) or P (the pool's pages):
  "lead" one key scale per sequence / page and K/V head [B|P, 1, K], one
  value scale per cache position / page row [1, S_max|page_size, 1];
  "rows" the key scales [1, S_max|page_size, K] and the value scales
  [B|P, 1, 1]."""
  lead, rows, heads = args["key"].shape[:3]
  shapes = {"lead": ((lead, 1, heads), (1, rows, 1)),
            "rows": ((1, rows, heads), (lead, 1, 1))}[form]
  k_scale, v_scale = (gen.uniform(0.01, 0.05, s).astype(np.float32)
                      for s in shapes)
  if args["block_table"] is not None:
    # The pool's pages no sequence uses are never read.
    unused = np.setdiff1d(np.arange(lead), args["block_table"])
    for x in (k_scale, v_scale):
      if x.shape[0] == lead:
        x[unused] = np.nan
  return dict(args, key_scale=k_scale, value_scale=v_scale)


@pytest.mark.parametrize("scale_form", ["full", "page_rows"])
def test_chunked_reads_several_whole_pages_a_block(scale_form):
  """chunked gathers several pages a step (`decode.chunked.paged_block`; a
  page a step made the step's fixed cost the call's: 4x a contiguous
  cache's time at 16-key pages), a page count no multiple of them
  included, with per-entry scales or scales per page row ([1, page, K]:
  each of the block's pages its own copy): the contiguous cache's answer
  on the same entries."""
  page, pages, b, num_kv, h = 16, 37, 2, 2, 32
  s_max = page * pages
  assert chunked.paged_block(page, pages, b, num_kv, h, jnp.float32) > (
      2 * page)
  gen = rng("chunked pages a block", scale_form)
  q = jnp.asarray(gen.standard_normal((b, 2, 4, h)), jnp.float32)
  key, value = (jnp.asarray(gen.integers(-127, 128, (b, s_max, num_kv, h)),
                            jnp.int8) for _ in range(2))
  if scale_form == "full":
    scales = [gen.uniform(0.01, 0.05, (b, s_max, num_kv)) for _ in range(2)]
    paged_scales = [x.reshape(b * pages, page, num_kv) for x in scales]
  else:
    paged_scales = [gen.uniform(0.01, 0.05, (1, page, k))
                    for k in (num_kv, 1)]
    scales = [np.tile(x, (1, pages, 1)) for x in paged_scales]
  lengths = jnp.asarray([s_max, 300], jnp.int32)
  table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)

  def call(k, v, scales, **kw):
    return pallas_fa.decode_attention(
        q, k, v, lengths, key_scale=jnp.asarray(scales[0], jnp.float32),
        value_scale=jnp.asarray(scales[1], jnp.float32),
        implementation="chunked", return_residual=True, **kw)

  got = call(key.reshape(b * pages, page, num_kv, h),
             value.reshape(b * pages, page, num_kv, h), paged_scales,
             block_table=table)
  want = call(key, value, scales)
  for x, y in zip(got, want):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5,
                               atol=1e-5)


def check_quantized_decode_with_a_mask_mod(implementation, dtype, page_size,
                                           scales, *, block_kv, **shape):
  """`implementation` against `chunked` on the same quantized cache under
  StreamingLLM's window with sink tokens, whose blocks are hidden (never
  read), whole (scales applied unmasked) or partly shown; `scales` "full"
  (per entry, NaN past the lengths) or a `broadcast_scales` form."""
  gen = rng(f"{implementation} quantized mask_mod", str(dtype), page_size,
            scales)
  q, args, lengths, _, _, _ = _case(gen, dtype=dtype, page_size=page_size,
                                    **shape)
  if scales != "full":
    args = broadcast_scales(gen, args, scales)
  kw = dict(mask_mod=flex.sliding_window_with_sinks,
            mask_mod_args=(jnp.int32(40), jnp.int32(3)), num_splits=2,
            return_residual=True,
            **{name: None if x is None else jnp.asarray(x)
               for name, x in args.items()})
  q, lengths = jnp.asarray(q), jnp.asarray(lengths)
  out, lse = pallas_fa.decode_attention(
      q, lengths=lengths, implementation=implementation,
      block_kv=None if page_size else block_kv, **kw)
  want_out, want_lse = pallas_fa.decode_attention(
      q, lengths=lengths, implementation=None, **kw)
  assert_close("out", out, want_out)
  assert_close("lse", lse, want_lse)


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("page_size, scale_form, splits", LAYOUTS)
def test_quantized_decode_matches_the_dequantized_oracle(
    dtype, page_size, scale_form, splits):
  check_quantized_decode(None, dtype, page_size, scale_form, splits)


def check_quantized_decode_with_a_narrow_query(implementation, dtype, *,
                                               cache_dtype=jnp.int8,
                                               query_scale=1, value_scale=1,
                                               **case):
  """`implementation` with a `dtype` (16-bit) query over a `cache_dtype`
  cache: the FlashAttention rule against the float64 oracle, with the
  dequantized cache stored in `dtype` through `xla` as the same-dtype
  reference. `query_scale` (a power of two) multiplies the queries and
  divides the key scales, the logits unchanged; `value_scale` (a power of
  two) divides the value scales and the rule's scale; the first
  sequence's first K/V head gets all-zero queries."""
  gen = rng("quantized decode narrow query", str(implementation), str(dtype),
            str(cache_dtype), query_scale, value_scale)
  q, args, lengths, q_pos, k_deq, v_deq = _case(gen, dtype=cache_dtype,
                                                **case)
  q = q * query_scale
  q[0, :, :q.shape[2] // k_deq.shape[2]] = 0.0
  args["key_scale"] = args["key_scale"] / np.float32(query_scale)
  args["value_scale"] = args["value_scale"] / np.float32(value_scale)
  k_deq, v_deq = k_deq / query_scale, v_deq / value_scale
  out = pallas_fa.decode_attention(
      jnp.asarray(q, dtype), lengths=jnp.asarray(lengths),
      implementation=implementation,
      **{name: None if x is None else jnp.asarray(x)
         for name, x in args.items()})
  ref32 = _oracle(q, k_deq, v_deq, lengths, q_pos)[0]
  same = pallas_fa.flash_attention(
      jnp.asarray(q, dtype), jnp.asarray(k_deq, dtype),
      jnp.asarray(v_deq, dtype), key_value_seq_lengths=jnp.asarray(lengths),
      query_positions=jnp.asarray(q_pos), is_causal=True,
      implementation="xla")
  assert out.dtype == dtype
  testing.assert_close("out", out, jnp.asarray(ref32, jnp.float32), same,
                       dtype, min_scale=1 / value_scale)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_quantized_cache_with_a_narrow_query(dtype):
  check_quantized_decode_with_a_narrow_query(None, dtype, page_size=16)


def test_float8_cache_scale_defaults_to_one():
  gen = rng("float8 without scale")
  q, args, lengths, q_pos, _, _ = _case(gen, dtype=jnp.float8_e4m3fn,
                                        scale_form="scalar")
  k, v = args["key"], args["value"]
  out = pallas_fa.decode_attention(jnp.asarray(q), jnp.asarray(k),
                                   jnp.asarray(v), jnp.asarray(lengths))
  ref = _oracle(q, _dequantized(k, 1.0), _dequantized(v, 1.0), lengths,
                q_pos)[0]
  assert_close("out", out, jnp.asarray(ref, jnp.float32))


@pytest.mark.parametrize("name", ["key_scale", "value_scale"])
@pytest.mark.parametrize("number", [float("nan"), np.float32(np.inf)])
def test_a_scale_that_is_a_non_finite_number_is_named(name, number):
  """A number scales every entry: NaN or inf would make every output NaN."""
  gen = rng("float8 non-finite scale")
  q, args, lengths, _, _, _ = _case(gen, dtype=jnp.float8_e4m3fn,
                                    scale_form="scalar")
  with pytest.raises(ValueError, match=f"{name} must be finite"):
    pallas_fa.decode_attention(
        jnp.asarray(q), jnp.asarray(args["key"]), jnp.asarray(args["value"]),
        jnp.asarray(lengths), **{name: number})


@pytest.mark.parametrize("change, error, match", [
    (dict(key_scale=None), ValueError, "key_scale is required"),
    (dict(value_scale=None), ValueError, "value_scale is required"),
    (dict(key_scale=np.ones((3, 7), np.float32)), ValueError,
     r"key_scale must broadcast to key.shape\[:-1\]"),
    (dict(value_scale=np.ones((5,), np.float32)), ValueError, "value_scale"),
    (dict(key_scale=np.ones((2,), np.int32)), TypeError, "key_scale"),
    (dict(float_key=True), ValueError, "key_scale applies to an int8"),
    (dict(key=np.zeros((3, 80, 2, 32), np.int16)), TypeError, "key.dtype"),
])
def test_bad_quantized_arguments_are_named(change, error, match):
  gen = rng("quantized errors")
  q, args, lengths, _, k_deq, _ = _case(gen, scale_form="head")
  if change.pop("float_key", False):
    args["key"] = k_deq.astype(np.float32)
  args.update(change)
  kw = {name: None if x is None or isinstance(x, str) else jnp.asarray(x)
        for name, x in args.items()}
  if "implementation" in change:
    kw["implementation"] = change["implementation"]
  with pytest.raises(error, match=match):
    pallas_fa.decode_attention(jnp.asarray(q), lengths=jnp.asarray(lengths),
                               **kw)


def _largest_wider_float_array(text: str, dtype) -> int:
  """Elements of the largest array of a compiled program's text in a float
  dtype wider than `dtype`."""
  wider = [name for name, size in (("f32", 4), ("f16", 2), ("bf16", 2))
           if size > jnp.dtype(dtype).itemsize]
  sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
           for dims in re.findall(rf"\b(?:{'|'.join(wider)})\[([\d,]*)\]",
                                  text)]
  return max(sizes, default=0)


@pytest.mark.parametrize("dtype, paged", [
    (jnp.bfloat16, False), (jnp.bfloat16, True), (jnp.int8, False),
    (jnp.float8_e5m2, True), (jnp.float8_e4m3fn, False)])
def test_a_narrow_cache_is_never_widened_whole(dtype, paged):
  """jaxlib 0.10's XLA:CPU has no 16-bit float slices: a bf16 cache sliced
  as floats was converted to float32 whole before the loop, every call
  (4.8x slower than a float32 cache at S = 32k); a float8 one, sliced as
  floats, is converted to float16 whole on every jaxlib, each tile back to
  float8 in the loop (5.7x a bf16 cache's time). The compiled program
  holds no wider float array as large as the cache."""
  b, s_max, num_kv, h, page_size = 1, 4096, 2, 64, 256
  q = jnp.ones((b, 1, 4, h), jnp.bfloat16)
  if paged:
    cache = jnp.zeros((s_max // page_size, page_size, num_kv, h), dtype)
    table = jnp.arange(s_max // page_size, dtype=jnp.int32)[None]
  else:
    cache, table = jnp.zeros((b, s_max, num_kv, h), dtype), None
  scales = {}
  if dtype == jnp.int8:
    scales = dict(key_scale=jnp.ones(cache.shape[:-1]),
                  value_scale=jnp.ones(cache.shape[:-1]))
  lengths = jnp.full((b,), s_max, jnp.int32)
  step = jax.jit(lambda q, k, v: pallas_fa.decode_attention(
      q, k, v, lengths, block_table=table, implementation="chunked",
      block_kv=None if paged else page_size, **scales))
  text = step.lower(q, cache, cache).compile().as_text()
  # A step's widened tiles (the paged default's block is half this
  # cache), never the whole cache.
  largest = _largest_wider_float_array(text, dtype)
  assert largest < cache.size, (largest, cache.size)



@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn,
                                   jnp.float8_e5m2])
def test_a_cache_folded_at_compile_time_decodes_as_passed(dtype):
  """A cache closed over by a jitted step is a constant that XLA folds
  through the decode's layout changes; XLA:CPU's constant folding of a
  bitcast-convert has read a transposed float8 literal in its stored order
  (a jitted float8 forward with its inputs closed over, jaxlib 0.10.2 and
  0.11.2), and `chunked` slices 16-bit and float8 caches as their bits.
  Here a head-major cache, transposed inside the step, with a traced
  query scale, decodes as the float64 oracle says."""
  gen = rng("folded cache", str(dtype))
  b, s, num_kv, n, h = 2, 96, 2, 4, 16
  q = gen.standard_normal((b, 1, n, h)).astype(np.float32)
  q_dtype = dtype if dtype == jnp.bfloat16 else jnp.float32
  head_major = [jnp.asarray(gen.standard_normal((b, num_kv, s, h)) * 4,
                            jnp.float32).astype(dtype) for _ in range(2)]
  lengths = np.array([s, s - 37], np.int32)

  def decode(factor, key, value):
    return pallas_fa.decode_attention(
        jnp.asarray(q, q_dtype) * factor.astype(q_dtype),
        *(jnp.transpose(x, (0, 2, 1, 3)) for x in (key, value)),
        jnp.asarray(lengths), implementation="chunked")

  factor = jnp.float32(0.5)
  out = jax.jit(lambda f: decode(f, *head_major))(factor)
  passed = jax.jit(decode)(factor, *head_major)
  k, v = (np.transpose(np.asarray(x.astype(jnp.float32)), (0, 2, 1, 3))
          for x in head_major)
  q_read = np.asarray(jnp.asarray(q, q_dtype).astype(jnp.float32))
  want = _oracle(q_read * 0.5, k, v, lengths, lengths[:, None] - 1)[0]
  assert_close("out", out, want, passed, dtype=q_dtype)
  assert_close("out passed", passed, want, out, dtype=q_dtype)
