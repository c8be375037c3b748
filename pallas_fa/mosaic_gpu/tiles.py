"""Tiling of the `mosaic_gpu` kernels: the config class, the shared-memory
model and the heuristic.

`mosaic_gpu` re-exports everything public here; `mosaic_gpu.
default_block_sizes` prefers a tuned record (`pallas_fa.tuning`) over
`heuristic_block_sizes`. The register-bound choices of the heuristic were
read off ptxas (`scripts/compile_check.py`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_fa import layout

# Sequences are padded to multiples of 64 rows (one warpgroup's wgmma M) and
# tiles are never cut to fit short ones; head dims are padded to 64 (128-byte
# TMA rows).
ALIGN = layout.Alignment(rows=64, head_dim=64)

# Shared memory per CTA on sm90 (H100 / H200), minus a margin: the estimate
# below counts the buffers only (each 1 KiB-aligned, `SMEM_ALIGNMENT`), and
# the compiled kernels add their barriers and, those with reductions, 2 KiB
# of reduction scratch (compile_check.py).
SHARED_MEMORY_BYTES = 227 * 1024 - 8 * 1024
# What a kernel may have (the sm90 opt-in limit): buffers past it can never
# compile, whatever the barriers add.
SHARED_MEMORY_LIMIT = 227 * 1024
# Mosaic GPU starts every SMEM buffer on a 1 KiB boundary.
SMEM_ALIGNMENT = 1024

# Values of `MosaicGpuBlockSizes.lowering_semantics` (None: jax's default).
LOWERING_SEMANTICS = (None, "lane", "warpgroup")

# Values of `MosaicGpuBlockSizes.backward`.
BACKWARDS = ("split", "fused")
# Values of `MosaicGpuBlockSizes.dq_split` (`dq_columns`).
DQ_SPLITS = ("columns", "keys")
# Values of `MosaicGpuBlockSizes.dq_swizzle` (bytes).
DQ_SWIZZLES = (32, 64, 128)


# The tiles that are a wgmma's M (stationary rows per consumer) and those that
# are the N of the logit tiles (streamed).
_STATIONARY = ("block_q", "block_q_dq", "block_kv_dkv")
_STREAMED = ("block_kv", "block_kv_dq", "block_q_dkv")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicGpuBlockSizes:
  """Tiling of the `mosaic_gpu` kernels.

  Each kernel has a stationary tile of rows per consumer warpgroup (the
  wgmma M: block_q, block_q_dq, block_kv_dkv), a multiple of 64, and a
  streamed tile (the wgmma N of the logits: block_kv, block_kv_dq,
  block_q_dkv), 32 or a multiple of 64; both at most 256. A 32-row streamed tile
  halves the float32 logit tiles a thread holds (16 registers each instead
  of 32), at the price of a 64-byte SMEM swizzle.

  Attributes:
    block_q: forward: query rows per consumer warpgroup.
    block_kv: forward: keys per streamed K/V tile.
    num_stages: forward: depth of the K/V shared-memory ring.
    num_consumers: forward: consumer warpgroups per CTA (1 or 2).
    pingpong: forward: alternate the two consumers on the tensor cores
      (FlashAttention-3 §3.2); needs num_consumers == 2. Off, the two run
      free, each as far ahead as the ring lets it: their softmaxes may
      then overlap, which the turns forbid (one consumer's softmax runs
      under the other's products). That matters where a softmax outlasts
      the other consumer's products, as in the float8 forward, whose
      products take half bf16's time; timed against ping-pong in the next
      GPU run.
    intra_overlap: forward: software-pipeline each consumer's key loop
      (FlashAttention-3 §3.2, Algorithm 2): Q K_j^T and P_{j-1} V_{j-1}
      are issued together and the softmax of tile j runs while the
      P_{j-1} V_{j-1} product is still on the tensor cores, instead of
      draining P V before the next Q K^T. Composes with `pingpong`. It
      costs registers: P_{j-1} stays live beside P_j until its product
      completes, block_kv / 4 more a thread (at H = 128, block_kv = 128:
      about 193 of a consumer's 240 instead of 154, no spill; with
      dropout's hashing beside it at H = 128 the forward spills 12 bytes,
      not a candidate there). Not a default until a GPU run times it. The
      float8 forward has it too (`forward.pipelined_steps`).
    poly_exp2: forward (both dtypes): compute one 8-key column group in
      `poly_exp2` of each logit tile's exponentials with a cubic on the
      FMA pipe instead of MUFU.EX2 (`exp2`, FlashAttention-4's split:
      MUFU issues 16 a clock per SM, the FMA pipe 128); 1: all of them;
      0 (the default): none. Its relative error is below 9e-5. Not a
      default until a GPU run times it.
    float8_two_level: float8 forward: each key tile's P V into a fresh
      accumulator, added to the running float32 one (acc * alpha + P V,
      one FMA an element in place of the rescale's multiply) instead of
      accumulating every tile in the 8-bit wgmma's adder, which keeps
      fewer bits than float32 (the accumulation that FP8
      FlashAttention-3 needed at 128k-token contexts). 64 more registers
      a consumer thread at Hv = 128; not with `intra_overlap`. Not a
      default until a GPU run times it and the long-context test asks
      for it.
    block_q_dq: dQ kernel: query rows per consumer warpgroup.
    block_kv_dq: dQ kernel: keys per streamed tile.
    num_consumers_dq: dQ kernel: consumer warpgroups per CTA (1 or 2).
    block_q_dkv: dK/dV kernel: queries per streamed tile.
    block_kv_dkv: dK/dV kernel: key rows per consumer warpgroup.
    num_consumers_dkv: dK/dV kernel: consumer warpgroups per CTA (1 or 2).
    num_stages_bwd: depth of the backward rings.
    split_dkv: compute dV and dK in two passes, keeping one float32
      accumulator in registers instead of two (head dim 256).
    backward: "fused" (the default): one KV-stationary kernel computes dK,
      dV and dQ (5 tile products), adding each tile's dQ partial to a
      float32 dQ in global memory with a TMA reduce-add (FlashAttention-3's
      backward), so dQ's summation order, and its last bits, vary from run
      to run; 1.09x the split backward's speed on an H200 (bf16, H = 128,
      causal or not). "split": a dK/dV kernel and a dQ kernel, each tile's
      logits recomputed in both (7 tile products); bitwise reproducible.
      The fused kernel runs where it fits (padded head dims <= 128, <= 64
      with dropout, `block_q_dkv` a multiple of 64, `split_dkv` off, no
      score_mod whose values are differentiated) and no reproducible
      backward is asked for (`flash_attention(deterministic_backward=
      True)`, or XLA's `--xla_gpu_deterministic_ops`, which win over
      "fused"); other calls take the split path, so "fused" never refuses
      a call (`mosaic_gpu.fused_backward_applies`).
    dq_split: the fused backward's dQ with two consumers at a head dim
      whose halves are whole 64-column swizzle tiles (H = 128). "columns"
      (the default, FlashAttention-3's): each consumer multiplies both
      consumers' dS by its half of K's columns and reduce-adds a
      [block_q_dkv, H / 2] tile, so the two exchange dS through shared
      memory behind a barrier each step and run in lockstep. "keys": each
      consumer multiplies its own dS by its own K over every column and
      reduce-adds its own [block_q_dkv, H] partial: no exchange and no
      lockstep, at twice the reduce-add bytes into L2. Other head dims and
      one consumer always split by keys.
    dq_swizzle: the fused backward's float32 dQ staging tile's shared
      memory swizzle, in bytes (32, 64 or 128), which its TMA reduce-add
      reads. Every swizzle stores the wgmma accumulator without bank
      conflicts, but at 128 (the default) Mosaic GPU staggers the lanes'
      tiles with 32 selects a step, which 32 does not need (sm_90a, H =
      128: a consumer's step is 469 instructions at 128, 434 at 32); 32
      has the reduce-add read 32-byte rows instead of 128-byte ones.
    fused_overlap: the fused backward issues each step's dK += dS^T Q
      and stages (and exchanges) dS^T for dQ while that product runs,
      awaiting it with dQ's first product (`ops.mm_around`), instead of
      draining it first: 471 instructions a consumer step against 469,
      less one wgmma drain on the step's chain. jax 0.10 runs it in
      order. Not a default until a GPU run times it.
    fused_pipeline: the fused backward leaves each step's dQ product to
      the next step, which issues it ahead of its own S^T product and
      stages it and adds it to dQ while S^T runs (`ops.mm_sum_ahead`);
      dS^T is staged and exchanged while dK's product runs. The unit's
      last dQ follows its last step. Calls with segment ids or a
      mask_mod, and kernels compiled by jax 0.10, keep each step's dQ in
      the step (`dkv.pipelines_dq`). An alternative to `fused_overlap`;
      the default of a full call's heuristic tiles (1.057x the in-step
      order fwd+bwd on an H200, H = 128, T = 16384), not yet a causal
      one's.
    fused_softmax_overlap: the fused backward issues dP^T = V dO^T as
      soon as S^T has landed and computes P^T while it runs, then issues
      dV += P^T dO and computes dS^T while that runs (stored for dQ
      there), FlashAttention-3's order (`ops.mm_while`), and stages dS^T
      under dK's product as `fused_overlap` does. In the default order
      the exponentials precede dP^T's and dV's products (issued as a
      pair) and dS^T follows them, with no product in flight in either.
      Calls with a soft cap or a score_mod, and kernels compiled by jax
      0.10, keep the default order (`dkv.softmax_overlaps`). With
      `fused_pipeline` (a full call's default) each step runs both: dQ
      of the step before issued ahead of S^T, then this order (sm_90a, H
      = 128, full: 505 instructions a consumer step against 489 with the
      pipeline alone and 498 with this order alone, 0 spills; a causal
      kernel with both spills 48 B, with the pipeline alone 8). Not a
      default until a GPU run times it.
    head_section: causal schedules only: the (batch, head) pairs dealt
      together (`kernel.Units`), longest first across a section before the
      next one starts, so that the K/V (Q, dO) of one section stay in L2;
      None: for the forward kernel sized from the L2 cache and the key
      length (4 heads at S = 16k, H = 128), for the backward kernels the
      section their dealing balances best.
    num_ctas: persistent grid size; None = one CTA per SM (GPU) or 1
      (interpreter).
    interpret: run in the Mosaic GPU interpreter; None = exactly when the
      default backend is not a GPU.
    lowering_semantics: how Mosaic GPU lowers the kernels: "lane" (per
      thread), "warpgroup" (layouts inferred per warpgroup) or None, the
      installed jax's default (lane up to 0.10, warpgroup from 0.11).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  num_consumers: int = 2
  pingpong: bool = True
  intra_overlap: bool = False
  poly_exp2: int = 0
  float8_two_level: bool = False
  block_q_dq: int = 64
  block_kv_dq: int = 64
  num_consumers_dq: int = 2
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  num_consumers_dkv: int = 2
  num_stages_bwd: int = 2
  split_dkv: bool = False
  backward: str = "fused"
  dq_split: str = "columns"
  dq_swizzle: int = 128
  fused_overlap: bool = False
  fused_pipeline: bool = False
  fused_softmax_overlap: bool = False
  head_section: int | None = None
  num_ctas: int | None = None
  interpret: bool | None = None
  lowering_semantics: str | None = None

  def __post_init__(self):
    cls = type(self).__name__

    def is_int(x):
      return isinstance(x, int) and not isinstance(x, bool)

    for names, step in ((_STATIONARY, 64), (_STREAMED, 32)):
      for name in names:
        value = getattr(self, name)
        if not is_int(value) or value < step or value > 256 or value % step:
          raise ValueError(
              f"{cls}.{name} must be a multiple of {step} in [{step}, 256], "
              f"got {value!r}.")
    for name in _STREAMED:
      # A wgmma contracts over whole swizzle rows of its B operand: 64
      # 16-bit rows of 128 bytes, or 32 of a 32-row tile's 64 bytes.
      value = getattr(self, name)
      if value > 64 and value % 64:
        raise ValueError(
            f"{cls}.{name} must be 32 or a multiple of 64 (a matmul "
            f"contracts over whole 64-row swizzle tiles), got {value!r}.")
    for name in ("num_stages", "num_stages_bwd"):
      value = getattr(self, name)
      if not is_int(value) or not 1 <= value <= 8:
        raise ValueError(
            f"{cls}.{name} must be an int in [1, 8], got {value!r}.")
    for name in ("num_consumers", "num_consumers_dq", "num_consumers_dkv"):
      value = getattr(self, name)
      if value not in (1, 2) or not is_int(value):
        raise ValueError(f"{cls}.{name} must be 1 or 2, got {value!r}.")
    for name in ("pingpong", "intra_overlap", "float8_two_level",
                 "split_dkv", "fused_overlap", "fused_pipeline",
                 "fused_softmax_overlap"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(
            f"{cls}.{name} must be a bool, got {getattr(self, name)!r}.")
    if not is_int(self.poly_exp2) or not 0 <= self.poly_exp2 <= 16:
      raise ValueError(
          f"{cls}.poly_exp2 must be an int in [0, 16], got "
          f"{self.poly_exp2!r}.")
    if self.fused_overlap and self.fused_pipeline:
      raise ValueError(
          f"{cls}.fused_overlap and {cls}.fused_pipeline are alternatives "
          "(the pipeline stages dS^T under dK's product too); set one.")
    if self.float8_two_level and self.intra_overlap:
      raise ValueError(
          f"{cls}.float8_two_level is not implemented with intra_overlap "
          "(the pipelined loop accumulates P V in the wgmma).")
    if self.pingpong and self.num_consumers != 2:
      raise ValueError(
          f"{cls}.pingpong needs num_consumers == 2, got "
          f"num_consumers={self.num_consumers!r}.")
    if self.backward not in BACKWARDS:
      raise ValueError(
          f"{cls}.backward must be one of {BACKWARDS}, got "
          f"{self.backward!r}.")
    if self.dq_split not in DQ_SPLITS:
      raise ValueError(
          f"{cls}.dq_split must be one of {DQ_SPLITS}, got "
          f"{self.dq_split!r}.")
    if self.dq_swizzle not in DQ_SWIZZLES or not is_int(self.dq_swizzle):
      raise ValueError(
          f"{cls}.dq_swizzle must be one of {DQ_SWIZZLES}, got "
          f"{self.dq_swizzle!r}.")
    if self.head_section is not None and (
        not is_int(self.head_section) or self.head_section < 1):
      raise ValueError(
          f"{cls}.head_section must be None or a positive int, got "
          f"{self.head_section!r}.")
    if self.num_ctas is not None and (
        not is_int(self.num_ctas) or self.num_ctas < 1):
      raise ValueError(
          f"{cls}.num_ctas must be None or a positive int, got "
          f"{self.num_ctas!r}.")
    if self.lowering_semantics not in LOWERING_SEMANTICS:
      raise ValueError(
          f"{cls}.lowering_semantics must be one of "
          f"{LOWERING_SEMANTICS}, got {self.lowering_semantics!r}.")
    if self.interpret is not None and not isinstance(self.interpret, bool):
      raise ValueError(
          f"{cls}.interpret must be None or a bool, got "
          f"{self.interpret!r}.")


def shared_memory_bytes(bs: MosaicGpuBlockSizes, head_dim: int,
                        itemsize: int = 2, value_head_dim: int | None = None,
                        *, meta: int = 2) -> dict[str, int]:
  """Shared memory (bytes) of the forward, dQ and dK/dV kernels.

  Args:
    bs: the tiling.
    head_dim: the unpadded query/key head dim.
    itemsize: bytes per element of q/k/v.
    value_head_dim: the unpadded value head dim; None: head_dim.
    meta: the metadata arrays that travel with the tiles (positions,
      segment ids: `kernel.Spec.num_meta`, 0 for a call without masks or
      with padding alone); the most, 2, by default.

  Returns:
    dict with keys "forward", "dq", "dkv".
  """
  hp = layout.padded_head_dim(head_dim, ALIGN)
  hvp = layout.padded_head_dim(value_head_dim or head_dim, ALIGN)

  def tiles(n, rows, vectors):
    """n x [rows, H] and n x [rows, Hv] tiles and `vectors` int32 /
    float32 vectors of n x rows: one buffer each."""
    return _buffers(n * rows * hp * itemsize, n * rows * hvp * itemsize,
                    *[n * rows * 4] * vectors)

  # Every tile carries its metadata; per query row the forward keeps its
  # lse, the dQ and dK/dV kernels lse and delta. The forward's output
  # reuses Q's buffer only when Hv == H: the [rows, Hv] one is Q's then.
  fwd_rows = tiles(bs.num_consumers, bs.block_q, 1 + meta)
  if hvp == hp:
    fwd_rows -= _buffers(bs.num_consumers * bs.block_q * hvp * itemsize)
  fwd = fwd_rows + tiles(bs.num_stages, bs.block_kv, meta)
  dq = (tiles(bs.num_consumers_dq, bs.block_q_dq, 2 + meta)
        + tiles(bs.num_stages_bwd, bs.block_kv_dq, meta))
  dkv = (tiles(bs.num_consumers_dkv, bs.block_kv_dkv, meta)
         + tiles(bs.num_stages_bwd, bs.block_q_dkv, 2 + meta))
  return {"forward": fwd, "dq": dq, "dkv": dkv}


def _buffers(*nbytes: int) -> int:
  """The SMEM that buffers of `nbytes` each take (`SMEM_ALIGNMENT`)."""
  return sum(-(-n // SMEM_ALIGNMENT) * SMEM_ALIGNMENT for n in nbytes)


def fp8_forward_bytes(bs: MosaicGpuBlockSizes, head_dim: int,
                      value_head_dim: int | None = None,
                      out_itemsize: int = 2, *, meta: int = 2) -> int:
  """Shared memory (bytes) of the e4m3 forward kernel (`forward_fp8`):
  1-byte Q, K and V^T tiles, an output tile of its own (bfloat16 by
  default: it cannot reuse Q's 1-byte buffer), and per consumer two row
  vectors (lse, row factors), per ring stage two key vectors (key scales,
  value factors), each with `meta` metadata vectors (as in
  `shared_memory_bytes`)."""
  hp = layout.padded_head_dim(head_dim, ALIGN)
  hvp = layout.padded_head_dim(value_head_dim or head_dim, ALIGN)
  rows = bs.num_consumers * bs.block_q
  keys = bs.num_stages * bs.block_kv
  return _buffers(rows * hp, rows * hvp * out_itemsize, *[rows * 4] * (
      2 + meta), keys * hp, keys * hvp, *[keys * 4] * (2 + meta))


def dq_columns(padded_head_dim: int, consumers: int,
               split: str = "columns") -> int:
  """The dQ columns each consumer of the fused backward computes: half the
  head dim with two consumers when a half is whole 64-column swizzle tiles
  and `split` is "columns" (FlashAttention-3's split at H = 128: each
  consumer multiplies both consumers' dS by its half of K, one [bq, H / 2]
  reduce-add each per step), else all of them (each consumer its own keys'
  partial; `MosaicGpuBlockSizes.dq_split`)."""
  half = padded_head_dim // consumers
  if split == "columns" and consumers > 1 and half % 64 == 0:
    return half
  return padded_head_dim


def ds_slots(padded_head_dim: int, consumers: int,
             split: str = "columns") -> int:
  """dS^T tiles per consumer in the fused backward: two when the consumers
  exchange them (a slot is rewritten only after the other consumer has read
  it, `dq_columns`), else one (its one reader is the consumer that wrote
  it, which awaits its wgmma before the next step's store)."""
  shared = dq_columns(padded_head_dim, consumers, split) < padded_head_dim
  return 2 if shared else 1


def fused_backward_bytes(bs: MosaicGpuBlockSizes, head_dim: int,
                         itemsize: int = 2,
                         value_head_dim: int | None = None) -> int:
  """Shared memory (bytes) of the fused backward's kernel: the dK/dV
  kernel's (`shared_memory_bytes`) plus `ds_slots` dS^T tiles per consumer
  and a float32 dQ staging tile of `dq_columns` per consumer."""
  nc = bs.num_consumers_dkv
  hp = layout.padded_head_dim(head_dim, ALIGN)
  dq_cols = dq_columns(hp, nc, bs.dq_split)
  slots = ds_slots(hp, nc, bs.dq_split)
  dkv = shared_memory_bytes(bs, head_dim, itemsize, value_head_dim)["dkv"]
  return dkv + _buffers(
      nc * slots * bs.block_kv_dkv * bs.block_q_dkv * itemsize,
      nc * bs.block_q_dkv * dq_cols * 4)


def check_fits(bs: MosaicGpuBlockSizes, kernel: str, nbytes: int,
               hint: str = "") -> None:
  """Raises a ValueError naming the tiling when a kernel's buffers alone
  (`shared_memory_bytes`, `fused_backward_bytes`: a lower bound of what
  it compiles to) exceed sm90's shared memory, instead of Mosaic's error
  from deep inside the lowering; `hint` ends its message. Tilings the
  margin of `SHARED_MEMORY_BYTES` keeps out of the defaults but within
  the limit are left to the compiler: some of them fit."""
  if nbytes > SHARED_MEMORY_LIMIT:
    raise ValueError(
        f"block_sizes={bs} needs {nbytes:,} bytes of shared memory in the "
        f"{kernel} kernel, past the {SHARED_MEMORY_LIMIT:,} a Hopper CTA "
        "has: use fewer stages, consumers or narrower tiles (or "
        f"block_sizes=None for the tuned default){hint}.")


def heuristic_block_sizes(
    *, q_len: int, kv_len: int, head_dim: int, dtype, is_causal: bool = False,
    dropout: bool = False, device_kind: str | None = None,
    value_head_dim: int | None = None,
) -> MosaicGpuBlockSizes:
  """The heuristic tiling of a call, ignoring tuned records.

  Forward: two 64-row consumers (ping-pong) and as many ring stages (<= 4)
  as shared memory allows. Backward: 64-row stationary tiles; past head dim
  128 one consumer per CTA (256 registers a thread instead of 240) and
  split dK/dV passes, so that the float32 accumulators fit the registers.
  The streamed tiles are the widest that compile without spilling
  (`scripts/compile_check.py`): 128 up to head dim 128 and 64 beyond; the
  dK/dV kernel's are 64, and 32 with dropout at head dims 72..128, where
  its two accumulators and the hashing of every probability share 240
  registers. The backward is the fused one (`backward`'s default) wherever
  `mosaic_gpu.fused_backward_applies`: head dims up to 128, up to 64 with
  dropout (the 32-query tiles above keep the split one).

  Args:
    q_len: T (the tiling does not depend on it).
    kv_len: S (a float8 call's key tile divides it).
    head_dim: H, unpadded.
    dtype: bfloat16, float16, or float8_e4m3fn (the ring depth then
      fits `fp8_forward_bytes`; the backward tiles are bfloat16's).
    is_causal: whether the call is causal (a full call's fused backward
      pipelines its dQ, `fused_pipeline`; a float8 full call takes 256-key
      tiles where S is a multiple of 256).
    dropout: whether the call has attention dropout.
    device_kind: a `jax.Device.device_kind` (every sm90 GPU has the same
      shared memory).
    value_head_dim: Hv, unpadded; None: head_dim. The wider of the two
      sizes the register-bound choices.

  Returns:
    A `MosaicGpuBlockSizes`.
  """
  del q_len, device_kind
  itemsize = jnp.dtype(dtype).itemsize
  hv = value_head_dim or head_dim
  hp = layout.padded_head_dim(max(head_dim, hv), ALIGN)
  wide, narrow = hp > 128, hp <= 64
  block_kv = 64 if wide else 128
  base = MosaicGpuBlockSizes(
      block_q=64,
      block_kv=block_kv,
      num_stages=2,
      block_kv_dq=block_kv,
      block_q_dkv=32 if dropout and not (wide or narrow) else 64,
      num_consumers_dq=1 if wide else 2,
      num_consumers_dkv=1 if wide else 2,
      split_dkv=wide,
      # H200, bf16, H = 128, T = 16384, full: 560.1 against 529.9 TFLOP/s
      # fwd+bwd (07213ac). Causal calls keep the in-step order until a
      # window times them (their pipelined kernel spills 8 B a unit).
      fused_pipeline=not is_causal,
  )
  def smem(bs):
    return shared_memory_bytes(bs, head_dim, itemsize, hv)

  def forward_bytes(bs):
    if itemsize == 1:  # float8: the e4m3 forward kernel's own buffers.
      return fp8_forward_bytes(bs, head_dim, hv)
    return smem(bs)["forward"]

  if itemsize == 1 and not (wide or is_causal) and kv_len % 256 == 0:
    # float8: 256-key tiles in two stages (H200, H = 128, T = 16384, full:
    # 909.8 against 837.9 TFLOP/s, 07213ac). Not causal (its wider
    # diagonal tiles are untimed) and not where the last tile is part
    # padding (its prologue and epilogue spill 40-104 B).
    base = dataclasses.replace(base, block_kv=256, num_stages=2)
  else:
    for stages in (4, 3):
      candidate = dataclasses.replace(base, num_stages=stages)
      if forward_bytes(candidate) <= SHARED_MEMORY_BYTES:
        base = candidate
        break
  if smem(base)["dq"] > SHARED_MEMORY_BYTES:
    base = dataclasses.replace(base, block_kv_dq=64)
  return base


# Tile operations whose derivative needs no value of the forward kept live
# (a constant, a sign or a selection).
_CHEAP_TO_DIFFERENTIATE = frozenset({
    "add", "sub", "mul", "neg", "convert_element_type", "select_n", "max",
    "min", "abs", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy",
    "copy_p", "stop_gradient"})


def for_score_mod(bs: MosaicGpuBlockSizes, score_mod):
  """`bs` adapted to a call with a score_mod (`fused_mods.FusedMod`, or
  None): its per-head values' cotangents are a [block_q_dq, block_kv_dq]
  tile in the dQ kernel, which spills at 128 keys (ptxas, H = 128, jax
  0.11); 64 do not. And the dK/dV kernel keeps the derivative of a
  transcendental tile part (tanh, exp, a division) live across its matmuls:
  64 streamed queries spilled there at H = 128 (92 bytes on jax 0.11, 564
  on 0.10), 32 do not."""
  if score_mod is None:
    return bs
  if bs.block_kv_dq > 64:
    bs = dataclasses.replace(bs, block_kv_dq=64)
  costly = score_mod.tile_primitives - _CHEAP_TO_DIFFERENTIATE
  if costly and bs.block_q_dkv > 32:
    bs = dataclasses.replace(bs, block_q_dkv=32)
  return bs


# What autotuning varies, per pass: the forward fields, then (with the
# forward fixed) the backward ones.
_SEARCH = {
    # The pipelined key loop keeps a second P tile live: up to 128 keys.
    "forward": [
        dict(block_q=bq, block_kv=bk, num_stages=st, pingpong=pp,
             intra_overlap=ov)
        for bq in (64, 128) for bk in (32, 64, 128, 192)
        for st in (2, 3, 4) for pp in (True, False)
        for ov in ((False, True) if bk <= 128 else (False,))
    ],
    "backward": [
        dict(block_kv_dq=bk, block_q_dkv=bq, num_consumers_dq=c,
             num_consumers_dkv=c2, split_dkv=sp)
        for bk in (32, 64, 128) for bq in (32, 64) for c in (1, 2)
        for c2 in (1, 2) for sp in (False, True)
    ],
}


def candidate_block_sizes(
    base: MosaicGpuBlockSizes, *, head_dim: int, dtype=jnp.bfloat16,
    passes: tuple[str, ...] = ("forward", "backward"),
) -> list[MosaicGpuBlockSizes]:
  """Tilings worth timing around `base` (the autotuning search space).

  Every candidate fits the shared memory of an sm90 GPU; the fields of each
  pass vary around `base`, the others stay as they are.

  Args:
    base: the tiling to vary (`heuristic_block_sizes`, or the best so far).
    head_dim: the (unpadded) head dim.
    dtype: bfloat16 or float16.
    passes: which fields vary: "forward" and/or "backward".

  Returns:
    A list of `MosaicGpuBlockSizes`, `base` first.
  """
  itemsize = jnp.dtype(dtype).itemsize
  out = [base]
  for change in (c for name in passes for c in _SEARCH[name]):
    candidate = dataclasses.replace(base, **change)
    smem = shared_memory_bytes(candidate, head_dim, itemsize)
    if max(smem.values()) <= SHARED_MEMORY_BYTES and candidate not in out:
      out.append(candidate)
  return out
