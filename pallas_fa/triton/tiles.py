"""Tile sizes of the `triton` kernels: the shared-memory model and the
heuristic.

`triton.heuristic_block_sizes` turns `heuristic` into a `TritonBlockSizes`;
`triton.default_block_sizes` prefers a tuned record (`pallas_fa.tuning`).
The register budgets behind the heuristic were read off ptxas
(`scripts/compile_check.py`), the shared-memory budgets off the devices.
"""

from __future__ import annotations

import dataclasses

from pallas_fa import layout

# Triton's tl.dot needs every matmul dimension to be at least 16.
MIN_BLOCK = 16
MAX_BLOCK = 512
# Tiles cut from short sequences, and the head dim, are powers of two of at
# least MIN_BLOCK (`tl.arange` needs powers of two).
ALIGN = layout.Alignment(rows=MIN_BLOCK, head_dim=MIN_BLOCK, power_of_two=True)


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


# Head dims below are padded: hp of q/k, hvp of v, the output and dO.


def _forward_bytes(bq, bk, hp, hvp, itemsize, stages, dense=0):
  # Q stays resident; K and V tiles (and a dense mask or bias tile, `dense`
  # bytes a logit) are multi-buffered by the pipeliner.
  return (bq * hp + stages * bk * (hp + hvp)) * itemsize + (
      stages * bq * bk * dense)


def _backward_bytes(b_rows, b_stream, hp, hvp, itemsize, stages, dense=0):
  # One side resident (two tiles: K,V or Q,dO), the other side streamed (two
  # tiles per stage, and the dense tile), plus the f32 [rows, stream]
  # staging of P / dS.
  return (b_rows + stages * b_stream) * (hp + hvp) * itemsize + (
      b_rows * b_stream * (4 + stages * dense)
  )


def shared_memory_bytes(bs, head_dim: int, itemsize: int,
                        value_head_dim: int | None = None,
                        dense_itemsize: int = 0) -> dict[str, int]:
  """Estimated shared memory (bytes) of the forward, dQ and dK/dV kernels.

  Args:
    bs: the tiling (a `triton.TritonBlockSizes`).
    head_dim: the unpadded query/key head dim H.
    itemsize: bytes per element of q/k/v.
    value_head_dim: the unpadded value head dim Hv; None: H.
    dense_itemsize: bytes per logit of the dense mask and bias the call
      reads (a mask's int8 plus the bias's dtype); 0 without them.

  Returns:
    dict with keys "forward", "dq", "dkv".
  """
  hp = layout.padded_head_dim(head_dim, ALIGN)
  hvp = layout.padded_head_dim(value_head_dim or head_dim, ALIGN)
  stages = bs.backward_stages
  return {
      "forward": _forward_bytes(
          bs.block_q, bs.block_kv, hp, hvp, itemsize, bs.num_stages,
          dense_itemsize),
      "dq": _backward_bytes(
          bs.block_q_dq, bs.block_kv_dq, hp, hvp, itemsize, stages,
          dense_itemsize),
      "dkv": _backward_bytes(
          bs.block_kv_dkv, bs.block_q_dkv, hp, hvp, itemsize, stages,
          dense_itemsize),
  }


def heuristic(hp: int, hvp: int, itemsize: int, kind: str) -> dict[str, int]:
  """FlashAttention-2 style tiles, shrunk until they fit shared memory.

  Registers are budgeted for the wider of the two head dims (every tile and
  accumulator is at most that wide; where ptxas showed mixed widths to need
  more, below, less), shared memory for both.

  Args:
    hp: the padded query/key head dim.
    hvp: the padded value head dim.
    itemsize: bytes per element of q/k/v.
    kind: a `jax.Device.device_kind`.

  Returns:
    The fields of a `triton.TritonBlockSizes`.
  """
  if "cpu" in kind.lower():
    # Interpret mode: the cost is per grid step and per loop iteration, so
    # large tiles are fastest; there is no shared memory to respect.
    return dict(
        block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128,
        block_q_dq=128, block_kv_dq=128, num_warps=4, num_stages=1)
  budget = shared_memory_budget(kind)
  wide = itemsize >= 4  # float32 tiles take twice the memory.
  # Hopper's wgmma reads both operands from shared memory; older GPUs
  # (mma.sync) hold them in registers, which leaves less for accumulators.
  hopper = any(name in kind for name in HOPPER_KINDS)
  # Register budgets below were read off ptxas (`scripts/compile_check.py`):
  # each choice is the largest tiling that compiles without spilling.
  widest, mixed = max(hp, hvp), hp != hvp
  # Float8 tiles are converted in registers (`kernel`'s float8 forward).
  fp8 = itemsize == 1
  if widest <= 64:
    fwd = (128, 64 if wide else 128)
    # Four warps fill their registers exactly (255 at H = Hv = 64); a
    # narrower V already spills there (H=64, Hv=32), so only H = Hv gets it
    # (not float8: 88 B spilled, ptxas, H100).
    warps = 4 if hopper and not wide and not mixed and not fp8 else 8
  elif widest <= 128:
    # Hopper: 128-key tiles halve the loop's per-iteration rescales and
    # waits (H200, H = 128 bf16: 493 against 461 TFLOP/s at T = 16384, 456
    # against 434 at 4096, causal unchanged; 220 registers, 0 spills).
    # Not with float8 tiles, whose conversions take the registers.
    wide_keys = hopper and not wide and not fp8
    fwd = (128, 32 if wide else 128 if wide_keys else 64)
    warps = 8
  else:
    fwd = (32 if wide else 64, 32)
    warps = 8
  # dK/dV keeps a K/V tile resident and streams Q; dQ the converse. The
  # streamed side is the narrow one (FlashAttention-2 §3.2). dK/dV works on
  # S^T = K Q^T, so its key tile is the M dimension of every matmul (at
  # least 64, one Hopper wgmma, where registers allow): the two float32
  # accumulators (dK [block_kv, Hp], dV [block_kv, Hvp]) plus the
  # [block_kv, block_q] logits must fit 8 warps' registers. At head dim
  # 256 that caps the key tile at 32.
  if widest <= 64:
    dkv, dq = (64 if hopper and not wide else 32, 128), (128, 64)
  elif widest <= 128:
    dkv, dq = (32, 128 if hopper and not wide else 64), (128, 32)
  else:
    dkv, dq = (16, 32), (64, 32)
  if wide:
    # float32 operands: twice the registers per element again.
    if widest <= 64:
      dkv, dq = (16, dkv[1]), (32, 64)
    elif widest <= 128:
      dkv, dq = (16, 32), (32, 32)
    else:
      dkv, dq = (16, 16), (16, 32)
  if hvp > hp and not hopper and not wide:
    # dK/dV with V wider than K needs more registers than with both at the
    # wider head dim on mma.sync GPUs (ptxas, A100: H=64, Hv=128 spills at
    # 32 query rows, not at 16).
    dkv = (16, dkv[1])
  warps_bwd = 8
  # Deeper backward pipelines than this spill at head dim 256.
  max_stages_bwd = 3 if widest <= 128 else 2

  def bwd_bytes(dkv, dq, stages):
    return max(_backward_bytes(dkv[1], dkv[0], hp, hvp, itemsize, stages),
               _backward_bytes(dq[0], dq[1], hp, hvp, itemsize, stages))

  # Deepest software pipeline that fits; shrink the resident tiles (never
  # below 32 rows) when not even one stage does.
  while _forward_bytes(*fwd, hp, hvp, itemsize, 1) > budget and fwd[0] > 32:
    fwd = (fwd[0] // 2, fwd[1])
  while bwd_bytes(dkv, dq, 1) > budget and max(dkv[1], dq[0]) > 32:
    dkv, dq = (dkv[0], max(32, dkv[1] // 2)), (max(32, dq[0] // 2), dq[1])
  # Past head dim 128 in float32 with Hv != H, shared memory allows a third
  # forward stage that spills on mma.sync GPUs (ptxas, A100: H=128, Hv=256;
  # H = Hv = 256 never fits three stages there).
  stages = 2 if widest > 128 and wide and mixed and not hopper else 3
  while stages > 1 and (
      _forward_bytes(*fwd, hp, hvp, itemsize, stages) > budget):
    stages -= 1
  stages_bwd = max_stages_bwd
  while stages_bwd > 1 and bwd_bytes(dkv, dq, stages_bwd) > budget:
    stages_bwd -= 1
  return dict(
      block_q=fwd[0], block_kv=fwd[1],
      block_q_dkv=dkv[0], block_kv_dkv=dkv[1],
      block_q_dq=dq[0], block_kv_dq=dq[1],
      num_warps=warps, num_stages=stages,
      num_warps_bwd=warps_bwd, num_stages_bwd=stages_bwd,
  )


def for_dense_tiles(bs, *, head_dim: int, value_head_dim: int,
                    itemsize: int, dense_itemsize: int, kind: str):
  """`bs` (a `triton.TritonBlockSizes`) adapted to a call that reads a dense
  mask or bias: each loop step loads its [rows, keys] tile beside the
  streamed K/V (or Q/dO) tiles, and the pipeliner buffers it per stage as
  it does them, which `heuristic`'s budget leaves out (H100, H = 64,
  bfloat16 with a float32 bias: 246784 B of 232448 at three stages of
  128 x 128 tiles). Fewer stages first (not below two), then narrower
  streamed tiles (not below 64), then one stage, then down to 16. The
  tile is added in registers too: a 4-warp forward spills (ptxas, H100,
  H = 64: 268 B), so the dropout rule of eight warps holds.

  Args:
    bs: the tiling.
    head_dim, value_head_dim: the unpadded head dims H and Hv.
    itemsize: bytes per element of q/k/v.
    dense_itemsize: `shared_memory_bytes`'.
    kind: a `jax.Device.device_kind`.
  """
  if not dense_itemsize or "cpu" in kind.lower():
    return bs
  # The backward's stages fixed before the forward's shrink, which an
  # unset `num_stages_bwd` would otherwise follow.
  bs = dataclasses.replace(for_dropout(bs, True),
                           num_stages_bwd=bs.backward_stages)
  budget = shared_memory_budget(kind)

  def smem(bs):
    return shared_memory_bytes(bs, head_dim, itemsize, value_head_dim,
                               dense_itemsize)

  def shrink(bs, kernels, stages_field, stream_fields):
    """Fewer stages, then narrower `stream_fields` tiles, until `kernels`
    fit."""
    while max(smem(bs)[k] for k in kernels) > budget:
      stages = getattr(bs, stages_field)
      stream = max(getattr(bs, f) for f in stream_fields)
      if stages > 2 or (stages > 1 and stream <= 64):
        bs = dataclasses.replace(bs, **{stages_field: stages - 1})
      elif stream > MIN_BLOCK:
        bs = dataclasses.replace(bs, **{
            f: min(getattr(bs, f), stream // 2) for f in stream_fields})
      else:
        break
    return bs

  bs = shrink(bs, ("forward",), "num_stages", ("block_kv",))
  # dQ streams key tiles, dK/dV query tiles.
  return shrink(bs, ("dq", "dkv"), "num_stages_bwd",
                ("block_kv_dq", "block_q_dkv"))


def for_dropout(bs, dropout: bool):
  """`bs` (a `triton.TritonBlockSizes`) adapted to a call with dropout."""
  if dropout and bs.num_warps < 8:
    # The mask hash adds registers: a 4-warp forward spills (ptxas, H=64).
    return dataclasses.replace(bs, num_warps=8)
  return bs


def for_flex(bs, flex: bool, *, tables: bool = False, head_dim: int = 0):
  """`bs` adapted to a call with a score_mod or mask_mod: their index
  tiles add registers as dropout's hash does (ALiBi's 4-warp forward
  spills 36 B at H=64, bf16, 128 x 128 tiles: ptxas), so the same rule.

  A score_mod that reads a table at computed offsets (`tables`; T5's
  buckets take a logarithm per element, and the dQ kernel carries the
  partial table) needs more (ptxas, H100, bf16): at H = 64 the forward's
  third stage overflows shared memory and 64-row dK/dV query tiles spill,
  at H = 256 a 64-row dQ tile spills, and between them Hopper's 128-key
  forward tiles ask for 361 KB (3 stages); `head_dim` is the unpadded H."""
  bs = for_dropout(bs, flex)
  if not tables:
    return bs
  hp = layout.padded_head_dim(head_dim, ALIGN)
  changes = dict(block_q_dkv=min(bs.block_q_dkv, 32))
  if hp <= 64:
    changes["num_stages"] = min(bs.num_stages, 2)
  elif hp <= 128:
    changes["block_kv"] = min(bs.block_kv, 64)
  if hp > 128:
    changes["block_q_dq"] = min(bs.block_q_dq, 32)
  return dataclasses.replace(bs, **changes)
