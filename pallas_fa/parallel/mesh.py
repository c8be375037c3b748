"""Device meshes and token layouts for multi-device attention.

`make_mesh` builds the (data, heads, sequence) mesh `pallas_fa.parallel`
plans its splits on; `shard_batch` and `replicate` place host data on it;
`zigzag` is the load-balanced token order of causal ring attention (device
r holds sequence chunks r and 2P-1-r of 2P); `shard_map` is the one wrapper
over jax's two spellings of it. `pallas_fa.parallel` re-exports all of them.
`onto_mesh` moves arrays laid out on another mesh onto the one a call runs
on, and `fresh_cotangents` gives its results' gradients that call's layout.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa import checks

Array = Any
AxisNames = str | Sequence[str] | None
_P = jax.sharding.PartitionSpec

# Mesh axis names used by `make_mesh` (any names work elsewhere).
DATA_AXIS = "data"
HEAD_AXIS = "heads"
SEQUENCE_AXIS = "sequence"


def shard_map(f, *, mesh, in_specs, out_specs):
  """`jax.shard_map` (or the older `jax.experimental.shard_map`).

  Replication checking is off: the ring skips steps with `lax.cond`, whose
  branches differ in how they vary over the mesh; the transpose still sums
  the cotangents of inputs replicated over an axis.
  """
  if hasattr(jax, "shard_map"):
    return jax.shard_map(
        f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
  from jax.experimental import shard_map as legacy

  return legacy.shard_map(
      f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False
  )


def make_mesh(
    *,
    data: int = 1,
    heads: int = 1,
    sequence: int = 1,
    devices: Sequence[Any] | None = None,
) -> jax.sharding.Mesh:
  """A (data, heads, sequence) mesh with automatic (GSPMD) axes.

  The sequence axis is innermost so ring neighbours are, where possible,
  devices of the same host (NVLink rather than the network).

  Args:
    data: devices along the batch (data-parallel) axis.
    heads: devices along the head (tensor-parallel) axis.
    sequence: devices along the sequence (context-parallel, ring) axis.
    devices: devices to use, default `jax.devices()` (all processes).

  Returns:
    A `jax.sharding.Mesh` with axes (DATA_AXIS, HEAD_AXIS, SEQUENCE_AXIS).

  Raises:
    TypeError: a size that is not an int (the message names it).
    ValueError: a size below 1, or data * heads * sequence differs from the
      number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  # A float size would pass the product check (2.0 * 2 == 4) and reach
  # jax's mesh constructors.
  shape = tuple(checks.check_positive_int(name, size) for name, size in (
      ("data", data), ("heads", heads), ("sequence", sequence)))
  if int(np.prod(shape)) != len(devices):
    raise ValueError(
        f"make_mesh needs data * heads * sequence == number of devices, got "
        f"{data=}, {heads=}, {sequence=} for {len(devices)} devices."
    )
  names = (DATA_AXIS, HEAD_AXIS, SEQUENCE_AXIS)
  axis_type = getattr(jax.sharding, "AxisType", None)
  kwargs = {}
  if axis_type is not None:
    kwargs["axis_types"] = (axis_type.Auto,) * 3
  try:
    return jax.make_mesh(shape, names, devices=devices, **kwargs)
  except TypeError:  # Older jax: no devices= argument.
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names)


def axis_names(axes: AxisNames) -> tuple[str, ...]:
  """Mesh axis names as a tuple: None -> (), "x" -> ("x",).

  Raises:
    TypeError: `axes` is neither None, a name, nor a sequence of names.
  """
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  if not isinstance(axes, (tuple, list)) or not all(
      isinstance(a, str) for a in axes):
    raise TypeError(
        f"mesh axes must be None, a mesh axis name or a sequence of them, "
        f"got {axes!r}.")
  return tuple(axes)


def mesh_size(mesh: jax.sharding.Mesh, names: tuple[str, ...]) -> int:
  """Devices along the mesh axes `names` (1 for none)."""
  return int(np.prod([mesh.shape[a] for a in names], dtype=np.int64))


def spec_entry(names: tuple[str, ...]):
  """A PartitionSpec entry for `names` (None when empty)."""
  if not names:
    return None
  return names[0] if len(names) == 1 else names


def onto_mesh(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """Moves the arrays of `tree` that are laid out on another mesh onto
  `mesh`, each dim split as before where `mesh` has the axes for it (else
  not split).

  `jax.jit` gives its results the mesh of its first input that is laid out
  on a mesh; a call over `mesh` whose inputs sit on another mesh (say, the
  one an earlier call used) would have its results converted to that mesh,
  which fails (IndivisibleError) when the two meshes' shapes differ. Arrays
  already on `mesh` and uncommitted ones are returned as they are, and so
  are tracers, except under eager autodiff (`jax.grad` without `jit`),
  whose tracers carry a concrete array: that one's layout decides, and the
  tracer moves by `jax.device_put` (which autodiff transposes). Inside a
  `jit` the layout of the jitted function's own inputs is what counts.
  """

  def entry_on(entry, size):
    names = axis_names(entry)
    if names and all(a in mesh.shape for a in names) and not (
        size % mesh_size(mesh, names)):
      return entry
    return None

  def move(x):
    concrete = x
    if isinstance(x, jax.core.Tracer):
      # JAX's accessor of a tracer's concrete value (None inside a jit).
      concrete = getattr(x, "to_concrete_value", lambda: None)()
    sharding = getattr(concrete, "sharding", None)
    if (not isinstance(sharding, jax.sharding.NamedSharding)
        or sharding.mesh == mesh):
      return x
    spec = [entry_on(e, n) for e, n in zip(sharding.spec, x.shape)]
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, _P(*spec)))

  return jax.tree.map(move, tree)


def fresh_cotangents(tree: Any) -> Any:
  """The identity, whose gradient lays each cotangent out like its primal.

  An eager gradient (`jax.grad` without `jit`) of a result on one mesh,
  after one on a mesh of another shape, can hand the result a cotangent
  whose type names the first mesh: JAX dispatches each eager operation
  from a cache keyed on its operands' concrete shardings (one device for
  an uncommitted array), not on the mesh their types carry, so `ct * g`
  returns the type it had when first run. The transpose of a jit reading
  that cotangent then describes its layout on the wrong mesh and fails
  (IndivisibleError). Placing the cotangent where its primal lies gives it
  a type made afresh from that sharding. Traced cotangents (under a `jit`,
  where types come from tracing) pass through unchanged.
  """
  return _fresh_cotangents(tree)


@jax.custom_vjp
def _fresh_cotangents(tree):
  return tree


def _fresh_cotangents_fwd(tree):
  # The primals themselves: their shardings say where cotangents go.
  return tree, tree


def _fresh_cotangents_bwd(primals, cotangents):
  def place(primal, ct):
    if (isinstance(primal, jax.core.Tracer) or isinstance(
        ct, jax.core.Tracer) or not hasattr(primal, "sharding")):
      return ct
    return jax.device_put(ct, primal.sharding)

  return (jax.tree.map(place, primals, cotangents),)


_fresh_cotangents.defvjp(_fresh_cotangents_fwd, _fresh_cotangents_bwd)


def zigzag_indices(length: int, num_shards: int) -> np.ndarray:
  """Token order of the zig-zag layout: `x_zz = x[zigzag_indices(...)]`.

  The sequence is cut into 2 * num_shards equal chunks and shard r holds
  chunks r and 2 * num_shards - 1 - r, so under a causal mask every shard
  sees the same number of keys (FlashAttention-style load balancing for
  context parallelism).

  Raises:
    TypeError: length or num_shards is not an int (a float would make the
      indices float64).
    ValueError: length < 0, num_shards < 1, or length is not a multiple of
      2 * num_shards.
  """
  length = checks.check_int("length", length, 0)
  num_shards = checks.check_positive_int("num_shards", num_shards)
  chunks = 2 * num_shards
  if length % chunks:
    raise ValueError(
        f"the zig-zag layout needs length % (2 * num_shards) == 0, got "
        f"{length=}, {num_shards=}."
    )
  c = length // chunks
  order = []
  for r in range(num_shards):
    order += [r, chunks - 1 - r]
  return np.concatenate([np.arange(j * c, (j + 1) * c) for j in order])


def _check_axis(x, axis) -> int:
  """`zigzag`'s and `unzigzag`'s `axis` as an int in [0, x.ndim)."""
  axis = checks.check_int("axis", axis, -x.ndim)
  if axis >= x.ndim:
    raise ValueError(
        f"axis must be in [-{x.ndim}, {x.ndim}) for x of rank {x.ndim}, got "
        f"{axis=}.")
  return axis % x.ndim


def zigzag(x: Array, num_shards: int, axis: int = 1) -> Array:
  """Permutes `axis` of x into the zig-zag layout (see `zigzag_indices`).

  A model permutes its tokens (and targets, and `arange` positions) once
  with this and runs every layer in that order; attention stays exact because
  it masks by the positions, which are permuted with the tokens.

  Raises:
    TypeError / ValueError: as `zigzag_indices`, or an axis that is not an
      int axis of x (the message names it).
  """
  x = jnp.asarray(x)
  return _permute(x, num_shards, _check_axis(x, axis), False)


def unzigzag(x: Array, num_shards: int, axis: int = 1) -> Array:
  """Inverse of `zigzag`: back to the natural token order (same errors)."""
  x = jnp.asarray(x)
  return _permute(x, num_shards, _check_axis(x, axis), True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _permute(x, num_shards, axis, inverse):
  order = zigzag_indices(x.shape[axis], num_shards)
  if inverse:
    order = np.argsort(order)
  return jnp.take(x, jnp.asarray(order), axis=axis)


def _permute_fwd(x, num_shards, axis, inverse):
  return _permute(x, num_shards, axis, inverse), None


def _permute_bwd(num_shards, axis, inverse, _, g):
  # A permutation's transpose is its inverse: a gather again, where
  # autodiff of `take` would scatter-add (which jax refuses to shard on a
  # mesh with explicit axes).
  if g.dtype == jax.dtypes.float0:  # Integer inputs (positions, segments).
    return (g,)
  return (_permute(g, num_shards, axis, not inverse),)


_permute.defvjp(_permute_fwd, _permute_bwd)


def shard_batch(
    batch: Any,
    mesh: jax.sharding.Mesh,
    *,
    batch_axes: AxisNames = DATA_AXIS,
    sequence_axis: str | None = SEQUENCE_AXIS,
    load_balance: bool = True,
) -> Any:
  """Places a host batch on `mesh`: rows over batch_axes, tokens over the ring.

  Every leaf is a [B, T, ...] host array (tokens, targets, weights, positions,
  segment ids). When the sequence is split (the mesh has `sequence_axis` of
  size > 1) and `load_balance` is set, the token axis is permuted into the
  zig-zag layout first, so causal ring attention is balanced; the batch must
  then carry the true `positions` ([B, T], e.g. `arange(T)`), which the
  model passes to attention and RoPE. Token-wise losses are unchanged by the
  permutation.

  Works on one or many processes: every process passes the same global batch
  (as a deterministic data pipeline gives) and keeps only its devices' part.

  Args:
    batch: pytree of [B, T, ...] arrays.
    mesh: the device mesh.
    batch_axes: mesh axis name(s) splitting B ("data" by default; None for
      none).
    sequence_axis: mesh axis splitting T, or None (also ignored when absent
      from the mesh).
    load_balance: permute T into the zig-zag layout when T is split.

  Returns:
    The batch as global `jax.Array`s sharded [batch_axes, sequence_axis].

  Raises:
    ValueError: T is not a multiple of 2 * ring size (zig-zag) or B of the
      batch-axis size.
    TypeError: load_balance is not a bool.
  """
  load_balance = checks.check_flag("load_balance", load_balance)
  batch_names = tuple(a for a in axis_names(batch_axes) if a in mesh.shape)
  if sequence_axis is not None and sequence_axis not in mesh.shape:
    sequence_axis = None
  ring_size = 1 if sequence_axis is None else mesh.shape[sequence_axis]
  spec = _P(spec_entry(batch_names), sequence_axis if ring_size > 1 else None)
  sharding = jax.sharding.NamedSharding(mesh, spec)
  rows = mesh_size(mesh, batch_names)

  def put(x):
    x = np.asarray(x)
    if x.ndim < 2 or x.shape[0] % rows:
      raise ValueError(
          f"shard_batch needs [B, T, ...] leaves with B a multiple of {rows} "
          f"(the devices on {batch_axes=}), got a leaf of shape {x.shape}."
      )
    if ring_size > 1 and load_balance:
      x = np.take(x, zigzag_indices(x.shape[1], ring_size), axis=1)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  return jax.tree.map(put, batch)


def replicate(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """Places a pytree (parameters, optimiser state) on every device of mesh.

  Works on one or many processes; every process passes the same values
  (the same initialisation seed, or a restored checkpoint).
  """
  sharding = jax.sharding.NamedSharding(mesh, _P())

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  return jax.tree.map(put, tree)
