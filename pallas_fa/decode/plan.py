"""How a decode call is laid out: splits, GQA packing, the cache's extent
and the merge of the splits.

Shared by the jax.numpy path (`decode.chunked`) and the Pallas kernels
(`decode.kernels`): the packed [G * T_new, H] query tile of each K/V head
(`packed`), the default split count (`default_num_splits`), which key
blocks a mask_mod leaves visible (`block_kinds`), and the exact merge of
the splits' partial results with the sinks added once (`merged`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa import api
from pallas_fa import gpu_target
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa.flex import mods

Array = Any

# The static arguments of the jitted decode paths.
STATIC = ("block", "splits", "scale", "is_causal", "local_window_size",
          "logits_soft_cap", "precision")

# An H100's streaming multiprocessors: the default when the GPU does not
# report its own.
_DEFAULT_CORES = 132
# TensorCores per TPU chip (two on megacore chips, one on v5e/v6e): the
# parallel grid axes are shared among them, so more programs gain nothing.
_TPU_CORES = 2


def default_num_splits(batch: int, num_kv_heads: int, num_blocks: int,
                       platform: str | None = None, *,
                       cache_dtype=None,
                       programs_per_core: int | None = None) -> int:
  """How many parts the key axis is split into.

  A GPU wants about two waves of programs over its streaming multiprocessors
  (batch * K/V heads * splits >= 2 * 132 on an H100, `gpu_target`), four
  over a 1-byte (int8 / float8) `cache_dtype`: a program then spends more
  of each block converting the tile than waiting for its bytes, and four
  programs an SM hide each other's latency where two left the SM idle
  (int8 on an H200 at B = 1: 44.4 us with 33 splits, 36.1 with 66, two
  pipeline stages). A TPU wants one program per TensorCore (each core
  streams its blocks through one pipeline, and every split adds a partial
  result to merge; this holds for the `chunked` path on a TPU as well); a
  CPU runs one wide block at a time fastest (its threads already share
  each block's matmuls, and the interpreted kernels pay per program).
  `programs_per_core` (a GPU kernel's tiling that says how many of its
  programs an SM holds) replaces the dtype's count.
  """
  platform = platform or api.platform()
  if platform == "cpu":
    return 1
  target = _TPU_CORES if platform == "tpu" else 8
  if platform == "gpu":
    gpu = gpu_target.current()
    per_core = 2
    if cache_dtype is not None and jnp.dtype(cache_dtype).itemsize == 1:
      per_core = 4
    per_core = programs_per_core or per_core
    target = per_core * ((gpu.core_count if gpu else 0) or _DEFAULT_CORES)
  splits = max(1, target // max(1, batch * num_kv_heads))
  return int(min(splits, num_blocks))


def capacity(key, block_table) -> int:
  """S_max: the entries a row of the cache holds."""
  if block_table is None:
    return key.shape[1]
  return block_table.shape[1] * key.shape[1]


def in_range(lengths, block_table, key):
  """Traced lengths and pages clamped into the cache (concrete ones were
  checked by `decode_attention`), so that every implementation gives the
  same, documented answer and no kernel reads outside the cache."""
  lengths = jnp.clip(lengths, 0, capacity(key, block_table))
  if block_table is not None:
    block_table = jnp.clip(block_table, 0, key.shape[0] - 1)
  return lengths, block_table


def clip_block(block: int, key, block_table) -> int:
  """A caller's block of keys, no wider than the cache needs: the smallest
  power of two >= 32 that covers a row when `block` is wider than that
  (such a block is a valid one for every implementation), else `block`. A
  block past the cache only pads it: 2^30 keys would allocate terabytes."""
  cover = 1 << max(5, (capacity(key, block_table) - 1).bit_length())
  return min(block, cover)


def kernel_blocks(key, block_table, block: int) -> int:
  """Blocks of `block` keys per sequence that a kernel indexes: enough to
  cover a row of the cache (every page's, paged; a block may span pages
  where it is wider than one, `triton.decode`)."""
  return -(-capacity(key, block_table) // block)


# Elements of a mask_mod tile that `block_kinds` evaluates at once (the
# blocks are classified a chunk at a time: a long cache's whole [B, N,
# T_new, S] tile need not fit in memory).
_MOD_ELEMENTS = 1 << 22


def block_kinds(mask_mod, mask_mod_args, lengths, query_positions, *,
                num_heads: int, num_kv: int, num_blocks: int, block: int,
                is_causal: bool, window) -> Array:
  """int32 [B, K, num_blocks]: the kind of each block of `block` keys for
  each K/V head's packed rows (its G query heads times the T_new new
  tokens) under the built-in masks (`masking.decode_block_kinds`) and the
  mask_mod, which is evaluated exactly, once on every (new token, cached
  key) pair."""
  b, t = query_positions.shape
  i32 = jnp.int32
  # The function is evaluated only along the axes it reads: a mask_mod that
  # ignores the head (most do) runs once for all of them.
  uses = mods.uses_batch_and_head(mods.MASK_MOD, mask_mod, mask_mod_args)
  km, gm = (num_kv, num_heads // num_kv) if uses[1] else (1, 1)
  chunk = max(1, min(num_blocks, _MOD_ELEMENTS // (b * km * gm * t * block)))

  def classify(step):
    kv_pos = step * chunk * block + jnp.arange(chunk * block, dtype=i32)
    visible = mods.evaluate(
        mask_mod, (b, km, gm, t, chunk * block),
        batch=jnp.arange(b, dtype=i32).reshape(b, 1, 1, 1, 1),
        head=jnp.arange(km * gm, dtype=i32).reshape(1, km, gm, 1, 1),
        q_idx=query_positions.reshape(b, 1, 1, t, 1),
        kv_idx=kv_pos.reshape(1, 1, 1, 1, -1), args=mask_mod_args,
        uses=uses)
    visible = visible.reshape(b, km, gm, t, chunk, block)
    cached = (kv_pos[None] < lengths[:, None]).reshape(b, 1, 1, 1, chunk, block)
    kinds = masking.kind_of(jnp.any(visible & cached, axis=(2, 3, 5)),
                            jnp.all(visible, axis=(2, 3, 5)))
    return jnp.broadcast_to(kinds, (b, num_kv, chunk))

  steps = -(-num_blocks // chunk)
  kinds = jax.lax.map(classify, jnp.arange(steps, dtype=i32))
  kinds = jnp.moveaxis(kinds, 0, 2).reshape(b, num_kv, steps * chunk)
  builtin = masking.decode_block_kinds(
      lengths, query_positions, num_blocks=num_blocks, block=block,
      is_causal=is_causal, window=window)
  return masking.intersect_kinds(builtin[:, None, :], kinds[..., :num_blocks])


def packed(query, lengths, query_positions, num_kv):
  """GQA packing: (q [B, K, G * T, H], row positions [B, G * T], query
  positions [B, T]); row r of K/V head k is query head k * G + r // T at
  token r % T."""
  b, t, n, h = query.shape
  g = n // num_kv
  if query_positions is None:
    query_positions = (lengths[:, None] - t
                       + jnp.arange(t, dtype=jnp.int32)[None, :])
  query_positions = query_positions.astype(jnp.int32)
  q = query.reshape(b, t, num_kv, g, h).transpose(0, 2, 3, 1, 4)
  return (q.reshape(b, num_kv, g * t, h),
          jnp.tile(query_positions, (1, g)), query_positions)


def merged(out, lse, sinks, axis, new_tokens):
  """The splits' partial results (splits on `axis`) merged exactly
  (`online_softmax.merge_parts`) into [B, K, G * T, Hv] and [B, K, G * T],
  then the sinks added once (`online_softmax.add_sink`)."""
  out, lse = online_softmax.merge_parts(out, lse, axis=axis)
  if sinks is None:
    return out, lse
  # Packed row r of K/V head k belongs to query head k * G + r // T.
  num_kv = out.shape[1]
  packed = jnp.repeat(sinks.reshape(num_kv, -1), new_tokens, axis=1)
  return online_softmax.add_sink(out, lse, packed)


def unpacked(out, lse, query):
  """[B, K, G * T, Hv] and [B, K, G * T] back to the query's [B, T, N, Hv]
  (typed like it) and [B, T, N]."""
  b, t, n, _ = query.shape
  num_kv, _, hv = out.shape[1:]
  g = n // num_kv
  out = out.reshape(b, num_kv, g, t, hv).transpose(0, 3, 1, 2, 4)
  lse = lse.reshape(b, num_kv, g, t).transpose(0, 3, 1, 2)
  return out.reshape(b, t, n, hv).astype(query.dtype), lse.reshape(b, t, n)
