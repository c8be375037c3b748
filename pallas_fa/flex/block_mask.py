"""Block masks: which tiles of a mask_mod are empty, partial or full.

`create_block_mask` evaluates a mask_mod (flex attention, `pallas_fa.flex.mods`)
on every element once -- exactly, never by sampling corners -- and cuts the
[T, S] plane into [block_q, block_kv] tiles: a tile is EMPTY if no element
is visible, FULL if all are, else PARTIAL (`masking.EMPTY`, ...); elements
past q_len or kv_len do not count. The result is a `BlockMask` pytree that
stores, per (batch row or broadcast, query head or broadcast, query tile),
the list of non-empty key tiles and which of them are full, and the
transposed lists (per key tile, the query tiles) for backward passes that
walk keys in the outer loop:

    kv_num_blocks [Bm, Hm, nq]        non-empty key tiles of query tile i
    kv_indices    [Bm, Hm, nq, nk]    their indices, ascending; entries past
                                      kv_num_blocks repeat the last one
    kv_full       [Bm, Hm, nq, nk]    whether that tile is FULL
    q_num_blocks, q_indices, q_full   the same per key tile

Bm is the batch or 1 and Hm the query heads or 1: a mask_mod that reads
neither `batch` nor `head` is stored once for all of them. Backends skip
EMPTY tiles (no load, no compute, forward and backward), skip the mask
evaluation on FULL ones and evaluate the mask_mod only on PARTIAL ones.

A block mask is made for one tiling. `retile` serves another one when the
two nest: coarser tiles that are whole multiples of the mask's (exact), or
finer ones that divide them (EMPTY and FULL stay exact; the parts of a
PARTIAL tile stay PARTIAL, so the mask_mod is evaluated there); any other
tiling is rejected with a ValueError. Without a block mask, a backend
classifies its own tiles the same way (`tile_kinds`), inside the call.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa import masking
from pallas_fa import vjp
from pallas_fa.flex import mods

Array = Any

# Mask elements evaluated per step of `classify`: bounds its scratch memory
# (a [Bm, Hm, block_q, columns] tile) whatever the sequence lengths.
_ELEMENTS_PER_STEP = 1 << 24
# Tiles outside the sequence when a coarser tiling regroups the last ones:
# neither EMPTY nor FULL constrain the group.
_OUTSIDE = -1


@dataclasses.dataclass(frozen=True)
class BlockMask:
  """The tiles of a mask_mod: per query tile, its non-empty key tiles.

  See the module docstring for the layout. Made by `create_block_mask` (or
  `from_kinds`); pass it to `flash_attention(block_mask=...)`, where it also
  supplies the mask_mod and its arguments when the call gives none.

  Attributes:
    kv_num_blocks: int32 [Bm, Hm, nq].
    kv_indices: int32 [Bm, Hm, nq, nk].
    kv_full: bool [Bm, Hm, nq, nk].
    q_num_blocks: int32 [Bm, Hm, nk].
    q_indices: int32 [Bm, Hm, nk, nq].
    q_full: bool [Bm, Hm, nk, nq].
    mask_mod_args: the arrays of the mask_mod it was made from.
    block_q: query rows per tile.
    block_kv: keys per tile.
    q_len: T it was made for.
    kv_len: S it was made for.
    mask_mod: the mask_mod it was made from.
  """

  kv_num_blocks: Array
  kv_indices: Array
  kv_full: Array
  q_num_blocks: Array
  q_indices: Array
  q_full: Array
  mask_mod_args: tuple[Array, ...] = ()
  block_q: int = dataclasses.field(kw_only=True)
  block_kv: int = dataclasses.field(kw_only=True)
  q_len: int = dataclasses.field(kw_only=True)
  kv_len: int = dataclasses.field(kw_only=True)
  mask_mod: Callable | None = dataclasses.field(default=None, kw_only=True)

  @property
  def batch(self) -> int:
    """Bm: the batch, or 1 for a mask shared by every batch row."""
    return self.kv_num_blocks.shape[0]

  @property
  def heads(self) -> int:
    """Hm: the query heads, or 1 for a mask shared by every head."""
    return self.kv_num_blocks.shape[1]

  def kinds(self) -> Array:
    """The dense tile kinds, int32 [Bm, Hm, nq, nk] (`masking.EMPTY`,
    `PARTIAL`, `FULL`), rebuilt from the per-query-tile lists."""
    return _kinds_from_lists(self.kv_num_blocks, self.kv_indices,
                             self.kv_full)

  def __repr__(self) -> str:
    shape = tuple(self.kv_indices.shape)
    return (f"BlockMask(shape={shape}, block_q={self.block_q}, "
            f"block_kv={self.block_kv}, q_len={self.q_len}, "
            f"kv_len={self.kv_len}, mask_mod={self.mask_mod!r})")


jax.tree_util.register_dataclass(
    BlockMask,
    data_fields=["kv_num_blocks", "kv_indices", "kv_full", "q_num_blocks",
                 "q_indices", "q_full", "mask_mod_args"],
    meta_fields=["block_q", "block_kv", "q_len", "kv_len", "mask_mod"],
)


def _positions(shape) -> Array:
  """0, 1, ... along the last axis, broadcasting against `shape`."""
  return jnp.arange(shape[-1], dtype=jnp.int32).reshape(
      (1,) * (len(shape) - 1) + (shape[-1],))


def _lists(kinds: Array) -> tuple[Array, Array, Array]:
  """(count, indices, full) of the non-empty tiles along the last axis."""
  nonempty = kinds != masking.EMPTY
  count = nonempty.sum(axis=-1, dtype=jnp.int32)
  # A stable sort on "is empty" lists the non-empty tiles first, ascending.
  order = jnp.argsort(~nonempty, axis=-1, stable=True).astype(jnp.int32)
  listed = _positions(kinds.shape) < count[..., None]
  last = jnp.take_along_axis(
      order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
  indices = jnp.where(listed, order, last)
  full = listed & (jnp.take_along_axis(kinds, indices, axis=-1)
                   == masking.FULL)
  return count, indices, full


def _kinds_from_lists(count: Array, indices: Array, full: Array) -> Array:
  *rows, n = indices.shape
  listed = _positions(indices.shape) < count[..., None]
  values = jnp.where(listed, jnp.where(full, masking.FULL, masking.PARTIAL),
                     masking.EMPTY)
  # Unlisted entries repeat a listed index with value EMPTY; max keeps the
  # listed value (EMPTY < PARTIAL < FULL).
  flat = (jnp.arange(math.prod(rows), dtype=jnp.int32).reshape(
      tuple(rows) + (1,)) * n + indices).reshape(-1)
  kinds = jnp.zeros(math.prod(rows) * n, jnp.int32).at[flat].max(
      values.reshape(-1).astype(jnp.int32))
  return kinds.reshape(tuple(rows) + (n,))


def from_kinds(kinds: Array, *, block_q: int, block_kv: int, q_len: int,
               kv_len: int, mask_mod: Callable | None = None,
               mask_mod_args: tuple[Array, ...] = ()) -> BlockMask:
  """The `BlockMask` of dense tile kinds int [Bm, Hm, nq, nk].

  Args:
    kinds: `masking.EMPTY` / `PARTIAL` / `FULL` per tile.
    block_q, block_kv: the tiles.
    q_len, kv_len: the sequence lengths (nq = ceil(q_len / block_q), ...).
    mask_mod, mask_mod_args: the mask they classify.
  """
  kinds = jnp.asarray(kinds, jnp.int32)
  kv = _lists(kinds)
  q = _lists(jnp.swapaxes(kinds, -1, -2))
  return BlockMask(*kv, *q, tuple(mask_mod_args), block_q=block_q,
                   block_kv=block_kv, q_len=q_len, kv_len=kv_len,
                   mask_mod=mask_mod)


def classify(mask_mod: Callable, mask_mod_args: tuple[Array, ...], *,
             batch: int, heads: int, q_len: int, kv_len: int, block_q: int,
             block_kv: int) -> Array:
  """The exact tile kinds of a mask_mod, int32 [Bm, Hm, nq, nk].

  Every element [0, q_len) x [0, kv_len) is evaluated once; a tile is EMPTY
  when none of its elements is visible, FULL when all are. Bm is `batch`,
  or 1 when the mask_mod does not read its batch argument; Hm likewise.
  Jit-compatible: the arguments may be traced, the sizes are static.

  Args:
    mask_mod: the predicate (checked: `mods.check`).
    mask_mod_args: its arrays.
    batch: B.
    heads: N (query heads).
    q_len, kv_len: T and S.
    block_q, block_kv: the tiles.
  """
  uses_b, uses_h = mods.uses_batch_and_head(
      mods.MASK_MOD, mask_mod, mask_mod_args)
  bm, hm = (batch if uses_b else 1), (heads if uses_h else 1)
  nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
  # Each step evaluates one query tile against `per_step` key tiles.
  per_step = max(1, min(nk, _ELEMENTS_PER_STEP // (
      bm * hm * block_q * block_kv)))
  col_steps = -(-nk // per_step)
  cols = per_step * block_kv
  i32 = jnp.int32
  b_idx = jnp.arange(bm, dtype=i32).reshape(bm, 1, 1, 1)
  h_idx = jnp.arange(hm, dtype=i32).reshape(1, hm, 1, 1)

  def step(index):
    i, c = index // col_steps, index % col_steps
    q_idx = i * block_q + jnp.arange(block_q, dtype=i32).reshape(
        1, 1, block_q, 1)
    kv_idx = c * cols + jnp.arange(cols, dtype=i32).reshape(1, 1, 1, cols)
    m = mods.evaluate(mask_mod, (bm, hm, block_q, cols), batch=b_idx,
                      head=h_idx, q_idx=q_idx, kv_idx=kv_idx,
                      args=mask_mod_args, uses=(uses_b, uses_h))
    real = (q_idx < q_len) & (kv_idx < kv_len)  # [1, 1, bq, cols]
    shape = (bm, hm, block_q, per_step, block_kv)
    seen = (m & real).reshape(shape).any(axis=(2, 4))
    whole = (m | ~real).reshape(shape).all(axis=(2, 4))
    return masking.kind_of(seen, whole)  # [Bm, Hm, per_step]

  kinds = jax.lax.map(step, jnp.arange(nq * col_steps, dtype=i32))
  kinds = kinds.reshape(nq, col_steps, bm, hm, per_step)
  kinds = kinds.transpose(2, 3, 0, 1, 4).reshape(bm, hm, nq, -1)
  return kinds[..., :nk]


def _retile_axis(kinds: Array, axis: int, old: int, new: int, length: int,
                 what: str) -> Array:
  n_old, n_new = -(-length // old), -(-length // new)
  if new == old:
    return kinds
  if new % old == 0 or n_new == 1:  # Coarser: a group of whole tiles.
    f = n_old if n_new == 1 else new // old
    pad = [(0, 0)] * kinds.ndim
    pad[axis] = (0, n_new * f - n_old)
    k = jnp.pad(kinds, pad, constant_values=_OUTSIDE)
    shape = k.shape[:axis] + (n_new, f) + k.shape[axis + 1:]
    k = k.reshape(shape)
    empty = ((k == masking.EMPTY) | (k == _OUTSIDE)).all(axis=axis + 1)
    full = ((k == masking.FULL) | (k == _OUTSIDE)).all(axis=axis + 1)
    return masking.kind_of(~empty, full)
  if old % new == 0:  # Finer: each tile is cut in old // new.
    k = jnp.repeat(kinds, old // new, axis=axis)
    return jax.lax.slice_in_dim(k, 0, n_new, axis=axis)
  raise ValueError(
      f"block_mask was made with {what}={old}, which neither divides nor is "
      f"a multiple of the {what}={new} this call runs with; create it with "
      f"{what} a divisor or multiple of {new} (pallas_fa.create_block_mask("
      f"..., block_q=..., block_kv=...)).")


def retile(kinds: Array, *, old: tuple[int, int], new: tuple[int, int],
           q_len: int, kv_len: int) -> Array:
  """Tile kinds [..., nq, nk] of tiles `old` as kinds of tiles `new`.

  See the module docstring: nested tilings only.

  Raises:
    ValueError: the tilings do not nest.
  """
  kinds = _retile_axis(kinds, kinds.ndim - 2, old[0], new[0], q_len,
                       "block_q")
  return _retile_axis(kinds, kinds.ndim - 1, old[1], new[1], kv_len,
                      "block_kv")


def tile_kinds(info: masking.MaskInfo, *, batch: int, heads: int,
               q_len: int, kv_len: int, block_q: int, block_kv: int,
               num_blocks: tuple[int, int] | None = None) -> Array:
  """The kinds of a backend's tiles under `info.mask_mod`, [Bm, Hm, nq,
  nk]: the call's block mask retiled, or the mask_mod classified here.

  Args:
    info: a call's mask description with a mask_mod.
    batch, heads: B and N.
    q_len, kv_len: T and S (unpadded).
    block_q, block_kv: the backend's tiles.
    num_blocks: (nq, nk) of the backend's padded sequences, or None: the
      tiles past T or S hold padding only and are EMPTY.
  """
  bm = info.block_mask
  if bm is None:
    kinds = classify(info.mask_mod, info.mask_mod_args, batch=batch,
                     heads=heads, q_len=q_len, kv_len=kv_len,
                     block_q=block_q, block_kv=block_kv)
  else:
    kinds = retile(bm.kinds(), old=(bm.block_q, bm.block_kv),
                   new=(block_q, block_kv), q_len=q_len, kv_len=kv_len)
  if num_blocks is None:
    return kinds
  nq, nk = num_blocks
  return jnp.pad(kinds, [(0, 0), (0, 0), (0, nq - kinds.shape[2]),
                         (0, nk - kinds.shape[3])],
                 constant_values=masking.EMPTY)


def _check_size(name, x, optional=False):
  if x is None and optional:
    return None
  if not isinstance(x, int) or isinstance(x, bool) or x < 1:
    raise ValueError(f"{name} must be a positive int"
                     f"{' or None' if optional else ''}, got {name}={x!r}.")
  return x


def default_tiles(implementation: str | None, q_len: int,
                  kv_len: int) -> tuple[int, int]:
  """The tiles `create_block_mask` uses for `implementation` by default.

  The finest query and key tiles of the backend's default config (so that
  each of its passes runs on whole multiples of them), clipped to the
  sequences. None and "xla" (which has no tiles) take those of "chunked",
  the backend that runs flex attention on every platform.
  """
  name = "chunked" if implementation in (None, "xla") else implementation
  config = vjp.get_backend(name).default_block_sizes(
      q_len=q_len, kv_len=kv_len, head_dim=128, dtype=jnp.bfloat16)
  fields = [f.name for f in dataclasses.fields(config)]
  block_q = min(getattr(config, f) for f in fields
                if f.startswith("block_q"))
  block_kv = min(getattr(config, f) for f in fields
                 if f.startswith("block_kv"))
  return min(block_q, q_len), min(block_kv, kv_len)


def create_block_mask(
    mask_mod: Callable,
    mask_mod_args: tuple[Array, ...] = (),
    *,
    batch: int | None,
    heads: int | None,
    q_len: int,
    kv_len: int,
    block_q: int | None = None,
    block_kv: int | None = None,
    implementation: str | None = None,
) -> BlockMask:
  """The `BlockMask` of `mask_mod`, reusable across calls and layers.

  Evaluates mask_mod on every element once (see the module docstring); works
  under `jit` (the arguments may be traced).

  Args:
    mask_mod: (batch, head, q_idx, kv_idx, *mask_mod_args) -> bool, True =
      may attend (`pallas_fa.flex.mods`).
    mask_mod_args: the arrays it reads (document ids, prefix lengths).
    batch: B (the flattened batch dims of the calls), or None when the mask
      does not depend on the batch row (mask_mod then sees batch = 0).
    heads: N (query heads), or None when it does not depend on the head.
    q_len: T.
    kv_len: S.
    block_q: query rows per tile; default `default_tiles(implementation)`.
    block_kv: keys per tile; default likewise.
    implementation: the backend whose tiles the defaults follow (None: the
      automatic choice).

  Returns:
    The `BlockMask`; a dimension the mask_mod does not read is stored
    broadcast (size 1).

  Raises:
    TypeError / ValueError: invalid arguments (the message names them).
  """
  args = mods.as_args("mask_mod_args", mask_mod_args)
  if mask_mod is None:
    raise TypeError("create_block_mask needs a mask_mod, got None.")
  mods.check_callable(mods.MASK_MOD, mask_mod, len(args))
  batch = _check_size("batch", batch, optional=True)
  heads = _check_size("heads", heads, optional=True)
  q_len = _check_size("q_len", q_len)
  kv_len = _check_size("kv_len", kv_len)
  block_q = _check_size("block_q", block_q, optional=True)
  block_kv = _check_size("block_kv", block_kv, optional=True)
  mods.check(mods.MASK_MOD, mask_mod, args)
  mods.check_shapes(mods.MASK_MOD, mask_mod, args, batch=batch,
                    heads=heads, q_len=q_len, kv_len=kv_len)
  default_q, default_kv = default_tiles(implementation, q_len, kv_len)
  block_q = block_q or default_q
  block_kv = block_kv or default_kv
  kinds = classify(mask_mod, args, batch=batch or 1, heads=heads or 1,
                   q_len=q_len, kv_len=kv_len, block_q=block_q,
                   block_kv=block_kv)
  return from_kinds(kinds, block_q=block_q, block_kv=block_kv, q_len=q_len,
                    kv_len=kv_len, mask_mod=mask_mod, mask_mod_args=args)


def _check_type(block_mask) -> None:
  if not isinstance(block_mask, BlockMask):
    raise TypeError(
        "block_mask must be a pallas_fa.BlockMask (create_block_mask), got "
        f"{type(block_mask).__name__}.")


def check_made_from(block_mask, mask_mod, mask_mod_args) -> None:
  """Before the call's jit: block_mask's type, and the arrays it was made
  from against the call's mask_mod_args where both are concrete.

  A block mask made from other arrays than the call's mask_mod reads marks
  tiles empty that the call's mask keeps, and the kernels that skip empty
  tiles would drop them: a wrong answer. Traced arrays cannot be compared
  (README: flex attention); the same array objects need no comparison.

  Raises:
    TypeError: not a BlockMask.
    ValueError: made from other mask_mod_args.
  """
  if block_mask is None:
    return
  _check_type(block_mask)
  made_from, given = block_mask.mask_mod_args, tuple(mask_mod_args)
  if not given:
    return  # The call runs on the block mask's own arrays.
  if mask_mod is not None and mask_mod is not block_mask.mask_mod:
    return  # Another function: `check_block_mask` names it.
  if len(made_from) != len(given):
    same = False
  else:
    pairs = [(a, b) for a, b in zip(made_from, given) if a is not b]
    if any(isinstance(x, jax.core.Tracer) for pair in pairs for x in pair):
      return
    same = all(np.shape(a) == np.shape(b)
               and np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in pairs)
  if not same:
    raise ValueError(
        "block_mask was made from other mask_mod_args than the call's: its "
        "empty tiles are those of other arrays, and the kernels that skip "
        "them would drop keys the call's mask keeps; create the block mask "
        "from the call's mask_mod_args (or pass none, to use the block "
        "mask's).")


def check_block_mask(block_mask, mask_mod, *, batch: int, heads: int,
                     q_len: int, kv_len: int) -> BlockMask | None:
  """Validates `flash_attention(block_mask=...)` against the call.

  Raises:
    TypeError: not a BlockMask.
    ValueError: made for other lengths, batch or heads, or for another
      mask_mod than the call's.
  """
  if block_mask is None:
    return None
  _check_type(block_mask)
  if (block_mask.q_len, block_mask.kv_len) != (q_len, kv_len):
    raise ValueError(
        f"block_mask was made for q_len={block_mask.q_len}, "
        f"kv_len={block_mask.kv_len}, but the call has T={q_len}, "
        f"S={kv_len}.")
  uses_b, uses_h = (True, True)
  if block_mask.mask_mod is not None:
    uses_b, uses_h = mods.uses_batch_and_head(
        mods.MASK_MOD, block_mask.mask_mod, block_mask.mask_mod_args)
  # Size 1 is a broadcast, right only for a mask_mod that ignores the axis.
  for name, size, want, uses in (("batch", block_mask.batch, batch, uses_b),
                                 ("heads", block_mask.heads, heads, uses_h)):
    if size != want and (size != 1 or uses):
      raise ValueError(
          f"block_mask covers {name}={size}, but the call has {want} and "
          f"its mask_mod reads that index; create it with {name}={want}.")
  if mask_mod is not None and mask_mod is not block_mask.mask_mod:
    raise ValueError(
        f"block_mask was made from mask_mod={block_mask.mask_mod!r}, not "
        f"the call's {mask_mod=}; pass the same function (or leave "
        "mask_mod=None to use the block mask's).")
  return block_mask
