r"""One-command GPU triage: device, compile report, compiled tests, benchmarks.

Meant for the first session on a GPU machine (H100/H200), where device time
is scarce: one call records everything needed to triage the GPU backends, and
no failing, hanging or slow step stops the ones after it. Every step runs as a
subprocess with its own timeout (its whole process group is stopped on
timeout), writes its log into the output folder, and is recorded in
`summary.json`, which is rewritten after every step so that a run killed from
outside still leaves what it had. The steps:

  env      device, driver and versions (python, jax, jaxlib, CUDA plugin,
           nvidia-smi, jax.devices(), git commit) -> env.json
  compile  scripts/compile_check.py --target=local --quick (the whole matrix
           with --compile-full) -> compile_check.json/.log
  tests    the conformance suite compiled for xla, chunked, triton and
           mosaic_gpu, plus tests/test_triton.py and tests/test_mosaic_gpu.py,
           with a per-test timeout -> pytest.xml, pytest.log
  bench    scripts/benchmark.py, one T (4096) per head dim in {64, 128, 256},
           bf16, fwd and fwd+bwd, causal and not, mosaic_gpu and triton
           against the cudnn and xla peers -> bench_h<H>.json/.log

A whole-run budget (`--budget`, default 570 s: one command on a lent machine
may run 10 minutes) caps every step's timeout at the time left. The package
need not be installed: the repository root is put on PYTHONPATH.

Commands (from the repository root):

  # On the GPU machine, everything into gpu_check_out/ (exit 1 if a step
  # failed; the printed summary says which and why). --workers=4 runs the
  # tests in 4 pytest-xdist processes (compiling is CPU-bound), where a hung
  # kernel costs one test rather than the rest of the run:
  python scripts/gpu_check.py --out=gpu_check_out --workers=4

  # Only the tests, with a longer budget for them, into the same folder
  # (summary.json keeps the other steps' earlier records):
  python scripts/gpu_check.py --out=gpu_check_out --steps=tests \
      --step-timeout=tests=540 --workers=4

  # CI / CPU smoke test of the same steps on tiny inputs (under a minute):
  # interpreted Triton on a few conformance cases, a CPU benchmark cell, and
  # a two-case deviceless compile only where a CUDA plugin is installed.
  python scripts/gpu_check.py --dry-run --out=/tmp/gpu_check_dry
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any
from typing import Sequence
from xml.etree import ElementTree

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPILE_CHECK = REPO_ROOT / "scripts" / "compile_check.py"
BENCHMARK = REPO_ROOT / "scripts" / "benchmark.py"
STEPS = ("env", "compile", "tests", "bench")
CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
BENCH_HEAD_DIMS = (64, 128, 256)

# Seconds per step: (GPU run, --dry-run). The whole run is further capped by
# --budget, so a step gets min(its timeout, the time left).
STEP_TIMEOUTS = {
    "env": (60, 60),
    "compile": (150, 60),
    "tests": (240, 90),
    "bench": (240, 60),
}
DEFAULT_BUDGET = (570, 110)
DEFAULT_TEST_TIMEOUT = (90, 60)
# A stopped step gets SIGINT (pytest then still writes its junit XML), then
# SIGTERM, then SIGKILL, each after this many seconds.
STOP_GRACE = (10, 3, 3)
MIN_STEP_S = 5

# The dry run's tests: a handful of interpreted Triton conformance checks
# that take about a second each on a CPU.
DRY_RUN_TESTS_K = (
    "(test_float32 and (B2T64S64N2K2H32 or B1T1S37N2K1H16 or B2T9S1N2K2H8 "
    "or B1T40S40N8K1H64)) or test_fully_masked_rows "
    "or test_unbatched_and_residual "
    "or (test_low_precision and B2T64S64N2K2H32 and bfloat16)")


# ---------------------------------------------------------------------------
# Running one subprocess.


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


def _child_env(**extra: str) -> dict[str, str]:
  env = dict(os.environ)
  path = env.get("PYTHONPATH")
  env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
  env["PYTHONUNBUFFERED"] = "1"
  env.update(extra)
  return env


def _tail(path: pathlib.Path, lines: int = 3) -> str:
  try:
    text = path.read_text(errors="replace").strip().splitlines()
  except OSError:
    return ""
  text = [t for t in text[1:]  # text[0] is the command.
          if t.strip() and not t.startswith("[gpu_check]")]
  return " | ".join(t.strip() for t in text[-lines:])[:500]


def _has_module(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):  # A parent package is missing.
    return False


def cuda_plugin() -> str | None:
  """The importable jax CUDA plugin module, or None."""
  for name in CUDA_PLUGINS:
    if _has_module(name):
      return name
  return None


# ---------------------------------------------------------------------------
# Step 1: the environment (runs in a child: `--collect-env=PATH`).


def _command_output(cmd: Sequence[str], timeout: float = 30) -> str | None:
  if shutil.which(cmd[0]) is None:
    return None
  try:
    proc = subprocess.run(list(cmd), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)
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
      "cuda_plugin_module": cuda_plugin(),
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


def _collect_env_main(path: str, dry_run: bool) -> int:
  info = collect_env(dry_run)
  with open(path, "w") as f:
    json.dump(info, f, indent=1, default=str)
    f.write("\n")
  print(json.dumps({k: info.get(k) for k in (
      "jax_version", "jaxlib_version", "default_backend", "devices",
      "cuda_plugin_module", "problems")}, indent=1, default=str))
  return 1 if info["problems"] else 0


def _env_brief(info: dict[str, Any]) -> str:
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


# ---------------------------------------------------------------------------
# Result parsing.


# pytest-timeout's failure: "Timeout (>90.0s) from pytest-timeout." (2.x) or
# "Timeout >90s" (1.x).
_TIMEOUT_MESSAGE = re.compile(r"Timeout \(?>")


def parse_junit(xml_text: str, max_listed: int = 20) -> dict[str, Any]:
  """Counts the outcomes in a pytest junit XML report.

  Args:
    xml_text: the report.
    max_listed: how many failed/errored tests to name.

  Returns:
    {"tests", "passed", "failed", "errors", "skipped", "timeouts",
    "crashed", "interrupted", "time_s", "problems": [{"test", "outcome",
    "message"}]}. A timeout (pytest-timeout) or a crashed xdist worker is
    also counted as failed or errors; "interrupted" counts the nameless
    record pytest writes for a test stopped by SIGINT (not in "tests").
  """
  root = ElementTree.fromstring(xml_text)
  counts = dict(tests=0, passed=0, failed=0, errors=0, skipped=0,
                timeouts=0, crashed=0, interrupted=0)
  problems = []
  time_s = 0.0
  suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
  for suite in suites:
    time_s += float(suite.get("time") or 0.0)
  for case in root.iter("testcase"):
    if case.get("name") is None:
      # The test that was running when pytest was interrupted (SIGINT).
      counts["interrupted"] += 1
      continue
    counts["tests"] += 1
    failure, error = case.find("failure"), case.find("error")
    bad = failure if failure is not None else error
    if bad is None:
      counts["skipped" if case.find("skipped") is not None else "passed"] += 1
      continue
    counts["failed" if failure is not None else "errors"] += 1
    message = (bad.get("message") or "") + "\n" + (bad.text or "")
    if _TIMEOUT_MESSAGE.search(message):
      counts["timeouts"] += 1
    if "crashed while running" in message:
      counts["crashed"] += 1
    if len(problems) < max_listed:
      name = case.get("name", "?")
      classname = case.get("classname", "")
      first = next((line.strip() for line in message.splitlines()
                    if line.strip()), "")
      problems.append({
          "test": f"{classname}::{name}" if classname else name,
          "outcome": "failed" if failure is not None else "error",
          "message": first[:300]})
  return {**counts, "time_s": round(time_s, 1), "problems": problems}


def summarise_compile(report: Any) -> dict[str, Any]:
  """The key numbers of a scripts/compile_check.py JSON report.

  The report is {"versions", "argv", "results": [one record per case:
  {"backend", "head_dim", "dtype", "variant", "target", "error",
  "kernels": [{"kernel", "problems": [...], "registers",
  "spill_stores", "spill_loads", "smem_bytes", ...}], ...}]}. Problems are
  counted as compile_check counts them: a case that failed to compile, plus
  each kernel row with a problem.

  Args:
    report: the parsed JSON.

  Returns:
    {"cases", "kernels", "problems", "spilling_kernels", "failed": [up to
    10 short descriptions]}; empty if the report has no "results" list.
  """
  results = report.get("results") if isinstance(report, dict) else None
  if not isinstance(results, list):
    return {}
  kernels = problems = spilling = 0
  failed = []
  for case in results:
    if not isinstance(case, dict):
      continue
    label = " ".join(str(case[k]) for k in (
        "target", "backend", "head_dim", "dtype", "variant") if k in case)
    if case.get("error"):
      problems += 1
      failed.append(f"{label}: {str(case['error']).splitlines()[0][:200]}"
                    if str(case["error"]).strip() else f"{label}: error")
    for row in case.get("kernels") or ():
      kernels += 1
      if row.get("spill_stores") or row.get("spill_loads"):
        spilling += 1
      if row.get("problems"):
        problems += 1
        failed.append(f"{label} {row.get('kernel', '?')}: "
                      f"{', '.join(map(str, row['problems']))}")
  return {"cases": len(results), "kernels": kernels, "problems": problems,
          "spilling_kernels": spilling, "failed": failed[:10]}


def summarise_bench(report: dict[str, Any]) -> dict[str, Any]:
  """The per-cell numbers of one scripts/benchmark.py JSON report.

  Args:
    report: the parsed JSON ({"meta", "matmul", "results"}).

  Returns:
    {"platform", "device_kind", "unit", "matmul_flops_per_s", "counts":
    {status: n}, "cells": [{impl, mode, causal, head_dim, seq_len, status,
    reason, ms, flops_per_s}]}.
  """
  meta = report.get("meta") or {}
  cells, counts = [], {}
  for r in report.get("results") or []:
    status = r.get("status", "?")
    counts[status] = counts.get(status, 0) + 1
    cells.append({k: r.get(k) for k in (
        "impl", "kind", "mode", "causal", "head_dim", "seq_len", "batch",
        "heads", "dtype", "status", "reason", "ms", "flops_per_s")})
  platform_name = meta.get("platform")
  matmul = report.get("matmul") or {}
  return {
      "platform": platform_name,
      "device_kind": meta.get("device_kind"),
      "unit": "GFLOP/s" if platform_name == "cpu" else "TFLOP/s",
      "matmul_flops_per_s": matmul.get("flops_per_s"),
      "counts": counts,
      "cells": cells,
  }


# ---------------------------------------------------------------------------
# The steps. Each returns its record: status "ok" | "failed" | "skipped",
# reason, and its own numbers; the caller adds the duration.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Context:
  """What every step needs."""

  out: pathlib.Path
  dry_run: bool
  test_timeout: float
  workers: int
  compile_full: bool = False


def _proc_fields(proc: ProcResult) -> dict[str, Any]:
  return {"returncode": proc.returncode, "timed_out": proc.timed_out}


def step_env(ctx: Context, timeout: float) -> dict[str, Any]:
  path = ctx.out / "env.json"
  log = ctx.out / "env.log"
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()),
         f"--collect-env={path}"] + (["--dry-run"] if ctx.dry_run else [])
  proc = run_logged(cmd, log_path=log, timeout=timeout, env=_child_env())
  record = {"command": shlex.join(cmd), "log": log.name,
            **_proc_fields(proc)}
  try:
    info = json.loads(path.read_text())
  except (OSError, ValueError):
    info = {"problems": [f"env collection wrote no env.json: {_tail(log)}"]}
    path.write_text(json.dumps(info, indent=1) + "\n")
  record["json"] = path.name
  record["brief"] = _env_brief(info)
  record["jax_version"] = info.get("jax_version")
  if proc.timed_out:
    return {**record, "status": "failed",
            "reason": f"timed out after {timeout:.0f} s"}
  if info.get("problems") or proc.returncode != 0:
    reason = "; ".join(info.get("problems") or []) or (
        f"exit status {proc.returncode}: {_tail(log)}")
    return {**record, "status": "failed", "reason": reason}
  return {**record, "status": "ok", "reason": ""}


# argparse's exit status is 2 as well: a usage error is a failure.
_USAGE_ERROR = re.compile(r"^usage: |: error: ", re.MULTILINE)


def step_compile(ctx: Context, timeout: float) -> dict[str, Any]:
  script = COMPILE_CHECK
  if not script.exists():
    return {"status": "skipped",
            "reason": "scripts/compile_check.py not found"}
  plugin = cuda_plugin()
  if ctx.dry_run and plugin is None:
    return {"status": "skipped",
            "reason": f"no CUDA plugin (none of {', '.join(CUDA_PLUGINS)} "
                      "importable)"}
  path = ctx.out / "compile_check.json"
  log = ctx.out / "compile_check.log"
  if ctx.dry_run:
    # Deviceless, as compile_check.py documents: no CUDA backend is started.
    # One case per backend (--quick's 12 take over a minute on 2 cores).
    args = ["--target=h100", "--backends=triton,mosaic_gpu",
            "--head-dims=64", "--variants=plain", "--dtypes=bfloat16"]
    env = _child_env(JAX_PLATFORMS="cpu")
  else:
    # --quick (H 64/128/256, plain and causal, bf16; under a minute) unless
    # --compile-full asks for the whole matrix (~60 cases, minutes).
    args = ["--target=local"] + ([] if ctx.compile_full else ["--quick"])
    env = _child_env()
  cmd = [sys.executable, str(script), *args, f"--json={path}"]
  proc = run_logged(cmd, log_path=log, timeout=timeout, env=env)
  record = {"command": shlex.join(cmd), "log": log.name,
            **_proc_fields(proc)}
  if path.exists():
    record["json"] = path.name
    try:
      record.update(summarise_compile(json.loads(path.read_text())))
    except ValueError as e:
      record["json_error"] = str(e)
  if proc.timed_out:
    return {**record, "status": "failed",
            "reason": f"timed out after {timeout:.0f} s"}
  if proc.returncode == 0:
    return {**record, "status": "ok", "reason": ""}
  if proc.returncode == 2 and not _USAGE_ERROR.search(
      log.read_text(errors="replace")):
    return {**record, "status": "skipped",
            "reason": f"cannot run here (exit 2): {_tail(log, 1)}"}
  what = ("compile problems" if proc.returncode == 1
          else f"exit status {proc.returncode}")
  return {**record, "status": "failed", "reason": f"{what}: {_tail(log, 2)}"}


def step_tests(ctx: Context, timeout: float) -> dict[str, Any]:
  xml = ctx.out / "pytest.xml"
  log = ctx.out / "pytest.log"
  xml.unlink(missing_ok=True)
  if ctx.dry_run:
    impls = "triton"
    files = ["tests/test_conformance.py"]
    select = ["-k", DRY_RUN_TESTS_K]
  else:
    impls = "xla,chunked,triton,mosaic_gpu"
    files = ["tests/test_conformance.py", "tests/test_triton.py",
             "tests/test_mosaic_gpu.py"]
    select = []
  cmd = [sys.executable, "-m", "pytest", *files, *select, "-q", "-rfE",
         "-p", "no:cacheprovider", f"--junitxml={xml}",
         # pytest's own watchdog: dumps every thread's stack when a test runs
         # this long, even while it is blocked in C (a hung kernel).
         "-o", f"faulthandler_timeout={ctx.test_timeout:.0f}"]
  warnings = []
  if _has_module("pytest_timeout"):
    cmd.append(f"--timeout={ctx.test_timeout:.0f}")
  else:
    warnings.append("pytest-timeout is not installed: no per-test timeout "
                    "(a hanging test ends the step at its timeout)")
  extra_env = {"PALLAS_FA_TEST_IMPLEMENTATIONS": impls}
  if ctx.workers > 0:
    if _has_module("xdist"):
      cmd += ["-n", str(ctx.workers)]
      if _has_module("pytest_timeout"):
        # A timed-out test kills its worker, which xdist replaces: a hung
        # kernel costs one test, not the run. (The ini name works in every
        # pytest-timeout version; the flag's spelling changed in 2.2.)
        cmd += ["-o", "timeout_method=thread"]
      # Several processes share the GPU.
      extra_env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:
      warnings.append("pytest-xdist is not installed: --workers ignored")
  proc = run_logged(cmd, log_path=log, timeout=timeout,
                    env=_child_env(**extra_env))
  record = {"command": shlex.join(cmd),
            "implementations": impls, "log": log.name,
            "warnings": warnings, **_proc_fields(proc)}
  counts = None
  if xml.exists():
    record["junit"] = xml.name
    try:
      counts = parse_junit(xml.read_text())
    except ElementTree.ParseError as e:
      record["junit_error"] = str(e)
  if counts is not None:
    record.update(counts)
  if proc.timed_out:
    reason = f"timed out after {timeout:.0f} s"
    if counts is not None:
      reason += " (the counts are of the tests that finished)"
    else:
      reason += f" (no junit XML; log ends: {_tail(log, 2)})"
    return {**record, "status": "failed", "reason": reason}
  if counts is None:
    return {**record, "status": "failed",
            "reason": f"no junit XML (exit status {proc.returncode}): "
                      f"{_tail(log, 2)}"}
  if proc.returncode != 0 or counts["failed"] or counts["errors"]:
    return {**record, "status": "failed",
            "reason": f"pytest exit status {proc.returncode}"}
  if not counts["passed"]:
    return {**record, "status": "failed", "reason": "no test passed"}
  return {**record, "status": "ok", "reason": ""}


def _bench_args(ctx: Context, head_dim: int, seq_len: int,
                causal: str) -> list[str]:
  if ctx.dry_run:
    return ["--grid=cpu", "--impls=chunked,xla", "--peers=xla",
            f"--seq_lens={seq_len}", f"--head_dim={head_dim}", "--heads=2",
            "--batch=1", "--causal=false", "--modes=fwd,fwd_bwd",
            "--dtype=float32", "--repeats=2", "--warmup=1", "--noisolate",
            "--matmul_size=0"]
  # The FlashAttention protocol (B*T = 16k tokens, N*H = 2048) at one T.
  return ["--grid=fa", "--impls=mosaic_gpu,triton", "--peers=cudnn,xla",
          f"--seq_lens={seq_len}", f"--head_dim={head_dim}",
          f"--causal={causal}", "--modes=fwd,fwd_bwd", "--dtype=bfloat16",
          "--repeats=5", "--warmup=1", "--noisolate"]


def step_bench(ctx: Context, timeout: float, *, head_dims: Sequence[int],
               seq_len: int, causal: str) -> dict[str, Any]:
  deadline = time.monotonic() + timeout
  runs, failures = [], []
  for i, head_dim in enumerate(head_dims):
    left = deadline - time.monotonic()
    # An equal share of what is left (less the grace a stopped run may take
    # past its timeout), so one slow head dim cannot starve the others.
    runs_left = len(head_dims) - i
    share = (left - sum(STOP_GRACE) * (runs_left - 1)) / runs_left
    name = f"bench_h{head_dim}"
    path, log = ctx.out / f"{name}.json", ctx.out / f"{name}.log"
    path.unlink(missing_ok=True)
    if share < MIN_STEP_S:
      runs.append({"head_dim": head_dim, "status": "skipped",
                   "reason": "out of time"})
      failures.append(f"H={head_dim}: out of time")
      continue
    cmd = [sys.executable, str(BENCHMARK),
           *_bench_args(ctx, head_dim, seq_len, causal), f"--json={path}"]
    proc = run_logged(cmd, log_path=log, timeout=share, env=_child_env())
    run = {"head_dim": head_dim, "command": shlex.join(cmd),
           "log": log.name, "duration_s": round(proc.duration_s, 1),
           **_proc_fields(proc)}
    if path.exists():
      run["json"] = path.name
      run.update(summarise_bench(json.loads(path.read_text())))
    # Only our implementations' cells decide; a peer's failure is shown.
    bad = {}
    for c in run.get("cells") or ():
      if c["kind"] == "impl" and c["status"] in ("wrong", "failed"):
        bad[c["status"]] = bad.get(c["status"], 0) + 1
    if proc.timed_out:
      problem = f"timed out after {share:.0f} s"
    elif proc.returncode != 0:
      problem = f"exit status {proc.returncode}: {_tail(log, 1)}"
    elif "json" not in run:
      problem = "wrote no JSON"
    elif bad:
      problem = ", ".join(f"{v} cell(s) {k}" for k, v in bad.items())
    else:
      problem = ""
    run["status"] = "failed" if problem else "ok"
    run["reason"] = problem
    if problem:
      failures.append(f"H={head_dim}: {problem}")
    runs.append(run)
  measured = sum(1 for r in runs for c in r.get("cells") or ()
                 if c.get("ms"))
  record = {"runs": runs, "measured_cells": measured}
  if failures:
    return {**record, "status": "failed", "reason": "; ".join(failures)}
  if not measured:
    return {**record, "status": "failed", "reason": "no cell was measured"}
  return {**record, "status": "ok", "reason": ""}


# ---------------------------------------------------------------------------
# The summary.


def _rate(flops_per_s: float | None, unit: str) -> str:
  if not flops_per_s:
    return "-"
  return f"{flops_per_s / (1e9 if unit == 'GFLOP/s' else 1e12):.1f}"


def format_summary(summary: dict[str, Any]) -> str:
  """A short human summary of summary.json's content.

  Args:
    summary: the summary record (see `main`).

  Returns:
    A few lines: one per step, with its key numbers.
  """
  lines = [f"gpu_check{' --dry-run' if summary['dry_run'] else ''}: "
           f"{summary['out']} ({summary.get('total_s', 0):.0f} s)"]
  for name, s in summary["steps"].items():
    duration = s.get("duration_s")
    duration = f"{duration:6.1f}s" if duration is not None else "      -"
    head = f"  {name:8s} {s['status']:8s} {duration}"
    detail = s.get("reason") or ""
    if name == "env" and s.get("brief"):
      detail = s["brief"] + (f" [{detail}]" if detail else "")
    elif name == "compile" and s.get("problems") is not None:
      detail = (f"{s['problems']} problem(s), {s['spilling_kernels']} "
                f"spilling, in {s['kernels']} kernel(s) of {s['cases']} "
                "case(s)" + (f" [{detail}]" if detail else ""))
    elif name == "tests" and "tests" in s:
      crashed = f", {s['crashed']} crashed" if s.get("crashed") else ""
      detail = (f"{s['passed']} passed, {s['failed']} failed, "
                f"{s['errors']} errors, {s['timeouts']} timeouts{crashed}, "
                f"{s['skipped']} skipped" + (f" [{detail}]" if detail else ""))
    lines.append(f"{head}  {detail}".rstrip())
    for w in s.get("warnings") or ():
      lines.append(f"      warning: {w}")
    if name == "tests" and isinstance(s.get("problems"), list):
      for p in s["problems"][:10]:
        lines.append(f"      {p['outcome']}: {p['test']}: {p['message']}")
    if name == "compile":
      for line in s.get("failed") or ():
        lines.append(f"      {line}")
    if name == "bench":
      for run in s.get("runs") or ():
        lines.extend(_bench_lines(run))
  return "\n".join(lines)


def _bench_lines(run: dict[str, Any]) -> list[str]:
  if not run.get("cells"):
    return [f"      H={run['head_dim']}: {run['status']} {run['reason']}"]
  unit = run.get("unit", "TFLOP/s")
  groups: dict[tuple, list[str]] = {}
  for c in run["cells"]:
    key = (c["seq_len"], c["mode"], c["causal"])
    value = _rate(c.get("flops_per_s"), unit) if c.get("ms") else c["status"]
    groups.setdefault(key, []).append(f"{c['impl']} {value}")
  lines = []
  for (t, mode, causal), items in groups.items():
    lines.append(f"      H={run['head_dim']} T={t} {mode:7s} "
                 f"{'causal' if causal else 'full':6s} {unit}: "
                 + ", ".join(items))
  if run.get("reason"):
    lines.append(f"      H={run['head_dim']}: {run['reason']}")
  return lines


def _write_json(path: pathlib.Path, value: Any) -> None:
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(value, indent=1, default=str) + "\n")
  os.replace(tmp, path)


def _parse_step_timeouts(text: str | None, dry_run: bool) -> dict[str, float]:
  timeouts = {k: float(v[1 if dry_run else 0])
              for k, v in STEP_TIMEOUTS.items()}
  for entry in (text or "").split(","):
    entry = entry.strip()
    if not entry:
      continue
    name, sep, value = entry.rpartition("=")
    if sep and name not in STEPS:
      raise ValueError(f"--step-timeout: unknown step {name!r} in {entry!r}; "
                       f"expected one of {STEPS}.")
    try:
      seconds = float(value)
    except ValueError:
      raise ValueError(f"--step-timeout entries are SECONDS or STEP=SECONDS, "
                       f"got {entry!r}.") from None
    for step in ((name,) if sep else STEPS):
      timeouts[step] = seconds
  return timeouts


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """Parses the command line (see the module docstring)."""
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="gpu_check_out",
                      help="Output folder (created). Default: %(default)s.")
  parser.add_argument("--steps", default=",".join(STEPS),
                      help="Comma list of steps among "
                           f"{','.join(STEPS)}. Default: all.")
  parser.add_argument("--dry-run", action="store_true",
                      help="The same steps, tiny and fast, on a CPU (CI).")
  parser.add_argument("--test-timeout", type=float, default=None,
                      help="Seconds per test (pytest-timeout). Default: "
                           f"{DEFAULT_TEST_TIMEOUT[0]} "
                           f"({DEFAULT_TEST_TIMEOUT[1]} with --dry-run).")
  parser.add_argument("--step-timeout", default=None,
                      help="SECONDS for every step, or STEP=SECONDS,... "
                           "Defaults: " + ", ".join(
                               f"{k}={v[0]}" for k, v in
                               STEP_TIMEOUTS.items()) + ".")
  parser.add_argument("--budget", type=float, default=None,
                      help="Seconds for the whole run; each step's timeout "
                           "is capped at what is left. Default: "
                           f"{DEFAULT_BUDGET[0]} ({DEFAULT_BUDGET[1]} with "
                           "--dry-run).")
  parser.add_argument("--workers", type=int, default=0,
                      help="pytest-xdist workers for the tests step (0: no "
                           "xdist). Default: %(default)s.")
  parser.add_argument("--compile-full", action="store_true",
                      help="Compile check of the whole matrix rather than "
                           "--quick (GPU run only).")
  parser.add_argument("--bench-head-dims", default=None,
                      help="Head dims of the bench step. Default: "
                           f"{','.join(map(str, BENCH_HEAD_DIMS))} (64 "
                           "with --dry-run).")
  parser.add_argument("--bench-seq-len", type=int, default=None,
                      help="T = S of the bench step. Default: 4096 (256 "
                           "with --dry-run).")
  parser.add_argument("--bench-causal", default="both",
                      choices=("both", "true", "false"),
                      help="Causal cells of the bench step (GPU).")
  parser.add_argument("--collect-env", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  steps = [s.strip() for s in args.steps.split(",") if s.strip()]
  unknown = [s for s in steps if s not in STEPS]
  if unknown or not steps:
    parser.error(f"--steps must be a non-empty subset of {STEPS}, got "
                 f"{args.steps!r}.")
  args.steps = [s for s in STEPS if s in steps]
  try:
    args.step_timeouts = _parse_step_timeouts(args.step_timeout,
                                              args.dry_run)
  except ValueError as e:
    parser.error(str(e))
  i = 1 if args.dry_run else 0
  if args.test_timeout is None:
    args.test_timeout = float(DEFAULT_TEST_TIMEOUT[i])
  if args.budget is None:
    args.budget = float(DEFAULT_BUDGET[i])
  if args.bench_head_dims is None:
    args.bench_head_dims = "64" if args.dry_run else ",".join(
        map(str, BENCH_HEAD_DIMS))
  args.bench_head_dims = [int(h) for h in args.bench_head_dims.split(",")]
  if args.bench_seq_len is None:
    args.bench_seq_len = 256 if args.dry_run else 4096
  return args


def main(argv: Sequence[str]) -> int:
  """Runs the chosen steps and writes DIR/summary.json.

  Args:
    argv: the command-line arguments (without the program name).

  Returns:
    The exit status: 0 when no step failed, 1 otherwise.
  """
  args = parse_args(argv)
  if args.collect_env:
    return _collect_env_main(args.collect_env, args.dry_run)
  start = time.monotonic()
  out = pathlib.Path(args.out).resolve()
  out.mkdir(parents=True, exist_ok=True)
  ctx = Context(out=out, dry_run=args.dry_run,
                test_timeout=args.test_timeout, workers=args.workers,
                compile_full=args.compile_full)
  summary_path = out / "summary.json"
  previous = {}
  if summary_path.exists():
    # A run of some --steps into the same folder keeps the other steps'
    # records from the earlier run.
    try:
      old = json.loads(summary_path.read_text())
      if old.get("dry_run") == args.dry_run:
        previous = old.get("steps") or {}
    except ValueError:
      pass
  steps = {}
  for name in STEPS:
    if name in args.steps:
      steps[name] = {"status": "pending", "reason": ""}
    elif name in previous:
      steps[name] = {**previous[name], "from_earlier_run": True}
    else:
      steps[name] = {"status": "skipped", "reason": "not requested (--steps)"}
  summary: dict[str, Any] = {
      "dry_run": args.dry_run,
      "out": str(out),
      "command": shlex.join([sys.executable, *sys.argv]),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "budget_s": args.budget,
      "test_timeout_s": args.test_timeout,
      "steps": steps,
  }
  runners = {
      "env": step_env,
      "compile": step_compile,
      "tests": step_tests,
      "bench": lambda ctx, timeout: step_bench(
          ctx, timeout, head_dims=args.bench_head_dims,
          seq_len=args.bench_seq_len, causal=args.bench_causal),
  }
  _write_json(summary_path, summary)
  # SIGTERM (a wall-clock limit from outside) unwinds like Ctrl-C, so that
  # the running step's process group is stopped and the summary written.
  signal.signal(signal.SIGTERM, _raise_interrupt)
  interrupted = False
  for name in args.steps:
    left = args.budget - (time.monotonic() - start) - sum(STOP_GRACE)
    timeout = min(args.step_timeouts[name], left)
    step_start = time.monotonic()
    if interrupted:
      record = {"status": "skipped", "reason": "gpu_check was interrupted"}
    elif timeout < MIN_STEP_S:
      record = {"status": "skipped",
                "reason": f"out of time (--budget={args.budget:.0f} s)"}
    else:
      print(f"[gpu_check] {name}: running (timeout {timeout:.0f} s)",
            flush=True)
      steps[name] = {"status": "running", "reason": ""}
      _write_json(summary_path, summary)
      try:
        record = runners[name](ctx, timeout)
      except KeyboardInterrupt:
        interrupted = True
        record = {"status": "failed", "reason": "gpu_check was interrupted"}
        xml = out / "pytest.xml"
        if name == "tests" and xml.exists():  # pytest saw SIGINT too.
          with contextlib.suppress(ElementTree.ParseError):
            record.update(parse_junit(xml.read_text()), junit=xml.name)
      except Exception as e:  # One broken step must not stop the others.
        record = {"status": "failed",
                  "reason": f"gpu_check error: {type(e).__name__}: {e}"}
    record["duration_s"] = round(time.monotonic() - step_start, 1)
    record["timeout_s"] = round(max(timeout, 0), 1)
    steps[name] = record
    summary["total_s"] = round(time.monotonic() - start, 1)
    _write_json(summary_path, summary)
    print(f"[gpu_check] {name}: {record['status']} "
          f"({record['duration_s']:.1f} s) {record.get('reason', '')}"[:400],
          flush=True)
  summary["total_s"] = round(time.monotonic() - start, 1)
  text = format_summary(summary)
  summary["summary_text"] = text
  _write_json(summary_path, summary)
  print()
  print(text)
  print(f"\nwrote {summary_path}")
  if interrupted:
    return 130
  return 1 if any(s["status"] == "failed" for s in steps.values()) else 0


def _raise_interrupt(signum, frame):
  del signum, frame  # Unused.
  raise KeyboardInterrupt


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
