"""A score_mod or mask_mod split for a Pallas kernel (flex attention).

A kernel can run elementwise arithmetic on a tile, but cannot gather from
an array at data-dependent indices (Triton and Mosaic have no register
gather). Most user functions (`pallas_fa.flex.mods`) only gather with indices
that are known before the tile loop: `slopes[head]` needs the program's
head, `document_ids[batch, q_idx]` one value per query row. `split` traces
the function once on scalars, inlines its calls, and sorts each operation
by what its result depends on:

    PROGRAM  batch, head, the arrays    one value per (batch, head)
    ROW      ... and q_idx              one value per query
    COLUMN   ... and kv_idx             one value per key
    TILE     the score, or both         computed in the kernel

The first three levels run outside the kernel, in plain XLA, vectorised
over every batch row, head and token (`FusedMod.residual_arrays`); the kernel
receives the values that tile operations read ("residuals") as small arrays
blocked like its positions, and evaluates the tile operations on its tile
(`FusedMod.tile`). Those must be elementwise (`_ELEMENTWISE`), with one
exception a kernel that holds tables asks for (`split(..., tables=True)`):
a read of one element of an array made outside at an index computed per
element (`dynamic_slice`, what `table[head, bucket(kv_idx - q_idx)]`
traces to, T5's relative-position buckets or any learned relative bias).
`split` cuts such a read in two: outside, the indices that are known per
program select the program's part of the table (`table[head]`, a
PROGRAM residual of `Residual.size` elements, flattened); in the tile, the
remaining indices, clamped as `dynamic_slice` clamps them, give a flat
offset into it, and the kernel loads the elements at those offsets (the
residual's value in `FusedMod.tile` is a function from offsets to
values: a load from the kernel's ref). Any other non-elementwise tile
operation, and a table read without `tables`, is declined with a
NotImplementedError naming the operation, so the automatic choice moves
on.

Gradients (score_mod): the kernel chains dS through the tile part with
`jax.vjp` (`FusedMod.tile_vjp`), summing each PROGRAM residual's cotangent
over its tiles (a per-program partial sum); `FusedMod.args_grad` chains
those sums through the outside part. A table's cotangent is the
scatter-add of the tile's cotangents of the elements read at their offsets
(`tile_vjp`'s `scatter`, which the kernel supplies: a vector of the table's
size per program), chained the same way: summed over programs, then
through the outside part (so `table[head]`'s row goes back into its row of
the table). A float ROW or COLUMN residual that depends on the arrays (a
learned per-token bias) would need a cotangent per token and is declined
for now.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax

from pallas_fa.flex import mods

Array = Any
_Literal = jax.extend.core.Literal


class Level(enum.IntEnum):
  PROGRAM = 0
  ROW = 1
  COLUMN = 2
  TILE = 3


# What a value depends on (bit flags).
_SCORE, _BATCH, _HEAD, _Q, _KV, _ARGS, _DIFF = (1 << i for i in range(7))

# Tile operations a kernel can lower: elementwise on operands broadcast to
# a common shape. Shape-only operations on scalars pass their operand on.
_ELEMENTWISE = frozenset("""
    abs add and atan2 cbrt ceil clamp convert_element_type cos div eq erf
    exp exp2 expm1 floor ge gt integer_pow is_finite le log log1p logistic
    lt max min mul ne neg not or pow reduce_precision rem round rsqrt
    select_n shift_left shift_right_arithmetic shift_right_logical sign sin
    sqrt square stop_gradient sub tan tanh xor copy copy_p
""".split())
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze",
                         "expand_dims"})
# Parameters holding the body of a call that `_flatten` inlines (jit,
# custom_jvp_call, custom_vjp_call across jax versions).
_CALL_BODIES = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _level(deps: int) -> Level:
  if deps & _SCORE or (deps & _Q and deps & _KV):
    return Level.TILE
  if deps & _Q:
    return Level.ROW
  if deps & _KV:
    return Level.COLUMN
  return Level.PROGRAM


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
  """One primitive application: inputs and outputs are keys of an
  environment (a `_Literal` stands for itself)."""

  primitive: Any
  params: dict
  ins: tuple
  outs: tuple
  out_avals: tuple
  level: Level


def _flatten(jaxpr, names: dict, steps: list) -> None:
  """Appends the equations of `jaxpr` to `steps`, inlining calls.

  `names` maps the jaxpr's input (and constant) variables to keys.
  """
  def key(atom):
    return atom if isinstance(atom, _Literal) else names[atom]

  for eqn in jaxpr.eqns:
    body = next((eqn.params[p] for p in _CALL_BODIES if p in eqn.params),
                None)
    inner = getattr(body, "jaxpr", body)
    if inner is not None and hasattr(inner, "eqns") and len(
        inner.invars) == len(eqn.invars):
      sub = {v: key(a) for v, a in zip(inner.invars, eqn.invars)}
      for v, c in zip(inner.constvars, getattr(body, "consts", ())):
        sub[v] = _Literal(c, v.aval)
      _flatten(inner, sub, steps)
      for v, out in zip(eqn.outvars, inner.outvars):
        names[v] = key(out) if isinstance(out, _Literal) else sub[out]
      continue
    outs = tuple(object() for _ in eqn.outvars)
    names.update(zip(eqn.outvars, outs))
    steps.append(_Step(eqn.primitive, dict(eqn.params),
                       tuple(key(a) for a in eqn.invars), outs,
                       tuple(v.aval for v in eqn.outvars), Level.TILE))


def _custom_derivatives(jaxpr) -> list[str]:
  """The custom_jvp / custom_vjp calls in `jaxpr`, its calls' bodies
  included (`_flatten` inlines their primal bodies, dropping the rules)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith(("custom_jvp_call", "custom_vjp_call")):
      found.append(eqn.primitive.name)
    for p in _CALL_BODIES:
      inner = getattr(eqn.params.get(p), "jaxpr", eqn.params.get(p))
      if inner is not None and hasattr(inner, "eqns"):
        found.extend(_custom_derivatives(inner))
  return list(dict.fromkeys(found))


@dataclasses.dataclass(frozen=True)
class Residual:
  """A value computed outside the kernel and read by its tile operations.

  Attributes:
    key: its key in the environment.
    level: PROGRAM (one per batch row and head), ROW or COLUMN (also one
      per query or key).
    dtype: its dtype.
    batch, head: whether it depends on the batch row / the head (else it
      is stored broadcast, size 1).
    differentiable: a float value that depends on a float array of the
      function's arguments.
    size: None for one value; for a table (a PROGRAM residual the tile
      reads at computed offsets), its number of elements: the residual is
      then a vector of that size per program.
  """

  key: Any
  level: Level
  dtype: Any
  batch: bool
  head: bool
  differentiable: bool
  size: int | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of one program's value: () or (size,)."""
    return () if self.size is None else (self.size,)


@dataclasses.dataclass(frozen=True, eq=False)
class FusedMod:
  """A score_mod or mask_mod split into an outside and a tile part.

  Made by `split`. Hashable by identity, so it can parameterise kernels.
  """

  name: str
  fn: Callable
  inputs: tuple  # keys of (score?), batch, head, q_idx, kv_idx, *args
  outside: tuple[_Step, ...]
  tile_steps: tuple[_Step, ...]
  output: Any
  residuals: tuple[Residual, ...]

  @property
  def is_score_mod(self) -> bool:
    return self.name == mods.SCORE_MOD

  def _index_keys(self):
    offset = int(self.is_score_mod)
    return self.inputs[offset:offset + 4]

  def _arg_keys(self):
    return self.inputs[int(self.is_score_mod) + 4:]

  # -- outside the kernel ---------------------------------------------------

  def _outside_values(self, batch, head, q_idx, kv_idx, args):
    """The residuals for scalar indices (vmapped by `residuals`)."""
    env = dict(zip(self._index_keys(), (batch, head, q_idx, kv_idx)))
    env.update(zip(self._arg_keys(), args))
    for step in self.outside:
      _run(step, env, tile=False)
    return [env[r.key] for r in self.residuals]

  def values_at(self, i: int, args, *, batch, head, q_idx,
                kv_idx) -> Array:
    """Residual i at index arrays that broadcast together (vectorised over
    their broadcast shape, which the result has)."""
    index = [jnp.asarray(x, jnp.int32) for x in (batch, head, q_idx, kv_idx)]
    shape = jnp.broadcast_shapes(*(x.shape for x in index))
    flat = [jnp.broadcast_to(x, shape).reshape(-1) for x in index]

    def one(b, h, q, kv):
      return self._outside_values(b, h, q, kv, args)[i]

    out = jax.vmap(one)(*flat)
    return out.reshape(shape + out.shape[1:])

  def residual_arrays(self, args, *, batch: int, heads: int, q_len: int,
                      kv_len: int, q_padded: int, kv_padded: int,
                      levels=tuple(Level)) -> list[Array]:
    """The residuals (of `levels`, in `residuals` order): [Bm, Hm] for
    PROGRAM ([Bm, Hm, size] for a table), [Bm, Hm, q_padded] for ROW,
    [Bm, Hm, kv_padded] for COLUMN; Bm = batch if the value depends on the
    batch row, else 1, Hm likewise. Padded positions repeat the last real
    one (they are never visible)."""
    i32 = jnp.int32
    out = []
    for i, r in enumerate(self.residuals):
      if r.level not in levels:
        continue
      length, padded = {Level.ROW: (q_len, q_padded),
                        Level.COLUMN: (kv_len, kv_padded)}.get(
                            r.level, (1, 1))
      pos = jnp.minimum(jnp.arange(padded, dtype=i32), length - 1)
      value = self.values_at(
          i, args,
          batch=jnp.arange(batch if r.batch else 1, dtype=i32)[:, None, None],
          head=jnp.arange(heads if r.head else 1, dtype=i32)[None, :, None],
          q_idx=pos if r.level == Level.ROW else 0,
          kv_idx=pos if r.level == Level.COLUMN else 0)
      out.append(value[:, :, 0] if r.level == Level.PROGRAM else value)
    return out

  def args_grad(self, args, cotangents: list[Array], *, batch: int,
                heads: int) -> tuple:
    """Gradients of `args` from the summed cotangents of the
    differentiable PROGRAM residuals ([Bm, Hm] each, [Bm, Hm, size] for a
    table, in `residuals` order); None for integer arrays."""
    diff = [i for i, x in enumerate(args)
            if jnp.issubdtype(x.dtype, jnp.inexact)]

    def program(*dargs):
      full = list(args)
      for i, x in zip(diff, dargs):
        full[i] = x
      values = self.residual_arrays(
          tuple(full), batch=batch, heads=heads, q_len=1, kv_len=1,
          q_padded=1, kv_padded=1, levels=(Level.PROGRAM,))
      program_residuals = [r for r in self.residuals
                           if r.level == Level.PROGRAM]
      return [v for v, r in zip(values, program_residuals)
              if r.differentiable]

    _, pull = jax.vjp(program, *(args[i] for i in diff))
    grads = pull([c.astype(v.dtype) for c, v in zip(
        cotangents, jax.eval_shape(program, *(args[i] for i in diff)))])
    out = [None] * len(args)
    for i, g in zip(diff, grads):
      out[i] = g
    return tuple(out)

  def args_grad_from_partials(self, args, partials: list[Array], *,
                              batch: int, heads: int) -> tuple:
    """`args_grad` from a kernel's partial sums: per differentiable
    PROGRAM residual, float32 [B, N, ...] (per program, per query, ...;
    [B, N, ..., size] for a table), summed here to the residual's [Bm, Hm]
    ([Bm, Hm, size]); cast to the arrays' dtypes."""
    differentiable = [r for r in self.residuals if r.differentiable]
    cotangents = []
    for d, r in zip(partials, differentiable):
      d = d.reshape(d.shape[:2] + (-1,) + r.shape).sum(axis=2)
      cotangents.append(d.sum(axis=(0,) * (not r.batch) + (1,) * (
          not r.head), keepdims=True))
    grads = self.args_grad(args, cotangents, batch=batch, heads=heads)
    return tuple(None if g is None else g.astype(a.dtype)
                 for g, a in zip(grads, args))

  # -- in the kernel --------------------------------------------------------

  @property
  def tile_primitives(self) -> frozenset[str]:
    """The names of the primitives the tile part applies."""
    return frozenset(step.primitive.name for step in self.tile_steps)

  @property
  def tile_indices(self) -> frozenset[str]:
    """Which token indices ("q_idx", "kv_idx") the tile part reads. A
    kernel builds only those: Mosaic GPU's layout inference fails on an
    index tile nothing consumes."""
    read = {k for step in self.tile_steps for k in step.ins
            if not isinstance(k, _Literal)}  # Constants are unhashable.
    if not isinstance(self.output, _Literal):
      read.add(self.output)
    return frozenset(name for k, name in zip(self._index_keys()[2:],
                                             ("q_idx", "kv_idx"))
                     if k in read)

  @property
  def has_tables(self) -> bool:
    """Whether the tile part reads a table at computed offsets."""
    return any(r.size is not None for r in self.residuals)

  def tile(self, values: list[Array], *, q_idx: Array | None,
           kv_idx: Array | None, score: Array | None = None,
           shape: tuple[int, ...] | None = None, _grad: bool = False,
           _loads: dict | None = None) -> Array:
    """The function on a tile: `values` are the residuals (in `residuals`
    order) shaped to broadcast against it -- a table's, a function from
    int32 offsets to the elements there (a kernel's load), or the table as
    a vector --, `q_idx` / `kv_idx` the token indices likewise (None for
    one `tile_indices` leaves out). Returns the tile (score's dtype, or
    bool), of the score's shape, else `shape`, else the indices' broadcast
    shape.

    `_loads` maps a table read (its output key) to the values to use
    instead of loading (`tile_vjp` differentiates through them), and
    records (offsets, values) of the reads it does not map."""
    env = {k: x for k, x in zip(self._index_keys()[2:], (q_idx, kv_idx))
           if x is not None}
    if self.is_score_mod:
      env[self.inputs[0]] = score
    env.update((r.key, v) for r, v in zip(self.residuals, values))
    for step in self.tile_steps:
      _run(step, env, tile=True, grad=_grad, loads=_loads)
    out = _value(self.output, env)
    if score is not None:
      return jnp.broadcast_to(out, score.shape).astype(score.dtype)
    if shape is None:
      shape = jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx))
    return jnp.broadcast_to(out, shape)

  def tile_vjp(self, values: list[Array], *, q_idx: Array | None,
               kv_idx: Array | None,
               score: Array, reduce: Callable = jnp.sum, args: bool = True,
               scatter: Callable | None = None):
    """(score_mod(score), pullback): pullback(ds) -> (ds w.r.t. the score,
    [the cotangent of each differentiable residual, float32, `reduce`d:
    summed over the tile by default; a table's `scatter`ed]).

    Values passed broadcast to the tile get a tile of cotangents, which
    `reduce` may sum along one axis only (a kernel that cannot reduce to a
    scalar). A table's cotangent is scatter(offsets, cotangents, size):
    the float32 cotangents of the elements read at the int32 offsets (two
    tiles) added into a vector of the table's size (by default a
    jax.numpy scatter-add; a kernel passes its own). Without `args` only
    the score's cotangent is computed."""
    diff = [i for i, r in enumerate(self.residuals)
            if r.differentiable and args]
    scalars = [i for i in diff if self.residuals[i].size is None]
    table_of = {self.residuals[i].key: i for i in diff
                if self.residuals[i].size is not None}
    reads = [s for s in self.tile_steps if isinstance(s.primitive, _Table)
             and s.ins[0] in table_of]
    record: dict = {}
    if reads:  # The offsets and elements each read of a table takes.
      self.tile(values, q_idx=q_idx, kv_idx=kv_idx, score=score,
                _grad=True, _loads=record)

    def f(s, *dvals):
      vals = list(values)
      for i, x in zip(scalars, dvals):
        vals[i] = x
      loads = {step.outs[0]: x for step, x in zip(
          reads, dvals[len(scalars):])}
      return self.tile(vals, q_idx=q_idx, kv_idx=kv_idx, score=s,
                       _grad=True, _loads=loads)

    out, pull = jax.vjp(f, score, *(values[i] for i in scalars),
                        *(record[step.outs[0]][1] for step in reads))
    scatter = scatter or _scatter_add

    def pullback(ds):
      ds_in, *dvals = _evaluate_in_kernel(pull, ds.astype(out.dtype))
      grads = {i: reduce(d.astype(jnp.float32))
               for i, d in zip(scalars, dvals)}
      for step, d in zip(reads, dvals[len(scalars):]):
        i = table_of[step.ins[0]]
        part = scatter(record[step.outs[0]][0], d.astype(jnp.float32),
                       self.residuals[i].size)
        grads[i] = part if i not in grads else grads[i] + part
      return ds_in, [grads[i] for i in diff]

    return out, pullback


def _value(k, env):
  return k.val if isinstance(k, _Literal) else env[k]


def _scatter_add(offsets: Array, d: Array, size: int) -> Array:
  """The cotangents `d` added at `offsets` into a vector of `size`."""
  return jnp.zeros((size,), jnp.float32).at[offsets.reshape(-1)].add(
      d.reshape(-1))


@dataclasses.dataclass(frozen=True)
class _ProgramTable:
  """Outside the kernel: a table read's operand with its per-program
  indices applied (clamped as `dynamic_slice` clamps), flattened; the
  program's table. Bound like a primitive by `_run`."""

  shape: tuple[int, ...]
  program_dims: tuple[int, ...]
  name = "program_table"
  multiple_results = False

  def get_bind_params(self, params):
    return params

  def bind(self, operand, *index):
    starts = [jnp.zeros((), jnp.int32)] * len(self.shape)
    sizes = list(self.shape)
    for d, i in zip(self.program_dims, index):
      starts[d], sizes[d] = jnp.asarray(i, jnp.int32), 1
    return lax.dynamic_slice(operand, starts, sizes).reshape(-1)


@dataclasses.dataclass(frozen=True)
class _Table:
  """In the tile: the elements of a program's table (`_ProgramTable`) at
  the remaining indices, clamped to `dims` as `dynamic_slice` clamps."""

  dims: tuple[int, ...]
  name = "table"
  multiple_results = False

  def offsets(self, index) -> Array:
    """The flat int32 offsets of the indices (broadcast together)."""
    shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in index))
    flat = jnp.zeros(shape, jnp.int32)
    for i, dim in zip(index, self.dims):
      i = jnp.clip(jnp.asarray(i, jnp.int32), 0, dim - 1)
      flat = flat * dim + i
    return flat

  def load(self, table, offsets) -> Array:
    """The elements at `offsets`: a kernel's load, or a vector's."""
    return table(offsets) if callable(table) else table[offsets]


@jax.custom_jvp
def _divide(x, y):
  return lax.div(x, y)


@_divide.defjvp
def _divide_jvp(primals, tangents):
  # JAX's own rule for the denominator squares it with integer_pow(y, -2),
  # which Mosaic GPU cannot lower; this one divides twice instead.
  (x, y), (dx, dy) = primals, tangents
  out = lax.div(x, y)
  return out, lax.div(dx - out * dy, y)


def _integer_pow(x, n: int, grad: bool):
  """x ** n in products and at most one division: Mosaic GPU lowers
  integer_pow for n >= 2 and n == -1 only, and its derivative needs
  n - 1."""
  if n == 0:
    return jnp.ones_like(x)
  out = x
  for _ in range(abs(n) - 1):
    out = lax.mul(out, x)
  if n > 0:
    return out
  return (_divide if grad else lax.div)(jnp.ones_like(x), out)


def _run(step: _Step, env: dict, *, tile: bool, grad: bool = False,
         loads: dict | None = None) -> None:
  """Evaluates one step; on a tile, operands are broadcast to their common
  shape first (the trace was on scalars), and with `grad` (under jax.vjp
  in a kernel) float division and integer powers take rules every kernel
  compiler lowers (`_divide`, `_integer_pow`). A table read takes its
  values from `loads` when they are there, else loads them and records
  (offsets, values) in `loads` (`FusedMod.tile`)."""
  vals = [_value(k, env) for k in step.ins]
  name = step.primitive.name
  if isinstance(step.primitive, _Table):
    out = step.outs[0]
    if loads is not None and out in loads:
      env[out] = loads[out]
      return
    offsets = step.primitive.offsets(vals[1:])
    env[out] = step.primitive.load(vals[0], offsets)
    if loads is not None:
      loads[out] = (offsets, env[out])
    return
  if tile and name in _SHAPE_ONLY:
    env[step.outs[0]] = vals[0]
    return
  if tile:
    shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in vals))
    vals = [v if jnp.shape(v) == shape else jnp.broadcast_to(v, shape)
            for v in vals]
    floats = jnp.issubdtype(step.out_avals[0].dtype, jnp.floating)
    if name == "integer_pow":
      out = _integer_pow(vals[0], step.params["y"], grad)
    elif name == "div" and grad and floats:
      out = _divide(*vals)
    else:
      out = step.primitive.bind(*vals, **step.params)
  else:
    out = step.primitive.bind(*vals, **_bind_params(step))
  outs = out if step.primitive.multiple_results else [out]
  env.update(zip(step.outs, outs))


def _evaluate_in_kernel(fn: Callable, *args) -> list:
  """fn(*args), its primitives bound one by one with `add_any` (how
  transposition sums the cotangents of a value used twice) as `add`: Mosaic
  GPU lowers no add_any."""
  closed = jax.make_jaxpr(fn)(*args)
  jaxpr, env, names = closed.jaxpr, {}, {}
  for v, x in (*zip(jaxpr.invars, args), *zip(jaxpr.constvars,
                                              closed.consts)):
    names[v] = object()
    env[names[v]] = x
  steps: list[_Step] = []
  _flatten(jaxpr, names, steps)
  for step in steps:
    vals = [_value(k, env) for k in step.ins]
    if step.primitive.name == "add_any":
      out = lax.add(*vals)
    else:
      out = step.primitive.bind(*vals, **_bind_params(step))
    env.update(zip(step.outs, out if step.primitive.multiple_results
                   else [out]))
  return [v.val if isinstance(v, _Literal) else env[names[v]]
          for v in jaxpr.outvars]


def _bind_params(step: _Step) -> dict:
  """The parameters to bind a step's primitive with (jax < 0.10 returned
  (subfuns, params) here; every primitive left after `_flatten` has no
  subfuns)."""
  params = step.primitive.get_bind_params(step.params)
  if isinstance(params, tuple):  # pragma: no cover - older jax.
    subfuns, params = params
    if subfuns:
      raise NotImplementedError(f"cannot rebind {step.primitive.name}")
  return params


def split(name: str, fn: Callable, args: tuple[Array, ...],
          backend: str, *, tables: bool = False) -> FusedMod:
  """Splits a checked score_mod / mask_mod (`mods.check`) for a kernel.

  Args:
    name: "score_mod" or "mask_mod".
    fn: the function.
    args: its arrays (only their shapes and dtypes are read).
    backend: named in the errors.
    tables: whether the kernel reads tables at computed offsets (see the
      module docstring); without, such a read is declined.

  Raises:
    NotImplementedError: the tile part has an operation a kernel cannot
      run, or a residual a kernel cannot take (the message says which).
  """
  i32 = jax.ShapeDtypeStruct((), jnp.int32)
  abstract = ((jax.ShapeDtypeStruct((), jnp.float32),) if name == (
      mods.SCORE_MOD) else ()) + (i32,) * 4 + tuple(
          jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args)
  try:
    closed = jax.make_jaxpr(fn)(*abstract)
  except Exception as e:  # A function that needs its tile shapes.
    raise NotImplementedError(
        f"{backend} runs {name} on scalar indices to fuse it into its "
        f"kernels, and {name} failed on them ({type(e).__name__}: {e}); "
        "\"chunked\" and \"xla\" run it.") from None
  jaxpr = closed.jaxpr
  custom = _custom_derivatives(jaxpr)
  if custom and name == mods.SCORE_MOD:
    raise NotImplementedError(
        f"{backend} cannot fuse this {name}: it calls a function with a "
        f"custom derivative ({', '.join(custom)}), whose rule its kernels' "
        "backward would not apply (it differentiates the function's body); "
        "\"chunked\" and \"xla\" apply it.")
  inputs = tuple(object() for _ in jaxpr.invars)
  names = dict(zip(jaxpr.invars, inputs))
  for v, c in zip(jaxpr.constvars, closed.consts):
    names[v] = _Literal(c, v.aval)
  steps: list[_Step] = []
  _flatten(jaxpr, names, steps)
  out = jaxpr.outvars[0]
  output = out if isinstance(out, _Literal) else names[out]

  offset = int(name == mods.SCORE_MOD)
  deps = {k: 0 for k in inputs}
  if offset:
    deps[inputs[0]] = _SCORE
  for k, flag in zip(inputs[offset:offset + 4], (_BATCH, _HEAD, _Q, _KV)):
    deps[k] = flag
  # Only a score_mod's floating arrays are differentiated (a mask_mod's
  # result is a bool).
  for k, x in zip(inputs[offset + 4:], args):
    deps[k] = _ARGS | (
        _DIFF if offset and jnp.issubdtype(x.dtype, jnp.inexact) else 0)
  for i, step in enumerate(steps):
    d = 0
    for k in step.ins:
      d |= 0 if isinstance(k, _Literal) else deps[k]
    floating = all(jnp.issubdtype(v.dtype, jnp.inexact)
                   for v in step.out_avals)
    d = d if floating else d & ~_DIFF
    deps.update((o, d) for o in step.outs)
    steps[i] = dataclasses.replace(step, level=_level(d))

  avals = {k: a for k, a in zip(inputs, abstract)}
  for s in steps:
    avals.update(zip(s.outs, s.out_avals))
  steps, table_keys = _cut_table_reads(name, steps, deps, avals, backend,
                                       tables)
  outside = tuple(s for s in steps if s.level != Level.TILE)
  tile_steps = tuple(s for s in steps if s.level == Level.TILE)
  for s in tile_steps:
    if not isinstance(s.primitive, _Table) and (
        s.primitive.name not in _ELEMENTWISE | _SHAPE_ONLY):
      raise NotImplementedError(
          f"{backend} cannot fuse this {name}: it applies "
          f"`{s.primitive.name}` to values its kernels compute per element "
          "(from the score or the token indices), e.g. a gather such as "
          "table[head, kv_idx - q_idx], which a kernel cannot run; "
          "\"chunked\" and \"xla\" run it.")

  # Residuals: values made outside and read in the tile (q_idx and kv_idx
  # themselves the kernel knows), and the output when it is made outside.
  read = [k for s in tile_steps for k in s.ins
          if not isinstance(k, _Literal)]
  if not isinstance(output, _Literal) and _level(deps[output]) != Level.TILE:
    read.append(output)
  residuals, seen = [], set()
  index_keys = set(inputs[offset + 2:offset + 4])
  for k in read:
    if k in seen or k in index_keys or _level(deps[k]) == Level.TILE:
      continue
    seen.add(k)
    level = _level(deps[k])
    aval = avals[k]
    if k in table_keys:
      residuals.append(Residual(
          key=k, level=level, dtype=aval.dtype,
          batch=bool(deps[k] & _BATCH), head=bool(deps[k] & _HEAD),
          differentiable=bool(deps[k] & _DIFF), size=aval.shape[0]))
      continue
    if aval.shape != ():
      raise NotImplementedError(
          f"{backend} cannot fuse this {name}: its per-tile part reads an "
          f"array of shape {aval.shape} (a kernel takes one value per "
          "program, query or key); \"chunked\" and \"xla\" run it.")
    diff = bool(deps[k] & _DIFF)
    if diff and level != Level.PROGRAM:
      raise NotImplementedError(
          f"{backend} cannot fuse this {name}: a per-"
          f"{'query' if level == Level.ROW else 'key'} value it computes "
          "from its float arrays needs a gradient per token, which its "
          "kernels do not produce; \"chunked\" and \"xla\" run it.")
    residuals.append(Residual(
        key=k, level=level, dtype=aval.dtype, batch=bool(deps[k] & _BATCH),
        head=bool(deps[k] & _HEAD), differentiable=diff))
  return FusedMod(name=name, fn=fn, inputs=inputs, outside=outside,
                  tile_steps=tile_steps, output=output,
                  residuals=tuple(residuals))


def _cut_table_reads(name, steps, deps, avals, backend, tables):
  """`steps` with each tile-level read of one element of an array made
  outside (`dynamic_slice` of ones) cut in two: a `_ProgramTable` step
  outside, the program's table (a new key, in `deps`), and a `_Table`
  step in the tile. Returns (steps, the tables' keys).

  Raises:
    NotImplementedError: without `tables`, or for a table that is made
      per query or key.
  """
  out, keys = [], set()
  for step in steps:
    operand = step.ins[0] if step.ins else None
    if not (step.level == Level.TILE
            and step.primitive.name == "dynamic_slice"
            and all(d == 1 for d in step.params["slice_sizes"])
            and _level(_deps(operand, deps)) != Level.TILE):
      out.append(step)
      continue
    if not tables:
      raise NotImplementedError(
          f"{backend} cannot fuse this {name}: it reads a table at indices "
          "computed per element (`dynamic_slice`, e.g. "
          "table[head, bucket(kv_idx - q_idx)]), which its kernels do not "
          "gather; flash_attention's \"triton\" and \"mosaic_tpu\" fuse "
          "it, \"chunked\" and \"xla\" run it.")
    if _level(_deps(operand, deps)) != Level.PROGRAM:
      raise NotImplementedError(
          f"{backend} cannot fuse this {name}: the table it reads per "
          "element is made per query or key (a kernel holds one table per "
          "program); \"chunked\" and \"xla\" run it.")
    index = step.ins[1:]
    shape = tuple(jnp.shape(operand.val) if isinstance(operand, _Literal)
                  else avals[operand].shape)
    program = tuple(d for d, k in enumerate(index)
                    if _level(_deps(k, deps)) == Level.PROGRAM)
    rest = tuple(d for d in range(len(shape)) if d not in program)
    table = object()
    d = _deps(operand, deps)
    for k in (index[i] for i in program):
      d |= _deps(k, deps) & ~_DIFF
    deps[table] = d
    size = 1
    for i in rest:
      size *= shape[i]
    dtype = step.out_avals[0].dtype
    avals[table] = jax.ShapeDtypeStruct((size,), dtype)
    out.append(_Step(_ProgramTable(shape, program), {},
                     (operand, *(index[i] for i in program)), (table,),
                     (avals[table],), Level.PROGRAM))
    out.append(_Step(_Table(tuple(shape[i] for i in rest)), {},
                     (table, *(index[i] for i in rest)), step.outs,
                     step.out_avals, Level.TILE))
    keys.add(table)
  return out, keys


def _deps(k, deps) -> int:
  return 0 if k is None or isinstance(k, _Literal) else deps[k]


def packed_values(mod: FusedMod, args, row_pos: Array, *, num_kv: int,
                  new_tokens: int, kv_positions: int,
                  backend: str) -> list[Array]:
  """A split function's residuals for a decode kernel's packed rows.

  A decode program holds the packed query tile of one K/V head: row r is
  query head k * G + r // T_new at position row_pos[b, r]. Values per
  (batch, head) or per query are then one per row, values per key one per
  cache position -- served to every row, so they must not depend on the
  head.

  Args:
    mod: the split score_mod / mask_mod.
    args: its arrays.
    row_pos: int32 [B, R], each packed row's query position.
    num_kv: K.
    new_tokens: T_new (R = G * T_new).
    kv_positions: how many cache positions the kernel reads values for.
    backend: named in the error.

  Returns:
    Per residual: [B, K, R] (PROGRAM, ROW) or [B, kv_positions] (COLUMN).

  Raises:
    NotImplementedError: a per-key value that depends on the head.
  """
  i32 = jnp.int32
  b, r = row_pos.shape
  heads = (jnp.arange(num_kv, dtype=i32)[:, None] * (r // new_tokens)
           + jnp.arange(r, dtype=i32)[None, :] // new_tokens)  # [K, R]
  out = []
  for i, res in enumerate(mod.residuals):
    if res.level == Level.COLUMN:
      if res.head:
        raise NotImplementedError(
            f"{backend} cannot fuse this {mod.name}: it computes a value per "
            "key that depends on the head (a decode tile's rows hold several "
            "heads); \"chunked\" runs it.")
      out.append(mod.values_at(
          i, args, batch=jnp.arange(b, dtype=i32)[:, None], head=0,
          q_idx=0, kv_idx=jnp.arange(kv_positions, dtype=i32)[None, :]))
    else:
      out.append(mod.values_at(
          i, args, batch=jnp.arange(b, dtype=i32)[:, None, None],
          head=heads[None], q_idx=row_pos[:, None, :], kv_idx=0))
  return out


def split_call(info, backend: str, *, tables: bool = False
               ) -> tuple[FusedMod | None, FusedMod | None]:
  """(score_mod, mask_mod) of a call's `masking.MaskInfo`, split; None for
  an absent one. Raises NotImplementedError as `split`."""
  return tuple(
      None if fn is None else split(name, fn, args, backend, tables=tables)
      for name, fn, args in (
          (mods.SCORE_MOD, info.score_mod, info.score_mod_args),
          (mods.MASK_MOD, info.mask_mod, info.mask_mod_args)))
