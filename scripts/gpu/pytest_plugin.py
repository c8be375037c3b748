"""The pytest plugin of gpu_check's test runs (`-p gpu.pytest_plugin`).

It changes nothing unless loaded, and then, from environment variables:

* Order (PALLAS_FA_TEST_FIRST, default "mosaic_gpu,triton"): the tests
  whose id names the first of these run first, then the second, then the
  rest, so that a run stopped at its budget has answered for them.
* Hypothesis: the "gpu_check" profile, with no shrinking (a failing
  property test would otherwise recompile kernels for every smaller example
  until its timeout) and no deadline.
* Order by earlier windows (PALLAS_FA_TEST_ORDER=FILE, JSON {"first":
  [ids], "last": [[ids], ...]}): the tests of "first" (those that failed
  in the last window) run before every other; those of each group of
  "last" (the tests an earlier window finished, the stalest window's
  group first) after every test in no group and after the groups before
  it (a test in several groups goes with the last of them), so that a run
  stopped at its budget answers for the unknown ones first.
* Selection (PALLAS_FA_TEST_ONLY=FILE): only the tests whose id contains
  one of FILE's lines run (a rerun of what failed); ids that match nothing
  are printed, not fatal. PALLAS_FA_TEST_DROP=REGEX: the tests whose id
  it finds are left out (deselected).
* Results (PALLAS_FA_TEST_RESULTS=FILE): one JSON line per finished test,
  written as it finishes, so that a run killed before pytest writes its
  junit XML still tells what passed and failed; and one ("outcome":
  "started") as each test starts, so that a run stopped in a test tells
  which (pytest's own summary of a run stopped in its only selected test
  counts nothing but the deselected ones).
* Each worker's stderr (PALLAS_FA_TEST_STDERR_DIR=DIR): a pytest-xdist
  worker writes its file descriptor 2 (Python's tracebacks, faulthandler's
  dumps, pytest-timeout's stacks, XLA's and CUDA's messages) to
  DIR/stderr_<worker>.log, and a test whose worker died is reported with
  that file's last lines: what killed it (a timeout, a fatal signal, an
  allocation failure, a CHECK) is then in the results.
* A CUDA error that leaves the process's context unusable (an illegal
  address, a launch failure) ends that pytest-xdist worker after its test,
  so that xdist starts a fresh one rather than every later test of the
  worker failing the same way.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import sys

import pytest

# CUDA reports these once and then fails every later call in the process.
STICKY_CUDA_ERROR = re.compile(
  r"CUDA_ERROR_(ILLEGAL_ADDRESS|LAUNCH_FAILED|MISALIGNED_ADDRESS|"
  r"ILLEGAL_INSTRUCTION|HARDWARE_STACK_ERROR|ASSERT)|"
  r"illegal memory access|unspecified launch failure|misaligned address"
)
# The exit status of a worker ended for a sticky error (any non-zero one
# makes xdist replace the worker).
STICKY_EXIT_STATUS = 70
# The lines of a dead worker's stderr that its crash report keeps.
STDERR_TAIL_LINES = 12


def _stderr_path(directory: str, worker: str) -> str:
  return os.path.join(directory, f"stderr_{worker}.log")


def _redirect_stderr(directory: str, worker: str) -> None:
  """Sends this process's file descriptor 2 (C and Python alike) to its
  own file, and faulthandler's dumps with it."""
  os.makedirs(directory, exist_ok=True)
  log = open(_stderr_path(directory, worker), "a", buffering=1)
  sys.stderr.flush()
  os.dup2(log.fileno(), 2)
  # A fatal signal's stacks go to the file too (the file object must stay
  # open for the process's life: it is kept by faulthandler).
  faulthandler.enable(file=log, all_threads=True)


def stderr_tail(directory: str | None, worker: str | None) -> str:
  """The last lines of a worker's stderr file, on one line ("" if none)."""
  if not directory or not worker:
    return ""
  try:
    with open(_stderr_path(directory, worker), errors="replace") as f:
      lines = [line.rstrip() for line in f if line.strip()]
  except OSError:
    return ""
  return " | ".join(lines[-STDERR_TAIL_LINES:])[-2000:]


def _message(report: pytest.TestReport) -> str:
  """The one line that says why a test failed or was skipped."""
  longrepr = report.longrepr
  if longrepr is None:
    return ""
  if isinstance(longrepr, tuple):  # A skip: (path, line, reason).
    return str(longrepr[-1])
  crash = getattr(longrepr, "reprcrash", None)
  if crash is not None and getattr(crash, "message", None):
    return crash.message.strip().splitlines()[0][:500]
  lines = str(longrepr).strip().splitlines()
  return lines[-1][:500] if lines else ""


def outcome(report: pytest.TestReport) -> str | None:
  """A test's outcome from one of its reports: "passed", "failed",
  "skipped", "error" (setup or teardown failed) or "crashed" (its process
  died); None for a report that decides nothing."""
  if report.when == "call":
    return report.outcome
  if report.when == "???":  # xdist's report of a worker that died.
    return "crashed"
  if report.failed:
    return "error"
  if report.skipped and report.when == "setup":
    return "skipped"
  return None


class GpuCheckPlugin:
  """The plugin's hooks, with their state (see the module docstring)."""

  def __init__(self, config: pytest.Config):
    self.is_worker = hasattr(config, "workerinput")
    # Under xdist only the workers collect: the first says what it found.
    self.reports_collection = (
      not self.is_worker or config.workerinput.get("workerid") == "gw0"
    )
    self.first = [
      name.strip()
      for name in os.environ.get(
        "PALLAS_FA_TEST_FIRST", "mosaic_gpu,triton"
      ).split(",")
      if name.strip()
    ]
    self.only = None
    only_path = os.environ.get("PALLAS_FA_TEST_ONLY")
    if only_path:
      with open(only_path) as f:
        self.only = [
          line.strip()
          for line in f
          if line.strip() and not line.startswith("#")
        ]
    self.drop = os.environ.get("PALLAS_FA_TEST_DROP") or None
    # Test id -> its tier: 0 first, 1 (by default) none, 2 + i the i-th
    # group of "last".
    self.tiers: dict[str, int] = {}
    order_path = os.environ.get("PALLAS_FA_TEST_ORDER")
    if order_path and os.path.exists(order_path):
      with open(order_path) as f:
        order = json.load(f)
      for i, group in enumerate(order.get("last") or ()):
        self.tiers.update(dict.fromkeys(group, 2 + i))
      self.tiers.update(dict.fromkeys(order.get("first") or (), 0))
    self.stderr_dir = os.environ.get("PALLAS_FA_TEST_STDERR_DIR") or None
    if self.stderr_dir and self.is_worker:
      _redirect_stderr(self.stderr_dir, config.workerinput["workerid"])
    results = os.environ.get("PALLAS_FA_TEST_RESULTS")
    # Only the controller (or a run without xdist) writes the results: it
    # sees every worker's reports, and its own reports of crashed workers.
    self.results = (
      open(results, "a", buffering=1)
      if results and not self.is_worker
      else None
    )
    self.sticky_error = None

  def _rank(self, item: pytest.Item) -> tuple[int, int]:
    rank = next((i for i, name in enumerate(self.first)
                 if name in item.nodeid), len(self.first))
    return self.tiers.get(item.nodeid, 1), rank

  @pytest.hookimpl(trylast=True)
  def pytest_collection_modifyitems(
    self, config: pytest.Config, items: list[pytest.Item]
  ) -> None:
    if self.only is not None:
      keep = [i for i in items if any(p in i.nodeid for p in self.only)]
      unmatched = [
        p for p in self.only if not any(p in i.nodeid for i in items)
      ]
      if unmatched and self.reports_collection:
        print(
          f"gpu_check: {len(unmatched)} --only pattern(s) match no "
          f"test: {unmatched[:5]}",
          file=sys.stderr,
        )
      config.hook.pytest_deselected(items=[i for i in items if i not in keep])
      items[:] = keep
    if self.drop is not None:
      dropped = [i for i in items if re.search(self.drop, i.nodeid)]
      if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i not in dropped]
    # A stable sort: within a rank the collection order stays.
    items.sort(key=self._rank)

  def _write(self, record: dict) -> None:
    self.results.write(json.dumps(record) + "\n")

  def pytest_runtest_logstart(self, nodeid: str, location) -> None:
    del location  # Unused.
    # Under pytest-xdist the controller hears of each test a worker starts.
    if self.results is not None:
      self._write({"test": nodeid, "outcome": "started"})

  def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
    result = outcome(report)
    if (
      self.is_worker
      and report.failed
      and (STICKY_CUDA_ERROR.search(str(report.longrepr)))
    ):
      self.sticky_error = _message(report)
    if self.results is None or result is None:
      return
    node = getattr(report, "node", None)
    worker = getattr(getattr(node, "gateway", None), "id", None)
    message = "" if result == "passed" else _message(report)
    if result == "crashed":
      tail = stderr_tail(self.stderr_dir, worker)
      if tail:
        message = f"{message}; its stderr ended: {tail}"
    self._write(
      {
        "test": report.nodeid,
        "outcome": result,
        "when": report.when,
        "duration_s": round(report.duration or 0.0, 2),
        "message": message,
        "worker": worker,
      }
    )

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(self, item: pytest.Item):
    yield
    if self.sticky_error is not None:
      # The reports of this test have gone to the controller (xdist writes
      # them to its pipe as they are made); it reports the worker's exit as
      # a crash of this same test, and starts a fresh worker.
      print(
        f"gpu_check: ending this worker after {item.nodeid}: the CUDA "
        f"context is unusable ({self.sticky_error})",
        file=sys.stderr,
        flush=True,
      )
      os._exit(STICKY_EXIT_STATUS)

  def pytest_unconfigure(self) -> None:
    if self.results is not None:
      self.results.close()


def pytest_configure(config: pytest.Config) -> None:
  config.pluginmanager.register(GpuCheckPlugin(config), "gpu_check_plugin")
  try:
    import hypothesis
  except ImportError:
    return
  phases = hypothesis.Phase
  hypothesis.settings.register_profile(
    "gpu_check",
    deadline=None,
    print_blob=True,
    phases=(phases.explicit, phases.reuse, phases.generate),
  )
  hypothesis.settings.load_profile("gpu_check")
