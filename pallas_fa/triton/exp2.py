"""2^x of the triton kernels' logit tiles, one MUFU.EX2 an element.

`jnp.exp2` lowers in Pallas-Triton to libdevice's exp2f, `ex2.approx.f32`
without flush-to-zero, which ptxas wraps in a compare and two multiplies
that rescale subnormal inputs and results (SASS of the H = 128 forward:
34 FSETP and 68 FMUL around its 34 MUFU.EX2 a thread per 128 x 64 tile,
a fifth of the loop's instructions). A probability below 2^-126 adds
nothing a float32 row sum or a 16-bit P can hold, so the tiles take
`ex2.approx.ftz.f32`: the MUFU alone, as the Mosaic GPU kernels' approx
math does. With a logit scale left to the softmax
(`online_softmax.update(scale=...)`) the exponent is one `fma.rn.f32` in
the same inline PTX: Pallas-Triton's arithmetic is not contracted, so a
multiply and a subtract would stay two instructions. Interpreted (CPU)
and on ROCm, jnp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_fa import gpu_target
from pallas_fa import online_softmax

_EX2 = "ex2.approx.ftz.f32 $0, $1;"
_FMA_EX2 = ("{ .reg .f32 t; fma.rn.f32 t, $1, $2, $3; "
            "ex2.approx.ftz.f32 $0, t; }")


def exp2(s, shift, scale: float | None = None):
  """2^(s * scale - shift) (scale None: 2^(s - shift)) of a float32 tile,
  results below 2^-126 flushed to 0 (`online_softmax.update`'s
  `tile_exp`)."""
  if s.dtype != jnp.float32 or not gpu_target.builds_ptx():
    return online_softmax.shifted_exp(jnp.exp2)(s, shift, scale)
  out_type = [jax.ShapeDtypeStruct(s.shape, jnp.float32)]
  shift = jnp.broadcast_to(shift, s.shape).astype(jnp.float32)
  if scale is None:
    args, asm = [s - shift], _EX2
  else:
    args, asm = [s, jnp.full(s.shape, scale, jnp.float32), -shift], _FMA_EX2
  (out,) = pltriton.elementwise_inline_asm(
      asm, args=args, constraints="=f" + ",f" * len(args), pack=1,
      result_shape_dtypes=out_type)
  return out
