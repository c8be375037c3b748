"""`decode_attention`: the argument checks and the choice of path."""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_fa import api
from pallas_fa import checks
from pallas_fa import kv_cache
from pallas_fa import manual_axes
from pallas_fa import online_softmax
from pallas_fa.decode import chunked
from pallas_fa.decode import kernels
from pallas_fa.decode import plan
from pallas_fa.decode import prefix
from pallas_fa.flex import mods

Array = Any

# The implementations decode_attention runs on.
IMPLEMENTATIONS = ("chunked", "triton", "mosaic_tpu", "mosaic_gpu")
# Those that run a Pallas decode kernel (`decode.kernels`).
KERNELS = IMPLEMENTATIONS[1:]


def _check_cache(name, x, query):
  x = checks.as_array(name, x)
  if x.ndim != 4:
    raise ValueError(
        f"{name} must be [B, S_max, K, H] or pages [P, page_size, K, H], "
        f"got {name}.shape={x.shape}.")
  if name == "key" and x.shape[3] != query.shape[3]:
    raise ValueError(
        f"key's head dim must equal the query's, got key.shape={x.shape}, "
        f"query.shape={query.shape}.")
  if x.dtype != query.dtype and not kv_cache.is_quantized(x.dtype):
    raise TypeError(
        f"{name} must have the query's dtype {query.dtype} or be a quantized "
        f"cache (int8, float8_e4m3fn, float8_e5m2), got {name}.dtype="
        f"{x.dtype}.")
  return x


def _check_scale(name, scale, cache, cache_name):
  """A quantized cache's scales as float32 of rank 3 (each dim 1 or the
  cache's), or None for a float8 cache without them (scale 1)."""
  if scale is None and cache.dtype == jnp.int8:
    raise ValueError(
        f"{name} is required with an int8 {cache_name} cache (its values "
        f"are integers; kv_cache.quantize returns both).")
  return checks.check_scale(
      name, scale, cache, cache_name,
      forms="[B, S_max, K], pages [P, page_size, K], [K] or a scalar")


def decode_attention(
    query: Array,
    key: Array,
    value: Array,
    lengths: Array,
    *,
    block_table: Array | None = None,
    query_positions: Array | None = None,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: int | Sequence[int | None] | None = None,
    logits_soft_cap: float | None = None,
    sinks: Array | None = None,
    num_splits: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    implementation: str | None = None,
    precision: str | jax.lax.Precision | None = None,
    return_residual: bool = False,
    score_mod: Callable | None = None,
    score_mod_args: Sequence[Array] = (),
    mask_mod: Callable | None = None,
    mask_mod_args: Sequence[Array] = (),
    key_scale: Array | None = None,
    value_scale: Array | None = None,
    value_head_dim: int | None = None,
    prefix_key: Array | None = None,
    prefix_value: Array | None = None,
    _fold_prefix: bool | str = True,
    _value_chunk: int | None = None,
    _prefix_block_kv: int | None = None,
    _prefix_num_warps: int | None = None,
    _quantized_query: bool = False,
    _float16_products: bool = True,
    _pdl_merge: bool = False,
):
  """Attention of T_new new tokens over a KV cache (generation).

  Equal to `flash_attention(query, key, value,
  key_value_seq_lengths=lengths, query_positions=..., ...)` on the gathered
  cache, computed with GQA packing and split-KV (see the module docstring).

  Args:
    query: [B, T_new, N, H], T_new small (1 for plain decoding, a few for
      speculative decoding).
    key: the cache, [B, S_max, K, H], or pages [P, page_size, K, H] with
      `block_table`. N % K == 0.
      The query's dtype, or a quantized cache: int8, float8_e4m3fn or
      float8_e5m2 values with `key_scale` (`kv_cache.quantize`); the cache
      attention sees is `key.astype(float32) * key_scale[..., None]`, each
      tile dequantized as it is read (never a float copy of the cache).
    value: like key, with its own head dim Hv (and `value_scale`), or None
      for a latent cache (`value_head_dim`).
    lengths: int [B], valid cache entries per sequence, the new tokens
      included (they have been written to the cache already); in [0, S_max]
      (S_max = max_pages * page_size for a paged cache). Concrete values
      outside raise ValueError. Traced ones (a jitted serving loop) cannot
      be checked and are clamped into [0, S_max]: a row whose length is past
      the cache attends to the whole cache, its new tokens keeping their
      positions `lengths - T_new + arange(T_new)`, and a negative length
      attends to nothing (zeros, lse -inf). `check_cache_indices` checks
      traced values under `jax.experimental.checkify`.
    block_table: int [B, max_pages] for a paged cache: page
      `block_table[b, i]` holds keys [i * page_size, (i + 1) * page_size) of
      sequence b. None for a contiguous cache. Entries must be pages in
      [0, P): concrete ones outside raise ValueError; traced ones are
      clamped into [0, P), so the row reads another page -- a wrong answer,
      but never memory outside the pool (`check_cache_indices` catches them
      under checkify).
    query_positions: int [B, T_new], default `lengths - T_new +
      arange(T_new)`.
    scale: logit scale, default 1/sqrt(H).
    is_causal: keep keys with cache index <= query position (default True:
      a new token sees itself and everything before it).
    local_window_size: as in `flash_attention`.
    logits_soft_cap: as in `flash_attention`.
    sinks: float [N] (or [1]) sink logits, as in `flash_attention`: added
      once to the merged result of the splits.
    num_splits: parts the key axis is split into; default from the shape
      and platform (`default_num_splits`).
    block_kv: keys per block of a contiguous cache (a power of two >= 16
      for "triton", a multiple of 8 for "mosaic_tpu", of 32 for its
      quantized caches); default from the head dim. A paged cache reads
      whole pages a block ("chunked": as many as come nearest to its
      contiguous block), a divisor of it ("mosaic_tpu": a multiple
      of 8, or of 32 when quantized) or the contiguous default ("triton":
      a slice of a page, or pages smaller than it gathered several to a
      block).
    num_warps: "triton": warps per program, 1, 2, 4, 8 or 16; default
      4 for a packed tile of up to 16 rows x 128 value columns, else 8.
      Fewer warps split a block's keys fewer ways (each warp's share of the
      softmax reductions is exchanged through shared memory) at more
      registers a thread. "mosaic_gpu": the consumer warps of a CTA, 4
      (the default: one warpgroup) or 8 (two, taking every other block of
      a unit, each with its own partial result).
    implementation: None or "chunked" (jax.numpy, any platform, any head
      dim), "triton" (the Pallas-Triton kernel; a GPU or CPU interpret
      mode, page sizes multiples of 16; float, quantized and latent caches, a
      float8_e4m3fn one from compute capability 8.9) or "mosaic_tpu" (the
      Pallas TPU kernel; a TPU or its interpret mode elsewhere, page sizes
      multiples of 8, of 32 for a quantized cache; float, quantized and
      latent caches) or "mosaic_gpu" (the Pallas Mosaic GPU kernel; Hopper
      or its interpreter on a CPU; a contiguous or paged cache of the
      query's 16-bit dtype or an int8/float8 one, at H = 64, 128 or 256,
      pages of a multiple of 8 keys dividing or a multiple of 64 (1-byte
      ones of at least 64 past H = 128), a contiguous cache or shared
      prefix of at least 64 entries, G * T_new <= 64, a contiguous 16-bit
      latent cache (H a multiple of 64 up to 576, Hv of 256), no
      score_mod/mask_mod, a block_kv of 64 or 128).
      Other backends have no decode kernel and raise NotImplementedError.
    precision: as in `flash_attention`.
    return_residual: also return the logsumexp [B, T_new, N] (with
      `sinks`, the sink term included).
    score_mod: as in `flash_attention`, with `q_idx` the new token's
      position and `kv_idx` the cache index; applied after the soft cap.
      Every implementation; the kernels fuse it as `flash_attention`'s
      do, and a value it computes per key must not depend on the head
      there (`fused_mods.packed_values`).
    score_mod_args: the arrays score_mod reads.
    mask_mod: as in `flash_attention` (same indices); intersects the other
      masks. Every implementation classifies the cache's key blocks under
      it exactly (`block_kinds`: evaluated once on every cached key):
      blocks no new token sees are never read (a sliding window with sink
      tokens reads only the sinks and the window) and blocks every new
      token sees whole skip the masking ("chunked" per step over all
      sequences, the kernels per sequence and K/V head).
    mask_mod_args: the arrays mask_mod reads.
    key_scale: a quantized key cache's float32 scales, broadcastable to
      `key.shape[:-1]` (contiguous [B, S_max, K], paged [P, page_size, K];
      a per-head [K] or a scalar broadcast too). Required for int8; a
      float8 cache's defaults to 1. Like the cache, entries past a row's
      length are never used (they may hold anything). "chunked" and
      "triton" read quantized caches ("triton" loads the 1-byte tiles and
      dequantizes them in registers, a broadcast scale never expanded);
      so does "mosaic_tpu" (1-byte tiles DMA'd and dequantized in VMEM,
      blocks and pages multiples of 32 keys; the scales laid out per block
      of keys, a small copy of them per call).
    value_scale: the same for `value`.
    value_head_dim: with value=None, a latent (MLA) cache: the values are
      key's first `value_head_dim` columns, read with the keys (one read
      of the cache; every implementation but "mosaic_gpu"), a quantized
      key's scales
      dequantizing both.
    prefix_key: [S_p, K, H], the query's dtype: a prefix shared by every
      row (a common prompt), before each row's own cache: the result is
      decoding each row over `[prefix; cache[b, :lengths[b]]]`, `lengths`
      counting the row's own entries and the new tokens at positions
      `S_p + lengths - T_new + arange(T_new)` (or `query_positions`, in
      the concatenation), score_mod/mask_mod seeing those positions. The
      prefix is read once per call for all rows and merged exactly with
      each row's own part (`decode.prefix`); every implementation
      ("mosaic_gpu": a prefix of at least 64 entries).
    prefix_value: [S_p, K, Hv], with prefix_key (defaults to prefix_key's
      first Hv columns with a latent cache).
    _fold_prefix: private, for A/B benchmarks: False sends the prefix part
      through `flash_attention` even where the rows' folded queries fit a
      decode tile (`decode.prefix.attend`); "two_merges" folds them but
      merges each part's splits on its own before merging the parts (the
      path `kernels.run_with_prefix` replaces).
    _value_chunk: private, for A/B benchmarks: the most value columns a
      triton program computes (a power of two >= 16): more programs a
      split and so fewer splits, less partial traffic (a latent cache's
      [16, 512] partials), at the cost of reading each key block once per
      value chunk (through L2); no mask_mod and no prefix.
    _prefix_block_kv, _prefix_num_warps: private, for A/B benchmarks:
      the keys per block of the prefix's folded pass (a power of two >=
      16) and its warps a program (triton: as `num_warps`, which sets both
      kernels'); None: the kernel's default for the folded tile; with a
      prefix only.
    _quantized_query: private, for A/B benchmarks: on "mosaic_gpu" over an
      int8 or float8_e4m3fn cache, the query rows quantized to the cache's
      dtype (one scale a row) and Q K^T on 8-bit wgmma over the K tiles as
      stored, instead of widening them (`mosaic_gpu.decode`); the query's
      rounding is the accuracy it costs.
    _float16_products: private, for A/B benchmarks: False keeps the
      bfloat16 query's dtype for the products of "mosaic_gpu" over a
      float8 cache whose scales are constant along it (its tiles then
      widen through float32), where the default runs them in float16
      (`mosaic_gpu.decode.product_dtypes`).
    _pdl_merge: private, for A/B benchmarks: on "mosaic_gpu", the splits'
      merge as a Mosaic GPU kernel launched while the split kernel runs
      (programmatic dependent launch, jax >= 0.11;
      `mosaic_gpu.decode_merge`), where the call's parts fit it; else the
      Triton merge.

  Returns:
    out [B, T_new, N, Hv] typed like query, or (out, lse). Empty calls are
    valid on every implementation, as in `flash_attention`: B or T_new = 0
    give empty results, a cache with no entries (S_max = 0) zeros with lse
    -inf; no kernel runs for them.

  Raises:
    ValueError / TypeError: invalid arguments (the message names them),
      concrete lengths past the cache or block-table entries outside the
      pool included.
    NotImplementedError: `implementation` has no decode path, or "triton"
      ("mosaic_tpu") with a page size that is not a multiple of 16 (8; 32
      for a quantized cache), or with a score_mod/mask_mod it cannot fuse
      (`pallas_fa.flex.fused_mods`).
  """
  # Not a str (a list, say) is flash_attention's TypeError, before the
  # lookups below would hash it.
  api.check_implementation(implementation, None)
  if implementation not in (None,) + IMPLEMENTATIONS:
    if implementation in api.REGISTRY:
      raise NotImplementedError(
          f"implementation={implementation!r} has no decode path; decode "
          f"runs on {IMPLEMENTATIONS}.")
    raise ValueError(
        f"Unknown implementation={implementation!r}; decode runs on "
        f"{IMPLEMENTATIONS} or None.")
  query = checks.as_array("query", query)
  if query.ndim != 4:
    raise ValueError(f"query must be [B, T_new, N, H], got {query.shape=}.")
  if not any(query.dtype == d for d in (jnp.float32, jnp.bfloat16,
                                         jnp.float16, jnp.float64)):
    raise TypeError(
        f"query must be float32, bfloat16, float16 or float64, got "
        f"{query.dtype=}.")
  b, t, n, h = query.shape
  key = _check_cache("key", key, query)
  value, hv = _check_value(value, value_head_dim, key, query)
  key_scale = _check_scale("key_scale", key_scale, key, "key")
  if value is None and value_scale is not None:
    raise ValueError(
        "value_scale applies to a value cache; a latent cache (value=None) "
        "is dequantized by key_scale.")
  value_scale = (None if value is None else
                 _check_scale("value_scale", value_scale, value, "value"))
  num_kv = key.shape[2]
  if not (h and n and num_kv):
    raise ValueError(
        f"query and key need heads and a head dim, got {query.shape=} "
        f"[B, T_new, N, H], key.shape={key.shape} [..., K, H].")
  if n % num_kv:
    raise ValueError(
        f"query heads N must be a multiple of key/value heads K, got N={n}, "
        f"K={num_kv}.")
  block_table = _check_block_table(block_table, key, b, block_kv)
  lengths = checks.as_index_array("lengths", lengths)
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(
        f"lengths must be an int [B={b}] array, got {lengths.shape=}, "
        f"{lengths.dtype=}.")
  api.check_non_negative("lengths", lengths)
  api.check_flag("return_residual", return_residual)
  _check_lengths_fit(lengths, plan.capacity(key, block_table))
  if block_table is not None:
    kv_cache.check_page_indices(block_table, key.shape[0])
  if query_positions is not None:
    query_positions = checks.as_index_array("query_positions",
                                            query_positions)
    if (query_positions.shape != (b, t)
        or not jnp.issubdtype(query_positions.dtype, jnp.integer)):
      raise ValueError(
          f"query_positions must be an int [B, T_new]={(b, t)} array, got "
          f"{query_positions.shape=}, {query_positions.dtype=}.")
  for name, x in (("num_splits", num_splits), ("block_kv", block_kv)):
    if x is not None and (not isinstance(x, (int, np.integer))
                          or isinstance(x, bool) or x < 1):
      raise ValueError(f"{name} must be a positive int or None, got {x!r}.")
  if not (isinstance(_fold_prefix, bool) or _fold_prefix == "two_merges"):
    raise ValueError(f"_fold_prefix must be a bool or 'two_merges', got "
                     f"{_fold_prefix!r}.")
  warps = _check_num_warps(num_warps, implementation)
  prefix_launch = _check_prefix_tiling(_prefix_block_kv, _prefix_num_warps,
                                       prefix_key, implementation)
  launch = dict(warps, **_check_value_chunk(_value_chunk, implementation,
                                            mask_mod, prefix_key),
                **_check_mosaic_gpu_flag("_quantized_query", _quantized_query,
                                         False, implementation, prefix_key),
                **_check_mosaic_gpu_flag("_float16_products",
                                         _float16_products, True,
                                         implementation, prefix_key),
                **_check_mosaic_gpu_flag("_pdl_merge", _pdl_merge, False,
                                         implementation, prefix_key))
  if prefix_value is None and value is None and prefix_key is not None:
    prefix_value = jnp.asarray(prefix_key)[..., :hv]  # A latent prefix.
  prefix_key, prefix_value = prefix.check(prefix_key, prefix_value, query, hv,
                                          num_kv)
  _check_symbolic_dims(implementation, query, key, value, block_table,
                       prefix_key, prefix_value)
  static = api.static_arguments(
      scale=scale, is_causal=is_causal, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, precision=precision)
  if static["scale"] is None:
    static["scale"] = 1.0 / math.sqrt(h)
  sinks = api.check_sinks(sinks, n, online_softmax.stats_dtype(query.dtype))
  score_mod_args = mods.as_args("score_mod_args", score_mod_args)
  mask_mod_args = mods.as_args("mask_mod_args", mask_mod_args)
  mods.check_functions(score_mod, score_mod_args, mask_mod, mask_mod_args)
  flex = {}
  if score_mod is not None or mask_mod is not None:
    flex = dict(score_mod=score_mod, score_mod_args=score_mod_args,
                mask_mod=mask_mod, mask_mod_args=mask_mod_args)
  # Inside a user's shard_map that checks varying axes: one type for every
  # array of the call (`manual_axes`), which the query then carries.
  (query, key, value, key_scale, value_scale, lengths, block_table,
   query_positions, sinks, prefix_key, prefix_value, flex) = (
       manual_axes.vary_together(
           query, key, value, key_scale, value_scale, lengths, block_table,
           query_positions, sinks, prefix_key, prefix_value, flex))
  if implementation in KERNELS:
    manual_axes.check_kernels(
        implementation, query,
        interpreted=lambda: kernels.interpreted(implementation))
  if 0 in (b, t):  # No rows: an empty result, as in `flash_attention`.
    return _result(jnp.zeros((b, t, n, hv), query.dtype),
                   jnp.full((b, t, n), online_softmax.MASK_VALUE,
                            online_softmax.stats_dtype(query.dtype)),
                   return_residual)
  # Generation needs no gradients: differentiating through the cache
  # reads (a paged gather, the split loops) is refused here, by name. A
  # call with no entries to read is constant, its gradients zero.
  if plan.capacity(key, block_table) > 0 or prefix_key is not None:
    query, key, value, key_scale, value_scale, prefix_key, prefix_value = (
        _forward_only(x) for x in (query, key, value, key_scale,
                                   value_scale, prefix_key, prefix_value))
    if implementation == "triton":  # Its kernels take the sinks in.
      sinks = _forward_only(sinks)
  functions = {name: flex[name] for name in ("score_mod", "mask_mod")
               if flex}
  decode = functools.partial(
      _decode, implementation, value_head_dim=hv, static=static,
      functions=functions, tiling=dict(num_splits=num_splits,
                                       block_kv=block_kv, launch=launch,
                                       prefix_block_kv=_prefix_block_kv,
                                       prefix_launch=prefix_launch),
      warps=warps, fold_prefix=_fold_prefix)
  spec = manual_axes.explicit_spec(query)
  if spec is not None:
    # Arrays typed with Explicit mesh axes: the result is sharded as the
    # query is (as in `flash_attention`).
    decode = jax.sharding.auto_axes(
        decode, out_sharding=(spec, jax.sharding.PartitionSpec(*spec[:-1])))
  out, lse = decode(query, key, value, key_scale, value_scale, lengths,
                    block_table, query_positions, sinks, prefix_key,
                    prefix_value, flex.get("score_mod_args", ()),
                    flex.get("mask_mod_args", ()))
  return _result(out, lse, return_residual)


def _decode(implementation, query, key, value, key_scale, value_scale,
            lengths, block_table, query_positions, sinks, prefix_key,
            prefix_value, score_mod_args, mask_mod_args, *, value_head_dim,
            static, functions, tiling, warps, fold_prefix):
  """(out, lse) of a checked, non-empty `decode_attention` call."""
  b, t, _, _ = query.shape
  hv = value_head_dim
  flex = {}
  if functions:
    flex = dict(functions, score_mod_args=score_mod_args,
                mask_mod_args=mask_mod_args)
  cache = dict(key=key, value=value, value_head_dim=hv, key_scale=key_scale,
               value_scale=value_scale, lengths=lengths,
               block_table=block_table)
  if prefix_key is None:
    return _own_cache(implementation, query, query_positions, sinks, cache,
                      tiling, static, flex)
  # One new token a row on triton: three kernels (`kernels.run_with_prefix`)
  # that read the lengths or the positions as given.
  if (fold_prefix is True and value is not None
      and plan.capacity(key, block_table) > 0
      and kernels.merges_prefix_in_place(implementation, query, prefix_value,
                                         dict(static, **flex))):
    scales = {name: x for name, x in (("key_scale", key_scale),
                                      ("value_scale", value_scale))
              if x is not None}
    return kernels.run_with_prefix(
        implementation, query, key, value, lengths, block_table,
        query_positions, sinks, prefix_key, prefix_value,
        tiling["num_splits"], tiling["block_kv"],
        dict(static, **scales, **warps), tiling["prefix_block_kv"],
        tiling["prefix_launch"].get("num_warps"))
  s_p = prefix_key.shape[0]
  if query_positions is None:
    query_positions = (lengths[:, None].astype(jnp.int32) - t
                       + jnp.arange(t, dtype=jnp.int32)[None]) + s_p
  shifted = dict(flex)
  if flex:
    shifted.update(
        score_mod=prefix.shifted(functions["score_mod"], s_p, True),
        mask_mod=prefix.shifted(functions["mask_mod"], s_p, False))
  own = _own_cache(implementation, query, query_positions - s_p, None,
                   cache, tiling, static, shifted)

  def decode_one_row(query, query_positions, key, value):
    row = dict(key=key, value=value, value_head_dim=hv, key_scale=None,
               value_scale=None, block_table=None,
               lengths=jnp.full((1,), s_p, jnp.int32))
    return _own_cache(implementation, query, query_positions, None, row,
                      dict(num_splits=None, launch=tiling["prefix_launch"],
                           block_kv=tiling["prefix_block_kv"]), static, {})

  shared = prefix.attend(query, prefix_key, prefix_value, query_positions,
                         implementation=implementation, static=static,
                         flex=flex, decode_one_row=decode_one_row,
                         fold=bool(fold_prefix))
  return prefix.merge(shared, own, sinks, query.dtype)


def _forward_only(x):
  """x, unchanged, behind a derivative rule that refuses: decode_attention
  is forward only (its sinks excepted where they join after the
  kernels)."""
  if x is None or not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  return _refuse_derivatives(x)


@jax.custom_jvp
def _refuse_derivatives(x):
  return x


@_refuse_derivatives.defjvp
def _refuse_derivatives_jvp(primals, tangents):
  del primals, tangents
  raise NotImplementedError(
      "decode_attention is forward only (generation): no gradient or jvp "
      "flows to its query, cache or scales (nor to the sinks on 'triton'). "
      "Differentiate flash_attention over the same keys instead "
      "(key_value_seq_lengths and query_positions say which).")


def _check_symbolic_dims(implementation, query, key, value, block_table,
                         prefix_key, prefix_value):
  """Shape polymorphism (`jax.export`): the batch (and a paged cache's page
  count) may be symbolic on `chunked`; the blocks and splits are sized from
  every other dim, and the kernels' grids from all of them."""
  batch, rest = checks.symbolic_batch_and_rest(query, key, value,
                                               block_table)
  rest += checks.symbolic_dims(
      *(x.shape for x in (prefix_key, prefix_value) if x is not None))
  if rest:
    raise NotImplementedError(
        "decode_attention needs concrete new-token counts, cache lengths, "
        f"head counts and head dims, got the symbolic {', '.join(rest)} "
        f"(query {query.shape}, key {key.shape}); only the batch may be "
        "symbolic.")
  if batch and implementation not in (None, "chunked"):
    raise NotImplementedError(
        f"implementation={implementation!r} needs a concrete batch size, "
        f"got the symbolic {', '.join(batch)}; 'chunked' (the default) "
        "takes one.")


def _result(out, lse, return_residual):
  return (out, lse) if return_residual else out


def _own_cache(implementation, query, query_positions, sinks, cache, tiling,
               static, flex):
  """(out, lse) over the rows' own caches (`cache`: the checked key, value,
  scales, lengths and block table)."""
  b, t, n, h = query.shape
  key, hv = cache["key"], cache["value_head_dim"]
  num_kv = key.shape[2]
  if plan.capacity(key, cache["block_table"]) == 0:
    # A cache with no entries: zeros with lse -inf (no key to see), no
    # kernel launched on empty operands. Constants: zero gradients.
    out = jnp.zeros((b, t, n, hv), query.dtype)
    lse = jnp.full((b, t, n), online_softmax.MASK_VALUE,
                   online_softmax.stats_dtype(query.dtype))
    if sinks is not None:
      out, lse = online_softmax.add_sink(out, lse, sinks)
    return out, lse
  scales = {name: cache[name] for name in ("key_scale", "value_scale")
            if cache[name] is not None}
  if implementation in KERNELS:
    value, latent = cache["value"], {}
    if value is None:
      if not getattr(kernels._decode_kernel(implementation),
                     "LATENT_CACHES", False):
        raise NotImplementedError(
            f"implementation={implementation!r} reads a separate value "
            "cache; a latent cache (value=None) decodes with "
            "implementation='chunked' (or None).")
      # The kernel reads the values from the key's first hv columns.
      value, latent = key, dict(value_head_dim=hv)
    return kernels.run(
        implementation, query, key, value, cache["lengths"],
        cache["block_table"], query_positions, sinks, tiling["num_splits"],
        tiling["block_kv"],
        dict(static, **flex, **scales, **latent, **tiling["launch"]))
  if cache["block_table"] is None:
    block = (plan.clip_block(tiling["block_kv"], key, None)
             if tiling["block_kv"] else chunked.default_block(
                 key.shape[1], b, num_kv, h, query.dtype))
    num_blocks = -(-key.shape[1] // block)
  else:
    num_pages = cache["block_table"].shape[1]
    block = chunked.paged_block(key.shape[1], num_pages, b, num_kv, h,
                                query.dtype)
    num_blocks = -(-num_pages // (block // key.shape[1]))
  splits = tiling["num_splits"] or plan.default_num_splits(
      b, num_kv, num_blocks)
  flex = {**dict(score_mod=None, score_mod_args=(), mask_mod=None,
                 mask_mod_args=()), **flex}
  return chunked.attention(
      query, key, cache["value"], cache["lengths"], cache["block_table"],
      query_positions, sinks, flex["score_mod_args"], flex["mask_mod_args"],
      cache["key_scale"], cache["value_scale"], block=int(block),
      splits=int(min(splits, num_blocks)), score_mod=flex["score_mod"],
      mask_mod=flex["mask_mod"], value_head_dim=hv, **static)


def _check_value_chunk(value_chunk, implementation, mask_mod,
                       prefix_key) -> dict:
  """{"max_value_chunk": n} for the triton kernel's `attention`, or {}
  (the default).

  Raises:
    ValueError: a value chunk that is not a power of two >= 16, or one
      where the call does not take `triton.decode.attention` (another
      implementation, a mask_mod or a shared prefix).
  """
  if value_chunk is None:
    return {}
  _check_power_of_two("_value_chunk", value_chunk)
  if (implementation != "triton" or mask_mod is not None
      or prefix_key is not None):
    raise ValueError(
        "_value_chunk applies to implementation='triton' without a mask_mod "
        f"or a prefix, got {implementation=}, mask_mod={mask_mod!r}, "
        f"prefix_key given: {prefix_key is not None}.")
  return {"max_value_chunk": int(value_chunk)}


def _check_mosaic_gpu_flag(name: str, flag, default: bool, implementation,
                           prefix_key) -> dict:
  """{name without its underscore: flag} for the Mosaic GPU kernel's
  `attention` where a private flag (`_quantized_query`,
  `_float16_products`, `_pdl_merge`) is set to other than its default, or
  {}. The cache it reads is the kernel's to check
  (`mosaic_gpu.decode.supports`).

  Raises:
    TypeError: not a bool.
    ValueError: set where the call does not take the Mosaic GPU decode
      kernel (another implementation, or a shared prefix).
  """
  if api.check_flag(name, flag) == default:
    return {}
  if implementation != "mosaic_gpu" or prefix_key is not None:
    raise ValueError(
        f"{name}={flag} applies to implementation='mosaic_gpu' without a "
        f"prefix, got {implementation=}, prefix_key given: "
        f"{prefix_key is not None}.")
  return {name[1:]: bool(flag)}


def _check_power_of_two(name: str, x) -> None:
  """Raises ValueError: `x` (a private tiling option, named) is not an int
  power of two >= 16."""
  if (not isinstance(x, (int, np.integer)) or isinstance(x, bool) or x < 16
      or x & (x - 1)):
    raise ValueError(f"{name} must be a power of two >= 16, got {x!r}.")


def _check_prefix_tiling(block, warps, prefix_key, implementation) -> dict:
  """{"num_warps": n} for the prefix pass's launch, or {} (the default).

  Raises:
    ValueError: `_prefix_block_kv` is not a power of two >= 16,
      `_prefix_num_warps` not a valid `num_warps` for the implementation,
      or either is given without a prefix.
  """
  if block is not None:
    _check_power_of_two("_prefix_block_kv", block)
  launch = _check_num_warps(warps, implementation, "_prefix_num_warps")
  if (block is not None or launch) and prefix_key is None:
    raise ValueError("_prefix_block_kv and _prefix_num_warps apply to a "
                     "call with prefix_key.")
  return launch


def _check_num_warps(num_warps, implementation,
                     name: str = "num_warps") -> dict:
  """{"num_warps": n} for a kernel's launch, or {} (the default).

  Raises:
    ValueError: num_warps is not 1, 2, 4, 8 or 16 on "triton", not 4 or
      8 (one or two consumer warpgroups) on "mosaic_gpu" (not as
      `_prefix_num_warps`), or is given to another implementation (which
      has no warps to set).
  """
  if num_warps is None:
    return {}
  allowed = {"triton": (1, 2, 4, 8, 16)}
  if name == "num_warps":
    allowed["mosaic_gpu"] = (4, 8)
  if implementation not in allowed:
    raise ValueError(
        f"{name} applies to implementation={' or '.join(map(repr, allowed))}"
        f", got implementation={implementation!r}.")
  if (not isinstance(num_warps, (int, np.integer))
      or isinstance(num_warps, bool)
      or num_warps not in allowed[implementation]):
    choices = allowed[implementation]
    raise ValueError(
        f"{name} must be {', '.join(map(str, choices[:-1]))} or "
        f"{choices[-1]} on implementation={implementation!r}, got "
        f"{num_warps!r}.")
  return {"num_warps": int(num_warps)}


def _check_value(value, value_head_dim, key, query):
  """(value or None, Hv): a value cache matching the key's, or a latent
  cache (value=None) whose values are key's first `value_head_dim`
  columns."""
  if value is None:
    h = key.shape[3]
    if (not isinstance(value_head_dim, (int, np.integer))
        or isinstance(value_head_dim, bool) or not 0 < value_head_dim <= h):
      raise ValueError(
          f"value=None (a latent cache) takes value_head_dim, the values' "
          f"width: an int in [1, H={h}], got value_head_dim="
          f"{value_head_dim!r}.")
    return None, int(value_head_dim)
  value = _check_cache("value", value, query)
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(
        f"value must match key's first three dims, got key.shape="
        f"{key.shape}, value.shape={value.shape}.")
  if value_head_dim is not None and value_head_dim != value.shape[3]:
    raise ValueError(
        f"value_head_dim applies to a latent cache (value=None); with a "
        f"value cache it must be None or value.shape[3]={value.shape[3]}, "
        f"got value_head_dim={value_head_dim!r}.")
  return value, value.shape[3]


def _check_block_table(block_table, key, batch: int, block_kv):
  if block_table is None:
    if key.shape[0] != batch:
      raise ValueError(
          f"a contiguous cache must be [B, S_max, K, H] with the query's "
          f"B={batch}, got key.shape={key.shape} (pass block_table= for "
          f"pages).")
    return None
  block_table = checks.as_index_array("block_table", block_table)
  if (not jnp.issubdtype(block_table.dtype, jnp.integer)
      or block_table.ndim != 2 or block_table.shape[0] != batch):
    raise ValueError(
        f"block_table must be an int [B={batch}, max_pages] array, got "
        f"{block_table.shape=}, {block_table.dtype=}.")
  if block_kv is not None:
    raise ValueError("block_kv applies to a contiguous cache only; a paged "
                     "cache is read a page at a time.")
  return block_table


def _check_lengths_fit(lengths, s_max: int) -> None:
  if isinstance(lengths, jax.core.Tracer):
    return  # Clamped by `plan.in_range`; `check_cache_indices` checks it.
  values = np.asarray(lengths)
  if np.any(values > s_max):
    raise ValueError(
        f"lengths must be at most the cache's {s_max=} entries per row "
        f"(max_pages * page_size for a paged cache), got lengths={values}.")


def check_cache_indices(key: Array, lengths: Array,
                        block_table: Array | None = None) -> None:
  """Opt-in run-time checks of traced decode indices, with checkify.

  `decode_attention` raises on lengths past the cache and on block-table
  entries outside the pool when they are concrete, and clamps traced ones
  (see its `lengths` and `block_table`). In a jitted serving loop, call
  this before it, inside a function transformed by
  `jax.experimental.checkify.checkify`, to turn them into a checkify error:

    def step(q, k, v, lengths, table):
      decode.check_cache_indices(k, lengths, table)
      return decode.decode_attention(q, k, v, lengths, block_table=table)

    err, out = jax.jit(checkify.checkify(step))(q, k, v, lengths, table)
    err.throw()

  Opt-in because a `checkify.check` that no `checkify.checkify` transforms
  fails to trace under jit.

  Args:
    key: the key cache as passed to `decode_attention` (its shape gives
      S_max, or the page count P).
    lengths: int [B].
    block_table: int [B, max_pages] for a paged cache, else None.

  Raises:
    TypeError / ValueError: key is not a rank-4 array, lengths or
      block_table not an integer array (named).
  """
  if jnp.ndim(key) != 4:
    raise ValueError(
        f"key must be the cache [B, S_max, K, H] or pages [P, page_size, "
        f"K, H], got key.shape={jnp.shape(key)}.")
  given = {"lengths": lengths}
  if block_table is not None:
    given["block_table"] = block_table
  for name, x in given.items():
    dtype = checks.as_array(name, x).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(
          f"{name} must be an integer array, got {name}.dtype={dtype}.")
  s_max = plan.capacity(key, block_table)
  checkify.check(
      jnp.all((lengths >= 0) & (lengths <= s_max)),
      f"lengths must be in [0, S_max={s_max}], got lengths={{}}", lengths)
  if block_table is not None:
    checkify.check(
        jnp.all((block_table >= 0) & (block_table < key.shape[0])),
        f"block_table entries must be pages in [0, num_pages={key.shape[0]}"
        "), got block_table={}", block_table)


