"""Running one step's subprocess: its log, its deadline, its environment;
and writing a file so that a reader never sees half of it."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from typing import Callable
from typing import Sequence

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "scripts"
CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")

# A process stopped at its deadline gets SIGINT (pytest then still writes its
# junit XML, a benchmark its last cell), then SIGTERM, then SIGKILL, each
# after this many seconds. Stopped because gpu_check itself is being stopped
# (a wall-clock limit from outside), it gets less.
STOP_GRACE = (6, 2, 2)
INTERRUPTED_GRACE = (2, 1, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcResult:
  """How one subprocess ended."""

  returncode: int | None
  timed_out: bool
  duration_s: float


def _stop(
  proc: subprocess.Popen, grace: Sequence[float] = STOP_GRACE
) -> int | None:
  """Stops `proc`'s process group: SIGINT, SIGTERM, then SIGKILL."""
  for sig, seconds in zip(
    (signal.SIGINT, signal.SIGTERM, signal.SIGKILL), grace
  ):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      break
    try:
      return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
      continue
  return proc.poll()


def shown(cmd: Sequence[str], folders: dict[str, str] | None = None) -> str:
  """`cmd` as the records show it, naming no path of the machine that ran
  it: this Python as python3, files of the repository relative to its root
  (the commands run there), and each of `folders` by its name."""
  names = {**(folders or {}), str(REPO_ROOT): "."}

  def one(arg: str) -> str:
    if arg == sys.executable:
      return "python3"
    for path, name in sorted(names.items(), key=lambda x: -len(x[0])):
      # The folder itself, or a file in it (the repository's: relative).
      arg = re.sub(re.escape(path) + r"(/|$)",
                   lambda m, name=name: "" if name == "." and m[1] else (
                       name + m[1]), arg)
    return arg

  return shlex.join(one(a) for a in cmd)


def run_logged(
  cmd: Sequence[str],
  *,
  log_path: pathlib.Path,
  timeout: float,
  env: dict[str, str] | None = None,
  cwd: pathlib.Path = REPO_ROOT,
  on_wait: Callable[[], None] | None = None,
  poll_s: float = 5.0,
) -> ProcResult:
  """Runs `cmd` with stdout and stderr into `log_path`, within `timeout`.

  The command runs in its own process group, so that at its deadline (or
  when this script is interrupted) its children (pytest-xdist workers)
  stop with it.

  Args:
    cmd: the command.
    log_path: the log file (overwritten); it starts with the command.
    timeout: seconds before the process group is stopped.
    env: the environment (default: this one).
    cwd: the working directory.
    on_wait: called every `poll_s` seconds while the command runs, and once
      more when an interrupt stopped it (to publish its progress); an
      exception in it is noted in the log.
    poll_s: see `on_wait`.

  Returns:
    The exit status (None if it could not be reaped), whether it timed out
    and how long it ran.
  """
  start = time.monotonic()
  deadline = start + max(timeout, 0.1)
  with open(log_path, "w") as log:
    log.write("$ " + shlex.join(cmd) + "\n")
    log.flush()
    group = (
      {"process_group": 0}
      if sys.version_info >= (3, 11)
      else {"preexec_fn": os.setpgrp}
    )
    proc = subprocess.Popen(
      list(cmd),
      stdout=log,
      stderr=subprocess.STDOUT,
      stdin=subprocess.DEVNULL,
      cwd=cwd,
      env=env,
      **group,
    )
    timed_out = False
    returncode, note = None, ""
    try:
      while True:
        left = deadline - time.monotonic()
        if left <= 0:
          timed_out = True
          note = f" (timed out after {timeout:.0f} s)"
          returncode = _stop(proc)
          break
        try:
          returncode = proc.wait(timeout=min(left, poll_s) if on_wait else left)
          break
        except subprocess.TimeoutExpired:
          pass
        _call(on_wait, log)
    except BaseException as e:  # Ctrl-C or SIGTERM: take the group down too.
      returncode = _stop(proc, INTERRUPTED_GRACE)
      note = f" (stopped: {type(e).__name__} {e})"
      # What the stopped command left is published before unwinding.
      _call(on_wait, log)
      raise
    finally:
      duration = time.monotonic() - start
      log.write(
        f"\n[gpu_check] exit status {returncode}{note}, {duration:.1f} s\n"
      )
  return ProcResult(
    returncode=returncode, timed_out=timed_out, duration_s=duration
  )


def _call(on_wait: Callable[[], None] | None, log) -> None:
  if on_wait is None:
    return
  try:
    on_wait()
  except Exception as e:  # Progress is a nicety; the run goes on.
    log.write(f"\n[gpu_check] progress: {type(e).__name__}: {e}\n")
    log.flush()


def child_env(*, scripts_on_path: bool = False, **extra: str) -> dict[str, str]:
  """This environment for a step's child: the repository root first on
  PYTHONPATH (nothing need be installed), and scripts/ after it for pytest
  (which loads `gpu.pytest_plugin` from there), unbuffered output, and
  `extra`."""
  env = dict(os.environ)
  path = env.get("PYTHONPATH")
  paths = [str(REPO_ROOT)] + ([str(SCRIPTS)] if scripts_on_path else [])
  env["PYTHONPATH"] = os.pathsep.join(paths + ([path] if path else []))
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
  text = [
    t
    for t in text[1:]  # text[0] is the command.
    if t.strip() and not t.startswith("[gpu_check]")
  ]
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


def write_atomic(path: pathlib.Path, data: str | bytes) -> None:
  """Writes `data` to `path` through a temporary file beside it, so that a
  reader (or a copy taken when this process is killed) sees the old file or
  the new one, never part of one."""
  tmp = path.with_name(f".{path.name}.tmp")
  try:
    if isinstance(data, str):
      tmp.write_text(data)
    else:
      tmp.write_bytes(data)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


# A file bigger than this goes into the bundle as its head and tail: the
# bundle must stay well under the 16 MiB a returned file may have.
BUNDLE_FILE_BYTES = 3 << 20


def write_bundle(folder: pathlib.Path, path: pathlib.Path) -> None:
  """Packs every file of `folder` into the gzipped tar `path` (atomically),
  under gpu_check/; a file over `BUNDLE_FILE_BYTES` is cut to its
  first third and last two thirds of that, with a note between."""
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
      try:
        data = file.read_bytes()
      except OSError:  # Removed meanwhile.
        continue
      if len(data) > BUNDLE_FILE_BYTES:
        head = BUNDLE_FILE_BYTES // 3
        note = (
          f"\n[gpu_check] {len(data) - BUNDLE_FILE_BYTES} bytes cut here\n"
        ).encode()
        data = data[:head] + note + data[-(BUNDLE_FILE_BYTES - head) :]
      info = tarfile.TarInfo(f"gpu_check/{file.relative_to(folder).as_posix()}")
      info.size = len(data)
      info.mtime = int(file.stat().st_mtime) if file.exists() else 0
      tar.addfile(info, io.BytesIO(data))
  write_atomic(path, buffer.getvalue())
