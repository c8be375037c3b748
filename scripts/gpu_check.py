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

This file parses the command line and runs the steps in order, keeping
summary.json current; the parts are in `gpu/`: `runner.py` (a subprocess
with its log, timeout and process group), `environment.py` (the env step's
record), `steps.py` (the four steps) and `report.py` (reading the junit XML
and JSON reports back, and the printed summary).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import shlex
import signal
import sys
import time
from typing import Any
from typing import Sequence
from xml.etree import ElementTree

from gpu import environment
from gpu import report
from gpu import runner
from gpu import steps

STEPS = ("env", "compile", "tests", "bench")
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
    return environment.write_env(args.collect_env, args.dry_run)
  start = time.monotonic()
  out = pathlib.Path(args.out).resolve()
  out.mkdir(parents=True, exist_ok=True)
  ctx = steps.Context(out=out, dry_run=args.dry_run,
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
  records = {}
  for name in STEPS:
    if name in args.steps:
      records[name] = {"status": "pending", "reason": ""}
    elif name in previous:
      records[name] = {**previous[name], "from_earlier_run": True}
    else:
      records[name] = {"status": "skipped",
                       "reason": "not requested (--steps)"}
  summary: dict[str, Any] = {
      "dry_run": args.dry_run,
      "out": str(out),
      "command": shlex.join([sys.executable, *sys.argv]),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "budget_s": args.budget,
      "test_timeout_s": args.test_timeout,
      "steps": records,
  }
  runners = {
      "env": steps.step_env,
      "compile": steps.step_compile,
      "tests": steps.step_tests,
      "bench": lambda ctx, timeout: steps.step_bench(
          ctx, timeout, head_dims=args.bench_head_dims,
          seq_len=args.bench_seq_len, causal=args.bench_causal),
  }
  _write_json(summary_path, summary)
  # SIGTERM (a wall-clock limit from outside) unwinds like Ctrl-C, so that
  # the running step's process group is stopped and the summary written.
  signal.signal(signal.SIGTERM, _raise_interrupt)
  interrupted = False
  for name in args.steps:
    left = args.budget - (time.monotonic() - start) - sum(runner.STOP_GRACE)
    timeout = min(args.step_timeouts[name], left)
    step_start = time.monotonic()
    if interrupted:
      record = {"status": "skipped", "reason": "gpu_check was interrupted"}
    elif timeout < steps.MIN_STEP_S:
      record = {"status": "skipped",
                "reason": f"out of time (--budget={args.budget:.0f} s)"}
    else:
      print(f"[gpu_check] {name}: running (timeout {timeout:.0f} s)",
            flush=True)
      records[name] = {"status": "running", "reason": ""}
      _write_json(summary_path, summary)
      try:
        record = runners[name](ctx, timeout)
      except KeyboardInterrupt:
        interrupted = True
        record = {"status": "failed", "reason": "gpu_check was interrupted"}
        xml = out / "pytest.xml"
        if name == "tests" and xml.exists():  # pytest saw SIGINT too.
          with contextlib.suppress(ElementTree.ParseError):
            record.update(report.parse_junit(xml.read_text()),
                          junit=xml.name)
      except Exception as e:  # One broken step must not stop the others.
        record = {"status": "failed",
                  "reason": f"gpu_check error: {type(e).__name__}: {e}"}
    record["duration_s"] = round(time.monotonic() - step_start, 1)
    record["timeout_s"] = round(max(timeout, 0), 1)
    records[name] = record
    summary["total_s"] = round(time.monotonic() - start, 1)
    _write_json(summary_path, summary)
    print(f"[gpu_check] {name}: {record['status']} "
          f"({record['duration_s']:.1f} s) {record.get('reason', '')}"[:400],
          flush=True)
  summary["total_s"] = round(time.monotonic() - start, 1)
  text = report.format_summary(summary)
  summary["summary_text"] = text
  _write_json(summary_path, summary)
  print()
  print(text)
  print(f"\nwrote {summary_path}")
  if interrupted:
    return 130
  return 1 if any(s["status"] == "failed" for s in records.values()) else 0


def _raise_interrupt(signum, frame):
  del signum, frame  # Unused.
  raise KeyboardInterrupt


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
