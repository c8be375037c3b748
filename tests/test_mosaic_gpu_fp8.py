"""Tests of `mosaic_gpu`'s float8 (e4m3) forward that run without a GPU.

* The kernel lowers ahead of time for an H100 (8-bit wgmma operands, the
  transposed V ring and the P conversion included).
* The key order of the e4m3 P operand (`forward_fp8.p_operand`, from the
  wgmma register fragments of the PTX ISA) matches the order `layout_v`
  gives V^T.
* The kernel body runs in the Mosaic GPU interpreter against the float64
  attention of the dequantized inputs; `check` declines what it cannot run.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import gpu_jax_only
from attention_testing import needs_hopper
from attention_testing import race_verdicts

import pallas_fa
from pallas_fa import api
from pallas_fa import gpu_target
from pallas_fa import mosaic_gpu
from pallas_fa import quantize
from pallas_fa import testing
from pallas_fa.mosaic_gpu import forward_fp8
from pallas_fa.mosaic_gpu import kernel

E4M3 = jnp.float8_e4m3fn

needs_interpreter = pytest.mark.skipif(
    kernel.interpret_params() is None or jax.default_backend() != "cpu",
    reason="the Mosaic GPU interpreter runs on CPU only")


def _quantized(gen, b, t, s, n, kh, h, granularity):
  shapes = ((b, t, n, h), (b, s, kh, h), (b, s, kh, h))
  pairs = [quantize.quantize_fp8(testing.normal(gen, shape) * 2.0,
                                 granularity) for shape in shapes]
  return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _scales(scales):
  return dict(zip(("query_scale", "key_scale", "value_scale"), scales))


def _oracle(values, scales, causal, soft_cap=None):
  """float64 (out, lse, reach) of the dequantized inputs (numpy); reach:
  per query row, the largest sum_i |q_i k_i| * scale over its visible keys
  (what an accumulator's relative rounding of Q K^T scales with)."""
  q, k, v = (np.asarray(quantize.dequantize(x, s), np.float64)
             for x, s in zip(values, scales))
  g = q.shape[2] // k.shape[2]
  k, v = (np.repeat(x, g, axis=2) for x in (k, v))
  q, k, v = (np.moveaxis(x, 2, 1) for x in (q, k, v))
  scale = 1 / np.sqrt(q.shape[-1])
  s = q @ np.swapaxes(k, -1, -2) * scale
  reach = np.abs(q) @ np.swapaxes(np.abs(k), -1, -2) * scale
  if soft_cap is not None:
    s = soft_cap * np.tanh(s / soft_cap)
  if causal:
    visible = np.tril(np.ones(s.shape[-2:], bool))
    s = np.where(visible, s, -np.inf)
    reach = np.where(visible, reach, 0.0)
  m = s.max(-1, keepdims=True)
  p = np.exp(s - m)
  out = (p / p.sum(-1, keepdims=True)) @ v
  lse = np.log(p.sum(-1)) + m[..., 0]
  return (np.moveaxis(out, 1, 2), np.moveaxis(lse, 1, 2),
          np.moveaxis(reach.max(-1), 1, 2))


# Hopper's 8-bit wgmma adds its products into an accumulator narrower than
# float32 (DeepSeek-V3's report measured about 14 bits kept), so a compiled
# logit is off by a fraction of sum_i |q_i k_i|, not of the logit: an H200
# run (b85705a) measured up to 2.6e-4 of it in the logsumexp at H = 256.
# The interpreter's products are float32.
_WGMMA_FP8_ROUNDING = 2.0 ** -10


def _assert_near_oracle(out, lse, values, scales, causal, soft_cap=None, *,
                        compiled=False):
  """A bfloat16 result within e4m3 P's error of the float64 attention of
  the dequantized inputs (3 mantissa bits: the error of FlashAttention-3
  style float8 attention, a few percent of |V|), its lse near exact
  (compiled: within the 8-bit products' accumulation, `reach`)."""
  assert out.dtype == jnp.bfloat16
  want_out, want_lse, reach = _oracle(values, scales, causal, soft_cap)
  err = np.abs(np.asarray(out, np.float64) - want_out).max()
  assert err <= 0.05 * np.abs(want_out).max() + 1e-2, err
  bound = 2e-3 + (_WGMMA_FP8_ROUNDING * reach if compiled else 0.0)
  lse_err = np.abs(np.asarray(lse, np.float64) - want_lse)
  assert (lse_err <= bound).all(), (lse_err.max(), (lse_err / bound).max())


def _interpreted(values, scales, causal, *, soft_cap=None, **tiles):
  """(out, lse) of the float8 call in the Mosaic GPU interpreter, 64 x 64
  tiles unless `tiles` say otherwise."""
  bs = mosaic_gpu.MosaicGpuBlockSizes(
      **{"block_q": 64, "block_kv": 64, "interpret": True, **tiles})
  return pallas_fa.flash_attention(
      *values, **_scales(scales), is_causal=causal, logits_soft_cap=soft_cap,
      implementation="mosaic_gpu", block_sizes=bs, return_residual=True)


def test_p_operand_key_order_matches_layout_v():
  """P V == P' V' where P' is P as `p_operand` packs it: a thread's
  float32 accumulator values (PTX wgmma D fragment: row lane / 4 (+ 8),
  columns 8j + 2 (lane % 4) + {0, 1}) placed in the 8-bit A fragment
  (row lane / 4 (+ 8), columns 16i + 4 (lane % 4) + {0..3}), two 8-column
  groups per 16 keys; V' is `layout_v`'s compiled V^T."""
  gen = np.random.default_rng(0)
  m, s, hv = 64, 64, 32
  p = gen.standard_normal((m, s))
  v = gen.standard_normal((1, s, 1, hv)).astype(np.float32)
  packed = np.empty_like(p)
  for lane in range(32):
    c = lane % 4
    for row in (lane // 4, lane // 4 + 8):
      for rows in range(0, m, 16):
        for i in range(s // 16):
          # What the thread holds, in register order: groups 2i, 2i + 1.
          held = [p[rows + row, 8 * (2 * i + grp) + 2 * c + e]
                  for grp in (0, 1) for e in (0, 1)]
          packed[rows + row, 16 * i + 4 * c:16 * i + 4 * c + 4] = held
  vt = np.asarray(forward_fp8.layout_v(jnp.asarray(v), interpret=False))
  np.testing.assert_allclose(packed @ vt[0, 0].T, p @ v[0, :, 0],
                             rtol=1e-10, atol=1e-10)
  assert sorted(forward_fp8.KEY_ORDER) == list(range(16))


def test_check_declines_what_the_float8_kernel_cannot_run():
  gen = testing.rng("mosaic_gpu fp8 check")
  values, scales = _quantized(gen, 1, 64, 64, 2, 2, 64, "head")
  bs = mosaic_gpu.MosaicGpuBlockSizes(interpret=True)
  backend = api.get_backend("mosaic_gpu")
  for kw, reason in (
      (dict(out_dtype=jnp.float32), "writes bfloat16 or float16"),
      (dict(dropout_rate=0.1, dropout_rng=1), "dropout"),
      (dict(block_sizes=mosaic_gpu.MosaicGpuBlockSizes(
          block_kv=32, interpret=True)), "multiple of 64"),
  ):
    call = api.canonicalize(*values, **_scales(scales), float8=True,
                            **{"block_sizes": bs, **kw})
    with pytest.raises(NotImplementedError, match=reason):
      backend.check_call(*call.arrays)
  e5m2 = tuple(x.astype(jnp.float8_e5m2) for x in values)
  call = api.canonicalize(*e5m2, **_scales(scales), float8=True,
                          block_sizes=bs)
  with pytest.raises(NotImplementedError, match="float8"):
    backend.check_call(*call.arrays)


@pytest.mark.parametrize("overlap, poly", [(False, 0), (True, 0), (True, 4)])
def test_float8_forward_lowers_for_hopper(overlap, poly):
  gen = testing.rng("mosaic_gpu fp8 lower")
  values, scales = _quantized(gen, 1, 256, 256, 4, 2, 128, "token")
  bs = mosaic_gpu.MosaicGpuBlockSizes(
      intra_overlap=True, poly_exp2=poly) if overlap else None

  def fwd(*args):
    return pallas_fa.flash_attention(
        *args[:3], **_scales(args[3:]), is_causal=True,
        implementation="mosaic_gpu", block_sizes=bs)

  with gpu_target.compile_for(gpu_target.H100):
    text = jax.jit(fwd).trace(*values, *scales).lower(
        lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 1


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("granularity, causal, overlap, poly, two_level", [
    ("head", True, False, 0, False), ("token", False, False, 0, False),
    ("head", True, True, 0, False), ("head", False, True, 0, False),
    ("token", True, True, 0, False), ("token", False, True, 0, False),
    ("token", True, True, 2, False), ("token", True, False, 0, True),
    ("head", False, False, 0, True)])
def test_interpreted_float8_forward(granularity, causal, overlap, poly,
                                    two_level):
  """Ragged lengths, GQA, a head dim padded to 64; head scales fold into
  the row factors, token scales stream with K and V. With `overlap` the
  software-pipelined key loop (`intra_overlap`: P_{j-1} V_{j-1} with
  Q K_j^T; token scales wait for V_j with K_j); with `poly`, half the
  exponentials by the cubic (`poly_exp2`); with `two_level`, each tile's
  P V added to the float32 accumulator (`float8_two_level`)."""
  gen = testing.rng("mosaic_gpu fp8", granularity, causal)
  values, scales = _quantized(gen, 1, 100, 150, 2, 1, 48, granularity)
  out, lse = _interpreted(values, scales, causal, intra_overlap=overlap,
                          poly_exp2=poly, float8_two_level=two_level)
  _assert_near_oracle(out, lse, values, scales, causal)


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("granularity, causal", [("token", True),
                                                 ("head", False)])
def test_interpreted_float8_forward_256_key_tiles(granularity, causal):
  """256-key tiles in two stages (`block_kv=256`): 300 keys are a full
  tile and one mostly padding, and the causal diagonal crosses both."""
  gen = testing.rng("mosaic_gpu fp8 256 keys", granularity, causal)
  values, scales = _quantized(gen, 1, 300, 300, 2, 1, 48, granularity)
  out, lse = _interpreted(values, scales, causal, block_kv=256,
                          num_stages=2)
  _assert_near_oracle(out, lse, values, scales, causal)


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
def test_interpreted_float8_forward_without_pingpong_is_race_free(
    monkeypatch):
  """The two consumers free-running (`pingpong=False`: no turns on the
  tensor cores, each consumer as far ahead as the ring lets it), in the
  default key loop and the software-pipelined one, under the race
  detector: a two-slot ring refilled as soon as both consumers release a
  slot, two CTAs, several units, token scales streamed with K and V. The
  ping-pong schedule only adds orderings, so a race-free run without it
  covers the default's rings too."""
  verdicts, reset = race_verdicts(
      monkeypatch,
      lambda spec, name, races: (name, spec.pingpong, spec.intra_overlap,
                                 races))
  gen = testing.rng("mosaic_gpu fp8 free-running consumers")
  values, scales = _quantized(gen, 1, 200, 300, 2, 1, 32, "token")
  results = []
  try:
    with jax.disable_jit():
      for overlap in (False, True):
        results.append(_interpreted(
            values, scales, True, pingpong=False, intra_overlap=overlap,
            num_stages=2, num_ctas=2))
  finally:
    reset()
  assert [v[:3] for v in verdicts] == [
      ("pfa_mgpu_forward_fp8", False, False),
      ("pfa_mgpu_forward_fp8", False, True)], verdicts
  assert not any(v[3] for v in verdicts), verdicts
  for out, lse in results:
    _assert_near_oracle(out, lse, values, scales, True)


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("causal", [True, False])
def test_interpreted_float8_forward_signed_query_scales(causal):
  """Zero and negative query scales are legal and exact. The kernel folds
  the row factor into the exponent (the max on the raw products) for
  64-row tiles whose factors are all positive, zeros included (made the
  smallest normal), and multiplies it into the logits first in tiles with
  a negative one (`forward_fp8.row_factors`): here head 0's first tile
  holds a zero, its second a negative and a zero factor, head 1's first
  tile is all negative."""
  gen = testing.rng("mosaic_gpu fp8 signed scales", causal)
  values, (qs, ks, vs) = _quantized(gen, 1, 100, 150, 2, 1, 48, "token")
  sign = np.ones(qs.shape, np.float32)
  sign[:, 70, 0] = -1.0
  sign[:, 5, 0] = sign[:, 75, 0] = 0.0
  sign[:, :64, 1] = -1.0
  scales = (qs * sign, ks, vs)
  _, mixed = forward_fp8.row_factors(
      jnp.swapaxes(jnp.pad(scales[0], ((0, 0), (0, 28), (0, 0))), 1, 2), 64)
  np.testing.assert_array_equal(mixed[0], [[0, 1], [1, 0]])
  out, lse = _interpreted(values, scales, causal)
  _assert_near_oracle(out, lse, values, scales, causal)


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("granularity", ["head", "token"])
def test_interpreted_float8_forward_soft_cap(granularity):
  """A soft cap acts on the natural logits: the row factors stay natural
  there (without one they carry log2(e)), the cap and base change run in
  the kernel; with per-token value scales P_SCALE rides in their factors,
  else in the softmax's offset."""
  gen = testing.rng("mosaic_gpu fp8 soft cap", granularity)
  values, scales = _quantized(gen, 1, 100, 150, 2, 1, 48, granularity)
  out, lse = _interpreted(values, scales, True, soft_cap=2.0)
  _assert_near_oracle(out, lse, values, scales, True, soft_cap=2.0)
  # The cap matters at this size: the uncapped attention is far off.
  uncapped, _, _ = _oracle(values, scales, True)
  assert np.abs(np.asarray(out, np.float64) - uncapped).max() > 0.1


@needs_hopper
@pytest.mark.parametrize("granularity, causal, h, loop", [
    ("head", True, 128, None), ("token", False, 128, None),
    ("tensor", True, 64, None), ("head", False, 256, None),
    ("head", False, 128, "overlap"), ("token", True, 128, "overlap"),
    ("token", False, 256, "overlap"), ("head", False, 128, "free"),
    ("token", True, 128, "free"), ("token", False, 128, "free_overlap")])
def test_compiled_float8_forward(granularity, causal, h, loop):
  """The compiled kernel (8-bit wgmma, P packed in registers against the
  reordered V^T, `p_operand`) against the float64 attention of the
  dequantized inputs: ragged lengths, GQA, several key tiles. `loop`:
  None, the default; "overlap", the software-pipelined key loop
  (`intra_overlap`); "free", the consumers without ping-pong;
  "free_overlap", both."""
  gen = testing.rng("mosaic_gpu fp8 compiled", granularity, causal, h)
  values, scales = _quantized(gen, 2, 333, 517, 4, 2, h, granularity)
  # Otherwise the default forward tiles of the head dim.
  bs = None if loop is None else mosaic_gpu.MosaicGpuBlockSizes(
      block_kv=64 if h > 128 else 128, num_stages=3 if h > 128 else 4,
      intra_overlap="overlap" in loop, pingpong="free" not in loop)
  out, lse = pallas_fa.flash_attention(
      *values, **_scales(scales), is_causal=causal,
      implementation="mosaic_gpu", return_residual=True, block_sizes=bs)
  _assert_near_oracle(out, lse, values, scales, causal, compiled=True)


def _rel_rms(x, ref):
  x = np.asarray(x, np.float64)
  return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref ** 2)))


def _rows_attention(q, k, v, *, p_dtype=None):
  """float64 attention (numpy) of query rows q [R, H] over every key of
  k, v [S, H], scale 1/sqrt(H); with `p_dtype`, P rounded to it (its
  largest entry 1) before P V, as an FP8 kernel feeds its second
  product (the float8 emulation of `test_fp8`)."""
  s = q @ k.T / np.sqrt(q.shape[-1])
  p = np.exp(s - s.max(-1, keepdims=True))
  rounded = p if p_dtype is None else np.asarray(
      jnp.asarray(p, jnp.float32).astype(p_dtype), np.float64)
  return rounded @ v / p.sum(-1, keepdims=True)


_LONG_CONTEXT = (4096, 32768, 131072)
_LONG_CONTEXT_ROWS = 128


@functools.cache
def _long_context_case(t: int):
  """Fresh inputs [1, t, 1, 128] of the long-context test (the same for
  both of its cases) and the query rows it checks."""
  gen = testing.rng("mosaic_gpu fp8 long context", t)
  wide = tuple(testing.normal(gen, (1, t, 1, 128)) for _ in range(3))
  return wide, np.linspace(0, t - 1, _LONG_CONTEXT_ROWS).astype(int)


@functools.cache
def _long_context_bf16_error(t: int) -> float:
  """The compiled bf16 forward's error on `_long_context_case(t)`."""
  wide, rows = _long_context_case(t)
  narrow = [x.astype(jnp.bfloat16) for x in wide]
  q, k, v = (np.asarray(x, np.float64)[0, :, 0] for x in narrow)
  out = pallas_fa.flash_attention(*narrow, implementation="mosaic_gpu")
  return _rel_rms(np.asarray(out, np.float64)[0, rows, 0],
                  _rows_attention(q[rows], k, v))


@needs_hopper
@pytest.mark.parametrize("two_level", [False, True])
def test_compiled_float8_error_does_not_grow_with_length(two_level):
  """The long-context trap of FP8 attention (a vLLM study: FlashAttention-3
  in FP8 fell from 91 % to 13 % on a 128k needle test, fixed by float32
  P V partials): at T = S = 4k, 32k and 128k, the float8 forward's error
  against the float64 attention of its dequantized inputs (on 128 query
  rows spread over the sequence) stays within P's e4m3 rounding (the
  emulated float8 attention's error) at every length, and grows with T no
  faster than the bfloat16 forward's against its own inputs' attention;
  with `two_level` (`float8_two_level`), each tile's P V added in
  float32, the fix should the default accumulation fail here."""
  bs = mosaic_gpu.MosaicGpuBlockSizes(float8_two_level=True) if (
      two_level) else None
  fp8, emulated, bf16 = [], [], []
  for t in _LONG_CONTEXT:
    wide, rows = _long_context_case(t)
    pairs = [quantize.quantize_fp8(x, "head") for x in wide]
    values, scales = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    q, k, v = (np.asarray(quantize.dequantize(x, sc), np.float64)[0, :, 0]
               for x, sc in zip(values, scales))
    ref = _rows_attention(q[rows], k, v)
    out = pallas_fa.flash_attention(*values, **_scales(scales),
                                    implementation="mosaic_gpu",
                                    block_sizes=bs)
    fp8.append(_rel_rms(np.asarray(out, np.float64)[0, rows, 0], ref))
    emulated.append(_rel_rms(_rows_attention(q[rows], k, v, p_dtype=E4M3),
                             ref))
    bf16.append(_long_context_bf16_error(t))
  report = dict(fp8=fp8, emulated=emulated, bf16=bf16)
  # The compiled Q K^T also rounds in the 8-bit products' accumulator
  # (`_WGMMA_FP8_ROUNDING`), which the emulation does not.
  assert all(a <= 1.5 * b for a, b in zip(fp8, emulated)), report
  assert fp8[-1] / fp8[0] <= 1.5 * max(bf16[-1] / bf16[0], 1.0), report
