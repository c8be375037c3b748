"""Calls inside a user's `jax.shard_map` that checks varying axes.

Under `shard_map(..., check_vma=True)` (its default) every array's type
records the mesh axes along which its value varies, and JAX demands equal
types where values meet: a loop's carry in and out, the branches of a
switch, a Pallas kernel's declared outputs. Arrays the library creates
(zeros to accumulate into, a kernel's output buffers) vary along no axis,
the user's along some, so those places fail with type errors unless they
are told. The rule here, applied once at each public entry
(`vary_together`) and then wherever an array is created inside a loop or a
kernel's outputs are declared (`vary_like`, `out_structs`): every array of
one call varies along the union of its inputs' axes.

Outside such a shard_map (or on a jax without varying-axis types) every
function here is the identity (`check_kernels` passes), so the traced
program is unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = Any


def _varying(x) -> frozenset:
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", ()) or ())


def axes(*trees) -> tuple[str, ...]:
  """The mesh axes along which any array of `trees` varies, sorted (a
  tuple, as `lax.pcast` takes them)."""
  found = frozenset()
  for leaf in jax.tree.leaves(trees):
    if isinstance(leaf, jax.Array):
      found |= _varying(leaf)
  return tuple(sorted(found))


def vary(tree, names: tuple[str, ...]):
  """Every array of `tree` varying along `names` too. The cast moves no
  data; its transpose sums the cotangent over the axes it added (a
  replicated key's gradient is the sum of every device's)."""
  if not names:
    return tree

  def cast(x):
    if isinstance(x, np.ndarray):  # A constant meets varying operands too.
      x = jnp.asarray(x)
    if not isinstance(x, jax.Array):
      return x
    missing = tuple(a for a in names if a not in _varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def vary_together(*trees):
  """`trees` with every array varying along the union of their axes."""
  return vary(trees, axes(*trees))


def vary_like(tree, like):
  """`tree`'s arrays varying along `like`'s axes (loop carries and branch
  results created inside a call, against the call's inputs)."""
  return vary(tree, axes(like))


_TAKES_MANUAL = "manual_axis_type" in inspect.signature(
    jax.ShapeDtypeStruct).parameters


def out_structs(structs, like):
  """A kernel's output declarations (`jax.ShapeDtypeStruct`s) typed as
  varying along `like`'s axes, as a Pallas call inside such a shard_map
  must declare them."""
  names = axes(like)
  if not names or not _TAKES_MANUAL:
    return structs
  manual = None
  for leaf in jax.tree.leaves(like):
    if isinstance(leaf, jax.Array) and _varying(leaf) == frozenset(names):
      manual = jax.typeof(leaf).manual_axis_type
      break
  if manual is None:
    return structs

  def typed(s):
    if not isinstance(s, jax.ShapeDtypeStruct):
      return s
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding,
                                manual_axis_type=manual)

  return jax.tree.map(typed, structs)


def check_kernels(implementation: str, *trees,
                  interpreted: Callable[[], bool]) -> None:
  """Declines Pallas kernels that cannot run inside such a shard_map.

  A `pl.pallas_call` compiled for a GPU (Triton) or a TPU traces its body
  on blocks that carry no axes, and its outputs are declared varying
  (`out_structs`): it runs. Interpreted, the body runs on the whole
  varying arrays, and Mosaic GPU's kernels trace theirs with the map's
  types; either way their loops' fresh counters and accumulators meet
  varying values with other types, inside JAX where no call site reaches.

  Args:
    implementation: the backend's name.
    *trees: the call's arrays.
    interpreted: () -> whether the kernels run interpreted here, asked
      only inside such a map.

  Raises:
    NotImplementedError: the kernels are interpreted or Mosaic GPU's, and
      the inputs vary along mesh axes; automatic choice then moves on.
  """
  names = axes(*trees)
  if not names:
    return
  how = "has kernels that"
  if interpreted():
    how = "runs interpreted here, and its interpreted kernels"
  elif implementation != "mosaic_gpu":
    return
  raise NotImplementedError(
      f"implementation={implementation!r} {how} cannot run inside a "
      "jax.shard_map that checks varying axes (check_vma=True, the "
      f"default; inputs vary along {names}): pass check_vma=False to "
      "jax.shard_map, or use implementation='chunked'.")


def explicit_spec(x) -> Any:
  """x's `PartitionSpec` (one entry a dim) when its type carries Explicit
  mesh axes (`jax.make_mesh`'s default, under `jax.set_mesh`), else None.

  The library's own arrays (accumulators, loop carries) carry no sharding
  in their types, and JAX demands equal types where they meet the user's:
  calls on such arrays run under `jax.sharding.auto_axes`, where sharding
  is left to the compiler as on any other mesh.
  """
  if not isinstance(x, (jax.Array, jax.core.Tracer)):
    return None  # Host arrays (and arguments the checks will refuse).
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not any(
      t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return None
  spec = tuple(sharding.spec)
  return jax.sharding.PartitionSpec(*spec, *(None,) * (x.ndim - len(spec)))
