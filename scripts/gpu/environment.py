"""The env step's record: device, driver and versions of this machine, and
which source it ran.

`collect_env` runs in a child process (`gpu_check.py --collect-env=PATH`), so
that a jax which hangs or crashes while starting its backend costs only this
step.

Which source: the copy of the working tree on a lent GPU machine has no
.git, so the commit comes from the environment variable PALLAS_FA_COMMIT
(set by the command that runs gpu_check; `gpu_check.py --plan` prints that
command with this checkout's commit in it), else from git where there is
one. The source hash (`source_hash`) needs neither: it is computed from the
files themselves, so `gpu_check.py --plan` here and the summary of a run
there agree exactly when the same source ran.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
from typing import Any
from typing import Sequence

from compile import ptxas as ptxas_lib

from gpu import runner

# What the source hash covers: the code and data that decide a run.
_SOURCE_DIRS = ("pallas_fa", "models", "scripts", "tests")
_SOURCE_SUFFIXES = (".py", ".json", ".toml")


def _command_output(cmd: Sequence[str], timeout: float = 30) -> str | None:
  if shutil.which(cmd[0]) is None and not os.path.isfile(cmd[0]):
    return None
  try:
    proc = subprocess.run(
      list(cmd),
      capture_output=True,
      text=True,
      timeout=timeout,
      cwd=runner.REPO_ROOT,
    )
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"error: {e}"
  return (proc.stdout + proc.stderr).strip()


def source_hash(root: pathlib.Path = runner.REPO_ROOT) -> str:
  """A short sha256 of the source files under `root` (their paths and
  contents: *.py, *.json, *.toml in pallas_fa/, models/, scripts/, tests/
  and pyproject.toml), the same here and in a copy without .git."""
  digest = hashlib.sha256()
  paths = [root / "pyproject.toml"]
  for folder in _SOURCE_DIRS:
    paths += (
      p
      for p in (root / folder).rglob("*")
      if p.suffix in _SOURCE_SUFFIXES
      and p.is_file()
      and "__pycache__" not in p.parts
    )
  for path in sorted(set(paths)):
    if not path.is_file():
      continue
    digest.update(path.relative_to(root).as_posix().encode() + b"\0")
    digest.update(path.read_bytes() + b"\0")
  return digest.hexdigest()[:16]


def commit_info() -> dict[str, Any]:
  """The commit that ran: PALLAS_FA_COMMIT, else git's HEAD (and the files
  it shows as modified), else None; and the source hash."""
  info: dict[str, Any] = {"source_hash": source_hash()}
  given = os.environ.get("PALLAS_FA_COMMIT", "").strip()
  if given:
    return {**info, "commit": given, "from": "PALLAS_FA_COMMIT"}
  if not (runner.REPO_ROOT / ".git").exists():
    return {
      **info,
      "commit": None,
      "from": "none (no .git and PALLAS_FA_COMMIT unset)",
    }
  commit = _command_output(["git", "rev-parse", "HEAD"])
  if commit is None or commit.startswith(("error", "fatal")):
    return {**info, "commit": None, "from": commit or "git not found"}
  status = (
    _command_output(["git", "status", "--porcelain", "--untracked-files=no"])
    or ""
  )
  return {
    **info,
    "commit": commit,
    "from": "git",
    "modified": status.splitlines(),
  }


def _packages() -> dict[str, str]:
  names = {}
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower()
    if name in (
      "jax",
      "jaxlib",
      "flax",
      "optax",
      "orbax-checkpoint",
      "chex",
      "numpy",
      "pytest",
      "pytest-timeout",
      "pytest-xdist",
      "hypothesis",
      "absl-py",
      "tokamax",
    ) or name.startswith(("jax-cuda", "jax_cuda", "nvidia-", "triton")):
      names[name] = dist.version
  return dict(sorted(names.items()))


def cuda_versions() -> dict[str, Any]:
  """The CUDA library versions jax's CUDA plugin reports (runtime, cuDNN,
  cuBLAS, ...: each `*_version` function of its `_versions` module), {}
  without one. The runtime's decides whether mosaic_gpu refuses masked
  kernels (`pallas_fa.mosaic_gpu.cuda_runtime_version`)."""
  try:
    versions = importlib.import_module("jax._src.lib").cuda_versions
  except Exception:  # A jax without the attribute: nothing to report.
    return {}
  if versions is None:
    return {}
  out = {"module": versions.__name__}
  for name in sorted(dir(versions)):
    if not name.endswith("_version"):
      continue
    try:
      out[name] = getattr(versions, name)()
    except Exception as e:  # One that needs arguments or a device.
      out[name] = f"{type(e).__name__}: {e}"[:200]
  return out


def ptxas_versions() -> dict[str, str | None]:
  """`ptxas --version` of the wheel's ptxas (the one XLA uses) and of the
  one on PATH, by path."""
  out = {}
  for path in dict.fromkeys((ptxas_lib.ptxas_path(), shutil.which("ptxas"))):
    if path:
      lines = (_command_output([path, "--version"]) or "").splitlines()
      # "Cuda compilation tools, release 13.0, V13.0.88", else the last.
      release = [x for x in lines if "release" in x]
      out[path] = (release or lines or [None])[-1]
  return out


def _devices(jax) -> list[dict[str, Any]]:
  devices = []
  for d in jax.devices():
    record = {"id": d.id, "platform": d.platform, "str": str(d)}
    for attr in ("device_kind", "compute_capability", "core_count"):
      record[attr] = getattr(d, attr, None)
    try:
      stats = d.memory_stats() or {}
      record["bytes_limit"] = stats.get("bytes_limit")
    except Exception:  # Not every backend reports memory.
      record["bytes_limit"] = None
    devices.append(record)
  return devices


def collect_env(dry_run: bool) -> dict[str, Any]:
  """Device, driver, versions and source of this machine.

  Args:
    dry_run: whether a missing GPU is expected.

  Returns:
    A JSON-able record; "problems" lists what makes the step fail.
  """
  info: dict[str, Any] = {
    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"
    ),
    "python": sys.version,
    "python_executable": sys.executable,
    "platform": platform.platform(),
    "hostname": platform.node(),
    "cpu_count": os.cpu_count(),
    "source": commit_info(),
    "cuda_plugin_module": runner.cuda_plugin(),
    "packages": _packages(),
    "ptxas": ptxas_versions(),
    "env_vars": {
      k: v
      for k, v in os.environ.items()
      if k.startswith(
        ("XLA_", "JAX_", "CUDA_", "NVIDIA_", "PALLAS_FA_", "TF_CPP_")
      )
    },
    "nvidia_smi": _command_output(["nvidia-smi"]),
    "nvidia_smi_query": _command_output(
      [
        "nvidia-smi",
        "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
        "clocks.max.mem,power.limit,compute_cap",
        "--format=csv",
      ]
    ),
  }
  problems = []
  try:
    import jax
    import jaxlib

    info["jax_version"] = jax.__version__
    info["jaxlib_version"] = jaxlib.__version__
    info["default_backend"] = jax.default_backend()
    info["devices"] = _devices(jax)
    info["cuda"] = cuda_versions()
    try:
      info["platform_version"] = jax.devices()[0].client.platform_version
    except Exception:  # A private attribute; absent on some versions.
      info["platform_version"] = None
  except Exception as e:  # Recorded: the point of this step.
    problems.append(f"jax: {type(e).__name__}: {e}")
  try:
    import pallas_fa
    from pallas_fa import api

    info["pallas_fa"] = {
      "file": pallas_fa.__file__,
      "version": getattr(pallas_fa, "__version__", None),
      "platform": api.platform(),
      "implementations": list(pallas_fa.implementations()),
    }
    mosaic_gpu = importlib.import_module("pallas_fa.mosaic_gpu")
    info["pallas_fa"]["mosaic_gpu_cuda_runtime"] = (
      mosaic_gpu.cuda_runtime_version()
    )
  except Exception as e:  # Recorded: the point of this step.
    problems.append(f"pallas_fa: {type(e).__name__}: {e}")
  if not dry_run and info.get("default_backend") not in (None, "gpu"):
    problems.append(
      f"no GPU: jax.default_backend() is {info['default_backend']!r} "
      f"(CUDA plugin module: {info['cuda_plugin_module']})"
    )
  info["problems"] = problems
  return info


def write_env(path: str, dry_run: bool) -> int:
  """Writes `collect_env`'s record to `path` and prints its key fields.

  Returns:
    The exit status of `gpu_check.py --collect-env`: 1 if it found problems.
  """
  info = collect_env(dry_run)
  with open(path, "w") as f:
    json.dump(info, f, indent=1, default=str)
    f.write("\n")
  print(
    json.dumps(
      {
        k: info.get(k)
        for k in (
          "jax_version",
          "jaxlib_version",
          "default_backend",
          "devices",
          "cuda",
          "ptxas",
          "source",
          "problems",
        )
      },
      indent=1,
      default=str,
    )
  )
  return 1 if info["problems"] else 0


def headline(info: dict[str, Any]) -> dict[str, Any]:
  """The fields of `collect_env`'s record that the summary shows."""
  devices = info.get("devices") or [{}]
  cuda = info.get("cuda") or {}
  ptxas = [v for v in (info.get("ptxas") or {}).values() if v]
  source = info.get("source") or {}
  return {
    "device": devices[0].get("device_kind"),
    "devices": len(info.get("devices") or []),
    "compute_capability": devices[0].get("compute_capability"),
    "jax": info.get("jax_version"),
    "jaxlib": info.get("jaxlib_version"),
    "cuda_runtime": cuda.get("cuda_runtime_get_version"),
    "cudnn": cuda.get("cudnn_get_version"),
    "ptxas": ptxas[0] if ptxas else None,
    "commit": source.get("commit"),
    "source_hash": source.get("source_hash"),
  }


def env_brief(info: dict[str, Any]) -> str:
  """One line of `collect_env`'s record: devices, versions, source."""
  h = headline(info)
  parts = []
  if h["devices"]:
    cc = h["compute_capability"]
    parts.append(
      f"{h['devices']} x {h['device']}" + (f" (sm {cc})" if cc else "")
    )
  parts.append(f"jax {h['jax']}, jaxlib {h['jaxlib']}")
  if h["cuda_runtime"]:
    parts.append(f"CUDA runtime {h['cuda_runtime']}, cuDNN {h['cudnn']}")
  if h["ptxas"]:
    parts.append(f"ptxas: {h['ptxas']}")
  parts.append(f"commit {(h['commit'] or '?')[:12]}, source {h['source_hash']}")
  return "; ".join(parts)
