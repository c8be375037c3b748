"""Argument checks of the public calls: each validates one argument (or one
family) and raises a ValueError/TypeError naming it (as the caller spells
it, `segment_ids.q.shape=...`, never a local variable's name).

`api.canonicalize` and `api.static_arguments` run them on every call of
`flash_attention`; the other public entry points (`decode_attention`, the
Flax modules, `pallas_fa.testing`) reuse them through `api`, which exports
the public ones under the same names.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from pallas_fa import quantize


def check_flag(name, x) -> bool:
  """x as a bool if it is one (Python's or numpy's): a truthy string or
  array would otherwise pass as a flag.

  Raises:
    TypeError: it is not (the message names `name`).
  """
  if not isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {name}={x!r}.")
  return bool(x)


# The kernels' index type.
_INT32 = np.iinfo(np.int32)


def as_array(name, x):
  """x as a jax array, or a TypeError naming `name` where it is not one
  (None, a list holding None, an object): jnp.asarray's own message names
  neither the argument nor the call."""
  if x is None:
    raise TypeError(f"{name} must be an array, got None.")
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:
    raise TypeError(
        f"{name} must be an array, got {type(x).__name__} {x!r:.80}: "
        f"{e}") from None


def _check_int_array(name, x, shape):
  x = as_array(name, x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(
        f"{name} must be an integer array, got {name}.dtype={x.dtype}.")
  if tuple(x.shape) != tuple(shape):
    raise ValueError(
        f"{name} must have shape {tuple(shape)}, got {name}.shape={x.shape}."
    )
  return x.astype(jnp.int32)


def check_lengths(name, x, batch_shape):
  """int [*B] (a scalar when there is one batch row) -> int32 [prod(B)]."""
  if x is None:
    return None
  # A traced 64-bit or unsigned length past int32 means "every position":
  # it must not wrap into a short one when cast.
  x = as_index_array(name, x)
  if x.ndim == 0 and math.prod(batch_shape) == 1:
    x = x.reshape(batch_shape)
  return _check_int_array(name, x, batch_shape).reshape(-1)


def check_int(name: str, x, low: int) -> int:
  """`x` as an int if it is an int (Python's or numpy's, not a bool) of at
  least `low`: a size or count, which a float would carry into shapes and
  indices (as float64 arrays or jax's shape errors) and a bool would pass
  for 0 or 1.

  Raises:
    TypeError: x is not an int (the message names `name`).
    ValueError: x < low.
  """
  if not isinstance(x, (int, np.integer)) or isinstance(x, (bool, np.bool_)):
    raise TypeError(
        f"{name} must be an int, got {type(x).__name__} {name}={x!r}.")
  if x < low:
    kind = "a positive int" if low == 1 else f"an int >= {low}"
    raise ValueError(f"{name} must be {kind}, got {name}={x!r}.")
  return int(x)


def check_positive_int(name: str, x) -> int:
  """`x` as an int if it is a positive int (`check_int` with low=1).

  Raises:
    TypeError: x is not an int (the message names `name`).
    ValueError: x < 1.
  """
  return check_int(name, x, 1)


def check_per_token(name, x, batch_shape, length):
  """int [*B, length] -> int32 [prod(B), length]."""
  # Explicit sizes: with an empty dim a -1 would be ambiguous (0 / 0).
  return _check_int_array(name, x, batch_shape + (length,)).reshape(
      math.prod(batch_shape), length)


def check_non_negative(name, x):
  """Rejects negative lengths when they are known (not traced) values.

  Traced negative lengths cannot be detected; they mean "all padding".
  """
  if x is None or isinstance(x, jax.core.Tracer):
    return
  values = np.asarray(x)
  if np.issubdtype(values.dtype, np.integer) and np.any(values < 0):
    raise ValueError(f"{name} must be non-negative, got {name}={values}.")


def check_int32_values(name, x, low=int(_INT32.min), high=int(_INT32.max),
                       why="int32, the kernels' index type"):
  """Rejects known (not traced) integer values outside [low, high]: the
  kernels index in int32, and a wider value would wrap silently (as jit's
  own cast of a 64-bit argument does).

  Traced values cannot be checked; they are cast. Arrays whose dtype
  cannot hold such a value are not read back from the device.
  """
  if x is None or isinstance(x, jax.core.Tracer):
    return
  if isinstance(x, (list, tuple)) and any(
      isinstance(e, jax.core.Tracer) for e in x):
    return
  dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
  if not np.issubdtype(dtype, np.integer):
    return  # The dtype checks under jit name a non-integer array.
  bounds = np.iinfo(dtype)
  if low <= bounds.min and bounds.max <= high:
    return
  values = np.asarray(x)
  if not values.size:
    return
  if values.min() < low or values.max() > high:
    raise ValueError(
        f"{name} must lie in [{low}, {high}] ({why}), got values in "
        f"[{values.min()}, {values.max()}].")


def as_index_array(name, x):
  """An integer index argument (lengths, positions, pages) as an array whose
  values survive the kernels' int32: known values outside it are an error
  (`check_int32_values`, before jnp.asarray wraps a 64-bit one without x64),
  traced ones of a wider or unsigned dtype are clamped into it instead of
  wrapping (a uint32 length of 2^32 - 1 is "every entry", not -1). Other
  dtypes pass through, for the caller's dtype check to name."""
  check_int32_values(name, x)
  x = as_array(name, x)
  if jnp.issubdtype(x.dtype, jnp.integer) and (
      jnp.iinfo(x.dtype).max > _INT32.max):
    x = jnp.clip(x, max(int(_INT32.min), int(jnp.iinfo(x.dtype).min)),
                 int(_INT32.max))
  return x


# Window sides from this on are unbounded, and positions given with a
# window lie within +-WINDOW_POSITIONS: their differences are then below
# any bounded side, and a position plus or minus a side fits int32, in
# which every backend compares them.
WINDOW_UNBOUNDED = 2**30
WINDOW_POSITIONS = 2**29


def check_window(local_window_size):
  if local_window_size is None:
    return None
  w = local_window_size
  if isinstance(w, (int, np.integer)) and not isinstance(w, bool):
    w = (int(w), int(w))
  if not isinstance(w, (tuple, list)) or len(w) != 2:
    raise ValueError(
        "local_window_size must be an int or a (left, right) pair, got "
        f"{local_window_size=}."
    )
  sides = []
  for side in w:
    if side is None:
      sides.append(None)
    elif isinstance(side, (int, np.integer)) and not isinstance(side, bool):
      if side < 0:
        raise ValueError(
            f"local_window_size sides must be >= 0, got {local_window_size=}."
        )
      sides.append(int(side) if side < WINDOW_UNBOUNDED else None)
    else:
      raise ValueError(
          "local_window_size sides must be ints or None, got "
          f"{local_window_size=}."
      )
  return None if sides == [None, None] else tuple(sides)


def check_static_float(name, x, positive=False):
  if x is None:
    return None
  if isinstance(x, jax.core.Tracer):
    raise TypeError(f"{name} must be a static Python float, got a tracer.")
  # float() would take "0.5" and True too: a string or a flag passed here
  # is a mistake, not a number.
  if isinstance(x, (str, bytes, bool, np.bool_)):
    raise TypeError(f"{name} must be a float, got {type(x).__name__} {x!r}.")
  try:
    value = float(x)
  except (TypeError, ValueError):
    raise TypeError(
        f"{name} must be a float, got {type(x).__name__}.") from None
  if not math.isfinite(value) or (positive and value <= 0):
    raise ValueError(f"{name} must be finite{' and > 0' if positive else ''},"
                     f" got {name}={value}.")
  # The kernels compute in float32: a value it cannot hold would turn into
  # inf (and NaN logits), or into 0, silently.
  if abs(value) > _FLOAT32_MAX or 0 < abs(value) < _FLOAT32_TINY:
    raise ValueError(
        f"{name} must be 0 or of a magnitude in [{_FLOAT32_TINY:.3g}, "
        f"{_FLOAT32_MAX:.3g}] (float32's normal range), got {name}={value}.")
  return value


# As Python floats: one past float32's range compared with a float32
# scalar warns of overflow.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def check_dropout_rate(rate) -> float:
  """`dropout_rate=` as a float in [0, 1) (None: 0)."""
  rate = check_static_float("dropout_rate", rate) or 0.0
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate}.")
  return rate


def check_dropout(rate, rng):
  """(rate, rng as an array or None): the static rate in [0, 1); an rng
  (PRNG key or integer seed) is required when rate > 0."""
  rate = check_dropout_rate(rate)
  if rate == 0.0:
    return 0.0, None
  if rng is None:
    raise ValueError(
        f"dropout_rate={rate} needs dropout_rng (a PRNG key or an integer "
        "seed).")
  if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
    rng = np.uint32(int(rng) & 0xFFFFFFFF)
  elif not hasattr(rng, "dtype"):  # A string would fail inside the jit.
    raise TypeError(
        "dropout_rng must be a JAX PRNG key or an integer seed, got "
        f"{type(rng).__name__}.")
  return rate, rng


def check_precision(precision) -> jax.lax.Precision:
  """`precision=` as a `jax.lax.Precision`, with JAX's names for its levels.

  None follows `jax.default_matmul_precision`, read now (outside any jit of
  ours); when that is unset too, DEFAULT, as for `jnp.dot`.
  """
  if precision is None:
    config = jax.config.jax_default_matmul_precision
    try:
      return check_precision(config or "default")
    except ValueError:
      raise ValueError(
          "precision=None follows jax_default_matmul_precision, which is a "
          f"dot algorithm ({config!r}) that flash_attention does not "
          "support; pass precision= explicitly."
      ) from None
  if isinstance(precision, jax.lax.Precision):
    return precision
  if not isinstance(precision, str):
    raise TypeError(
        "precision must be None, a jax.lax.Precision or its name, got "
        f"{precision=}."
    )
  try:
    # JAX's table: "bfloat16" and "fastest" are DEFAULT, "tensorfloat32" and
    # "bfloat16_3x" HIGH, "float32" HIGHEST.
    return jax.lax.Precision(precision.lower())
  except ValueError:
    raise ValueError(
        "precision must be 'default', 'high', 'highest', 'bfloat16', "
        "'tensorfloat32', 'float32', 'fastest', 'bfloat16_3x' or a "
        f"jax.lax.Precision, got {precision=}."
    ) from None


# XLA's flags that ask for run-to-run reproducible GPU executables; the
# first implies the second (it also fixes XLA's autotuning choices).
XLA_DETERMINISM_FLAGS = ("--xla_gpu_deterministic_ops",
                         "--xla_gpu_exclude_nondeterministic_ops")


def xla_flags_deterministic(flags: str | None = None) -> bool:
  """Whether XLA flags ask for deterministic ops: `XLA_DETERMINISM_FLAGS`,
  either set true as XLA parses a boolean flag (bare, "=true" or "=1"), the
  last occurrence of each winning.

  Args:
    flags: the flags, as in `XLA_FLAGS`; None reads the environment
      variable now.
  """
  if flags is None:
    flags = os.environ.get("XLA_FLAGS", "")
  values = {}
  for token in flags.split():
    name, has_value, value = token.partition("=")
    if name in XLA_DETERMINISM_FLAGS:
      values[name] = not has_value or value.lower() in ("true", "1")
  return any(values.values())


def check_deterministic_backward(deterministic_backward) -> bool:
  """`deterministic_backward=` as a bool; None follows XLA's flags, read
  now (`xla_flags_deterministic`).

  Raises:
    TypeError: neither None nor a bool.
  """
  if deterministic_backward is None:
    return xla_flags_deterministic()
  if not isinstance(deterministic_backward, (bool, np.bool_)):
    raise TypeError(
        "deterministic_backward must be None (follow XLA_FLAGS), True or "
        f"False, got {deterministic_backward=}.")
  return bool(deterministic_backward)


def check_scale(name, scale, x, x_name, *, forms,
                dtypes=tuple(quantize.QUANTIZED_DTYPES)):
  """The float32 scales of a quantized array (`pallas_fa.quantize`).

  Args:
    name: the argument's name ("key_scale").
    scale: float, broadcastable to `x.shape[:-1]`, or None.
    x: the quantized array it scales.
    x_name: x's argument name, for the messages.
    forms: the usual shapes of `scale`, for the message of a bad one.
    dtypes: the dtypes of x that take a scale.

  Returns:
    None if `scale` is None, else float32 of rank `x.ndim - 1`, each dim 1
    or x's (leading 1s added).

  Raises:
    ValueError: x's dtype takes no scale, the shape does not broadcast, or
      a Python or numpy float scale is not finite.
    TypeError: scale is not floating.
  """
  if scale is None:
    return None
  if isinstance(scale, (float, np.floating)) and not np.isfinite(scale):
    # A number (read without a device round trip) scaling every entry.
    raise ValueError(f"{name} must be finite, got {name}={scale!r}.")
  dtypes = tuple(jnp.dtype(d) for d in dtypes)
  if x.dtype not in dtypes:
    kind = ("an int8 or float8" if jnp.dtype(jnp.int8) in dtypes
            else "a float8")
    raise ValueError(
        f"{name} applies to {kind} {x_name}, got {x_name}.dtype={x.dtype}.")
  scale = as_array(name, scale)
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    raise TypeError(
        f"{name} must be floating (it is used in float32), got "
        f"{name}.dtype={scale.dtype}.")
  target = x.shape[:-1]
  padded = (1,) * (len(target) - scale.ndim) + scale.shape
  if scale.ndim > len(target) or any(
      d not in (1, t) for d, t in zip(padded, target)):
    raise ValueError(
        f"{name} must broadcast to {x_name}.shape[:-1]={target} ({forms}), "
        f"got {name}.shape={scale.shape}.")
  return scale.astype(jnp.float32).reshape(padded)


# The dtypes a float8 call may return (`flash_attention(out_dtype=...)`).
OUT_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float16)


def check_out_dtype(out_dtype):
  """`out_dtype=` as a `jnp.dtype` (hashable, a static argument), or None.

  Raises:
    TypeError: not a dtype, or not one of `OUT_DTYPES`.
  """
  if out_dtype is None:
    return None
  try:
    dtype = jnp.dtype(out_dtype)
  except TypeError:
    dtype = None
  if dtype is None or dtype not in OUT_DTYPES:
    raise TypeError(
        f"out_dtype must be None, bfloat16, float32 or float16, got "
        f"{out_dtype=}.")
  return dtype


def check_sinks(sinks, num_heads, dtype):
  """float [N] or [1] -> [N] in `dtype` (the stats dtype: float32, or
  float64 for float64 inputs), or None."""
  if sinks is None:
    return None
  sinks = as_array("sinks", sinks)
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"sinks must be a float array, got {sinks.dtype=}.")
  if sinks.ndim != 1 or sinks.shape[0] not in (1, num_heads):
    raise ValueError(
        f"sinks must have shape [N]=({num_heads},) (one per query head) or "
        f"(1,), got {sinks.shape=}.")
  return jnp.broadcast_to(sinks.astype(dtype), (num_heads,))


def _check_dense(name, x, batch_shape, nts):
  """bias/mask broadcastable to [*B, N, T, S] -> 4-D [1 or prod(B), ...]."""
  if x is None:
    return None
  x = as_array(name, x)
  full = batch_shape + nts
  if x.ndim > len(full):
    raise ValueError(
        f"{name} must be broadcastable to [*B, N, T, S]={full}, got "
        f"{name}.shape={x.shape}.")
  shape = x.shape  # As passed, for the message.
  x = x.reshape((1,) * (len(full) - x.ndim) + x.shape)
  for got, want in zip(x.shape, full):
    if got not in (1, want):
      raise ValueError(
          f"{name} must be broadcastable to [*B, N, T, S]={full}, got "
          f"{name}.shape={shape}."
      )
  rows = x.shape[:len(batch_shape)]
  if math.prod(rows) == 1:  # Shared by the whole batch: keep it so.
    return x.reshape((1,) + x.shape[len(batch_shape):])
  x = jnp.broadcast_to(x, batch_shape + x.shape[len(batch_shape):])
  return x.reshape((math.prod(batch_shape),) + x.shape[len(batch_shape):])


def check_bias_and_mask(bias, mask, batch_shape, nts):
  """Validates bias (float) and mask (bool), each broadcastable to
  [*B, *nts]; returns them 4-D with the batch dims folded (1 if shared)."""
  bias = _check_dense("bias", bias, batch_shape, nts)
  if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
    raise TypeError(f"bias must be a float array, got {bias.dtype=}.")
  mask = _check_dense("mask", mask, batch_shape, nts)
  if mask is not None and mask.dtype != jnp.bool_:
    raise TypeError(f"mask must be a bool array (True = attend), got "
                    f"{mask.dtype=}.")
  return bias, mask


def symbolic_dims(*shapes) -> list[str]:
  """The symbolic dims (`jax.export` shape polymorphism) in `shapes`, each
  named once."""
  return list(dict.fromkeys(
      str(d) for shape in shapes for d in shape if export.is_symbolic_dim(d)))


def symbolic_batch_and_rest(*arrays) -> tuple[list[str], list[str]]:
  """(the symbolic dims of the arrays' leading batch axis, those of their
  other axes); None entries are skipped."""
  arrays = [x for x in arrays if x is not None]
  return (symbolic_dims(*(x.shape[:1] for x in arrays)),
          symbolic_dims(*(x.shape[1:] for x in arrays)))
