"""Float8 query/key/value with scales: `flash_attention`'s float8 calls,
`quantize_fp8`, their gradients and the Flax option, against a float64
oracle of the dequantized inputs and an emulated float8 attention."""

from __future__ import annotations

import dataclasses
import re

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import gpu_jax_only_on_cpu
from flax import nnx

import pallas_fa
from pallas_fa import api
from pallas_fa import gpu_target
from pallas_fa import kv_cache
from pallas_fa import quantize
from pallas_fa import testing

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
# B, T, S, N, K, H: ragged lengths against the small test tiles (chunked's
# 16 x 32), GQA.
SHAPE = (2, 40, 72, 4, 2, 32)


def _inputs(gen, shape=SHAPE, dtype=jnp.float32):
  """Fresh q [B, T, N, H], k, v [B, S, K, H] with per-head magnitudes far
  from 1 (so that a missing or misplaced scale shows)."""
  b, t, s, n, k, h = shape
  spread = lambda heads: 10.0 ** gen.uniform(-1, 1, (1, 1, heads, 1))
  q = testing.normal(gen, (b, t, n, h)) * spread(n)
  key = testing.normal(gen, (b, s, k, h)) * spread(k)
  value = testing.normal(gen, (b, s, k, h)) * spread(k)
  return tuple(x.astype(dtype) for x in (q, key, value))


def _quantized(gen, granularity="head", dtype=E4M3, shape=SHAPE):
  """((q8, k8, v8), (q_scale, k_scale, v_scale)) of fresh inputs."""
  pairs = [quantize.quantize_fp8(x, granularity, dtype)
           for x in _inputs(gen, shape)]
  return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _scales(scales):
  return dict(zip(("query_scale", "key_scale", "value_scale"), scales))


def _dequantized64(values, scales):
  """The float64 arrays a float8 call means."""
  return tuple(np.asarray(quantize.dequantize(x, s), np.float64)
               for x, s in zip(values, scales))


def _oracle(q, k, v, *, causal=False):
  """float64 attention (numpy) of [B, T, N, H] / [B, S, K, H] arrays:
  (out, lse), top-left causal, scale 1/sqrt(H)."""
  g = q.shape[2] // k.shape[2]
  k, v = (np.repeat(x, g, axis=2) for x in (k, v))
  q, k, v = (np.moveaxis(x, 2, 1) for x in (q, k, v))  # [B, N, L, H]
  s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
  if causal:
    t, n_keys = s.shape[-2:]
    s = np.where(np.tril(np.ones((t, n_keys), bool)), s, -np.inf)
  m = s.max(-1, keepdims=True)
  p = np.exp(s - m)
  lse = np.log(p.sum(-1)) + m[..., 0]
  out = (p / p.sum(-1, keepdims=True)) @ v
  return np.moveaxis(out, 1, 2), np.moveaxis(lse, 1, 2)


def _emulated_fp8(values, scales, *, causal=False):
  """XLA attention computed the float8 way on the same inputs: each
  product's inputs in e4m3 (q8.k8 and round(P).v8, P rounded to e4m3 as an
  FP8 kernel feeds it to its second matmul), accumulation and softmax in
  float32, scales applied in float32."""
  q8, k8, v8 = (x.astype(jnp.float32) for x in values)
  qs, ks, vs = (jnp.broadcast_to(s, x.shape[:-1])
                for s, x in zip(scales, values))
  g = q8.shape[2] // k8.shape[2]
  k8, v8, ks, vs = (jnp.repeat(x, g, axis=2) for x in (k8, v8, ks, vs))
  dot = jnp.einsum("btnh,bsnh->bnts", q8, k8, precision="highest")
  s = dot * qs.transpose(0, 2, 1)[..., None] * ks.transpose(0, 2, 1)[
      :, :, None] / np.sqrt(q8.shape[-1])
  if causal:
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
  p = jnp.exp(s - s.max(-1, keepdims=True))
  p8 = p.astype(E4M3).astype(jnp.float32) * vs.transpose(0, 2, 1)[:, :, None]
  out = jnp.einsum("bnts,bsnh->btnh", p8, v8, precision="highest")
  return out / p.sum(-1).transpose(0, 2, 1)[..., None]


def _max_error(x, ref):
  return float(np.abs(np.asarray(x, np.float64) - ref).max())


# Backends whose products run on the values as stored (converted in
# registers), P rounded for the second one (the others compute in float32
# on the dequantized inputs), with the largest relative rounding of an
# entry of P: triton, P in float16, or in e4m3 with
# `kernel.FLOAT8_OPERANDS` (2**-4, e4m3's); mosaic_tpu, P times the
# value's per-key scale in bfloat16 as in its bfloat16 calls (2**-9, and
# as much again for the float32 sums). In e4m3 P is rounded against the
# running max of its tile's row, not the row's final max as
# `_emulated_fp8` does: other roundings of the same size, so the largest
# error is that of the emulation up to this factor (measured <= 1.011).
# mosaic_gpu rounds P to e4m3 for its 8-bit P.V product.
P_ROUNDING = {"triton": 2.0 ** -4, "mosaic_tpu": 2.0 ** -8,
              "mosaic_gpu": 2.0 ** -4}
EMULATION_FACTOR = 1.25


def _automatic(values, scales):
  """The backend name the automatic choice runs this float8 call on (on a
  CPU `chunked`, on a GPU a kernel that may round P: `P_ROUNDING`)."""
  call = api.canonicalize(*values, **_scales(scales), float8=True)
  return api.choose_backend(None, call).name


def _assert_within_p_rounding(out, ref, v, dropout_rate=0.0,
                              implementation="triton"):
  """P's entries each rounded within `P_ROUNDING` of their value move each
  output by at most that much of the largest |v| it averages (times
  dropout's factor)."""
  bound = (P_ROUNDING[implementation] * float(np.abs(v).max())
           / (1 - dropout_rate))
  assert _max_error(out, ref) <= bound, (_max_error(out, ref), bound)


# ---------------------------------------------------------------------------
# The forward against the float64 oracle.


@pytest.mark.parametrize("granularity", ["token", "head", "tensor"])
@pytest.mark.parametrize("implementation",
                         ["xla", "chunked", "triton", "mosaic_tpu"])
def test_matches_float64_attention_of_dequantized_inputs(implementation,
                                                         granularity):
  gen = testing.rng("fp8 forward", implementation, granularity)
  values, scales = _quantized(gen, granularity)
  out, lse = pallas_fa.flash_attention(
      *values, **_scales(scales), is_causal=True, out_dtype=jnp.float32,
      implementation=implementation,
      block_sizes=conftest.block_sizes_for(implementation),
      return_residual=True)
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  ref, ref_lse = _oracle(*_dequantized64(values, scales), causal=True)
  # The logits are exact products of float8 values either way.
  testing.assert_close("lse", lse, ref_lse)
  # No worse than XLA's attention computed in float8 on the same inputs.
  emulated = _emulated_fp8(values, scales, causal=True)
  if implementation in P_ROUNDING:
    _assert_within_p_rounding(out, ref, _dequantized64(values, scales)[2],
                              implementation=implementation)
    assert _max_error(out, ref) <= EMULATION_FACTOR * _max_error(
        emulated, ref)
    return
  testing.assert_close("out", out, ref)
  assert _max_error(out, ref) <= _max_error(emulated, ref)


@gpu_jax_only_on_cpu
def test_triton_float8_operands(monkeypatch):
  # The kernel's float8-operand products (`kernel.FLOAT8_OPERANDS`, for a
  # lowering that reaches FP8 tensor cores): Q.K^T on e4m3, P rounded to
  # e4m3 for P.V, within the emulated float8 attention's error; with
  # dropout P stays below 448.
  from pallas_fa.triton import kernel  # noqa: PLC0415
  monkeypatch.setattr(kernel, "FLOAT8_OPERANDS", True)
  gen = testing.rng("fp8 triton operands")
  values, scales = _quantized(gen, "head")
  kw = dict(is_causal=True, out_dtype=jnp.float32, implementation="triton",
            block_sizes=conftest.block_sizes_for("triton"))
  out = pallas_fa.flash_attention(*values, **_scales(scales), **kw)
  ref = _oracle(*_dequantized64(values, scales), causal=True)[0]
  emulated = _emulated_fp8(values, scales, causal=True)
  assert _max_error(out, ref) <= EMULATION_FACTOR * _max_error(emulated, ref)
  deq = [jnp.asarray(x, jnp.float32) for x in _dequantized64(values, scales)]
  kw.update(dropout_rate=0.5, dropout_rng=3)
  out = pallas_fa.flash_attention(*values, **_scales(scales), **kw)
  want = pallas_fa.flash_attention(*deq, **{**kw, "implementation": "xla",
                                            "out_dtype": None,
                                            "block_sizes": None})
  _assert_within_p_rounding(out, np.asarray(want, np.float64), deq[2], 0.5)


@gpu_jax_only_on_cpu
@pytest.mark.parametrize("granularity", ["token", "head"])
def test_triton_widened_float8_is_the_kernels_conversion(granularity):
  # float16 holds every e4m3 and e5m2 value: widening the inputs in XLA
  # (`TritonBlockSizes.widen_float8`) feeds the kernel the values its own
  # conversion makes, so the two paths agree bit for bit in the
  # interpreter, mixed formats and per-token scales included.
  gen = testing.rng("fp8 triton widened", granularity)
  wide = _inputs(gen)
  pairs = [quantize.quantize_fp8(x, granularity, d)
           for x, d in zip(wide, (E4M3, E5M2, E4M3))]
  values, scales = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
  small = conftest.block_sizes_for("triton")
  outs = [pallas_fa.flash_attention(
      *values, **_scales(scales), is_causal=True, out_dtype=jnp.float32,
      implementation="triton", return_residual=True,
      block_sizes=dataclasses.replace(small, widen_float8=widen))
      for widen in (False, True)]
  if gpu_target.current() is None:
    # Interpreted: the same float16 values through the same arithmetic.
    # (Compiled, the two kernels may order their products' sums apart.)
    for name, a, b in zip(("out", "lse"), *outs):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=name)
  ref = _oracle(*_dequantized64(values, scales), causal=True)[0]
  _assert_within_p_rounding(outs[1][0], ref, _dequantized64(values, scales)[2])


def _check_triton_causal(values, scales, widen):
  """triton's causal float8 call against the float64 oracle: lse to the
  float32 tolerance, the output within P's rounding."""
  out, lse = pallas_fa.flash_attention(
      *values, **_scales(scales), is_causal=True, out_dtype=jnp.float32,
      implementation="triton", return_residual=True,
      block_sizes=dataclasses.replace(conftest.block_sizes_for("triton"),
                                      widen_float8=widen))
  ref, ref_lse = _oracle(*_dequantized64(values, scales), causal=True)
  testing.assert_close("lse", lse, ref_lse)
  _assert_within_p_rounding(out, ref, _dequantized64(values, scales)[2])


@gpu_jax_only_on_cpu
@pytest.mark.parametrize("granularity", ["token", "head"])
@pytest.mark.parametrize("widen", [False, True])
def test_triton_float8_signed_query_scales(granularity, widen):
  # Zero and negative query scales are legal. With one key scale a head,
  # the kernel takes the row max on the raw products with the factor in
  # the exponent (`kernel.Fp8.exponent_scale`), which needs it
  # positive: its sign goes into the queries and a zero one zeroes them
  # (`triton._positive_factors`); a zero factor must not turn a masked
  # logit into NaN (causal masks here).
  gen = testing.rng("fp8 triton signed scales", granularity, widen)
  pairs = [quantize.quantize_fp8(x, g, E4M3) for x, g in zip(
      _inputs(gen), (granularity, "head", "head"))]
  values = tuple(p[0] for p in pairs)
  qs, ks, vs = (p[1] for p in pairs)
  sign = np.ones(qs.shape, np.float32)
  if granularity == "token":
    sign[:, 3, 0] = sign[:, 20, 1] = -1.0
    sign[:, 7, 0] = sign[:, 21, 2] = 0.0
    sign[1, :, 3] = -1.0
  else:
    sign[..., 0], sign[..., 2] = -1.0, 0.0
  scales = (qs * sign, ks, vs)
  _check_triton_causal(values, scales, widen)


@gpu_jax_only_on_cpu
@pytest.mark.parametrize("widen", [False, True])
def test_triton_float8_signed_value_scales(widen):
  # Per-key value scales of either sign: the kernel divides them by their
  # largest magnitude per (batch row, K/V head), so each ratio is within
  # [-1, 1] and P times it stays in float16. A negative scale twice the
  # largest positive one (divided by that positive one, it overflowed P:
  # every output was inf) and a zero one.
  gen = testing.rng("fp8 triton signed value scales", widen)
  pairs = [quantize.quantize_fp8(x, "token", E4M3) for x in _inputs(gen)]
  values = tuple(p[0] for p in pairs)
  qs, ks, vs = (p[1] for p in pairs)
  sign = np.ones(vs.shape, np.float32)
  sign[:, 5, 0] = -3.0
  sign[:, 11, 1] = 0.0
  sign[1, :, 1] = -1.0
  sign[0, 9, :] = -2.5
  scales = (qs, ks * np.where(sign < 0, -1.0, 1.0), vs * sign)
  _check_triton_causal(values, scales, widen)


def test_triton_widens_float8_where_products_read_shared_memory():
  # Hopper's wgmma reads K and V from shared memory: a float8 forward long
  # enough to be compute-bound widens them in XLA; an A100-class GPU, a
  # short call and the CPU interpreter keep the kernel's conversion; the
  # block-size field decides where set.
  from pallas_fa import triton  # noqa: PLC0415
  least = triton.WIDEN_FLOAT8_MIN_QUERIES
  assert triton.widens_float8(4 * least, target=gpu_target.H100)
  assert triton.widens_float8(least, target=gpu_target.H100)
  assert not triton.widens_float8(least - 1, target=gpu_target.H100)
  assert not triton.widens_float8(4 * least, target=gpu_target.A100)
  if gpu_target.current() is None:  # Interpreted: nothing to widen for.
    assert not triton.widens_float8(4 * least)
  forced = triton.TritonBlockSizes(widen_float8=False)
  assert not triton.widens_float8(4 * least, forced, gpu_target.H100)
  forced = triton.TritonBlockSizes(widen_float8=True)
  assert triton.widens_float8(16, forced, gpu_target.A100)
  # The lowering for an H100: the widened call converts the keys to
  # float16 in XLA, before the kernel; the other leaves them to it.
  gen = testing.rng("fp8 triton widened lowering")
  values, scales = _quantized(gen, shape=(1, least, least, 2, 1, 64))
  key_widening = re.compile(r"stablehlo\.convert[^\n]*tensor<1x1024x1x64x"
                            r"f8E4M3FN>\) -> tensor<1x1024x1x64xf16>")

  def lowered(widen):
    def call(*args):
      return pallas_fa.flash_attention(
          *args[:3], **_scales(args[3:]), implementation="triton",
          block_sizes=triton.TritonBlockSizes(widen_float8=widen))

    with gpu_target.compile_for(gpu_target.H100):
      return jax.jit(call).trace(*values, *scales).lower(
          lowering_platforms=("cuda",)).as_text()

  assert key_widening.search(lowered(None))
  assert not key_widening.search(lowered(False))


@pytest.mark.parametrize("formats", ["e5m2 q/k, e4m3 v", "e4m3 q, e5m2 k/v"])
@pytest.mark.parametrize("implementation",
                         ["xla", "chunked", "triton", "mosaic_tpu"])
def test_e5m2_and_mixed_formats(implementation, formats):
  gen = testing.rng("fp8 e5m2", implementation, formats)
  wide = _inputs(gen)
  dtypes = ((E5M2, E5M2, E4M3) if formats.startswith("e5m2")
            else (E4M3, E5M2, E5M2))
  granularities = ("token", "token", "head")
  pairs = [quantize.quantize_fp8(x, g, d)
           for x, g, d in zip(wide, granularities, dtypes)]
  values, scales = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
  out = pallas_fa.flash_attention(
      *values, **_scales(scales), out_dtype=jnp.float32,
      implementation=implementation,
      block_sizes=conftest.block_sizes_for(implementation))
  ref = _oracle(*_dequantized64(values, scales))[0]
  if implementation == "triton":
    # Q.K^T exact (float16 holds both formats); P in float16: 11 bits.
    _assert_within_p_rounding(out, ref, _dequantized64(values, scales)[2])
    assert _max_error(out, ref) <= 2.0 ** -9 * float(np.abs(ref).max())
    return
  if implementation in P_ROUNDING:
    # Q.K^T exact (bfloat16 holds both formats).
    _assert_within_p_rounding(out, ref, _dequantized64(values, scales)[2],
                              implementation=implementation)
    return
  testing.assert_close("out", out, ref)


def test_result_dtype_is_bfloat16_unless_asked():
  gen = testing.rng("fp8 out dtype")
  values, scales = _quantized(gen)
  ref = _oracle(*_dequantized64(values, scales))[0]
  out = pallas_fa.flash_attention(*values, **_scales(scales))
  assert out.dtype == jnp.bfloat16
  # Within the FlashAttention rule of a bfloat16 result: its own rounding.
  testing.assert_close("out", out, ref, ref.astype(jnp.bfloat16),
                       jnp.bfloat16)
  # No worse than XLA's float8 attention; a kernel that rounds P to e4m3
  # itself (mosaic_gpu, on a GPU) rounds against the running row max.
  factor = EMULATION_FACTOR if _automatic(values, scales) in P_ROUNDING else 1
  assert _max_error(out, ref) <= factor * _max_error(
      _emulated_fp8(values, scales), ref)
  for dtype in (jnp.float16, jnp.float32):
    assert pallas_fa.flash_attention(
        *values, **_scales(scales), out_dtype=dtype).dtype == dtype


def test_scale_forms_broadcast_as_decode_caches_do():
  # Per tensor (scalar), per head ([N] / [K]), per batch row and head,
  # per token; any batch dims; missing scales are 1.
  gen = testing.rng("fp8 scale forms")
  b, t, s, n, k, h = 2, 24, 40, 4, 2, 16
  q, key, value = _inputs(gen, (2 * 3, t, s, n, k, h))
  q, key, value = (x.reshape((2, 3) + x.shape[1:]) for x in (q, key, value))
  forms = {
      "tensor": (jnp.float32(0.5), jnp.float32(2.0), None),
      "head": (gen.uniform(0.5, 2, (n,)), gen.uniform(0.5, 2, (k,)),
               gen.uniform(0.5, 2, (1, 1, k))),
      "row and head": (gen.uniform(0.5, 2, (b, 3, 1, n)),
                       gen.uniform(0.5, 2, (3, 1, k)), None),
      "token": (gen.uniform(0.5, 2, (b, 3, t, n)),
                gen.uniform(0.5, 2, (b, 3, s, k)),
                gen.uniform(0.5, 2, (b, 3, s, k))),
  }
  values = tuple(x.astype(E4M3) for x in (q, key, value))
  for name, scales in forms.items():
    scales = tuple(None if x is None else jnp.asarray(x, jnp.float32)
                   for x in scales)
    out = pallas_fa.flash_attention(*values, **_scales(scales),
                                    out_dtype=jnp.float32)
    deq = [jnp.asarray(d, jnp.float32).reshape((6,) + d.shape[2:])
           for d in _dequantized64(values, scales)]
    ref = pallas_fa.flash_attention(*deq, implementation="xla")
    chosen = _automatic(values, scales)
    if chosen in P_ROUNDING:  # A GPU kernel's P rounding (documented).
      _assert_within_p_rounding(out.reshape(ref.shape), ref, deq[2],
                                implementation=chosen)
    else:
      testing.assert_close(f"out ({name} scales)", out.reshape(ref.shape),
                           ref)
  # Unbatched [T, N, H].
  unbatched = tuple(x[0, 0] for x in values)
  out = pallas_fa.flash_attention(*unbatched, query_scale=jnp.float32(3.0))
  assert out.shape == (t, n, h) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("implementation", ["chunked", "triton", "mosaic_tpu"])
def test_every_other_argument_keeps_its_meaning(implementation):
  # Masks, padding, soft cap, sinks, dropout and a score_mod act on the
  # dequantized inputs exactly as on float32 ones. (Per-head scales on
  # triton: P scaled below its format's largest under dropout.)
  gen = testing.rng("fp8 arguments", implementation)
  values, scales = _quantized(
      gen, "head" if implementation == "triton" else "token")
  b, t, s, n = SHAPE[:4]
  kw = dict(
      local_window_size=(24, 8), logits_soft_cap=20.0,
      key_value_seq_lengths=jnp.array([s, s - 13]),
      query_seq_lengths=jnp.array([t - 5, t]),
      segment_ids=pallas_fa.SegmentIds(
          q=jnp.asarray(np.repeat([[0, 1]], b, 0).repeat([t // 2, t - t // 2],
                                                         1)),
          kv=jnp.asarray(np.repeat([[0, 1]], b, 0).repeat([s // 2, s - s // 2],
                                                          1))),
      sinks=testing.normal(gen, (n,)), dropout_rate=0.25, dropout_rng=7,
      score_mod=pallas_fa.flex.alibi,
      score_mod_args=(jnp.linspace(0.1, 0.5, n),))
  deq = [jnp.asarray(x, jnp.float32) for x in _dequantized64(values, scales)]
  ref = pallas_fa.flash_attention(*deq, implementation="xla", **kw)
  out = pallas_fa.flash_attention(
      *values, **_scales(scales), out_dtype=jnp.float32,
      implementation=implementation, block_sizes=conftest.block_sizes_for(
          implementation), **kw)
  if implementation in P_ROUNDING:
    _assert_within_p_rounding(out, ref, deq[2], kw["dropout_rate"],
                              implementation)
  else:
    testing.assert_close("out", out, ref)


@pytest.mark.parametrize("implementation",
                         ["xla", "chunked", "triton", "mosaic_tpu"])
def test_padding_never_leaks(implementation):
  # NaN values and inf scales stored in padded keys reach nothing: not the
  # output, not the scales' gradients.
  gen = testing.rng("fp8 padding")
  (q8, k8, v8), (qs, ks, vs) = _quantized(gen, "token")
  lengths = jnp.array([SHAPE[2] - 9, SHAPE[2]])
  padded = (jnp.arange(SHAPE[2])[None] >= lengths[:, None])[..., None]
  # [B, S, 1]
  k8 = jnp.where(padded[..., None], jnp.nan, k8.astype(jnp.float32)).astype(
      E4M3)
  v8 = jnp.where(padded[..., None], jnp.nan, v8.astype(jnp.float32)).astype(
      E4M3)
  ks = jnp.where(padded, jnp.inf, ks)
  vs = jnp.where(padded, jnp.inf, vs)

  def loss(scales, implementation):
    out = pallas_fa.flash_attention(
        q8, k8, v8, **_scales(scales), key_value_seq_lengths=lengths,
        implementation=implementation, out_dtype=jnp.float32)
    return jnp.sum(out * jnp.cos(out)), out

  grads, out = jax.grad(loss, has_aux=True)((qs, ks, vs), implementation)
  assert np.isfinite(np.asarray(out)).all()
  for name, g in zip(("query_scale", "key_scale", "value_scale"), grads):
    assert np.isfinite(np.asarray(g)).all(), name


@pytest.mark.parametrize("granularity", ["tensor", "head", "token"])
def test_quantize_ignores_padding(granularity):
  """flash_attention(quantize=...) takes its scales over real positions
  only: NaN/inf stored past the lengths (keys and queries) change neither
  the real rows' outputs nor the gradients, at every granularity."""
  gen = testing.rng("fp8 quantize padding", granularity)
  q, k, v = _inputs(gen)
  q_len = jnp.array([SHAPE[1] - 5, SHAPE[1]])
  kv_len = jnp.array([SHAPE[2] - 9, SHAPE[2]])

  def poisoned(x, lengths, value):
    past = jnp.arange(x.shape[1])[None] >= lengths[:, None]
    return jnp.where(past[:, :, None, None], value, x)

  def loss(q, k, v):
    out = pallas_fa.flash_attention(
        q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
        quantize=granularity, implementation="chunked",
        out_dtype=jnp.float32)
    return jnp.sum(out * jnp.cos(out)), out

  clean_grads, clean = jax.grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
  bad = (poisoned(q, q_len, jnp.inf), poisoned(k, kv_len, jnp.nan),
         poisoned(v, kv_len, jnp.inf))
  grads, out = jax.grad(loss, (0, 1, 2), has_aux=True)(*bad)
  np.testing.assert_array_equal(out, clean)
  for g, want in zip(grads, clean_grads):
    np.testing.assert_array_equal(g, want)


@pytest.mark.slow_for("mosaic_tpu")  # its interpreter is the slowest
@pytest.mark.parametrize("implementation", ["chunked", "mosaic_tpu"])
def test_error_grows_with_length_no_faster_than_bfloat16(implementation):
  # The float8 call's error (default bfloat16 result) against the float64
  # attention of its dequantized inputs, and the bfloat16 call's against
  # that of its own inputs, as T = S grows: relative RMS errors.
  gen = testing.rng("fp8 long")
  lengths = (256, 1024, 4096)
  rel = lambda x, ref: (np.sqrt(np.mean((np.asarray(x, np.float64) - ref)
                                        ** 2)) / np.sqrt(np.mean(ref ** 2)))
  fp8, bf16 = [], []
  for t in lengths:
    wide = _inputs(gen, (1, t, t, 1, 1, 64))
    pairs = [quantize.quantize_fp8(x, "head") for x in wide]
    values, scales = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    out = pallas_fa.flash_attention(*values, **_scales(scales),
                                    implementation=implementation)
    fp8.append(rel(out, _oracle(*_dequantized64(values, scales))[0]))
    narrow = tuple(x.astype(jnp.bfloat16) for x in wide)
    out = pallas_fa.flash_attention(*narrow, implementation=implementation)
    bf16.append(rel(out, _oracle(*(np.asarray(x, np.float64)
                                   for x in narrow))[0]))
  growth_fp8 = fp8[-1] / fp8[0]
  growth_bf16 = bf16[-1] / bf16[0]
  assert growth_fp8 <= 1.5 * max(growth_bf16, 1.0), (fp8, bf16)


@gpu_jax_only_on_cpu
def test_triton_error_stays_within_p_rounding_as_length_grows():
  # triton's float8 forward, as T = S grows: its relative RMS error
  # against the float64 attention of the dequantized inputs stays within
  # that of XLA's attention computed in float8 (P rounded to e4m3 once,
  # float32 sums) at every length: nothing accumulates beyond P's
  # rounding. (On a CPU the interpreter sums in float32; compiled, this
  # is where a tensor core's narrower accumulation would show.)
  gen = testing.rng("fp8 long products")
  rel = lambda x, ref: (np.sqrt(np.mean((np.asarray(x, np.float64) - ref)
                                        ** 2)) / np.sqrt(np.mean(ref ** 2)))
  for t in (256, 4096):
    wide = _inputs(gen, (1, t, t, 1, 1, 64))
    pairs = [quantize.quantize_fp8(x, "head") for x in wide]
    values, scales = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    ref = _oracle(*_dequantized64(values, scales))[0]
    out = pallas_fa.flash_attention(*values, **_scales(scales),
                                    out_dtype=jnp.float32,
                                    implementation="triton")
    emulated = rel(_emulated_fp8(values, scales), ref)
    assert rel(out, ref) <= EMULATION_FACTOR * emulated, (
        t, rel(out, ref), emulated)


# ---------------------------------------------------------------------------
# Gradients.


@pytest.mark.parametrize("implementation",
                         ["xla", "chunked", "triton", "mosaic_tpu"])
def test_scale_gradients_are_those_of_the_dequantized_attention(
    implementation):
  gen = testing.rng("fp8 scale grads", implementation)
  values, scales = _quantized(gen, "token")
  dout = testing.normal(gen, SHAPE[:2] + (SHAPE[3], SHAPE[5]))
  dlse = testing.normal(gen, SHAPE[:2] + (SHAPE[3],))

  def loss(scales, fn, dlse):
    out, lse = fn(scales)
    return jnp.sum(out * dout) + jnp.sum(lse * dlse)

  def fp8(scales):
    return pallas_fa.flash_attention(
        *values, **_scales(scales), is_causal=True, out_dtype=jnp.float32,
        implementation=implementation, return_residual=True,
        block_sizes=conftest.block_sizes_for(implementation))

  def dequantized(scales):
    return pallas_fa.flash_attention(
        *(quantize.dequantize(x, s) for x, s in zip(values, scales)),
        is_causal=True, implementation="xla", return_residual=True)

  got = jax.grad(loss)(scales, fp8, dlse)
  if implementation in P_ROUNDING:
    # The backward runs in float32 on the dequantized inputs, but takes
    # delta = rowsum(out * dout) - dlse from the forward's output, whose
    # P rounding moves delta by rowsum((out - exact) * dout): exactly
    # what moving dlse by minus that does. The gradients must be those of
    # the dequantized attention under that dlse.
    shift = jnp.sum((fp8(scales)[0] - dequantized(scales)[0]) * dout, -1)
    dlse = dlse - shift
  want = jax.grad(loss)(scales, dequantized, dlse)
  for name, g, w in zip(("dquery_scale", "dkey_scale", "dvalue_scale"), got,
                        want):
    assert g.dtype == jnp.float32 and g.shape == w.shape
    testing.assert_close(name, g, w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_differentiates_straight_through(dtype):
  # quantize="head": the high-precision inputs get the gradient of the
  # attention at the dequantized inputs, in their own dtype.
  gen = testing.rng("fp8 straight through", str(dtype))
  wide = _inputs(gen, dtype=dtype)
  dout = testing.normal(gen, wide[0].shape)

  # On xla, whose float8 forward is exact on the dequantized inputs: a
  # kernel's backward uses its forward's output, P's rounding in it too
  # (documented), which this straight-through check is not about.
  def loss(q, k, v):
    out = pallas_fa.flash_attention(q, k, v, quantize="head", is_causal=True,
                                    out_dtype=jnp.float32,
                                    implementation="xla")
    return jnp.sum(out * dout)

  out = pallas_fa.flash_attention(*wide, quantize="head")
  assert out.dtype == dtype
  got = jax.grad(loss, (0, 1, 2))(*wide)
  deq = [quantize.dequantize(*quantize.quantize_fp8(x, "head")) for x in wide]
  want = jax.grad(
      lambda *x: jnp.sum(pallas_fa.flash_attention(
          *x, is_causal=True, implementation="xla") * dout), (0, 1, 2))(*deq)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.dtype == dtype
    testing.assert_close(name, g, w, w.astype(dtype), dtype)


def test_differentiating_a_float8_input_raises():
  gen = testing.rng("fp8 no float8 cotangent")
  values, scales = _quantized(gen)

  def loss(q8):
    return pallas_fa.flash_attention(q8, *values[1:],
                                     **_scales(scales)).sum()

  with pytest.raises(TypeError, match="does not differentiate float8.*query"):
    jax.grad(loss)(values[0])
  # Through a cast from a high-precision array, as well.
  with pytest.raises(TypeError, match="float8"):
    jax.grad(lambda q: loss(q.astype(E4M3)))(_inputs(gen)[0])
  # Stopped, they are data, and the scales stay differentiable.
  wide = _inputs(gen)[0]
  q_scale = scales[0]

  def scaled(q, s):
    q8 = jax.lax.stop_gradient(q).astype(E4M3)
    return pallas_fa.flash_attention(q8, *values[1:], query_scale=s,
                                     key_scale=scales[1]).sum()

  dq, ds = jax.grad(scaled, (0, 1))(wide, q_scale)
  assert not np.asarray(dq).any() and ds.shape == q_scale.shape


# ---------------------------------------------------------------------------
# Backends and the automatic choice.


def test_automatic_choice_runs_float8_on_chunked(monkeypatch):
  gen = testing.rng("fp8 auto")
  values, scales = _quantized(gen)
  out = pallas_fa.flash_attention(*values, **_scales(scales))
  chosen = _automatic(values, scales)
  # On a CPU chunked; on a GPU or TPU the platform's float8 kernel.
  assert chosen == {"cpu": "chunked", "tpu": "mosaic_tpu"}.get(
      api.platform(), chosen if chosen in ("mosaic_gpu", "triton") else "")
  want = pallas_fa.flash_attention(*values, **_scales(scales),
                                   implementation=chosen)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(want, np.float32))
  call = api.canonicalize(*values, **_scales(scales), float8=True)
  # mosaic_tpu runs float8 calls (tiles widened to bfloat16 in the kernel).
  monkeypatch.setitem(api.AUTO_ORDER, api.platform(),
                      ("mosaic_tpu", "chunked"))
  assert api.choose_backend(None, call).name == "mosaic_tpu"
  e5m2 = api.canonicalize(*(x.astype(E5M2) for x in values),
                          **_scales(scales), float8=True)
  with gpu_target.compile_for(gpu_target.H100):
    # On a Hopper GPU, mosaic_gpu (first in the order, and able to run the
    # call: its 8-bit wgmma forward) takes it.
    assert api.choose_backend(None, call).name == "mosaic_gpu"
    # It takes e4m3 only: an e5m2 call moves on down the order.
    monkeypatch.setitem(api.AUTO_ORDER, api.platform(),
                        ("mosaic_gpu", "chunked"))
    assert api.choose_backend(None, e5m2).name == "chunked"
    monkeypatch.setitem(api.AUTO_ORDER, api.platform(),
                        ("mosaic_gpu", "triton", "chunked"))
    assert api.choose_backend(None, e5m2).name == "triton"


@pytest.mark.parametrize("block_kv", [192, 256])
def test_mosaic_gpu_float8_lowers_wide_key_tiles_for_hopper(block_kv):
  """192-key tiles: the V^T tile's 192-byte rows take a 64-byte swizzle
  (a 128-byte one does not tile them); 256-key tiles two 128-byte swizzle
  tiles a row, in two stages. The padded keys of a length that is not a
  multiple of the tile are masked by index."""
  gen = testing.rng("fp8 lower wide keys", block_kv)
  values, scales = _quantized(gen, shape=(1, 320, 320, 2, 1, 128))
  bs = pallas_fa.MosaicGpuBlockSizes(block_kv=block_kv, num_stages=2)

  def call(*args):
    return pallas_fa.flash_attention(
        *args[:3], **_scales(args[3:]), implementation="mosaic_gpu",
        block_sizes=bs)

  with gpu_target.compile_for(gpu_target.H100):
    text = jax.jit(call).trace(*values, *scales).lower(
        lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 1


def test_triton_declines_float8_below_compute_capability_8_9():
  # Triton converts float8_e4m3fn from 8.9 on: an A100 call moves on.
  gen = testing.rng("fp8 triton capability")
  values, scales = _quantized(gen)
  call = api.canonicalize(*values, **_scales(scales), float8=True)
  backend = api.get_backend("triton")
  with gpu_target.compile_for(gpu_target.A100):
    with pytest.raises(NotImplementedError, match="compute capability 8.9"):
      backend.check_call(*call.arrays)
  with gpu_target.compile_for(gpu_target.H100):
    backend.check_call(*call.arrays)


def test_a_backend_without_float8_declines_by_name():
  gen = testing.rng("fp8 kernels")
  values, scales = _quantized(gen)
  call = api.canonicalize(*values, **_scales(scales), float8=True)
  plain = dataclasses.replace(api.get_backend("chunked"), name="plain",
                              dtypes=(jnp.float32, jnp.bfloat16))
  with pytest.raises(NotImplementedError, match="'plain' has no float8 path"):
    plain.check_call(*call.arrays)


def test_jit_vmap_and_empty_calls():
  gen = testing.rng("fp8 transforms")
  values, scales = _quantized(gen, "token")
  fn = lambda q, k, v, qs, ks, vs: pallas_fa.flash_attention(
      q, k, v, query_scale=qs, key_scale=ks, value_scale=vs)
  out = jax.jit(jax.vmap(fn))(*values, *scales)
  want = fn(*values, *scales)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(want, np.float32), atol=1e-2)
  empty = pallas_fa.flash_attention(values[0][:, :0], *values[1:])
  assert empty.shape == (2, 0, 4, 32) and empty.dtype == jnp.bfloat16


# ---------------------------------------------------------------------------
# Bad input.


def _bad_call(change):
  gen = testing.rng("fp8 errors")
  (q8, k8, v8), (qs, ks, vs) = _quantized(gen, "token")
  args = dict(query=q8, key=k8, value=v8, query_scale=qs, key_scale=ks,
              value_scale=vs)
  args.update(change)
  return lambda: pallas_fa.flash_attention(**args)


@pytest.mark.parametrize("change, error, match", [
    (dict(key=jnp.ones((2, 72, 2, 32), jnp.bfloat16), key_scale=None),
     TypeError, r"must all be float8.*key.dtype=bfloat16"),
    (dict(query=jnp.ones((2, 40, 4, 32)), query_scale=None), TypeError,
     "must all be float8"),
    (dict(query=jnp.ones((2, 40, 4, 32)), key=jnp.ones((2, 72, 2, 32)),
          value=jnp.ones((2, 72, 2, 32)), key_scale=None, value_scale=None),
     ValueError, "query_scale applies to a float8 query"),
    (dict(query=jnp.ones((2, 40, 4, 32), jnp.int8), query_scale=None),
     TypeError, "query must be float32"),
    (dict(key_scale=np.ones((72, 3), np.float32)), ValueError,
     r"key_scale must broadcast to key.shape\[:-1\]"),
    (dict(query_scale=np.ones((2, 40, 4, 1), np.float32)), ValueError,
     "query_scale"),
    (dict(value_scale=np.ones((2,), np.int32)), TypeError,
     "value_scale must be floating"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype"),
    (dict(out_dtype="no such dtype"), TypeError, "out_dtype"),
    (dict(quantize="head", query_scale=None, key_scale=None,
          value_scale=None), TypeError, "quantize= quantizes 16/32-bit"),
    (dict(quantize="row"), ValueError, "quantize must be one of"),
])
def test_bad_float8_arguments_are_named(change, error, match):
  with pytest.raises(error, match=match):
    _bad_call(change)()


def test_bad_float_options_are_named():
  q = jnp.ones((1, 8, 2, 16))
  with pytest.raises(ValueError, match="out_dtype applies to float8 calls"):
    pallas_fa.flash_attention(q, q, q, out_dtype=jnp.bfloat16)
  pallas_fa.flash_attention(q, q, q, out_dtype=jnp.float32)  # Its own dtype.
  with pytest.raises(ValueError, match="query_scale applies"):
    pallas_fa.flash_attention(q, q, q, quantize="head", query_scale=1.0)
  with pytest.raises(TypeError, match="query must be float32"):
    # Only flash_attention's own path takes float8 inputs.
    api.canonicalize(q.astype(E4M3), q, q)


# ---------------------------------------------------------------------------
# quantize_fp8.


@pytest.mark.parametrize("granularity, shape", [
    ("token", (2, 3, 8, 4)), ("head", (2, 3, 1, 4)), ("tensor", ())])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_fp8_granularities(granularity, shape, dtype):
  gen = testing.rng("quantize_fp8", granularity, str(dtype))
  x = np.asarray(testing.normal(gen, (2, 3, 8, 4, 16)), np.float64)
  x *= 10.0 ** gen.uniform(-2, 2, (2, 3, 1, 4, 1))
  values, scale = quantize.quantize_fp8(jnp.asarray(x, jnp.float32),
                                        granularity, dtype)
  assert values.dtype == dtype and scale.dtype == jnp.float32
  assert scale.shape == shape
  back = np.asarray(quantize.dequantize(values, scale), np.float64)
  axes = {"token": (-1,), "head": (-3, -1), "tensor": None}[granularity]
  absmax = np.abs(x).max(axis=axes, keepdims=True)
  np.testing.assert_allclose(np.abs(back).max(axis=axes, keepdims=True),
                             absmax, rtol=1e-6)  # the absmax is exact
  mantissa = 3 if dtype == E4M3 else 2
  tiny = float(jnp.finfo(dtype).smallest_subnormal) / float(
      jnp.finfo(dtype).max)
  bound = np.abs(x) * 2.0 ** -(mantissa + 1) + absmax * tiny
  assert np.all(np.abs(back - x) <= bound * (1 + 1e-6))


def test_quantize_fp8_rejects_bad_input_and_keeps_zeros():
  x = jnp.zeros((1, 4, 2, 8)).at[0, 1, 0].set(3.0)
  values, scale = quantize.quantize_fp8(x, "token")
  back = np.asarray(quantize.dequantize(values, scale))
  # All-zero slices: scale 1, values 0, exact zeros back.
  assert scale[0, 0, 0] == 1.0 and not back[0, 0].any()
  np.testing.assert_allclose(back, np.asarray(x), rtol=1e-6)
  with pytest.raises(ValueError, match="granularity"):
    quantize.quantize_fp8(x, "row")
  with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
    quantize.quantize_fp8(x, "head", jnp.int8)
  with pytest.raises(ValueError, match=r"\[\*B, T, N, H\]"):
    quantize.quantize_fp8(x[0, 0], "head")


@pytest.mark.parametrize("dtype", ["fp8", "float9", None, object(), [8]])
def test_quantize_names_a_dtype_that_is_no_dtype(dtype):
  """Not numpy's "data type not understood": the argument, named."""
  x = jnp.asarray(testing.rng("quantize dtype", repr(dtype)).standard_normal(
      (1, 4, 2, 8)), jnp.float32)
  with pytest.raises(TypeError, match=r"quantize_fp8's dtype must be "
                     r"float8_e4m3fn or float8_e5m2, got dtype="):
    quantize.quantize_fp8(x, "head", dtype)
  with pytest.raises(TypeError, match="quantize's dtype must be int8"):
    quantize.quantize(x, dtype)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_quantize_fp8_takes_a_dtypes_name(name):
  x = jnp.asarray(testing.rng("quantize name", name).standard_normal(
      (2, 4, 2, 8)), jnp.float32)
  by_name = quantize.quantize_fp8(x, "head", name)
  by_dtype = quantize.quantize_fp8(x, "head", jnp.dtype(name))
  assert by_name[0].dtype == jnp.dtype(name)
  for a, b in zip(by_name, by_dtype):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))


def test_cache_quantization_is_the_per_token_case():
  gen = testing.rng("quantize one home")
  x = testing.normal(gen, (2, 5, 3, 16))
  for dtype in (jnp.int8, E4M3):
    a = kv_cache.quantize(x, dtype)
    b = quantize.quantize(x, dtype, (-1,))
    for p, r in zip(a, b):
      np.testing.assert_array_equal(np.asarray(p, np.float32),
                                    np.asarray(r, np.float32))
  c = quantize.quantize_fp8(x, "token")
  np.testing.assert_array_equal(np.asarray(c[1]),
                                np.asarray(kv_cache.quantize(x, E4M3)[1]))


# ---------------------------------------------------------------------------
# The Flax option.


def test_multi_head_attention_fp8_option():
  gen = testing.rng("fp8 flax")
  kw = dict(num_heads=4, in_features=32, num_kv_heads=2, is_causal=True,
            dtype=jnp.bfloat16)
  layer = pallas_fa.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  fp8 = pallas_fa.MultiHeadAttention(**kw, fp8_attention="head",
                                     rngs=nnx.Rngs(0))
  x = testing.normal(gen, (2, 24, 32))
  out, out8 = layer(x), fp8(x)
  assert out8.dtype == out.dtype == jnp.bfloat16
  # Float8 inputs cost about e4m3's 2**-4 relative rounding, no more.
  scale = float(jnp.abs(out.astype(jnp.float32)).max())
  assert float(jnp.abs(out8.astype(jnp.float32)
                       - out.astype(jnp.float32)).max()) < 0.1 * scale

  def loss(model):
    return jnp.sum(model(x).astype(jnp.float32) ** 2)

  grads, grads8 = nnx.grad(loss)(layer), nnx.grad(loss)(fp8)
  for path in (("query", "kernel"), ("key", "kernel"), ("value", "kernel")):
    g, g8 = (np.asarray(getattr(getattr(gr, path[0]), path[1])[...],
                        np.float32) for gr in (grads, grads8))
    assert np.isfinite(g8).all() and np.abs(g8).max() > 0
    # Straight through: the float32 gradient at nearby (dequantized) inputs.
    assert np.abs(g8 - g).max() < 0.25 * np.abs(g).max(), path
  with pytest.raises(ValueError, match="fp8_attention"):
    pallas_fa.MultiHeadAttention(**kw, fp8_attention="row", rngs=nnx.Rngs(0))
