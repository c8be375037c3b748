"""Running one step's subprocess: its log, its timeout, its environment."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
from typing import Sequence

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")

# A stopped step gets SIGINT (pytest then still writes its junit XML), then
# SIGTERM, then SIGKILL, each after this many seconds.
STOP_GRACE = (10, 3, 3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcResult:
  """How one subprocess ended."""

  returncode: int | None
  timed_out: bool
  duration_s: float


def _stop(proc: subprocess.Popen) -> int | None:
  """Stops `proc`'s process group: SIGINT, SIGTERM, then SIGKILL."""
  for sig, grace in zip((signal.SIGINT, signal.SIGTERM, signal.SIGKILL),
                        STOP_GRACE):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      break
    try:
      return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
      continue
  return proc.poll()


def run_logged(cmd: Sequence[str], *, log_path: pathlib.Path,
               timeout: float, env: dict[str, str] | None = None,
               cwd: pathlib.Path = REPO_ROOT) -> ProcResult:
  """Runs `cmd` with stdout and stderr into `log_path`, within `timeout`.

  The command runs in its own process group, so that on timeout (or when
  this script is interrupted) its children (pytest-xdist workers, benchmark
  cells) stop with it. It stays in this session: whatever ends the session
  ends it too.

  Args:
    cmd: the command.
    log_path: the log file (overwritten); it starts with the command.
    timeout: seconds before the process group is stopped.
    env: the environment (default: this one).
    cwd: the working directory.

  Returns:
    The exit status (None if it could not be reaped), whether it timed out
    and how long it ran.
  """
  start = time.monotonic()
  with open(log_path, "w") as log:
    log.write("$ " + shlex.join(cmd) + "\n")
    log.flush()
    group = ({"process_group": 0} if sys.version_info >= (3, 11)
             else {"preexec_fn": os.setpgrp})
    proc = subprocess.Popen(
        list(cmd), stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, cwd=cwd, env=env, **group)
    timed_out = False
    try:
      returncode = proc.wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
      timed_out = True
      returncode = _stop(proc)
    except BaseException:  # Ctrl-C or SIGTERM: take the group down too.
      _stop(proc)
      raise
    duration = time.monotonic() - start
    note = f" (timed out after {timeout:.0f} s)" if timed_out else ""
    log.write(f"\n[gpu_check] exit status {returncode}{note}, "
              f"{duration:.1f} s\n")
  return ProcResult(returncode=returncode, timed_out=timed_out,
                    duration_s=duration)


def child_env(**extra: str) -> dict[str, str]:
  """This environment for a step's child: the repository root first on
  PYTHONPATH (nothing need be installed), unbuffered output, and `extra`."""
  env = dict(os.environ)
  path = env.get("PYTHONPATH")
  env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
  env["PYTHONUNBUFFERED"] = "1"
  env.update(extra)
  return env


def log_tail(path: pathlib.Path, lines: int = 3) -> str:
  """The last `lines` non-empty lines of a `run_logged` log, on one line
  (without the command and this script's own notes), for a step's reason."""
  try:
    text = path.read_text(errors="replace").strip().splitlines()
  except OSError:
    return ""
  text = [t for t in text[1:]  # text[0] is the command.
          if t.strip() and not t.startswith("[gpu_check]")]
  return " | ".join(t.strip() for t in text[-lines:])[:500]


def has_module(name: str) -> bool:
  """Whether module `name` can be imported here (without importing it)."""
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):  # A parent package is missing.
    return False


def cuda_plugin() -> str | None:
  """The importable jax CUDA plugin module, or None."""
  for name in CUDA_PLUGINS:
    if has_module(name):
      return name
  return None
