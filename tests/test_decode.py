"""decode_attention against flash_attention on the gathered cache."""

from __future__ import annotations

import collections
import functools
import os
import re
import types

import chex
import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import pallas_fa
from pallas_fa import decode
from pallas_fa import gpu_target
from pallas_fa import online_softmax
from tests import attention_testing
from tests.attention_testing import assert_close
from tests.attention_testing import rng


def _cache(gen, b, s_max, num_kv, h, hv, dtype, *, page_size=None):
  """Random K/V, contiguous or paged with shuffled pages.

  Returns (key, value, block_table, contiguous key, contiguous value); the
  pages nobody uses hold NaN, which must never leak.
  """
  k = gen.standard_normal((b, s_max, num_kv, h)).astype(np.float32)
  v = gen.standard_normal((b, s_max, num_kv, hv)).astype(np.float32)
  if page_size is None:
    return k, v, None, k, v
  table = attention_testing.page_table(gen, b, -(-s_max // page_size))
  return (attention_testing.paged(k, table, page_size, np.nan),
          attention_testing.paged(v, table, page_size, np.nan), table, k, v)


def _check(*, b=2, t=1, n=4, num_kv=1, h=32, hv=None, s_max=200,
           dtype=jnp.float32, page_size=None, window=None, soft_cap=None,
           positions=False, num_splits=None, block_kv=None,
           implementation=None, sinks=False, lengths=None, name=""):
  hv = hv or h
  gen = rng("decode", name, b, t, n, num_kv, h, hv, s_max, str(dtype),
            page_size, window, soft_cap, positions, num_splits, block_kv,
            implementation, sinks)
  q = gen.standard_normal((b, t, n, h)).astype(np.float32)
  k, v, table, k_flat, v_flat = _cache(
      gen, b, s_max, num_kv, h, hv, dtype, page_size=page_size)
  if lengths is None:
    lengths = gen.integers(t, s_max + 1, b).astype(np.int32)
    lengths[0] = s_max  # one full sequence
  lengths = np.asarray(lengths, np.int32)
  kw = dict(is_causal=True, local_window_size=window,
            logits_soft_cap=soft_cap)
  if sinks:
    kw["sinks"] = jnp.asarray(2.0 + 1.5 * gen.standard_normal(n), jnp.float32)
  q_pos = lengths[:, None] - t + np.arange(t, dtype=np.int32)[None]
  if positions:  # e.g. speculative tokens not at the end of the cache
    q_pos = q_pos - gen.integers(0, 3, (b, 1)).astype(np.int32)
  # Positions past each length hold NaN in the contiguous cache as well.
  invalid = np.arange(s_max)[None] >= lengths[:, None]
  k_flat = np.where(invalid[..., None, None], np.nan, k_flat)
  v_flat = np.where(invalid[..., None, None], np.nan, v_flat)
  if page_size is None:
    k, v = k_flat, v_flat
  else:  # and in the used pages' rows past the length
    for row, pages in enumerate(table):
      for i, page in enumerate(pages):
        tail = i * page_size + np.arange(page_size) >= lengths[row]
        k[page, tail] = v[page, tail] = np.nan
  cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731

  out, lse = pallas_fa.decode_attention(
      cast(q), cast(k), cast(v), jnp.asarray(lengths),
      block_table=None if table is None else jnp.asarray(table),
      query_positions=jnp.asarray(q_pos) if positions else None,
      num_splits=num_splits, block_kv=block_kv, implementation=implementation,
      return_residual=True, **kw)
  assert out.shape == (b, t, n, hv) and out.dtype == dtype
  assert lse.shape == (b, t, n)

  def reference(dtype):
    # The reference reads the whole cache, so padding must be finite there.
    kf = jnp.asarray(np.nan_to_num(k_flat), dtype)
    vf = jnp.asarray(np.nan_to_num(v_flat), dtype)
    if max(h, hv) > 256:  # Past flash_attention's head dims: numpy.
      assert dtype == jnp.float32
      return attention_testing.decode_reference(
          q, kf, vf, lengths, q_pos, n // num_kv)
    return pallas_fa.flash_attention(
        jnp.asarray(q, dtype), kf, vf, key_value_seq_lengths=lengths,
        query_positions=jnp.asarray(q_pos), implementation="xla",
        precision="highest", return_residual=True, **kw)

  ref32 = reference(jnp.float32)
  same = (None, None) if dtype == jnp.float32 else reference(dtype)
  assert_close("out", out, ref32[0], same[0], dtype)
  assert_close("lse", lse, ref32[1], same[1], dtype)


@pytest.mark.parametrize("group", [1, 4, 8, 32])
def test_gqa_ratios(group):
  _check(n=group * 2 if group < 32 else 32, num_kv=2 if group < 32 else 1,
         t=2, name="gqa")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("paged", [False, True])
def test_dtypes_and_layouts(dtype, paged):
  _check(dtype=dtype, num_kv=2, n=8, t=4, page_size=16 if paged else None,
         name="dtypes")


@pytest.mark.parametrize("h", [64, 128, 576, 4096])
def test_head_dims(h):
  _check(h=h, s_max=64 if h == 4096 else 150, n=4, num_kv=2,
         page_size=32 if h == 576 else None, name="head dims")


@pytest.mark.parametrize("num_splits, block_kv", [
    (1, 16), (3, 16), (7, 32), (64, 16), (None, None)])
def test_any_split_and_block(num_splits, block_kv):
  _check(num_splits=num_splits, block_kv=block_kv, t=3, n=4, num_kv=2,
         name="splits")


def test_default_block_spans_a_bounded_step_over_all_rows():
  # One step of the contiguous path reads every row's block: its bytes, not
  # a row's, are what the default bounds (at B = 16 a 1k-key block made
  # 64 MiB steps, 3x slower on a CPU than 4 MiB ones).
  blocks = []
  for batch in (1, 4, 16, 64, 4096):
    block = decode.chunked.default_block(32768, batch, 8, 128, jnp.float32)
    step_bytes = batch * block * 8 * 128 * 4
    assert 16 <= block <= 2048 and block & (block - 1) == 0, block
    assert step_bytes <= decode.chunked._BLOCK_BYTES or block == 16, (
        batch, block)
    blocks.append(block)
  assert blocks == sorted(blocks, reverse=True) and blocks[0] > blocks[2]
  # A short cache gets one block no longer than itself (rounded up).
  assert decode.chunked.default_block(100, 1, 8, 128, jnp.float32) == 128


@pytest.mark.parametrize("cache_dtype, per_core", [
    (None, 2), (jnp.bfloat16, 2), (jnp.float32, 2), (jnp.int8, 4),
    (jnp.float8_e4m3fn, 4), (jnp.float8_e5m2, 4)])
def test_default_splits_fill_four_programs_per_core_over_one_byte(
    cache_dtype, per_core):
  """Two programs per streaming multiprocessor (an H100's 132 when no GPU
  says otherwise), four over a 1-byte cache; one split on a CPU."""
  assert decode.default_num_splits(
      1, 8, 512, "gpu", cache_dtype=cache_dtype) == per_core * 132 // 8
  assert decode.default_num_splits(
      2, 8, 4, "gpu", cache_dtype=cache_dtype) == 4
  assert decode.default_num_splits(
      1, 8, 512, "cpu", cache_dtype=cache_dtype) == 1


@pytest.mark.parametrize("t, num_splits, paged", [
    (4, 1, False), (1, 3, False), (2, 1, True)])
def test_one_sequence_one_kv_head(t, num_splits, paged):
  # Every batch axis of the decode einsums is 1, so they run as plain matrix
  # products (`decode.chunked._einsum`); with 3 splits the split axis stays.
  _check(b=1, t=t, n=8, num_kv=1, num_splits=num_splits,
         block_kv=None if paged else 32, page_size=16 if paged else None,
         soft_cap=30.0, name="one sequence")


def test_paged_splits_and_features():
  _check(page_size=8, num_splits=5, window=(40, 0), soft_cap=20.0,
         positions=True, t=4, n=8, num_kv=2, hv=48, name="features")


def test_window_softcap_positions_value_head_dim():
  _check(window=17, soft_cap=5.0, positions=True, t=2, hv=24,
         name="contiguous features")


# The Pallas-Triton kernel, interpreted: few tiny cases (each runs its grid
# one program at a time).
@pytest.mark.parametrize("dtype, paged, group", [
    (jnp.float32, False, 1), (jnp.bfloat16, True, 4)])
def test_triton_layouts(dtype, paged, group):
  _check(implementation="triton", dtype=dtype, t=2, n=2 * group, num_kv=2,
         h=64, s_max=70, page_size=16 if paged else None, num_splits=3,
         name="triton")


@pytest.mark.parametrize("dtype, page_size, t, group, window, splits", [
    (jnp.bfloat16, 16, 1, 4, None, 3),
    (jnp.float32, 16, 3, 2, (50, 0), 4),
    (jnp.bfloat16, 32, 2, 4, (70, 0), 2),
    # A page size the block does not divide: blocks cross page edges.
    (jnp.float32, 48, 2, 1, None, 3),
])
def test_triton_blocks_span_small_pages(dtype, page_size, t, group, window,
                                        splits):
  """Pages smaller than the block (vLLM's 16 keys) are read several to a
  64-key block, each key's row gathered through its own table entry:
  shuffled pages, NaN in the unused ones and past every length, lengths
  that end mid-page and mid-block, a last block past the table (S_max =
  200 is no whole number of pages or blocks), GQA, new tokens, a
  window."""
  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415
  assert triton_decode.block_for(
      head_dim=64, value_head_dim=64, groups=group, new_tokens=t,
      page_size=page_size, block_kv=None) == 64
  _check(implementation="triton", dtype=dtype, b=4, t=t, n=2 * group,
         num_kv=2, h=64, s_max=200, page_size=page_size, window=window,
         num_splits=splits, lengths=[200, 75, 128, 37],
         name="triton small pages")


def test_triton_a_64_row_tile_is_one_warpgroup_on_hopper(monkeypatch):
  """A 64-row tile of 128-column chunks (a shared prefix's 16 rows x 4
  query heads, or G * T_new = 64) takes 4 warps where `one_warpgroup`
  (Hopper, 16-bit queries over a cache of their dtype or a 1-byte one:
  two programs an SM, 210 registers, against one at 8 warps' 130 x 256
  threads); other tiles, other GPUs and float32 keep theirs."""
  from pallas_fa import triton as triton_pkg  # noqa: PLC0415
  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415
  for rows, chunk, hopper, warps in (
      (64, 128, True, 4), (64, 128, False, 8), (64, 256, True, 8),
      (64, 64, True, 8), (128, 128, True, 8), (32, 128, True, 8),
      (16, 128, True, 4), (16, 128, False, 4)):
    assert triton_decode._launch(  # noqa: SLF001
        rows, chunk, one_warpgroup=hopper)[0] == warps, (rows, chunk, hopper)
  assert triton_decode._launch(  # noqa: SLF001
      64, 128, one_warpgroup=True, warps=8)[0] == 8  # the caller's choice
  launched = []
  real = triton_pkg.pallas_call

  def spy(kernel, inputs, outputs, grid, warps, *args, **kw):
    if args[-1] == "flash_decode":
      launched.append(warps)
    return real(kernel, inputs, outputs, grid, warps, *args, **kw)

  monkeypatch.setattr(triton_pkg, "pallas_call", spy)
  gen = rng("one warpgroup")
  # 16 query heads a K/V head and 4 new tokens: a 64-row tile, as a
  # shared prefix's 16 rows x 4 query heads fold into.
  b, t, n, num_kv, h, s = 2, 4, 32, 2, 128, 48
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), jnp.bfloat16)
  k, v = (jnp.asarray(gen.standard_normal((b, s, num_kv, h)), jnp.bfloat16)
          for _ in range(2))
  lengths = jnp.full((b,), s, jnp.int32)
  (k8, ks), (v8, vs) = (pallas_fa.kv_cache.quantize(x, jnp.int8)
                        for x in (k, v))
  for target, dtype, cache, want in (
      (gpu_target.H100, jnp.bfloat16, None, [4]),
      (gpu_target.A100, jnp.bfloat16, None, [8]),
      (gpu_target.H100, jnp.float32, None, [8]),
      (gpu_target.H100, jnp.bfloat16, "int8", [4]),
      (gpu_target.H100, jnp.float32, "int8", [8])):
    # The decode module's view of the target only: the kernels still run
    # interpreted here.
    monkeypatch.setattr(triton_decode, "gpu_target", types.SimpleNamespace(
        current=lambda target=target: target,
        builds_ptx=gpu_target.builds_ptx))
    launched.clear()
    jax.clear_caches()  # The jitted kernels' cache knows no target.
    # Traced only: the launch is chosen at trace time (running the
    # interpreted kernels would take seconds each).
    if cache is None:
      jax.eval_shape(functools.partial(
          pallas_fa.decode_attention, implementation="triton"),
          *(x.astype(dtype) for x in (q, k, v)), lengths)
    else:
      jax.eval_shape(functools.partial(
          pallas_fa.decode_attention, implementation="triton"),
          q.astype(dtype), k8, v8, lengths, key_scale=ks, value_scale=vs)
    assert launched == want, (target.device_kind, dtype, cache, launched)


def test_triton_one_byte_caches_take_128_key_blocks_two_programs_an_sm():
  """A contiguous int8 / float8 key and value cache whose tile has 16 rows
  and chunks of at most 128 columns reads 128-key blocks (where it holds
  that many entries), and its split
  count fills two programs an SM (the registers and shared memory of
  such a program), not the 64-key tiling's four; paged caches, wider
  tiles, wider head dims and 16-bit caches keep theirs."""
  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415
  for h, groups, t, page_size, one_byte, cache_len, block in (
      (128, 4, 1, None, True, 128, 128), (64, 8, 2, None, True, 4096, 128),
      # A cache shorter than the block would be padded to it.
      (128, 4, 1, None, True, 127, 64),
      (128, 4, 1, None, False, 4096, 64), (128, 4, 1, 64, True, 64, 64),
      (128, 8, 4, None, True, 4096, 64), (256, 4, 1, None, True, 4096, 32)):
    assert triton_decode.block_for(
        head_dim=h, value_head_dim=h, groups=groups, new_tokens=t,
        page_size=page_size, block_kv=None, one_byte=one_byte,
        cache_len=cache_len) == block, (h, groups, t, page_size, one_byte)
  assert triton_decode.programs_per_sm(128, True) == 2
  assert triton_decode.programs_per_sm(64, True) is None
  assert triton_decode.programs_per_sm(128, False) is None
  # B = 1, K = 8 on an H100: 33 splits, where the 1-byte dtype's four
  # programs an SM gave 66.
  assert decode.default_num_splits(
      1, 8, 256, "gpu", cache_dtype=jnp.int8, programs_per_core=2) == 33
  assert decode.default_num_splits(
      1, 8, 512, "gpu", cache_dtype=jnp.int8) == 66


def test_triton_float32_tiles_of_the_most_elements_take_half_the_block():
  """Float32 queries over 64 packed rows at H = 256 (a [64, 256] chunk, the
  most a tile holds) read 16-key blocks, which compile without spilling,
  where 16-bit queries and smaller tiles keep theirs."""
  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415
  for h, groups, t, float32, one_byte, block in (
      (256, 4, 16, True, False, 16), (256, 4, 16, False, True, 32),
      (256, 4, 16, True, True, 16), (256, 4, 16, False, False, 32),
      (256, 4, 1, True, True, 32), (128, 4, 16, True, True, 64)):
    assert triton_decode.block_for(
        head_dim=h, value_head_dim=h, groups=groups, new_tokens=t,
        page_size=None, block_kv=None, one_byte=one_byte,
        cache_len=4096, float32_queries=float32) == block, (
            h, groups, t, float32, one_byte)


def test_triton_paged_blocks_are_the_contiguous_ones():
  """A paged cache's block is the contiguous default whatever the page
  size (a slice of a page, or several pages), and a kernel indexes enough
  blocks to cover a row's pages."""
  from pallas_fa.decode import plan  # noqa: PLC0415
  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415
  for h in (64, 128, 256):
    shape = dict(head_dim=h, value_head_dim=h, groups=4, new_tokens=1)
    default = triton_decode.block_for(**shape, page_size=None,
                                      block_kv=None)
    for page_size in (16, 32, 48, 64, 128, 256):
      assert triton_decode.block_for(
          **shape, page_size=page_size, block_kv=None) == default
  key = jnp.zeros((9, 16, 1, 8))
  assert plan.kernel_blocks(key, jnp.zeros((2, 5), jnp.int32), 64) == 2
  assert plan.kernel_blocks(key, jnp.zeros((2, 8), jnp.int32), 64) == 2
  assert plan.kernel_blocks(key, None, 64) == 1


def test_triton_head_dim_past_256():
  """Head-dim chunks for Q.K^T, one value chunk per program, and pages
  of two blocks each."""
  _check(implementation="triton", h=576, n=4, num_kv=1, s_max=100,
         page_size=128, num_splits=2, name="triton head dim")


def test_triton_window_softcap_positions():
  _check(implementation="triton", window=(9, 0), soft_cap=5.0,
         positions=True, t=2, n=4, num_kv=2, h=32, hv=48, s_max=60,
         block_kv=16, name="triton features")


@pytest.mark.parametrize("page_size, window, t, num_splits", [
    (None, None, 1, 3), (None, (40, 0), 3, 4), (16, None, 2, 5),
    (64, (70, 0), 1, 2)])
def test_triton_interior_blocks_run_unmasked(page_size, window, t,
                                             num_splits):
  """The blocks every row sees whole skip the masking; a length that is no
  multiple of the block, a window's first block and the causal edge of
  several new tokens stay masked (NaN past the lengths, in unused pages
  and in the rows of used ones)."""
  _check(implementation="triton", dtype=jnp.bfloat16, b=3, t=t, n=8,
         num_kv=2, s_max=150 if page_size is None else 200,
         page_size=page_size, window=window, num_splits=num_splits,
         block_kv=None if page_size else 16, name="triton interior")


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", [None, (5, 0), (37, None), (None, 2)])
def test_whole_blocks_are_the_full_ones(is_causal, window):
  """`masking.decode_whole_blocks`, from scalars in the triton and
  mosaic_gpu kernels, gives the FULL blocks of
  `masking.decode_block_kinds` (and only those) for every sequence."""
  from pallas_fa import masking  # noqa: PLC0415
  gen = rng("decode", "whole blocks", is_causal, window)
  b, t, block, num_blocks = 64, 3, 16, 10
  lengths = gen.integers(0, num_blocks * block + 1, b).astype(np.int32)
  q_pos = (lengths[:, None] - t + np.arange(t, dtype=np.int32)[None]
           - gen.integers(0, 20, (b, 1)).astype(np.int32))
  kinds = np.asarray(masking.decode_block_kinds(
      jnp.asarray(lengths), jnp.asarray(q_pos), num_blocks=num_blocks,
      block=block, is_causal=is_causal, window=window))
  lo, hi = masking.decode_whole_blocks(
      jnp.asarray(lengths), jnp.asarray(q_pos.min(1)),
      jnp.asarray(q_pos.max(1)), block=block, is_causal=is_causal,
      window=window)
  blocks = np.arange(num_blocks)[None]
  whole = (blocks >= np.asarray(lo)[:, None]) & (
      blocks < np.asarray(hi)[:, None])
  np.testing.assert_array_equal(whole, kinds == masking.FULL)


def test_triton_one_new_token_rows_past_the_group():
  """T_new = 1 with 4 query heads per K/V head: the kernel's 16-row tile
  runs past the 4 packed rows, which are neither read nor written; explicit
  positions, a window and sinks on that path too."""
  _check(implementation="triton", t=1, n=8, num_kv=2, h=64, s_max=90,
         positions=True, window=(30, 0), sinks=True, num_splits=4,
         block_kv=16, name="triton one token")


def test_triton_score_mod_without_mask_mod():
  """A score_mod alone keeps the two-kernel path (no block lists)."""
  gen = rng("decode", "triton score_mod")
  b, t, n, num_kv, h, s_max = 2, 1, 4, 2, 32, 70
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), jnp.float32)
  k, v = (jnp.asarray(gen.standard_normal((b, s_max, num_kv, h)),
                      jnp.float32) for _ in range(2))
  lengths = jnp.array([70, 33])
  slopes = jnp.asarray(gen.uniform(0.1, 1.0, n), jnp.float32)
  kw = dict(score_mod=pallas_fa.flex.alibi, score_mod_args=(slopes,),
            num_splits=3, return_residual=True)
  got = pallas_fa.decode_attention(q, k, v, lengths, block_kv=16,
                                   implementation="triton", **kw)
  want = pallas_fa.decode_attention(q, k, v, lengths,
                                    implementation="chunked", **kw)
  chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-5)


# One decode step at the bandwidth: B = 1, T_new = 1, S = 32k, 32 query
# heads on 8 K/V heads, H = 128, bfloat16 -- 128 MiB of K/V, ~40 us on an
# H100, so a few-microsecond launch per small fusion would matter.
_STEP = dict(b=1, s=32768, n=32, num_kv=8, h=128)


def _decode_step(paged: bool, extras: bool):
  """(function, argument specs) of that step (with `extras`: explicit
  positions, a window and sinks)."""
  spec = jax.ShapeDtypeStruct
  b, s, n, num_kv, h = (_STEP[x] for x in ("b", "s", "n", "num_kv", "h"))
  page = 64
  cache = (s * b // page, page) if paged else (b, s)
  args = [spec((b, 1, n, h), jnp.bfloat16),
          spec((*cache, num_kv, h), jnp.bfloat16),
          spec((*cache, num_kv, h), jnp.bfloat16), spec((b,), jnp.int32),
          spec((b, s // page), jnp.int32) if paged else None]
  if extras:
    args += [spec((b, 1), jnp.int32), spec((n,), jnp.float32)]

  def step(q, k, v, lengths, table, positions=None, sinks=None):
    return pallas_fa.decode_attention(
        q, k, v, lengths, block_table=table, query_positions=positions,
        sinks=sinks, local_window_size=(4096, 0) if extras else None,
        implementation="triton", return_residual=True)

  return step, args


@pytest.mark.parametrize("paged, tile, smem, stages", [
    (False, 32_768, gpu_target.A100.shared_memory_per_block, 3),
    # float32, H = 128, 64 keys: 176,128 B at three stages on an A100.
    (False, 65_536, gpu_target.A100.shared_memory_per_block, 2),
    (False, 65_536, gpu_target.H100.shared_memory_per_block, 3),
    (True, 65_536, gpu_target.H100.shared_memory_per_block, 5),
    (True, 65_536, gpu_target.A100.shared_memory_per_block, 4),
    (True, 1 << 20, gpu_target.A100.shared_memory_per_block, 4),
    (False, 1 << 20, None, 3),
])
def test_triton_decode_stages_fit_shared_memory(paged, tile, smem, stages):
  """The decode kernel's pipeline keeps fewer K/V blocks in flight where
  the target's shared memory would not hold them (about one block more
  than in flight), never none; interpreted (no limit) it keeps its
  designed depth."""
  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415
  assert triton_decode._launch(16, 128, paged, tile_bytes=tile,
                               shared_memory=smem) == (4, stages)


def test_num_warps_is_checked():
  """num_warps is triton's and mosaic_gpu's (every other implementation,
  the default included, rejects it by name), one of their warp counts."""
  gen = rng("decode num_warps checks")
  q = jnp.asarray(gen.standard_normal((1, 1, 4, 16)), jnp.float32)
  k = jnp.asarray(gen.standard_normal((1, 40, 2, 16)), jnp.float32)
  lengths = jnp.asarray([33])
  for implementation in (None, "chunked"):
    with pytest.raises(ValueError, match="num_warps applies to "
                       "implementation='triton' or 'mosaic_gpu'"):
      pallas_fa.decode_attention(q, k, k, lengths, num_warps=2,
                                 implementation=implementation)
  for bad in (3, 0, True, 2.0, 32):
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4, 8 or"):
      pallas_fa.decode_attention(q, k, k, lengths, num_warps=bad,
                                 implementation="triton")
  for bad in (1, 2, 16, True):
    with pytest.raises(ValueError, match="num_warps must be 4 or 8 on "
                       "implementation='mosaic_gpu'"):
      pallas_fa.decode_attention(q, k, k, lengths, num_warps=bad,
                                 implementation="mosaic_gpu")


@pytest.mark.long
@attention_testing.gpu_jax_only_on_cpu
def test_triton_num_warps_reaches_every_split_kernel(monkeypatch):
  """decode_attention(num_warps=2) launches the split kernels (the rows'
  and a shared prefix's, an int8 cache's under bfloat16 queries) with two
  warps and leaves the merge's; the results equal the default launch's
  (interpreted) and the chunked reference."""
  from pallas_fa import triton as triton_pkg  # noqa: PLC0415
  launches = []
  real = triton_pkg.pallas_call

  def spy(kernel, inputs, outputs, grid, warps, stages, name, **kw):
    launches.append((name, warps))
    return real(kernel, inputs, outputs, grid, warps, stages, name, **kw)

  monkeypatch.setattr(triton_pkg, "pallas_call", spy)
  gen = rng("decode num_warps launches")
  b, n, num_kv, h, s = 2, 8, 2, 32, 70
  q = jnp.asarray(gen.standard_normal((b, 1, n, h)), jnp.bfloat16)
  k, v = (gen.standard_normal((b, s, num_kv, h)).astype(np.float32)
          for _ in range(2))
  (k8, ks), (v8, vs) = (pallas_fa.kv_cache.quantize(jnp.asarray(x),
                                                    jnp.int8)
                        for x in (k, v))
  pk, pv = (jnp.asarray(gen.standard_normal((48, num_kv, h)), jnp.bfloat16)
            for _ in range(2))
  lengths = jnp.asarray([61, 9])
  kw = dict(key_scale=ks, value_scale=vs, num_splits=2, block_kv=16,
            return_residual=True)
  calls = [dict(), dict(prefix_key=pk, prefix_value=pv)]
  for extra in calls:
    got = pallas_fa.decode_attention(q, k8, v8, lengths, num_warps=2,
                                     implementation="triton", **kw, **extra)
    default = pallas_fa.decode_attention(q, k8, v8, lengths,
                                         implementation="triton", **kw,
                                         **extra)
    reference = {key: x for key, x in kw.items() if key != "block_kv"}
    want32, same = (pallas_fa.decode_attention(
        q.astype(dtype), k8, v8, lengths, implementation="chunked",
        **reference, **{key: x.astype(dtype) for key, x in extra.items()})
        for dtype in (jnp.float32, jnp.bfloat16))
    for a, d, w, w16, part in zip(got, default, want32, same,
                                  ("out", "lse")):
      np.testing.assert_array_equal(np.asarray(a, np.float32),
                                    np.asarray(d, np.float32))
      assert_close(part, a, w, w16, jnp.bfloat16)
  split = [warps for name, warps in launches if name == "flash_decode"]
  merges = {warps for name, warps in launches if name == "flash_decode_merge"}
  # The rows' kernel with two warps, then by default (four); then the
  # prefix's and the rows' with two warps each, then by default.
  assert split == [2, 4, 2, 2, 4, 4] and merges == {4}, launches


@pytest.mark.parametrize("paged, extras", [(False, False), (True, True)])
def test_triton_decode_step_lowers_to_two_kernels(paged, extras):
  """Lowered for an H100 (no GPU needed), a one-token step is the split
  kernel and the merge kernel and nothing else that XLA would launch:
  around them only reshapes, which XLA turns into bitcasts. The programs
  find their key runs from the lengths themselves and read the unpadded
  queries; the merge writes the output in its final dtype and layout."""
  step, args = _decode_step(paged, extras)
  with gpu_target.compile_for(gpu_target.H100):
    lowered = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",))
  ops = collections.Counter()

  def visit(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          ops[inner.operation.name] += 1
          visit(inner.operation)

  visit(lowered.compiler_ir("stablehlo").operation)
  free = {"stablehlo.reshape", "func.func", "func.call", "func.return"}
  work = {name: count for name, count in ops.items()
          if name not in free and not name.startswith("sdy.")}
  assert work == {"stablehlo.custom_call": 2}, ops
  text = lowered.as_text()
  assert 'name = "flash_decode"' in text
  assert 'name = "flash_decode_merge"' in text


def test_triton_decode_step_compiles_to_two_kernels(monkeypatch, tmp_path):
  """The same step compiled for an H100 without a GPU (XLA's whole GPU
  pipeline, `scripts/compile_check.py`'s way): XLA's thunk sequence holds
  two kernels. Needs jax's CUDA plugin, which test environments usually
  lack (the compile check reports the same count per decode variant)."""
  # Importing the script sets logging defaults in os.environ: keep them in
  # a copy that goes away with the test.
  monkeypatch.setattr(os, "environ", dict(os.environ))
  with conftest.script_module("compile_check") as compile_check:
    reason = compile_check._can_compile_for_cuda("h100")  # noqa: SLF001
    if reason:
      pytest.skip(reason)
    device = compile_check._cuda_device("h100")  # noqa: SLF001
    step, args = _decode_step(paged=False, extras=False)
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [None if a is None else jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=sharding) for a in args]
    with gpu_target.compile_for(gpu_target.H100):
      jax.jit(step).trace(*args).lower().compile(
          compiler_options={"xla_dump_to": str(tmp_path)})
    assert compile_check.kernels_per_call(str(tmp_path)) == 2


@pytest.mark.parametrize("implementation, change", [
    (None, dict(page_size=8, num_splits=5, t=4, positions=True)),
    (None, dict(dtype=jnp.bfloat16, num_splits=3, t=1, soft_cap=5.0)),
    ("triton", dict(h=64, s_max=70, page_size=16, num_splits=3, t=2)),
    ("mosaic_tpu", dict(h=32, s_max=60, page_size=8, num_splits=2, t=2)),
])
def test_sinks_join_once_after_the_merge(implementation, change):
  """With sinks, decode equals flash_attention with sinks on the gathered
  cache: the splits' sink-free partials merge, then the sink joins once
  (per packed row, so every query head gets its own)."""
  _check(implementation=implementation, sinks=True, n=8, num_kv=2,
         name="sinks", **change)


@pytest.mark.parametrize("implementation", ["triton", "mosaic_tpu"])
def test_kernels_decline_float64(implementation):
  with jax.enable_x64(True):
    x = jnp.ones((2, 32, 1, 16), jnp.float64)
    # As flash_attention declines a dtype its backend does not run.
    with pytest.raises(NotImplementedError, match="not float64"):
      pallas_fa.decode_attention(x[:, :1], x, x, jnp.array([3, 30]),
                                 implementation=implementation)


# The Mosaic TPU kernel in Pallas's TPU interpret mode: few tiny cases (the
# interpreter compiles each shape for seconds). The contiguous case reads
# two 128-key blocks per sequence (the shorter one skips its second); the
# paged one walks runs of 16-key pages with skipped steps past each run.
@pytest.mark.parametrize("dtype, paged, group, t", [
    (jnp.float32, False, 1, 1), (jnp.bfloat16, True, 4, 4)])
def test_mosaic_tpu_layouts(dtype, paged, group, t):
  _check(implementation="mosaic_tpu", dtype=dtype, t=t, n=2 * group,
         num_kv=2, h=64, s_max=100 if paged else 200,
         page_size=16 if paged else None, num_splits=3 if paged else None,
         name="mosaic_tpu")


def test_mosaic_tpu_window_softcap_positions():
  """A left window drops the first pages; 8-key pages; Hv != H."""
  _check(implementation="mosaic_tpu", window=(9, 0), soft_cap=5.0,
         positions=True, t=2, n=4, num_kv=2, h=32, hv=48, s_max=60,
         page_size=8, num_splits=2, name="mosaic_tpu features")


@pytest.mark.parametrize("h, dtype, page_size, s_max", [
    (192, jnp.float16, None, 150),  # padded to 256 lanes, float32 compute
    (1024, jnp.float32, 24, 40),  # a page size that is no power of two
    (8192, jnp.float32, None, 16),  # blocks of 32 keys fit VMEM
])
def test_mosaic_tpu_head_dims(h, dtype, page_size, s_max):
  _check(implementation="mosaic_tpu", h=h, dtype=dtype, n=4, num_kv=1,
         s_max=s_max, page_size=page_size, name="mosaic_tpu head dims")


@pytest.mark.parametrize("implementation", [None, "triton", "mosaic_tpu"])
def test_zero_length_rows_are_zero_not_nan(implementation):
  gen = rng("decode", "empty")
  q = jnp.asarray(gen.standard_normal((2, 1, 2, 16)), jnp.float32)
  k = jnp.asarray(gen.standard_normal((2, 40, 1, 16)), jnp.float32)
  out, lse = pallas_fa.decode_attention(
      q, k, k, jnp.array([0, 40]), is_causal=False, return_residual=True,
      implementation=implementation)
  np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
  assert np.all(np.isneginf(np.asarray(lse[0])))
  assert np.all(np.isfinite(np.asarray(out[1])))


@pytest.mark.parametrize("implementation", [None, "triton", "mosaic_tpu"])
@pytest.mark.parametrize("paged", [False, True])
def test_empty_calls_launch_no_kernel(implementation, paged, monkeypatch):
  """As flash_attention's: no sequences or no new tokens (B or T_new = 0)
  give empty results, a cache with no entries zeros with lse -inf; shaped
  and typed like a full call's (out like query, lse float32), gradients
  zero, eagerly and under jit, and no kernel runs."""

  def no_kernel(*args, **kwargs):
    raise AssertionError("an empty call reached a kernel")

  monkeypatch.setattr(decode.kernels, "run", no_kernel)
  monkeypatch.setattr(decode.chunked, "attention", no_kernel)
  gen = rng("decode", "empty calls", implementation, paged)
  n, num_kv, h, hv, page_size, dtype = 4, 2, 16, 8, 16, jnp.bfloat16
  normal = lambda *shape: jnp.asarray(  # noqa: E731
      gen.standard_normal(shape), dtype)
  for b, t, s_max in ((0, 1, 32), (2, 0, 32), (2, 2, 0)):
    q = normal(b, t, n, h)
    table = None
    if paged:
      k, v = normal(3, page_size, num_kv, h), normal(3, page_size, num_kv, hv)
      table = jnp.asarray(
          gen.integers(0, 3, (b, s_max // page_size)), jnp.int32)
    else:
      k, v = normal(b, s_max, num_kv, h), normal(b, s_max, num_kv, hv)
    lengths = jnp.asarray(gen.integers(min(t, s_max), s_max + 1, b), jnp.int32)
    sinks = jnp.asarray(gen.standard_normal(n), jnp.float32)

    def loss(q, k, v, lengths=lengths, table=table, sinks=sinks):
      out, lse = pallas_fa.decode_attention(
          q, k, v, lengths, block_table=table, sinks=sinks,
          return_residual=True, implementation=implementation)
      value = jnp.sum(out.astype(jnp.float32)) + jnp.sum(
          jnp.where(jnp.isfinite(lse), lse, 0.0))
      return value, (out, lse)

    for run in (loss, jax.jit(loss)):
      (_, (out, lse)), grads = jax.value_and_grad(
          run, argnums=(0, 1, 2), has_aux=True)(q, k, v)
      case = (b, t, s_max)
      assert out.shape == (b, t, n, hv) and out.dtype == dtype, case
      assert lse.shape == (b, t, n) and lse.dtype == jnp.float32, case
      np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
      assert np.all(np.isneginf(np.asarray(lse))), case
      for grad, x in zip(grads, (q, k, v), strict=True):
        assert grad.shape == x.shape and grad.dtype == x.dtype, case
        np.testing.assert_array_equal(np.asarray(grad, np.float32), 0.0)


@pytest.mark.parametrize("implementation", [None, "triton", "mosaic_tpu"])
def test_strict_promotion(implementation, strict_promotion):
  """bfloat16 with every feature on a paged cache, under strict dtype
  promotion and rank promotion "raise"."""
  del strict_promotion  # Active for the whole test.
  _check(t=2, dtype=jnp.bfloat16, page_size=16, s_max=70, window=(40, 0),
         soft_cap=10.0, positions=True, implementation=implementation,
         name="strict")


@pytest.mark.parametrize("implementation", [None, "triton", "mosaic_tpu"])
def test_traced_out_of_range_indices_are_clamped(implementation):
  """Traced (unchecked) lengths past the cache and pages outside the pool
  are clamped, alike on every implementation: a length past S_max attends
  to the whole cache, its tokens keeping the positions of the given
  length; a page index reads the nearest page in [0, P)."""
  gen = rng("decode", "clamped", implementation)
  b, t, n, page_size, num_pages = 2, 2, 4, 16, 6
  q = jnp.asarray(gen.standard_normal((b, t, n, 16)), jnp.float32)
  k, v = (jnp.asarray(gen.standard_normal((num_pages, page_size, 2, 16)),
                      jnp.float32) for _ in range(2))
  run = jax.jit(lambda lengths, table, pos=None: pallas_fa.decode_attention(
      q, k, v, lengths, block_table=table, query_positions=pos,
      local_window_size=(20, 0), implementation=implementation))
  lengths = jnp.array([40, 20])  # S_max = 2 pages = 32
  got = run(lengths, jnp.array([[0, 9], [-1, 3]]))
  want = run(jnp.array([32, 20]), jnp.array([[0, 5], [0, 3]]),
             lengths[:, None] - t + jnp.arange(t)[None])
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


def test_check_cache_indices_under_checkify():
  """The opt-in checks of traced indices: silent on good ones, a checkify
  error naming the argument on bad ones."""
  q = jnp.ones((2, 1, 2, 16))
  pages = jnp.ones((4, 16, 1, 16))

  @jax.jit
  @checkify.checkify
  def step(lengths, table):
    decode.check_cache_indices(pages, lengths, table)
    return pallas_fa.decode_attention(q, pages, pages, lengths,
                                      block_table=table)

  good = jnp.array([[0, 1], [2, 3]])
  err, out = step(jnp.array([5, 32]), good)
  assert err.get() is None
  chex.assert_trees_all_close(out, pallas_fa.decode_attention(
      q, pages, pages, jnp.array([5, 32]), block_table=good))
  err, _ = step(jnp.array([5, 33]), good)
  assert "lengths must be in [0, S_max=32]" in err.get()
  err, _ = step(jnp.array([5, 32]), jnp.array([[0, 1], [2, 4]]))
  assert "block_table entries must be pages in [0, num_pages=4)" in err.get()
  # Its own arguments are named before any check is staged.
  with pytest.raises(ValueError, match=r"key must be the cache.*\(4, 16, 1\)"):
    decode.check_cache_indices(pages[..., 0], jnp.array([5, 32]))
  with pytest.raises(TypeError, match="lengths must be an array, got None"):
    decode.check_cache_indices(pages, None)


def test_merge_parts_equals_one_softmax():
  """Merging per-part (out, lse) equals attention over all keys at once."""
  gen = rng("decode", "merge")
  s = jnp.asarray(gen.standard_normal((3, 5, 12)), jnp.float32)
  v = jnp.asarray(gen.standard_normal((12, 4)), jnp.float32)
  parts = s.reshape(3, 5, 3, 4)  # key axis split into 3 parts of 4
  p = jax.nn.softmax(parts, axis=-1)
  out_parts = jnp.einsum("bqpk,pkh->bpqh", p, v.reshape(3, 4, 4))
  lse_parts = jax.nn.logsumexp(parts, axis=-1).transpose(0, 2, 1)
  out, lse = online_softmax.merge_parts(out_parts, lse_parts, axis=1)
  np.testing.assert_allclose(out, jax.nn.softmax(s, axis=-1) @ v, atol=1e-6)
  np.testing.assert_allclose(lse, jax.nn.logsumexp(s, axis=-1), atol=1e-6)


@pytest.mark.parametrize("splits, r, hv, sinks", [
    (33, 64, 128, True), (5, 12, 48, False), (3, 4, 16, True)])
def test_triton_merge_of_many_rows_equals_merge_parts(splits, r, hv, sinks):
  """The triton merge kernel cuts many packed rows (a folded shared
  prefix's) into blocks of rows: equal to `merge_parts` and the sinks,
  splits that saw no key included."""
  from pallas_fa.triton import decode_merge  # noqa: PLC0415

  gen = rng("decode", "triton merge", splits, r)
  out = jnp.asarray(gen.standard_normal((2, 2, splits, r, hv)), jnp.float32)
  lse = gen.standard_normal((2, 2, splits, r)).astype(np.float32)
  lse[:, :, -1] = -np.inf
  lse = jnp.asarray(lse)
  sink = (jnp.asarray(gen.standard_normal((2, r)), jnp.float32) if sinks
          else None)
  got, got_lse = decode_merge.merge_splits(out, lse, sink,
                                           dtype=jnp.float32,
                                           value_head_dim=hv - 8)
  want, want_lse = online_softmax.merge_parts(out, lse, axis=2)
  if sinks:
    want, want_lse = online_softmax.add_sink(want, want_lse, sink)
  np.testing.assert_allclose(got, want[..., :hv - 8], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got_lse, want_lse, atol=1e-5, rtol=1e-5)


class ComposesWithTransformsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_vmap(self):
    gen = rng("decode", "jit")
    q = jnp.asarray(gen.standard_normal((3, 2, 1, 4, 16)), jnp.float32)
    k = jnp.asarray(gen.standard_normal((3, 2, 30, 2, 16)), jnp.float32)
    lengths = jnp.asarray(gen.integers(1, 31, (3, 2)), jnp.int32)
    fn = self.variant(jax.vmap(
        lambda q, k, n: pallas_fa.decode_attention(q, k, k, n, num_splits=2)))
    out = fn(q, k, lengths)
    chex.assert_shape(out, q.shape)
    chex.assert_trees_all_close(
        out, jnp.stack([pallas_fa.decode_attention(q[i], k[i], k[i],
                                                   lengths[i])
                        for i in range(3)]), atol=1e-6)


@pytest.mark.parametrize("change, error, match", [
    (dict(implementation="xla"), NotImplementedError, "no decode path"),
    # float32 queries over a float32 cache at H = 16.
    (dict(implementation="mosaic_gpu"), NotImplementedError,
     "mosaic_gpu.*reads bfloat16 or float16"),
    (dict(implementation="triton", block_kv=24), ValueError, "block_kv"),
    (dict(implementation="triton", key=jnp.ones((4, 8, 1, 16)),
          value=jnp.ones((4, 8, 1, 16)), block_table=jnp.zeros((2, 4), int)),
     NotImplementedError, "page_size"),
    (dict(implementation="mosaic_tpu", block_kv=12), ValueError,
     "block_kv"),
    (dict(implementation="mosaic_tpu", key=jnp.ones((4, 12, 1, 16)),
          value=jnp.ones((4, 12, 1, 16)), block_table=jnp.zeros((2, 3), int)),
     NotImplementedError, "page_size"),
    (dict(implementation="nope"), ValueError, "implementation"),
    (dict(implementation=["chunked"]), TypeError,
     r"implementation must be a str or None, got "
     r"implementation=\['chunked'\]"),
    (dict(implementation={"chunked": 1}), TypeError,
     "implementation must be a str or None"),
    (dict(implementation=3), TypeError, "implementation must be a str"),
    (dict(lengths=jnp.zeros((3,), jnp.int32)), ValueError, "lengths"),
    (dict(lengths=jnp.array([-1, 2])), ValueError, "lengths"),
    (dict(lengths=jnp.array([3, 31])), ValueError, "lengths.*s_max=30"),
    (dict(key=jnp.ones((4, 16, 1, 16)), value=jnp.ones((4, 16, 1, 16)),
          block_table=jnp.array([[0, 1], [2, 3]]), lengths=jnp.array([3, 33])),
     ValueError, "lengths.*s_max=32"),
    (dict(key=jnp.ones((4, 16, 1, 16)), value=jnp.ones((4, 16, 1, 16)),
          block_table=jnp.array([[0, 1], [2, 9]])),
     ValueError, r"num_pages=4\), got block_table\[1, 1\]=9"),
    (dict(key=jnp.ones((4, 16, 1, 16)), value=jnp.ones((4, 16, 1, 16)),
          block_table=jnp.array([[0, -1], [2, 3]])),
     ValueError, "block_table.*num_pages=4"),
    (dict(block_table=jnp.zeros((2,), jnp.int32)), ValueError, "block_table"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(key=jnp.zeros((2, 30, 3, 16)), value=jnp.zeros((2, 30, 3, 16))),
     ValueError, "multiple"),
    (dict(value=jnp.zeros((2, 30, 1, 16), jnp.bfloat16)), TypeError,
     "value"),
    (dict(query=jnp.zeros((2, 4, 16))), ValueError, "query"),
    (dict(local_window_size=-1), ValueError, "local_window_size"),
    (dict(sinks=jnp.zeros((3,))), ValueError, "sinks"),
    (dict(return_residual="no"), TypeError, "return_residual must be a bool"),
    (dict(is_causal="no"), TypeError, "is_causal must be a bool"),
    # 64-bit values that jnp.asarray would wrap into int32 silently.
    (dict(lengths=np.array([2**32 + 3, 4], np.int64)), ValueError,
     r"lengths must lie in \[-2147483648, 2147483647\]"),
    (dict(query_positions=np.array([[2**32 + 3], [5]], np.int64)),
     ValueError, "query_positions must lie in"),
    (dict(key=jnp.ones((4, 16, 1, 16)), value=jnp.ones((4, 16, 1, 16)),
          block_table=np.array([[0, 1], [2, 2**32 + 3]], np.int64)),
     ValueError, "block_table must lie in"),
    (dict(lengths=None), TypeError, "lengths must be an array, got None"),
    (dict(query=None), TypeError, "query must be an array, got None"),
    (dict(key="abc"), TypeError, "key must be an array, got str"),
    (dict(query=jnp.ones((2, 1, 4, 0)), key=jnp.ones((2, 30, 1, 0)),
          value=jnp.ones((2, 30, 1, 0))), ValueError, "heads and a head dim"),
    (dict(key=jnp.ones((2, 30, 0, 16)), value=jnp.ones((2, 30, 0, 16))),
     ValueError, "heads and a head dim"),
    (dict(prefix_key=jnp.ones((5, 1, 16)), prefix_value=jnp.ones((5, 1, 16)),
          _fold_prefix="two_merge"), ValueError,
     "_fold_prefix must be a bool or 'two_merges'"),
])
def test_bad_arguments_are_named(change, error, match):
  args = dict(query=jnp.ones((2, 1, 4, 16)), key=jnp.ones((2, 30, 1, 16)),
              value=jnp.ones((2, 30, 1, 16)), lengths=jnp.array([3, 30]))
  args.update(change)
  with pytest.raises(error, match=match):
    pallas_fa.decode_attention(**args)


def test_traced_unsigned_lengths_past_int32_are_the_whole_cache():
  """A traced uint32 length of 2^32 - 1 clamps to the cache (as documented
  for traced lengths past it), where a cast would wrap it to -1: no keys."""
  gen = rng("decode", "uint32")
  q = jnp.asarray(gen.standard_normal((2, 1, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(gen.standard_normal((2, 30, 2, 16)), jnp.float32)
          for _ in range(2))
  got = jax.jit(pallas_fa.decode_attention)(
      q, k, v, jnp.array([2**32 - 1, 4], jnp.uint32))
  want = pallas_fa.decode_attention(q, k, v, jnp.array([30, 4]))
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("implementation", [["chunked"], ("chunked",), 3])
def test_an_implementation_that_is_no_str_is_flash_attentions_error(
    implementation):
  gen = rng("decode implementation type", repr(implementation))
  q = jnp.asarray(gen.standard_normal((2, 1, 4, 16)), jnp.float32)
  k = jnp.asarray(gen.standard_normal((2, 30, 1, 16)), jnp.float32)
  errors = []
  for call in (
      lambda: pallas_fa.flash_attention(q, k, k,
                                        implementation=implementation),
      lambda: pallas_fa.decode_attention(q, k, k, jnp.array([3, 30]),
                                         implementation=implementation)):
    with pytest.raises(TypeError) as error:
      call()
    errors.append(str(error.value))
  assert errors[0] == errors[1], errors


@pytest.mark.parametrize("implementation", ["chunked", "triton",
                                            "mosaic_tpu"])
def test_a_block_past_the_cache_is_clipped(implementation):
  """block_kv = 2^30 on a 40-entry cache: the answer of a block covering
  it, not a cache padded to 2^30 keys (terabytes)."""
  gen = rng("huge block", implementation)
  q = jnp.asarray(gen.standard_normal((2, 1, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(gen.standard_normal((2, 40, 2, 16)), jnp.float32)
          for _ in range(2))
  lengths = jnp.array([40, 9])
  call = functools.partial(pallas_fa.decode_attention, q, k, v, lengths,
                           implementation=implementation)
  np.testing.assert_array_equal(call(block_kv=1 << 30), call(block_kv=64))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_16bit_cache_is_copied_only_where_xla_cannot_slice_it(dtype):
  """The bit view that keeps a 16-bit cache's slices in the loop costs one
  copy of the cache per call: made only where this XLA:CPU widens the
  slices (`chunked._slices_widen`, jaxlib 0.10), never where it slices
  them natively (0.6x the float32 time there, against 2x with the copy)."""
  b, s_max, num_kv, h = 1, 4096, 2, 64
  q = jnp.ones((b, 1, 4, h), dtype)
  cache = jnp.zeros((b, s_max, num_kv, h), dtype)
  lengths = jnp.full((b,), s_max, jnp.int32)
  step = jax.jit(lambda q, k, v: pallas_fa.decode_attention(
      q, k, v, lengths, implementation="chunked", block_kv=256))
  text = step.lower(q, cache, cache).compile().as_text()
  sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
           for dims in re.findall(r"u16\[([\d,]*)\]", text)]
  copied = max(sizes, default=0) >= cache.size
  assert copied == decode.chunked._slices_widen(jnp.dtype(dtype)), (
      copied, jax.__version__)


@pytest.mark.parametrize("implementation", ["chunked", "triton"])
def test_derivatives_are_refused_by_name(implementation):
  """decode_attention is forward only: grad and jvp through the query or
  the cache are a NotImplementedError that names the call (they were
  JAX's fori_loop error, or empty assertions inside Pallas); the sinks'
  gradient, added after the kernels on chunked, is the flash_attention
  equivalent's."""
  gen = rng("decode derivatives", implementation)
  q = jnp.asarray(gen.standard_normal((2, 1, 4, 16)), jnp.float32)
  k, v = (jnp.asarray(gen.standard_normal((2, 32, 2, 16)), jnp.float32)
          for _ in range(2))
  lengths = jnp.array([32, 9])
  sinks = jnp.asarray(gen.standard_normal(4), jnp.float32)

  def decode(q, k, sinks):
    return jnp.sum(jnp.sin(pallas_fa.decode_attention(
        q, k, v, lengths, sinks=sinks, implementation=implementation)))

  for argnum in (0, 1):
    with pytest.raises(NotImplementedError, match="forward only"):
      jax.grad(decode, argnums=argnum)(q, k, sinks)
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.jvp(lambda q: decode(q, k, sinks), (q,), (q,))
  if implementation == "triton":
    with pytest.raises(NotImplementedError, match="forward only"):
      jax.grad(decode, argnums=2)(q, k, sinks)
    return

  def flash(sinks):
    positions = (lengths - 1)[:, None]
    return jnp.sum(jnp.sin(pallas_fa.flash_attention(
        q, k, v, key_value_seq_lengths=lengths, is_causal=True,
        query_positions=positions, key_positions=jnp.broadcast_to(
            jnp.arange(32), (2, 32)), sinks=sinks, implementation="xla")))

  assert_close("dsinks", jax.grad(decode, argnums=2)(q, k, sinks),
               jax.grad(flash)(sinks))
