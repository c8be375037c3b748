"""The steps of scripts/gpu_check.py. Each returns its record: status "ok" |
"failed" | "skipped", reason, and its own numbers; the caller adds the
duration."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shlex
import sys
import time
from typing import Any
from typing import Sequence
from xml.etree import ElementTree

from gpu import environment
from gpu import report
from gpu import runner

GPU_CHECK = runner.REPO_ROOT / "scripts" / "gpu_check.py"
COMPILE_CHECK = runner.REPO_ROOT / "scripts" / "compile_check.py"
BENCHMARK = runner.REPO_ROOT / "scripts" / "benchmark.py"
MIN_STEP_S = 5

# The dry run's tests: two interpreted Triton conformance checks that take
# a few seconds each on a CPU (the dry run checks the plumbing, not the
# kernels).
DRY_RUN_TESTS_K = (
    "(test_float32 and B2T64S64N2K2H32) or test_fully_masked_rows")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Context:
  """What every step needs."""

  out: pathlib.Path
  dry_run: bool
  test_timeout: float
  workers: int
  compile_full: bool = False


def _proc_fields(proc: runner.ProcResult) -> dict[str, Any]:
  return {"returncode": proc.returncode, "timed_out": proc.timed_out}


def step_env(ctx: Context, timeout: float) -> dict[str, Any]:
  path = ctx.out / "env.json"
  log = ctx.out / "env.log"
  cmd = [sys.executable, str(GPU_CHECK),
         f"--collect-env={path}"] + (["--dry-run"] if ctx.dry_run else [])
  proc = runner.run_logged(cmd, log_path=log, timeout=timeout,
                           env=runner.child_env())
  record = {"command": shlex.join(cmd), "log": log.name,
            **_proc_fields(proc)}
  try:
    info = json.loads(path.read_text())
  except (OSError, ValueError):
    info = {"problems": ["env collection wrote no env.json: "
                         f"{runner.log_tail(log)}"]}
    path.write_text(json.dumps(info, indent=1) + "\n")
  record["json"] = path.name
  record["brief"] = environment.env_brief(info)
  record["jax_version"] = info.get("jax_version")
  if proc.timed_out:
    return {**record, "status": "failed",
            "reason": f"timed out after {timeout:.0f} s"}
  if info.get("problems") or proc.returncode != 0:
    reason = "; ".join(info.get("problems") or []) or (
        f"exit status {proc.returncode}: {runner.log_tail(log)}")
    return {**record, "status": "failed", "reason": reason}
  return {**record, "status": "ok", "reason": ""}


# argparse's exit status is 2 as well: a usage error is a failure.
_USAGE_ERROR = re.compile(r"^usage: |: error: ", re.MULTILINE)


def step_compile(ctx: Context, timeout: float) -> dict[str, Any]:
  script = COMPILE_CHECK
  if not script.exists():
    return {"status": "skipped",
            "reason": "scripts/compile_check.py not found"}
  plugin = runner.cuda_plugin()
  if ctx.dry_run and plugin is None:
    return {"status": "skipped",
            "reason": "no CUDA plugin (none of "
                      f"{', '.join(runner.CUDA_PLUGINS)} importable)"}
  path = ctx.out / "compile_check.json"
  log = ctx.out / "compile_check.log"
  if ctx.dry_run:
    # Deviceless, as compile_check.py documents: no CUDA backend is started.
    # One case per backend (--quick's 12 take over a minute on 2 cores).
    args = ["--target=h100", "--backends=triton,mosaic_gpu",
            "--head-dims=64", "--variants=plain", "--dtypes=bfloat16"]
    env = runner.child_env(JAX_PLATFORMS="cpu")
  else:
    # --quick (H 64/128/256, plain and causal, bf16; under a minute) unless
    # --compile-full asks for the whole matrix (~60 cases, minutes).
    args = ["--target=local"] + ([] if ctx.compile_full else ["--quick"])
    env = runner.child_env()
  cmd = [sys.executable, str(script), *args, f"--json={path}"]
  proc = runner.run_logged(cmd, log_path=log, timeout=timeout, env=env)
  record = {"command": shlex.join(cmd), "log": log.name,
            **_proc_fields(proc)}
  if path.exists():
    record["json"] = path.name
    try:
      record.update(report.summarise_compile(json.loads(path.read_text())))
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
            "reason": f"cannot run here (exit 2): {runner.log_tail(log, 1)}"}
  what = ("compile problems" if proc.returncode == 1
          else f"exit status {proc.returncode}")
  return {**record, "status": "failed",
          "reason": f"{what}: {runner.log_tail(log, 2)}"}


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
  if runner.has_module("pytest_timeout"):
    cmd.append(f"--timeout={ctx.test_timeout:.0f}")
  else:
    warnings.append("pytest-timeout is not installed: no per-test timeout "
                    "(a hanging test ends the step at its timeout)")
  extra_env = {"PALLAS_FA_TEST_IMPLEMENTATIONS": impls}
  if ctx.workers > 0:
    if runner.has_module("xdist"):
      cmd += ["-n", str(ctx.workers)]
      if runner.has_module("pytest_timeout"):
        # A timed-out test kills its worker, which xdist replaces: a hung
        # kernel costs one test, not the run. (The ini name works in every
        # pytest-timeout version; the flag's spelling changed in 2.2.)
        cmd += ["-o", "timeout_method=thread"]
      # Several processes share the GPU.
      extra_env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:
      warnings.append("pytest-xdist is not installed: --workers ignored")
  proc = runner.run_logged(cmd, log_path=log, timeout=timeout,
                           env=runner.child_env(**extra_env))
  record = {"command": shlex.join(cmd),
            "implementations": impls, "log": log.name,
            "warnings": warnings, **_proc_fields(proc)}
  counts = None
  if xml.exists():
    record["junit"] = xml.name
    try:
      counts = report.parse_junit(xml.read_text())
    except ElementTree.ParseError as e:
      record["junit_error"] = str(e)
  if counts is not None:
    record.update(counts)
  if proc.timed_out:
    reason = f"timed out after {timeout:.0f} s"
    if counts is not None:
      reason += " (the counts are of the tests that finished)"
    else:
      reason += f" (no junit XML; log ends: {runner.log_tail(log, 2)})"
    return {**record, "status": "failed", "reason": reason}
  if counts is None:
    return {**record, "status": "failed",
            "reason": f"no junit XML (exit status {proc.returncode}): "
                      f"{runner.log_tail(log, 2)}"}
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
    share = (left - sum(runner.STOP_GRACE) * (runs_left - 1)) / runs_left
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
    proc = runner.run_logged(cmd, log_path=log, timeout=share,
                             env=runner.child_env())
    run = {"head_dim": head_dim, "command": shlex.join(cmd),
           "log": log.name, "duration_s": round(proc.duration_s, 1),
           **_proc_fields(proc)}
    if path.exists():
      run["json"] = path.name
      run.update(report.summarise_bench(json.loads(path.read_text())))
    # Only our implementations' cells decide; a peer's failure is shown.
    bad = {}
    for c in run.get("cells") or ():
      if c["kind"] == "impl" and c["status"] in ("wrong", "failed"):
        bad[c["status"]] = bad.get(c["status"], 0) + 1
    if proc.timed_out:
      problem = f"timed out after {share:.0f} s"
    elif proc.returncode != 0:
      problem = f"exit status {proc.returncode}: {runner.log_tail(log, 1)}"
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
