"""Float8 `flash_attention` calls on random feature combinations against
XLA's attention of the dequantized inputs: e4m3 and e5m2 (mixed), scales
per token, head or tensor (each input its own), GQA, a value head dim,
ragged lengths with NaN values and inf scales stored past them, causal,
windows, the soft cap, sinks, a bias, dropout, ALiBi, and the result in
float32, bfloat16 or float16; out and lse.

PALLAS_FA_PROPERTY_EXAMPLES=N runs N fresh examples per implementation, as
`test_conformance.test_property` does (BUILD.md)."""

from __future__ import annotations

import dataclasses

import attention_testing
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import block_sizes_for
from hypothesis import strategies as st
from test_fp8 import P_ROUNDING

import pallas_fa
from pallas_fa import quantize
from pallas_fa import testing

IMPLEMENTATIONS = ("chunked", "triton", "mosaic_tpu")
_NAMES = ("query", "key", "value")


@dataclasses.dataclass(frozen=True)
class Fp8Case:
  """One float8 call (see the module docstring)."""
  b: int
  t: int
  s: int
  num_kv: int
  group: int
  h: int
  hv: int
  formats: tuple           # q, k, v: "e4m3" or "e5m2"
  granularities: tuple     # q, k, v: "token", "head" or "tensor"
  magnitudes: tuple        # q, k, v: log10 of their spread
  out_dtype: str
  causal: bool
  window: tuple | None
  kv_lengths: bool
  q_lengths: bool
  garbage: bool            # NaN values and inf scales past the lengths
  soft_cap: float | None
  sinks: bool
  bias: str | None         # "full" or "heads"
  dropout: bool
  alibi: bool


@st.composite
def _cases(draw):
  three = lambda s: st.tuples(s, s, s)  # noqa: E731
  return Fp8Case(
      b=draw(st.integers(1, 2)), t=draw(st.integers(1, 200)),
      s=draw(st.integers(1, 200)), num_kv=draw(st.sampled_from([1, 2])),
      group=draw(st.sampled_from([1, 2, 4])),
      h=draw(st.sampled_from([8, 32, 64, 100, 128])),
      hv=draw(st.sampled_from([None, None, 16, 160])) or 0,
      formats=draw(three(st.sampled_from(["e4m3", "e4m3", "e5m2"]))),
      granularities=draw(three(st.sampled_from(["token", "head",
                                                "tensor"]))),
      magnitudes=draw(three(st.floats(-1.0, 1.0))),
      out_dtype=draw(st.sampled_from(["bfloat16", "float32", "float16"])),
      causal=draw(st.booleans()),
      window=draw(st.one_of(st.none(), st.none(), st.tuples(
          st.integers(0, 50), st.integers(0, 50)))),
      kv_lengths=draw(st.booleans()), q_lengths=draw(st.integers(0, 3)) == 0,
      garbage=draw(st.booleans()),
      soft_cap=draw(st.one_of(st.none(), st.none(), st.floats(2.0, 30.0))),
      sinks=draw(st.integers(0, 3)) == 0,
      bias=draw(st.sampled_from([None, None, None, "full", "heads"])),
      dropout=draw(st.integers(0, 5)) == 0,
      alibi=draw(st.integers(0, 5)) == 0)


def _inputs(case: Fp8Case, gen):
  """(float8 values, scales, keyword arguments) of a case."""
  n = case.num_kv * case.group
  shapes = ((case.b, case.t, n, case.h), (case.b, case.s, case.num_kv, case.h),
            (case.b, case.s, case.num_kv, case.hv or case.h))
  dtypes = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
  values, scales = [], []
  for shape, fmt, granularity, magnitude in zip(
      shapes, case.formats, case.granularities, case.magnitudes):
    x = testing.normal(gen, shape) * 10.0 ** magnitude
    x8, scale = quantize.quantize_fp8(x, granularity, dtypes[fmt])
    values.append(x8)
    scales.append(scale)
  kw = dict(is_causal=case.causal, local_window_size=case.window,
            logits_soft_cap=case.soft_cap)
  if case.kv_lengths:
    lengths = gen.integers(0, case.s + 1, case.b)
    kw["key_value_seq_lengths"] = jnp.asarray(lengths, jnp.int32)
    if case.garbage:  # Past the lengths: NaN values, inf scales.
      past = np.arange(case.s)[None] >= lengths[:, None]  # [B, S]
      for i in (1, 2):
        x = np.asarray(values[i], np.float32)
        x[past] = np.nan
        values[i] = jnp.asarray(x, values[i].dtype)
        if case.granularities[i] == "token":
          scale = np.array(scales[i])
          scale[past] = np.inf
          scales[i] = jnp.asarray(scale)
  if case.q_lengths:
    kw["query_seq_lengths"] = jnp.asarray(
        gen.integers(0, case.t + 1, case.b), jnp.int32)
  if case.sinks:
    kw["sinks"] = testing.normal(gen, (n,))
  if case.bias is not None:
    kw["bias"] = testing.normal(gen, (case.b, n, case.t, case.s)
                                if case.bias == "full" else (1, n, 1, case.s))
  if case.dropout:
    kw.update(dropout_rate=0.2, dropout_rng=int(gen.integers(0, 1 << 20)))
  if case.alibi:
    kw.update(score_mod=pallas_fa.flex.alibi,
              score_mod_args=(jnp.linspace(0.1, 0.5, n),))
  return values, scales, kw


def check_fp8_case(implementation, case: Fp8Case, gen):
  """The float8 call against XLA's float32 attention of the dequantized
  inputs (values past the lengths zeroed: they stand for nothing):
  `testing`'s float32 rule for backends that compute in float32; within
  their rounding of P (`test_fp8.P_ROUNDING`) for the others; the result
  rounded to its dtype either way."""
  values, scales, kw = _inputs(case, gen)
  out_dtype = jnp.dtype(case.out_dtype)
  out, lse = pallas_fa.flash_attention(
      *values, **{f"{name}_scale": s for name, s in zip(_NAMES, scales)},
      out_dtype=out_dtype, implementation=implementation,
      block_sizes=block_sizes_for(implementation), return_residual=True,
      **kw)
  assert out.dtype == out_dtype and lse.dtype == jnp.float32
  deq = [quantize.dequantize(x, s) for x, s in zip(values, scales)]
  if case.kv_lengths:
    past = (np.arange(case.s)[None] >= np.asarray(
        kw["key_value_seq_lengths"])[:, None])[..., None, None]
    deq[1:] = [jnp.where(past, 0.0, x) for x in deq[1:]]
  ref, ref_lse = pallas_fa.flash_attention(
      *deq, implementation="xla", return_residual=True, **kw)
  testing.assert_close("lse", lse, ref_lse)
  out = np.asarray(out, np.float64)
  assert np.isfinite(out).all()
  if implementation not in P_ROUNDING and out_dtype == jnp.float32:
    testing.assert_close("out", out, ref)
    return
  v_max = float(np.abs(np.asarray(deq[2])).max(initial=0.0))
  bound = (P_ROUNDING.get(implementation, 0.0) * v_max
           / (1 - kw.get("dropout_rate", 0.0))
           + float(jnp.finfo(out_dtype).eps)
           * float(np.abs(np.asarray(ref)).max(initial=0.0)))
  error = float(np.abs(out - np.asarray(ref, np.float64)).max(initial=0.0))
  assert error <= bound, (error, bound)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fp8_property(implementation):
  """Random float8 calls (every feature at once) against the reference."""
  attention_testing.check_property(
      _cases(),
      lambda case: check_fp8_case(
          implementation, case,
          testing.rng(implementation, repr(case), "fp8 property")),
      4 if implementation == "chunked" else 2)
