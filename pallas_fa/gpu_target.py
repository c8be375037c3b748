"""The GPU kernels are built for: the local one, or an ahead-of-time target.

Backends never ask `jax.devices()` directly which GPU they run on; they ask
`current()`. Normally that is the default device (None when it is not a GPU).
Inside `compile_for(target)` it is `target`, whatever this machine has, so the
GPU backends build their *compiled* kernels (not the CPU interpreter) with the
tiling, grid and checks that GPU would get. Together with
`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`, or a compile
against a `jax.experimental.topologies` CUDA device, this gives on a machine
without a GPU exactly the program the GPU would run (`scripts/compile_check.py`
is built on it):

    with pallas_fa.gpu_target.compile_for(pallas_fa.gpu_target.H100):
      lowered = jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))

`flash_attention` keys its trace cache on the target, so calls inside and
outside the context never share a traced program.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import jax


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GpuTarget:
  """What the kernels need to know about a GPU.

  Attributes:
    device_kind: `jax.Device.device_kind`, e.g. "NVIDIA H100 80GB HBM3"
      (tuned tile records are stored per kind).
    compute_capability: "major.minor", e.g. "9.0".
    core_count: streaming multiprocessors (the persistent grid size).
    shared_memory_per_block: opt-in shared memory per block, bytes.
  """

  device_kind: str
  compute_capability: str
  core_count: int
  shared_memory_per_block: int

  @property
  def major(self) -> int:
    return int(self.compute_capability.split(".")[0] or 0)


# Published figures (CUDA programming guide, compute capability tables).
H100 = GpuTarget(
    device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0",
    core_count=132, shared_memory_per_block=232448)
A100 = GpuTarget(
    device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0",
    core_count=108, shared_memory_per_block=166912)

_AHEAD_OF_TIME: contextvars.ContextVar[GpuTarget | None] = (
    contextvars.ContextVar("pallas_fa_gpu_target", default=None))


def ahead_of_time() -> GpuTarget | None:
  """The target of the enclosing `compile_for`, or None."""
  return _AHEAD_OF_TIME.get()


def current() -> GpuTarget | None:
  """The GPU kernels are built for: the ahead-of-time target, else the
  default device when it is a GPU, else None (interpret on CPU)."""
  target = ahead_of_time()
  if target is not None:
    return target
  device = jax.devices()[0]
  if device.platform not in ("gpu", "cuda", "rocm"):
    return None
  return GpuTarget(
      device_kind=device.device_kind,
      compute_capability=str(getattr(device, "compute_capability", "")),
      core_count=int(getattr(device, "core_count", 0) or 0),
      shared_memory_per_block=int(
          getattr(device, "shared_memory_per_block_optin", 0) or 0),
  )


def builds_ptx() -> bool:
  """Whether kernels are built for an NVIDIA GPU (PTX: inline assembly
  applies), not interpreted and not for ROCm."""
  if current() is None:
    return False
  return ahead_of_time() is not None or jax.devices()[0].platform != "rocm"


def device_kind() -> str:
  """`device_kind` of the target, else of the default device ("cpu"...)."""
  target = ahead_of_time()
  return jax.devices()[0].device_kind if target is None else target.device_kind


def _abstract_gpu(target: GpuTarget):
  """jax >= 0.11 lowers Pallas-Triton only for a known GPU: without one, the
  device must be named through an abstract mesh. Older jax needs nothing."""
  device_cls = getattr(jax.sharding, "AbstractDevice", None)
  use_mesh = getattr(jax.sharding, "use_abstract_mesh", None)
  if device_cls is None or use_mesh is None:
    return contextlib.nullcontext()
  device = device_cls(device_kind=target.device_kind,
                      num_cores=target.core_count, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("_pallas_fa_target",),
                                   abstract_device=device)
  return use_mesh(mesh)


@contextlib.contextmanager
def compile_for(target: GpuTarget) -> Iterator[GpuTarget]:
  """Builds compiled kernels for `target` inside the context (see module doc).

  Args:
    target: the GPU to build for, e.g. `H100`.

  Yields:
    target.

  Raises:
    TypeError: target is not a GpuTarget.
  """
  if not isinstance(target, GpuTarget):
    raise TypeError(
        f"target must be a pallas_fa.gpu_target.GpuTarget, got {target=}.")
  token = _AHEAD_OF_TIME.set(target)
  try:
    with _abstract_gpu(target):
      yield target
  finally:
    _AHEAD_OF_TIME.reset(token)
