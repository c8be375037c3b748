"""int8 tiles to float16 in registers, five instructions per four values.

Triton's own int8 -> bfloat16 conversion of a cache tile takes about two
instructions a value (sm_90a, the decode kernel's interior loop over an
int8 cache, per warp per 64 keys: 153 LOP3, 112 PRMT and 64 bfloat16x2
adds of 772 instructions). `to_float16` converts four packed values at
once with the magic-number trick: the bytes, their sign bits flipped (x +
128 as an unsigned byte), are placed under float16's exponent of 1024
(0x64uu is 1024 + u: float16 has ulp 1 in [1024, 2048)), and one
float16x2 subtraction of 1152 gives x, exactly, for two values: one xor,
two byte permutes and two subtractions per four values (703 instructions
in that loop). float16 holds every int8 value, so the products that
follow are those of the int8 values themselves.

What it leaves: Triton moves a unary conversion of a product's operand to
the operand's register layout, so the V tile (keys on P.V's reduction
axis) is still read from shared memory one byte a value (64 LDS.U8 and 48
PRMT that pack them, per thread per 64 keys). Keeping the conversion in
the load layout (a select after it does) sends the float16 tile through
shared memory instead, and costs more than it saves there (773).

Interpreted (CPU) and on ROCm, `astype`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_fa import gpu_target

# Four int8 values in $2 (value i in byte i) become four float16 in $0
# (values 0, 1) and $1 (values 2, 3). `prmt.b32 d, a, b, sel` takes result
# byte i (from the lowest) from byte `sel`'s nibble i of {b, a} (0-3: a's).
SIGN_FLIP = 0x80808080  # x ^ 0x80 is x + 128 as an unsigned byte.
EXPONENT = 0x64646464  # float16 0x64uu is 1024 + u.
SELECTORS = (0x5140, 0x5342)  # {u0, 64, u1, 64}, {u2, 64, u3, 64}.
OFFSET = 0x64806480  # float16x2 (1152, 1152), 1152 = 1024 + 128.
_TO_FLOAT16 = (
    "{ .reg .b32 t, c; "
    f"xor.b32 t, $2, {SIGN_FLIP:#x}; "
    f"prmt.b32 $0, t, {EXPONENT:#x}, {SELECTORS[0]:#x}; "
    f"prmt.b32 $1, t, {EXPONENT:#x}, {SELECTORS[1]:#x}; "
    f"mov.b32 c, {OFFSET:#x}; "
    "sub.f16x2 $0, $0, c; "
    "sub.f16x2 $1, $1, c; }")


def to_float16(x):
  """An int8 tile as float16 (exact)."""
  if x.dtype != jnp.int8:
    raise TypeError(f"to_float16 converts int8 tiles, got {x.dtype}.")
  if not gpu_target.builds_ptx() or x.size % 4:
    return x.astype(jnp.float16)
  (out,) = pltriton.elementwise_inline_asm(
      _TO_FLOAT16, args=[x], constraints="=r,=r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])
  return out
