"""The triton decode kernel's private A/B options, against the chunked
reference and the default path: the splits merged by the split kernel's
own last program of each K/V head (`decode_attention(_merge=
"split_kernel")`, `triton.decode._merge_when_last`) instead of a second
kernel, over the cache forms whose partials it reads differently (value
chunks, word-read 1-byte values, a latent cache); narrower value chunks
(`_value_chunk`); and the options' checks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from tests import attention_testing
from tests.attention_testing import assert_close
from tests.attention_testing import rng

# (name, B, T_new, N, K, H, Hv, query dtype, cache dtype, page size,
# splits): each reads its partials in a different layout.
_CASES = [
    # Empty splits (a 3-key row), GQA, sinks.
    ("bf16", 3, 1, 8, 2, 64, 64, jnp.bfloat16, jnp.bfloat16, None, 5),
    # Several new tokens a row, 16-key pages, float32.
    ("paged_t3", 2, 3, 4, 2, 32, 32, jnp.float32, jnp.float32, 16, 3),
    # An int8 cache under bfloat16 queries: values read as words at H = 128.
    ("int8_words", 2, 1, 8, 2, 128, 128, jnp.bfloat16, jnp.int8, None, 4),
    # Two value chunks a K/V head (Hv = 2048), each counted apart.
    ("value_chunks", 1, 1, 2, 1, 32, 2048, jnp.float32, jnp.float32, None, 3),
    # A latent cache: the values are the key's first Hv columns.
    ("latent", 2, 1, 4, 1, 80, 64, jnp.bfloat16, jnp.bfloat16, None, 4),
]


def _inputs(gen, b, t, n, k, h, hv, q_dtype, cache_dtype, page_size):
  """Queries, decode_attention's cache keywords and ragged lengths."""
  s = 96
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), q_dtype)
  key = gen.standard_normal((b, s, k, h)).astype(np.float32)
  value = gen.standard_normal((b, s, k, hv)).astype(np.float32)
  lengths = jnp.asarray(
      [s, 3, 50][:b] if b > 1 else [77], jnp.int32)
  if hv < h:  # Latent: no value cache.
    return q, dict(key=jnp.asarray(key, cache_dtype), value=None,
                   value_head_dim=hv), lengths
  kw = {}
  if cache_dtype == jnp.int8:
    (key, kw["key_scale"]), (value, kw["value_scale"]) = (
        pallas_fa.kv_cache.quantize(jnp.asarray(x), jnp.int8)
        for x in (key, value))
  else:
    key, value = (jnp.asarray(x, cache_dtype) for x in (key, value))
  if page_size:
    pages = s // page_size
    perm = gen.permutation(b * pages).astype(np.int32)
    key, value = (x.reshape(b * pages, page_size, *x.shape[2:])[
        np.argsort(perm)] for x in (key, value))
    kw["block_table"] = jnp.asarray(perm.reshape(b, pages))
  return q, dict(key=key, value=value, **kw), lengths


@attention_testing.gpu_jax_only_on_cpu
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_triton_merge_in_the_split_kernel(case):
  """The in-kernel merge gives the two-kernel path's result (to rounding:
  it merges the splits in groups) and the chunked reference's, sinks
  included."""
  name, b, t, n, k, h, hv, q_dtype, cache_dtype, page_size, splits = case
  gen = rng("decode merge in split kernel", name)
  q, cache, lengths = _inputs(gen, b, t, n, k, h, hv, q_dtype, cache_dtype,
                              page_size)
  sinks = jnp.asarray(gen.standard_normal(n), jnp.float32)
  kw = dict(cache, lengths=lengths, sinks=sinks, num_splits=splits,
            return_residual=True)
  if page_size is None:
    kw["block_kv"] = 16
  fused, two = (pallas_fa.decode_attention(
      q, implementation="triton", _merge=merge, **kw)
      for merge in ("split_kernel", "kernel"))
  def reference(dtype):
    ref_kw = {key: x for key, x in kw.items() if key != "block_kv"}
    for key in ("key", "value"):  # A float cache in the query's dtype.
      if ref_kw[key] is not None and ref_kw[key].dtype == q_dtype:
        ref_kw[key] = ref_kw[key].astype(dtype)
    return pallas_fa.decode_attention(q.astype(dtype),
                                      implementation="chunked", **ref_kw)

  want32, same = reference(jnp.float32), reference(q_dtype)
  for part, got, other, w, w16 in zip(("out", "lse"), fused, two, want32,
                                      same):
    assert got.shape == other.shape and got.dtype == other.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(other, np.float32),
                               rtol=1e-5 if q_dtype == jnp.float32 else 1e-2,
                               atol=1e-5 if q_dtype == jnp.float32 else 1e-2)
    assert_close(part, got, w, w16, q_dtype)


@attention_testing.gpu_jax_only_on_cpu
@pytest.mark.parametrize("name, k, h, hv, chunk, merge", [
    # A latent cache: the key chunk follows the value chunk down.
    ("latent", 1, 80, 64, 16, "kernel"),
    ("latent_merged", 1, 80, 64, 32, "split_kernel"),
    # Separate values, four chunks of 32 columns a split.
    ("values", 2, 32, 128, 32, "kernel"),
])
def test_triton_narrower_value_chunks(monkeypatch, name, k, h, hv, chunk,
                                      merge):
  """`_value_chunk`: more programs a split (each its value columns, the
  keys read once per chunk), fewer splits by default, the same
  attention."""
  from pallas_fa import triton as triton_pkg  # noqa: PLC0415
  grids = []
  real = triton_pkg.pallas_call

  def spy(kernel, inputs, outputs, grid, *args, **kw):
    if args[-1] == "flash_decode":
      grids.append(grid)
    return real(kernel, inputs, outputs, grid, *args, **kw)

  monkeypatch.setattr(triton_pkg, "pallas_call", spy)
  gen = rng("decode value chunks", name)
  b, t, n, s = 2, 1, 4, 96
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), jnp.bfloat16)
  key = jnp.asarray(gen.standard_normal((b, s, k, h)), jnp.bfloat16)
  if hv < h:
    cache = dict(key=key, value=None, value_head_dim=hv)
  else:
    cache = dict(key=key, value=jnp.asarray(
        gen.standard_normal((b, s, k, hv)), jnp.bfloat16))
  lengths = jnp.asarray([s, 45], jnp.int32)
  got = pallas_fa.decode_attention(
      q, lengths=lengths, implementation="triton", _value_chunk=chunk,
      _merge=merge, return_residual=True, **cache)
  wide = {key: (x.astype(jnp.float32) if x is not None else None)
          for key, x in cache.items() if key != "value_head_dim"}
  want32 = pallas_fa.decode_attention(
      q.astype(jnp.float32), lengths=lengths, implementation="chunked",
      value_head_dim=cache.get("value_head_dim"), return_residual=True,
      **wide)
  same = pallas_fa.decode_attention(
      q, lengths=lengths, implementation="chunked", return_residual=True,
      **cache)
  for part, x, w, w16 in zip(("out", "lse"), got, want32, same):
    assert_close(part, x, w, w16, jnp.bfloat16)
  # One split (a CPU's default) of hv / chunk programs a K/V head.
  assert grids == [(b, k, hv // chunk)], grids


def test_private_options_are_checked():
  """`_merge` names one of the two merges and `_value_chunk` is a power of
  two >= 16, each only where the call takes the triton kernel's
  two-kernel path."""
  gen = rng("decode merge checks")
  q = jnp.asarray(gen.standard_normal((1, 1, 4, 16)), jnp.float32)
  k = jnp.asarray(gen.standard_normal((1, 40, 2, 16)), jnp.float32)
  lengths = jnp.asarray([33])
  with pytest.raises(ValueError, match="_merge must be"):
    pallas_fa.decode_attention(q, k, k, lengths, _merge="merge_kernel",
                               implementation="triton")
  for kw in (dict(implementation="chunked"),
             dict(implementation="triton",
                  mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx),
             dict(implementation="triton", prefix_key=k[0],
                  prefix_value=k[0])):
    with pytest.raises(ValueError, match="_merge applies"):
      pallas_fa.decode_attention(q, k, k, lengths, _merge="split_kernel",
                                 **kw)
    with pytest.raises(ValueError, match="_value_chunk applies"):
      pallas_fa.decode_attention(q, k, k, lengths, _value_chunk=32, **kw)
  for bad in (24, 8, True, 32.0):
    with pytest.raises(ValueError, match="_value_chunk must be a power"):
      pallas_fa.decode_attention(q, k, k, lengths, _value_chunk=bad,
                                 implementation="triton")


@attention_testing.gpu_jax_only_on_cpu
@pytest.mark.parametrize("t", [1, 2])
def test_prefix_tiling_options_tile_the_prefix_pass(monkeypatch, t):
  """`_prefix_block_kv` and `_prefix_num_warps`: the prefix's folded pass
  reads blocks of that many keys with that many warps (one new token a
  row: the in-place merge's prefix kernel; two: the folded row's own
  decode), the rows' caches keep theirs, and the result is the
  concatenation's."""
  from pallas_fa import triton as triton_pkg  # noqa: PLC0415
  from pallas_fa.decode import kernels  # noqa: PLC0415
  tilings, launched = [], []
  real = kernels._tiling  # noqa: SLF001
  real_call = triton_pkg.pallas_call

  def spy(kernel, implementation, query, key, *args):
    tiling = real(kernel, implementation, query, key, *args)
    tilings.append((key.shape[1], tiling[0]))
    return tiling

  def spy_call(kernel, inputs, outputs, grid, warps, *args, **kw):
    if args[-1] == "flash_decode":
      launched.append(warps)
    return real_call(kernel, inputs, outputs, grid, warps, *args, **kw)

  monkeypatch.setattr(kernels, "_tiling", spy)
  monkeypatch.setattr(triton_pkg, "pallas_call", spy_call)
  gen = rng("prefix block kv", t)
  b, n, num_kv, h, s_p, s = 3, 4, 2, 32, 72, 40
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), jnp.float32)
  pk, pv = (jnp.asarray(gen.standard_normal((s_p, num_kv, h)), jnp.float32)
            for _ in range(2))
  k, v = (jnp.asarray(gen.standard_normal((b, s, num_kv, h)), jnp.float32)
          for _ in range(2))
  lengths = jnp.asarray([s, 0, 23], jnp.int32)
  got = pallas_fa.decode_attention(
      q, k, v, lengths, prefix_key=pk, prefix_value=pv,
      implementation="triton", _prefix_block_kv=16, _prefix_num_warps=2,
      return_residual=True)
  # The prefix's tiling is the one over its S_p keys.
  assert (s_p, 16) in tilings and all(
      block != 16 for keys, block in tilings if keys == s), tilings
  # The rows' kernel first (in place) or the prefix's row first (folded).
  assert sorted(launched) == [2, 4], launched
  cat = [jnp.concatenate([jnp.broadcast_to(p, (b,) + p.shape), x], axis=1)
         for p, x in ((pk, k), (pv, v))]
  want = pallas_fa.decode_attention(q, *cat, lengths + s_p,
                                    implementation="chunked",
                                    return_residual=True)
  for part, x, w in zip(("out", "lse"), got, want):
    assert_close(part, x, w)


def test_prefix_tiling_options_are_checked():
  """`_prefix_block_kv` is a power of two >= 16, `_prefix_num_warps` a
  triton warp count, each with a prefix only."""
  gen = rng("prefix block kv checks")
  q = jnp.asarray(gen.standard_normal((1, 1, 4, 16)), jnp.float32)
  k = jnp.asarray(gen.standard_normal((1, 40, 2, 16)), jnp.float32)
  lengths = jnp.asarray([33])
  for bad in (24, 8, True, 32.0):
    with pytest.raises(ValueError, match="_prefix_block_kv must be a power"):
      pallas_fa.decode_attention(q, k, k, lengths, prefix_key=k[0],
                                 prefix_value=k[0], _prefix_block_kv=bad)
  prefix = dict(prefix_key=k[0], prefix_value=k[0])
  with pytest.raises(ValueError, match="_prefix_num_warps must be 1, 2"):
    pallas_fa.decode_attention(q, k, k, lengths, _prefix_num_warps=3,
                               implementation="triton", **prefix)
  with pytest.raises(ValueError, match="_prefix_num_warps applies to "
                     "implementation='triton'"):
    pallas_fa.decode_attention(q, k, k, lengths, _prefix_num_warps=4,
                               implementation="chunked", **prefix)
  for kw in (dict(_prefix_block_kv=32),
             dict(_prefix_num_warps=4, implementation="triton")):
    with pytest.raises(ValueError, match="_prefix_block_kv and "
                       "_prefix_num_warps apply to a call with prefix_key"):
      pallas_fa.decode_attention(q, k, k, lengths, **kw)
