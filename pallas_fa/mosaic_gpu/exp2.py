"""A logit tile's exponentials split between MUFU and the FMA pipe.

The forward's softmax takes one MUFU.EX2 per logit, and an SM issues 16 of
those a clock against 128 FMAs. In the float8 forward, whose products take
half the bf16 clocks, MUFU then sets the pace (FlashAttention-4 makes the
same observation on Blackwell). `split_exp2` computes one column group in
`every` of a tile's 2^x instead as

  2^x = 2^floor(x) * p(x - floor(x)),  p a cubic fitted to 2^f on [0, 1),

with floor(x) taken by one add rounded down (the integer lands in the low
mantissa bits of x + 1.5 * 2^23) and 2^floor(x) put in by an integer add
to p's exponent field: eight FMA-pipe and two integer instructions, no
MUFU. p's relative error is below 9e-5, under the float32 P's use (P goes
to the products in bfloat16 or e4m3 and to the row sums in float32, where
the logits' own rounding is larger).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

# p(f) = 1 + f (C1 + f (C2 + f C3)): the cubic through p(0) = 1 (so that
# 2^-127 comes out exactly 0) with the least largest relative error on
# [0, 1] (8.6e-5), each coefficient rounded to float32.
C1, C2, C3 = 0.6951160430908203, 0.22764834761619568, 0.07706397771835327
# Below it the exponent field would underflow: 2^x is 0 there, as
# MUFU.EX2's flush to zero gives.
LOWEST = -127.0
# 1.5 * 2^23: x + ROUND_BIAS rounded down holds floor(x) in its low bits
# for |x| < 2^22.
ROUND_BIAS = 12582912.0
# Columns per register group of the wgmma accumulator layout: a thread
# holds two adjacent columns of each 8-column group (in two rows).
GROUP = 8


def _hex(x: float) -> str:
  return "0f" + np.float32(x).view(np.uint32).tobytes()[::-1].hex().upper()


# One float32 in ($1), 2^x out ($0).
_POLY_PTX = (
    "{ .reg .f32 x, t, j, f, p; .reg .b32 e, pb;\n"
    f"max.f32 x, $1, {_hex(LOWEST)};\n"
    f"add.rm.f32 t, x, {_hex(ROUND_BIAS)};\n"
    f"sub.rn.f32 j, t, {_hex(ROUND_BIAS)};\n"
    "sub.rn.f32 f, x, j;\n"
    f"fma.rn.f32 p, f, {_hex(C3)}, {_hex(C2)};\n"
    f"fma.rn.f32 p, p, f, {_hex(C1)};\n"
    "fma.rn.f32 p, p, f, 0f3F800000;\n"
    "mov.b32 e, t;\n"
    "shl.b32 e, e, 23;\n"
    "mov.b32 pb, p;\n"
    "add.s32 $0, pb, e; }")
_MUFU_PTX = "ex2.approx.ftz.f32 $0, $1;"


def poly_exp2(x):
  """2^x by the cubic, in jnp: the compiled kernels' arithmetic (up to the
  FMAs' single rounding), for the interpreter and the tests."""
  x = jnp.maximum(x.astype(jnp.float32), LOWEST)
  j = jnp.floor(x)
  f = x - j
  p = 1.0 + f * (C1 + f * (C2 + f * C3))
  bits = lax.bitcast_convert_type(p, jnp.int32) + j.astype(jnp.int32) * (
      1 << 23)
  return lax.bitcast_convert_type(bits, jnp.float32)


def on_fma(shape, every: int):
  """Whether each entry of a [rows, keys] tile is computed by the cubic:
  the keys of every `every`-th 8-column group (the last of each run)."""
  cols = lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
  return (cols // GROUP) % every == every - 1


def split_exp2(x, every: int, *, interpret: bool):
  """2^x of a float32 [rows, keys] logit tile in the wgmma accumulator
  layout, one 8-column group in `every` on the FMA pipe (`poly_exp2`),
  the others on MUFU."""
  if interpret:
    return jnp.where(on_fma(x.shape, every), poly_exp2(x), jnp.exp2(x))
  return _split_compiled(x, every)


def _split_compiled(x, every: int):
  # Imported here: only compiled kernels reach this.
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  from jax._src.lib.mlir.dialects import llvm  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415

  x = plgpu.layout_cast(x, plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(
          x.shape, jnp.float32, layout=plgpu.Layout.WGMMA))
  def split(_, tile):
    regs = tile.registers
    if regs.ndim < 2 or regs.shape[1] * GROUP != tile.shape[1]:
      raise NotImplementedError(
          f"split_exp2: unexpected register shape {regs.shape} for a "
          f"{tile.shape} tile")
    f32 = ir.F32Type.get()
    i32 = ir.IntegerType.get_signless(32)
    out = np.empty(regs.shape, dtype=object)
    for idx, reg in np.ndenumerate(regs):
      ptx = _POLY_PTX if idx[1] % every == every - 1 else _MUFU_PTX
      vec = reg
      for lane in range(ir.VectorType(reg.type).shape[0]):
        pos = llvm.ConstantOp(i32, ir.IntegerAttr.get(i32, lane)).result
        value = llvm.inline_asm(
            f32, [llvm.extractelement(reg, pos)], ptx, "=f,f",
            asm_dialect=0)
        vec = llvm.insertelement(vec, value, pos)
      out[idx] = vec
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT,
                              _is_signed=None)

  return split(x)
