"""Quantized attention inputs: int8/float8 values with float32 scales.

One convention for every quantized array the library reads (float8
query/key/value of `flash_attention`, int8/float8 caches of
`decode_attention`): values `x` of a narrow dtype and a float32 `scale`
broadcastable to `x.shape[:-1]`, one scale per head-dim vector at most, so
that the array meant is

    dequantize(x, scale) = x.astype(float32) * scale[..., None].

A scale of shape `x.shape[:-1]` is per token (and head), one of shape
[*B, 1, N] (or [N]) per head, a scalar per tensor. `quantize` makes such a
pair by symmetric absmax scaling; `quantize_fp8` is its float8 form for
query/key/value [*B, T, N, H] at a named granularity.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import jax.numpy as jnp
from jax import lax

Array = Any

# The narrow dtypes, each with the largest magnitude it holds.
QUANTIZED_DTYPES = {
    jnp.dtype(jnp.int8): 127.0,
    jnp.dtype(jnp.float8_e4m3fn): float(jnp.finfo(jnp.float8_e4m3fn).max),
    jnp.dtype(jnp.float8_e5m2): float(jnp.finfo(jnp.float8_e5m2).max),
}
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))

# `quantize_fp8` granularities -> the axes of [*B, T, N, H] one scale spans
# (from the end; the head dim H always).
GRANULARITIES = {"token": (-1,), "head": (-3, -1), "tensor": None}


def is_quantized(dtype) -> bool:
  """Whether arrays of this dtype hold quantized values (with scales)."""
  return jnp.dtype(dtype) in QUANTIZED_DTYPES


def is_fp8(dtype) -> bool:
  """Whether `dtype` is one of the float8 formats the library reads."""
  return jnp.dtype(dtype) in FP8_DTYPES


def as_dtype(dtype: Any):
  """`jnp.dtype(dtype)`, or None where that is no dtype at all (a string
  such as "fp8", numpy's "data type not understood"), so that a caller can
  name its argument in the error."""
  try:
    return jnp.dtype(dtype)
  except (TypeError, ValueError):
    return None


def check_granularity(name: str, granularity: Any) -> str:
  """`granularity` if it is one of `GRANULARITIES`.

  Raises:
    ValueError: it is not (the message names `name`).
  """
  if not isinstance(granularity, str) or granularity not in GRANULARITIES:
    raise ValueError(
        f"{name} must be one of {tuple(GRANULARITIES)}, got {granularity!r}.")
  return granularity


def quantize(x: Array, dtype=jnp.int8,
             axes: Sequence[int] | None = (-1,)) -> tuple[Array, Array]:
  """Symmetric absmax quantization, one scale per slice over `axes`.

  Args:
    x: float values [..., H].
    dtype: int8, float8_e4m3fn or float8_e5m2.
    axes: the axes one scale spans, including the last (the head dim);
      None for all (one scale for the whole array).

  Returns:
    (values, scale): `values` of `dtype` shaped like x, and a float32
    `scale` of rank `x.ndim - 1` (shape `x.shape[:-1]` with 1 on the
    other `axes`; a scalar when `axes` is None) equal to absmax / 127 for
    int8 and absmax / the format's largest finite value for float8, so
    that `dequantize(values, scale)` approximates x (int8 values rounded to
    nearest, float8 ones as the cast rounds). A slice of zeros gets scale
    1 and values 0, which round-trip to zeros.

  Raises:
    TypeError: `dtype` is not one of the three, or x is not a floating
      array.
    ValueError: x is a scalar.
  """
  if as_dtype(dtype) not in QUANTIZED_DTYPES:
    raise TypeError(
        f"quantize's dtype must be int8, float8_e4m3fn or float8_e5m2, got "
        f"dtype={_dtype_name(dtype)}.")
  dtype = jnp.dtype(dtype)
  try:
    x = jnp.asarray(x)
  except (TypeError, ValueError):
    # None or an object: jnp's own message names neither x nor the call.
    raise TypeError(
        f"quantize takes an array x, got {type(x).__name__}.") from None
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantize takes float values, got x.dtype={x.dtype}.")
  if not x.ndim:
    raise ValueError("quantize takes x of rank >= 1 ([..., H]: a scale "
                     "spans the last axis at least), got a scalar.")
  wide = x.astype(jnp.float32)
  # `initial`: an empty slice (a call with no tokens) has absmax 0.
  absmax = jnp.max(jnp.abs(wide), axis=None if axes is None else tuple(axes),
                   keepdims=True, initial=0.0)
  scale = absmax_scale(absmax, dtype)
  values = scaled_values(wide, scale, dtype)
  scale = scale.reshape(()) if axes is None else scale[..., 0]
  return values, scale.astype(jnp.float32)


def absmax_scale(absmax: Array, dtype) -> Array:
  """The float32 scale of a slice whose largest magnitude is `absmax`
  (`quantize`'s; also computed inside the Mosaic GPU decode kernel, for
  its e4m3 query rows)."""
  largest = QUANTIZED_DTYPES[jnp.dtype(dtype)]
  # A NaN or inf in a slice makes its scale NaN or inf, so it dequantizes
  # to NaN (int8 would otherwise cast a NaN to some integer silently). A
  # scale below float32's smallest normal would be flushed to 0 (XLA:CPU
  # does), and the values divided by it inf or NaN: such a slice (absmax
  # under about 5e-36) takes the smallest normal.
  tiny = float(jnp.finfo(jnp.float32).tiny)
  return jnp.where(absmax == 0, jnp.ones_like(absmax),
                   jnp.maximum(absmax / largest,
                               jnp.full_like(absmax, tiny)))


def scaled_values(wide: Array, scale: Array, dtype) -> Array:
  """float32 `wide` over its `scale` (broadcast against it) as `dtype`'s
  values: `quantize`'s rounding."""
  largest = QUANTIZED_DTYPES[jnp.dtype(dtype)]
  # The clamp only guards the last ulp of absmax / scale: a float8 value
  # above the format's largest would become NaN (e4m3fn has no inf).
  scaled = jnp.minimum(jnp.maximum(wide / scale,
                                   jnp.full_like(wide, -largest)),
                       jnp.full_like(wide, largest))
  if jnp.dtype(dtype) == jnp.int8:
    scaled = jnp.round(scaled)
  return scaled.astype(dtype)


def quantize_fp8(x: Array, granularity: str = "head",
                 dtype=jnp.float8_e4m3fn) -> tuple[Array, Array]:
  """Float8 query, key or value with float32 scales for `flash_attention`.

  Args:
    x: float [*B, T, N, H] (any leading batch dims, none included).
    granularity: what one scale covers: "token" (one head of one token:
      scale [*B, T, N]), "head" (one head of one batch row over all its
      tokens: scale [*B, 1, N], FlashAttention-3's per-(batch, head)
      descale) or "tensor" (the whole array: a scalar).
    dtype: float8_e4m3fn (the forward format of FP8 attention) or
      float8_e5m2.

  Returns:
    (x8, scale), `dequantize(x8, scale)` approximating x: pass them as
    `flash_attention(x8, ..., query_scale=scale)` (or key_scale /
    value_scale). Finer granularities lose less to outliers elsewhere in
    the array. Each slice's largest magnitude maps to the format's
    largest value, so e4m3 (3 mantissa bits) keeps a relative error of at
    most 2**-4 for values down to about 2**-15 of their slice's largest
    (its normal range); smaller ones land on its subnormals or zero, an
    absolute error of at most about 2**-19 of that largest.

  Raises:
    ValueError: x has fewer than 3 dims or `granularity` is unknown.
    TypeError: `dtype` is not a float8 format, or x is not floating.
  """
  granularity = check_granularity("granularity", granularity)
  if as_dtype(dtype) not in FP8_DTYPES:
    raise TypeError(
        f"quantize_fp8's dtype must be float8_e4m3fn or float8_e5m2, got "
        f"dtype={_dtype_name(dtype)}.")
  x = jnp.asarray(x)
  if x.ndim < 3:
    raise ValueError(
        f"quantize_fp8 takes query/key/value [*B, T, N, H], got "
        f"x.shape={x.shape}.")
  return quantize(x, dtype, GRANULARITIES[granularity])


def _dtype_name(dtype) -> str:
  """A dtype argument for a message: its dtype's name, else as passed."""
  parsed = None if dtype is None else as_dtype(dtype)
  return repr(dtype) if parsed is None else str(parsed)


def float16_unit(largest: Array) -> tuple[Array, Array]:
  """(2^e, 2^-e) in float32 for a slice whose largest magnitude is
  `largest` (float32, any shape): 2^e takes it into [2^14, 2^15), so that
  the slice times 2^e fits float16 with every bit a bfloat16 value has
  but for entries 2^28 below the largest (float16's subnormals). Both are
  clipped to float32's normal range where `largest` is 0 or not finite.
  The decode kernels read 1-byte caches through it: bfloat16 queries (or P
  times per-key scales) scaled into float16, so that the products run on
  float16 tiles, which every int8 and float8 value converts to in one or
  two instructions."""
  bits = lax.bitcast_convert_type(largest, jnp.int32)
  exponent = lax.shift_right_logical(bits, jnp.int32(23)) & 0xFF
  # e = 14 - the exponent: 2^e's biased exponent is 127 + e.
  biased = jnp.clip(268 - exponent, 1, 253)
  return (lax.bitcast_convert_type(lax.shift_left(biased, jnp.int32(23)),
                                   jnp.float32),
          lax.bitcast_convert_type(
              lax.shift_left(254 - biased, jnp.int32(23)), jnp.float32))


# The magnitude bits (sign cleared) from which a float8 dtype's values are
# inf or NaN: e4m3fn has no inf and one NaN (S.1111.111), e5m2 has IEEE's
# all-ones exponent.
_FP8_SPECIAL = {jnp.dtype(jnp.float8_e4m3fn): 0x7F,
                jnp.dtype(jnp.float8_e5m2): 0x7C}


def float8_bits_as_float32(bits: Array, dtype) -> Array:
  """The values of float8 `dtype` (e4m3fn or e5m2) whose bits are the
  uint8 `bits`, as float32, exactly: the magnitude's exponent re-biased
  into float32's; a subnormal, which that reads with an implicit leading 1
  (the smallest normal value added), as twice that less the smallest
  normal; inf and NaN (payload kept) from the magnitudes past
  `_FP8_SPECIAL`; then the sign bit.

  XLA:CPU converts float8 one element at a time (about 1.5-2 ns an
  element on a 2-core x86-64, 15x its int8 conversion) and has no float8
  dynamic slices; these integer and float32 operations vectorise
  (`decode.chunked` slices a float8 cache as its bits and widens each
  tile so).
  """
  info = jnp.finfo(dtype)
  mantissa_bits, bias = info.nmant, 1 - info.minexp
  bits = bits.astype(jnp.int32)
  magnitude = bits & 0x7F
  aligned = lax.shift_left(magnitude, jnp.int32(23 - mantissa_bits))
  value = lax.bitcast_convert_type(aligned + ((127 - bias) << 23),
                                   jnp.float32)
  smallest_normal = 2.0 ** (1 - bias)
  value = jnp.where(magnitude < (1 << mantissa_bits),
                    2 * value - smallest_normal, value)
  value_bits = jnp.where(magnitude >= _FP8_SPECIAL[jnp.dtype(dtype)],
                         aligned | 0x7F800000,
                         lax.bitcast_convert_type(value, jnp.int32))
  return lax.bitcast_convert_type(
      value_bits | lax.shift_left(bits & 0x80, jnp.int32(24)), jnp.float32)


def dequantize(x: Array, scale: Array | None, dtype=jnp.float32) -> Array:
  """The array a quantized pair means: `x.astype(dtype) * scale[..., None]`
  (a missing scale is 1; `scale` broadcastable to `x.shape[:-1]`)."""
  # Converted as is, never through the bits (`float8_bits_as_float32`):
  # `chunked`'s forward transposes float8 inputs into tiles, and where they
  # were constants of a jitted call XLA:CPU's constant folding read the
  # transposed literal's bits in their stored order (jaxlib 0.10.2 and
  # 0.11.2: a bitcast-convert folded on a literal with a permuted layout).
  x = x.astype(dtype)
  if scale is None:
    return x
  scale = jnp.asarray(scale, dtype)
  # Explicit leading 1s: callers may run with rank promotion disallowed.
  return x * scale.reshape((1,) * (x.ndim - 1 - scale.ndim) + scale.shape
                           + (1,))


def scale_grad(dx: Array, x: Array, scale: Array) -> Array:
  """The gradient of `scale` from the gradient `dx` of `dequantize(x,
  scale)`: sum(dx * x) over the head dim and over the axes the scale is
  broadcast along, shaped like `scale` (rank `x.ndim - 1`, float32).

  Where dx is 0 the term is 0 whatever x holds: padded rows get dx = 0 and
  may store NaN, which must not leak into the scale's gradient.
  """
  dx, x = dx.astype(jnp.float32), x.astype(jnp.float32)
  d = jnp.sum(jnp.where(dx == 0, 0.0, dx * x), axis=-1)
  axes = tuple(a for a, (n, m) in enumerate(zip(scale.shape, d.shape))
               if n == 1 and m != 1)
  return jnp.sum(d, axis=axes, keepdims=True).astype(scale.dtype)
