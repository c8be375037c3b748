"""The env step's record: device, driver and versions of this machine.

`collect_env` runs in a child process (`gpu_check.py --collect-env=PATH`), so
that a jax which hangs or crashes while starting its backend costs only this
step.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from typing import Any
from typing import Sequence

from gpu import runner


def _command_output(cmd: Sequence[str], timeout: float = 30) -> str | None:
  if shutil.which(cmd[0]) is None:
    return None
  try:
    proc = subprocess.run(list(cmd), capture_output=True, text=True,
                          timeout=timeout, cwd=runner.REPO_ROOT)
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"error: {e}"
  return (proc.stdout + proc.stderr).strip()


def _git_info() -> dict[str, Any]:
  commit = _command_output(["git", "rev-parse", "HEAD"])
  if commit is None or commit.startswith(("error", "fatal")):
    return {"commit": None, "reason": commit or "git not found"}
  status = _command_output(
      ["git", "status", "--porcelain", "--untracked-files=no"]) or ""
  return {"commit": commit, "modified": status.splitlines()}


def _packages() -> dict[str, str]:
  names = {}
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower()
    if (name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
                 "chex", "numpy", "pytest", "pytest-timeout",
                 "pytest-xdist", "hypothesis", "absl-py")
        or name.startswith(("jax-cuda", "jax_cuda", "nvidia-", "triton"))):
      names[name] = dist.version
  return dict(sorted(names.items()))


def collect_env(dry_run: bool) -> dict[str, Any]:
  """Device, driver and versions of this machine.

  Args:
    dry_run: whether a missing GPU is expected.

  Returns:
    A JSON-able record; "problems" lists what makes the step fail.
  """
  info: dict[str, Any] = {
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "python": sys.version,
      "python_executable": sys.executable,
      "platform": platform.platform(),
      "hostname": platform.node(),
      "cpu_count": os.cpu_count(),
      "cuda_plugin_module": runner.cuda_plugin(),
      "packages": _packages(),
      "git": _git_info(),
      "env_vars": {k: v for k, v in os.environ.items()
                   if k.startswith(("XLA_", "JAX_", "CUDA_", "NVIDIA_",
                                    "PALLAS_FA_", "TF_CPP_"))},
      "nvidia_smi": _command_output(["nvidia-smi"]),
      "nvidia_smi_query": _command_output([
          "nvidia-smi",
          "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
          "clocks.max.mem,power.limit,compute_cap",
          "--format=csv"]),
  }
  problems = []
  try:
    import jax
    import jaxlib

    info["jax_version"] = jax.__version__
    info["jaxlib_version"] = jaxlib.__version__
    info["default_backend"] = jax.default_backend()
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
    info["devices"] = devices
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
  except Exception as e:  # Recorded: the point of this step.
    problems.append(f"pallas_fa: {type(e).__name__}: {e}")
  if not dry_run and info.get("default_backend") not in (None, "gpu"):
    problems.append(
        f"no GPU: jax.default_backend() is {info['default_backend']!r} "
        f"(CUDA plugin module: {info['cuda_plugin_module']})")
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
  print(json.dumps({k: info.get(k) for k in (
      "jax_version", "jaxlib_version", "default_backend", "devices",
      "cuda_plugin_module", "problems")}, indent=1, default=str))
  return 1 if info["problems"] else 0


def env_brief(info: dict[str, Any]) -> str:
  """One line of `collect_env`'s record: devices, versions, commit."""
  devices = info.get("devices") or []
  parts = []
  if devices:
    d = devices[0]
    cc = d.get("compute_capability")
    extra = ", ".join(x for x in (
        f"sm {cc}" if cc else "",
        f"{d['core_count']} cores" if d.get("core_count") else "") if x)
    parts.append(f"{len(devices)} x {d.get('device_kind')}"
                 + (f" ({extra})" if extra else ""))
  parts.append(f"jax {info.get('jax_version')}, "
               f"jaxlib {info.get('jaxlib_version')}")
  plugins = {k: v for k, v in (info.get("packages") or {}).items()
             if k.startswith(("jax-cuda", "jax_cuda"))}
  if plugins:
    parts.append(", ".join(f"{k} {v}" for k, v in plugins.items()))
  commit = (info.get("git") or {}).get("commit")
  if commit:
    parts.append(f"commit {commit[:10]}")
  return "; ".join(parts)
