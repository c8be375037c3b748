r"""The prepared commands of a lent GPU machine: what decides the next month.

A GPU machine is lent for 15 minutes in all, its start and idle time
included, and a command runs at most 10 minutes, of which at most 8 files
come back. A window is two calls (`gpu/plan.py`; `--plan` prints them),
the second straight after the first while the machine is warm, each step
within its share:

  --call=speed (420 s budget, 450 s limit)
    env      20 s  versions (jax, CUDA runtime, cuDNN, ptxas), nvidia-smi,
                   devices, PALLAS_FA_COMMIT and the source hash; it
                   always runs, for at least 10 s
    bench   265 s  bf16, H = 128, T in {16384, 4096}, causal and not, fwd
                   and fwd+bwd: each implementation in its own process
                   with the seconds it needs, those that answer the
                   window's questions first: mosaic_gpu with the split and
                   the fused backward, cuDNN, the float8 forwards of
                   mosaic_gpu, cuDNN and triton; then, in what they
                   leave, the fused backward's tile variants, a forward
                   variant and triton's bf16 cells; a timestamp per phase
                   of each process
    decode  135 s  triton decode_attention's cache forms with bf16
                   queries, then the grid (B in {1, 8}, S = 32768, K = 8,
                   H = 128, share of HBM bandwidth)
  --call=correctness (250 s budget, 280 s limit)
    env      20 s  as above
    kernels 180 s  compiled correctness of every GPU kernel: the tests
                   that failed in the last window first, then those no
                   window finished, then the stalest window's finished
                   ones; pytest-xdist with a per-test timeout, no
                   hypothesis shrinking, each worker's stderr kept
    checks   50 s  every backend with jax_enable_x64 on, the float32 tests
                   at precision="highest", then each test that crashed a
                   worker in the last window alone, if its time is left
  extra (only with --steps): xla/chunked conformance and other tests, XLA
    and H = 64 and 256 in the benchmark, the on-device compile report

A step may use the time earlier steps left unused, never a later step's
share. Every step runs in processes of its own with a deadline (a failing,
hanging or crashing one never stops the next), and at most 7 files are
written, all at the top of --out:

  summary.json  every step's status, time and headline numbers; rewritten
                after every step and every few seconds within one
  bundle.tgz    every log and per-step report; rewritten after every step
                and every 30 s
  junit.xml     the test results (kernels, checks and extra)
  bench.json, bench.md  the benchmark table, rewritten after every cell
  decode.json, decode_forms.json  the decode cells, rewritten after every
                cell

A SIGTERM (the command's time limit) stops the running step's processes
and leaves all of these readable. The package need not be installed.

Commands (from the repository root; BUILD.md has the ones to paste):

  python3 scripts/gpu_check.py --plan                  # plan and commands
  PYTHONPATH=. python3 scripts/gpu_check.py --out="$OUT" --call=speed
  PYTHONPATH=. python3 scripts/gpu_check.py --out="$OUT" --call=correctness
  # A rerun of what failed, with a returned summary.json copied to the
  # repository root as gpu_summary.json:
  PYTHONPATH=. python3 scripts/gpu_check.py --out="$OUT" \
      --steps=env,kernels --budget=150 --only=@gpu_summary.json
  # The CPU rehearsal of both calls (tests/test_gpu_check.py runs it):
  python3 scripts/gpu_check.py --dry-run --call=all --out=/tmp/gpu_dry

This file parses the command line and runs the steps, keeping the files
current; the parts are in `gpu/`: `plan.py` (steps, calls, shares, files),
`runner.py` (a subprocess with its log, deadline and process group; atomic
files and the bundle), `environment.py` (the env record), `steps.py` (the
steps), `pytest_plugin.py` (test order, selection, results as they finish,
no shrinking, fresh workers after a CUDA fault, each worker's stderr) and
`report.py` (the results read back, the printed summary). The last
windows' test results, which order the test steps, are their files under
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import shutil
import signal
import sys
import tempfile
import time
from typing import Any
from typing import Sequence

from gpu import environment
from gpu import plan
from gpu import report
from gpu import runner
from gpu import steps

DEFAULT_TEST_TIMEOUT = 120
# The GPU machines have 16 cores: 8 processes compile while others run.
# The dry run runs its few tests in one process (CI has 2 cores).
DEFAULT_WORKERS = {False: 8, True: 0}
BUNDLE_EVERY_S = 30


def _only_patterns(values: Sequence[str]) -> tuple[str, ...]:
  """The test id patterns of --only: each value, or @FILE's lines, or the
  failed tests of @FILE when it is a gpu_check summary.json."""
  patterns = []
  for value in values:
    if not value.startswith("@"):
      patterns.append(value)
      continue
    path = pathlib.Path(value[1:])
    if path.suffix != ".json":
      patterns += [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#")
      ]
      continue
    patterns += failed_tests(json.loads(path.read_text()).get("steps") or {})
  return tuple(dict.fromkeys(patterns))


def failed_tests(records: dict[str, Any]) -> list[str]:
  """The ids of the tests that failed in a summary's step records (the
  kernels step's, and those of the checks and extra steps' test parts)."""
  parts = [
    part
    for name in ("checks", "extra")
    for part in ((records.get(name) or {}).get("parts") or {}).values()
  ]
  return [
    test
    for record in (records.get("kernels"), *parts)
    for test in (record or {}).get("failed_ids") or []
  ]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """Parses the command line (see the module docstring)."""
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--out",
    default="gpu_check_out",
    help="Output folder (created); only the files of the "
    "plan are written there. Default: %(default)s.",
  )
  parser.add_argument(
    "--call",
    choices=sorted(plan.CALLS),
    default=plan.DEFAULT_CALL,
    help="Which prepared call of a window: its steps and budget. "
    "Default: %(default)s.",
  )
  parser.add_argument(
    "--steps",
    default=None,
    help=f"Comma list of steps among {','.join(plan.NAMES)}. Default: "
    "the call's.",
  )
  parser.add_argument(
    "--plan",
    action="store_true",
    help="Print the plan (steps, shares, files, the "
    "commands to run it) as JSON; run nothing.",
  )
  parser.add_argument(
    "--dry-run",
    action="store_true",
    help="The same plan, tiny and fast, on a CPU (CI).",
  )
  parser.add_argument(
    "--budget",
    type=float,
    default=None,
    help="Seconds for the whole run. Default: the call's "
    f"({', '.join(f'{c.name} {c.budget_s:.0f}' for c in plan.CALLS.values())}"
    "; less with --dry-run).",
  )
  parser.add_argument(
    "--test-timeout",
    type=float,
    default=None,
    help=f"Seconds per test (pytest-timeout). Default: {DEFAULT_TEST_TIMEOUT}.",
  )
  parser.add_argument(
    "--workers",
    type=int,
    default=None,
    help="pytest-xdist workers (0: none). Default: "
    f"{DEFAULT_WORKERS[False]} "
    f"({DEFAULT_WORKERS[True]} with --dry-run).",
  )
  parser.add_argument(
    "--only",
    action="append",
    default=[],
    help="Rerun only the tests whose id contains this "
    "(repeatable); @FILE: one per line, or the failed "
    "tests of a gpu_check summary.json.",
  )
  parser.add_argument(
    "--work",
    default=None,
    help="Folder for the logs and per-step reports (kept); "
    "default: a temporary one, removed at the end "
    "(bundle.tgz holds its files).",
  )
  parser.add_argument("--collect-env", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if not args.out.strip():
    # An unset $OUT: the files would land in the working directory.
    parser.error("--out is empty (is $OUT set?)")
  call = plan.CALLS[args.call]
  if args.steps is None:
    args.steps = ",".join(call.steps)
  names = [s.strip() for s in args.steps.split(",") if s.strip()]
  unknown = [s for s in names if s not in plan.NAMES]
  if unknown or not names:
    parser.error(
      f"--steps must be a non-empty subset of {plan.NAMES}, got {args.steps!r}."
    )
  args.steps = [s for s in plan.NAMES if s in names]
  if args.budget is None:
    args.budget = float(
      call.dry_run_budget_s if args.dry_run else call.budget_s
    )
  if not args.budget > 0:
    parser.error(
      f"--budget must be a positive number of seconds, got {args.budget}."
    )
  if args.test_timeout is None:
    args.test_timeout = float(DEFAULT_TEST_TIMEOUT)
  if args.workers is None:
    args.workers = DEFAULT_WORKERS[args.dry_run]
  try:
    only = _only_patterns(args.only)
  except (OSError, ValueError) as e:
    parser.error(f"--only: {e}")
  if args.only and not only:
    parser.error("--only names no test (no failed test in that summary?)")
  args.only = only
  return args


def _commit_label() -> str:
  info = environment.commit_info()
  commit = info.get("commit") or "unknown"
  return commit + ("+modified" if info.get("modified") else "")


def plan_json(args: argparse.Namespace) -> dict[str, Any]:
  """The plan of this command line, and the commands that run the GPU plan
  on a lent machine with this checkout's commit."""
  described = plan.describe(args.steps, args.budget, args.dry_run)
  return {
    **described,
    "source_hash": environment.source_hash(),
    "commands": plan.commands(_commit_label()),
  }


class _Run:
  """One run's state: the summary, and the files kept current under out."""

  def __init__(
    self, args: argparse.Namespace, out: pathlib.Path, work: pathlib.Path
  ):
    self.out, self.work = out, work
    self.start = time.monotonic()
    self.bundled = 0.0
    self.records = {
      name: {"status": "pending", "reason": ""} for name in args.steps
    }
    self.summary: dict[str, Any] = {
      "dry_run": args.dry_run,
      "out": str(out),
      "command": runner.shown([sys.executable, *sys.argv],
                              {str(out): "$OUT"}),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"
      ),
      "budget_s": args.budget,
      "plan": plan.describe(args.steps, args.budget, args.dry_run),
      "steps": self.records,
    }

  def write_summary(self) -> None:
    self.summary["total_s"] = round(time.monotonic() - self.start, 1)
    self.summary["files"] = sorted(
      p.name for p in self.out.iterdir() if p.name in plan.FILES
    )
    runner.write_atomic(
      self.out / plan.SUMMARY,
      json.dumps(self.summary, indent=1, default=str) + "\n",
    )

  def flush(self) -> None:
    """Rewrites every file that gathers the work folder's (the merged
    junit XML, the bundle), then the summary."""
    junit = report.merge_junit(sorted(self.work.glob("junit_*.xml")))
    if junit is not None:
      runner.write_atomic(self.out / plan.JUNIT, junit)
    runner.write_bundle(self.work, self.out / plan.BUNDLE)
    self.bundled = time.monotonic()
    self.write_summary()

  def progress(self, name: str, record: dict[str, Any]) -> None:
    """A running step's numbers so far: into the summary now, into the
    bundle every `BUNDLE_EVERY_S`."""
    self.records[name] = {**self.records[name], **record, "status": "running"}
    if time.monotonic() - self.bundled > BUNDLE_EVERY_S:
      self.flush()
    else:
      self.write_summary()


def _interrupt(signum, frame):
  del frame  # Unused.
  # One is enough: the second of a burst must not cut the flush short.
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  raise KeyboardInterrupt(signal.Signals(signum).name)


def step_timeout(
  name: str, step_shares: dict[str, float], until_end: float
) -> float | None:
  """The timeout of step `name`'s processes when it starts `until_end`
  seconds before the run's budget ends.

  A step ends where the later steps' shares begin, its processes' stop
  included (`runner.STOP_GRACE`): it may use what the earlier steps left,
  never a later step's share. A step with a `plan.Step.min_timeout_s`
  (env) always gets at least that: its share, whatever the budget, is
  never too short to start it.

  Returns:
    The seconds, or None when they are not worth starting a process for
    (the step is then skipped).
  """
  timeout = (until_end - plan.reserved_after(name, step_shares)
             - sum(runner.STOP_GRACE))
  floor = plan.by_name(name).min_timeout_s
  if floor is not None:
    return max(timeout, floor)
  return timeout if timeout >= steps.MIN_STEP_S else None


def run_steps(args: argparse.Namespace, run: _Run) -> str | None:
  """Runs the chosen steps in order, each by its deadline.

  Returns:
    The name of the signal that stopped the run, or None.
  """
  shares = plan.shares(args.steps, args.budget, args.dry_run)
  end = run.start + args.budget
  base = steps.Context(
    out=run.out,
    work=run.work,
    dry_run=args.dry_run,
    test_timeout=args.test_timeout,
    workers=args.workers,
    only=args.only,
  )
  stopped_by = None
  for name in args.steps:
    step_start = time.monotonic()
    timeout = step_timeout(name, shares, end - step_start)
    if stopped_by:
      record = {"status": "skipped", "reason": f"gpu_check got {stopped_by}"}
    elif timeout is None:
      record = {
        "status": "skipped",
        "reason": f"out of time (--budget={args.budget:.0f} s)",
      }
    else:
      print(
        f"[gpu_check] {name}: running (timeout {timeout:.0f} s)", flush=True
      )
      run.records[name] = {"status": "running", "reason": ""}
      run.write_summary()
      ctx = dataclasses.replace(
        base, progress=lambda r, name=name: run.progress(name, r)
      )
      try:
        record = steps.RUNNERS[name](ctx, timeout)
      except KeyboardInterrupt as e:
        stopped_by = str(e) or "SIGINT"
        # The numbers it had published stay.
        record = {
          **run.records[name],
          "status": "failed",
          "reason": f"stopped: gpu_check got {stopped_by}",
        }
      except Exception as e:  # One broken step must not stop the others.
        record = {
          "status": "failed",
          "reason": f"gpu_check error: {type(e).__name__}: {e}",
        }
    record["duration_s"] = round(time.monotonic() - step_start, 1)
    record["timeout_s"] = round(max(timeout or 0, 0), 1)
    run.records[name] = record
    try:
      run.flush()
    except KeyboardInterrupt as e:
      stopped_by = stopped_by or str(e) or "SIGINT"
    print(
      f"[gpu_check] {name}: {record['status']} "
      f"({record['duration_s']:.1f} s) {record.get('reason', '')}"[:400],
      flush=True,
    )
  return stopped_by


def main(argv: Sequence[str]) -> int:
  """Runs the chosen steps and keeps the files under --out current.

  Args:
    argv: the command-line arguments (without the program name).

  Returns:
    The exit status: 0 when no step failed, 1 otherwise, 128 + the signal
    when a signal stopped the run.
  """
  args = parse_args(argv)
  if args.collect_env:
    return environment.write_env(args.collect_env, args.dry_run)
  if args.plan:
    print(json.dumps(plan_json(args), indent=1))
    return 0
  out = pathlib.Path(args.out).resolve()
  out.mkdir(parents=True, exist_ok=True)
  for name in plan.FILES:  # The folder describes this run only.
    (out / name).unlink(missing_ok=True)
  work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
  work.mkdir(parents=True, exist_ok=True)
  run = _Run(args, out, work)
  # SIGTERM (a wall-clock limit from outside) unwinds like Ctrl-C: the
  # running step's processes are stopped and every file flushed.
  signal.signal(signal.SIGTERM, _interrupt)
  run.write_summary()
  stopped_by = run_steps(args, run)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  failed = [n for n, r in run.records.items() if r["status"] == "failed"]
  if failed_tests(run.records):
    # With this summary.json copied to the repository root (see BUILD.md).
    run.summary["rerun"] = plan.rerun_command(_commit_label())
  text = report.format_summary(run.summary)
  run.summary["summary_text"] = text
  run.flush()
  if not args.work:
    shutil.rmtree(work, ignore_errors=True)
  print()
  print(text)
  print(f"\nwrote {', '.join(run.summary['files'])} in {out}")
  if stopped_by:
    return 128 + getattr(signal.Signals, stopped_by, signal.SIGINT).value
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
