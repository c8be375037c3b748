"""`triton`: flash attention kernels in Pallas, lowered to Triton.

Three kernels, none using atomics, so every result is deterministic:

* forward: grid (query blocks, query heads, batch); each program keeps one
  [block_q, H] tile of queries and runs the online softmax over the key/value
  tiles (FlashAttention-2, Algorithm 1) in base 2, with log2(e) folded into
  the logit scale; it writes the output and the natural-log logsumexp;
* dK/dV: grid (key blocks, key/value heads, batch); each program keeps one
  [block_kv, H] tile of K and V and streams the query tiles of *every* query
  head of its GQA group, so dK and dV come out summed over the group without
  ever being materialised per query head (FlashAttention-2 §3.2);
* dQ: grid (query blocks, query heads, batch); each program keeps one query
  tile and streams the key/value tiles; it also produces dbias when a bias is
  given. delta = rowsum(out * dout) - dlse arrives precomputed from `vjp`.

Every loop runs over the tiles `masking.classify_blocks` marks non-empty, its
bounds computed outside the kernel from per-block min/max of positions and
segment ids (so causal, windows, padding and sorted segments shrink the
loops), and is split into a masked head, an unmasked middle of FULL tiles and
a masked tail, so the masking arithmetic runs only on PARTIAL tiles.

Any T and S are padded to whole tiles and any head dim to a power of two of
at least 16 (`ALIGN`, `pallas_fa.layout`). A call without `block_sizes=`
gets a tuned record (`scripts/tune.py`) or else the heuristic of
`heuristic_block_sizes`. On CPU the kernels run in Pallas interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_fa import dropout
from pallas_fa import gpu_target
from pallas_fa import layout
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import tuning
from pallas_fa import vjp

try:  # The Triton-specific Pallas API (`jax.experimental.pallas.gpu` once).
  from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - depends on the installed jax.
  from jax.experimental.pallas import gpu as _plgpu

Array = Any
_F32 = jnp.float32
_LOG2_E = online_softmax.LOG2_E
# Triton's tl.dot needs every matmul dimension to be at least 16.
MIN_BLOCK = 16
MAX_BLOCK = 512
_WARPS = (1, 2, 4, 8, 16)
_SQUEEZED = getattr(pl, "squeezed", None)
# Older jax releases call it TritonCompilerParams.
_CompilerParams = (
    _plgpu.CompilerParams if hasattr(_plgpu, "CompilerParams")
    else _plgpu.TritonCompilerParams
)


# Tiles cut from short sequences, and the head dim, are powers of two of at
# least MIN_BLOCK (`tl.arange` needs powers of two).
ALIGN = layout.Alignment(rows=MIN_BLOCK, head_dim=MIN_BLOCK, power_of_two=True)


def _is_power_of_2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TritonBlockSizes:
  """Tiling of the `triton` kernels.

  Tiles are clipped to the (power-of-two rounded) sequence lengths, so large
  tiles are safe on short sequences.

  Attributes:
    block_q: forward query rows per program.
    block_kv: forward key rows per loop step.
    block_q_dkv: dK/dV kernel, query rows per loop step.
    block_kv_dkv: dK/dV kernel, key rows per program.
    block_q_dq: dQ kernel, query rows per program.
    block_kv_dq: dQ kernel, key rows per loop step.
    num_warps: warps per program of the forward kernel.
    num_stages: software-pipelining stages of the forward kernel.
    num_warps_bwd: warps of the backward kernels (None: num_warps).
    num_stages_bwd: stages of the backward kernels (None: num_stages).
  """

  block_q: int = 128
  block_kv: int = 64
  block_q_dkv: int = 32
  block_kv_dkv: int = 128
  block_q_dq: int = 128
  block_kv_dq: int = 32
  num_warps: int = 4
  num_stages: int = 2
  num_warps_bwd: int | None = None
  num_stages_bwd: int | None = None

  def __post_init__(self):
    name = type(self).__name__
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if value is None and f.name.endswith("_bwd"):
        continue
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(
            f"{name}.{f.name} must be an int, got {value!r}.")
      if f.name.startswith("block_") and not (
          _is_power_of_2(value) and MIN_BLOCK <= value <= MAX_BLOCK
      ):
        raise ValueError(
            f"{name}.{f.name} must be a power of two in "
            f"[{MIN_BLOCK}, {MAX_BLOCK}], got {value!r}."
        )
      if f.name.startswith("num_warps") and value not in _WARPS:
        raise ValueError(
            f"{name}.{f.name} must be one of {_WARPS}, got {value!r}.")
      if f.name.startswith("num_stages") and not 1 <= value <= 8:
        raise ValueError(
            f"{name}.{f.name} must be in [1, 8], got {value!r}.")

  @property
  def backward_warps(self) -> int:
    return self.num_warps_bwd or self.num_warps

  @property
  def backward_stages(self) -> int:
    return self.num_stages_bwd or self.num_stages


# ----------------------------------------------------------------------------
# Default tiles: a tuned record (`pallas_fa.tuning`), else the heuristic.

# Shared memory per block (bytes) the Triton compiler can use, by device-kind
# substring; the first match wins. Unknown GPUs get the conservative default.
_SHARED_MEMORY = (
    ("H100", 227 * 1024),
    ("H200", 227 * 1024),
    ("H800", 227 * 1024),
    ("GH200", 227 * 1024),
    ("B200", 227 * 1024),
    ("A100", 163 * 1024),
    ("A800", 163 * 1024),
    ("A10", 99 * 1024),
    ("L4", 99 * 1024),
    ("L40", 99 * 1024),
    ("RTX", 99 * 1024),
)
_DEFAULT_SHARED_MEMORY = 99 * 1024
# Device kinds of Hopper (sm90) GPUs.
HOPPER_KINDS = ("H100", "H200", "H800", "GH200")


def shared_memory_budget(kind: str) -> int:
  """Shared memory per thread block usable by one kernel on `kind`."""
  for name, size in _SHARED_MEMORY:
    if name.lower() in kind.lower():
      return size
  return _DEFAULT_SHARED_MEMORY


def _forward_bytes(bq, bk, hp, itemsize, stages):
  # Q stays resident; K and V tiles are multi-buffered by the pipeliner.
  return (bq * hp + stages * 2 * bk * hp) * itemsize


def _backward_bytes(b_rows, b_stream, hp, itemsize, stages):
  # One side resident (two tiles: K,V or Q,dO), the other side streamed (two
  # tiles per stage), plus the f32 [rows, stream] staging of P / dS.
  return (2 * b_rows * hp + stages * 2 * b_stream * hp) * itemsize + (
      b_rows * b_stream * 4
  )


def shared_memory_bytes(bs: TritonBlockSizes, head_dim: int,
                        itemsize: int) -> dict[str, int]:
  """Estimated shared memory (bytes) of the forward, dQ and dK/dV kernels.

  Args:
    bs: the tiling.
    head_dim: the unpadded head dim.
    itemsize: bytes per element of q/k/v.

  Returns:
    dict with keys "forward", "dq", "dkv".
  """
  hp = layout.padded_head_dim(head_dim, ALIGN)
  stages = bs.backward_stages
  return {
      "forward": _forward_bytes(
          bs.block_q, bs.block_kv, hp, itemsize, bs.num_stages),
      "dq": _backward_bytes(
          bs.block_q_dq, bs.block_kv_dq, hp, itemsize, stages),
      "dkv": _backward_bytes(
          bs.block_kv_dkv, bs.block_q_dkv, hp, itemsize, stages),
  }


def _heuristic(hp: int, itemsize: int, kind: str) -> TritonBlockSizes:
  """FlashAttention-2 style tiles, shrunk until they fit shared memory."""
  if "cpu" in kind.lower():
    # Interpret mode: the cost is per grid step and per loop iteration, so
    # large tiles are fastest; there is no shared memory to respect.
    return TritonBlockSizes(
        block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128,
        block_q_dq=128, block_kv_dq=128, num_warps=4, num_stages=1)
  budget = shared_memory_budget(kind)
  wide = itemsize >= 4  # float32 tiles take twice the memory.
  # Hopper's wgmma reads both operands from shared memory; older GPUs
  # (mma.sync) hold them in registers, which leaves less for accumulators.
  hopper = any(name in kind for name in HOPPER_KINDS)
  # Register budgets below were read off ptxas (`scripts/compile_check.py`):
  # each choice is the largest tiling that compiles without spilling.
  if hp <= 64:
    fwd = (128, 64 if wide else 128)
    warps = 4 if hopper and not wide else 8
  elif hp <= 128:
    fwd = (128, 32 if wide else 64)
    warps = 8
  else:
    fwd = (32 if wide else 64, 32)
    warps = 8
  # dK/dV keeps a K/V tile resident and streams Q; dQ the converse. The
  # streamed side is the narrow one (FlashAttention-2 §3.2). dK/dV works on
  # S^T = K Q^T, so its key tile is the M dimension of every matmul (at
  # least 64, one Hopper wgmma, where registers allow): the two float32
  # accumulators [block_kv, Hp] plus the [block_kv, block_q] logits must fit
  # 8 warps' registers. At head dim 256 that caps the key tile at 32.
  if hp <= 64:
    dkv, dq = (64 if hopper and not wide else 32, 128), (128, 64)
  elif hp <= 128:
    dkv, dq = (32, 128 if hopper and not wide else 64), (128, 32)
  else:
    dkv, dq = (16, 32), (64, 32)
  if wide:
    # float32 operands: twice the registers per element again.
    if hp <= 64:
      dkv, dq = (16, dkv[1]), (32, 64)
    elif hp <= 128:
      dkv, dq = (16, 32), (32, 32)
    else:
      dkv, dq = (16, 16), (16, 32)
  warps_bwd = 8
  # Deeper backward pipelines than this spill at head dim 256.
  max_stages_bwd = 3 if hp <= 128 else 2

  def bwd_bytes(dkv, dq, stages):
    return max(_backward_bytes(dkv[1], dkv[0], hp, itemsize, stages),
               _backward_bytes(dq[0], dq[1], hp, itemsize, stages))

  # Deepest software pipeline that fits; shrink the resident tiles (never
  # below 32 rows) when not even one stage does.
  while _forward_bytes(*fwd, hp, itemsize, 1) > budget and fwd[0] > 32:
    fwd = (fwd[0] // 2, fwd[1])
  while bwd_bytes(dkv, dq, 1) > budget and max(dkv[1], dq[0]) > 32:
    dkv, dq = (dkv[0], max(32, dkv[1] // 2)), (max(32, dq[0] // 2), dq[1])
  stages = 3
  while stages > 1 and _forward_bytes(*fwd, hp, itemsize, stages) > budget:
    stages -= 1
  stages_bwd = max_stages_bwd
  while stages_bwd > 1 and bwd_bytes(dkv, dq, stages_bwd) > budget:
    stages_bwd -= 1
  return TritonBlockSizes(
      block_q=fwd[0], block_kv=fwd[1],
      block_q_dkv=dkv[0], block_kv_dkv=dkv[1],
      block_q_dq=dq[0], block_kv_dq=dq[1],
      num_warps=warps, num_stages=stages,
      num_warps_bwd=warps_bwd, num_stages_bwd=stages_bwd,
  )


def _for_dropout(bs: TritonBlockSizes, dropout: bool) -> TritonBlockSizes:
  if dropout and bs.num_warps < 8:
    # The mask hash adds registers: a 4-warp forward spills (ptxas, H=64).
    return dataclasses.replace(bs, num_warps=8)
  return bs


def heuristic_block_sizes(
    *, q_len: int, kv_len: int, head_dim: int, dtype, is_causal: bool = False,
    dropout: bool = False, device_kind: str | None = None,
) -> TritonBlockSizes:
  """The heuristic tiling of a call, ignoring tuned records.

  FlashAttention-2 tiles per head dim, dtype and GPU (read off ptxas so that
  none spills), shrunk until the software pipeline fits shared memory.

  Args:
    q_len: T (tiles are clipped to it when the kernels run).
    kv_len: S (likewise).
    head_dim: H, unpadded.
    dtype: the input dtype.
    is_causal: whether the call is causal (the heuristic does not care).
    dropout: whether the call has attention dropout.
    device_kind: a `jax.Device.device_kind`; None: the GPU the kernels are
      built for (`pallas_fa.gpu_target`), else "cpu".

  Returns:
    A `TritonBlockSizes`.
  """
  del q_len, kv_len, is_causal
  kind = tuning.device_kind() if device_kind is None else device_kind
  hp = layout.padded_head_dim(head_dim, ALIGN)
  bs = _heuristic(hp, jnp.dtype(dtype).itemsize, kind)
  return _for_dropout(bs, dropout)


def default_block_sizes(
    *, q_len: int, kv_len: int, head_dim: int, dtype, is_causal: bool = False,
    dropout: bool = False, device_kind: str | None = None,
) -> TritonBlockSizes:
  """The tiling of a call made without `block_sizes=`.

  The tuned record nearest to the call (`pallas_fa.tuning`), else
  `heuristic_block_sizes`, whose arguments these are.

  Returns:
    A `TritonBlockSizes`.
  """
  bs = tuning.tuned_or_heuristic(
      "triton", TritonBlockSizes, heuristic_block_sizes, q_len=q_len,
      kv_len=kv_len, head_dim=head_dim, dtype=dtype, is_causal=is_causal,
      dropout=dropout, device_kind=device_kind)
  return _for_dropout(bs, dropout)  # Records are tuned without dropout.


def _interpret() -> bool:
  """Interpret on CPU, unless building for a GPU (`gpu_target`)."""
  return gpu_target.current() is None


# ----------------------------------------------------------------------------
# Static description of a call, shared by the three kernels.


@dataclasses.dataclass(frozen=True)
class _Features:
  """What the kernels must compute (hashable: it parameterises the kernels).

  `mask` / `bias` are None or, per axis (B, N, T, S), whether the dense array
  is full along that axis (False: broadcast, size 1).
  """

  scale: float
  soft_cap: float | None
  is_causal: bool
  window: tuple[int | None, int | None] | None
  segments: bool
  mask: tuple[bool, bool, bool, bool] | None
  bias: tuple[bool, bool, bool, bool] | None
  groups: int
  precision: Any = None
  dropout_rate: float = 0.0

  @property
  def positions(self) -> bool:
    return self.is_causal or self.window is not None

  @property
  def masked(self) -> bool:
    return self.positions or self.segments or self.mask is not None


def _full_axes(x) -> tuple[bool, bool, bool, bool] | None:
  return None if x is None else tuple(d > 1 for d in x.shape)


def _dot(a, b, feat: _Features):
  """a @ b, float32 accumulation at the call's matmul precision (float32
  inputs: DEFAULT/HIGH run TF32 on tensor cores, HIGHEST full float32)."""
  return jax.lax.dot_general(
      a, b, (((1,), (0,)), ((), ())), precision=feat.precision,
      preferred_element_type=_F32)


def _dot_nt(a, b, feat: _Features):
  """a @ b.T, as `_dot`."""
  return jax.lax.dot_general(
      a, b, (((1,), (1,)), ((), ())), precision=feat.precision,
      preferred_element_type=_F32)


def _logits(feat: _Features, qk, bias):
  """Base-2 logits of a tile, and the capped natural logits (or None).

  The natural logits are soft_cap(scale * qk) + bias; kernels use exp2, so
  they are multiplied by log2(e) -- folded into the scale when there is
  neither cap nor bias, which leaves a single multiply per element.
  """
  if feat.soft_cap is None and bias is None:
    return None, qk * (feat.scale * _LOG2_E)
  s_capped = online_softmax.soft_cap(qk * feat.scale, feat.soft_cap)
  s = s_capped if bias is None else s_capped + bias.astype(_F32)
  return s_capped, s * _LOG2_E


def _program_ids():
  """The three grid indices, read at the kernel's top level (the
  interpreter resolves `program_id` there, not inside loop bodies)."""
  return pl.program_id(0), pl.program_id(1), pl.program_id(2)


def _dropout_factor(refs, feat: _Features, batch, head, row0, rows: int,
                    col0, cols: int, *, queries_last: bool = False):
  """The [rows, cols] attention-dropout factor of a tile (0 or
  1 / (1 - rate), `pallas_fa.dropout`): rows are queries and columns keys,
  or the converse with `queries_last`."""
  seed = refs["seed"][...][None, :]  # [1, 1] uint32
  r = row0 + jnp.arange(rows, dtype=jnp.int32)[:, None]
  c = col0 + jnp.arange(cols, dtype=jnp.int32)[None, :]
  q_index, kv_index = (c, r) if queries_last else (r, c)
  keep = dropout.keep_mask(seed, feat.dropout_rate, batch, head, q_index,
                           kv_index)
  return dropout.factor(keep, feat.dropout_rate, _F32)


def _visible(feat: _Features, row_pos, col_pos, row_seg, col_seg, dense, *,
             queries_last: bool = False):
  """`masking.visible` for a [rows, cols] tile from per-row/column data.

  Rows are queries and columns keys, or the converse with `queries_last`
  (the transposed dK/dV tile).
  """
  def rows(x):
    return None if x is None else x[:, None]

  def cols(x):
    return None if x is None else x[None, :]

  q_pos, kv_pos = rows(row_pos), cols(col_pos)
  q_seg, kv_seg = rows(row_seg), cols(col_seg)
  if queries_last:
    q_pos, kv_pos = cols(col_pos), rows(row_pos)
    q_seg, kv_seg = cols(col_seg), rows(row_seg)
  return masking.visible(
      is_causal=feat.is_causal, window=feat.window,
      q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg,
      dense=None if dense is None else dense != 0,
  )


def _visit(refs, tile, carry, masked: bool, num_tiles: int):
  """Runs tile(j, carry, masked) over the non-empty tiles of this program.

  `refs["bounds"]` holds (lo, full_lo, full_hi, hi): tiles in
  [full_lo, full_hi) are FULL and skip the masking arithmetic; the others in
  [lo, hi) are masked; everything outside [lo, hi) is EMPTY and not visited.
  """
  if not masked:
    return jax.lax.fori_loop(
        0, num_tiles, functools.partial(tile, masked=False), carry)
  bounds = refs["bounds"]
  lo, full_lo, full_hi, hi = (bounds[i] for i in range(4))
  head = full_lo - lo

  def masked_tile(step, carry):
    # The partial tiles before and after the FULL run, in one loop: one copy
    # of the masked body (the online softmax does not depend on tile order).
    j = jnp.where(step < head, lo + step, full_hi + (step - head))
    return tile(j, carry, masked=True)

  carry = jax.lax.fori_loop(
      full_lo, full_hi, functools.partial(tile, masked=False), carry)
  return jax.lax.fori_loop(0, head + hi - full_hi, masked_tile, carry)


def tile_bounds(kinds: Array) -> Array:
  """Loop bounds from tile kinds [..., n] -> int32 [..., 4].

  (lo, full_lo, full_hi, hi): [lo, hi) spans the non-empty tiles and
  [full_lo, full_hi) is the run of FULL tiles inside it when those are
  contiguous (otherwise it is empty and every tile is masked).
  """
  lo, hi = masking.block_range(kinds)
  full_lo, full_hi = masking.full_run(kinds, hi)
  return jnp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------
# Inputs padded to whole tiles.


class _Padded(layout.Padded):
  """q/k/v, bias, mask and MaskInfo padded to [Tp, Sp] and head dim Hp."""

  def __init__(self, q, k, v, bias, info, params, tp, sp):
    super().__init__(q, k, v, bias, info, q_len=tp, kv_len=sp, align=ALIGN)
    self.mask = None
    if self.info.mask is not None:
      # Triton loads bytes, not i1: keep the mask as int8 in memory.
      self.mask = self.info.mask.astype(jnp.int8)
    self.feat = _Features(
        scale=float(params.scale),
        soft_cap=params.soft_cap,
        is_causal=self.info.is_causal,
        window=self.info.window,
        segments=self.info.has_segments,
        mask=_full_axes(self.mask),
        bias=_full_axes(self.bias),
        groups=self.g,
        precision=params.precision,
        dropout_rate=self.info.dropout_rate,
    )

  def kinds(self, block_q, block_kv):
    return masking.classify_blocks(self.info, block_q, block_kv)


def _grouped(x, num_kv):
  """[B|1, N|1, T|1, S|1] -> [B|1, K|1, G|1, T|1, S|1]."""
  return masking.group_heads(x, num_kv)


def _pallas_call(kernel, inputs, outputs, grid, warps, stages, name):
  """pallas_call over named (array, BlockSpec) inputs and outputs.

  The kernel receives one dict of refs, so optional inputs (positions,
  segment ids, mask, bias) are simply absent rather than positional Nones.
  """
  in_names = [key for key, val in inputs.items() if val is not None]
  out_names = list(outputs)

  def body(*refs):
    kernel(dict(zip(in_names + out_names, refs, strict=True)))

  return pl.pallas_call(
      body,
      grid=grid,
      in_specs=[inputs[key][1] for key in in_names],
      out_specs=[outputs[key][1] for key in out_names],
      out_shape=[outputs[key][0] for key in out_names],
      compiler_params=_CompilerParams(num_warps=warps, num_stages=stages),
      interpret=_interpret(),
      name=name,
  )(*[inputs[key][0] for key in in_names])


def _spec(block_shape, index_map):
  block_shape = tuple(_SQUEEZED if d is None else d for d in block_shape)
  return pl.BlockSpec(block_shape, index_map)


def _dense_block(x, full, rows: int, cols: int):
  """Block shape of a [B|1, N|1, T|1, S|1] array for a (row, col) tile."""
  return (None, None, rows if full[2] else 1, cols if full[3] else 1)


def _dense_index(full, b, n, i, j):
  return (b if full[0] else 0, n if full[1] else 0,
          i if full[2] else 0, j if full[3] else 0)


def _dense_tile(ref, full, lead, rows, cols):
  """Loads a dense tile; broadcast axes load as size 1."""
  return ref[(*lead, rows if full[2] else slice(None),
              cols if full[3] else slice(None))]


# ----------------------------------------------------------------------------
# Forward.


def _forward_kernel(refs, *, feat: _Features, block_k: int, num_tiles: int,
                    reverse_rows: bool):
  q = refs["q"][...]  # [block_q, Hp]
  block_q, hp = q.shape
  row, head, batch = _program_ids()
  if reverse_rows:
    row = pl.num_programs(0) - 1 - row
  q_pos = refs["q_pos"][...] if feat.positions else None  # [block_q]
  q_seg = refs["q_seg"][...] if feat.segments else None

  def tile(j, carry, masked):
    m_i, l_i, acc = carry
    cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k = refs["k"][cols, :]  # [block_k, Hp]
    v = refs["v"][cols, :]
    bias = None
    if feat.bias is not None:
      bias = _dense_tile(refs["bias"], feat.bias, (), slice(None), cols)
    _, s = _logits(feat, _dot_nt(q, k, feat), bias)  # [block_q, block_k]
    if masked:
      dense = None
      if feat.mask is not None:
        dense = _dense_tile(refs["mask"], feat.mask, (), slice(None), cols)
      s = online_softmax.apply_mask(s, _visible(
          feat, q_pos,
          refs["kv_pos"][cols] if feat.positions else None,
          q_seg, refs["kv_seg"][cols] if feat.segments else None, dense))
    m_i, l_i, p, alpha = online_softmax.update(m_i, l_i, s, exp=jnp.exp2)
    if feat.dropout_rate:
      # On the normalised probabilities: l_i sums the undropped ones.
      p = p * _dropout_factor(refs, feat, batch, head, row * block_q,
                              block_q, j * block_k, block_k)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, feat)
    return m_i, l_i, acc

  carry = online_softmax.init((block_q,), (block_q, hp))
  m_i, l_i, acc = _visit(refs, tile, carry, feat.masked, num_tiles)
  out, lse = online_softmax.finalize_base2(m_i, l_i, acc)
  refs["out"][...] = out.astype(refs["out"].dtype)
  refs["lse"][...] = lse


def _forward(q, k, v, bias, info, params):
  bs = BACKEND.block_sizes(params, q, k, info)
  b, t, n, h = q.shape
  s = k.shape[1]
  bq, tp = layout.tile(bs.block_q, t, ALIGN)
  bk, sp = layout.tile(bs.block_kv, s, ALIGN)
  x = _Padded(q, k, v, bias, info, params, tp, sp)
  feat, hp, g = x.feat, x.hp, x.g
  nq, nk = x.tp // bq, x.sp // bk
  # Heavier (later, for causal) query blocks first: less tail imbalance.
  if info.is_causal:
    def row(i):
      return nq - 1 - i
  else:
    def row(i):
      return i

  inputs = {
      "q": (x.q, _spec((None, bq, None, hp),
                       lambda i, h, b: (b, row(i), h, 0))),
      "k": (x.k, _spec((None, x.sp, None, hp),
                       lambda i, h, b: (b, 0, h // g, 0))),
      "v": (x.v, _spec((None, x.sp, None, hp),
                       lambda i, h, b: (b, 0, h // g, 0))),
      "bounds": None,
      "q_pos": None, "kv_pos": None, "q_seg": None, "kv_seg": None,
      "mask": None, "bias": None,
  }
  if feat.masked:
    inputs["bounds"] = (
        tile_bounds(x.kinds(bq, bk)),
        _spec((None, None, 4), lambda i, h, b: (b, row(i), 0)))
  _add_row_col_inputs(inputs, x, feat, bq, x.sp, row, lambda i: 0)
  _add_dense_inputs(inputs, x, feat, bq, x.sp, row, lambda i: 0)
  outputs = {
      "out": (jax.ShapeDtypeStruct((b, x.tp, n, hp), q.dtype),
              _spec((None, bq, None, hp), lambda i, h, b: (b, row(i), h, 0))),
      "lse": (jax.ShapeDtypeStruct((b, n, x.tp), _F32),
              _spec((None, None, bq), lambda i, h, b: (b, h, row(i)))),
  }
  _add_dropout_seed(inputs, x)
  kernel = functools.partial(
      _forward_kernel, feat=feat, block_k=bk, num_tiles=nk,
      reverse_rows=info.is_causal)
  out, lse = _pallas_call(kernel, inputs, outputs, (nq, n, b),
                          bs.num_warps, bs.num_stages, "flash_fwd")
  return out[:, :t, :, :h], lse[:, :, :t].transpose(0, 2, 1)


def _add_row_col_inputs(inputs, x, feat, rows, cols, row, col):
  """Positions / segment ids, blocked per program for grids (r, head, b)."""
  pairs = []
  if feat.positions:
    pairs.append(("pos", x.info.q_positions, x.info.kv_positions))
  if feat.segments:
    pairs.append(("seg", x.info.q_segment_ids, x.info.kv_segment_ids))
  for name, q_arr, kv_arr in pairs:
    inputs["q_" + name] = (
        q_arr, _spec((None, rows), lambda r, h, b: (b, row(r))))
    inputs["kv_" + name] = (
        kv_arr, _spec((None, cols), lambda r, h, b: (b, col(r))))


def _add_dropout_seed(inputs, x):
  if x.info.has_dropout:
    seed = jnp.asarray(x.info.dropout_seed, jnp.uint32).reshape(1)
    inputs["seed"] = (seed, _spec((1,), lambda *_: (0,)))


def _add_dense_inputs(inputs, x, feat, rows, cols, row, col):
  """Mask / bias for the query-head grids (forward, dQ)."""
  for name, arr, full in (("mask", x.mask, feat.mask),
                          ("bias", x.bias, feat.bias)):
    if arr is None:
      continue
    inputs[name] = (arr, _spec(
        _dense_block(arr, full, rows, cols),
        lambda r, h, b, full=full: _dense_index(full, b, h, row(r), col(r))))


# ----------------------------------------------------------------------------
# Backward.


def _dkv_kernel(refs, *, feat: _Features, block_q: int, num_tiles: int):
  # Transposed orientation (S^T = K Q^T, FlashAttention-2 §3.1.2): every
  # matmul has M = block_kv, and P^T / dS^T are the left operands of the
  # dV / dK updates as computed, so no tile is ever transposed in registers.
  k = refs["k"][...]  # [block_kv, Hp]
  v = refs["v"][...]
  block_kv, hp = k.shape
  kv_block, kv_head, batch = _program_ids()
  kv_pos = refs["kv_pos"][...] if feat.positions else None  # [block_kv]
  kv_seg = refs["kv_seg"][...] if feat.segments else None

  def head(g, carry):
    def tile(i, carry, masked):
      dk, dv = carry
      rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
      q = refs["q"][rows, g, :]  # [block_q, Hp]
      do = refs["do"][rows, g, :]
      lse = refs["lse"][g, rows]  # [block_q], base 2
      delta = refs["delta"][g, rows]
      bias = None
      if feat.bias is not None:
        bias = _dense_tile(refs["bias"], feat.bias,
                           (g if feat.bias[1] else 0,), rows, slice(None)).T
      # [block_kv, block_q]
      s_capped, s = _logits(feat, _dot_nt(k, q, feat), bias)
      if masked:
        dense = None
        if feat.mask is not None:
          dense = _dense_tile(refs["mask"], feat.mask,
                              (g if feat.mask[1] else 0,), rows,
                              slice(None)).T
        s = online_softmax.apply_mask(s, _visible(
            feat, kv_pos, refs["q_pos"][rows] if feat.positions else None,
            kv_seg, refs["q_seg"][rows] if feat.segments else None, dense,
            queries_last=True))
      p = online_softmax.probs_from_lse(s, lse, exp=jnp.exp2,
                                        queries_last=True)
      dp = _dot_nt(v, do, feat)  # [block_kv, block_q]
      p_used = p
      if feat.dropout_rate:
        # dV from the dropped P^T, dP^T through the same mask, and
        # dS^T = P^T * (dP^T - delta) (FlashAttention-2's dropout backward).
        z = _dropout_factor(
            refs, feat, batch, kv_head * feat.groups + g, kv_block * block_kv,
            block_kv, i * block_q, block_q, queries_last=True)
        p_used, dp = p * z, dp * z
      dv = dv + _dot(p_used.astype(do.dtype), do, feat)  # [block_kv, Hp]
      ds = online_softmax.logits_grad(p, dp, delta, queries_last=True)
      ds = online_softmax.soft_cap_grad(ds, s_capped, feat.soft_cap)
      dk = dk + _dot(ds.astype(q.dtype), q, feat)  # unscaled, see below
      return dk, dv

    return _visit(refs, tile, carry, feat.masked, num_tiles)

  carry = (jnp.zeros((block_kv, hp), _F32), jnp.zeros((block_kv, hp), _F32))
  if feat.groups == 1:
    dk, dv = head(0, carry)
  else:
    # The whole GQA group, so dK/dV leave the kernel already reduced.
    dk, dv = jax.lax.fori_loop(0, feat.groups, head, carry)
  # d logits / d qk = scale: applied once to the sum, not per tile.
  refs["dk"][...] = (dk * feat.scale).astype(refs["dk"].dtype)
  refs["dv"][...] = dv.astype(refs["dv"].dtype)


def _dq_kernel(refs, *, feat: _Features, block_k: int, num_tiles: int):
  q = refs["q"][...]  # [block_q, Hp]
  do = refs["do"][...]
  lse = refs["lse"][...]  # [block_q], base 2
  delta = refs["delta"][...]
  block_q, hp = q.shape
  q_block, head, batch = _program_ids()
  q_pos = refs["q_pos"][...] if feat.positions else None
  q_seg = refs["q_seg"][...] if feat.segments else None
  db = feat.bias
  # dbias: tiles stored in place when bias has a full key axis, else a
  # running row sum; the query axis is summed in the tile when bias
  # broadcasts over it.
  db_rows = block_q if db is not None and db[2] else 1
  db_carry = db is not None and not db[3]

  def tile(j, carry, masked):
    dq, db_acc = carry
    cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k = refs["k"][cols, :]  # [block_k, Hp]
    v = refs["v"][cols, :]
    bias = None
    if db is not None:
      bias = _dense_tile(refs["bias"], db, (), slice(None), cols)
    s_capped, s = _logits(feat, _dot_nt(q, k, feat), bias)  # [bq, bk]
    if masked:
      dense = None
      if feat.mask is not None:
        dense = _dense_tile(refs["mask"], feat.mask, (), slice(None), cols)
      s = online_softmax.apply_mask(s, _visible(
          feat, q_pos, refs["kv_pos"][cols] if feat.positions else None,
          q_seg, refs["kv_seg"][cols] if feat.segments else None, dense))
    p = online_softmax.probs_from_lse(s, lse, exp=jnp.exp2)
    dp = _dot_nt(do, v, feat)  # [block_q, block_k]
    if feat.dropout_rate:
      dp = dp * _dropout_factor(refs, feat, batch, head, q_block * block_q,
                                block_q, j * block_k, block_k)
    ds = online_softmax.logits_grad(p, dp, delta)
    if db is not None:
      d = ds if db[2] else ds.sum(axis=0, keepdims=True)
      if db[3]:
        refs["dbias"][:, cols] = d.astype(refs["dbias"].dtype)
      else:
        db_acc = db_acc + d.sum(axis=1, keepdims=True)
    ds = online_softmax.soft_cap_grad(ds, s_capped, feat.soft_cap)
    dq = dq + _dot(ds.astype(k.dtype), k, feat)  # unscaled, see below
    return dq, db_acc

  if db is not None and db[3] and feat.masked:
    # Tiles outside the visited range have zero gradient; write it.
    def zero(j, c):
      cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
      refs["dbias"][:, cols] = jnp.zeros((db_rows, block_k), _F32)
      return c

    bounds = refs["bounds"]
    jax.lax.fori_loop(0, bounds[0], zero, 0)
    jax.lax.fori_loop(bounds[3], num_tiles, zero, 0)
  carry = (jnp.zeros((block_q, hp), _F32),
           jnp.zeros((db_rows, 1), _F32) if db_carry else None)
  dq, db_acc = _visit(refs, tile, carry, feat.masked, num_tiles)
  if db_carry:
    refs["dbias"][...] = db_acc
  refs["dq"][...] = (dq * feat.scale).astype(refs["dq"].dtype)


def _backward(q, k, v, bias, info, params, lse, dout, delta):
  bs = BACKEND.block_sizes(params, q, k, info)
  b, t, n, h = q.shape
  s, num_kv = k.shape[1], k.shape[2]
  bq_kv, _ = layout.tile(bs.block_q_dkv, t, ALIGN)
  bk_kv, _ = layout.tile(bs.block_kv_dkv, s, ALIGN)
  bq_q, _ = layout.tile(bs.block_q_dq, t, ALIGN)
  bk_q, _ = layout.tile(bs.block_kv_dq, s, ALIGN)
  x = _Padded(q, k, v, bias, info, params, layout.padded_length(t, bq_kv, bq_q),
              layout.padded_length(s, bk_kv, bk_q))
  feat, hp, g = x.feat, x.hp, x.g
  do = x.queries(dout.astype(q.dtype))
  # lse in base 2 for exp2; padded rows -inf (probability 0).
  lse2 = x.rows(lse * _LOG2_E, online_softmax.MASK_VALUE)  # [B, N, Tp]
  delta = x.rows(delta.astype(_F32), 0.0)
  warps, stages = bs.backward_warps, bs.backward_stages

  # dK/dV: grid (key blocks, kv heads, batch), loop over group x query tiles.
  nq, nk = x.tp // bq_kv, x.sp // bk_kv
  inputs = {
      "k": (x.k, _spec((None, bk_kv, None, hp),
                       lambda j, h, b: (b, j, h, 0))),
      "v": (x.v, _spec((None, bk_kv, None, hp),
                       lambda j, h, b: (b, j, h, 0))),
      "q": (x.q, _spec((None, x.tp, g, hp), lambda j, h, b: (b, 0, h, 0))),
      "do": (do, _spec((None, x.tp, g, hp), lambda j, h, b: (b, 0, h, 0))),
      "lse": (lse2, _spec((None, g, x.tp), lambda j, h, b: (b, h, 0))),
      "delta": (delta, _spec((None, g, x.tp), lambda j, h, b: (b, h, 0))),
      "bounds": None,
  }
  if feat.masked:
    kinds = jnp.swapaxes(x.kinds(bq_kv, bk_kv), 1, 2)  # [B, nk, nq]
    inputs["bounds"] = (
        tile_bounds(kinds), _spec((None, None, 4), lambda j, h, b: (b, j, 0)))
  _add_row_col_inputs(inputs, x, feat, x.tp, bk_kv, lambda j: 0,
                      lambda j: j)
  for name, arr, full in (("mask", x.mask, feat.mask),
                          ("bias", x.bias, feat.bias)):
    if arr is None:
      continue
    arr = _grouped(arr, num_kv)  # [B|1, K|1, G|1, Tp|1, Sp|1]
    block = (None, None, g if full[1] else 1,
             x.tp if full[2] else 1, bk_kv if full[3] else 1)
    inputs[name] = (arr, _spec(
        block,
        lambda j, h, b, full=full: (b if full[0] else 0, h if full[1] else 0,
                                    0, 0, j if full[3] else 0)))
  outputs = {
      "dk": (jax.ShapeDtypeStruct((b, x.sp, num_kv, hp), k.dtype),
             _spec((None, bk_kv, None, hp), lambda j, h, b: (b, j, h, 0))),
      "dv": (jax.ShapeDtypeStruct((b, x.sp, num_kv, hp), v.dtype),
             _spec((None, bk_kv, None, hp), lambda j, h, b: (b, j, h, 0))),
  }
  _add_dropout_seed(inputs, x)
  kernel = functools.partial(
      _dkv_kernel, feat=feat, block_q=bq_kv, num_tiles=nq)
  dk, dv = _pallas_call(kernel, inputs, outputs, (nk, num_kv, b), warps,
                        stages, "flash_bwd_dkv")

  # dQ (and dbias): grid (query blocks, query heads, batch).
  nq, nk = x.tp // bq_q, x.sp // bk_q
  inputs = {
      "q": (x.q, _spec((None, bq_q, None, hp), lambda i, h, b: (b, i, h, 0))),
      "do": (do, _spec((None, bq_q, None, hp), lambda i, h, b: (b, i, h, 0))),
      "lse": (lse2, _spec((None, None, bq_q), lambda i, h, b: (b, h, i))),
      "delta": (delta, _spec((None, None, bq_q), lambda i, h, b: (b, h, i))),
      "k": (x.k, _spec((None, x.sp, None, hp),
                       lambda i, h, b: (b, 0, h // g, 0))),
      "v": (x.v, _spec((None, x.sp, None, hp),
                       lambda i, h, b: (b, 0, h // g, 0))),
      "bounds": None,
  }
  if feat.masked:
    inputs["bounds"] = (
        tile_bounds(x.kinds(bq_q, bk_q)),
        _spec((None, None, 4), lambda i, h, b: (b, i, 0)))
  _add_row_col_inputs(inputs, x, feat, bq_q, x.sp, lambda i: i,
                      lambda i: 0)
  _add_dense_inputs(inputs, x, feat, bq_q, x.sp, lambda i: i, lambda i: 0)
  outputs = {
      "dq": (jax.ShapeDtypeStruct((b, x.tp, n, hp), q.dtype),
             _spec((None, bq_q, None, hp), lambda i, h, b: (b, i, h, 0))),
  }
  db = feat.bias
  if db is not None:
    # [B, N, Tp | query blocks, Sp | 1]: reduced outside over what the
    # kernel cannot (batch, heads, query blocks) -- no atomics.
    db_shape = (b, n, x.tp if db[2] else nq, x.sp if db[3] else 1)
    db_block = (None, None, bq_q if db[2] else 1, x.sp if db[3] else 1)
    outputs["dbias"] = (jax.ShapeDtypeStruct(db_shape, _F32),
                        _spec(db_block, lambda i, h, b: (b, h, i, 0)))
  _add_dropout_seed(inputs, x)
  kernel = functools.partial(
      _dq_kernel, feat=feat, block_k=bk_q, num_tiles=nk)
  results = _pallas_call(kernel, inputs, outputs, (nq, n, b), warps, stages,
                         "flash_bwd_dq")
  dq = results[0][:, :t, :, :h]
  dk, dv = dk[:, :s, :, :h], dv[:, :s, :, :h]
  dbias = None
  if db is not None:
    dbias = results[1]
    dbias = dbias[:, :, :t] if db[2] else dbias.sum(axis=2, keepdims=True)
    dbias = dbias[:, :, :, :s] if db[3] else dbias
    if not db[0]:
      dbias = dbias.sum(axis=0, keepdims=True)
    if not db[1]:
      dbias = dbias.sum(axis=1, keepdims=True)
    dbias = dbias.astype(bias.dtype)
  return dq, dk, dv, dbias


def _check(q, k, v, bias, info, params):
  """Declines calls the Triton lowering cannot run here."""
  del q, k, v, bias, info, params
  platform = jax.default_backend()
  if platform not in ("cpu", "gpu", "cuda", "rocm"):
    raise NotImplementedError(
        f"the triton implementation needs a GPU (or CPU interpret mode), "
        f"not {platform=}.")


BACKEND = vjp.Backend(
    name="triton",
    forward=_forward,
    backward=_backward,
    check=_check,
    block_sizes_type=TritonBlockSizes,
    default_block_sizes=default_block_sizes,
    dropout=True,
)
