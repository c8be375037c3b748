"""The shared skeleton of the Mosaic GPU kernels of `mosaic_gpu` (Hopper).

Three persistent kernels (`forward`, `dq`,
`dkv`) share one producer/consumer skeleton (FlashAttention-3,
§3.1), built by `launch`:

* a *producer* warpgroup streams tiles with TMA into a `stages`-deep ring of
  shared-memory slots (`produce`); every slot has a "loaded" barrier
  (completed by the TMA transaction count) and a "consumed" barrier (one
  arrival per consumer);
* one or two *consumer* warpgroups each own a tile of rows that stays in
  shared memory for the whole unit of work (`load_stationary`), run the
  matmuls on wgmma and keep the softmax state in registers;
* every CTA walks a static list of units of work (`Units`; causal ones
  dealt longest first and balanced across CTAs), so
  the grid is at most one CTA per SM and the prologue of one unit overlaps
  the tail of the previous one (the producer runs ahead across unit
  boundaries).

Each consumer splits the key (or query) tiles of a unit into a masked prefix,
an unmasked middle that skips the masking arithmetic and a masked suffix
(`phases`); tiles outside the union of the consumers' non-empty ranges are
never loaded.

The same kernel bodies run in the Mosaic GPU interpreter on CPU:
`ops.Ops` swaps the few GPU-only operations (wgmma, register
layouts, layout-aware loads) for plain jax.numpy equivalents; barriers, TMA
copies, ring slots and the schedule are executed as written.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import heapq
import importlib
import inspect
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa import dropout
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa.flex import fused_mods
from pallas_fa.mosaic_gpu import ops as gpu_ops

Array = Any

# Producer register budget (setmaxnreg, the hardware minimum); it only
# issues TMA copies.
_PRODUCER_REGISTERS = 24


def _consumer_registers(consumers: int) -> int:
  """setmaxnreg budget of a consumer thread. Three warpgroups launch with
  168 registers a thread (64K / 384), 504 in all: the 24-register producer
  leaves 2 x 240 for two consumers (FlashAttention-3's split); one consumer
  gets the hardware maximum, 256."""
  return 240 if consumers == 2 else 256


# --------------------------------------------------------------------------
# Version-dependent API (jax 0.10.x and 0.11.x).
# --------------------------------------------------------------------------


def ops_for(spec: Spec) -> gpu_ops.Ops:
  """The `Ops` of a launch (its execution mode and SMEM swizzle)."""
  return gpu_ops.Ops(spec.interpret, swizzle=spec.swizzle)


def interpret_params():
  """A Mosaic GPU interpreter parameter object, or None when unavailable."""
  for name in ("InterpretGPUParams", "InterpretParams"):
    cls = getattr(plgpu, name, None)
    if cls is not None:
      return cls()
  # jax 0.10 keeps the interpreter private.
  try:
    interpret_module = importlib.import_module(
        "jax._src.pallas.mosaic_gpu.interpret.params")
  except ImportError:
    return None
  cls = getattr(interpret_module, "InterpretGPUParams", None)
  return None if cls is None else cls()


def interpreter_takes_ref_unions() -> bool:
  """Whether this jax's Mosaic GPU interpreter runs kernels with a
  `plgpu.RefUnion` (jax 0.11; jax 0.10's fails on the union's views, in a
  thread of its own, and the kernel then never ends)."""
  try:
    callbacks = importlib.import_module(
        "jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks")
  except ImportError:
    return False
  return hasattr(callbacks, "call_tag_ref_union")


def rem(x, n: int):
  """lax.rem of an int32 index by a static n.

  The kernels' index math is int32 (CTA, warpgroup and loop indices,
  schedule entries). lax's integer operations take operands of one dtype,
  and under `jax_enable_x64` a Python int is int64: n goes in as int32.
  """
  return lax.rem(x, np.int32(n))


def div(x, n: int):
  """lax.div (rounding toward zero) of an int32 index by a static n, as
  `rem`."""
  return lax.div(x, np.int32(n))


# Warpgroups of the widest kernel: a producer and two consumers.
MAX_WARPGROUPS = 3


def cpu_client_threads() -> int:
  """Threads of the CPU client that runs interpreted kernels.

  The interpreter runs each warpgroup as a computation of its own that
  blocks in a callback at every barrier until the others arrive, so it
  needs a client thread per warpgroup at once or it deadlocks. XLA sizes
  the pool by the NPROC environment variable, else by the cores this
  process may run on.
  """
  nproc = os.environ.get("NPROC", "")
  if nproc.isdigit():
    return int(nproc)
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def kernel_kwargs(*, out_types, scratch, interpret, lowering_semantics,
                  cross_warp_reductions=True):
  """`plgpu.kernel` keywords under whichever names this jax version takes.

  `lowering_semantics` ("lane", "warpgroup" or None for jax's default)
  applies to compiled kernels only, and so does `cross_warp_reductions`:
  False (a kernel whose reductions all stay within a warp) reserves none
  of the SMEM Mosaic GPU keeps for cross-warp ones (2 KiB by default; such
  a reduction would then fail to lower, not run wrong).
  """
  params = inspect.signature(plgpu.kernel).parameters
  kwargs = {
      "out_type" if "out_type" in params else "out_shape": out_types,
      "scratch_types" if "scratch_types" in params else "scratch_shapes":
          scratch,
  }
  if interpret is not None:
    kwargs["interpret"] = interpret
  else:
    compiler = dict(approx_math=True)
    if not cross_warp_reductions:
      compiler["reduction_scratch_bytes"] = 0
    if lowering_semantics is not None:
      compiler["lowering_semantics"] = getattr(
          plgpu.LoweringSemantics, lowering_semantics.capitalize())
    kwargs["compiler_params"] = plgpu.CompilerParams(**compiler)
  return kwargs


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
  """Static (hashable) parameters of one kernel launch.

  Attributes:
    batch: B.
    q_len: padded query length (a multiple of the query tiles).
    kv_len: padded key length (a multiple of the key tiles).
    num_heads: N.
    num_kv_heads: K.
    head_dim: padded query/key head dim (a multiple of 64, at most 256).
    value_head_dim: padded value (and output) head dim; None: head_dim.
    dropout_rate: attention dropout rate (`pallas_fa.dropout`); 0: none.
    dtype: bfloat16 or float16.
    block_q: query rows per consumer tile.
    block_kv: key rows per consumer tile.
    stages: depth of the shared-memory ring.
    consumers: consumer warpgroups per CTA (1 or 2).
    num_ctas: persistent grid size.
    pingpong: forward only: alternate the two consumers on the tensor cores.
    intra_overlap: forward only: each consumer issues Q K_j^T and
      P_{j-1} V_{j-1} together and runs the softmax of tile j while the
      second is in flight (`MosaicGpuBlockSizes.intra_overlap`).
    poly_exp2: forward only: one 8-key column group in poly_exp2 of each
      logit tile's exponentials on the FMA pipe (0: none;
      `MosaicGpuBlockSizes.poly_exp2`).
    two_level: float8 forward only: each tile's P V in a fresh
      accumulator, added to the float32 running one
      (`MosaicGpuBlockSizes.float8_two_level`).
    dq_split: fused backward only: "columns" or "keys", how two consumers
      divide dQ (`MosaicGpuBlockSizes.dq_split`, `tiles.dq_columns`).
    dq_swizzle: fused backward only: the dQ staging tile's swizzle in
      bytes (`MosaicGpuBlockSizes.dq_swizzle`).
    fused_overlap: fused backward only: stage dS^T while dK's product
      runs (`MosaicGpuBlockSizes.fused_overlap`).
    fused_pipeline: fused backward only: each step's dQ product issued
      with the next step's S^T (`MosaicGpuBlockSizes.fused_pipeline`).
    fused_softmax_overlap: fused backward only: P^T computed under dP^T's
      product, dS^T under dV's (`MosaicGpuBlockSizes.fused_softmax_overlap`).
    is_causal: causal masking on positions.
    window: (left, right) or None; a None side is unbounded.
    positions_by_index: the positions causal or window masking compares
      are the tokens' indices (`MaskInfo.positions_are_indices`): made
      from the tile offsets (`load_meta`), they take no shared memory and
      no copies.
    has_segments: whether segment ids (padding included) take part.
    scale: logit scale.
    soft_cap: logit soft cap or None.
    interpret: run in the Mosaic GPU interpreter (CPU).
    lowering_semantics: "lane", "warpgroup" or None (jax's default).
    score_mod: the call's score_mod split by `fused_mods` (its residuals
      are per (batch, head) only: `Refs.residuals`), or None.
    mask_mod: the call's mask_mod split likewise, or None. Its per-(batch,
      head) values follow the score_mod's in `Refs.residuals`; its one
      per-query and one per-key value (if any) travel in a metadata slot
      the call leaves free, `mod_slot`.
    mod_slot: "segments" or "positions": the metadata slot (segment ids
      unless the call has some, else positions unless it needs them) that
      carries the mask_mod's per-query and per-key values; None when it has
      none.
    valid_kv_len: S before padding. Where no segment ids travel (a
      forward without the call's own, or `mod_slot` "segments") the padded
      keys are masked by index (`masks_padding_by_index`).
    head_section: (batch, head) pairs per head section of a causal
      schedule (`Units`); None: all pairs in one section.
  """

  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: Any
  block_q: int
  block_kv: int
  stages: int
  consumers: int = 2
  num_ctas: int = 1
  pingpong: bool = True
  intra_overlap: bool = False
  poly_exp2: int = 0
  two_level: bool = False
  dq_split: str = "columns"
  dq_swizzle: int = 128
  fused_overlap: bool = False
  fused_pipeline: bool = False
  fused_softmax_overlap: bool = False
  is_causal: bool = False
  window: tuple[int | None, int | None] | None = None
  positions_by_index: bool = False
  has_segments: bool = False
  scale: float = 1.0
  soft_cap: float | None = None
  interpret: bool = False
  lowering_semantics: str | None = None
  value_head_dim: int | None = None
  dropout_rate: float = 0.0
  score_mod: Any = None
  mask_mod: Any = None
  mod_slot: str | None = None
  valid_kv_len: int | None = None
  head_section: int | None = None

  @property
  def hv(self) -> int:
    """The padded value head dim."""
    return self.head_dim if self.value_head_dim is None else (
        self.value_head_dim)

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def need_positions(self) -> bool:
    return self.is_causal or self.window is not None

  @property
  def masks_padding_by_index(self) -> bool:
    """Whether the padded keys are masked by their index rather than by
    the padding's segment ids (which then do not travel)."""
    return (not self.has_segments and self.valid_kv_len is not None
            and self.valid_kv_len < self.kv_len)

  @property
  def masks_padding_causally(self) -> bool:
    """Whether the causal bound masks the padded keys as well: with
    positions by index and no window, a query sees key j iff j <= min(its
    index, the last real key's), one compare where two were (the padded
    keys are past every real one)."""
    return (self.masks_padding_by_index and self.positions_by_index
            and self.is_causal and self.window is None)

  @property
  def masked(self) -> bool:
    return (self.need_positions or self.has_segments
            or self.mask_mod is not None or self.masks_padding_by_index)

  @property
  def carries_pos(self) -> bool:
    """Whether the position slots travel (positions not made from
    indices, or `mod_slot`)."""
    return ((self.need_positions and not self.positions_by_index)
            or self.mod_slot == "positions")

  @property
  def carries_seg(self) -> bool:
    """Whether the segment-id slots travel (segment ids or `mod_slot`)."""
    return self.has_segments or self.mod_slot == "segments"

  @property
  def swizzle(self) -> int:
    """Bytes of the swizzle of the kernel's SMEM tiles: 128, or 64 with a
    32-row tile. A wgmma contracts over the rows of the tile that is its
    B operand (P V, dS K, dS^T Q), and must span whole swizzle widths of
    them; both operands of a wgmma share one swizzle, so it is one value
    per kernel."""
    rows = min(self.block_q, self.block_kv)
    return min(128, rows * jnp.dtype(self.dtype).itemsize)

  @property
  def num_meta(self) -> int:
    """Metadata arrays that travel with a tile (positions, segment ids)."""
    return int(self.carries_pos) + int(self.carries_seg)


# --------------------------------------------------------------------------
# The shared math, bound to a launch. The kernels work in base 2; register
# arrays cannot be reshaped to [rows, 1], so per-query vectors are broadcast
# explicitly (`online_softmax.queries_along`).
# --------------------------------------------------------------------------


def lse_for_kernel(lse: Array) -> Array:
  """The natural-log logsumexp as the backward kernels take it: base 2,
  +inf for rows without a visible key (`online_softmax.lse_for_probs`)."""
  return online_softmax.lse_for_probs(lse, base2=True)


def logits(spec: Spec, qk):
  """(s in base 2, soft-capped natural logits or None) of a qk tile."""
  return online_softmax.logits(
      qk, scale=spec.scale, cap=spec.soft_cap, base2=True)


def flex_logits(spec: Spec, ops, qk, r, *, batch, head, q0, kv0, q_axis,
                grad=False, args=True):
  """(s in base 2, capped logits, score_mod pullback or None) of a qk
  tile: `logits` with the call's score_mod (`fused_mods`) applied to the
  natural logits, its pullback kept when `grad`.

  The tile's queries start at q0 along `q_axis` (1 in the transposed dK/dV
  tile), its keys at kv0. The per-(batch, head) values arrive broadcast to
  the tile in the wgmma layout, so their cotangents come back as tiles and
  are summed along the keys only (a [rows] vector per query).
  """
  mod = spec.score_mod
  if mod is None:
    return (*logits(spec, qk), None)
  s, capped = online_softmax.logits(qk, scale=spec.scale, cap=spec.soft_cap)
  shape, kv_axis = s.shape, 1 - q_axis
  q_idx, kv_idx = _tile_indices(ops, mod, shape, q0, kv0, q_axis)
  values = _program_values(ops, shape, mod, r.residuals[:len(mod.residuals)],
                           batch, head)
  pullback = None
  if grad:
    s, pullback = mod.tile_vjp(
        values, q_idx=q_idx, kv_idx=kv_idx, score=s, args=args,
        reduce=lambda d: d.sum(axis=kv_axis))
  else:
    s = mod.tile(values, q_idx=q_idx, kv_idx=kv_idx, score=s)
  return s * online_softmax.LOG2_E, capped, pullback


def _tile_indices(ops, mod, shape, q0, kv0, q_axis):
  """The query and key index of every element of a tile whose queries
  start at q0 along `q_axis`, its keys at kv0: those `mod`'s tile part
  reads (`fused_mods.FusedMod.tile_indices`), None for the others (an
  unused index tile fails layout inference)."""
  def index(start, axis):
    return lax.broadcast_in_dim(
        start + ops.iota_vector(shape[axis], axis), shape, (axis,))

  wanted = mod.tile_indices
  return (index(q0, q_axis) if "q_idx" in wanted else None,
          index(kv0, 1 - q_axis) if "kv_idx" in wanted else None)


def _program_value(ops, shape, res, ref, batch, head):
  """A per-(batch, head) value [Bm, Hm] broadcast to a tile (booleans
  travel as int32)."""
  x = ref[batch if res.batch else 0, head if res.head else 0]
  if res.dtype == jnp.bool_:
    return ops.full(shape, x, jnp.int32) != 0
  return ops.full(shape, x, res.dtype)


def _program_values(ops, shape, mod, refs, batch, head):
  return [_program_value(ops, shape, res, ref, batch, head)
          for res, ref in zip(mod.residuals, refs)]


def index_mask_tile(spec: Spec, ops, r, shape, q_meta, kv_meta, *, batch,
                    head, q0, kv0, q_axis):
  """The mask of a tile (bool, `shape`) beyond `masking.visible`'s: the
  call's mask_mod, and the padded keys where they are masked by index
  (`Spec.masks_padding_by_index`) and not by the causal bound
  (`Spec.masks_padding_causally`, `apply_mask`); None without either.

  q_meta / kv_meta are the tile's (positions, segment ids) vectors
  (`load_meta`); the `Spec.mod_slot` one carries the mask_mod's per-query /
  per-key value.
  """
  mod = spec.mask_mod
  real_keys = None
  if spec.masks_padding_by_index and not spec.masks_padding_causally:
    kv_axis = 1 - q_axis
    keys = kv0 + ops.iota_vector(shape[kv_axis], kv_axis)
    real_keys = lax.broadcast_in_dim(keys < spec.valid_kv_len, shape,
                                     (kv_axis,))
  if mod is None:
    return real_keys
  slot = int(spec.mod_slot == "segments")
  q_idx, kv_idx = _tile_indices(ops, mod, shape, q0, kv0, q_axis)
  refs = iter(r.residuals[len(spec.score_mod.residuals)
                          if spec.score_mod is not None else 0:])
  values = []
  for res in mod.residuals:
    if res.level == fused_mods.Level.PROGRAM:
      values.append(_program_value(ops, shape, res, next(refs), batch, head))
      continue
    row = res.level == fused_mods.Level.ROW
    vec = (q_meta if row else kv_meta)[slot]
    x = lax.broadcast_in_dim(vec, shape, (q_axis if row else 1 - q_axis,))
    values.append(x != 0 if res.dtype == jnp.bool_ else x)
  visible = mod.tile(values, q_idx=q_idx, kv_idx=kv_idx, shape=shape)
  if real_keys is None:
    return visible
  return jnp.logical_and(visible, real_keys)


def logits_grad(spec: Spec, ds, capped):
  """Chains dS (w.r.t. the natural logits) back to the raw q.k products,
  all but the logit scale: the kernels multiply their dQ and dK sums by
  it once (`scale_grad`) rather than every dS element (one multiply an
  element fewer on the backward's dS chain)."""
  return online_softmax.logits_grad(ds, capped, cap=spec.soft_cap)


def scale_grad(spec: Spec, total):
  """A dQ or dK sum of `logits_grad`'s dS products times the logit
  scale."""
  return total if spec.scale == 1.0 else total * spec.scale


def apply_mask(spec: Spec, s, axis, q_pos, q_seg, kv_pos, kv_seg,
               mod=None):
  """Masks a logit tile by `masking.visible` and `mod` (`index_mask_tile`,
  or None), and the padded keys where the causal bound masks them
  (`Spec.masks_padding_causally`); axis indexes queries (0, or 1 in the
  transposed orientation of the dK/dV kernel)."""

  def along(x, a):
    return None if x is None else lax.broadcast_in_dim(x, s.shape, (a,))

  # The slots may carry a mask_mod's values instead (`Spec.mod_slot`).
  positions, segments = spec.need_positions, spec.has_segments
  if spec.masks_padding_causally:
    q_pos = jnp.minimum(q_pos, spec.valid_kv_len - 1)
  visible = masking.visible(
      is_causal=spec.is_causal,
      window=spec.window,
      q_pos=along(q_pos, axis) if positions else None,
      kv_pos=along(kv_pos, 1 - axis) if positions else None,
      q_seg=along(q_seg, axis) if segments else None,
      kv_seg=along(kv_seg, 1 - axis) if segments else None,
  )
  if mod is not None:
    visible = mod if visible is None else jnp.logical_and(visible, mod)
  return online_softmax.apply_mask(s, visible)


# --------------------------------------------------------------------------
# The shared skeleton: units of work, producer loop.
# --------------------------------------------------------------------------


# L2 bytes a causal forward's head section may stream: FlashAttention-3's
# budget (32 MiB of the 50 MiB L2 of an H100 or H200), so that a section's
# K/V are read from HBM about once.
L2_SECTION_BYTES = 32 * 1024 * 1024


def default_head_section(bytes_per_pair: int) -> int:
  """The (batch, head) pairs of a causal schedule's head section
  (`Units`): as many as stream `L2_SECTION_BYTES` (4 at T = 16k, H = 128,
  bfloat16, the forward), at least 1."""
  return max(1, L2_SECTION_BYTES // max(1, bytes_per_pair))


# Candidate head-group sizes of a wave-dealt balanced `Units` schedule.
_GROUPS = (8, 12, 16, 20, 24, 28, 32, 40, 48)


def _busiest_over_mean(pairs, rows, num_ctas, group) -> float:
  """The busiest CTA's work over the mean under `Units`' wave dealing
  (rounded, so that near ties go to the smaller group), for units whose
  k-th visited row tile has rows - k tiles of work (causal)."""
  u = np.arange(pairs * rows)
  per_group = group * rows
  g, w = u // per_group, u % per_group
  size = np.minimum(group, pairs - g * group)
  work = rows - w // size
  wave, pos = u // num_ctas, u % num_ctas
  cta = np.where(wave % 2 == 1, num_ctas - 1 - pos, pos)
  per_cta = np.bincount(cta, weights=work, minlength=num_ctas)
  return round(float(per_cta.max() / per_cta.mean()), 3)


@functools.lru_cache(maxsize=64)
def _lpt_table(pairs: int, rows: int, num_ctas: int, section: int
               ) -> np.ndarray:
  """The balanced dealing of causal units (`Units`), as a table.

  Units go section by section (`section` (batch, head) pairs each), longest
  first within a section (the k-th visited row tile of a pair has rows - k
  tiles of work), each to the CTA with the least work so far (the longest
  processing time first rule, which FlashAttention-3 applies at run time).

  Returns:
    int32 [num_ctas, 1 + most]: per CTA its unit count, then its units in
    order, each as pair * rows + k (k: the visit index).
  """
  loads = [(0, c) for c in range(num_ctas)]
  dealt = [[] for _ in range(num_ctas)]
  for first in range(0, pairs, section):
    members = range(first, min(pairs, first + section))
    for k in range(rows):
      for pair in members:
        load, cta = heapq.heappop(loads)
        dealt[cta].append(pair * rows + k)
        heapq.heappush(loads, (load + rows - k, cta))
  table = np.zeros((num_ctas, 1 + max(len(d) for d in dealt)), np.int32)
  for cta, units in enumerate(dealt):
    table[cta, 0] = len(units)
    table[cta, 1:1 + len(units)] = units
  return table


class Units:
  """Static assignment of units of work to persistent CTAs.

  A unit is (batch, head, row tile) with `rows` row tiles per batch x head.
  Units of equal length (no causal masking) go round-robin in (batch, head)
  major order: the CTAs running at once share a few heads' K/V in L2.

  Causal units grow (forward, dQ: row tile i sees i + 1 key tiles) or shrink
  (dK/dV) with the row tile, and in that order a CTA whose stride through
  the list is nearly a multiple of `rows` draws mostly long or mostly short
  units: with 132 CTAs and 128 row tiles (T = 16384) the busiest CTA has
  1.6x the mean work, and the kernel waits for it. `balance` deals them
  longest first in head sections of `section` (batch, head) pairs, so that
  the CTAs running at once stream the K/V of one section (L2-sized,
  `default_head_section`), in one of two ways:

  * `table` (the forward): from a table (`_lpt_table`), each unit to the
    least loaded CTA; the busiest CTA is then within a few percent of the
    mean at any section size. The table is a kernel operand (`launch`),
    read through `bind`.
  * waves (the backward kernels, where a table's addressing costs
    registers ptxas then spills: the fused dK/dV kernel's three
    accumulators, the dQ kernel at H = 256): by arithmetic, dealing every
    other wave of CTAs in reverse order (boustrophedon), which pairs a
    CTA's longer units with shorter ones.
    It balances only larger sections: without a `section`, the one of
    `_GROUPS` (8 to 48 pairs) whose dealing, simulated on the causal work
    model, is most even.

  tests/test_mosaic_gpu.py::test_balanced_schedule holds the busiest CTA
  within 6% of the mean.
  """

  def __init__(self, batch, heads, rows, num_ctas, *, balance=False,
               reverse=False, section=None, table=True):
    """`reverse`: row tiles last-first (the longest first when they grow).
    `section`: pairs per head section of a balanced dealing (None: all,
    or with waves the most even of `_GROUPS`). `table`: deal from a table
    rather than in waves."""
    self.batch, self.heads, self.rows = batch, heads, rows
    self.total = batch * heads * rows
    self.num_ctas = num_ctas
    self.balance = balance
    self.reverse = reverse
    pairs = batch * heads
    self.table = self.section = None
    if balance and table:
      self.section = min(pairs, section or pairs)
      self.table = _lpt_table(pairs, rows, num_ctas, self.section)
    elif balance:
      self.section = min(pairs, section) if section else min(
          sorted({min(pairs, g) for g in _GROUPS}),
          key=lambda g: (_busiest_over_mean(pairs, rows, num_ctas, g), g))
    self._table_ref = None

  def bind(self, table_ref) -> Units:
    """These units reading their table from `table_ref` (in a kernel)."""
    bound = copy.copy(self)
    bound._table_ref = table_ref
    return bound

  def _entry(self, cta, i):
    if self._table_ref is not None:
      return self._table_ref[cta, i]
    return jnp.asarray(self.table)[cta, i]

  def count(self, cta):
    """Units handled by `cta` (traced)."""
    n = self.num_ctas
    if self.table is not None:
      return self._entry(cta, 0)
    if not self.balance:
      return (self.total - cta + n - 1) // n
    waves, rest = divmod(self.total, n)
    # The last, partial wave is dealt forward after an even number of full
    # waves, else backward.
    last = (cta < rest) if waves % 2 == 0 else (cta >= n - rest)
    return waves + jnp.asarray(last, jnp.int32)

  def decode(self, cta, t):
    """(b, head, row tile) of this CTA's t-th unit."""
    n = self.num_ctas
    if self.table is not None:
      u = self._entry(cta, 1 + t)
      row = rem(u, self.rows)
      bh = div(u, self.rows)
    elif not self.balance:
      u = cta + t * n
      row = rem(u, self.rows)
      bh = div(u, self.rows)
    else:
      backward = rem(t, 2) == 1
      u = t * n + jnp.where(backward, n - 1 - cta, cta)
      per_section = self.section * self.rows
      g = div(u, per_section)
      w = rem(u, per_section)
      # The last section may hold fewer pairs.
      size = jnp.minimum(self.section,
                         self.batch * self.heads - g * self.section)
      row = lax.div(w, size)
      bh = g * self.section + lax.rem(w, size)
    head = rem(bh, self.heads)
    b = div(bh, self.heads)
    if self.reverse:
      row = self.rows - 1 - row
    return b, head, row


def produce(*, units, cta, reps, sched_ref, groups, stages):
  """The producer warpgroup: streams every step's tiles into the ring.

  Args:
    units: the `Units` of the kernel.
    cta: this CTA's index.
    reps: steps are repeated `reps` times per unit (the GQA group of dK/dV).
    sched_ref: int32 [B, rows, 2 + 2 * consumers]; [ulo, uhi) is the union
      of the consumers' tile ranges.
    groups: list of (loaded barriers, consumed barriers, copies) where
      copies(b, head, rep, j, slot) returns [(gmem view, smem view)].
    stages: ring depth.
  """

  def unit(t, base):
    b, head, row = units.decode(cta, t)
    ulo = sched_ref[b, row, 0]
    uhi = sched_ref[b, row, 1]
    length = uhi - ulo

    def rep(r, base):
      def load(j, _):
        step = base + j - ulo
        slot = rem(step, stages)
        for loaded, consumed, copies in groups:
          # The step's views first: a paged cache's come from its block
          # table, a load from global memory that then runs while the
          # producer waits for the slot, not after it.
          views = copies(b, head, r, j, slot)

          # A slot is refilled only once every consumer released it. The
          # consumers read some of it with plain shared-memory loads (the
          # generic proxy: positions, segment ids, lse, delta) and the refill
          # writes it through the TMA (the async proxy): the proxy fence
          # orders the refill after those reads, which the release barrier
          # alone orders only within the generic proxy.
          @pl.when(step >= stages)
          def _(consumed=consumed):
            plgpu.barrier_wait(consumed.at[slot])
            plgpu.commit_smem()

          for src, dst in views:
            plgpu.copy_gmem_to_smem(src, dst, loaded.at[slot])

      lax.fori_loop(ulo, uhi, load, None)
      return base + length

    return lax.fori_loop(0, reps, rep, base)

  total = lax.fori_loop(0, units.count(cta), unit, jnp.int32(0))

  # Drain: observe the release of the last `stages` steps, so that every
  # phase of every consumed barrier is awaited exactly once.
  def drain(step, _):
    slot = rem(step, stages)
    for _, consumed, _ in groups:
      plgpu.barrier_wait(consumed.at[slot])

  lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)


def stationary_in_step(spec: Spec, wg):
  """The index of a consumer's stationary tiles, to address them in a step.

  A stationary tile's address is the same in every step of a unit, so the
  compiler hoists the wgmma descriptors built from it (one 64-bit descriptor
  per 16-wide slice of the contraction: 32 registers for a 256-wide head)
  out of the step loop, where they stay live beside the accumulators; at
  H = 256 that spilled. Passed through an optimization barrier in each step,
  the index is opaque there and the descriptors are rebuilt in the step
  from a few integer operations instead.

  jax 0.10's warpgroup lowering takes no scalar through a barrier; a kernel
  lowered that way (an explicit `lowering_semantics="warpgroup"` there)
  keeps the hoisted descriptors.
  """
  if spec.lowering_semantics == "warpgroup" and jax.__version_info__ < (0, 11):
    return wg
  # A static index goes in as int32: under jax_enable_x64 a Python int is
  # int64, which Mosaic GPU's barrier does not take.
  return lax.optimization_barrier(
      np.int32(wg) if isinstance(wg, int) else wg)


def phases(sched_ref, b, row, wg, step_fn, carry, masked: bool, gate=None,
           start=None):
  """Runs step_fn over [ulo, uhi) as masked / unmasked / masked phases.

  The ranges come from the tile classification of `masking.classify_blocks`
  (`mosaic_gpu.schedule`), so causal, window, padding and sorted segments
  all shrink the loops. `gate`: an int32 scalar, 0 or 1; with 0 every loop
  runs zero trips (so that a kernel can hold two versions of its loop and
  run the one its data needs), None: 1. `start`: the first tile, in [ulo,
  uhi] (None: ulo), for a caller that ran the ones before it itself.
  """
  ulo = sched_ref[b, row, 0] if start is None else start
  uhi = sched_ref[b, row, 1]
  if masked:
    flo = sched_ref[b, row, 2 + 2 * wg]
    fhi = sched_ref[b, row, 3 + 2 * wg]
    if start is not None:  # The first runs may end before it.
      flo = jnp.maximum(flo, start)
      fhi = jnp.maximum(fhi, flo)
    runs = ((ulo, flo, True), (flo, fhi, False), (fhi, uhi, True))
  else:
    runs = ((ulo, uhi, False),)
  for lo, hi, masked_run in runs:
    if gate is not None:
      hi = lo + (hi - lo) * gate
    carry = lax.fori_loop(
        lo, hi, functools.partial(step_fn, masked=masked_run), carry)
  return carry


def q_units(spec: Spec, *, table: bool) -> Units:
  """The units of the Q-stationary kernels: a (batch, query head) pair and
  a tile of `consumers` x block_q rows; causal visits the longest first
  (`table`: `Units`' dealing)."""
  return Units(
      spec.batch, spec.num_heads, spec.q_len // (spec.consumers * spec.block_q),
      spec.num_ctas, balance=spec.is_causal, reverse=spec.is_causal,
      section=spec.head_section, table=table)


def kv_producer(spec: Spec):
  """`launch`'s producer_groups of the Q-stationary kernels (forward, dQ):
  K (+ key positions / segment ids), then V.

  Their inputs start (q, k, v) and end (key positions, key segment ids,
  schedule); their SMEM ends with `kv_rings` and their barriers 1..4 are
  `kv_barriers`. Query head n reads K/V head n // group (GQA without
  repeating K/V).
  """
  bk = spec.block_kv

  def groups(r: Refs):
    k_ref, v_ref = r.inputs[1:3]
    kpos_ref, kseg_ref = r.inputs[-3:-1]
    k_smem, v_smem, kmeta_smem = r.smem[-3:]
    k_bar, v_bar, k_free, v_free = r.barriers[1:5]

    def k_copies(b, n, rep, j, slot):
      del rep
      cols = pl.ds(j * bk, bk)
      return [
          (k_ref.at[b, cols, n // spec.group], k_smem.at[slot]),
          *meta_copies(spec, (kpos_ref, kseg_ref),
                       meta_at(spec, kmeta_smem, slot), b, cols),
      ]

    def v_copies(b, n, rep, j, slot):
      del rep
      cols = pl.ds(j * bk, bk)
      return [(v_ref.at[b, cols, n // spec.group], v_smem.at[slot])]

    return [(k_bar, k_free, k_copies), (v_bar, v_free, v_copies)]

  return groups


def kv_rings(spec: Spec, ops: gpu_ops.Ops):
  """The SMEM types that `kv_producer` fills: the K and V rings and the
  key metadata rings (`meta_smem`), the last three of a Q-stationary
  kernel's SMEM."""
  bk, h, stages = spec.block_kv, spec.head_dim, spec.stages
  return (
      ops.smem((stages, bk, h), spec.dtype, True),  # K ring
      ops.smem((stages, bk, spec.hv), spec.dtype, True),  # V ring
      meta_smem(spec, (stages, bk)),  # key positions / segment ids rings
  )


def meta_smem(spec: Spec, shape):
  """SMEM for the metadata of tiles of `shape`: an int32 buffer for each of
  the positions and segment ids the spec carries, none for the others
  (Mosaic GPU aligns every SMEM buffer to 1 KiB, so even an unused one
  would cost that much). `meta_at` names them."""
  return tuple(plgpu.SMEM(shape, jnp.int32) for _ in range(spec.num_meta))


def meta_at(spec: Spec, refs, index=None):
  """(positions, segment ids) views of `meta_smem`'s buffers `refs` at
  `index` (None: whole buffers), None for those the spec does not carry."""
  left = iter(refs)

  def take(carried):
    if not carried:
      return None
    ref = next(left)
    return ref if index is None else ref.at[index]

  return take(spec.carries_pos), take(spec.carries_seg)


def kv_barriers(spec: Spec):
  """The barriers of `kv_producer` (1..4 of a Q-stationary kernel's)."""
  return (
      gpu_ops.barrier(spec.stages, 1 + spec.num_meta),  # K (+ metadata).
      gpu_ops.barrier(spec.stages),  # V loaded.
      gpu_ops.barrier(spec.stages, spec.consumers),  # K slot released.
      gpu_ops.barrier(spec.stages, spec.consumers),  # V slot released.
  )


def meta_copies(spec: Spec, refs, dsts, b, rows):
  """Copies of the positions / segment ids (those the spec uses) of `rows`
  of batch b: refs and dsts are (positions, segment ids) pairs."""
  (pos_ref, seg_ref), (pos_dst, seg_dst) = refs, dsts
  out = []
  if spec.carries_pos:
    out.append((pos_ref.at[b, rows], pos_dst))
  if spec.carries_seg:
    out.append((seg_ref.at[b, rows], seg_dst))
  return out


def apply_dropout(spec: Spec, ops: gpu_ops.Ops, x, seed_ref, *, batch, head,
                  q_start, kv_start, q_axis):
  """x times its attention-dropout factor (0 or 1 / (1 - rate)): x is a
  float32 tile in the wgmma layout whose first query / key are q_start /
  kv_start, its query axis `q_axis` (1 in the transposed dK/dV kernel).

  The query side of the hash is computed once per row vector
  (`dropout.row_state`), the key index is mixed in per element; a select
  instead of a product with a factor tile keeps one float32 tile fewer
  live.
  """
  shape, kv_axis = x.shape, 1 - q_axis
  q_index = q_start + ops.iota_vector(shape[q_axis], q_axis)
  kv_index = kv_start + ops.iota_vector(shape[kv_axis], kv_axis)
  state = dropout.row_state(seed_ref[0], batch, head, q_index)
  keep = dropout.keep_in_row(
      lax.broadcast_in_dim(state, shape, (q_axis,)), spec.dropout_rate,
      lax.broadcast_in_dim(kv_index, shape, (kv_axis,)))
  return jnp.where(keep, x * (1.0 / (1.0 - spec.dropout_rate)), 0.0)


def load_meta(spec: Spec, ops: gpu_ops.Ops, pos_ref, seg_ref, axis, *,
              first, size):
  """(positions, segment ids) vectors of the `size` tokens from index
  `first` on, laid out along `axis` of a wgmma tile; None for those the
  spec does not use. Positions by index (`Spec.positions_by_index`) are
  the indices themselves."""
  pos = seg = None
  if spec.need_positions and spec.positions_by_index:
    pos = first + ops.iota_vector(size, axis)
  elif spec.carries_pos:
    pos = ops.load_vector(pos_ref, axis)
  if spec.carries_seg:
    seg = ops.load_vector(seg_ref, axis)
  return pos, seg


# --------------------------------------------------------------------------
# The warp-specialised launch.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Refs:
  """What a kernel body sees: GMEM input refs (in operand order, the
  schedule last), GMEM output refs, SMEM and barrier refs (in the order the
  kernel declared them), this CTA's index and this warpgroup's, and the
  uint32 [1] dropout seed (None without dropout), the score_mod's
  per-(batch, head) values [Bm, Hm] (`Spec.score_mod`), and the launch's
  `Units`, bound to their table where they have one."""

  inputs: tuple
  outputs: tuple
  smem: tuple
  barriers: tuple
  cta: Any
  wg: Any
  seed: Any = None
  residuals: tuple = ()
  units: Any = None


def load_stationary(copies, bar):
  """Loads a consumer's stationary tiles [(gmem view, smem view)] for its
  next unit, once the previous unit's output stores have read that SMEM."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for src, dst in copies:
    plgpu.copy_gmem_to_smem(src, dst, bar)
  plgpu.barrier_wait(bar)


def store(copies):
  """Stores a consumer's results [(smem view, gmem view)] as one commit
  group (`load_stationary` waits for it to be read)."""
  plgpu.commit_smem()
  for src, dst in copies:
    plgpu.copy_smem_to_gmem(src, dst, commit_group=False)
  plgpu.commit_smem_to_gmem_group()


def waits_on_grid() -> bool:
  """Whether this jax launches a Mosaic GPU kernel that waits on its grid
  dependency with programmatic dependent launch (PDL): jax >= 0.11 marks
  such a kernel `mosaic_gpu.uses_pdl`, which XLA launches with the
  attribute that lets it start before the previous kernel in the stream
  has completed."""
  return (jax.__version_info__ >= (0, 11)
          and hasattr(plgpu, "griddepcontrol_wait"))


def depend_on_grid(ops) -> None:
  """A PDL kernel's first act, in every thread: wait until the previous
  kernel in the stream has completed and its writes are visible, then let
  the next one launch (whose CTAs wait in turn, on the SMs this grid
  leaves free). No-ops interpreted, and where `waits_on_grid` is False."""
  if ops.interpret or not waits_on_grid():
    return
  plgpu.griddepcontrol_wait()
  plgpu.griddepcontrol_launch_dependents()


def launch(spec: Spec, *, name, units, reps, operands, out_types, smem_types,
           barrier_types, unit, producer_groups, seed=None, residuals=(),
           accumulators=(), cross_warp_reductions=True, schedule=None,
           static_consumers=False, pdl=False):
  """Builds and runs a persistent warp-specialised kernel.

  Warpgroups 0 .. consumers - 1 each run `unit` over this CTA's units of
  work; warpgroup `consumers` is the producer, which streams
  `producer_groups` into the ring.

  Args:
    spec: launch parameters.
    name: the kernel's symbol (its ptxas entry is `<name>_mosaic_gpu_kernel`,
      so profiles and compile reports tell the kernels apart).
    units: the `Units` the CTAs walk.
    reps: producer steps are repeated `reps` times per unit (`produce`).
    operands: the GMEM inputs; the last is the int32 schedule (`phases`).
    out_types: tuple of the outputs' ShapeDtypeStructs.
    smem_types: tuple of SMEM scratch types.
    barrier_types: tuple of barrier types.
    unit: unit(refs, t, base) -> base: a consumer's t-th unit; `base` counts
      the ring steps consumed so far.
    producer_groups: producer_groups(refs) -> the `groups` of `produce`.
    seed: the uint32 [1] dropout seed, or None without dropout.
    residuals: the score_mod's [Bm, Hm] values (`Spec.score_mod`).
    accumulators: arrays the kernel updates in place, e.g. with TMA
      reduce-adds: each is an operand and also an output after
      `out_types` that shares its buffer (compiled kernels only,
      `can_accumulate`); the body writes through the output ref.
    cross_warp_reductions: False where every reduction of the kernel runs
      within a warp (the per-row ones of a [64 k, N] wgmma tile, whose warps
      own 16 rows each): `kernel_kwargs`.
    schedule: None (the last operand is the schedule), or schedule(refs)
      -> what the producer reads as one (`produce`'s sched_ref: indexed
      [b, row, i]), for a kernel that computes its tile ranges itself.
    static_consumers: whether each consumer runs a copy of `unit` of its
      own, with `Refs.wg` its index as a Python int (for shared memory a
      consumer owns as separate refs, such as a `plgpu.RefUnion` each),
      instead of one copy with the traced warpgroup index.
    pdl: the kernel starts with `depend_on_grid`, so that its dependent
      (a PDL kernel) launches while it runs.
  """
  ops = ops_for(spec)
  nc, num_inputs = spec.consumers, len(operands)
  seeds = () if seed is None else (seed,)
  tables = () if units.table is None else (jnp.asarray(units.table),)
  operands = (*operands, *seeds, *residuals, *tables, *accumulators)
  first_table = num_inputs + len(seeds) + len(residuals)
  first_accumulator = len(operands) - len(accumulators)

  def body(*refs):
    if pdl:
      depend_on_grid(ops)
    r = Refs(
        inputs=refs[:num_inputs], outputs=refs[len(operands):-2],
        smem=refs[-2], barriers=refs[-1],
        cta=lax.axis_index("cta"), wg=lax.axis_index("wg"),
        seed=None if seed is None else refs[num_inputs],
        residuals=refs[num_inputs + len(seeds):first_table],
        units=units.bind(refs[first_table]) if tables else units)

    def consume(r):
      ops.set_max_registers(_consumer_registers(nc), "increase")
      lax.fori_loop(
          0, r.units.count(r.cta), functools.partial(unit, r), jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    if static_consumers:
      for c in range(nc):
        pl.when(r.wg == c)(functools.partial(
            consume, dataclasses.replace(r, wg=c)))
    else:
      pl.when(r.wg < nc)(functools.partial(consume, r))

    @pl.when(r.wg == nc)
    def _producer():
      ops.set_max_registers(_PRODUCER_REGISTERS, "decrease")
      produce(units=r.units, cta=r.cta, reps=reps,
              sched_ref=r.inputs[-1] if schedule is None else schedule(r),
              groups=producer_groups(r), stages=spec.stages)

  mesh = dict(grid=(spec.num_ctas,), grid_names=("cta",),
              num_threads=nc + 1, thread_name="wg")
  kwargs = kernel_kwargs(
      out_types=out_types, scratch=[smem_types, barrier_types],
      interpret=interpret_params() if spec.interpret else None,
      lowering_semantics=spec.lowering_semantics,
      cross_warp_reductions=cross_warp_reductions)
  if accumulators:
    out_types = (*out_types, *(jax.ShapeDtypeStruct(a.shape, a.dtype)
                               for a in accumulators))
    first_out = len(out_types) - len(accumulators)
    call = _kernel_aliased(
        body, name=name, mesh=mesh, out_types=out_types,
        scratch=[smem_types, barrier_types],
        compiler_params=kwargs["compiler_params"],
        aliases={first_accumulator + i: first_out + i
                 for i in range(len(accumulators))})
  else:
    call = plgpu.kernel(body, kernel_name=name, **mesh, **kwargs)
  return call(*operands)


def _mpmd_map():
  """jax's mesh-kernel builder under `plgpu.kernel`, which (unlike it)
  takes input/output aliases; None where this jax has none."""
  try:
    mpmd = importlib.import_module("jax._src.pallas.mpmd")
  except ImportError:
    return None
  build = getattr(mpmd, "_mpmd_map", None)
  if build is None or "input_output_aliases" not in (
      inspect.signature(build).parameters):
    return None
  return build


def can_accumulate() -> bool:
  """Whether compiled kernels can update an operand in place
  (`launch`'s `accumulators`)."""
  return _mpmd_map() is not None


def _kernel_aliased(body, *, name, mesh, out_types, scratch,
                    compiler_params, aliases):
  """`plgpu.kernel` whose outputs `aliases` ({operand: output}) share their
  operand's buffer, so the kernel adds into it in place. plgpu.kernel
  takes no aliases; mutable-array operands (`jax.new_ref`) would alias
  through its discharge, which renames the kernel. Compiled kernels only
  (interpreted ones write their partial results to outputs of their own)."""
  build = _mpmd_map()
  if build is None:
    raise NotImplementedError(
        f"this jax ({jax.__version__}) builds no Mosaic GPU kernel with "
        "aliased outputs.")

  def with_scratch(*refs):
    # What plgpu.kernel does with its scratch types: allocated once for
    # all warpgroups.
    pl.run_scoped(functools.partial(body, *refs), *scratch,
                  collective_axes=mesh["thread_name"])

  return build([(plgpu.Mesh(kernel_name=name, **mesh), with_scratch)],
               out_types, input_output_aliases=aliases,
               compiler_params=compiler_params, name=name)
