"""1-byte cache tiles (int8, float8) to float16 in registers, for the decode
kernel's float16 products.

**Key tiles, int8** (`to_float16`). Triton's own int8 -> bfloat16
conversion takes about two instructions a value (sm_90a, the decode
kernel's interior loop over an int8 cache, per warp per 64 keys: 153 LOP3,
112 PRMT and 64 bfloat16x2 adds of 772 instructions). Here four packed
values convert at once by the magic-number trick: the bytes, their sign
bits flipped (x + 128 as an unsigned byte), go under float16's exponent
of 1024 (0x64uu is 1024 + u: float16 has ulp 1 in [1024, 2048)), and one
float16x2 subtraction of 1152 gives x, exactly, for two values: one xor,
two byte permutes and two subtractions per four values.

**Value tiles** (`word_values`). P.V reduces over the keys, the rows of
V: a product operand holds pairs of values of consecutive keys, and
Triton reads a 1-byte tile into that layout from shared memory one byte
a value (LDS.U8, then byte permutes to pack them: 64 loads and 48 PRMT
per thread per 64 keys at H = 128, in both 1-byte forms). So the value
cache comes in as int32 words of four values along the head dim
(`as_words`, a bitcast of the cache, no copy; where a program's value
chunk has 128 columns or more), the tile as [keys, Hv / 4]
words, and `word_values(w, j)` is the float16 tile of each word's value j
(head-dim columns j, j + 4, ...): one instance takes the words of two
consecutive keys, which Triton loads 4 bytes at a time straight into the
operand layout, and leaves the pair in one float16x2 register: for int8
a byte permute, a LOP3 (the sign flip and the exponent in one) and a
subtraction per two values, for float8 a byte permute and the hardware's
float8x2 -> float16x2 conversion. The kernel runs four products of Hv / 4
columns and stores their columns with a stride of 4. A probe kernel
(one P.V of a 64 x 128 tile, sm_90a): 240 instructions against 384.

float16 holds every int8 and float8 value, so the products are those of
the stored values. Interpreted (CPU) and on ROCm, jax.numpy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_fa import gpu_target

# `prmt.b32 d, a, b, sel` takes result byte i (from the lowest) from byte
# `sel`'s nibble i of {b, a} (0-3: a's, 4-7: b's).
SIGN_FLIP = 0x80808080  # x ^ 0x80 is x + 128 as an unsigned byte.
EXPONENT = 0x64646464  # float16 0x64uu is 1024 + u.
SELECTORS = (0x5140, 0x5342)  # {u0, 64, u1, 64}, {u2, 64, u3, 64}.
OFFSET = 0x64806480  # float16x2 (1152, 1152), 1152 = 1024 + 128.
LOW_BYTES = 0x00FF00FF
# Four int8 values in $2 (value i in byte i) to four float16 in $0
# (values 0, 1) and $1 (values 2, 3).
_TO_FLOAT16 = (
    "{ .reg .b32 t, c; "
    f"xor.b32 t, $2, {SIGN_FLIP:#x}; "
    f"prmt.b32 $0, t, {EXPONENT:#x}, {SELECTORS[0]:#x}; "
    f"prmt.b32 $1, t, {EXPONENT:#x}, {SELECTORS[1]:#x}; "
    f"mov.b32 c, {OFFSET:#x}; "
    "sub.f16x2 $0, $0, c; "
    "sub.f16x2 $1, $1, c; }")


def pair_selector(j: int) -> int:
  """prmt's selector of byte j of two words: result bytes {a_j, a_j, b_j,
  b_j}, so that each half's low byte is one word's value j."""
  return j | j << 4 | (4 + j) << 8 | (4 + j) << 12


def _int8_pair(j: int) -> str:
  """Value j of the words $1 and $2 to float16x2 $0 (low half: $1's):
  (x & 0x00FF00FF) ^ 0x64806480 flips the sign bits and sets the
  exponent in one LOP3 (its table 0x6a is (a & b) ^ c), then 1152 off."""
  return ("{ .reg .b32 x, c; "
          f"prmt.b32 x, $1, $2, {pair_selector(j):#x}; "
          f"lop3.b32 $0, x, {LOW_BYTES:#x}, {OFFSET:#x}, 0x6a; "
          f"mov.b32 c, {OFFSET:#x}; "
          "sub.f16x2 $0, $0, c; }")


def _float8_pair(j: int, dtype) -> str:
  """Value j of the words $1 and $2 to float16x2 $0 (low half: $1's): the
  two bytes side by side in the low half-word, then one float8x2 ->
  float16x2 conversion."""
  kind = "e4m3x2" if jnp.dtype(dtype) == jnp.float8_e4m3fn else "e5m2x2"
  return ("{ .reg .b32 x; .reg .b16 lo, hi; "
          f"prmt.b32 x, $1, $2, {j | (4 + j) << 4:#x}; "
          "mov.b32 {lo, hi}, x; "
          f"cvt.rn.f16x2.{kind} $0, lo; }}")


def to_float16(x):
  """An int8 tile as float16 (exact), four packed values at a time."""
  if x.dtype != jnp.int8:
    raise TypeError(f"to_float16 converts int8 tiles, got {x.dtype}.")
  if not gpu_target.builds_ptx() or x.size % 4:
    return x.astype(jnp.float16)
  (out,) = pltriton.elementwise_inline_asm(
      _TO_FLOAT16, args=[x], constraints="=r,=r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])
  return out


def as_words(x):
  """A 1-byte array [..., H] (H a multiple of 4) as int32 [..., H / 4],
  word c holding values 4c .. 4c + 3 (value j in byte j): a bitcast."""
  if x.shape[-1] % 4:
    raise ValueError(f"as_words needs a head dim divisible by 4, got "
                     f"{x.shape}.")
  return jax.lax.bitcast_convert_type(
      x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4), jnp.int32)


def word_values(words, j: int, dtype):
  """The float16 tile of value j of each int32 word of a tile of `dtype`
  (1-byte) values packed by `as_words`: [..., H / 4] -> [..., H / 4]."""
  if not gpu_target.builds_ptx() or words.size % 2:
    values = jax.lax.bitcast_convert_type(words, jnp.int8)[..., j]
    if jnp.dtype(dtype) != jnp.int8:
      values = jax.lax.bitcast_convert_type(values, dtype)
    return values.astype(jnp.float16)
  asm = (_int8_pair(j) if jnp.dtype(dtype) == jnp.int8
         else _float8_pair(j, dtype))
  (out,) = pltriton.elementwise_inline_asm(
      asm, args=[words], constraints="=r,r,r", pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.float16)])
  return out
