"""`decode_attention` on random feature combinations against the float64
oracle: cache forms (the query's dtype, int8, float8 with scales per entry,
per head, per cache or broadcast), contiguous or paged caches with shuffled
pages and garbage past every length, latent caches, a shared prefix, GQA,
speculative tokens and moved positions, causal or not, windows, the soft
cap, sinks, flex score_mod/mask_mod, splits and blocks; out and lse.

PALLAS_FA_PROPERTY_EXAMPLES=N runs N fresh examples per implementation, as
`test_conformance.test_property` does (BUILD.md)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import pallas_fa
from pallas_fa import flex
from tests import attention_testing
from tests.attention_testing import assert_close
from tests.attention_testing import rng

IMPLEMENTATIONS = ("chunked", "triton", "mosaic_tpu")
# The largest value of each 1-byte cache dtype, and what garbage they hold.
_TOP = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


@dataclasses.dataclass(frozen=True)
class DecodeCase:
  """One decode problem (see the module docstring)."""
  b: int
  t: int
  num_kv: int
  group: int
  h: int
  hv: int
  latent: bool
  dtype: str            # the query's (and a float cache's) dtype
  cache: str            # "same" or a 1-byte dtype's name
  scale_form: str       # "entry", "head", "cache", "lead" or "rows"
  page_size: int | None
  s_max: int
  zero_lengths: bool    # rows with no entries at all
  moved_positions: bool
  causal: bool
  window: tuple | None
  soft_cap: float | None
  sinks: bool
  prefix: int           # shared prefix length, 0 for none
  alibi: bool           # score_mod
  mask_mod: str | None  # "streaming" or "chunked_causal"
  splits: int | None
  block_kv: int | None


@st.composite
def _cases(draw, implementation):
  cache = draw(st.sampled_from(["same", "same", "int8", "float8_e4m3fn",
                                "float8_e5m2"]))
  # Pages the kernel reads whole: 16 keys (triton), 8 sublanes or 32 for a
  # 1-byte cache (mosaic_tpu); any size in jax.numpy.
  unit = {"chunked": 1, "triton": 16,
          "mosaic_tpu": 8 if cache == "same" else 32}[implementation]
  page_size = draw(st.one_of(st.none(), st.sampled_from(
      [4, 8, 16] if unit == 1 else [unit, 2 * unit])))
  if page_size is None:
    s_max = draw(st.integers(1, 160))
  else:
    s_max = page_size * draw(st.integers(1, max(1, 160 // page_size)))
  h = draw(st.sampled_from([16, 32, 64] + ([40] if unit == 1 else [])))
  latent = draw(st.booleans()) and draw(st.booleans())
  hv = draw(st.sampled_from([8, 16, h] if latent else [h, h, 16, 32]))
  block_kv = None
  if page_size is None and draw(st.booleans()):
    block_kv = draw(st.sampled_from(
        {"chunked": [8, 16, 48], "triton": [16, 32, 64],
         "mosaic_tpu": [32, 64]}[implementation]))
  scale_form = draw(st.sampled_from(["entry", "head", "cache", "lead",
                                     "rows"]))
  if page_size is not None and scale_form == "rows":
    scale_form = "lead"  # a position's scale has no per-page form
  return DecodeCase(
      b=draw(st.integers(1, 3)), t=draw(st.sampled_from([1, 1, 2, 4])),
      num_kv=draw(st.sampled_from([1, 2])),
      group=draw(st.sampled_from([1, 2, 4, 8])), h=h, hv=hv, latent=latent,
      dtype=draw(st.sampled_from(["float32", "float32", "bfloat16"])),
      cache=cache, scale_form=scale_form, page_size=page_size, s_max=s_max,
      zero_lengths=draw(st.integers(0, 9)) == 0,
      moved_positions=draw(st.integers(0, 4)) == 0,
      causal=draw(st.integers(0, 4)) > 0,
      window=draw(st.one_of(st.none(), st.none(), st.tuples(
          st.one_of(st.none(), st.integers(0, 60)),
          st.one_of(st.none(), st.integers(0, 4))))),
      soft_cap=draw(st.one_of(st.none(), st.none(), st.floats(1.0, 30.0))),
      sinks=draw(st.booleans()),
      prefix=draw(st.sampled_from([0, 0, 0, 1, 37, 80])),
      alibi=draw(st.integers(0, 5)) == 0,
      mask_mod=draw(st.sampled_from([None] * 6
                                    + ["streaming", "chunked_causal"])),
      splits=draw(st.one_of(st.none(), st.integers(1, 7))),
      block_kv=block_kv)


def _scale_shape(form, b, s_max, num_kv):
  return {"entry": (b, s_max, num_kv), "head": (num_kv,), "cache": (),
          "lead": (b, 1, num_kv), "rows": (1, s_max, 1)}[form]


def _quantized(gen, x, case):
  """(stored values, scales in the case's form, dequantized float64) of x
  [B, S, K, H]: scales a little above the amax of what they cover."""
  shape = _scale_shape(case.scale_form, *x.shape[:3])
  aligned = (1,) * (3 - len(shape)) + shape  # as it broadcasts on [B, S, K]
  covered = tuple(i for i, n in enumerate(aligned) if n == 1)
  amax = np.abs(x).max(-1).max(axis=covered, keepdims=True).reshape(shape)
  scale = np.maximum(amax * gen.uniform(1.0, 1.3) / _TOP[case.cache], 1e-6)
  scale = scale.astype(np.float32)
  y = x / np.asarray(scale, np.float64)[..., None]
  if case.cache == "int8":
    values = np.clip(np.round(y), -127, 127).astype(np.int8)
  else:
    values = np.asarray(jnp.asarray(y.astype(np.float32), case.cache))
  return values, scale, (np.asarray(values, np.float64)
                         * np.asarray(scale, np.float64)[..., None])


def _lead_pages(scale, table):
  """[B, 1, K] scales as [P, 1, K]: each page takes its row's."""
  pool = np.full((table.size + 2,) + scale.shape[1:], np.nan, np.float32)
  for row, pages in enumerate(table):
    pool[pages] = scale[row]
  return pool


def check_decode_case(implementation, case: DecodeCase, gen):
  """Runs `case` and the float64 oracle on fresh inputs; asserts out and
  lse by the project's rule (the float32 table, or the 16-bit one against
  the oracle of the rounded inputs)."""
  b, t, h, hv, s_max = case.b, case.t, case.h, case.hv, case.s_max
  num_kv, n = case.num_kv, case.num_kv * case.group
  dtype = jnp.dtype(case.dtype)
  rounded = lambda x: np.asarray(  # noqa: E731
      jnp.asarray(np.asarray(x, np.float32), dtype), np.float64)
  q = rounded(gen.standard_normal((b, t, n, h)))
  keys = gen.standard_normal((b, s_max, num_kv, h))
  values = None if case.latent else gen.standard_normal(
      (b, s_max, num_kv, hv))
  lengths = gen.integers(0 if case.zero_lengths else min(t, s_max),
                         s_max + 1, b).astype(np.int32)
  lengths[0] = s_max
  past = np.arange(s_max)[None] >= lengths[:, None]

  scales = {}
  if case.cache == "same":
    stored = {"key": rounded(keys)}
    if values is not None:
      stored["value"] = rounded(values)
    dequantized = dict(stored)
    garbage = np.nan
  else:
    stored, dequantized = {}, {}
    for name, x in (("key", keys), ("value", values)):
      if x is not None:
        stored[name], scales[name + "_scale"], dequantized[name] = (
            _quantized(gen, x, case))
    garbage = np.array(_TOP[case.cache] if case.cache == "int8"
                       else -_TOP[case.cache], np.float32)
    garbage = garbage.astype(stored["key"].dtype)
  for name in stored:  # Nothing past a length is ever read.
    stored[name] = np.array(stored[name], stored[name].dtype)
    stored[name][past] = garbage
  if case.scale_form == "entry":
    for name in scales:
      scales[name] = scales[name].copy()
      scales[name][past] = np.nan
  table = None
  if case.page_size is not None:
    table = attention_testing.page_table(gen, b, s_max // case.page_size)
    stored = {name: attention_testing.paged(x, table, case.page_size, garbage)
              for name, x in stored.items()}
    if case.scale_form == "entry":
      scales = {name: attention_testing.paged(x, table, case.page_size,
                                              np.float32(np.nan))
                for name, x in scales.items()}
    elif case.scale_form == "lead":
      scales = {name: _lead_pages(x, table) for name, x in scales.items()}

  s_p = case.prefix
  prefix = {}
  if s_p:
    prefix["prefix_key"] = rounded(gen.standard_normal((s_p, num_kv, h)))
    if not case.latent:
      prefix["prefix_value"] = rounded(
          gen.standard_normal((s_p, num_kv, hv)))
  q_pos = s_p + lengths[:, None] - t + np.arange(t)[None]
  if case.moved_positions:  # speculative tokens not at the end
    q_pos = q_pos - gen.integers(0, 3, (b, 1))

  kw = dict(is_causal=case.causal, local_window_size=case.window,
            logits_soft_cap=case.soft_cap)
  oracle_kw = dict(is_causal=case.causal, window=case.window,
                   soft_cap=case.soft_cap)
  if case.sinks:
    sinks = (1.0 + 1.5 * gen.standard_normal(n)).astype(np.float32)
    kw["sinks"] = jnp.asarray(sinks)
    oracle_kw["sinks"] = sinks
  if case.alibi:
    slopes = np.asarray(flex.alibi_slopes(n), np.float64)
    kw.update(score_mod=flex.alibi, score_mod_args=(flex.alibi_slopes(n),))
    oracle_kw["score_mod"] = lambda s, qi, ki: (
        s - slopes[None, :, None, None] * np.abs(qi - ki))
  if case.mask_mod == "streaming":
    window, first = int(gen.integers(1, 40)), int(gen.integers(0, 5))
    kw.update(mask_mod=flex.sliding_window_with_sinks,
              mask_mod_args=(window, first))
    oracle_kw["mask_mod"] = lambda qi, ki: (ki <= qi) & (
        (qi - ki < window) | (ki < first))
  elif case.mask_mod == "chunked_causal":
    chunk = int(gen.integers(1, 50))
    kw.update(mask_mod=flex.chunked_causal, mask_mod_args=(chunk,))
    oracle_kw["mask_mod"] = lambda qi, ki: (ki <= qi) & (
        qi // chunk == ki // chunk)

  cache_dtype = dtype if case.cache == "same" else case.cache
  out, lse = pallas_fa.decode_attention(
      jnp.asarray(q, dtype), jnp.asarray(stored["key"], cache_dtype),
      jnp.asarray(stored["value"], cache_dtype) if "value" in stored
      else None,
      jnp.asarray(lengths),
      block_table=None if table is None else jnp.asarray(table),
      query_positions=(jnp.asarray(q_pos, jnp.int32)
                       if case.moved_positions else None),
      num_splits=case.splits, block_kv=case.block_kv,
      implementation=implementation, return_residual=True,
      value_head_dim=hv if case.latent else None,
      **{name: jnp.asarray(x) for name, x in scales.items()},
      **{name: jnp.asarray(x, dtype) for name, x in prefix.items()}, **kw)
  assert out.shape == (b, t, n, hv) and out.dtype == dtype
  assert lse.shape == (b, t, n)

  # The oracle attends over [prefix; each row's own entries].
  k_all = dequantized["key"]
  v_all = k_all[..., :hv] if case.latent else dequantized["value"]
  if s_p:
    p_key = prefix["prefix_key"]
    p_value = p_key[..., :hv] if case.latent else prefix["prefix_value"]
    k_all = np.concatenate([np.broadcast_to(p_key, (b,) + p_key.shape),
                            k_all], axis=1)
    v_all = np.concatenate([np.broadcast_to(p_value, (b,) + p_value.shape),
                            v_all], axis=1)
  ref = attention_testing.decode_reference(
      q, k_all, v_all, s_p + lengths, q_pos, case.group, **oracle_kw)
  if dtype == jnp.float32:
    assert_close("out", out, ref[0])
    assert_close("lse", lse, ref[1])
  else:  # The 16-bit rule's own tolerance: the tiles' rounding of P.
    for name, x, r in (("out", out, ref[0]), ("lse", lse, ref[1])):
      assert_close(name, x, r, r, dtype)


@pytest.mark.slow_for("mosaic_tpu")  # its interpreter is the slowest
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_decode_property(implementation):
  """Random decode calls (every feature at once) against the oracle."""
  attention_testing.check_property(
      _cases(implementation),
      lambda case: check_decode_case(
          implementation, case,
          rng(implementation, repr(case), "decode property")),
      4 if implementation == "chunked" else 2)
