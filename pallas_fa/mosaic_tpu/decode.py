"""The split-KV decode kernel of `decode_attention(implementation=
"mosaic_tpu")`.

Grid (B, K, splits, steps): the first three axes are "parallel" (Mosaic
shares them among a chip's TensorCores), the last, the key blocks of one
split, is "arbitrary" and carries the online softmax.

* **Rows.** A program holds the packed query tile of its K/V head
  (`decode`'s GQA packing): the G query heads of the group times the T_new
  new tokens, R = G * T_new rows padded to whole sublane tiles, so each K/V
  byte is read once per K/V head.
* **Keys.** `masking.split_runs` cuts the visible blocks of each sequence
  (past the length, after the last query under causal and left of the
  window are dropped) into `splits` contiguous runs; step j of split p
  reads block `first[b, p] + j`. Steps past the run's end do nothing
  (`pl.when`) and their index maps name the run's last block again, which
  the pipeline already holds, so they issue no DMA. With a mask_mod the
  visible blocks need not be contiguous: each K/V head's non-empty blocks
  are listed (`masking.listed_runs`, scalar-prefetched) and the splits cut
  the list, so blocks the mask_mod hides are never fetched and those it
  shows whole skip the masking.
* **Paging.** The run boundaries, the lengths and the block table are
  scalar-prefetched into SMEM and read by the K/V index maps, so the
  pipeline's DMAs fetch block j of a paged cache straight from page
  `block_table[b, j // per_page]`, rows `(j % per_page) * block`. A
  contiguous cache is indexed by block directly.
* **Layout.** The cache stays in HBM as [B or pages, rows, K * Hp], a free
  reshape of [.., K, H] when H is a multiple of 128, so a (block, Hp) tile
  of one K/V head is a lane-aligned slice. The statistics m_i and l_i live
  lane-replicated ([R, 128]) in float32 VMEM scratch next to the [R, Hvp]
  accumulator (the conventions of `forward`); each split
  writes a normalised partial (out, lse) that `online_softmax.merge_parts`
  merges in plain JAX.
* **Masking.** Every key of a block is masked by `masking.visible` with
  `key < length` as its dense term, and value rows (and per-key scales)
  past the length are zeroed before P.V: they may hold NaN, and 0 * NaN is
  NaN.
* **Quantized caches.** An int8 / float8 key or value cache stays as
  stored: the pipeline DMAs its 1-byte tiles, and the kernel widens each
  to the computed dtype (every int8 and float8 value is exact in bfloat16).
  Its float32 scales, [B or pages, S_max or page_size, K] with any dim
  possibly 1, travel as one lane vector of `block` scales per block of
  keys (`_scale_blocks`), their index maps those of the cache (through the
  block table) with broadcast dims at block 0. The key's scales multiply
  the logits of their key columns before the soft cap (q . (k * c) = (q .
  k) * c), the value's the probabilities before P.V (P . (v * c) = (P * c)
  . v): only the [R, block] logits and probabilities are rescaled, never a
  cache tile.
* **Latent caches.** With `value_head_dim` (value=None: DeepSeek's MLA,
  H = 576, Hv = 512), the values are the first Hv columns of the key tile
  the step already holds: one DMA of the cache, no value operand, the key
  scales dequantizing both.

Blocks are multiples of 128 keys (the lane width of the [R, block] logits)
for a contiguous cache, a divisor of the page size (a multiple of 8
sublanes) for a paged one, and as large as `_STEP_BYTES` and the VMEM
budget allow; very wide heads (thousands of lanes) take blocks below 128
keys so that the double-buffered tiles fit. An int8 / float8 cache tiles
(32, 128) in memory, so its blocks are multiples of 32 keys (page sizes
that are not are declined). A contiguous cache is read in
place when its head dims are multiples of 128 (its last block may be
partial); otherwise it is padded, a copy (of the stored dtype). float16
computes in float32 (the TPU's matrix unit has no float16 mode), at the
cost of a converted copy of the cache. A score_mod / mask_mod is fused:
its per-row values travel lane-replicated, its per-key ones
sublane-replicated per cache position (`fused_mods.packed_values`).
Forward only.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_fa import kv_cache
from pallas_fa import layout
from pallas_fa import manual_axes
from pallas_fa import masking
from pallas_fa import mosaic_tpu
from pallas_fa import online_softmax
from pallas_fa.flex import fused_mods
from pallas_fa.flex import mods as mods_lib
from pallas_fa.mosaic_tpu import kernel

Array = Any
# `decode.kernels` passes int8 / float8 caches as they are, with their
# scales, and `decode.front` latent caches (values = the key's columns).
QUANTIZED_CACHES = True
LATENT_CACHES = True
_F32 = jnp.float32
_LANES = kernel.NUM_LANES
_SUBLANES = kernel.NUM_SUBLANES
# The widest block of keys.
_MAX_BLOCK = 2048
# K plus V bytes one grid step reads at most: 2 MiB take ~2.6 us at a v5e's
# ~0.8 TB/s, so a grid step's fixed cost (~0.35 us) stays small, while
# short caches still split into several blocks.
_STEP_BYTES = 1 << 21
# The default scoped VMEM of a v5e, and the share of it the kernel's
# buffers may take (the rest is Mosaic's own temporaries).
_SCOPED_VMEM = 16 << 20
_VMEM_BUDGET = 12 << 20
# Sublane rows of an int8 / float8 tile: four 8-bit values pack a 32-bit
# word, so Mosaic tiles these arrays (32, 128); their blocks and the rows
# their DMAs start at are multiples of 32.
_NARROW_SUBLANES = 4 * _SUBLANES


def interpreted() -> bool:
  """Whether the kernels run in the interpreter here (`decode.kernels`)."""
  return kernel.interpret_params() is not False


def packed_rows(rows: int, dtype) -> int:
  """Rows of the query tile: G * T_new rounded up to whole sublane tiles
  (8 rows of 32-bit values, 16 of 16-bit ones)."""
  itemsize = jnp.dtype(mosaic_tpu.compute_dtype(dtype)).itemsize
  return layout.round_up(rows, _SUBLANES * 4 // itemsize)


def vmem_bytes(
  *,
  rows: int,
  head_dim: int,
  value_head_dim: int,
  block: int,
  itemsize: int,
  cache_itemsize: int | None = None,
  latent: bool = False,
  scales: int = 0,
) -> int:
  """Estimated VMEM of one launch: double-buffered q/k/v tiles (and per-key
  scales), positions and outputs, the float32 scratch and [rows, block]
  temporaries (logits, probabilities, mask) plus the masked value tile and,
  for a quantized cache, its tiles converted.

  Args:
    rows: packed rows (`packed_rows`).
    head_dim, value_head_dim: padded head dims (multiples of 128).
    block: keys per block.
    itemsize: bytes per element of the computed dtype.
    cache_itemsize: bytes per element of the cache (1 for int8 / float8),
      default `itemsize`.
    latent: the values are the keys' first columns (no value tile).
    scales: per-key scale operands (0, 1 or 2).
  """
  if cache_itemsize is None:
    cache_itemsize = itemsize
  cache_width = head_dim + (0 if latent else value_head_dim)
  inputs = 2 * itemsize * rows * head_dim
  inputs += 2 * cache_itemsize * block * cache_width
  # A [1, block] float32 scale tile takes 8 sublanes in VMEM.
  inputs += 2 * scales * 4 * _SUBLANES * max(block, _LANES)
  positions = 2 * 4 * rows * _LANES
  outputs = 2 * 4 * rows * (value_head_dim + _LANES)
  scratch = 4 * rows * (value_head_dim + 2 * _LANES)
  temporaries = 4 * 3 * rows * max(block, _LANES)
  temporaries += itemsize * block * value_head_dim
  if cache_itemsize != itemsize:
    # The narrow tiles widened (through float32) to the computed dtype.
    temporaries += 4 * block * cache_width
  return inputs + positions + outputs + scratch + temporaries


def block_for(
  *,
  head_dim: int,
  value_head_dim: int,
  groups: int,
  new_tokens: int,
  dtype,
  cache_len: int,
  page_size: int | None,
  block_kv: int | None,
  cache_dtype=None,
  latent: bool = False,
) -> int:
  """Keys per block.

  Contiguous: `block_kv`, or the cache length rounded up to 128 if that is
  smaller, or the widest power-of-two multiple of 128 (up to 2048) whose
  buffers fit `_VMEM_BUDGET` and, past 128, whose step stays within
  `_STEP_BYTES`; below 128 keys (8 to 64) only when even 128 does not fit
  the budget. Paged: the widest divisor of `page_size` that is a multiple
  of 8 and fits the same limits. An int8 / float8 cache tiles as (32, 128)
  in memory: its blocks are multiples of 32 keys instead of 8.

  Args:
    head_dim, value_head_dim: H and Hv (unpadded).
    groups, new_tokens: G and T_new.
    dtype: the query's dtype.
    cache_len: S_max of a contiguous cache.
    page_size: the page size of a paged cache, else None.
    block_kv: the caller's block of a contiguous cache, or None.
    cache_dtype: the cache's dtype, default the query's.
    latent: the values are the keys' first `value_head_dim` columns.

  Raises:
    ValueError: `block_kv` is not a multiple of 8 (32).
    NotImplementedError: `page_size` is not a multiple of 8 (32).
  """
  itemsize = jnp.dtype(mosaic_tpu.compute_dtype(dtype)).itemsize
  narrow = cache_dtype is not None and kv_cache.is_quantized(cache_dtype)
  cache_itemsize = 1 if narrow else itemsize
  least = _NARROW_SUBLANES if narrow else _SUBLANES
  hp = layout.padded_head_dim(head_dim, mosaic_tpu.ALIGN)
  hvp = layout.padded_head_dim(value_head_dim, mosaic_tpu.ALIGN)
  rows = packed_rows(groups * new_tokens, dtype)
  read = hp + (0 if latent else hvp)

  def fits(block):
    # Blocks of up to 128 keys are never cut for the step size: narrower
    # logits waste lanes.
    return (
      block <= _LANES or block * read * cache_itemsize <= _STEP_BYTES
    ) and vmem_bytes(
      rows=rows,
      head_dim=hp,
      value_head_dim=hvp,
      block=block,
      itemsize=itemsize,
      cache_itemsize=cache_itemsize,
      latent=latent,
      scales=2 if narrow else 0,
    ) <= _VMEM_BUDGET

  what = ""
  if narrow:
    what = f" (of {least} rows for a {jnp.dtype(cache_dtype).name} cache)"
  if page_size is not None:
    if page_size % least:
      raise NotImplementedError(
        f"implementation='mosaic_tpu' reads pages in whole sublane tiles"
        f"{what}: page_size must be a multiple of {least}, got {page_size}."
      )
    divisors = [
      d
      for d in range(least, min(page_size, _MAX_BLOCK) + 1, least)
      if page_size % d == 0
    ]
    fitting = [d for d in divisors if fits(d)]
    return max(fitting) if fitting else least
  if block_kv is not None:
    if block_kv % least:
      raise ValueError(
        f"block_kv must be a multiple of {least} for "
        f"implementation='mosaic_tpu'{what}, got {block_kv}."
      )
    return block_kv
  if not fits(_LANES):
    block = _LANES // 2
    while block > least and not fits(block):
      block //= 2
    return block
  block = _LANES
  while block * 2 <= _MAX_BLOCK and fits(block * 2):
    block *= 2
  return min(block, layout.round_up(cache_len, _LANES))


def _flex_values(mod, refs):
  """A split score_mod/mask_mod's values for an [R, block] tile: per row
  [R, 1] (lane-replicated refs), per key [1, block] (sublane-replicated)."""
  values = []
  for res, ref in zip(mod.residuals, refs):
    v = ref[:1, :] if res.level == fused_mods.Level.COLUMN else (
      kernel.column(ref)[:, None])
    values.append(v != 0 if res.dtype == jnp.bool_ else v)
  return values


def _kernel(
  lengths_ref,
  runs_ref,
  *refs,
  paged: bool,
  listed: bool,
  latent: bool,
  key_scaled: bool,
  value_scaled: bool,
  value_width: int,
  num_kv: int,
  num_blocks: int,
  block: int,
  splits: int,
  steps: int,
  scale: float,
  soft_cap,
  is_causal: bool,
  window,
  precision,
  score_mod=None,
  mask_mod=None,
):
  # The block table (paged) is read by the index maps only.
  order_ref = refs[0] if listed else None
  q_ref, pos_ref, k_ref, *rest = refs[int(listed) + int(paged):]
  # A latent cache's values are its key tile's first columns: no value ref.
  v_ref = None if latent else rest.pop(0)
  ks_ref = rest.pop(0) if key_scaled else None
  # A latent cache's value scales are its key scales.
  vs_ref = ks_ref if latent else (rest.pop(0) if value_scaled else None)
  mods = [m for m in (score_mod, mask_mod) if m is not None]
  flex_refs = []
  for mod in mods:
    flex_refs.append(rest[:len(mod.residuals)])
    rest = rest[len(mod.residuals):]
  out_ref, lse_ref, m_ref, l_ref, acc_ref = rest
  b, k, p, j = (pl.program_id(i) for i in range(4))
  length = lengths_ref[b]

  pl.when(j == 0)(lambda: kernel.init_softmax(m_ref, l_ref, acc_ref))

  def widened(tile):
    """A cache tile in the query's computed dtype (`kernel.widen`)."""
    return kernel.widen(tile, q_ref.dtype)

  def step(key_block, masked):
    keys = widened(k_ref[...])  # [bk, Hp]
    qk = kernel.dot(q_ref[...], keys, kernel.NT, precision)  # [R, bk]
    start = key_block * block
    kv_pos = start + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
    cached = kv_pos < length  # [1, bk]

    def key_scales(ref):
      """The block's per-key scales [1, bk]; past the length they may be
      NaN (0 * NaN is NaN), so zero there."""
      c = ref[...]
      return jnp.where(cached, c, jnp.zeros((), c.dtype)) if masked else c

    if ks_ref is not None:
      # Dequantizing: q . (k * c) = (q . k) * c for the key's scale c.
      qk = qk * key_scales(ks_ref)
    s, _ = online_softmax.logits(qk, scale=scale, cap=soft_cap)
    q_pos = kernel.column(pos_ref)[:, None]
    flex = dict(zip(mods, flex_refs))
    if score_mod is not None:
      s = score_mod.tile(_flex_values(score_mod, flex[score_mod]),
                         q_idx=q_pos, kv_idx=kv_pos, score=s)
    if masked:
      visible = masking.visible(
        is_causal=is_causal,
        window=window,
        q_pos=q_pos,
        kv_pos=kv_pos,
        dense=cached,
      )
      if mask_mod is not None:
        visible = visible & mask_mod.tile(
          _flex_values(mask_mod, flex[mask_mod]), q_idx=q_pos, kv_idx=kv_pos)
      s = online_softmax.apply_mask(s, visible)
    m_i, l_i, probs, alpha = online_softmax.update(
      kernel.column(m_ref), kernel.column(l_ref), s
    )
    # A latent cache's values: the key tile's first (lane-aligned) columns,
    # read by the same DMA.
    v = keys[:, :value_width] if latent else widened(v_ref[...])
    if masked:
      # Rows past the length may hold NaN, and 0 * NaN is NaN in P.V.
      key_rows = start + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
      v = jnp.where(key_rows < length, v, jnp.zeros((), v.dtype))
    if vs_ref is not None:
      # P . (v * c) = (P * c) . v for the value's scale c.
      probs = probs * key_scales(vs_ref)
    pv = kernel.dot(probs.astype(v.dtype), v, kernel.NN, precision)
    acc_ref[...] = online_softmax.rescale(acc_ref[...], alpha) + pv
    kernel.store_column(m_ref, m_i)
    kernel.store_column(l_ref, l_i)

  if listed:
    # Step j of the split is position first + j of this K/V head's list of
    # non-empty blocks; the first n_full positions are FULL blocks.
    row = (b * num_kv + k) * splits + p
    at = runs_ref[3 * row] + j
    key_block = order_ref[(b * num_kv + k) * num_blocks
                          + jnp.minimum(at, num_blocks - 1)]
    active, full = at < runs_ref[3 * row + 1], at < runs_ref[3 * row + 2]
    pl.when(active & full)(lambda: step(key_block, masked=False))
    pl.when(active & ~full)(lambda: step(key_block, masked=True))
  else:
    run = 2 * (b * splits + p)
    key_block = runs_ref[run] + j
    pl.when(key_block < runs_ref[run + 1])(
      lambda: step(key_block, masked=True))

  @pl.when(j == steps - 1)
  def _finalize():
    out, lse = online_softmax.finalize(
      kernel.column(m_ref), kernel.column(l_ref), acc_ref[...]
    )
    out_ref[...] = out
    kernel.store_column(lse_ref, lse)


def partials(
  q,
  row_pos,
  query_positions,
  key,
  value,
  lengths,
  block_table,
  *,
  block: int,
  splits: int,
  scale: float,
  is_causal: bool,
  local_window_size,
  logits_soft_cap,
  precision,
  score_mod=None,
  score_mod_args=(),
  mask_mod=None,
  mask_mod_args=(),
  kinds=None,
  key_scale=None,
  value_scale=None,
  value_head_dim=None,
):
  """Runs the kernel: the normalised (out, lse) of every split, float32
  [B, K, splits, R, Hv] and [B, K, splits, R], for `decode` to merge (the
  arguments and results of `decode.kernels._decode_split_kernel`'s `partials`;
  `block` from `block_for`). A score_mod / mask_mod is fused
  (`fused_mods.packed_values`: per-row values lane-replicated [B, K, rows,
  128], per-key ones sublane-replicated [B, 8, cache positions]). With a
  mask_mod, `kinds` (int32 [B, K, blocks], `decode.block_kinds`) lists each
  K/V head's non-empty blocks (`masking.listed_runs`, scalar-prefetched):
  a split's steps walk its share of the list, its DMAs fetch only those
  blocks and the FULL ones skip the masking.

  A quantized (int8 / float8) key / value is read as stored and widened
  tile by tile in the kernel; `key_scale` / `value_scale` are its float32
  scales of rank 3, each dim 1 or the cache's ([B, S_max, K] or [P,
  page_size, K]; `_scale_blocks` lays them out per block). With
  `value_head_dim`, the cache is latent: `value` is the key itself, whose
  first `value_head_dim` columns are the values (read with the keys, one
  DMA; the key scales dequantize both).

  Raises:
    NotImplementedError: on a TPU, the block table and run boundaries do
      not fit its scalar memory; a score_mod / mask_mod it cannot fuse.
  """
  b, num_kv, r, h = q.shape
  latent = value_head_dim is not None
  hv = value_head_dim if latent else value.shape[3]
  if latent:
    value, value_scale = None, None  # The key's columns and scales.
  dtype = mosaic_tpu.compute_dtype(q.dtype)
  precision = mosaic_tpu.kernel_precision(precision, q.dtype)
  hp = layout.padded_head_dim(h, mosaic_tpu.ALIGN)
  hvp = layout.padded_head_dim(hv, mosaic_tpu.ALIGN)
  rows = packed_rows(r, q.dtype)
  # Padded rows (zero queries) are sliced off below.
  q = masking.pad_axes(q.astype(dtype), {2: rows, 3: hp})
  positions = mosaic_tpu.lane_rows(masking.pad_axes(row_pos, {1: rows}))
  # A float cache computes in `dtype` (float16 as a float32 copy); an int8
  # / float8 one stays as stored, 1 byte an element, widened per tile.
  key, value = (
    x if x is None or kv_cache.is_quantized(x.dtype) else x.astype(dtype)
    for x in (key, value)
  )
  paged = block_table is not None
  if paged:
    per_page = key.shape[1] // block
    num_blocks = block_table.shape[1] * per_page
  else:
    # The last block may run past S_max: the pipeline reads it partially
    # (the rows past the cache are unspecified, and past every length, so
    # masked and zeroed like any padding) rather than from a padded copy.
    num_blocks = -(-key.shape[1] // block)
  # [B or pages, rows, K * Hp]: one head's (block, Hp) tile is a lane slice.
  key = masking.pad_axes(key, {3: hp}).reshape(*key.shape[:2], -1)
  if not latent:
    value = masking.pad_axes(value, {3: hvp}).reshape(*value.shape[:2], -1)
  scales = [
    _scale_blocks(x, block, per_page if paged else num_blocks)
    for x in (key_scale, value_scale)
    if x is not None
  ]
  splits = max(1, min(splits, num_blocks))
  steps = -(-num_blocks // splits)
  listed = kinds is not None
  if listed:
    order, runs = masking.listed_runs(kinds, splits)
    prefetch = [lengths.astype(jnp.int32), runs.reshape(-1), order.reshape(-1)]
  else:
    first, end = masking.split_runs(
      lengths,
      query_positions,
      num_blocks=num_blocks,
      block=block,
      splits=splits,
      is_causal=is_causal,
      window=local_window_size,
    )
    prefetch = [
      lengths.astype(jnp.int32),
      jnp.stack([first, end], axis=-1).reshape(-1),
    ]
  if paged:
    # Entries past a sequence's pages may name no page at all; the steps
    # that would read them are skipped, but their DMAs must stay in bounds.
    prefetch.append(
      jnp.clip(block_table.astype(jnp.int32), 0, key.shape[0] - 1).reshape(-1)
    )
  _check_scalar_memory(sum(x.size for x in prefetch))

  def block_of(i, k, p, j, runs_ref, order_ref):
    """The block step j of split p reads; past the run's end, its last
    block again, already resident (no DMA)."""
    if not listed:
      run = 2 * (i * splits + p)
      return jnp.maximum(
        jnp.minimum(runs_ref[run] + j, runs_ref[run + 1] - 1), 0)
    run = 3 * ((i * num_kv + k) * splits + p)
    at = jnp.maximum(jnp.minimum(runs_ref[run] + j, runs_ref[run + 1] - 1), 0)
    return order_ref[(i * num_kv + k) * num_blocks + at]

  def cache_index(i, k, p, j, lengths_ref, runs_ref, *refs):
    del lengths_ref
    order_ref = refs[0] if listed else None
    table_ref = refs[int(listed):]
    blk = block_of(i, k, p, j, runs_ref, order_ref)
    if not paged:
      return i, blk, k
    if per_page == 1:
      return table_ref[0][i * block_table.shape[1] + blk], 0, k
    page = table_ref[0][
      i * block_table.shape[1] + jax.lax.div(blk, jnp.int32(per_page))
    ]
    return page, jax.lax.rem(blk, jnp.int32(per_page)), k

  def scale_index(shape):
    """A `_scale_blocks` layout's block for the step: its cache block's,
    with broadcast dims (size 1) at block 0."""

    def index(*args):
      lead, blk, k = cache_index(*args)
      return tuple(
        x if n > 1 else 0 for x, n in zip((lead, blk, k), shape[:3])
      ) + (0, 0)

    return index

  def key_index(i, k, p, j, lengths_ref, runs_ref, *refs):
    # Per-key flex values: the cache positions of the step's block.
    del lengths_ref
    return i, 0, block_of(i, k, p, j, runs_ref, refs[0] if listed else None)

  sq = kernel.SQUEEZED
  in_specs = [
    pl.BlockSpec((sq, sq, rows, hp), lambda i, k, p, j, *_: (i, k, 0, 0)),
    pl.BlockSpec((sq, rows, _LANES), lambda i, k, p, j, *_: (i, 0, 0)),
    pl.BlockSpec((sq, block, hp), cache_index),
  ]
  if not latent:
    in_specs.append(pl.BlockSpec((sq, block, hvp), cache_index))
  in_specs += [
    pl.BlockSpec((sq, sq, sq, 1, block), scale_index(x.shape)) for x in scales
  ]
  fused, flex_operands = {}, []
  for name, fn, args in ((mods_lib.SCORE_MOD, score_mod, score_mod_args),
                         (mods_lib.MASK_MOD, mask_mod, mask_mod_args)):
    if fn is None:
      continue
    mod = fused_mods.split(name, fn, args, "mosaic_tpu decode")
    values = fused_mods.packed_values(
      mod, args, row_pos, num_kv=num_kv,
      new_tokens=query_positions.shape[1], kv_positions=num_blocks * block,
      backend="mosaic_tpu decode")
    for res, x in zip(mod.residuals, values):
      if x.dtype == jnp.bool_:  # No bool memrefs.
        x = x.astype(jnp.int32)
      if res.level == fused_mods.Level.COLUMN:
        x = jnp.broadcast_to(x[:, None, :], (b, _SUBLANES, x.shape[1]))
        in_specs.append(pl.BlockSpec((sq, _SUBLANES, block), key_index))
      else:
        x = masking.pad_axes(x, {2: rows})
        x = jnp.broadcast_to(x[..., None], x.shape + (_LANES,))
        in_specs.append(pl.BlockSpec(
          (sq, sq, rows, _LANES), lambda i, k, p, j, *_: (i, k, 0, 0)))
      flex_operands.append(x)
    fused[name] = mod
  out_shapes = (
    jax.ShapeDtypeStruct((b, num_kv, splits, rows, hvp), _F32),
    jax.ShapeDtypeStruct((b, num_kv, splits, rows, _LANES), _F32),
  )
  out_specs = [
    pl.BlockSpec(
      (sq, sq, sq, rows, width), lambda i, k, p, j, *_: (i, k, p, 0, 0)
    )
    for width in (hvp, _LANES)
  ]
  scratch = [
    pltpu.VMEM((rows, _LANES), _F32),  # m_i
    pltpu.VMEM((rows, _LANES), _F32),  # l_i
    pltpu.VMEM((rows, hvp), _F32),  # acc
  ]
  need = vmem_bytes(
    rows=rows,
    head_dim=hp,
    value_head_dim=hvp,
    block=block,
    itemsize=jnp.dtype(dtype).itemsize,
    cache_itemsize=key.dtype.itemsize,
    latent=latent,
    scales=len(scales),
  )
  interpret = kernel.interpret_params()
  params = kernel.compiler_params(
    kernel.parallel_grid(interpret),
    3,
    4,
    # Past the budget (many rows of a wide head): ask for what it needs.
    vmem_limit_bytes=None
    if need <= _VMEM_BUDGET
    else need + _SCOPED_VMEM - _VMEM_BUDGET,
  )
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=len(prefetch),
    grid=(b, num_kv, splits, steps),
    in_specs=in_specs,
    out_specs=out_specs,
    scratch_shapes=scratch,
  )
  kwargs = {}
  logits = b * num_kv * rows * num_blocks * block
  cost = kernel.cost_estimate(
    2 * logits * (hp + hvp),
    logits,
    tuple(x for x in (q, key, value, *scales) if x is not None),
    out_shapes,
  )
  if cost is not None:
    kwargs["cost_estimate"] = cost
  out, lse = pl.pallas_call(
    functools.partial(
      _kernel,
      paged=paged,
      listed=listed,
      latent=latent,
      key_scaled=key_scale is not None,
      value_scaled=value_scale is not None,
      value_width=hvp,
      num_kv=num_kv,
      num_blocks=num_blocks,
      block=block,
      splits=splits,
      steps=steps,
      scale=scale,
      soft_cap=logits_soft_cap,
      is_causal=is_causal,
      window=local_window_size,
      precision=precision,
      **fused,
    ),
    grid_spec=grid_spec,
    out_shape=manual_axes.out_structs(
        out_shapes, (q, positions, key, value, *scales, *flex_operands)),
    compiler_params=params,
    interpret=interpret,
    name="flash_decode",
    **kwargs,
  )(
    *prefetch,
    q,
    positions,
    *(x for x in (key, value) if x is not None),
    *scales,
    *flex_operands,
  )
  return out[..., :r, :hv], lse[..., :r, 0]


def _scale_blocks(scale, block: int, blocks: int):
  """Per-key scales [L, S, K] (each dim 1 or the cache's: L the batch or
  the pages, S the cache length or page size) as float32 [L, blocks or 1,
  K, 1, block]: block n of a row (or page) is the lane vector [1, block]
  of its keys' scales, a (1, block) block whose dims are whole ones of
  the array at any `block` (a [.., K, S] layout would need blocks of 128
  keys on its lanes, which a page need not have). Keys are on the lanes
  like the [R, block] logits they multiply, so the kernel reads one row
  of block * 4 bytes per step for each scaled operand (the cache's K/V
  bytes per key are H, so the scales add 4 / H, about 3% at H = 128).
  The price is one transposed copy of the scales per call (a 1/H share of
  the cache's bytes, 4 per key and head); a broadcast S (per-head or
  scalar scales) is a single block of the value repeated on lanes."""
  lead, s, heads = scale.shape
  if s == 1:
    x = jnp.broadcast_to(scale[..., None], (lead, 1, heads, block))
  else:
    x = masking.pad_axes(scale, {1: blocks * block})
    x = x.reshape(lead, blocks, block, heads).swapaxes(2, 3)
  return x.astype(_F32)[:, :, :, None, :]


def _check_scalar_memory(words: int) -> None:
  """Raises NotImplementedError when the scalar-prefetched words (lengths,
  run boundaries, block lists, block table) exceed this TPU's scalar memory."""
  capacity = kernel.metadata_capacity()
  if capacity is not None and words > capacity:
    raise NotImplementedError(
      f"implementation='mosaic_tpu': the block_table, lengths, split runs "
      f"and mask_mod block lists ({words} int32 words) exceed the "
      f"{capacity} that fit in this TPU's scalar memory; use larger pages "
      "or fewer num_splits."
    )
