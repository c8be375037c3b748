"""Where a benchmark process's time goes: a timestamp per phase.

A GPU window is a few minutes, and a benchmark process stopped at its share
keeps only the cells it finished. Compiling a cell takes seconds, so the
rest of a process's time (its start and the device's initialisation, the
inputs, the reference, the probes, warm-up and timing) decides how many
cells fit; the JSON records each phase's start (seconds since the process
started, so the first one shows what starting cost) and duration.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any
from typing import Iterator

_IMPORTED = time.time()


def process_start() -> float:
  """When this process started (seconds since the epoch): from /proc on
  Linux (so the interpreter's start and the imports count), else when this
  module was imported."""
  try:
    with open("/proc/self/stat") as f:
      # Field 22, starttime in clock ticks after boot; the command name
      # (field 2, in parentheses) may hold spaces.
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    age = uptime - ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return _IMPORTED
  return time.time() - age if 0 <= age < 86400 else _IMPORTED


class Timeline:
  """The phases of one process, in the order they ended.

  Each entry is {"phase", "start_s" (since the process started), "s"} and
  any labels given (the shape, the candidate).
  """

  def __init__(self, start: float | None = None):
    self.start = process_start() if start is None else start
    self.phases: list[dict[str, Any]] = []

  def now_s(self) -> float:
    """Seconds since the process started."""
    return time.time() - self.start

  def add(self, phase: str, start_s: float, seconds: float,
          **labels: Any) -> None:
    """Records a phase that started at `start_s` and took `seconds`."""
    self.phases.append({"phase": phase, "start_s": round(start_s, 3),
                        "s": round(seconds, 3), **labels})

  @contextlib.contextmanager
  def phase(self, phase: str, **labels: Any) -> Iterator[None]:
    """Records the phase that the `with` block runs (also when it raises)."""
    start = self.now_s()
    try:
      yield
    finally:
      self.add(phase, start, self.now_s() - start, **labels)

  def record(self, **meta: Any) -> dict[str, Any]:
    """This process's entry of a report's "timelines"."""
    return {**meta, "started_utc": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.start)),
            "phases": list(self.phases)}


def totals(phases: list[dict[str, Any]]) -> dict[str, float]:
  """Seconds per phase name, in the order each first appears."""
  out: dict[str, float] = {}
  for p in phases:
    out[p["phase"]] = round(out.get(p["phase"], 0.0) + p["s"], 2)
  return out
