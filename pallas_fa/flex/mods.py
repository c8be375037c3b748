"""The user's element functions of flex attention: checks and evaluation.

`flash_attention(score_mod=..., mask_mod=...)` takes two functions written
as for one element of the logit matrix:

    score_mod(score, batch, head, q_idx, kv_idx, *score_mod_args) -> score
    mask_mod(batch, head, q_idx, kv_idx, *mask_mod_args) -> bool

`batch` (the flattened batch index) and `head` (the query head) arrive as
int32 scalars, `q_idx` and `kv_idx` (0-based token indices within the
sequences) as int32 arrays that broadcast against the tile of scores. This
module is the one place that calls them: `evaluate` runs one on a tile of any
layout (vectorising over the leading (batch, head) axes with `jax.vmap`, so
that `slopes[head]` stays a scalar read and `table[head, kv_idx - q_idx]` an
elementwise gather), and `check` validates one when a call is traced.

Arrays a function reads must reach it through its `*_args`: arrays captured
by closure would take no gradient (score_mod) or freeze a traced value into
the trace (either), so `check` traces the function once with abstract
inputs (`jax.make_jaxpr`) and rejects its constants that are tracers (a
closed-over value of an enclosing jit, grad or vmap) and, for score_mod,
concrete floating-point `jax.Array`s (a parameter that would silently get
no gradient). Constants the function builds itself from numpy or Python
values are left alone: `make_jaxpr` records those as numpy literals, never
as device arrays or tracers.
"""

from __future__ import annotations

import inspect
import math
from typing import Any
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp

Array = Any

SCORE_MOD = "score_mod"
MASK_MOD = "mask_mod"
# Leading parameters before the *args: (score,) batch, head, q_idx, kv_idx.
_INDEX_ARGS = 4


def as_args(name: str, args) -> tuple[Array, ...]:
  """`score_mod_args`/`mask_mod_args` as a tuple of arrays.

  Raises:
    TypeError: not a tuple or list, or an element is not array-like.
  """
  if not isinstance(args, (tuple, list)):
    raise TypeError(
        f"{name} must be a tuple of arrays, got {type(args).__name__} "
        f"({name}={args!r}).")
  out = []
  for i, x in enumerate(args):
    try:
      out.append(jnp.asarray(x))
    except (TypeError, ValueError):  # jnp.asarray(None) is a ValueError.
      raise TypeError(
          f"{name}[{i}] must be an array, got {type(x).__name__}.") from None
  return tuple(out)


def widen(args: tuple[Array, ...], dtype) -> tuple[Array, ...]:
  """`args` with each floating-point array narrower than `dtype` cast to it.

  For the backends that differentiate a score_mod by autodiff (`xla`, and
  `chunked` tile by tile): the gradient of an array read per logit
  (`table[head, kv_idx - q_idx]`, `slopes[head]`) is a scatter-add of one
  cotangent per logit, which autodiff sums in the array's dtype -- for a
  bfloat16 table tens of ulps off. Read from the widened copy, the sum runs
  in `dtype` and the cast's transpose rounds it to the array's dtype once.
  Widening is exact, so the values the score_mod reads are unchanged.
  """
  dtype = jnp.dtype(dtype)
  return tuple(
      x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
      and jnp.finfo(x.dtype).bits < jnp.finfo(dtype).bits else x
      for x in args)


def check_callable(name: str, fn, num_args: int) -> None:
  """Eager checks of a score_mod/mask_mod: callable, and its arity.

  Args:
    name: "score_mod" or "mask_mod".
    fn: the function, or None.
    num_args: len(*_args).

  Raises:
    TypeError: fn is not callable or cannot take its positional arguments.
  """
  if fn is None:
    return
  if not callable(fn):
    raise TypeError(f"{name} must be callable or None, got {name}={fn!r}.")
  arity = _INDEX_ARGS + (name == SCORE_MOD) + num_args
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # Builtins, some C extensions: trust it.
    return
  try:
    signature.bind(*range(arity))
  except TypeError:
    params = ("score, " if name == SCORE_MOD else "") + (
        "batch, head, q_idx, kv_idx")
    raise TypeError(
        f"{name} must take {arity} positional arguments ({params}, "
        f"*{name}_args with len({name}_args)={num_args}), got {name} with "
        f"signature {signature}.") from None


def _abstract(name: str, args, rows: int = 2, cols: int = 3):
  """The abstract inputs of one call of `name` on a [rows, cols] tile."""
  i32 = jnp.int32
  index = (jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((), i32),
           jax.ShapeDtypeStruct((rows, 1), i32),
           jax.ShapeDtypeStruct((1, cols), i32))
  score = (jax.ShapeDtypeStruct((rows, cols), jnp.float32),) if (
      name == SCORE_MOD) else ()
  return score + index + tuple(
      jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args)


def trace(name: str, fn, args) -> jax.extend.core.ClosedJaxpr:
  """The jaxpr of `fn` on an abstract [2, 3] tile (after `check`)."""
  return jax.make_jaxpr(fn)(*_abstract(name, args))


def check(name: str, fn, args) -> None:
  """Checks what a score_mod/mask_mod computes, by tracing it once.

  Args:
    name: "score_mod" or "mask_mod".
    fn: the function (callable, right arity: `check_callable`).
    args: its extra arrays (`as_args`).

  Raises:
    ValueError: it reads an array captured by closure (see the module
      docstring), or returns a shape that does not broadcast to the tile.
    TypeError: it returns the wrong dtype (score_mod: floating point;
      mask_mod: bool).
  """
  jaxpr = trace(name, fn, args)
  for const in jaxpr.consts:
    traced = isinstance(const, jax.core.Tracer)
    parameter = (name == SCORE_MOD and isinstance(const, jax.Array)
                 and jnp.issubdtype(const.dtype, jnp.inexact))
    if traced or parameter:
      what = ("a traced array (of an enclosing jit, grad or vmap)" if traced
              else "a floating-point jax.Array (it would get no gradient)")
      raise ValueError(
          f"{name} reads an array of shape {tuple(const.shape)} captured by "
          f"closure, {what}; pass it through {name}_args and read it from "
          f"the extra arguments instead: {name}(..., *{name}_args).")
  if len(jaxpr.out_avals) != 1:
    raise TypeError(f"{name} must return one array, got "
                    f"{len(jaxpr.out_avals)} outputs.")
  out = jaxpr.out_avals[0]
  # A second tile of other, coprime sizes: a result shaped by something
  # other than q_idx and kv_idx (a (3,) array added to the scores) would
  # broadcast against the first and fail on the call's own tiles.
  for tile in ((2, 3), (5, 7)):
    try:
      shape = out.shape if tile == (2, 3) else jax.eval_shape(
          fn, *_abstract(name, args, *tile)).shape
      fits = jnp.broadcast_shapes(shape, tile) == tile
      what = f"returned shape {shape}"
    except (ValueError, TypeError) as e:  # Its own ops' broadcasting.
      fits, what = False, f"failed: {e}"
    if not fits:
      raise ValueError(
          f"{name} must return an array that broadcasts against the tile "
          f"of q_idx [rows, 1] and kv_idx [1, cols]; on a {tile} tile it "
          f"{what}.")
  if name == SCORE_MOD and not jnp.issubdtype(out.dtype, jnp.floating):
    raise TypeError(f"score_mod must return floating-point scores, got "
                    f"dtype {out.dtype}.")
  if name == MASK_MOD and out.dtype != jnp.bool_:
    raise TypeError(f"mask_mod must return bool (True = may attend), got "
                    f"dtype {out.dtype}.")


# What a declared dimension of a mod's argument (`reads`) must equal.
_CALL_SIZES = {"B": "batch", "N": "heads", "T": "q_len", "S": "kv_len"}


def reads(*shapes):
  """Declares the shapes of the arrays a score_mod/mask_mod reads from its
  extra arguments, one tuple per argument: "B" (the flattened batch), "N"
  (query heads), "T" (queries), "S" (keys), "T=S" (both, which must then
  be equal) or None (any size). An index past an array's end would be
  clamped by the gather, a wrong answer; `check_shapes` checks them
  against the call's sizes instead:

    @flex.reads(("B", "T=S"))
    def document(batch, head, q_idx, kv_idx, document_ids): ...
  """
  def declare(fn):
    fn.arg_shapes = shapes
    return fn
  return declare


def check_shapes(name: str, fn, args, **sizes) -> None:
  """The arrays `fn` reads against its `reads` declaration, if any, and the
  call's sizes (batch, heads, q_len, kv_len; None where unknown).

  Raises:
    ValueError: an argument of another rank or size (the message names
      `{name}_args[i]`).
  """
  declared = getattr(fn, "arg_shapes", None)
  if fn is None or declared is None or len(declared) != len(args):
    return  # The arity check names a count mismatch.
  for i, (want, x) in enumerate(zip(declared, args)):
    shape = tuple(jnp.shape(x))
    ok = len(shape) == len(want)
    for dim, symbol in zip(shape, want) if ok else ():
      for letter in (symbol or "").split("="):
        size = sizes.get(_CALL_SIZES[letter]) if letter else None
        ok &= size is None or dim == size
    if not ok:
      names = ", ".join(_described(symbol, sizes) for symbol in want)
      raise ValueError(
          f"{name}_args[{i}] of {getattr(fn, '__name__', name)} must be "
          f"shaped [{names}] for this call, got shape {shape}.")


def _described(symbol, sizes) -> str:
  """A declared dimension with the call's sizes: "N=4", "T=S=8", "any"."""
  if symbol is None:
    return "any"
  letters = symbol.split("=")
  known = {letter: sizes.get(_CALL_SIZES[letter]) for letter in letters}
  values = {v for v in known.values() if v is not None}
  if len(values) > 1:
    return f"{symbol} (but " + ", ".join(
        f"{k}={v}" for k, v in known.items()) + ")"
  return f"{symbol}={values.pop()}" if values else symbol


def check_functions(score_mod, score_mod_args, mask_mod,
                    mask_mod_args) -> None:
  """`check_callable` and `check` of a call's score_mod and mask_mod (with
  their args already `as_args`); args without their function are an error.

  Raises:
    ValueError / TypeError: as `check_callable` and `check`.
  """
  for name, fn, args in ((SCORE_MOD, score_mod, score_mod_args),
                         (MASK_MOD, mask_mod, mask_mod_args)):
    if fn is None:
      if args:
        raise ValueError(f"{name}_args given without a {name}: "
                         f"len({name}_args)={len(args)}.")
      continue
    check_callable(name, fn, len(args))
    check(name, fn, args)


def uses_batch_and_head(name: str, fn, args) -> tuple[bool, bool]:
  """Whether fn's result can depend on its `batch` and `head` arguments.

  A conservative walk of its jaxpr: every output of an equation that reads
  a dependent value depends on it (sub-jaxprs included). A block mask of a
  mask_mod that reads neither is computed once for all batch rows and heads.
  """
  jaxpr = trace(name, fn, args).jaxpr
  offset = int(name == SCORE_MOD)

  def reaches(var) -> bool:
    marked = {var}
    for eqn in jaxpr.eqns:
      if any(not isinstance(v, jax.extend.core.Literal) and v in marked
             for v in eqn.invars):
        marked.update(eqn.outvars)
    return any(not isinstance(v, jax.extend.core.Literal) and v in marked
               for v in jaxpr.outvars)

  return (reaches(jaxpr.invars[offset]), reaches(jaxpr.invars[offset + 1]))


def _flatten(x: Array, lead: tuple[int, ...]):
  """x (rank len(lead) + r, broadcastable to lead on its leading axes) as
  (array, vmap axis): [L, ...] and 0 when it varies along lead, else its
  trailing r axes and None."""
  k = len(lead)
  x = jnp.asarray(x)
  if all(d == 1 for d in x.shape[:k]):
    return x.reshape(x.shape[k:]), None
  x = jnp.broadcast_to(x, lead + x.shape[k:])
  return x.reshape((math.prod(lead),) + x.shape[k:]), 0


def evaluate(fn: Callable, tile: tuple[int, ...], *, batch: Array,
             head: Array, q_idx: Array, kv_idx: Array, score: Array = None,
             args: tuple[Array, ...] = (), uses=(True, True),
             dtype=None) -> Array:
  """A score_mod (given `score`) or mask_mod evaluated on a tile.

  The tile is [*lead, rows, cols] in any layout (grouped GQA heads,
  transposed, packed decode rows): every index argument has the tile's rank
  and broadcasts against it. The function runs once per element of the
  leading axes along which `batch`, `head` or the indices vary (`jax.vmap`),
  seeing `batch` and `head` as scalars.

  Args:
    fn: the user's function.
    tile: [*lead, rows, cols].
    batch: int32, broadcastable to lead + (1, 1).
    head: int32 (the query head), broadcastable to lead + (1, 1).
    q_idx: int32 query indices, broadcastable to the tile.
    kv_idx: int32 key indices, broadcastable to the tile.
    score: the tile of scores for a score_mod, None for a mask_mod.
    args: the function's extra arrays (never vectorised over).
    uses: whether fn reads (batch, head) (`uses_batch_and_head`); one it
      does not read is passed as 0, so the function is not vectorised along
      it.
    dtype: the result's dtype (default: the score's, or bool).

  Returns:
    The function's result broadcast to the tile, typed `dtype`.
  """
  lead, rows_cols = tuple(tile[:-2]), tuple(tile[-2:])
  k = len(lead)
  zero = jnp.zeros((1,) * len(tile), jnp.int32)
  batch = batch if uses[0] else zero
  head = head if uses[1] else zero
  dtype = dtype or (jnp.bool_ if score is None else score.dtype)
  operands = [_flatten(jnp.asarray(batch, jnp.int32)[..., 0, 0] if k else
                       jnp.asarray(batch, jnp.int32).reshape(()), lead),
              _flatten(jnp.asarray(head, jnp.int32)[..., 0, 0] if k else
                       jnp.asarray(head, jnp.int32).reshape(()), lead),
              _flatten(q_idx, lead), _flatten(kv_idx, lead)]
  if score is not None:
    operands.insert(0, _flatten(score, lead))

  def one(*xs):
    out = fn(*xs, *args)
    return jnp.broadcast_to(jnp.asarray(out).astype(dtype), rows_cols)

  values = [x for x, _ in operands]
  axes = tuple(a for _, a in operands)
  if all(a is None for a in axes):
    return jnp.broadcast_to(one(*values), tile)
  out = jax.vmap(one, in_axes=axes)(*values)
  return out.reshape(lead + rows_cols)
