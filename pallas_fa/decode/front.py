"""`decode_attention`: a few new query tokens against a (paged) KV cache.

Generation is memory-bound: each step reads the whole K/V cache once and does
little arithmetic per byte, so its speed limit is bytes read over memory
bandwidth. Two things get close to that limit (FlashDecoding):

* **GQA packing.** All G query heads of a K/V head, and all T_new new tokens,
  form one [G * T_new, H] tile, so each K/V byte is read once per K/V head,
  not once per query head.
* **Split-KV.** The key axis is split into `num_splits` parts that run
  side by side (one program each in the `triton` and `mosaic_tpu` kernels,
  one vectorised axis in `chunked`), each keeping its own online-softmax
  statistics; the partial results are merged exactly through their
  logsumexp. With one long sequence and few heads the splits are what fill
  the machine.

The cache is either contiguous, `[B, S_max, K, H]`, or **paged**: pages
`[num_pages, page_size, K, H]` plus a block table `[B, max_pages]` naming the
page that holds each sequence's keys [i * page_size, (i + 1) * page_size).
Both are read block by block (`chunked` through a table, a contiguous cache
being its own identity table, so one code path serves both). Per-sequence
`lengths` make the batch ragged; rows past a sequence's length are never
read into a result (they may hold anything, NaN included).

Semantics are `flash_attention`'s on the gathered cache: the new tokens sit at
positions `lengths - T_new + arange(T_new)` unless `query_positions` says
otherwise; keys are at their cache index; causal, sliding window and soft cap
act on those positions; attention sinks join once, after the splits merge.
Forward only.

Three implementations:

* `chunked` (the default): jax.numpy on any platform and head dim; split p
  reads blocks p, p + splits, ... of every sequence, all splits as one
  vectorised axis.
  A flex `mask_mod` (`q_idx` is the new token's position) is first
  classified over every step's keys, so keys no new token sees are never
  read and keys all of them see whole skip the masking.
* `triton`: a Pallas-Triton kernel (`triton.decode`), interpreted on CPU.
  Grid (B, K, splits x value-head-dim chunks): each program holds the
  packed [G * T_new, H] tile (rows padded to a power of two >= 16) and
  walks one contiguous run of the sequence's visible key blocks (blocks
  past the length, after the last query under causal or outside the
  window are never read), which it finds from the lengths itself; a
  second small kernel merges the partials (`online_softmax.merge_parts`),
  so a one-token step launches two kernels (with a mask_mod, its block
  lists are built and the partials merged in plain JAX). A paged cache
  is read page by page through the block table, in blocks of the largest
  power of two that divides the page size (multiples of 16). Head dims up
  to 256 are one tile; larger ones (up to 8192 and beyond) are cut into
  chunks: Q.K^T loops over them and each program writes one chunk of the
  output, recomputing the logits. float32, bfloat16 and float16;
  `num_splits` counts the value chunks as programs too.
* `mosaic_tpu`: a Pallas TPU kernel (`mosaic_tpu.decode`), compiled by
  Mosaic on a TPU and run in Pallas's TPU interpret mode elsewhere. Grid
  (B, K, splits, blocks per split), the last axis sequential: the packed
  tile (rows padded to whole sublane tiles) stays in VMEM while the
  pipeline streams the split's visible key blocks; the lengths, the split
  runs and the block table are scalar-prefetched, so the K/V index maps
  turn a paged cache into the DMAs' addresses, and skipped steps re-name
  the block already resident (no DMA). Head dims are padded to multiples of
  128; blocks are multiples of 128 keys (contiguous; fewer for very wide
  heads) or divisors of the page size (multiples of 8). float32, bfloat16
  and float16 (computed in float32).
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_fa import api
from pallas_fa import gpu_target
from pallas_fa import kv_cache
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa.flex import mods

Array = Any

# Bytes of K (or V) one block of the contiguous cache spans (all K/V heads):
# large enough to amortise the per-block loop overhead (on a 2-core x86 CPU
# at S = 32k, 4 MiB blocks ran several times faster than 512 KiB ones).
_BLOCK_BYTES = 1 << 22
_IMPLEMENTATIONS = ("chunked", "triton", "mosaic_tpu")
# An H100's streaming multiprocessors: the default when the GPU does not
# report its own.
_DEFAULT_CORES = 132
# TensorCores per TPU chip (two on megacore chips, one on v5e/v6e): the
# parallel grid axes are shared among them, so more programs gain nothing.
_TPU_CORES = 2


def default_num_splits(batch: int, num_kv_heads: int, num_blocks: int,
                       platform: str | None = None) -> int:
  """How many parts the key axis is split into.

  A GPU wants about two waves of programs over its streaming multiprocessors
  (batch * K/V heads * splits >= 2 * 132 on an H100, `gpu_target`); a TPU
  one program per TensorCore (each core streams its blocks through one
  pipeline, and every split adds a partial result to merge; this holds for
  the `chunked` path on a TPU as well); a CPU runs
  one wide block at a time fastest (its threads already share each
  block's matmuls, and the interpreted kernels pay per program).
  """
  platform = platform or api.platform()
  if platform == "cpu":
    return 1
  target = _TPU_CORES if platform == "tpu" else 8
  if platform == "gpu":
    gpu = gpu_target.current()
    target = 2 * ((gpu.core_count if gpu else 0) or _DEFAULT_CORES)
  splits = max(1, target // max(1, batch * num_kv_heads))
  return int(min(splits, num_blocks))


def _check_cache(name, x, query):
  x = jnp.asarray(x)
  if x.ndim != 4:
    raise ValueError(
        f"{name} must be [B, S_max, K, H] or pages [P, page_size, K, H], "
        f"got {x.shape=}.")
  if x.dtype != query.dtype:
    raise TypeError(
        f"{name} must have the query's dtype {query.dtype}, got {x.dtype}.")
  return x


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
    implementation: str | None = None,
    precision: str | jax.lax.Precision | None = None,
    return_residual: bool = False,
    score_mod: Callable | None = None,
    score_mod_args: Sequence[Array] = (),
    mask_mod: Callable | None = None,
    mask_mod_args: Sequence[Array] = (),
):
  """Attention of T_new new tokens over a KV cache (generation).

  Equal to `flash_attention(query, key_cache, value_cache,
  key_value_seq_lengths=lengths, query_positions=..., ...)` on the gathered
  cache, computed with GQA packing and split-KV (see the module docstring).

  Args:
    query: [B, T_new, N, H], T_new small (1 for plain decoding, a few for
      speculative decoding).
    key: the cache, [B, S_max, K, H], or pages [P, page_size, K, H] with
      `block_table`. N % K == 0.
    value: like key, with its own head dim Hv.
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
      for "triton", a multiple of 8 for "mosaic_tpu"); default from the
      head dim. A paged cache reads one page per block ("chunked") or a
      divisor of it ("triton": a power of two, "mosaic_tpu": a multiple of
      8).
    implementation: None or "chunked" (jax.numpy, any platform, any head
      dim), "triton" (the Pallas-Triton kernel; a GPU or CPU interpret
      mode, page sizes multiples of 16) or "mosaic_tpu" (the Pallas TPU
      kernel; a TPU or its interpret mode elsewhere, page sizes multiples
      of 8). Other backends have no decode kernel and raise
      NotImplementedError.
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
      ("mosaic_tpu") with a page size that is not a multiple of 16 (8), or
      with a score_mod/mask_mod it cannot fuse (`pallas_fa.flex.fused_mods`).
  """
  if implementation not in (None,) + _IMPLEMENTATIONS:
    if implementation in api.REGISTRY:
      raise NotImplementedError(
          f"implementation={implementation!r} has no decode path; decode "
          f"runs on {_IMPLEMENTATIONS}.")
    raise ValueError(
        f"Unknown implementation={implementation!r}; decode runs on "
        f"{_IMPLEMENTATIONS} or None.")
  query = jnp.asarray(query)
  if query.ndim != 4:
    raise ValueError(f"query must be [B, T_new, N, H], got {query.shape=}.")
  if not any(query.dtype == d for d in (jnp.float32, jnp.bfloat16,
                                         jnp.float16, jnp.float64)):
    raise TypeError(
        f"query must be float32, bfloat16, float16 or float64, got "
        f"{query.dtype=}.")
  key = _check_cache("key", key, query)
  value = _check_cache("value", value, query)
  b, t, n, h = query.shape
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(
        f"value must match key's first three dims, got {key.shape=}, "
        f"{value.shape=}.")
  num_kv = key.shape[2]
  if key.shape[3] != h:
    raise ValueError(
        f"key's head dim must equal the query's, got {key.shape=}, "
        f"{query.shape=}.")
  if n % num_kv:
    raise ValueError(
        f"query heads N must be a multiple of key/value heads K, got N={n}, "
        f"K={num_kv}.")
  if block_table is None:
    if key.shape[0] != b:
      raise ValueError(
          f"a contiguous cache must be [B, S_max, K, H] with the query's B, "
          f"got {key.shape=}, {query.shape=} (pass block_table= for pages).")
  else:
    block_table = jnp.asarray(block_table)
    if (not jnp.issubdtype(block_table.dtype, jnp.integer)
        or block_table.ndim != 2 or block_table.shape[0] != b):
      raise ValueError(
          f"block_table must be an int [B={b}, max_pages] array, got "
          f"{block_table.shape=}, {block_table.dtype=}.")
    if block_kv is not None:
      raise ValueError("block_kv applies to a contiguous cache only; a paged "
                       "cache is read a page at a time.")
  lengths = jnp.asarray(lengths)
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(
        f"lengths must be an int [B={b}] array, got {lengths.shape=}, "
        f"{lengths.dtype=}.")
  api.check_non_negative("lengths", lengths)
  _check_lengths_fit(lengths, _capacity(key, block_table))
  if block_table is not None:
    kv_cache.check_page_indices(block_table, key.shape[0])
  if query_positions is not None:
    query_positions = jnp.asarray(query_positions)
    if (query_positions.shape != (b, t)
        or not jnp.issubdtype(query_positions.dtype, jnp.integer)):
      raise ValueError(
          f"query_positions must be an int [B, T_new]={(b, t)} array, got "
          f"{query_positions.shape=}.")
  for name, x in (("num_splits", num_splits), ("block_kv", block_kv)):
    if x is not None and (not isinstance(x, (int, np.integer))
                          or isinstance(x, bool) or x < 1):
      raise ValueError(f"{name} must be a positive int or None, got {x!r}.")
  static = api.static_arguments(
      scale=scale, is_causal=is_causal, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, precision=precision)
  if static["scale"] is None:
    static["scale"] = 1.0 / math.sqrt(h)
  sinks = api.check_sinks(sinks, n, online_softmax.stats_dtype(query.dtype))
  score_mod_args = mods.as_args("score_mod_args", score_mod_args)
  mask_mod_args = mods.as_args("mask_mod_args", mask_mod_args)
  mods.check_functions(score_mod, score_mod_args, mask_mod, mask_mod_args)
  if 0 in (b, t, _capacity(key, block_table)):
    # Nothing to compute, as in `flash_attention`'s empty calls: no rows
    # (B or T_new = 0) give an empty result, a cache with no entries zeros
    # with lse -inf (no key to see). Constants: every gradient is zero, and
    # no kernel is launched on empty operands.
    out = jnp.zeros((b, t, n, value.shape[3]), query.dtype)
    lse = jnp.full((b, t, n), online_softmax.MASK_VALUE,
                   online_softmax.stats_dtype(query.dtype))
    return (out, lse) if return_residual else out
  flex = {}
  if score_mod is not None or mask_mod is not None:
    flex = dict(score_mod=score_mod, score_mod_args=score_mod_args,
                mask_mod=mask_mod, mask_mod_args=mask_mod_args)
  if implementation in ("triton", "mosaic_tpu"):
    out, lse = _split_kernel(implementation, query, key, value, lengths,
                             block_table, query_positions, sinks, num_splits,
                             block_kv, dict(static, **flex))
    return (out, lse) if return_residual else out
  if block_table is None:
    block = block_kv or _default_block(key.shape[1], num_kv, h,
                                       query.dtype.itemsize)
    num_blocks = -(-key.shape[1] // block)
  else:
    block, num_blocks = key.shape[1], block_table.shape[1]
  splits = num_splits or default_num_splits(b, num_kv, num_blocks)
  out, lse = _decode(
      query, key, value, lengths, block_table, query_positions, sinks,
      score_mod_args, mask_mod_args, block=int(block),
      splits=int(min(splits, num_blocks)), score_mod=score_mod,
      mask_mod=mask_mod, **static)
  return (out, lse) if return_residual else out


def _capacity(key, block_table) -> int:
  """S_max: the entries a row of the cache holds."""
  if block_table is None:
    return key.shape[1]
  return block_table.shape[1] * key.shape[1]


def _check_lengths_fit(lengths, s_max: int) -> None:
  if isinstance(lengths, jax.core.Tracer):
    return  # Clamped by `_in_range`; `check_cache_indices` checks it.
  values = np.asarray(lengths)
  if np.any(values > s_max):
    raise ValueError(
        f"lengths must be at most the cache's {s_max=} entries per row "
        f"(max_pages * page_size for a paged cache), got lengths={values}.")


def _in_range(lengths, block_table, key):
  """Traced lengths and pages clamped into the cache (concrete ones were
  checked by `decode_attention`), so that every implementation gives the
  same, documented answer and no kernel reads outside the cache."""
  lengths = jnp.clip(lengths, 0, _capacity(key, block_table))
  if block_table is not None:
    block_table = jnp.clip(block_table, 0, key.shape[0] - 1)
  return lengths, block_table


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
  """
  s_max = _capacity(key, block_table)
  checkify.check(
      jnp.all((lengths >= 0) & (lengths <= s_max)),
      f"lengths must be in [0, S_max={s_max}], got lengths={{}}", lengths)
  if block_table is not None:
    checkify.check(
        jnp.all((block_table >= 0) & (block_table < key.shape[0])),
        f"block_table entries must be pages in [0, num_pages={key.shape[0]}"
        "), got block_table={}", block_table)


def _decode_kernel(implementation):
  """The decode module of a backend folder, imported on first use (the core
  names backends, never imports them: a backend whose compiler stack is
  missing breaks nothing until it is called)."""
  return importlib.import_module(f"pallas_fa.{implementation}.decode")


def _split_kernel(implementation, query, key, value, lengths, block_table,
                  query_positions, sinks, num_splits, block_kv, static):
  """A Pallas kernel (`triton.decode` or `mosaic_tpu.decode`): its block
  and splits."""
  if query.dtype == jnp.float64:
    raise TypeError(
        f"implementation={implementation!r} runs float32, bfloat16 and "
        f"float16, got query {query.dtype=}.")
  b, t, n, h = query.shape
  num_kv, hv = key.shape[2], value.shape[3]
  paged = block_table is not None
  shape = dict(head_dim=h, value_head_dim=hv, groups=n // num_kv,
               new_tokens=t, page_size=key.shape[1] if paged else None,
               block_kv=block_kv)
  if implementation == "triton":
    kernel, platform = _decode_kernel("triton"), None
    block = kernel.block_for(**shape)
    # Value head-dim chunks are programs too.
    programs = num_kv * kernel.value_chunks(hv, n // num_kv * t)
  else:
    kernel, platform = _decode_kernel("mosaic_tpu"), "tpu"
    block = kernel.block_for(**shape, dtype=query.dtype,
                             cache_len=key.shape[1])
    programs = num_kv
  num_blocks = _kernel_blocks(key, block_table, block)
  if num_splits is None:
    num_splits = default_num_splits(b, programs, num_blocks, platform)
  splits = int(min(num_splits, num_blocks))
  if implementation == "triton" and static.get("mask_mod") is None:
    # Two kernels in all: the programs find their key runs themselves.
    return kernel.attention(
        query, key, value, lengths, block_table, query_positions, sinks,
        block=block, splits=splits, **static)
  return _decode_split_kernel(
      query, key, value, lengths, block_table, query_positions, sinks,
      partials=kernel.partials, block=block, splits=splits, **static)


def _kernel_blocks(key, block_table, block: int) -> int:
  """Blocks of `block` keys per sequence that a kernel indexes: every
  page's, or enough to cover a contiguous cache."""
  if block_table is not None:
    return block_table.shape[1] * (key.shape[1] // block)
  return -(-key.shape[1] // block)


def _default_block(s_max: int, num_kv: int, h: int, itemsize: int) -> int:
  rows = _BLOCK_BYTES // (num_kv * h * itemsize)
  block = 1 << max(4, min(11, rows.bit_length() - 1))  # 16 .. 2048
  return min(block, max(16, 1 << (s_max - 1).bit_length()))


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


def _packed(query, lengths, query_positions, num_kv):
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


def _merged(out, lse, sinks, axis, new_tokens):
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


def _unpacked(out, lse, query):
  """[B, K, G * T, Hv] and [B, K, G * T] back to the query's [B, T, N, Hv]
  (typed like it) and [B, T, N]."""
  b, t, n, _ = query.shape
  num_kv, _, hv = out.shape[1:]
  g = n // num_kv
  out = out.reshape(b, num_kv, g, t, hv).transpose(0, 3, 1, 2, 4)
  lse = lse.reshape(b, num_kv, g, t).transpose(0, 3, 1, 2)
  return out.reshape(b, t, n, hv).astype(query.dtype), lse.reshape(b, t, n)


_STATIC = ("block", "splits", "scale", "is_causal", "local_window_size",
           "logits_soft_cap", "precision")


@functools.partial(jax.jit, static_argnames=_STATIC + (
    "partials", "score_mod", "mask_mod"))
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
  q, row_pos, query_positions = _packed(
      query, lengths, query_positions, key.shape[2])
  lengths, block_table = _in_range(lengths, block_table, key)
  if static.get("mask_mod") is not None:
    # The kernels visit each K/V head's non-empty blocks only.
    static["kinds"] = block_kinds(
        static["mask_mod"], static["mask_mod_args"], lengths,
        query_positions, num_heads=query.shape[2], num_kv=key.shape[2],
        num_blocks=_kernel_blocks(key, block_table, block), block=block,
        is_causal=static["is_causal"],
        window=static["local_window_size"])
  out, lse = partials(
      q, row_pos, query_positions, key, value, lengths, block_table,
      block=block, splits=splits, **static)
  return _unpacked(*_merged(out, lse, sinks, 2, query.shape[1]), query)


@functools.partial(
    jax.jit, static_argnames=_STATIC + ("score_mod", "mask_mod"))
def _decode(query, key, value, lengths, block_table, query_positions, sinks,
            score_mod_args, mask_mod_args, *, block, splits, scale,
            is_causal, local_window_size, logits_soft_cap, precision,
            score_mod, mask_mod):
  b, t, n, h = query.shape
  num_kv, hv = key.shape[2], value.shape[3]
  rows = n // num_kv * t
  acc_dtype = online_softmax.stats_dtype(query.dtype)
  lengths = lengths.astype(jnp.int32)
  q, row_pos, query_positions = _packed(
      query, lengths, query_positions, num_kv)
  lengths, block_table = _in_range(lengths, block_table, key)

  # Split p reads blocks p, p + splits, p + 2 splits, ...: interleaving keeps
  # every split equally busy whatever the (ragged) lengths. Step j reads
  # blocks [j * splits, (j + 1) * splits), the keys [j * span, (j + 1) *
  # span); `read(j)` returns them with the cache index of its first key.
  span = splits * block
  if block_table is None:
    # Each step's blocks are one contiguous slice of the cache (no gather).
    num_blocks = -(-key.shape[1] // block)
    steps = -(-num_blocks // splits)
    if key.shape[1] < span:  # A cache shorter than one step: pad it.
      pad = span - key.shape[1]
      key, value = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
                    for x in (key, value))
    s_max = key.shape[1]

    def read(step):
      # A last step that would run past the cache reads its last span
      # instead of a padded copy of the cache; the masked body drops the
      # keys the step before read.
      start = jnp.minimum(step * span, s_max - span)
      return start, *(
          jax.lax.dynamic_slice_in_dim(x, start, span, 1).reshape(
              b, splits, block, num_kv, x.shape[3])
          for x in (key, value))
  else:
    num_blocks = block_table.shape[1]
    steps = -(-num_blocks // splits)
    table = jnp.pad(block_table.astype(jnp.int32),
                    ((0, 0), (0, steps * splits - num_blocks)))
    table = table.reshape(b, steps, splits)

    def read(step):
      pages = jax.lax.dynamic_index_in_dim(table, step, 1, keepdims=False)
      return step * span, key[pages], value[pages]  # [B, P, C, K, H]

  if acc_dtype == query.dtype:
    # Full precision: fold the scale into q once instead of per logit.
    q, logit_scale = q * scale, 1.0
  else:
    logit_scale = scale
  offsets = jnp.arange(span, dtype=jnp.int32).reshape(splits, block)
  g = n // num_kv
  tile = (b, splits, num_kv, g, t, block)  # What the mods are evaluated on.

  def flex_indices(kv_pos):
    """(batch, head, q_idx, kv_idx) of a step's [B, P, K, G, T, C] tile:
    packed row r of K/V head k is query head k * G + r // T, the new token
    r % T at its position."""
    i32 = jnp.int32
    return (jnp.arange(b, dtype=i32).reshape(b, 1, 1, 1, 1, 1),
            jnp.arange(n, dtype=i32).reshape(1, 1, num_kv, g, 1, 1),
            query_positions.reshape(b, 1, 1, 1, t, 1),
            kv_pos.reshape(1, splits, 1, 1, 1, block))

  def mod_visible(kv_pos):
    """mask_mod on a step's [B, P, K, G * T, C] tile."""
    indices = flex_indices(kv_pos)
    return mods.evaluate(
        mask_mod, tile, batch=indices[0],
        head=indices[1], q_idx=indices[2], kv_idx=indices[3],
        args=mask_mod_args).reshape(b, splits, num_kv, g * t, block)

  def body(step, carry, *, masked):
    m_i, l_i, acc = carry
    start, k_blk, v_blk = read(step)  # [B, P, C, K, H]
    s = _einsum("bkrh,bpckh->bpkrc", q, k_blk, precision=precision,
                preferred_element_type=acc_dtype)
    if logit_scale != 1.0:
      s = s * logit_scale
    s = online_softmax.soft_cap(s, logits_soft_cap)
    kv_pos = start + offsets  # [P, C]
    if score_mod is not None:
      indices = flex_indices(kv_pos)
      s = online_softmax.ScoreMod(
          fn=score_mod, args=score_mod_args, batch=indices[0],
          head=indices[1], q_idx=indices[2], kv_idx=indices[3],
      )(s.reshape(tile)).reshape(s.shape)
    if masked:
      valid = ((kv_pos >= step * span)[None]
               & (kv_pos[None] < lengths[:, None, None]))  # [B, P, C]
      # Rows past a length may hold anything; 0 * NaN would leak into P.V.
      v_blk = jnp.where(valid[..., None, None], v_blk, 0)
      vis = _visible(valid, kv_pos, row_pos, is_causal, local_window_size)
      if mask_mod is not None:
        vis = vis & mod_visible(kv_pos)
      s = online_softmax.apply_mask(s, vis)
    m_i, l_i, p, alpha = online_softmax.update(m_i, l_i, s)
    acc = acc * alpha[..., None] + _einsum(
        "bpkrc,bpckh->bpkrh", p.astype(value.dtype), v_blk,
        precision=precision, preferred_element_type=acc_dtype)
    return m_i, l_i, acc

  carry = online_softmax.init(
      (b, splits, num_kv, rows), (b, splits, num_kv, rows, hv), acc_dtype)
  # Only the blocks below the longest sequence are visited, and the steps
  # that every new token of every sequence sees whole (typically all but
  # the last under causal masking) skip the masking arithmetic.
  last = -(-jnp.max(lengths) // block)
  end = jnp.minimum(steps, -(-last // splits))
  if mask_mod is None:
    kinds = masking.decode_block_kinds(
        lengths, query_positions, num_blocks=steps, block=span,
        is_causal=is_causal, window=local_window_size)
    full_lo, full_hi = masking.full_run(
        jnp.where((kinds == masking.FULL).all(axis=0), masking.FULL,
                  masking.PARTIAL), 0)
    for lo, hi, masked in ((0, full_lo, True), (full_lo, full_hi, False),
                           (full_hi, end, True)):
      carry = jax.lax.fori_loop(
          lo, jnp.maximum(lo, hi), functools.partial(body, masked=masked),
          carry)
  else:
    # A step no new token sees is never read, and one that every new token
    # sees whole skips all masking.
    kinds = masking.shared_kinds(block_kinds(
        mask_mod, mask_mod_args, lengths, query_positions, num_heads=n,
        num_kv=num_kv, num_blocks=steps, block=span, is_causal=is_causal,
        window=local_window_size), axis=(0, 1))  # [steps]

    def visit(step, carry):
      branches = {masking.EMPTY: lambda c: c,
                  masking.PARTIAL: functools.partial(body, step, masked=True),
                  masking.FULL: functools.partial(body, step, masked=False)}
      return jax.lax.switch(
          kinds[step], [branches[kind] for kind in sorted(branches)], carry)

    carry = jax.lax.fori_loop(0, end, visit, carry)
  m_i, l_i, acc = carry
  out, lse = _merged(*online_softmax.finalize(m_i, l_i, acc), sinks, 1, t)
  return _unpacked(out, lse, query)


def _einsum(subscripts: str, x, y, **kwargs):
  """`jnp.einsum` of two operands, as a plain matrix product when every
  batch axis is 1.

  The decode einsums carry batch, split and K/V-head axes that are all 1
  for one sequence with one K/V head on CPU (one split). XLA's CPU backend
  runs such a dot as a batched one with relaid-out operands and transposed
  logits; with the size-1 axes dropped it is one matrix product, ~20%
  faster for the whole decode step at B = K = 1, T_new = 4, S = 32k. With
  a batch axis above 1 the einsum is left as written: dropping the others
  there leaves a batched dot over strided operands, several times slower.
  """
  inputs, output = subscripts.split("->")
  x_labels, y_labels = inputs.split(",")
  sizes = dict(zip(x_labels + y_labels, x.shape + y.shape))
  batch = set(x_labels) & set(y_labels) & set(output)
  if any(sizes[label] > 1 for label in batch):
    return jnp.einsum(subscripts, x, y, **kwargs)

  def kept(labels):
    return "".join(label for label in labels if sizes[label] > 1)

  def squeezed(labels, operand):
    return operand.reshape([sizes[label] for label in kept(labels)])

  out = jnp.einsum(
      f"{kept(x_labels)},{kept(y_labels)}->{kept(output)}",
      squeezed(x_labels, x), squeezed(y_labels, y), **kwargs)
  return out.reshape([sizes[label] for label in output])


def _visible(valid, kv_pos, row_pos, is_causal, window):
  """[B, P, 1, R, C] visibility of one block of keys for the packed rows:
  `masking.visible` with the lengths as its dense term."""
  return masking.visible(
      is_causal=is_causal, window=window,
      q_pos=row_pos[:, None, None, :, None],  # [B, 1, 1, R, 1]
      kv_pos=kv_pos[None, :, None, None, :],  # [1, P, 1, 1, C]
      dense=valid[:, :, None, None, :])
