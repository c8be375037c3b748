"""Reading a compile's results: ptxas reports and XLA's dumps.

Both compilers print the `ptxas -v` report of every kernel they build (see
`compile_check.py` for the environment that turns it on); the Triton
kernels' launch dimensions come from XLA's thunk-sequence dump, the Mosaic GPU
ones from the lowered program.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
import shutil
import sys
from typing import Any

_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PTXAS_PROPS = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_THUNK = re.compile(
    r"kCustomKernel .*?\] (\S+) grid: \[([^\]]*)\] threads: \[([^\]]*)\]"
    r"\s+shared_memory: (\d+) bytes")


def parse_ptxas(text: str) -> dict[str, dict[str, Any]]:
  """`ptxas -v` output -> {entry: {registers, spill_stores, ...}}."""
  out, current = {}, None
  for line in text.splitlines():
    if m := _PTXAS_FUNC.search(line):
      current = out.setdefault(m.group(1), {"arch": m.group(2)})
    elif current is not None and (m := _PTXAS_PROPS.search(line)):
      current.update(stack_bytes=int(m.group(1)),
                     spill_stores=int(m.group(2)),
                     spill_loads=int(m.group(3)))
    elif current is not None and (m := _PTXAS_USED.search(line)):
      current["registers"] = int(m.group(1))
  return out


def ptxas_path() -> str | None:
  """ptxas of the nvidia-cuda-nvcc wheel, else the one on PATH."""
  for name in ("nvidia.cuda_nvcc", "nvidia.cu13"):
    try:
      spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
      continue
    for root in (spec.submodule_search_locations or []) if spec else []:
      path = os.path.join(root, "bin", "ptxas")
      if os.path.exists(path):
        return path
  return shutil.which("ptxas")


@contextlib.contextmanager
def captured_output(path: str):
  """Redirects file descriptors 1 and 2 (C++ writes there too) to `path`."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  with open(path, "w") as f:
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
  try:
    yield
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, old in zip((1, 2), saved):
      os.dup2(old, fd)
      os.close(old)


def triton_launches(dump: str) -> dict[str, dict[str, Any]]:
  """{kernel: grid, threads, smem_bytes} from XLA's thunk-sequence dump."""
  launches = {}
  for path in glob.glob(os.path.join(dump, "*thunk_sequence*.txt")):
    with open(path) as f:
      for m in _THUNK.finditer(f.read()):
        launches[m.group(1)] = dict(
            grid=m.group(2).replace(" ", ""),
            threads=m.group(3).replace(" ", ""), smem_bytes=int(m.group(4)))
  return launches


def mosaic_launches(lowered) -> dict[str, dict[str, Any]]:
  """{kernel: grid, threads, smem_bytes} from the Mosaic GPU modules inside
  the lowered program (each `gpu.launch` names its dynamic shared memory).

  Reads the serialized kernel modules with jax's own MLIR bindings; returns
  {} if this jax stores them differently (the rows then lack these fields).
  """
  try:
    from jax._src.interpreters import mlir as jax_mlir  # noqa: PLC0415
    from jax._src.lib import mosaic_gpu_dialect  # noqa: PLC0415
    from jax._src.lib.mlir import ir  # noqa: PLC0415
  except ImportError:
    return {}
  launches = {}
  ctx = jax_mlir.make_ir_context()
  mosaic_gpu_dialect.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True

  def constant(value):
    return int(ir.IntegerAttr(value.owner.attributes["value"]).value)

  def calls(op):
    """The ops nested in `op`, but not those inside a `gpu.launch`: the
    kernel's body, most of its module and of this walk's time."""
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          yield inner
          if not inner.operation.name.endswith("gpu.launch"):
            yield from calls(inner)

  for op in calls(lowered.compiler_ir("stablehlo").operation):
    if op.name != "stablehlo.custom_call":
      continue
    if "mosaic_gpu" not in str(op.attributes["call_target_name"]):
      continue
    try:
      config = ir.DictAttr(op.attributes["mhlo.backend_config"])
      module = ir.Module.parse(
          ir.StringAttr(config["module"]).value_bytes, context=ctx)
    except (KeyError, ValueError, ir.MLIRError):
      continue
    found = {}
    for inner in calls(module.operation):
      name = inner.name
      if name.endswith("func.func") and "sym_name" in inner.attributes:
        sym = ir.StringAttr(inner.attributes["sym_name"]).value
        if sym.startswith("pfa_"):
          found["kernel"] = sym.removesuffix("_mosaic_gpu")
      if name.endswith("gpu.launch"):
        dims = [constant(v) for v in list(inner.operands)[1:8]]
        found.update(grid=",".join(map(str, dims[:3])),
                     threads=",".join(map(str, dims[3:6])),
                     smem_bytes=dims[6])
    if "kernel" in found:
      launches[found.pop("kernel")] = found
  return launches
