"""The shared pieces of the Mosaic TPU kernels of `mosaic_tpu`.

The kernels themselves are in `forward` (forward) and
`backward` (dQ, dK/dV).

Shapes are chosen for the TPU's (8 sublane x 128 lane) vector registers and its
128-wide matrix unit:

* q/k/v/out live in HBM as [B, L, heads * Hp] with the head dim padded to a
  multiple of 128 (q/k to H's, v/out to Hv's), so a (block, Hp) tile of one
  head is a lane-aligned slice of a free reshape of the public BTNH layout (no
  transposes around the kernels);
* the running statistics m_i and l_i are kept lane-replicated ([bq, 128]) in
  VMEM, so broadcasting them against a [bq, bk] tile needs no relayout; the
  logsumexp and delta residuals travel compactly as rows [B, N, 1, Tp];
* query-side positions and segment ids are lane-replicated ([B, Tp, 128]) and
  key-side ones sublane-replicated ([B, 8, Sp]), the layouts in which they
  broadcast against a [bq, bk] tile for free.

Block skipping: the wrapper classifies every (query tile, key tile) pair as
EMPTY, PARTIAL or FULL (`masking.classify_blocks`, on device) and passes one
int32 per grid step through scalar prefetch (SMEM): the kind in the low bits
and, above them, the block that step fetches. A non-empty step fetches its own
block; an empty one points at the block the sweep needs next (or the one it
already holds), so the pipeline issues no DMA for it, and its body does
nothing. FULL steps skip the masking arithmetic.

Flex attention: a split score_mod / mask_mod (`fused_mods`) brings its
per-(batch, head) values as 32-bit scalars in SMEM, its per-query (per-key)
ones lane- (sublane-) replicated like positions. A table the tile part reads
at offsets computed per element (T5's buckets, `table[head, bucket(kv_idx -
q_idx)]`, any learned relative bias) is one of those SMEM inputs too: each
program's part of the table, flattened, [Bm * Hm * size] scalars. Mosaic has
no vector gather from VMEM at arbitrary per-element offsets, so the kernels
"load" it by a one-hot selection (`_table_load`): a loop over the program's
entries j of `where(offsets == j, table[j], x)` on the tile, elementwise
compares and selects against scalars read from SMEM, O(entries) vector
operations per element (hence `MAX_TABLE_ENTRIES`). Its gradient is the
transpose (`_table_scatter`): entry j gets the tile's sum of the cotangents
where offsets == j, accumulated by the dQ kernel per (batch row, head, query
tile) in a lane row of float32 (a per-program partial table) and summed after
the kernel by XLA: no atomics, a fixed order, so deterministic.

Attention dropout (`pallas_fa.dropout`) regenerates its mask per tile from
the seed, which sits in SMEM, and the tile's global indices: the query side of
the hash runs once per row, lane-replicated like the positions, and only the
key index is hashed per element.

Compiled, the reduction grid axes are "arbitrary" and all others "parallel"
(see `parallel_grid` for interpreted runs). FlashAttention-2 §3.1 for the
forward; §3.2 for the backward, split into a dK/dV kernel -- key tile
stationary, the queries of its GQA group streamed, dK/dV summed over the group
in VMEM -- and a dQ kernel -- query tile stationary, keys streamed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_fa import dropout
from pallas_fa import manual_axes
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa.flex import fused_mods

NUM_LANES = 128
NUM_SUBLANES = 8

# A grid step's metadata word: (block index << KIND_BITS) | kind.
KIND_BITS = 2
KIND_MASK = (1 << KIND_BITS) - 1

_F32 = jnp.float32
# The most entries one program's table (`fused_mods.Residual.size`) may
# have. A table read costs a compare and a select per entry on every element
# of the tile (`_table_load`), and its gradient a compare, a select and a
# sum per entry (`_table_scatter`): at 256 entries that is several hundred
# VPU operations per logit, an order of magnitude above the softmax's own
# elementwise work, past which the one-hot selection is no better than
# `chunked`'s real gather. 256 covers T5's bucket counts (32 by default, up
# to 128 in practice) and learned relative biases over distances up to
# +-127; larger tables are declined (`mosaic_tpu.flex_mods`).
MAX_TABLE_ENTRIES = 256
# `dot`'s contraction dims.
NT = ((1,), (1,))  # a @ b.T
NN = ((1,), (0,))  # a @ b
TN = ((0,), (0,))  # a.T @ b

# Squeezed block dims: `pl.squeezed` where the installed Pallas has it.
SQUEEZED = getattr(pl, "squeezed", None)
_COMPILER_PARAMS = getattr(pltpu, "CompilerParams", None) or getattr(
    pltpu, "TPUCompilerParams", None
)


def interpret_params() -> Any:
  """pallas_call's `interpret=`: False on TPU, TPU interpret mode elsewhere."""
  if jax.default_backend() == "tpu":
    return False
  params = getattr(pltpu, "InterpretParams", None)
  return params() if params is not None else True


def metadata_capacity() -> int | None:
  """How many per-step metadata words this TPU's SMEM holds, or None.

  Half the scalar memory is left to Mosaic (scalar spills, DMA descriptors).
  None when the kernels run interpreted (the interpreter's scalar memory is
  unbounded) or the device is not a TPU Pallas knows.
  """
  if interpret_params() is not False:
    return None
  get_info = getattr(pltpu, "get_tpu_info", None)
  if get_info is None:
    return None
  try:
    smem = get_info().smem_capacity_bytes
  except (ValueError, AttributeError):
    return None
  return smem // 2 // 4


def parallel_grid(interpret) -> bool:
  """Whether the non-reduction grid axes are declared "parallel".

  Always when compiled: Mosaic splits parallel axes across TensorCores
  (megacore). The TPU interpreter visits parallel axes in a random order,
  drawn by random permutations traced into every call, which makes each
  small interpreted call compile about 1.5x slower; interpreted runs
  therefore declare every axis "arbitrary" (sequential) unless asked
  otherwise. The kernels' results do not depend on the order of the parallel
  axes, which the tests check by interpreting the TPU's own semantics.
  """
  return interpret is False


@dataclasses.dataclass(frozen=True)
class Float8:
  """How a float8 call's scales reach the forward kernel.

  q/k/v stay 1 byte an element in HBM and VMEM, each tile widened to
  bfloat16 (`widen`). "q_scale", float32 rows [B, N, 1, Tp], scales the
  logits' rows: the query's scale times the logit scale (`Static.scale`
  is then 1), times the key's where that is one per (batch row, head).

  Attributes:
    key_columns: the key's scales are per key: "k_scale" rows [B, K, 1,
      Sp] multiply the logits' columns.
    value_columns: the value's scales are per key: "v_scale" rows [B, K,
      1, Sp] multiply P's columns; else "v_scale" holds one per (batch
      row, query head) in SMEM, [B * N], which multiplies the output.
  """

  key_columns: bool
  value_columns: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class Static:
  """Everything static about one kernel launch.

  Attributes:
    scale: logit scale.
    soft_cap: logit soft cap or None.
    is_causal: causal masking on positions.
    window: (left, right) window on positions, or None.
    batch: B.
    num_heads: N (query heads).
    num_kv_heads: K (key/value heads).
    head_dim: Hp, the query/key head dim padded to a multiple of 128.
    value_head_dim: the value (and output) head dim, padded likewise.
    q_len: Tp, the padded query length (a multiple of block_q).
    kv_len: Sp, the padded key length (a multiple of block_kv).
    block_q: query rows per tile.
    block_kv: key rows per tile.
    positions: whether position arrays are passed (causal or window).
    segments: whether segment-id arrays are passed.
    bias_shape: shape of the padded bias [B|1, N|1, Tp|1, Sp|1], or None.
    mask_shape: shape of the padded int8 mask, or None.
    dropout_rate: attention dropout rate; 0 = none (else a "seed" input).
    precision: matmul precision of every dot.
    interpret: the `interpret=` argument of pallas_call.
    parallel: declare the non-reduction grid axes "parallel" (see
      `parallel_grid`); otherwise every axis is "arbitrary".
    score_mod, mask_mod: flex attention split by `fused_mods` (inputs
      "score_mod.i" / "mask_mod.i": per (batch, head) values in SMEM as
      32-bit scalars -- a table as [Bm * Hm * size] --, per query
      lane-replicated, per key sublane-replicated), or None.
    float8: the forward of a float8 call (`Float8`), or None.
  """

  scale: float
  soft_cap: float | None
  is_causal: bool
  window: tuple[int | None, int | None] | None
  batch: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  value_head_dim: int
  q_len: int
  kv_len: int
  block_q: int
  block_kv: int
  positions: bool
  segments: bool
  bias_shape: tuple[int, int, int, int] | None
  mask_shape: tuple[int, int, int, int] | None
  dropout_rate: float
  precision: Any
  interpret: Any
  parallel: bool
  score_mod: Any = None
  mask_mod: Any = None
  float8: Float8 | None = None

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def num_q_blocks(self) -> int:
    return self.q_len // self.block_q

  @property
  def num_kv_blocks(self) -> int:
    return self.kv_len // self.block_kv

  @property
  def masked(self) -> bool:
    """Whether any element can be masked (else every tile is FULL)."""
    return (self.positions or self.segments or self.mask_shape is not None
            or self.mask_mod is not None)

  def residual(self, name: str):
    """The `fused_mods.Residual` an input "score_mod.i" / "mask_mod.i"
    holds, or None for another input."""
    mod_name, _, index = name.partition(".")
    mod = getattr(self, mod_name, None) if index else None
    return None if mod is None else mod.residuals[int(index)]


class _Coords:
  """Block coordinates of one grid step, for the index maps.

  The block a step fetches along the swept axis comes from the metadata word
  in SMEM; it is read only by the index maps that need it.
  """

  def __init__(self, *, b, head, kv_head, q_block, kv_block):
    self.b, self.head, self.kv_head = b, head, kv_head
    self._q_block, self._kv_block = q_block, kv_block

  @property
  def q_block(self):
    return self._q_block()

  @property
  def kv_block(self):
    return self._kv_block()


def step_kind(word):
  """The kind (EMPTY/PARTIAL/FULL) of a grid step's metadata word."""
  return word & KIND_MASK


def step_block(word):
  """The block a grid step fetches, from its metadata word."""
  return word >> KIND_BITS


# --- index maps ---------------------------------------------------------------


def _in_spec(st: Static, name: str, coords) -> pl.BlockSpec:
  """BlockSpec of input `name`; `coords(*grid, meta_ref)` -> _Coords."""
  hp, hvp = st.head_dim, st.value_head_dim
  bq, bk = st.block_q, st.block_kv
  sq = SQUEEZED

  def spec(block, fn):
    return pl.BlockSpec(block, lambda *args: fn(coords(*args)))

  if name == "q":
    return spec((sq, bq, hp), lambda c: (c.b, c.q_block, c.head))
  if name == "do":
    return spec((sq, bq, hvp), lambda c: (c.b, c.q_block, c.head))
  if name == "k":
    return spec((sq, bk, hp), lambda c: (c.b, c.kv_block, c.kv_head))
  if name == "v":
    return spec((sq, bk, hvp), lambda c: (c.b, c.kv_block, c.kv_head))
  if name == "seed":  # int32 [1], whole in scalar memory
    return pl.BlockSpec(memory_space=pltpu.SMEM)
  res = st.residual(name)
  if res is not None:  # Flex values, laid out like positions (see Static).
    if res.level == fused_mods.Level.PROGRAM:
      return pl.BlockSpec(memory_space=pltpu.SMEM)
    if res.level == fused_mods.Level.ROW:
      return spec((sq, bq, NUM_LANES),
                  lambda c: (c.b if res.batch else 0, c.q_block, 0))
    return spec((sq, NUM_SUBLANES, bk),
                lambda c: (c.b if res.batch else 0, 0, c.kv_block))
  if name in ("lse", "delta", "q_scale"):
    return spec((sq, sq, 1, bq), lambda c: (c.b, c.head, 0, c.q_block))
  if name == "v_scale" and not st.float8.value_columns:
    return pl.BlockSpec(memory_space=pltpu.SMEM)  # [B * N] scalars
  if name in ("k_scale", "v_scale"):
    return spec((sq, sq, 1, bk), lambda c: (c.b, c.kv_head, 0, c.kv_block))
  if name in ("q_pos", "q_seg"):
    return spec((sq, bq, NUM_LANES), lambda c: (c.b, c.q_block, 0))
  if name in ("kv_pos", "kv_seg"):
    return spec((sq, NUM_SUBLANES, bk), lambda c: (c.b, 0, c.kv_block))
  if name in ("bias", "mask"):
    shape = st.bias_shape if name == "bias" else st.mask_shape
    b1, n1, t1, s1 = (d == 1 for d in shape)
    block = (sq, sq, 1 if t1 else bq, 1 if s1 else bk)
    return spec(
        block,
        lambda c: (
            0 if b1 else c.b,
            0 if n1 else c.head,
            0 if t1 else c.q_block,
            0 if s1 else c.kv_block,
        ),
    )
  raise ValueError(f"unknown kernel input {name=}")


def row_major_coords(st: Static):
  """Grid (B, N, nq, nk): query tile stationary, key tiles streamed."""
  nq, nk, g = st.num_q_blocks, st.num_kv_blocks, st.group

  def coords(b, n, i, j, meta_ref):
    # lax.div: a truncating divide, which Mosaic lowers without sign fix-ups.
    kv_head = jax.lax.div(n, jnp.int32(g))
    return _Coords(
        b=b, head=n, kv_head=kv_head, q_block=lambda: i,
        kv_block=lambda: step_block(meta_ref[(b * nq + i) * nk + j]))

  return coords


def col_major_coords(st: Static):
  """Grid (B, K, nk, G, nq): key tile stationary, its group's queries stream."""
  nq, nk, g = st.num_q_blocks, st.num_kv_blocks, st.group

  def coords(b, h, j, gi, i, meta_ref):
    return _Coords(
        b=b, head=h * g + gi, kv_head=h,
        q_block=lambda: step_block(meta_ref[(b * nk + j) * nq + i]),
        kv_block=lambda: j)

  return coords


# --- shared kernel pieces -----------------------------------------------------


def dot(a, b, dims, precision):
  """a . b contracting `dims` (NT/NN/TN), accumulated in float32."""
  return jax.lax.dot_general(
      a, b, (dims, ((), ())), preferred_element_type=_F32, precision=precision
  )


def widen(tile, dtype):
  """A tile in the computed `dtype`: an int8 / float8 one (1 byte an
  element in HBM and VMEM) converted here, through float32 (every int8 and
  float8 value is exact in bfloat16 as well)."""
  if tile.dtype == dtype:
    return tile
  return tile.astype(_F32).astype(dtype)


def _lanes(x, width):
  """Lane-replicated [rows, 128] -> [rows, width] (width % 128 == 0)."""
  return jnp.tile(x, (1, width // NUM_LANES))


def column(ref):
  """A lane-replicated [rows, 128] statistic as a [rows] column."""
  return ref[...][:, 0]


def store_column(ref, x):
  """Stores a [rows] column lane-replicated into a [rows, 128] ref."""
  ref[...] = jnp.broadcast_to(x[:, None], ref.shape)


def init_softmax(m_ref, l_ref, acc_ref):
  """Starts an online softmax in VMEM scratch: the lane-replicated
  [rows, 128] statistics m_i (-inf) and l_i (0) and the accumulator (0)."""
  m_i, l_i, acc = online_softmax.init(m_ref.shape, acc_ref.shape)
  m_ref[...] = m_i
  l_ref[...] = l_i
  acc_ref[...] = acc


def _logits(st: Static, r, q, k):
  """(s_capped, s) of one [bq, bk] tile, unmasked (`online_softmax.logits`).
  A float8 call's products are those of the stored values, scaled per row
  (`Float8`) and per key column where the key's scales are per key:
  q . (k * c) = (q . k) * c."""
  qk = dot(q, k, NT, st.precision)  # [bq, bk]
  if st.float8 is not None:
    qk = qk * r["q_scale"][0][:, None]
    if st.float8.key_columns:
      qk = qk * r["k_scale"][...]
  bias = r["bias"][...] if "bias" in r else None  # [bq|1, bk|1] broadcasts
  s, s_capped = online_softmax.logits(
      qk, scale=st.scale, cap=st.soft_cap, bias=bias)
  return s_capped, s


@dataclasses.dataclass(frozen=True)
class Tile:
  """Where the current [bq, bk] tile lies: batch row, query head, query
  and key block (for a flex function's indices and values)."""

  b: Any
  head: Any
  q_block: Any
  kv_block: Any


def table_width(size: int) -> int:
  """The lanes of a table's gradient row: `size` rounded up to 128."""
  return -(-size // NUM_LANES) * NUM_LANES


def _as_residual(x, res):
  """A 32-bit value read from memory as the residual's dtype."""
  if res.dtype == jnp.bool_:
    return x != 0
  return x if x.dtype == res.dtype else x.astype(res.dtype)


def _loop_unroll(steps: int) -> int:
  """fori_loop's `unroll` over `steps` of a table's entries: whole up to
  16 (no loop left), else by 8."""
  return max(steps, 1) if steps <= 16 else 8


def _table_load(ref, res, program):
  """A table residual's load (`fused_mods.FusedMod.tile`): the function
  from an int32 tile of offsets (in [0, size), clamped by `fused_mods`) to
  the program's entries there, as the one-hot selection
  `where(offsets == j, table[j], x)` over the entries j, each read as a
  scalar from SMEM (`ref`, [Bm * Hm * size]; this program's part starts at
  `program * size`). Only compares, selects and scalar reads: no gather."""
  size = res.size

  def load(offsets):
    base = program * size

    def body(j, x):
      return jnp.where(offsets == j, ref[base + j], x)

    first = jnp.full(offsets.shape, ref[base], ref.dtype)
    x = jax.lax.fori_loop(1, size, body, first,
                          unroll=_loop_unroll(size - 1))
    return _as_residual(x, res)

  return load


def _table_scatter(offsets, d, size: int):
  """The transpose of `_table_load`: `d` (float32, a tile) added at
  `offsets` into a [1, table_width(size)] float32 row, entry j in lane j:
  the tile's sum of d where offsets == j, reduced over sublanes, then lanes
  (a [1, 1] per entry, placed by a select). A fixed order, deterministic."""
  offsets, d = jnp.broadcast_arrays(offsets, d)
  lanes = jax.lax.broadcasted_iota(jnp.int32, (1, table_width(size)), 1)

  def body(j, acc):
    hit = jnp.where(offsets == j, d, 0.0)
    total = hit.sum(axis=0, keepdims=True).sum(axis=1, keepdims=True)
    return acc + jnp.where(lanes == j, total, 0.0)

  return jax.lax.fori_loop(0, size, body, jnp.zeros(lanes.shape, _F32),
                           unroll=_loop_unroll(size))


def _flex_values(st: Static, r, mod, tile: Tile, shape):
  """The residuals of `mod` for the tile, broadcast to it; a table's, its
  load (`_table_load`)."""
  level = fused_mods.Level
  values = []
  for i, res in enumerate(mod.residuals):
    ref = r[f"{mod.name}.{i}"]
    if res.level == level.PROGRAM:  # [Bm * Hm (* size)] in SMEM, 32-bit
      heads = st.num_heads if res.head else 1
      program = ((tile.b if res.batch else 0) * heads
                 + (tile.head if res.head else 0))
      if res.size is not None:
        values.append(_table_load(ref, res, program))
        continue
      v = _as_residual(jnp.full(shape, ref[program], ref.dtype), res)
    elif res.level == level.ROW:
      v = _as_residual(_lanes(ref[...], st.block_kv), res)  # [bq, bk]
    else:  # [1, bk] -> [bq, bk]
      v = _as_residual(jnp.broadcast_to(ref[:1, :], shape), res)
    values.append(v)
  return values


def _flex_indices(st: Static, tile: Tile, shape):
  """(q_idx, kv_idx) int32 tiles of the token indices."""
  rows = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  return tile.q_block * st.block_q + rows, tile.kv_block * st.block_kv + cols


def _visibility(st: Static, r):
  """`masking.visible` for the current [bq, bk] tile."""
  q_pos = kv_pos = q_seg = kv_seg = dense = None
  if st.positions:
    q_pos = _lanes(r["q_pos"][...], st.block_kv)  # [bq, bk]
    kv_pos = r["kv_pos"][:1, :]  # [1, bk]
  if st.segments:
    q_seg = _lanes(r["q_seg"][...], st.block_kv)  # [bq, bk]
    kv_seg = r["kv_seg"][:1, :]  # [1, bk]
  if st.mask_shape is not None:
    dense = r["mask"][...].astype(jnp.int32) != 0  # [bq|1, bk|1]
  return masking.visible(
      is_causal=st.is_causal,
      window=st.window,
      q_pos=q_pos,
      kv_pos=kv_pos,
      q_seg=q_seg,
      kv_seg=kv_seg,
      dense=dense,
  )


def masked_logits(st: Static, r, q, k, masked: bool, tile: Tile | None = None,
                  grad: bool = False, args: bool = True):
  """(s_capped, s, score_mod pullback or None) of the current tile: the
  score_mod applied (its pullback kept when `grad`; with `args` also its
  per-(batch, head) values' cotangents, summed per query row, [bq], and
  its tables', [1, table_width] rows (`_table_scatter`)), s masked when
  `masked` (by the mask_mod too). `tile` is needed with flex."""
  s_capped, s = _logits(st, r, q, k)
  pullback = None
  if st.score_mod is not None:
    q_idx, kv_idx = _flex_indices(st, tile, s.shape)
    values = _flex_values(st, r, st.score_mod, tile, s.shape)
    if grad:
      s, pullback = st.score_mod.tile_vjp(
          values, q_idx=q_idx, kv_idx=kv_idx, score=s, args=args,
          reduce=lambda d: d.sum(axis=1), scatter=_table_scatter)
    else:
      s = st.score_mod.tile(values, q_idx=q_idx, kv_idx=kv_idx, score=s)
  if masked:
    visible = _visibility(st, r)
    if st.mask_mod is not None:
      q_idx, kv_idx = _flex_indices(st, tile, s.shape)
      mod = st.mask_mod.tile(
          _flex_values(st, r, st.mask_mod, tile, s.shape), q_idx=q_idx,
          kv_idx=kv_idx)
      visible = mod if visible is None else visible & mod
    s = online_softmax.apply_mask(s, visible)
  return s_capped, s, pullback


def dropout_factor(st: Static, r, b, head, q_block, kv_block):
  """The [bq, bk] attention-dropout factor (0 or 1 / (1 - rate)) of tile
  (q_block, kv_block) of batch row b and query head `head`.

  Indices are global (padding only appends), so the mask is the one every
  backend draws. The query side is hashed lane-replicated ([bq, 128], the
  layout of the query positions) and tiled; the key index per element.
  """
  bq, bk = st.block_q, st.block_kv
  rows = q_block * bq + jax.lax.broadcasted_iota(
      jnp.int32, (bq, NUM_LANES), 0)
  state = _lanes(dropout.row_state(r["seed"][0], b, head, rows), bk)
  cols = kv_block * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  keep = dropout.keep_in_row(state, st.dropout_rate, cols)
  return dropout.factor(keep, st.dropout_rate, _F32)


def dispatch(st: Static, kind, step):
  """Runs step(masked) on PARTIAL/FULL steps; EMPTY steps do nothing."""
  if not st.masked:
    step(False)  # Every tile is FULL.
    return
  pl.when(kind == masking.PARTIAL)(lambda: step(True))
  pl.when(kind == masking.FULL)(lambda: step(False))


def unpack(names, refs):
  """The kernel's refs as a dict keyed by their names."""
  return dict(zip(names, refs, strict=True))


def compiler_params(parallel: bool, num_parallel: int, num_axes: int,
                    vmem_limit_bytes: int | None = None):
  """pallas_call's TPU compiler parameters: with `parallel` (see
  `parallel_grid`) the leading `num_parallel` grid axes "parallel" and the
  reduction axes "arbitrary"; `vmem_limit_bytes` raises the scoped VMEM
  limit (None: the compiler's default)."""
  if _COMPILER_PARAMS is None:
    return None
  kwargs = {}
  if vmem_limit_bytes is not None:
    kwargs["vmem_limit_bytes"] = int(vmem_limit_bytes)
  if not parallel:
    # None means "arbitrary" everywhere. Unlike an explicit tuple it also
    # covers grid axes that vmap prepends, which the interpreter needs.
    return _COMPILER_PARAMS(**kwargs)
  semantics = ("parallel",) * num_parallel + ("arbitrary",) * (
      num_axes - num_parallel)
  return _COMPILER_PARAMS(dimension_semantics=semantics, **kwargs)


def cost_estimate(flops, transcendentals, operands, out_shapes):
  """pallas_call's cost estimate, or None where Pallas has none."""
  cost = getattr(pl, "CostEstimate", None)
  if cost is None:
    return None
  nbytes = sum(x.size * x.dtype.itemsize for x in operands)
  nbytes += sum(
      math.prod(o.shape) * jnp.dtype(o.dtype).itemsize for o in out_shapes)
  return cost(flops=int(flops), transcendentals=int(transcendentals),
              bytes_accessed=int(nbytes))


def launch(kernel, st, grid, coords, names, operands, out_specs, out_shapes,
           scratch, num_parallel, meta, cost):
  """Runs `kernel` over `grid` with the metadata words in scalar prefetch.

  The inputs `operands`, named `names`, are tiled by `coords` (see
  `row_major_coords`, `col_major_coords`); the leading `num_parallel` grid
  axes may be "parallel". `cost` is a `cost_estimate` or None.
  """
  in_specs = [_in_spec(st, name, coords) for name in names]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=scratch,
  )
  kwargs = {}
  if cost is not None:
    kwargs["cost_estimate"] = cost
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=manual_axes.out_structs(out_shapes, operands),
      compiler_params=compiler_params(st.parallel, num_parallel, len(grid)),
      interpret=st.interpret,
      **kwargs,
  )(meta, *operands)
