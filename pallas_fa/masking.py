"""One canonical description of which keys each query may attend to.

Every way the public op can restrict attention -- causal, a local window,
padding lengths, segment ids (packed sequences), positions and a dense boolean
mask -- is turned into one `MaskInfo` by `api.flash_attention`. Every
implementation reads the same description through the same predicates, so the
semantics cannot drift between backends:

* `visible(...)`: the element predicate, query i may attend to key j;
* `classify_blocks(...)`: per (query block, key block) tile, whether the tile is
  EMPTY (skip it), FULL (no element masked, skip the masking arithmetic) or
  PARTIAL; computed on device from per-block min/max of positions and segment
  ids, so it works for traced, data-dependent layouts.

A user `mask_mod` (flex attention, `pallas_fa.flex.mods`) intersects all of
these: `tile_visibility` evaluates it with the tile's indices
(`tile_indices`), and its own per-tile classification is the
`pallas_fa.flex.block_mask.BlockMask`.

Causal and window are measured on positions (top-left aligned by default):

    is_causal, T = S = 4             local_window_size = (1, 0)
          k: 0 1 2 3                       k: 0 1 2 3
    q: 0     x . . .                 q: 0     x . . .
       1     x x . .                    1     x x . .
       2     x x x .                    2     . x x .
       3     x x x x                    3     . . x x

Bottom-right alignment (decoding, chunked prefill with T < S) is
`query_positions = arange(T) + S - T`.

Padding lengths are folded into segment ids: a padded query gets
`Q_PAD_SEGMENT`, a padded key `KV_PAD_SEGMENT`; the two never match each other
or any real segment, so padding is "just another segment" and padded tiles are
skipped like any other empty tile.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa.flex import mods

# Segment ids reserved for padding. Real segment ids must be greater than both.
Q_PAD_SEGMENT = int(np.iinfo(np.int32).min)
KV_PAD_SEGMENT = Q_PAD_SEGMENT + 1

# Tile kinds produced by `classify_blocks`.
EMPTY = 0
PARTIAL = 1
FULL = 2

Array = Any


@dataclasses.dataclass(frozen=True)
class SegmentIds:
  """Segment ids of packed sequences: attend only where `q == kv`.

  Attributes:
    q: int array [*B, T] (the query's batch dims).
    kv: int array [*B, S].
  """

  q: Array
  kv: Array


jax.tree_util.register_dataclass(
    SegmentIds, data_fields=["q", "kv"], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class MaskInfo:
  """The canonical mask description every implementation consumes.

  Attributes:
    q_positions: int32 [B, T].
    kv_positions: int32 [B, S].
    q_segment_ids: int32 [B, T] or None (padding folded in, see module doc).
    kv_segment_ids: int32 [B, S] or None.
    mask: bool [B|1, N|1, T|1, S|1] or None; True = may attend.
    is_causal: keep keys with kv_position <= q_position.
    window: (left, right) or None; keep
      q_position - left <= kv_position <= q_position + right. A side that is
      None is unbounded.
    dropout_seed: uint32 scalar, or None without dropout.
    dropout_rate: attention dropout rate (`pallas_fa.dropout`); 0 = none.
    score_mod: the user's score function (flex attention,
      `pallas_fa.flex.mods`), applied to the logits after soft cap and
      bias, or None.
    score_mod_args: the arrays score_mod reads (differentiable).
    mask_mod: the user's mask predicate, intersecting every other mask, or
      None.
    mask_mod_args: the arrays mask_mod reads (not differentiated).
    block_mask: a `pallas_fa.flex.block_mask.BlockMask` of mask_mod made by the
      caller, or None (each backend then classifies its own tiles).
    positions_are_indices: static; the real tokens' positions are their
      indices (the defaults, arange(T) and arange(S)), so a kernel may make
      them from its tile offsets instead of reading them. Padding's tails
      (`pad_sequence`) keep it: padding is masked apart from positions.
      `replace` clears it when positions change, and so must anything that
      changes them otherwise (a sequence-sharded call's shards).
  """

  q_positions: Array
  kv_positions: Array
  q_segment_ids: Array | None = None
  kv_segment_ids: Array | None = None
  mask: Array | None = None
  is_causal: bool = False
  window: tuple[int | None, int | None] | None = None
  dropout_seed: Array | None = None
  dropout_rate: float = 0.0
  score_mod: Callable | None = None
  score_mod_args: tuple[Array, ...] = ()
  mask_mod: Callable | None = None
  mask_mod_args: tuple[Array, ...] = ()
  block_mask: Any = None
  positions_are_indices: bool = False

  @property
  def has_dropout(self) -> bool:
    return self.dropout_rate > 0.0

  @property
  def has_flex(self) -> bool:
    """Whether the call carries a user score_mod or mask_mod."""
    return self.score_mod is not None or self.mask_mod is not None

  @property
  def has_segments(self) -> bool:
    return self.q_segment_ids is not None

  @property
  def restricts_positions(self) -> bool:
    """Whether causal or window masking applies at all."""
    return self.is_causal or self.window is not None

  def replace(self, **changes) -> MaskInfo:
    """dataclasses.replace; new positions clear `positions_are_indices`
    unless the change says otherwise."""
    if {"q_positions", "kv_positions"} & changes.keys():
      changes.setdefault("positions_are_indices", False)
    return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    MaskInfo,
    data_fields=[
        "q_positions",
        "kv_positions",
        "q_segment_ids",
        "kv_segment_ids",
        "mask",
        "dropout_seed",
        "score_mod_args",
        "mask_mod_args",
        "block_mask",
    ],
    meta_fields=["is_causal", "window", "dropout_rate", "score_mod",
                 "mask_mod", "positions_are_indices"],
)


def padding_segments(
    segment_ids: Array | None, lengths: Array | None, length: int, pad_id: int
) -> Array | None:
  """Folds padding lengths into segment ids.

  Args:
    segment_ids: int [B, L] or None.
    lengths: int [B] or None; index >= lengths[b] is padding.
    length: L, the static sequence length.
    pad_id: the segment id given to padded positions.

  Returns:
    int32 [B, L] segment ids, or None when neither input was given.
  """
  if lengths is None:
    return None if segment_ids is None else segment_ids.astype(jnp.int32)
  batch = lengths.shape[0]
  if segment_ids is None:
    segment_ids = jnp.zeros((batch, length), jnp.int32)
  idx = jnp.arange(length, dtype=jnp.int32)[None, :]
  return jnp.where(
      idx < lengths.astype(jnp.int32)[:, None],
      segment_ids.astype(jnp.int32),
      pad_id,
  )


def pad_axes(x: Array | None, sizes: dict[int, int], fill=0,
             broadcast: bool = False) -> Array | None:
  """Pads axis `a` of x at the end up to `sizes[a]` with `fill`.

  With `broadcast`, an axis of size 1 is a broadcast axis (of a dense bias or
  mask) and stays 1. None passes through.
  """
  if x is None:
    return None
  widths = [(0, 0)] * x.ndim
  for axis, size in sizes.items():
    if x.shape[axis] != size and not (broadcast and x.shape[axis] == 1):
      widths[axis] = (0, size - x.shape[axis])
  if all(w == (0, 0) for w in widths):
    return x
  return jnp.pad(x, widths, constant_values=fill)


def pad_sequence(info: MaskInfo, q_len: int, kv_len: int) -> MaskInfo:
  """Pads T to `q_len` and S to `kv_len`, marking the new tail as padding.

  Backends that tile in fixed blocks call this so a ragged last block is
  masked exactly like user padding.
  """
  t, s = info.q_positions.shape[-1], info.kv_positions.shape[-1]
  if q_len == t and kv_len == s:
    return info
  batch = info.q_positions.shape[0]
  q_seg, kv_seg = info.q_segment_ids, info.kv_segment_ids
  if q_seg is None:
    q_seg = jnp.zeros((batch, t), jnp.int32)
    kv_seg = jnp.zeros((batch, s), jnp.int32)
  return info.replace(
      q_positions=pad_axes(info.q_positions, {1: q_len}),
      kv_positions=pad_axes(info.kv_positions, {1: kv_len}),
      q_segment_ids=pad_axes(q_seg, {1: q_len}, Q_PAD_SEGMENT),
      kv_segment_ids=pad_axes(kv_seg, {1: kv_len}, KV_PAD_SEGMENT),
      # A dense mask may broadcast (size 1) along T or S; nothing else does.
      mask=pad_axes(info.mask, {2: q_len, 3: kv_len}, False, broadcast=True),
      # The tails are padding, masked by their segment ids.
      positions_are_indices=info.positions_are_indices,
  )


def visible(
    *,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    q_pos: Array,
    kv_pos: Array,
    q_seg: Array | None = None,
    kv_seg: Array | None = None,
    dense: Array | None = None,
) -> Array | None:
  """The element predicate: may this query attend to this key?

  All arguments are already broadcast-compatible (typically q_* with a
  trailing [..., bq, 1] and kv_* with [..., 1, bk]). Returns None when nothing
  is masked, so callers can skip the masking arithmetic entirely.
  """
  terms = []
  if is_causal:
    terms.append(kv_pos <= q_pos)
  if window is not None:
    left, right = window
    if left is not None:
      terms.append(kv_pos >= q_pos - left)
    if right is not None:
      terms.append(kv_pos <= q_pos + right)
  if q_seg is not None:
    terms.append(q_seg == kv_seg)
  if dense is not None:
    terms.append(dense)
  if not terms:
    return None
  out = terms[0]
  for t in terms[1:]:
    out = jnp.logical_and(out, t)
  return out


def group_heads(x: Array, num_kv_heads: int) -> Array:
  """[B|1, N|1, T|1, S|1] -> [B|1, K|1, G|1, T|1, S|1] (GQA grouping)."""
  b, n, t, s = x.shape
  if n == 1:
    return x[:, :, None]
  return x.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def slice_in_dim(x: Array, start, size: int, axis: int) -> Array:
  """dynamic_slice along `axis`, leaving a broadcast (size-1) axis alone."""
  if x.shape[axis] == 1 or (x.shape[axis] == size and isinstance(start, int)):
    return x
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def tile_indices(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    q_start=0,
    block_q: int = 1,
    kv_start=0,
    block_kv: int = 1,
) -> tuple[Array, Array, Array, Array]:
  """(batch, head, q_idx, kv_idx) of a tile in the grouped [B, K, G, bq, bk]
  layout, each int32 of rank 5 broadcasting against it: what a score_mod or
  mask_mod is evaluated with (`mods.evaluate`).

  Query head n = k * G + g reads key/value head k (GQA). Indices are token
  indices within the (padded) sequences; starts may be traced.
  """
  g = num_heads // num_kv_heads
  i32 = jnp.int32
  b = jnp.arange(batch, dtype=i32).reshape(batch, 1, 1, 1, 1)
  head = jnp.arange(num_heads, dtype=i32).reshape(1, num_kv_heads, g, 1, 1)
  q_idx = q_start + jnp.arange(block_q, dtype=i32).reshape(1, 1, 1, -1, 1)
  kv_idx = kv_start + jnp.arange(block_kv, dtype=i32).reshape(1, 1, 1, 1, -1)
  return b, head, q_idx, kv_idx


def mask_mod_visibility(info: MaskInfo, tile: tuple[int, ...], indices,
                        uses=None) -> Array:
  """`info.mask_mod` on a tile of any layout (`mods.evaluate`), bool.

  Args:
    info: the call's mask description (with a mask_mod).
    tile: the tile's shape [*lead, rows, cols].
    indices: (batch, head, q_idx, kv_idx) broadcasting against it.
    uses: whether mask_mod reads (batch, head); None: find out.
  """
  if uses is None:
    uses = mods.uses_batch_and_head(
        mods.MASK_MOD, info.mask_mod, info.mask_mod_args)
  batch, head, q_idx, kv_idx = indices
  return mods.evaluate(
      info.mask_mod, tile, batch=batch, head=head, q_idx=q_idx,
      kv_idx=kv_idx, args=info.mask_mod_args, uses=uses)


def tile_visibility(
    info: MaskInfo,
    num_kv_heads: int,
    q_start=0,
    block_q: int | None = None,
    kv_start=0,
    block_kv: int | None = None,
    *,
    num_heads: int | None = None,
    builtin: bool = True,
    mod: bool = True,
) -> Array | None:
  """`visible` for one tile in the grouped [B, K, G, bq, bk] layout.

  Starts may be traced; block sizes default to the whole sequence. Returns
  None when nothing is masked.

  Args:
    info: the call's mask description.
    num_kv_heads: K.
    q_start, block_q, kv_start, block_kv: the tile.
    num_heads: N, needed with a mask_mod (its `head` argument).
    builtin: include the masks of the public arguments (causal, window,
      segments and padding, dense mask).
    mod: include `info.mask_mod` (a tile its block mask marks FULL skips
      it).
  """
  block_q = block_q or info.q_positions.shape[1]
  block_kv = block_kv or info.kv_positions.shape[1]

  def rows(x, start, size):  # [B, L] -> [B, 1, 1, size, 1]
    return slice_in_dim(x, start, size, 1)[:, None, None, :, None]

  def cols(x, start, size):  # [B, L] -> [B, 1, 1, 1, size]
    return slice_in_dim(x, start, size, 1)[:, None, None, None, :]

  out = None
  if builtin:
    q_seg = kv_seg = dense = None
    if info.has_segments:
      q_seg = rows(info.q_segment_ids, q_start, block_q)
      kv_seg = cols(info.kv_segment_ids, kv_start, block_kv)
    if info.mask is not None:
      dense = slice_in_dim(info.mask, q_start, block_q, 2)
      dense = slice_in_dim(dense, kv_start, block_kv, 3)
      dense = group_heads(dense, num_kv_heads)
    out = visible(
        is_causal=info.is_causal,
        window=info.window,
        q_pos=rows(info.q_positions, q_start, block_q),
        kv_pos=cols(info.kv_positions, kv_start, block_kv),
        q_seg=q_seg,
        kv_seg=kv_seg,
        dense=dense,
    )
  if mod and info.mask_mod is not None:
    if num_heads is None:
      raise ValueError("tile_visibility needs num_heads with a mask_mod.")
    batch = info.q_positions.shape[0]
    tile = (batch, num_kv_heads, num_heads // num_kv_heads, block_q,
            block_kv)
    flex = mask_mod_visibility(info, tile, tile_indices(
        batch, num_heads, num_kv_heads, q_start, block_q, kv_start,
        block_kv))
    out = flex if out is None else jnp.logical_and(out, flex)
  return out


def is_padding(segment_ids: Array | None, pad_id: int) -> Array | None:
  return None if segment_ids is None else segment_ids == pad_id


def zero_padding(x: Array, segment_ids: Array | None, pad_id: int) -> Array:
  """Zeroes padded rows of x [B, L, heads, H] so NaN/inf there cannot leak.

  A masked logit becomes -inf and its probability 0, but 0 * NaN is NaN in
  p @ v and in ds @ k; padding must therefore be cleaned, not only masked.
  """
  pad = is_padding(segment_ids, pad_id)
  if pad is None:
    return x
  return jnp.where(pad[:, :, None, None], jnp.zeros((), x.dtype), x)


def _block_min_max(x: Array, block: int) -> tuple[Array, Array]:
  """Per-block min and max of x [B, L] with L % block == 0 -> [B, L/block]."""
  b, length = x.shape
  x = x.reshape(b, length // block, block)
  return x.min(axis=-1), x.max(axis=-1)


def _segment_ranges(seg: Array, block: int, pad_id: int):
  """Per-block (min, max, has_padding) of real segment ids [B, L/block].

  Padding is left out of the range: a padded row sees nothing, so a tile is
  empty when its *real* ids cannot meet, and a block of only padding gets
  an empty range (min > max) that meets nothing.
  """
  b, length = seg.shape
  x = seg.reshape(b, length // block, block)
  pad = x == pad_id
  big = np.iinfo(np.int32)
  lo = jnp.where(pad, big.max, x).min(axis=-1)
  hi = jnp.where(pad, big.min, x).max(axis=-1)
  return lo, hi, pad.any(axis=-1)


def _position_range(pos: Array, seg: Array | None, block: int, pad_id: int):
  """Per-block (min, max) of the positions of real rows [B, L/block].

  Padding (`pad_sequence`'s tails hold position 0) is left out, as in
  `_segment_ranges`: its elements are masked by their segment ids, so
  their positions must not widen a block's range (a 0 there made the last
  key tile of a padded causal call visible to every query tile). A block
  of only padding keeps its min/max unchanged: the segment test empties it.
  """
  lo, hi = _block_min_max(pos, block)
  if seg is None:
    return lo, hi
  b, length = pos.shape
  x = pos.reshape(b, length // block, block)
  pad = seg.reshape(b, length // block, block) == pad_id
  big = np.iinfo(np.int32)
  real_lo = jnp.where(pad, big.max, x).min(axis=-1)
  real_hi = jnp.where(pad, big.min, x).max(axis=-1)
  some = ~pad.all(axis=-1)
  return jnp.where(some, real_lo, lo), jnp.where(some, real_hi, hi)


def classify_blocks(info: MaskInfo, block_q: int, block_kv: int) -> Array:
  """Kinds (EMPTY / PARTIAL / FULL) of every tile, int32 [B, T/bq, S/bk].

  T and S must already be multiples of the blocks (see `pad_sequence`). The
  answer is conservative: a tile marked EMPTY has no visible element and one
  marked FULL has no masked element; anything else is PARTIAL. A dense mask is
  reduced over heads (a tile is empty/full only if it is for every head).
  """
  qp_lo, qp_hi = _position_range(
      info.q_positions, info.q_segment_ids, block_q, Q_PAD_SEGMENT)
  kp_lo, kp_hi = _position_range(
      info.kv_positions, info.kv_segment_ids, block_kv, KV_PAD_SEGMENT)
  qp_lo, qp_hi = qp_lo[:, :, None], qp_hi[:, :, None]
  kp_lo, kp_hi = kp_lo[:, None, :], kp_hi[:, None, :]
  shape = jnp.broadcast_shapes(qp_lo.shape, kp_lo.shape)
  empty = jnp.zeros(shape, bool)
  full = jnp.ones(shape, bool)
  if info.is_causal:
    empty |= kp_lo > qp_hi
    full &= kp_hi <= qp_lo
  if info.window is not None:
    left, right = info.window
    if left is not None:
      empty |= kp_hi < qp_lo - left
      full &= kp_lo >= qp_hi - left
    if right is not None:
      empty |= kp_lo > qp_hi + right
      full &= kp_hi <= qp_lo + right
  if info.has_segments:
    qs_lo, qs_hi, q_pad = _segment_ranges(
        info.q_segment_ids, block_q, Q_PAD_SEGMENT)
    ks_lo, ks_hi, k_pad = _segment_ranges(
        info.kv_segment_ids, block_kv, KV_PAD_SEGMENT)
    qs_lo, qs_hi, q_pad = qs_lo[:, :, None], qs_hi[:, :, None], q_pad[..., None]
    ks_lo, ks_hi, k_pad = ks_lo[:, None, :], ks_hi[:, None, :], k_pad[:, None]
    empty |= (qs_hi < ks_lo) | (ks_hi < qs_lo)
    full &= (
        ~q_pad & ~k_pad
        & (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)
    )
  if info.mask is not None:
    m = info.mask.any(axis=1)  # [B|1, T|1, S|1]
    mb, mt, ms = m.shape
    nq, nk = shape[1], shape[2]
    m = jnp.broadcast_to(
        m, (mb, nq * block_q if mt > 1 else 1, nk * block_kv if ms > 1 else 1)
    )
    tq = block_q if mt > 1 else 1
    tk = block_kv if ms > 1 else 1
    m_blocks = m.reshape(mb, m.shape[1] // tq, tq, m.shape[2] // tk, tk)
    empty |= ~m_blocks.any(axis=(2, 4))
    all_heads = info.mask.all(axis=1)
    all_heads = jnp.broadcast_to(all_heads, m.shape).reshape(m_blocks.shape)
    full &= all_heads.all(axis=(2, 4))
  return kind_of(~empty, full)


def kind_of(seen: Array, whole: Array) -> Array:
  """A tile's kind from whether any of its elements is visible (`seen`) and
  whether all of them are (`whole`): EMPTY, FULL or PARTIAL, int32."""
  return jnp.where(seen, jnp.where(whole, FULL, PARTIAL), EMPTY).astype(
      jnp.int32)


def shared_kinds(kinds: Array, axis) -> Array:
  """The kinds of tiles shared by the rows along `axis` (reduced away): a
  tile is EMPTY (FULL) only if it is for every row, else PARTIAL."""
  return kind_of(~jnp.all(kinds == EMPTY, axis=axis),
                 jnp.all(kinds == FULL, axis=axis))


def intersect_kinds(a: Array, b: Array) -> Array:
  """The kinds of tiles under two masks at once: EMPTY if either is, FULL
  if both are, else PARTIAL (EMPTY < PARTIAL < FULL)."""
  return jnp.minimum(a, b)


def block_range(kinds: Array) -> tuple[Array, Array]:
  """[lo, hi) of the non-empty tiles along the last axis of `kinds`.

  Loops run only over this range; rows with no visible tile get lo == hi.
  """
  n = kinds.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  nonempty = kinds != EMPTY
  lo = jnp.min(jnp.where(nonempty, idx, n), axis=-1)
  hi = jnp.max(jnp.where(nonempty, idx + 1, 0), axis=-1)
  return lo, jnp.maximum(lo, hi)


def full_run(kinds: Array, empty_at: Array) -> tuple[Array, Array]:
  """[lo, hi) of the FULL tiles along the last axis of `kinds`, when they
  are contiguous.

  Kernels run the tiles of this run without masking arithmetic and mask all
  others. Where a row has no FULL tile, or its FULL tiles are not
  contiguous, the run is empty (lo == hi == `empty_at`, broadcast against
  the row) and every tile of the row is masked.
  """
  n = kinds.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  full = kinds == FULL
  lo = jnp.min(jnp.where(full, idx, n), axis=-1)
  hi = jnp.max(jnp.where(full, idx + 1, 0), axis=-1)
  count = jnp.sum(full, axis=-1, dtype=jnp.int32)
  contiguous = (count > 0) & (count == hi - lo)
  return (jnp.where(contiguous, lo, empty_at),
          jnp.where(contiguous, hi, empty_at))


def decode_block_kinds(lengths: Array, q_positions: Array, *,
                       num_blocks: int, block: int, is_causal: bool,
                       window) -> Array:
  """`classify_blocks` of a decoding step's key blocks, int32 [B,
  num_blocks]: all the new tokens of a sequence form one query block, keys
  sit at their cache index and those at or past `lengths` are padding.

  Args:
    lengths: int [B], valid keys per sequence.
    q_positions: int32 [B, T_new], the new tokens' positions.
    num_blocks: key blocks per sequence.
    block: keys per block.
    is_causal: causal masking on positions.
    window: (left, right) window on positions, or None.
  """
  b = lengths.shape[0]
  kv_len = num_blocks * block
  info = MaskInfo(
      q_positions=q_positions,
      kv_positions=jnp.broadcast_to(
          jnp.arange(kv_len, dtype=jnp.int32), (b, kv_len)),
      q_segment_ids=jnp.zeros(q_positions.shape, jnp.int32),
      kv_segment_ids=padding_segments(None, lengths, kv_len, KV_PAD_SEGMENT),
      is_causal=is_causal, window=window)
  return classify_blocks(info, q_positions.shape[1], block)[:, 0]


def decode_key_blocks(length, q_first, q_last, *, block: int,
                      is_causal: bool, window) -> tuple[Array, Array]:
  """[lo, hi): the key blocks a decoding sequence's new tokens may see.

  The keys any new token sees lie in [max(0, q_first - left), min(length,
  q_last + 1 under causal, q_last + right + 1)), with q_first / q_last the
  smallest / largest new-token position: the non-empty blocks of
  `decode_block_kinds`, found with scalar arithmetic alone, so that a
  kernel program derives its run from the lengths itself (works on
  scalars and on arrays alike).

  Args:
    length: int, valid keys of the sequence (already within the cache).
    q_first, q_last: int, the smallest and largest new-token position.
    block: keys per block.
    is_causal: causal masking on positions.
    window: (left, right) window on positions, or None.

  Returns:
    (lo, hi) int32 blocks, lo == hi when no key is visible.
  """
  i32 = jnp.int32
  end = jnp.asarray(length, i32)
  # 0, computed from a value: Mosaic GPU lowers no constant scalar arrays.
  start = end * 0
  q_first = jnp.asarray(q_first, i32)
  q_last = jnp.asarray(q_last, i32)
  if is_causal:
    end = jnp.minimum(end, q_last + 1)
  if window is not None:
    left, right = window
    if left is not None:
      start = jnp.maximum(start, q_first - left)
    if right is not None:
      end = jnp.minimum(end, q_last + right + 1)
  lo = start // block
  hi = jnp.where(end > start, (end + block - 1) // block, lo)
  return lo.astype(i32), hi.astype(i32)


def decode_whole_blocks(length, q_first, q_last, *, block: int,
                        is_causal: bool, window) -> tuple[Array, Array]:
  """[lo, hi): the key blocks that every new token sees whole, all their
  keys below the length and inside the causal mask and window of the
  tokens at positions [q_first, q_last]; empty (lo >= hi) when none (the
  decode kernels run them unmasked). Scalar or array arithmetic, like
  `decode_key_blocks`."""
  # The keys every token sees are those the tokens would see if the window
  # started at the last token's and ended at the first token's
  # (`decode_key_blocks` in blocks of one key): whole blocks lie inside.
  start, end = decode_key_blocks(length, q_last, q_first, block=1,
                                 is_causal=is_causal, window=window)
  return (start + block - 1) // block, end // block


def split_run(lo, hi, splits: int, split) -> tuple[Array, Array]:
  """Blocks [first, end) of run `split` when [lo, hi) is cut into `splits`
  contiguous runs of ceil((hi - lo) / splits) blocks (split-KV); an empty
  run has first == end (at the end of the previous one). Scalar or array
  arithmetic, like `decode_key_blocks`."""
  per = (hi - lo + splits - 1) // splits
  first = jnp.minimum(lo + per * split, hi)
  return first, jnp.minimum(first + per, hi)


def split_runs(lengths: Array, q_positions: Array, *, num_blocks: int,
               block: int, splits: int, is_causal: bool,
               window) -> tuple[Array, Array]:
  """The non-empty key blocks of each decoding sequence, cut into `splits`
  contiguous runs (split-KV): `decode_key_blocks` and `split_run` for every
  sequence and split at once.

  Args:
    lengths: int [B], valid keys per sequence.
    q_positions: int32 [B, T_new], the new tokens' positions.
    num_blocks: key blocks per sequence.
    block: keys per block.
    splits: runs per sequence.
    is_causal: causal masking on positions.
    window: (left, right) window on positions, or None.

  Returns:
    (first, end) int32 [B, splits]: split p reads blocks [first, end); an
    empty split has first == end (at the end of the previous run).
  """
  lengths = jnp.minimum(lengths.astype(jnp.int32), num_blocks * block)
  lo, hi = decode_key_blocks(
      lengths, jnp.min(q_positions, axis=1), jnp.max(q_positions, axis=1),
      block=block, is_causal=is_causal, window=window)
  first, end = split_run(lo[:, None], hi[:, None], splits,
                         jnp.arange(splits, dtype=jnp.int32)[None, :])
  return first.astype(jnp.int32), end.astype(jnp.int32)


def visit_order(kinds: Array) -> tuple[Array, Array, Array]:
  """The non-empty tiles of each row of `kinds` [..., n] in the order a
  program visits them: (order int32 [..., n]: the FULL tiles ascending,
  then the PARTIAL ones, then the EMPTY ones; number FULL, number PARTIAL,
  int32 [..., 1])."""
  # A stable sort on the kind, descending (EMPTY < PARTIAL < FULL).
  order = jnp.argsort(-kinds, axis=-1, stable=True).astype(jnp.int32)
  n_full = jnp.sum(kinds == FULL, axis=-1, dtype=jnp.int32)[..., None]
  n_part = jnp.sum(kinds == PARTIAL, axis=-1, dtype=jnp.int32)[..., None]
  return order, n_full, n_part


def listed_runs(kinds: Array, splits: int) -> tuple[Array, Array]:
  """The non-empty blocks of each row of `kinds` as a list cut into `splits`
  contiguous runs: split-KV decode under a mask_mod, whose visible blocks
  need not be contiguous (a StreamingLLM cache: the sinks, then the window).

  Args:
    kinds: int32 [..., n] block kinds.
    splits: runs per row.

  Returns:
    (order int32 [..., n], runs int32 [..., splits, 3]): `order` as
    `visit_order` gives it; split p visits `order[first:end]`, the
    positions below `n_full` of them FULL, where a run is (first, end,
    n_full) and an empty split has first == end.
  """
  order, n_full, n_part = visit_order(kinds)
  visited = n_full + n_part
  per = -(-visited // splits)
  split = jnp.arange(splits, dtype=jnp.int32).reshape(
      (1,) * (kinds.ndim - 1) + (splits,))
  first = jnp.minimum(per * split, visited)
  end = jnp.minimum(first + per, visited)
  runs = jnp.stack([first, end, jnp.broadcast_to(n_full, first.shape)], -1)
  return order, runs
