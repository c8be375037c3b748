"""`decode_attention(implementation="mosaic_gpu")`: the Mosaic GPU split
kernel (interpreted on CPU, compiled on Hopper) against the chunked
reference, and the calls it refuses by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from pallas_fa import gpu_target
from pallas_fa import kv_cache
from pallas_fa import quantize
from pallas_fa.mosaic_gpu import kernel
from tests import attention_testing
from tests.attention_testing import assert_close
from tests.attention_testing import rng


def _runs_here() -> bool:
  target = gpu_target.current()
  if target is not None:
    return target.major == 9
  return (kernel.interpret_params() is not None
          and jax.default_backend() == "cpu")


needs_kernel = pytest.mark.skipif(
    not _runs_here(), reason="needs a Hopper GPU or the Mosaic GPU "
    "interpreter (CPU)")


def _cache(gen, b, s, k, h, hv, dtype, lengths):
  """A [B, S, K, H] key and value cache whose entries past each length
  are NaN (a cache may hold anything there)."""
  key = np.asarray(gen.standard_normal((b, s, k, h)), np.float32)
  value = np.asarray(gen.standard_normal((b, s, k, hv)), np.float32)
  for i, length in enumerate(lengths):
    key[i, length:] = np.nan
    value[i, length:] = np.nan
  return jnp.asarray(key, dtype), jnp.asarray(value, dtype)


def _unpacked(case):
  """(a case's other keywords, its dtype (bfloat16 by default), its shape
  (b, t, n, k, h, hv, s))."""
  c = dict(case)
  dtype = c.pop("dtype", jnp.bfloat16)
  return c, dtype, tuple(c.pop(x) for x in ("b", "t", "n", "k", "h", "hv",
                                             "s"))


CASES = {
    # GQA, one new token, a cache length no multiple of the block (its
    # last block read shifted back), ragged lengths, one of them 0.
    "gqa_causal_sinks": dict(b=3, t=1, n=8, k=2, h=64, hv=64, s=200,
                             lengths=(130, 200, 0), is_causal=True,
                             sinks=True),
    # Four speculative tokens in a window, soft-capped, float16.
    "window_softcap_f16": dict(b=2, t=4, n=4, k=2, h=128, hv=128, s=256,
                               lengths=(256, 77), is_causal=True,
                               local_window_size=(50, 0),
                               logits_soft_cap=20.0, dtype=jnp.float16),
    # 64 packed rows (G x T_new = 4 x 16) at explicit positions, values
    # narrower than the keys, 128-key blocks, no causal mask.
    "rows_64_positions": dict(b=1, t=16, n=4, k=1, h=128, hv=64, s=320,
                              lengths=(300,), positions=True, block_kv=128),
    # Shuffled pages of 16 keys (four a block, a TMA each; vLLM's CUDA
    # default) and of 128 (two blocks a page), NaN past every length and
    # in the pages no row names.
    "paged_16": dict(b=2, t=1, n=8, k=2, h=64, hv=64, s=192,
                     lengths=(150, 33), is_causal=True, page_size=16),
    "paged_128": dict(b=2, t=2, n=4, k=2, h=128, hv=128, s=256,
                      lengths=(256, 129), is_causal=True, page_size=128,
                      sinks=True),
    # Head dim 256 (a two-stage ring), GQA, a ragged last block.
    "head_dim_256": dict(b=2, t=1, n=4, k=2, h=256, hv=256, s=150,
                         lengths=(150, 65), is_causal=True),
}


@attention_testing.gpu_jax_only_on_cpu
@needs_kernel
@pytest.mark.parametrize("name", sorted(CASES))
def test_mosaic_gpu_decode_matches_reference(name):
  c, dtype, (b, t, n, k, h, hv, s) = _unpacked(CASES[name])
  gen = rng("mosaic_gpu decode", name)
  lengths = c.pop("lengths")
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), dtype)
  key, value = _cache(gen, b, s, k, h, hv, dtype, lengths)
  kw = dict(is_causal=c.pop("is_causal", False),
            local_window_size=c.pop("local_window_size", None),
            logits_soft_cap=c.pop("logits_soft_cap", None))
  if c.pop("sinks", False):
    kw["sinks"] = jnp.asarray(gen.standard_normal((n,)), jnp.float32)
  if c.pop("positions", False):
    # Positions below the length, not its last T_new.
    kw["query_positions"] = jnp.asarray(
        [[length - t - 9 + i for i in range(t)] for length in lengths],
        jnp.int32)
  block_kv = c.pop("block_kv", None)
  page_size = c.pop("page_size", None)
  assert not c, c
  cache = dict(key=key, value=value)
  if page_size:
    table = attention_testing.page_table(gen, b, s // page_size)
    cache = {name: jnp.asarray(attention_testing.paged(
        np.asarray(x, np.float32), table, page_size, np.nan), dtype)
             for name, x in cache.items()}
    cache["block_table"] = jnp.asarray(table)
  lengths = jnp.asarray(lengths, jnp.int32)
  got = pallas_fa.decode_attention(
      q, lengths=lengths, implementation="mosaic_gpu", num_splits=3,
      block_kv=block_kv, return_residual=True, **cache, **kw)
  want32 = pallas_fa.decode_attention(
      q.astype(jnp.float32), key.astype(jnp.float32),
      value.astype(jnp.float32), lengths, implementation="chunked",
      return_residual=True, **kw)
  same = pallas_fa.decode_attention(
      q, key, value, lengths, implementation="chunked",
      return_residual=True, **kw)
  assert got[0].dtype == dtype and got[0].shape == (b, t, n, hv)
  assert not bool(jnp.isnan(got[0].astype(jnp.float32)).any())
  assert_close(f"{name} out", got[0], want32[0], same[0], dtype)
  # The logsumexp (-inf where a row sees no key) to float32 accuracy of
  # the kernel's products.
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want32[1]),
                             rtol=2e-2, atol=2e-2)


QUANTIZED = {
    # int8 with a scale per entry (`kv_cache.quantize`), K = 2 (the
    # scales' head axis padded to 8), a length past the last full block.
    "int8_per_entry": dict(dtype=jnp.int8, scales="entry", b=2, t=1, n=8,
                           k=2, h=64, s=200, lengths=(130, 200)),
    # float8 with per-head scales, 4 new tokens in a window, K = 8.
    "float8_per_head": dict(dtype=jnp.float8_e4m3fn, scales="head", b=1,
                            t=4, n=16, k=8, h=128, s=256, lengths=(250,),
                            local_window_size=(100, 0)),
    # int8 in 128-key blocks (widened in 64-row parts), a cache length no
    # multiple of the block (the last block shifted back) and a length
    # that ends in a block's second part.
    "int8_128_keys": dict(dtype=jnp.int8, scales="entry", b=2, t=1, n=4,
                          k=2, h=64, s=300, lengths=(300, 170),
                          block_kv=128),
    # float8 without scales (scale 1).
    "float8_unscaled": dict(dtype=jnp.float8_e4m3fn, scales=None, b=2, t=2,
                            n=4, k=2, h=64, s=128, lengths=(128, 70)),
    # float8 with per-head scales under query heads of magnitudes 2^-24 to
    # 2^24: the float16 products' query rows, each scaled by its own power
    # of two (exact), where float16 itself would flush the small rows and
    # overflow the large ones.
    "float8_per_head_wide_queries": dict(
        dtype=jnp.float8_e4m3fn, scales="head", b=2, t=1, n=8, k=2, h=128,
        s=192, lengths=(192, 100), query_spread=24),
    # The same cache and queries through the path float16 products
    # replaced: the products in bfloat16, float8 widened through float32.
    "float8_per_head_wide_queries_bfloat16_products": dict(
        dtype=jnp.float8_e4m3fn, scales="head", b=2, t=1, n=8, k=2, h=128,
        s=192, lengths=(192, 100), query_spread=24,
        _float16_products=False),
    # Head dim 256 (the tiles widened in [64, 128] parts): int8 under
    # float16 queries (through bfloat16), and float8 on float16 products.
    "int8_float16_queries_256": dict(
        dtype=jnp.int8, scales="entry", b=1, t=1, n=4, k=2, h=256, s=160,
        lengths=(150,), query_dtype=jnp.float16),
    "float8_per_head_256": dict(dtype=jnp.float8_e4m3fn, scales="head", b=1,
                                t=2, n=4, k=2, h=256, s=128, lengths=(100,)),
    # Paged 1-byte caches (shuffled pages, garbage past every length and
    # in the pages no row names): 16-key pages (four TMA copies a block
    # for each tensor and each scale ring), 128-key pages (two blocks a
    # page) with per-head scales, 64-key pages with float8 per entry.
    "int8_per_entry_pages_16": dict(dtype=jnp.int8, scales="entry", b=2,
                                    t=1, n=4, k=2, h=64, s=192,
                                    lengths=(150, 33), page_size=16),
    "float8_per_head_pages_128": dict(
        dtype=jnp.float8_e4m3fn, scales="head", b=2, t=2, n=4, k=2, h=128,
        s=256, lengths=(256, 129), page_size=128),
    "float8_per_entry_pages_64": dict(
        dtype=jnp.float8_e4m3fn, scales="entry", b=1, t=1, n=8, k=2, h=64,
        s=128, lengths=(100,), page_size=64),
}


@attention_testing.gpu_jax_only_on_cpu
@needs_kernel
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_mosaic_gpu_decode_one_byte_caches(name):
  """int8 / float8 caches, widened in the kernel to the query's dtype times
  their per-key scales, against the chunked path on the same cache."""
  c = dict(QUANTIZED[name])
  dtype, granularity = c.pop("dtype"), c.pop("scales")
  b, t, n, k, h, s = (c.pop(x) for x in ("b", "t", "n", "k", "h", "s"))
  lengths = jnp.asarray(c.pop("lengths"), jnp.int32)
  spread = c.pop("query_spread", 0)
  kernel_only = {x: c.pop(x) for x in ("_float16_products",) if x in c}
  query_dtype = c.pop("query_dtype", jnp.bfloat16)
  page_size = c.pop("page_size", None)
  kw = dict(is_causal=True, **c)
  gen = rng("mosaic_gpu decode 1-byte", name)
  # Each head vector times 2^e, the exponents spread evenly over
  # [-spread, spread] in a random order.
  exponents = gen.permutation(np.linspace(-spread, spread, b * t * n))
  q = gen.standard_normal((b, t, n, h)) * np.exp2(
      exponents.reshape(b, t, n, 1))
  q = jnp.asarray(q, query_dtype)
  cache = {}
  for part in ("key", "value"):
    x = jnp.asarray(gen.standard_normal((b, s, k, h)) * 3.0, jnp.float32)
    if granularity == "entry":
      cache[part], scale = kv_cache.quantize(x, dtype)
      # Entries past a length may hold anything: NaN scales there, which
      # the kernel must zero before P V (a masked P of 0 times NaN).
      past = jnp.arange(s)[None, :, None] >= lengths[:, None, None]
      cache[part + "_scale"] = jnp.where(past, jnp.nan, scale)
    elif granularity == "head":
      scale = jnp.max(jnp.abs(x), axis=(0, 1, 3)) / 448.0
      cache[part] = (x / scale[None, None, :, None]).astype(dtype)
      cache[part + "_scale"] = scale
    else:
      cache[part] = x.astype(dtype)
  if page_size:
    table = attention_testing.page_table(gen, b, s // page_size)
    garbage = {jnp.dtype(jnp.int8): 127, jnp.dtype(jnp.float32): np.nan}
    cache = {name: x if x.ndim < 3 else jnp.asarray(attention_testing.paged(
        np.asarray(x), table, page_size,
        garbage.get(x.dtype, np.nan)), x.dtype)
             for name, x in cache.items()}
    cache["block_table"] = jnp.asarray(table)
  got = pallas_fa.decode_attention(
      q, lengths=lengths, implementation="mosaic_gpu", num_splits=2,
      **cache, **kw, **kernel_only)
  want32 = pallas_fa.decode_attention(
      q.astype(jnp.float32), lengths=lengths, implementation="chunked",
      **cache, **kw)
  same = pallas_fa.decode_attention(
      q, lengths=lengths, implementation="chunked", **cache, **kw)
  assert got.dtype == query_dtype
  assert not bool(jnp.isnan(got.astype(jnp.float32)).any())
  assert_close(f"{name} out", got, want32, same, query_dtype)


def _rounded(q, dtype):
  """The query as `_quantized_query` reads it: each head vector rounded
  to the cache's 1-byte `dtype` at its own absmax scale
  (`mosaic_gpu.decode._quantized_rows`), dequantized."""
  return quantize.dequantize(*quantize.quantize(q, dtype)).astype(q.dtype)


QUANTIZED_QUERY = {
    # float8, GQA, per-head scales (the key's in the row factors, each
    # K/V head its own), ragged lengths (a last block shifted back, NaN
    # past each length).
    "float8_per_head": dict(dtype=jnp.float8_e4m3fn, scales="head", b=2,
                            t=1, n=8, k=2, h=64, s=200, lengths=(130, 200)),
    # float8 without scales, 2 new tokens in a window, two consumers.
    "float8_unscaled_two_consumers": dict(
        dtype=jnp.float8_e4m3fn, scales=None, b=2, t=2, n=4, k=2, h=128,
        s=256, lengths=(256, 70), local_window_size=(100, 0), num_warps=8),
    # float8 with one scale for the cache, a soft cap (the factors before
    # the cap), sinks, 4 tokens of 4 query heads a K/V head.
    "float8_per_tensor_softcap_sinks": dict(
        dtype=jnp.float8_e4m3fn, scales="tensor", b=1, t=4, n=16, k=4,
        h=128, s=192, lengths=(190,), logits_soft_cap=20.0, sinks=True),
    # int8 with a scale per entry (`kv_cache.quantize`, NaN past each
    # length): int32 products, the key column through shared memory, the
    # values widened with theirs; K = 2 (the scales' head axis padded).
    "int8_per_entry": dict(dtype=jnp.int8, scales="entry", b=2, t=1, n=8,
                           k=2, h=64, s=200, lengths=(130, 200)),
    # int8 per entry in 128-key blocks, two consumers.
    "int8_per_entry_128_keys_two_consumers": dict(
        dtype=jnp.int8, scales="entry", b=2, t=2, n=4, k=2, h=128, s=300,
        lengths=(300, 170), block_kv=128, num_warps=8),
    # int8 with per-head scales (no scale rings).
    "int8_per_head": dict(dtype=jnp.int8, scales="head", b=1, t=1, n=16,
                          k=8, h=128, s=160, lengths=(150,)),
    # float8 with a scale per entry.
    "float8_per_entry": dict(dtype=jnp.float8_e4m3fn, scales="entry", b=1,
                             t=1, n=4, k=1, h=64, s=128, lengths=(100,)),
    # int8 per entry at head dim 256 (only V widens: three stages fit).
    "int8_per_entry_head_dim_256": dict(dtype=jnp.int8, scales="entry", b=1,
                                        t=1, n=4, k=2, h=256, s=130,
                                        lengths=(120,)),
}


def _quantized_cache(key, value, dtype, granularity, lengths):
  """{key, value[, key_scale, value_scale]} of `dtype` from float ones
  (NaN past each length): scales per entry (NaN there too), per K/V head,
  one for the cache, or none."""
  cache = {}
  for part, x in (("key", key), ("value", value)):
    x = x * 3.0
    if granularity is None:
      cache[part] = x.astype(dtype)
    elif granularity == "entry":
      cache[part], scale = kv_cache.quantize(jnp.nan_to_num(x), dtype)
      past = jnp.arange(x.shape[1])[None, :, None] >= jnp.asarray(
          lengths)[:, None, None]
      cache[part + "_scale"] = jnp.where(past, jnp.nan, scale)
    else:
      axes = (0, 1, 3) if granularity == "head" else None
      largest = 127.0 if dtype == jnp.int8 else 448.0
      scale = jnp.nanmax(jnp.abs(x), axis=axes) / largest
      q = x / (scale if axes is None else scale[None, None, :, None])
      cache[part] = (jnp.round(q) if dtype == jnp.int8 else q).astype(dtype)
      cache[part + "_scale"] = scale
  return cache


@attention_testing.gpu_jax_only_on_cpu
@needs_kernel
@pytest.mark.parametrize("name", sorted(QUANTIZED_QUERY))
def test_mosaic_gpu_decode_quantized_query(name):
  """`_quantized_query`: Q K^T on 8-bit wgmma over an int8 or float8
  cache, the query rounded to the cache's dtype a head vector at a time,
  against the chunked path on that rounded query and the same cache (the
  factors a row and a key, the value scales, the masks and cap after the
  factors)."""
  c = dict(QUANTIZED_QUERY[name])
  dtype, granularity = c.pop("dtype"), c.pop("scales")
  b, t, n, k, h, s = (c.pop(x) for x in ("b", "t", "n", "k", "h", "s"))
  lengths = c.pop("lengths")
  gen = rng("mosaic_gpu decode quantized query", name)
  if c.pop("sinks", False):
    c["sinks"] = jnp.asarray(gen.standard_normal((n,)), jnp.float32)
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), jnp.bfloat16)
  key, value = _cache(gen, b, s, k, h, h, jnp.float32, lengths)
  cache = _quantized_cache(key, value, dtype, granularity, lengths)
  kw = dict(lengths=jnp.asarray(lengths, jnp.int32), is_causal=True,
            **cache, **c)
  got = pallas_fa.decode_attention(q, implementation="mosaic_gpu",
                                   num_splits=2, _quantized_query=True, **kw)
  rounded = _rounded(q, dtype)
  kw.pop("num_warps", None)
  kw.pop("block_kv", None)
  want32 = pallas_fa.decode_attention(rounded.astype(jnp.float32),
                                      implementation="chunked", **kw)
  same = pallas_fa.decode_attention(rounded, implementation="chunked", **kw)
  assert not bool(jnp.isnan(got.astype(jnp.float32)).any())
  assert_close(f"{name} out", got, want32, same, jnp.bfloat16)


@attention_testing.gpu_jax_only_on_cpu
@needs_kernel
@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.int8],
                         ids=["bfloat16", "int8"])
def test_mosaic_gpu_decode_two_consumers(cache_dtype):
  """num_warps=8: two consumer warpgroups a CTA, each taking the ring
  slots of its parity (so every other block of a unit, whatever the
  parity a unit starts at: odd block counts shift it) and writing its own
  partial result, merged with the rest."""
  gen = rng("mosaic_gpu decode two consumers", jnp.dtype(cache_dtype).name)
  b, t, n, k, h, s = 3, 2, 8, 2, 64, 330
  lengths = jnp.asarray([300, 130, 65], jnp.int32)
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), jnp.bfloat16)
  cache = {}
  for part in ("key", "value"):
    x = jnp.asarray(gen.standard_normal((b, s, k, h)), jnp.float32)
    if cache_dtype == jnp.int8:
      cache[part], cache[part + "_scale"] = kv_cache.quantize(x)
    else:
      cache[part] = x.astype(cache_dtype)
  kw = dict(lengths=lengths, is_causal=True, **cache)
  got = pallas_fa.decode_attention(q, implementation="mosaic_gpu",
                                   num_warps=8, num_splits=3, **kw)
  one = pallas_fa.decode_attention(q, implementation="mosaic_gpu",
                                   num_splits=3, **kw)
  wide = {name: (x if name.endswith("scale") or x.dtype == jnp.int8
                 else x.astype(jnp.float32)) for name, x in cache.items()}
  want32 = pallas_fa.decode_attention(
      q.astype(jnp.float32), lengths=lengths, is_causal=True,
      implementation="chunked", **wide)
  same = pallas_fa.decode_attention(q, implementation="chunked", **kw)
  assert_close("two consumers", got, want32, same, jnp.bfloat16)
  assert_close("one consumer", one, want32, same, jnp.bfloat16)


@attention_testing.gpu_jax_only_on_cpu
@needs_kernel
@pytest.mark.parametrize("case", [
    # GQA with sinks, one new token, a row that sees no key (length 0:
    # lse -inf, out 0) and ragged lengths: eight parts a row.
    # (Eight splits need eight 64-key blocks.)
    dict(b=3, t=1, n=8, k=2, h=64, s=520, lengths=(450, 520, 0), splits=8,
         sinks=True),
    # Four new tokens of four query heads (16 packed rows, stored as
    # 16), two consumers (two parts a split: 16), float16.
    dict(b=2, t=4, n=8, k=2, h=128, s=520, lengths=(520, 77), splits=8,
         num_warps=8, dtype=jnp.float16),
    # Head dim 256.
    dict(b=1, t=1, n=4, k=2, h=256, s=520, lengths=(500,), splits=8),
    # Three parts a row, written into a tile of eight.
    dict(b=2, t=1, n=4, k=2, h=64, s=200, lengths=(200, 90), splits=3),
    # More parts than the kernel's tile (made 2 here): the Triton merge.
    dict(b=2, t=1, n=4, k=2, h=64, s=200, lengths=(200, 90), splits=3,
         max_parts=2),
], ids=["gqa-sinks-empty-row", "rows-16-two-consumers-f16", "head-dim-256",
        "three-parts", "past-the-tile"])
def test_mosaic_gpu_decode_pdl_merge(monkeypatch, case):
  """`_pdl_merge`: the splits' merge as a Mosaic GPU kernel (interpreted
  here, where PDL's waits are no-ops), against the float64-backed
  reference and against the Triton merge of the same split kernel (the
  two differ only in their sums' order)."""
  from pallas_fa.mosaic_gpu import decode_merge  # noqa: PLC0415
  c = dict(case)
  dtype = c.pop("dtype", jnp.bfloat16)
  b, t, n, k, h, s = (c.pop(x) for x in ("b", "t", "n", "k", "h", "s"))
  gen = rng("mosaic_gpu decode pdl merge", str(case))
  lengths = c.pop("lengths")
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), dtype)
  key, value = _cache(gen, b, s, k, h, h, dtype, lengths)
  kw = dict(is_causal=True, num_splits=c.pop("splits"),
            num_warps=c.pop("num_warps", None))
  if c.pop("sinks", False):
    kw["sinks"] = jnp.asarray(gen.standard_normal((n,)), jnp.float32)
  triton = "max_parts" in c
  if triton:
    monkeypatch.setattr(decode_merge, "MAX_PARTS", c.pop("max_parts"))
  assert not c, c
  merges, real = [], decode_merge.merge_splits
  monkeypatch.setattr(decode_merge, "merge_splits",
                      lambda *a, **kw: merges.append(1) or real(*a, **kw))
  lengths = jnp.asarray(lengths, jnp.int32)
  got = pallas_fa.decode_attention(
      q, key, value, lengths, implementation="mosaic_gpu",
      return_residual=True, _pdl_merge=True, **kw)
  assert merges == ([] if triton else [1]), merges
  default = pallas_fa.decode_attention(
      q, key, value, lengths, implementation="mosaic_gpu",
      return_residual=True, **kw)
  ref_kw = dict(is_causal=True, return_residual=True, sinks=kw.get("sinks"),
                implementation="chunked")
  want32 = pallas_fa.decode_attention(
      q.astype(jnp.float32), key.astype(jnp.float32),
      value.astype(jnp.float32), lengths, **ref_kw)
  same = pallas_fa.decode_attention(q, key, value, lengths, **ref_kw)
  assert got[0].dtype == dtype and got[0].shape == (b, t, n, h)
  assert not bool(jnp.isnan(got[0].astype(jnp.float32)).any())
  assert_close("pdl merge out", got[0], want32[0], same[0], dtype)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want32[1]),
                             rtol=2e-2, atol=2e-2)
  # Against the Triton merge: one rounding of the output apart at most.
  np.testing.assert_allclose(np.asarray(got[0], np.float32),
                             np.asarray(default[0], np.float32),
                             rtol=1e-2, atol=1e-3)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(default[1]),
                             rtol=1e-5, atol=1e-5)
  # A row that sees no key: lse -inf, out 0 (and no sink).
  empty = np.asarray(lengths) == 0
  assert np.all(np.isneginf(np.asarray(got[1])[empty]))
  assert not np.any(np.asarray(got[0], np.float32)[empty])


LATENT = {
    # An absorbed-MLA shape (Hv = 512: two value chunks, units of their
    # own): 16 query heads on one latent head, ragged lengths (no multiple
    # of the block, one of them 0) with NaN past each, causal, sinks.
    "mla_576_512": dict(b=3, t=1, n=16, k=1, h=576, hv=512, s=200,
                        lengths=(200, 70, 0), is_causal=True, sinks=True),
    # GQA over two latent heads, two speculative tokens in a window,
    # float16, one value chunk, keys wider than the values.
    "gqa_320_256_f16": dict(b=2, t=2, n=8, k=2, h=320, hv=256, s=192,
                            lengths=(192, 130), is_causal=True,
                            local_window_size=(100, 0), dtype=jnp.float16),
    # Shuffled pages of 16 keys (four TMAs a 64-key block) and of 128 (two
    # blocks a page), NaN past every length and in the pages no row names.
    "mla_paged_16": dict(b=2, t=1, n=16, k=1, h=576, hv=512, s=192,
                         lengths=(150, 33), is_causal=True, page_size=16),
    "mla_paged_128": dict(b=2, t=2, n=8, k=1, h=320, hv=256, s=256,
                          lengths=(256, 129), is_causal=True,
                          page_size=128),
}


def _latent_call(name, **options):
  """(call(implementation, wide=False): decode_attention over the latent
  case `name` in the case's dtype (float32 if `wide`), with `options`
  but on chunked; the result's shape; the case's dtype)."""
  c, dtype, (b, t, n, k, h, hv, s) = _unpacked(LATENT[name])
  gen = rng("mosaic_gpu latent decode", name)
  lengths = c.pop("lengths")
  page_size = c.pop("page_size", None)
  q = np.asarray(gen.standard_normal((b, t, n, h)), np.float32)
  cache, _ = _cache(gen, b, s, k, h, 1, jnp.float32, lengths)
  kw = dict(c, value_head_dim=hv,
            lengths=jnp.asarray(lengths, jnp.int32))
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.asarray(gen.standard_normal((n,)), jnp.float32)
  # The kernel reads the pages; chunked, the reference, the contiguous
  # cache.
  kernel_cache = dict(key=cache)
  if page_size:
    table = attention_testing.page_table(gen, b, s // page_size)
    kernel_cache = dict(
        key=attention_testing.paged(cache, table, page_size, np.nan),
        block_table=jnp.asarray(table))

  def call(implementation, wide=False):
    x = jnp.float32 if wide else dtype
    kernel = implementation != "chunked"
    given = dict(kernel_cache) if kernel else dict(key=cache)
    given["key"] = jnp.asarray(given["key"], x)
    return pallas_fa.decode_attention(
        jnp.asarray(q, x), value=None, implementation=implementation,
        return_residual=True, **given, **kw, **(options if kernel else {}))

  return call, (b, t, n, hv), dtype


@attention_testing.gpu_jax_only_on_cpu
@needs_kernel
@pytest.mark.parametrize("name", sorted(LATENT))
def test_mosaic_gpu_decode_latent_cache(name):
  """A latent (MLA) cache, its values the keys' first Hv columns of the
  same ring slot, each value chunk a unit: against the chunked reference
  in float32 and in the call's dtype, NaN past every length kept out."""
  call, shape, dtype = _latent_call(name, num_splits=3)
  got = call("mosaic_gpu")
  want32, same = call("chunked", wide=True), call("chunked")
  assert got[0].dtype == dtype and got[0].shape == shape
  assert not bool(jnp.isnan(got[0].astype(jnp.float32)).any())
  assert_close(f"{name} out", got[0], want32[0], same[0], dtype)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want32[1]),
                             rtol=2e-2, atol=2e-2)


@attention_testing.gpu_jax_only_on_cpu
@needs_kernel
def test_mosaic_gpu_latent_decode_is_race_free(monkeypatch):
  """The latent split kernel under the race detector, over more units
  (two value chunks of three splits, two sequences) than its one CTA and
  more blocks than its two ring stages: V read from the K slot after
  Q K^T and zeroed past the length in place before the slot's release,
  and the result staging written in the packed rows' memory, which the
  next unit reloads."""
  verdicts, reset = attention_testing.race_verdicts(
      monkeypatch, lambda spec, name, races: (name, races))
  call, _, _ = _latent_call("mla_576_512", num_splits=3)
  want = call("chunked")
  try:
    with jax.disable_jit():
      got = call("mosaic_gpu")
  finally:
    reset()
  assert [name for name, _ in verdicts] == ["pfa_mgpu_decode"], verdicts
  raced = [name for name, found in verdicts if found]
  assert not raced, f"races reported (printed above) in {raced}"
  np.testing.assert_allclose(np.asarray(got[0], np.float32),
                             np.asarray(want[0], np.float32), atol=2e-2,
                             rtol=2e-2)


@attention_testing.gpu_jax_only_on_cpu
@needs_kernel
@pytest.mark.parametrize("cache_dtype, options", [
    # Two consumers over an int8 cache: each one's result staging shares
    # its widened tiles' memory (`shares_staging`), every unit of the one
    # interpreted CTA rewriting both after the last's store.
    (jnp.int8, dict(num_warps=8)),
    # 128-key blocks widened in two parts each.
    (jnp.int8, dict(block_kv=128)),
    # 16-key pages: four TMA copies a block and tensor on one barrier.
    (jnp.bfloat16, dict(page_size=16)),
    # An int8 query over an int8 cache with per-entry scales: the key
    # column's staging rewritten every block, two consumers.
    (jnp.int8, dict(_quantized_query=True, num_warps=8)),
    # A paged int8 cache of 16-key pages: twelve TMA copies a block on the
    # K barrier (the tiles' and both scale rings', four each).
    (jnp.int8, dict(page_size=16)),
], ids=["int8-two-consumers", "int8-128-keys", "paged-16",
        "int8-quantized-query-two-consumers", "int8-paged-16"])
def test_mosaic_gpu_decode_is_race_free(monkeypatch, cache_dtype, options):
  """The split kernel under the interpreter's happens-before race detector,
  over more units than its one CTA and more blocks than ring stages: a
  ring refill not ordered after the consumer's reads of its slot, a read
  not ordered after its TMA load, or a shared-memory view rewritten while
  another view of the same memory may still be read is a race; the
  results are checked against the reference too."""
  verdicts, reset = attention_testing.race_verdicts(
      monkeypatch, lambda spec, name, races: (name, races))
  options = dict(options)
  page_size = options.pop("page_size", None)
  b, t, n, k, h, s = 2, 1, 8, 2, 64, 320
  lengths = jnp.asarray([320, 150], jnp.int32)
  gen = rng("mosaic_gpu decode races", str(cache_dtype.dtype), *options)
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), jnp.bfloat16)
  key, value = _cache(gen, b, s, k, h, h, jnp.float32, (320, 150))
  cache = dict(key=key, value=value)
  if cache_dtype == jnp.int8:
    for part in ("key", "value"):
      cache[part], cache[part + "_scale"] = kv_cache.quantize(
          jnp.nan_to_num(cache[part]), jnp.int8)
  else:
    cache = {name: x.astype(cache_dtype) for name, x in cache.items()}
  want = pallas_fa.decode_attention(
      _rounded(q, cache_dtype) if options.get("_quantized_query") else q,
      lengths=lengths, is_causal=True, implementation="chunked", **cache)
  if page_size is not None:
    table = np.arange(b * s // page_size, dtype=np.int32).reshape(b, -1)
    cache = {name: x.reshape((b * s // page_size, page_size) + x.shape[2:])
             for name, x in cache.items()}
    cache["block_table"] = jnp.asarray(table)
  try:
    with jax.disable_jit():
      got = pallas_fa.decode_attention(
          q, lengths=lengths, is_causal=True, implementation="mosaic_gpu",
          num_splits=3, **cache, **options)
  finally:
    reset()
  assert [name for name, _ in verdicts] == ["pfa_mgpu_decode"], verdicts
  raced = [name for name, found in verdicts if found]
  assert not raced, f"races reported (printed above) in {raced}"
  np.testing.assert_allclose(np.asarray(got, np.float32),
                             np.asarray(want, np.float32), atol=2e-2,
                             rtol=2e-2)


def _call(**changes):
  shape = dict(b=1, t=1, n=4, k=2, h=64, s=128, dtype=jnp.bfloat16)
  shape.update({x: changes.pop(x) for x in list(changes) if x in shape})
  q = jnp.ones((shape["b"], shape["t"], shape["n"], shape["h"]),
               shape["dtype"])
  cache = jnp.ones((shape["b"], shape["s"], shape["k"], shape["h"]),
                   changes.pop("cache_dtype", shape["dtype"]))
  kw = dict(key=cache, value=cache,
            lengths=jnp.full((shape["b"],), shape["s"], jnp.int32))
  kw.update(changes)
  return pallas_fa.decode_attention(q, implementation="mosaic_gpu", **kw)


@needs_kernel
@pytest.mark.parametrize("changes, match", [
    (dict(h=512), "head dim is 512"),
    (dict(h=80), "head dim is 80"),
    (dict(s=32), "fewer than one 64-key block"),
    (dict(t=33), "packed rows exceed 64"),
    (dict(dtype=jnp.float32), "reads bfloat16 or float16"),
    (dict(mask_mod=lambda b, h, q, k: q >= k), "mask_mod"),
])
def test_mosaic_gpu_decode_refuses_by_name(changes, match):
  with pytest.raises(NotImplementedError, match=match):
    _call(**changes)


@needs_kernel
@pytest.mark.parametrize("changes, match", [
    (dict(h=640), "latent cache's head dim is 640"),
    (dict(value_head_dim=128), "value_head_dim is 128"),
    (dict(num_warps=8), "num_warps=8 with a latent cache"),
    (dict(cache_dtype=jnp.int8, key_scale=jnp.ones(())),
     "latent cache is int8"),
])
def test_mosaic_gpu_decode_refuses_latent_caches_by_name(changes, match):
  h = changes.pop("h", 576)
  dtype = changes.pop("cache_dtype", jnp.bfloat16)
  cache = jnp.ones((1, 128, 1, h), dtype)
  kw = dict(value_head_dim=512, lengths=jnp.asarray([100], jnp.int32))
  kw.update(changes)
  with pytest.raises(NotImplementedError, match=match):
    pallas_fa.decode_attention(jnp.ones((1, 1, 16, h), jnp.bfloat16), cache,
                               None, implementation="mosaic_gpu", **kw)


@needs_kernel
def test_mosaic_gpu_decode_refuses_narrow_one_byte_pages_at_256_and_odd_pages():
  int8 = jnp.ones((8, 16, 2, 256), jnp.int8)
  with pytest.raises(NotImplementedError,
                     match="1-byte in 16-key pages at head dim 256"):
    _call(h=256, key=int8, value=int8, key_scale=jnp.ones((2,)),
          value_scale=jnp.ones((2,)), lengths=jnp.asarray([100], jnp.int32),
          block_table=jnp.asarray([[0, 1, 2, 3, 4, 5, 6]], jnp.int32))
  pages = jnp.ones((8, 24, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="page size is 24"):
    _call(key=pages, value=pages, lengths=jnp.asarray([100], jnp.int32),
          block_table=jnp.asarray([[0, 1, 2, 3, 4]], jnp.int32))


@needs_kernel
def test_mosaic_gpu_decode_quantized_query_refusals():
  """`_quantized_query` reads an int8 or float8_e4m3fn cache on
  mosaic_gpu: anything else is refused by name."""
  with pytest.raises(NotImplementedError, match="cache is bfloat16"):
    _call(_quantized_query=True)
  with pytest.raises(NotImplementedError, match="cache is float8_e5m2"):
    _call(cache_dtype=jnp.float8_e5m2, _quantized_query=True)
  with pytest.raises(TypeError, match="_quantized_query must be a bool"):
    _call(cache_dtype=jnp.float8_e4m3fn, _quantized_query=1)
  q = jnp.ones((1, 1, 4, 64), jnp.bfloat16)
  cache = jnp.ones((1, 128, 2, 64), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="_quantized_query=True applies to"):
    pallas_fa.decode_attention(q, cache, cache, jnp.asarray([128]),
                               implementation="chunked",
                               _quantized_query=True)
  # `_pdl_merge` likewise.
  with pytest.raises(TypeError, match="_pdl_merge must be a bool"):
    _call(_pdl_merge="yes")
  with pytest.raises(ValueError, match="_pdl_merge=True applies to"):
    pallas_fa.decode_attention(q, cache, cache, jnp.asarray([128]),
                               implementation="triton", _pdl_merge=True)
  # `_float16_products` likewise: a bool, on mosaic_gpu only.
  with pytest.raises(TypeError, match="_float16_products must be a bool"):
    _call(cache_dtype=jnp.float8_e4m3fn, _float16_products=0)
  with pytest.raises(ValueError, match="_float16_products=False applies to"):
    pallas_fa.decode_attention(q, cache, cache, jnp.asarray([128]),
                               implementation="chunked",
                               _float16_products=False)


@needs_kernel
def test_mosaic_gpu_decode_block_choices():
  with pytest.raises(ValueError, match="block_kv=32"):
    _call(block_kv=32)
