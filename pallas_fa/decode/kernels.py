"""The Pallas decode kernels' dispatch: `triton.decode`, `mosaic_tpu.decode`
and `mosaic_gpu.decode`, their block and split count, and (with a mask_mod, or
on TPU) the packing and merge around their `partials`.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa import kv_cache
from pallas_fa.decode import plan

Array = Any


def _decode_kernel(implementation):
  """The decode module of a backend folder, imported on first use (the core
  names backends, never imports them: a backend whose compiler stack is
  missing breaks nothing until it is called)."""
  return importlib.import_module(f"pallas_fa.{implementation}.decode")


def interpreted(implementation) -> bool:
  """Whether a kernel backend's decode kernels run interpreted here."""
  return _decode_kernel(implementation).interpreted()


def folds_rows(implementation, rows: int, dtype=jnp.bfloat16) -> bool:
  """Whether `rows` packed query rows (a shared prefix's B * T_new * G
  folded queries of a K/V head, of `dtype`) decode as one row's tile:
  always on "chunked", within the kernel module's `MAX_FOLDED_ROWS` on a
  kernel (`MAX_FOLDED_ROWS_FLOAT32` for float32 queries where it sets
  one; none: never)."""
  if implementation == "chunked":
    return True
  kernel = _decode_kernel(implementation)
  limit = getattr(kernel, "MAX_FOLDED_ROWS", 0)
  if jnp.dtype(dtype).itemsize > 2:
    limit = getattr(kernel, "MAX_FOLDED_ROWS_FLOAT32", limit)
  return rows <= limit


def run(implementation, query, key, value, lengths, block_table,
        query_positions, sinks, num_splits, block_kv, static):
  """A Pallas kernel (`triton.decode` or `mosaic_tpu.decode`): its block
  and splits.

  A quantized cache reaches a kernel module that sets `QUANTIZED_CACHES`
  as it is, with `key_scale` / `value_scale` in `static` (float32 of rank
  3, each dim 1 or the cache's; absent for a float8 cache without them).
  A latent cache (one that sets `LATENT_CACHES`) comes as value=key with
  `value_head_dim` in `static`; without a mask_mod its value chunk is the
  module's `LATENT_VALUE_CHUNK` unless `static` names one.
  """
  if query.dtype == jnp.float64:
    # As `vjp.Backend.check_call` says of a dtype a backend cannot run.
    raise NotImplementedError(
        f"implementation={implementation!r} runs float32, bfloat16 and "
        f"float16, not float64 (query {query.dtype=}); "
        "implementation='chunked' (or None) decodes float64.")
  kernel = _decode_kernel(implementation)
  if ((kv_cache.is_quantized(key.dtype) or kv_cache.is_quantized(value.dtype))
      and not getattr(kernel, "QUANTIZED_CACHES", False)):
    raise NotImplementedError(
        f"implementation={implementation!r} reads float caches only; a "
        f"quantized key/value cache ({key.dtype}, {value.dtype}) decodes "
        f"with implementation='chunked' (or None).")
  supports = getattr(kernel, "supports", None)
  why = supports and supports(query, key, value, block_table, static)
  if why:
    raise NotImplementedError(
        f"implementation={implementation!r} cannot decode this call: {why}; "
        "implementation='triton' or 'chunked' (or None) decodes it.")
  latent_chunk = getattr(kernel, "LATENT_VALUE_CHUNK", None)
  if (latent_chunk and "value_head_dim" in static
      and static.get("max_value_chunk") is None
      and static.get("mask_mod") is None):
    static = dict(static, max_value_chunk=latent_chunk)
  block, splits = _tiling(kernel, implementation, query, key, value,
                          block_table, static, num_splits, block_kv)
  if (implementation in ("triton", "mosaic_gpu")
      and static.get("mask_mod") is None):
    # Two kernels in all: the programs find their key runs themselves.
    return kernel.attention(
        query, key, value, lengths, block_table, query_positions, sinks,
        block=block, splits=splits, **static)
  return _decode_split_kernel(
      query, key, value, lengths, block_table, query_positions, sinks,
      partials=kernel.partials, block=block, splits=splits, **static)


def _tiling(kernel, implementation, query, key, value, block_table, static,
            num_splits, block_kv) -> tuple[int, int]:
  """(keys per block, splits) of a kernel's call: its `block_for` and
  `plan.default_num_splits` unless the caller chose them."""
  b, t, n, h = query.shape
  num_kv = key.shape[2]
  hv = static.get("value_head_dim") or value.shape[3]
  paged = block_table is not None
  shape = dict(head_dim=h, value_head_dim=hv, groups=n // num_kv,
               new_tokens=t, page_size=key.shape[1] if paged else None,
               block_kv=block_kv)
  # The programs an SM holds: the split count's default.
  per_core = None
  if implementation == "triton":
    platform = None
    max_value_chunk = static.get("max_value_chunk")
    # A key and value cache of 1-byte values (not latent).
    one_byte = (key.dtype.itemsize == 1 and value.dtype.itemsize == 1
                and "value_head_dim" not in static)
    block = kernel.block_for(**shape, max_value_chunk=max_value_chunk,
                             one_byte=one_byte, cache_len=key.shape[1],
                             float32_queries=query.dtype == jnp.float32)
    # Value head-dim chunks are programs too.
    programs = num_kv * kernel.value_chunks(hv, n // num_kv * t,
                                            max_value_chunk)
  elif implementation == "mosaic_gpu":
    platform = None
    block = block_kv or kernel.DEFAULT_BLOCK
    # A latent cache's value chunks are units too.
    programs = num_kv * kernel.latent_chunks(
        static.get("value_head_dim"), static.get("max_value_chunk"))
    per_core = 1  # One persistent CTA an SM (`mosaic_gpu.decode`).
  else:
    platform = "tpu"
    block = kernel.block_for(**shape, dtype=query.dtype,
                             cache_len=key.shape[1], cache_dtype=key.dtype,
                             latent="value_head_dim" in static)
    programs = num_kv
  if block_kv is not None:
    block = plan.clip_block(block, key, block_table)
    if implementation == "mosaic_gpu":
      block = kernel.check_block(block, key.shape[1])
  if implementation == "triton":
    per_core = kernel.programs_per_sm(block, one_byte)
  num_blocks = plan.kernel_blocks(key, block_table, block)
  if num_splits is None:
    num_splits = plan.default_num_splits(b, programs, num_blocks, platform,
                                         cache_dtype=key.dtype,
                                         programs_per_core=per_core)
  return block, int(min(num_splits, num_blocks))


def merges_prefix_in_place(implementation, query, prefix_value,
                           static) -> bool:
  """Whether `run_with_prefix` takes the call: the triton kernel, one new
  token a row (the folded prefix partials are then a strided view of each
  row's), no flex attention, a value cache (not latent) and the prefix's
  value columns padded as the rows' (`triton.decode.value_tiling`)."""
  if (implementation != "triton" or query.shape[1] != 1
      or query.dtype == jnp.float64
      or static.get("score_mod") is not None
      or static.get("mask_mod") is not None
      or static.get("value_head_dim") is not None):
    return False
  b, _, n, _ = query.shape
  groups = n // prefix_value.shape[1]
  if not folds_rows(implementation, b * groups, query.dtype):
    return False
  kernel = _decode_kernel(implementation)
  hv = prefix_value.shape[2]
  return (kernel.value_tiling(hv, kernel.packed_rows(groups))
          == kernel.value_tiling(hv, kernel.packed_rows(b * groups)))


def run_with_prefix(implementation, query, key, value, lengths, block_table,
                    query_positions, sinks, prefix_key, prefix_value,
                    num_splits, block_kv, static, prefix_block_kv=None,
                    prefix_num_warps=None):
  """`run` over the rows' own caches and a shared prefix at once, where
  `merges_prefix_in_place`: the prefix's split kernel (every row's new
  token folded into one row), the rows' split kernel, and one merge of
  both kernels' partials with the sinks, three kernels and the fold's
  small transpose in all. `query_positions` [B, 1] are those of the
  concatenation `[prefix; cache]`; `prefix_block_kv` and
  `prefix_num_warps` (None: the defaults) the prefix pass's keys per
  block and warps a program."""
  kernel = _decode_kernel(implementation)
  b = query.shape[0]
  block, splits = _tiling(kernel, implementation, query, key, value,
                          block_table, static, num_splits, block_kv)
  folded = query.reshape(1, b, *query.shape[2:])
  prefix_block, prefix_splits = _tiling(
      kernel, implementation, folded, prefix_key[None], prefix_value[None],
      None, {}, None, prefix_block_kv)
  return kernel.attention_with_prefix(
      query, key, value, lengths, block_table, query_positions, sinks,
      prefix_key, prefix_value, block=block, splits=splits,
      prefix_block=prefix_block, prefix_splits=prefix_splits,
      prefix_num_warps=prefix_num_warps, **static)


@functools.partial(jax.jit, static_argnames=plan.STATIC + (
    "partials", "score_mod", "mask_mod", "value_head_dim", "num_warps"))
def _decode_split_kernel(query, key, value, lengths, block_table,
                         query_positions, sinks, *, partials, block, splits,
                         **static):
  """Packs the queries, runs a kernel's `partials` and merges its splits.

  `partials(q, row_pos, query_positions, key, value, lengths, block_table,
  *, block, splits, **static)` takes the packed queries [B, K, R, H]
  (R = G * T_new), each packed row's position [B, R], the new tokens'
  positions [B, T_new], the cache as given and int32 lengths; it returns
  each split's normalised result and logsumexp, float32 [B, K, splits, R,
  Hv] and [B, K, splits, R] (-inf for a split that saw no key).
  """
  lengths = lengths.astype(jnp.int32)
  q, row_pos, query_positions = plan.packed(
      query, lengths, query_positions, key.shape[2])
  lengths, block_table = plan.in_range(lengths, block_table, key)
  if static.get("mask_mod") is not None:
    # The kernels visit each K/V head's non-empty blocks only.
    static["kinds"] = plan.block_kinds(
        static["mask_mod"], static["mask_mod_args"], lengths,
        query_positions, num_heads=query.shape[2], num_kv=key.shape[2],
        num_blocks=plan.kernel_blocks(key, block_table, block), block=block,
        is_causal=static["is_causal"],
        window=static["local_window_size"])
  out, lse = partials(
      q, row_pos, query_positions, key, value, lengths, block_table,
      block=block, splits=splits, **static)
  return plan.unpacked(*plan.merged(out, lse, sinks, 2, query.shape[1]), query)
