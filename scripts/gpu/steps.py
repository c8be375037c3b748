"""The steps of scripts/gpu_check.py (see `gpu.plan`). Each returns its
record: status "ok" | "failed" | "skipped", reason, and its headline
numbers; the caller adds the duration. A step publishes its numbers so far
through `Context.progress` while it runs."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time
from typing import Any
from typing import Callable
from typing import Sequence
from xml.etree import ElementTree

from gpu import environment
from gpu import plan
from gpu import report
from gpu import runner

GPU_CHECK = runner.SCRIPTS / "gpu_check.py"
COMPILE_CHECK = runner.SCRIPTS / "compile_check.py"
BENCHMARK = runner.SCRIPTS / "benchmark.py"
DECODE_BENCHMARK = runner.SCRIPTS / "decode_benchmark.py"
TRAIN = runner.SCRIPTS / "train.py"
# Less time than this is not worth starting a process for.
MIN_STEP_S = 5
MIN_PART_S = {False: 20, True: 5}  # By dry_run.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Context:
  """What every step needs.

  Attributes:
    out: the folder whose files come back (`plan.FILES` only).
    work: the folder of everything else (logs, per-run reports), which
      `bundle.tgz` packs.
    dry_run: the CPU rehearsal: the same steps on tiny shapes.
    test_timeout: seconds per test.
    workers: pytest-xdist workers (0: none).
    only: test id patterns for a rerun (the kernels step runs only these).
    progress: called with a step's record so far while it runs.
  """

  out: pathlib.Path
  work: pathlib.Path
  dry_run: bool
  test_timeout: float
  workers: int
  only: tuple[str, ...] = ()
  progress: Callable[[dict[str, Any]], None] = lambda record: None

  def shown(self, cmd: Sequence[str]) -> str:
    """`runner.shown`, with the out and work folders as $OUT and $WORK."""
    return runner.shown(cmd, {str(self.out): "$OUT", str(self.work): "$WORK"})


def _proc_fields(proc: runner.ProcResult) -> dict[str, Any]:
  return {"returncode": proc.returncode, "timed_out": proc.timed_out}


def _proc_problem(
  proc: runner.ProcResult, timeout: float, log: pathlib.Path
) -> str:
  """Why a process's run failed ("" if it exited 0)."""
  if proc.timed_out:
    return f"timed out after {timeout:.0f} s"
  if proc.returncode != 0:
    return f"exit status {proc.returncode}: {runner.log_tail(log, 2)}"
  return ""


def _read_json(path: pathlib.Path) -> Any:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


# ---------------------------------------------------------------------------
# env


def step_env(ctx: Context, timeout: float) -> dict[str, Any]:
  path = ctx.work / "env.json"
  log = ctx.work / "env.log"
  cmd = [sys.executable, str(GPU_CHECK), f"--collect-env={path}"] + (
    ["--dry-run"] if ctx.dry_run else []
  )
  proc = runner.run_logged(
    cmd, log_path=log, timeout=timeout, env=runner.child_env()
  )
  record = {"command": ctx.shown(cmd), **_proc_fields(proc)}
  info = _read_json(path)
  if not isinstance(info, dict):
    info = {
      "problems": [f"env collection wrote no env.json: {runner.log_tail(log)}"]
    }
  record["brief"] = environment.env_brief(info)
  record["env"] = environment.headline(info)
  problem = "; ".join(info.get("problems") or []) or _proc_problem(
    proc, timeout, log
  )
  return {**record, "status": "failed" if problem else "ok", "reason": problem}


# ---------------------------------------------------------------------------
# Tests (kernels, and extra's other tests)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tests:
  """What one pytest run runs.

  Attributes:
    files: the test files it collects.
    implementations: PALLAS_FA_TEST_IMPLEMENTATIONS (the conformance
      suite's).
    patterns: run only the tests whose id contains one of these (none: all).
    select: more pytest arguments (-k ...).
    drop: a regular expression: the tests whose id it finds are left out
      ("": none).
    first: ids of tests to run before all others (those that failed in the
      last window).
    last: groups of ids of tests to run after all others, each group after
      the one before (those each earlier window finished, the stalest
      window's first).
    env: more environment variables of the pytest process.
  """

  files: tuple[str, ...]
  implementations: str
  patterns: tuple[str, ...] = ()
  select: tuple[str, ...] = ()
  drop: str = ""
  first: tuple[str, ...] = ()
  last: tuple[tuple[str, ...], ...] = ()
  env: tuple[tuple[str, str], ...] = ()


# The tests' references are XLA programs compiled once and run once:
# XLA:GPU's autotuning of their matmuls (seconds each, per process) bought
# nothing in the first window but time; a matmul's algorithm does not change
# what a test accepts.
TEST_XLA_FLAGS = ("--xla_gpu_autotune_level=0",)


def test_xla_flags() -> str:
  """XLA_FLAGS of a test process: the outer ones, then `TEST_XLA_FLAGS`."""
  outer = os.environ.get("XLA_FLAGS", "").split()
  return " ".join(dict.fromkeys([*outer, *TEST_XLA_FLAGS]))


# The GPU windows of record, whose tests order the next window's: a test
# that failed in the last one runs first (is its fix in?), then those no
# window finished, then those each finished, the stalest window's first.
# ff8094b's are read from its junit XML; b85705a's and 07213ac's from the
# results that `gpu.pytest_plugin` wrote as each test finished (their
# kernels steps were stopped at their deadlines before pytest-xdist wrote
# the XML).
_RESULTS = runner.REPO_ROOT / "benchmarks" / "results"
BASELINE_JUNIT = _RESULTS / "h200_ff8094b" / "junit.xml"
EARLIER_KERNELS = _RESULTS / "h200_b85705a" / "tests_kernels.jsonl"
EARLIER_CHECKS = _RESULTS / "h200_b85705a" / "tests_checks.jsonl"
LAST_KERNELS = _RESULTS / "h200_07213ac" / "tests_kernels.jsonl"
LAST_CHECKS = _RESULTS / "h200_07213ac" / "tests_checks.jsonl"


def recorded_tests(results: pathlib.Path, *,
                   failed: bool = False) -> tuple[str, ...]:
  """The ids of the tests a results file of `gpu.pytest_plugin` records
  as finished, in the order they finished (`failed`: only those that did
  not pass or skip); () without the file."""
  summary = report.summarise_tests(results)
  if summary is None:
    return ()
  return tuple(summary["failed_ids" if failed else "finished"])


def finished_tests(junit: pathlib.Path) -> tuple[str, ...]:
  """The ids of the tests a junit XML records as finished (passed, failed
  or skipped; not those whose worker crashed), as pytest names them."""
  try:
    root = ElementTree.parse(junit).getroot()
  except (OSError, ElementTree.ParseError):
    return ()
  ids = []
  for case in root.iter("testcase"):
    module = case.get("classname")
    if not module or any(child.tag == "error" for child in case):
      continue
    ids.append(f"{module.replace('.', '/')}.py::{case.get('name')}")
  return tuple(ids)


def files_of(patterns: Sequence[str]) -> tuple[str, ...]:
  """The test files that test ids ("tests/x.py::test_y[...]") name."""
  return tuple(dict.fromkeys(p.split("::")[0] for p in patterns))


# mosaic_tpu runs interpreted off a TPU: slow, and no GPU kernel.
_NOT_TPU = ("-k", "not mosaic_tpu")
_KERNEL_IMPLEMENTATIONS = "mosaic_gpu,triton"
# The kernel test files' cases of xla and chunked (an id parameter of its
# own: "[xla]", "[t5-chunked]", "[chunked-token]"; not "chunked_causal"
# nor "..._matches_chunked"): no GPU kernel of ours runs in them, and they
# took 14 % of the kernels step's time at b85705a (185 of 1,368
# worker-seconds). CI runs them on a CPU.
NOT_A_KERNEL = r"[\[-](xla|chunked)[\]-]"
# The dry run's tests: one cheap test of each kind (a mosaic_gpu one that
# runs no kernel, an interpreted triton conformance case, the interpreted
# triton decode kernel, a float8 one that failed in the last window; an
# xla conformance case), selected as a rerun selects (`Context.only`).
_DRY_RUN_KERNELS = (
  "tests/test_mosaic_gpu.py::test_block_sizes_frozen_and_hashable",
  "tests/test_fp8.py::test_automatic_choice_runs_float8_on_chunked",
  "tests/test_conformance.py::test_float32[triton-B2T64S64N2K2H32]",
  "tests/test_decode.py::test_triton_window_softcap_positions",
)
_DRY_RUN_OTHERS = (
  "tests/test_conformance.py::test_float32[xla-B2T64S64N2K2H32]",
)
# By --dry-run: the compiled correctness of every GPU kernel (the kernels
# step), and the rest of the suite that runs on a GPU (the extra step).
KERNEL_TESTS = {
  False: Tests(
    files=(
      "tests/test_mosaic_gpu.py",
      "tests/test_conformance.py",
      "tests/test_triton.py",
      "tests/test_decode.py",
      "tests/test_decode_mosaic_gpu.py",
      "tests/test_decode_quantized_triton.py",
      "tests/test_decode_latent_triton.py",
      "tests/test_dropout.py",
      "tests/test_flex.py",
      "tests/test_fp8.py",
      "tests/test_mosaic_gpu_fp8.py",
      "tests/test_decode_prefix_latent.py",
      "tests/test_decode_property.py",
      "tests/test_fp8_property.py",
    ),
    implementations=_KERNEL_IMPLEMENTATIONS,
    select=_NOT_TPU,
    drop=NOT_A_KERNEL,
  ),
  True: Tests(
    files=files_of(_DRY_RUN_KERNELS),
    implementations="triton",
    patterns=_DRY_RUN_KERNELS,
  ),
}
OTHER_TESTS = {
  False: Tests(
    files=(
      "tests/test_conformance.py",
      "tests/test_precision.py",
      "tests/test_api.py",
      "tests/test_chunked.py",
    ),
    implementations="xla,chunked",
    select=_NOT_TPU,
  ),
  True: Tests(
    files=files_of(_DRY_RUN_OTHERS),
    implementations="xla",
    patterns=_DRY_RUN_OTHERS,
  ),
}


def rerun_tests(patterns: Sequence[str]) -> Tests:
  """The tests of a rerun (--only): those whose id contains one of
  `patterns`, in the files they name if each names its file, else in every
  file of both GPU selections."""
  files = files_of(patterns)
  if not all(
    f.endswith(".py") and (runner.REPO_ROOT / f).is_file() for f in files
  ):
    gpu = (KERNEL_TESTS[False], OTHER_TESTS[False])
    files = tuple(dict.fromkeys(f for t in gpu for f in t.files))
  return Tests(
    files=files,
    implementations=",".join(
      (KERNEL_TESTS[False].implementations, OTHER_TESTS[False].implementations)
    ),
    patterns=tuple(patterns),
  )


def _xdist_args(workers: int) -> tuple[list[str], list[str]]:
  """(pytest arguments, warnings) for `workers` pytest-xdist processes."""
  if workers <= 0:
    return [], []
  if not runner.has_module("xdist"):
    return [], ["pytest-xdist is not installed: no workers"]
  args = ["-n", str(workers)]
  try:
    version = importlib.metadata.version("pytest-xdist")
    major, minor = (int(x) for x in version.split(".")[:2])
  except (importlib.metadata.PackageNotFoundError, ValueError):
    major, minor = 0, 0
  if (major, minor) >= (3, 2):  # Where --maxschedchunk came in.
    # Two tests at a time per worker: the first tests (mosaic_gpu's) spread
    # over every worker, rather than a long run of them going to one.
    args.append("--maxschedchunk=2")
  return args, []


def run_tests(
  ctx: Context, name: str, timeout: float, tests: Tests
) -> dict[str, Any]:
  """Runs pytest once, with `gpu.pytest_plugin`; its record.

  Args:
    ctx: the run's context.
    name: names the files in ctx.work (log, junit XML, results).
    timeout: seconds for the whole pytest run.
    tests: what it runs.

  Returns:
    The record: the counts and failures (`report.summarise_tests`), the
    command, status and reason.
  """
  xml = ctx.work / f"junit_{name}.xml"
  log = ctx.work / f"pytest_{name}.log"
  results = ctx.work / f"tests_{name}.jsonl"
  for path in (xml, results):
    path.unlink(missing_ok=True)
  cmd = [sys.executable, "-m", "pytest", *tests.files, *tests.select]
  # Python's output is captured per test, file descriptor 2 is not: what C
  # code (XLA, CUDA) writes there reaches the worker's stderr file, from
  # which a dead worker's crash report takes its last lines.
  cmd += ["-q", "-rfE", "--capture=sys"]
  cmd += ["--tb=short", "-p", "no:cacheprovider", "-p", "gpu.pytest_plugin"]
  cmd += [f"--junitxml={xml}"]
  xdist, warnings = _xdist_args(ctx.workers)
  cmd += xdist
  if runner.has_module("pytest_timeout"):
    # It dumps every thread's stack at the timeout, and stops the test.
    cmd.append(f"--timeout={ctx.test_timeout:.0f}")
    if xdist:
      # A timed-out test ends its worker, which xdist replaces: a hung
      # kernel costs one test, not the run. (The ini name works in every
      # pytest-timeout version; the flag's spelling changed in 2.2.)
      cmd += ["-o", "timeout_method=thread"]
  else:
    # pytest's own watchdog at least dumps every thread's stack when a test
    # runs this long, even while it is blocked in C (a hung kernel).
    cmd += ["-o", f"faulthandler_timeout={ctx.test_timeout:.0f}"]
    warnings.append(
      "pytest-timeout is not installed: no per-test timeout "
      "(a hanging test ends the step at its timeout)"
    )
  extra_env = {
    "PALLAS_FA_TEST_IMPLEMENTATIONS": tests.implementations,
    "PALLAS_FA_TEST_RESULTS": str(results),
    "PALLAS_FA_TEST_FIRST": _KERNEL_IMPLEMENTATIONS,
    "PALLAS_FA_TEST_STDERR_DIR": str(ctx.work / f"stderr_{name}"),
    "XLA_FLAGS": test_xla_flags(),
  }
  if tests.first or tests.last:
    order = ctx.work / f"order_{name}.json"
    order.write_text(json.dumps({"first": list(tests.first),
                                 "last": [list(g) for g in tests.last]}))
    extra_env["PALLAS_FA_TEST_ORDER"] = str(order)
  if tests.drop:
    extra_env["PALLAS_FA_TEST_DROP"] = tests.drop
  if tests.patterns:
    only = ctx.work / f"only_{name}.txt"
    only.write_text("\n".join(tests.patterns) + "\n")
    extra_env["PALLAS_FA_TEST_ONLY"] = str(only)
  if xdist:
    # Several processes share the GPU: each takes memory as it needs it.
    extra_env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  extra_env.update(tests.env)
  base = {
    "command": ctx.shown(cmd),
    "implementations": tests.implementations,
    "warnings": warnings,
  }

  def progress():
    ctx.progress({**base, **(report.summarise_tests(results) or {})})

  proc = runner.run_logged(
    cmd,
    log_path=log,
    timeout=timeout,
    env=runner.child_env(scripts_on_path=True, **extra_env),
    on_wait=progress,
  )
  record = {**base, **_proc_fields(proc)}
  counts = report.summarise_tests(results)
  if counts is None:
    return {
      **record,
      "status": "failed",
      "reason": "no test finished: "
      + (_proc_problem(proc, timeout, log) or runner.log_tail(log, 2)),
    }
  record.update(counts)
  problem = _proc_problem(proc, timeout, log)
  if proc.timed_out:
    running = counts["running"]
    if running:
      problem += (f" in {len(running)} test(s): "
                  f"{', '.join(running[:3])}{', ...' if running[3:] else ''}")
    problem += f" ({counts['tests']} finished: the counts are theirs)"
  elif not problem and not counts["passed"]:
    problem = "no test passed"
  if counts["failed_ids"]:
    problem = problem or f"{len(counts['failed_ids'])} test(s) failed"
  return {**record, "status": "failed" if problem else "ok", "reason": problem}


def step_kernels(ctx: Context, timeout: float) -> dict[str, Any]:
  if ctx.only:
    tests = rerun_tests(ctx.only)
  else:
    # What failed at 07213ac first, then what no window finished, then
    # what ff8094b, b85705a and 07213ac finished, in that order.
    tests = dataclasses.replace(
      KERNEL_TESTS[ctx.dry_run],
      first=recorded_tests(LAST_KERNELS, failed=True),
      last=(finished_tests(BASELINE_JUNIT), recorded_tests(EARLIER_KERNELS),
            recorded_tests(LAST_KERNELS)))
  return run_tests(ctx, "kernels", timeout, tests)


# ---------------------------------------------------------------------------
# checks: x64, float32 at "highest", and the last window's crashes alone


# By --dry-run: every backend with jax_enable_x64 on, the reproducible
# backward rerun bitwise-equal on every backend, and the float32 tests
# (conftest sets jax_default_matmul_precision="highest": the triton float32
# products then run in IEEE float32, not TF32) but the conformance suite's
# float32 cases of mosaic_gpu and triton, which the kernels step runs (48
# tests); those the last window did not finish first. The dry run: xla and
# the interpreted triton kernel, one conformance case.
CHECK_TESTS = {
  False: Tests(
    files=("tests/test_x64.py", "tests/test_determinism.py",
           "tests/test_precision.py", "tests/test_conformance.py"),
    implementations="mosaic_gpu,triton,xla,chunked",
    select=("-k", "(test_x64 or test_determinism or test_precision or "
                  "(float32 and not mosaic_gpu and not triton)) "
                  "and not mosaic_tpu"),
    last=(recorded_tests(EARLIER_CHECKS), recorded_tests(LAST_CHECKS)),
  ),
  True: Tests(
    files=("tests/test_x64.py",),
    implementations="xla,triton",
    select=("-k", "not mosaic_tpu and not mosaic_gpu"),
  ),
}
# The tests that crashed their pytest-xdist worker in the last window, each
# to run alone in a process of its own, with the time it needs
# (`ALONE_NEED_S`), after the x64 and float32 tests. None crashed one at
# b85705a or 07213ac: the two that had at ff8094b (over its 60 s per-test
# timeout) passed under pytest-xdist in 11 and 17 s with the 120 s one.
# The dry run: one cheap test.
ALONE_TESTS = {
  False: (),
  True: ("tests/test_mosaic_gpu.py::test_block_sizes_frozen_and_hashable",),
}
# Seconds an alone test needs: its process's start (jax, the CUDA
# context), its compile and its run. At b85705a one was started with 11 s
# (the step's time split evenly) and stopped while it compiled.
ALONE_NEED_S = {False: 60, True: 15}


def step_checks(ctx: Context, timeout: float) -> dict[str, Any]:
  deadline = time.monotonic() + timeout
  alone = ALONE_TESTS[ctx.dry_run]
  need = ALONE_NEED_S[ctx.dry_run]
  # The x64 and float32 tests get all but the alone tests' need (at least
  # half the step).
  start = time.monotonic()
  checks = max(timeout - need * len(alone), timeout / 2)
  parts = {"x64_float32": {
      **run_tests(ctx, "checks", checks, CHECK_TESTS[ctx.dry_run]),
      "duration_s": round(time.monotonic() - start, 1)}}
  ctx.progress({"parts": dict(parts)})
  serial = dataclasses.replace(ctx, workers=0)
  for i, test in enumerate(alone):
    left = deadline - time.monotonic()
    if left < need:
      parts[f"alone_{i}"] = {
        "status": "skipped", "test": test,
        "reason": f"out of time ({max(left, 0):.0f} s left of the {need} s "
                  "it needs)"}
      continue
    tests = Tests(files=files_of([test]),
                  implementations=_KERNEL_IMPLEMENTATIONS, patterns=(test,))
    # Its need, and what the later ones' needs leave.
    share = max(need, left - need * (len(alone) - i - 1))
    run = dataclasses.replace(serial, test_timeout=share)
    start = time.monotonic()
    parts[f"alone_{i}"] = {**run_tests(run, f"alone_{i}", share, tests),
                           "test": test,
                           "duration_s": round(time.monotonic() - start, 1)}
    ctx.progress({"parts": dict(parts)})
  failed = [f"{n}: {p['reason']}" for n, p in parts.items()
            if p["status"] == "failed"]
  return {"parts": parts, "status": "failed" if failed else "ok",
          "reason": "; ".join(failed)}


# ---------------------------------------------------------------------------
# Benchmarks (bench, decode, and extra's other head dims)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchRun:
  """One scripts/benchmark.py process of a step: one implementation, with
  the variants of it that are compared in the same process.

  Attributes:
    label: names the run and its log.
    need_s: the seconds it needs for all its cells (the last window's
      phases, with a margin): its timeout when the step's time is short
      (`run_share`).
    essential: the runs before it keep its `need_s` for it (the step's
      runs answer the window's questions first); a run that is not (after
      every essential one) gets what they leave.
    impls: pallas_fa implementations (`--impls` entries: NAME or
      NAME:FIELD=VALUE, a variant of its tiling); empty for a peer's run.
    peers: the peers (`--peers`); empty for none.
    head_dims: H values.
    seq_lens: T = S values, in the order they run.
    causal: "both", "true" or "false".
    modes: of `--modes`.
    matmul_size: of the matmul ceiling (0: none; one run measures it).
    dtype: `--dtype`, after the step's flags (absl keeps a flag's last
      value), or None for theirs.
  """

  label: str
  need_s: float
  essential: bool = True
  impls: tuple[str, ...] = ()
  peers: tuple[str, ...] = ()
  head_dims: tuple[int, ...]
  seq_lens: tuple[int, ...]
  causal: str = "both"
  modes: tuple[str, ...] = ("fwd", "fwd_bwd")
  matmul_size: int = 0
  dtype: str | None = None

  def args(self) -> list[str]:
    join = lambda values: ",".join(map(str, values))  # noqa: E731
    return [
      f"--impls={join(self.impls)}",
      f"--peers={join(self.peers) or 'none'}",
      f"--head_dim={join(self.head_dims)}",
      f"--seq_lens={join(self.seq_lens)}",
      f"--causal={self.causal}",
      f"--modes={join(self.modes)}",
      f"--matmul_size={self.matmul_size}",
      *([f"--dtype={self.dtype}"] if self.dtype else []),
    ]


def run_share(runs: Sequence[BenchRun], i: int, left: float) -> float:
  """The timeout of `runs[i]`, started with `left` seconds of its step's
  time: its need (or all that is left, if less), and more when the later
  runs' needs leave more. An essential run keeps the needs of the
  essential runs after it, a run that is not those of every run after it:
  so the runs that answer the window's questions get their time first,
  and one that overruns its need costs the later ones that are not
  essential.

  Args:
    runs: a step's runs, in order.
    i: which one.
    left: seconds until the step's deadline.
  """
  run = runs[i]
  kept = sum(r.need_s for r in runs[i + 1:]
             if r.essential or not run.essential)
  return max(min(run.need_s, left), left - kept)


# By --dry-run: the flags every benchmark run shares, the headline's runs
# (bench) and the other head dims' (extra). The headline: H = 128, T in
# {4096, 16384}, causal and not, fwd and fwd+bwd, bf16, the FlashAttention
# protocol (B*T = 16k tokens, N*H = 2048). T = 16384 (the published peers'
# headline) first: a run stopped at its share keeps the cells it finished.
# Each implementation runs in a process of its own (a crash loses one
# column, not the table), with the variants that are compared against it in
# the same process: mosaic_gpu's split and fused backward (the backward
# alone is fwd_bwd less fwd, `report.summarise_bench`). cuDNN comes second:
# every ratio is taken against it; its process also measures the matmul
# ceiling (7 s at b85705a, off the first run's time). Every run checks each
# cell before timing it, at the first and last `--check_rows` query (and
# key) rows, against a reference that the first run to need a shape
# computes and the others read back (`--reference_dir`, a scratch folder of
# the step): the first GPU window lost most of each process's share before
# its first cell.
# The float8 forwards (e4m3 query/key/value quantized per head, bf16 result)
# of mosaic_gpu and triton, each in a process of its own like the others,
# on the forward cells of the headline: their columns ('<impl>+e4m3') carry
# the speed-up against cuDNN's bf16 cells, cuDNN's FP8 ones and their own
# bf16 ones.
# Each run's need is from the phases b85705a timed (in seconds: a process's
# start 1-2, each shape's inputs 2-5 and reference 3-4 where no earlier
# process left it, each cell's compile 1-8, its check and timing about 1):
# mosaic_gpu's 14 of 16 cells took 79 s (7 of them the matmul probe), its
# two lost causal fwd+bwd cells at T = 4096 compiled in 8.3 and 6.4 s in a
# later process; cuDNN's 8 cells 20 s; the float8 forwards' first cells
# 8-15 s. The essential runs need 182 s of the bench step's 265 (the
# float8 one times the default and its consumers without ping-pong;
# the split backward, measured in two windows, is no longer one of them);
# those after them, in what is left: the float8 forward's variants
# (T = 16384), the fused backward's variants on the cells
# b85705a lost (T = 16384, causal, fwd+bwd; their forward is the fused
# default's), the one forward variant that matched cuDNN at T = 16384
# (full) on the causal cells, and triton's bf16 cells at T = 4096 (b85705a
# measured its T = 16384 ones). Dropped after b85705a: JAX's Pallas mha
# (all its cells measured), the head-section sweep (measured apart: 2:
# 582, 8: 567, the default 571 TFLOP/s), the other forward variants and
# mosaic_gpu's float8 pipelined key loop (measured at T = 16384, full: all
# slower than the default).
# The dry run: chunked stands for our implementations (a block size for a
# variant, float8 for the float8 runs), xla for the peers; float32 on a
# CPU, tiny.
_BENCH_COMMON = ("--warmup=1", "--noisolate")
BENCH_FLAGS = {
  False: ("--grid=fa", "--dtype=bfloat16", "--repeats=5", *_BENCH_COMMON),
  True: (
    *("--grid=cpu", "--dtype=float32", "--repeats=2", *_BENCH_COMMON),
    *("--batch=1", "--heads=2", "--check_rows=32"),
  ),
}
_T = (16384, 4096)
FP8 = "float8_e4m3fn"
# Tile variants, each timed beside the path it would replace in the same
# process (predictions.md gives each one's expected rate and what it
# tells). Every one compiles for sm_90a without a spill at H = 128. The
# fused backward: dQ split by keys (each consumer reduce-adds its own keys'
# partial: no dS exchange and no lockstep, at twice the reduce-add bytes),
# one consumer warpgroup (is it bound by the overlap of the two consumers'
# softmax/dS chains, or by memory?), and a head section of 4 (dQ
# accumulators of fewer heads in L2 at once).
FUSED_VARIANTS = (
  "mosaic_gpu:backward=fused:dq_split=keys",
  "mosaic_gpu:backward=fused:num_consumers_dkv=1",
  "mosaic_gpu:backward=fused:head_section=4",
)
# The fused backward's step orders (predictions.md sections 8 and 9): each
# step's dQ issued ahead of the next step's S^T (`fused_pipeline`), the
# default of full calls since 07213ac measured it 1.057x the in-step order,
# against that order, full and causal (whose default it is not yet); and
# the softmax under dP^T's and dV's products (`fused_softmax_overlap`,
# FlashAttention-3's order) on top of each call's default: with the
# pipeline in a full call, dQ in the step in a causal one.
FUSED_STEP_VARIANTS = (
  "mosaic_gpu:backward=fused:fused_pipeline=false",
  "mosaic_gpu:backward=fused:fused_pipeline=true",
  "mosaic_gpu:backward=fused:fused_softmax_overlap=true",
)
# The forward: the software-pipelined key loop (`intra_overlap`: P V of a
# tile in flight under the next tile's softmax) without ping-pong, 600
# TFLOP/s at T = 16384 (full) at b85705a against the default's 593.
FORWARD_VARIANTS = ("mosaic_gpu:intra_overlap=true:pingpong=false",)
# The bf16 forward's 192-key tiles in two stages (each iteration's fixed
# cost spread over 1.5x the keys): 1.02x full at 07213ac, and causal 0.51x
# there, when a padded last key tile made every unit stream every tile
# (fixed since: `masking.classify_blocks` leaves padding out).
WIDE_KEYS = "mosaic_gpu:block_kv=192:num_stages=2"
# The float8 forward's tiles: 256 keys in two stages, the default of full
# calls at H <= 128 since 07213ac measured 1.086x, against the 128-key
# four-stage ring they replaced, full and causal (whose default is still
# 128 keys).
FP8_WIDE_KEYS = "mosaic_gpu:block_kv=256:num_stages=2"
FP8_NARROW_KEYS = "mosaic_gpu:block_kv=128:num_stages=4"
# The float8 forward's two consumers without ping-pong: each one's softmax
# (about 1,500-1,600 clocks a 256-key tile, fitted to 07213ac) outlasts
# the other's two float8 products (about 1,430), so taking turns on the
# tensor cores serialises the two softmaxes (predictions.md section 9,
# its last block); in the essential float8 run,
# in place of the multiply-first loop that b85705a and 07213ac timed
# against the exponent fold (1.05x and 1.04x).
FP8_FREE = "mosaic_gpu:pingpong=false"
# Free-running consumers with the software-pipelined loop (each one's P V
# under its own next softmax), at the 128-key tiles where that loop fits
# its registers (at 256 keys it spills).
FP8_FREE_OVERLAP = ("mosaic_gpu:block_kv=128:num_stages=4:"
                    "intra_overlap=true:pingpong=false")
# triton's forward at the 64-key tiles it had on Hopper before b85705a's
# run measured 128 (its default since).
TRITON_VARIANTS = ("triton:block_kv=64",)
BENCH_RUNS = {
  False: (
    BenchRun(label="mosaic_gpu", need_s=60,
             impls=("mosaic_gpu:backward=fused",),
             head_dims=(128,), seq_lens=_T),
    BenchRun(label="cudnn", need_s=34, peers=("cudnn",),
             head_dims=(128,), seq_lens=_T, matmul_size=8192),
    BenchRun(label="mosaic_gpu_fp8", need_s=44,
             impls=("mosaic_gpu", FP8_FREE),
             dtype=FP8, head_dims=(128,), seq_lens=_T, modes=("fwd",)),
    # cuDNN's FP8 forward (per-tensor scales): the float8 rows' FP8 peer.
    BenchRun(label="cudnn_fp8", need_s=44, peers=("cudnn_fp8",),
             dtype=FP8, head_dims=(128,), seq_lens=_T, modes=("fwd",)),
    # The fused backward's step orders beside the default (T = 16384,
    # full and causal): the backward is the headline furthest behind
    # cuDNN.
    BenchRun(label="mosaic_gpu_fused_step", need_s=52, essential=False,
             impls=("mosaic_gpu:backward=fused", *FUSED_STEP_VARIANTS),
             head_dims=(128,), seq_lens=(16384,), modes=("fwd_bwd",)),
    # The float8 forward's 256-key tiles against the 128-key ring they
    # replaced (T = 16384, full and causal), and the free-running
    # pipelined loop at 128 keys, in their own process.
    BenchRun(label="mosaic_gpu_fp8_tiles", need_s=32, essential=False,
             impls=("mosaic_gpu", FP8_NARROW_KEYS, FP8_WIDE_KEYS,
                    FP8_FREE_OVERLAP),
             dtype=FP8, head_dims=(128,), seq_lens=(16384,), modes=("fwd",)),
    # The causal forward: the pipelined loop without ping-pong, and
    # 192-key tiles (which fit since default positions are made from
    # indices, not stored).
    BenchRun(label="mosaic_gpu_forward_tiles", need_s=32, essential=False,
             impls=("mosaic_gpu", *FORWARD_VARIANTS, WIDE_KEYS),
             head_dims=(128,), seq_lens=_T, causal="true", modes=("fwd",)),
    # The triton forward's new tiles against its old ones, then JAX's
    # Pallas mha beside them (issue 47's 1.1x).
    BenchRun(label="triton", need_s=30, essential=False,
             impls=("triton", *TRITON_VARIANTS),
             head_dims=(128,), seq_lens=_T, modes=("fwd",)),
    BenchRun(label="pallas_mha", need_s=18, essential=False,
             peers=("pallas_mha",), head_dims=(128,), seq_lens=(16384,),
             modes=("fwd",)),
    # The reproducible split backward (1.08-1.11x slower than the fused
    # one in two windows; its dQ kernel lost its per-element scale too).
    BenchRun(label="mosaic_gpu_split", need_s=24, essential=False,
             impls=("mosaic_gpu:backward=split",), head_dims=(128,),
             seq_lens=(16384,), modes=("fwd_bwd",)),
    BenchRun(label="mosaic_gpu_fused_tiles", need_s=36, essential=False,
             impls=("mosaic_gpu:backward=fused", *FUSED_VARIANTS),
             head_dims=(128,), seq_lens=(16384,), causal="true",
             modes=("fwd_bwd",)),
    # triton's float8 forward: its products take float16 operands (jax's
    # Pallas Triton lowering has no float8 wgmma). Its inputs widened to
    # float16 in XLA (the default on Hopper from T = 1024) beside the
    # kernel's own conversion of each tile, which b85705a timed at 0.64x
    # triton bf16 (predictions.md section 7).
    BenchRun(label="triton_fp8", need_s=40, essential=False,
             impls=("triton", "triton:widen_float8=false"), dtype=FP8,
             head_dims=(128,), seq_lens=_T, modes=("fwd",)),
  ),
  True: (
    BenchRun(label="chunked", need_s=25,
             impls=("chunked", "chunked:block_q_bwd=64"),
             head_dims=(16,), seq_lens=(128, 256), matmul_size=128),
    BenchRun(label="xla", need_s=8, peers=("xla",),
             head_dims=(16,), seq_lens=(128,)),
    BenchRun(label="chunked_fp8", need_s=8,
             impls=("chunked", "chunked+negated_query"),
             dtype=FP8, head_dims=(16,), seq_lens=(128,), modes=("fwd",)),
    BenchRun(label="chunked_tiles", need_s=8, essential=False,
             impls=("chunked", "chunked:block_kv=64"),
             head_dims=(16,), seq_lens=(256,), causal="true",
             modes=("fwd",)),
  ),
}  # fmt: skip
# The extra step's: whatever its share allows, in this order.
OTHER_BENCH_RUNS = {
  False: (
    BenchRun(label="xla", need_s=15, essential=False, peers=("xla",),
             head_dims=(128,), seq_lens=(4096,)),
    BenchRun(label="mosaic_gpu_h64_h256", need_s=70, essential=False,
             impls=("mosaic_gpu",), head_dims=(64, 256), seq_lens=_T),
    BenchRun(label="triton_h64_h256", need_s=60, essential=False,
             impls=("triton",), head_dims=(64, 256), seq_lens=_T),
    BenchRun(label="cudnn_h64_h256", need_s=40, essential=False,
             peers=("cudnn",), head_dims=(64, 256), seq_lens=_T),
  ),
  True: (
    BenchRun(label="chunked_h32", need_s=10, impls=("chunked",),
             head_dims=(32,), seq_lens=(128,)),
  ),
}  # fmt: skip


def run_benchmarks(
  ctx: Context, timeout: float, runs: Sequence[BenchRun]
) -> dict[str, Any]:
  """Runs scripts/benchmark.py once per run of `runs`, each within its
  share of `timeout` (a run may use what the ones before it left), all
  merging their cells into bench.json and bench.md under ctx.out.

  Args:
    ctx: the run's context.
    timeout: seconds for all of `runs`.
    runs: the processes, in order.

  Returns:
    The record: each run's status, the headline of the table's rows at the
    runs' head dims (`report.summarise_bench`), status and reason. Only our
    implementations' failures fail it; a peer's are warnings.
  """
  # The shared references: outside ctx.work, which the bundle packs.
  references = pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_references_"))
  try:
    return _run_benchmarks(ctx, timeout, runs, references)
  finally:
    shutil.rmtree(references, ignore_errors=True)


def _run_benchmarks(
  ctx: Context,
  timeout: float,
  runs: Sequence[BenchRun],
  references: pathlib.Path,
) -> dict[str, Any]:
  deadline = time.monotonic() + timeout
  json_path = ctx.out / plan.BENCH_JSON
  common = (*BENCH_FLAGS[ctx.dry_run], f"--reference_dir={references}")
  head_dims = {h for run in runs for h in run.head_dims}
  done, failures, warnings = [], [], []
  folders = {
    str(ctx.out): "$OUT",
    str(ctx.work): "$WORK",
    str(references): "$REFERENCES",
  }

  def record_so_far() -> dict[str, Any]:
    bench = _read_json(json_path)
    return {
      "runs": list(done),
      "warnings": list(warnings),
      "bench": report.summarise_bench(bench, head_dims) if bench else None,
    }

  for i, run in enumerate(runs):
    share = run_share(runs, i, deadline - time.monotonic())
    log = ctx.work / f"bench_{run.label}.log"
    cmd = [
      sys.executable,
      str(BENCHMARK),
      *common,
      *run.args(),
      f"--json={json_path}",
      f"--markdown={ctx.out / plan.BENCH_MD}",
      "--merge",
    ]
    if share < MIN_STEP_S:
      entry = {"label": run.label, "status": "skipped", "reason": "out of time"}
    else:
      proc = runner.run_logged(
        cmd,
        log_path=log,
        timeout=share,
        env=runner.child_env(),
        on_wait=lambda: ctx.progress(record_so_far()),
      )
      problem = _proc_problem(proc, share, log)
      entry = {
        "label": run.label,
        "command": runner.shown(cmd, folders),
        "status": "failed" if problem else "ok",
        "reason": problem,
        "duration_s": round(proc.duration_s, 1),
        "timeout_s": round(share, 1),
        "timed_out": proc.timed_out,
      }
    done.append(entry)
    # A peer's failure, and an inessential run's lack of time, are
    # warnings (its wrong cells are problems all the same, below).
    out_of_time = entry["status"] == "skipped" or entry.get("timed_out")
    if entry["status"] != "ok":
      serious = bool(run.impls) and (run.essential or not out_of_time)
      (failures if serious else warnings).append(
        f"{run.label}: {entry['reason']}"
      )
  record = record_so_far()
  bench = record["bench"] or {}
  failures += bench.get("problems") or []
  if failures:
    return {**record, "status": "failed", "reason": "; ".join(failures)}
  if not any(row["rate"] for row in bench.get("rows") or ()):
    return {**record, "status": "failed", "reason": "no cell was measured"}
  return {**record, "status": "ok", "reason": ""}


def step_bench(ctx: Context, timeout: float) -> dict[str, Any]:
  # A fresh table: the extra step's cells are merged into it later.
  for name in (plan.BENCH_JSON, plan.BENCH_MD):
    (ctx.out / name).unlink(missing_ok=True)
  return run_benchmarks(ctx, timeout, BENCH_RUNS[ctx.dry_run])


# By --dry-run: triton decode_attention at the GQA shape of a large model's
# decoding, with the library's split of the key axis and a fixed one of
# DECODE_SPLITS (by default 33 and 4 splits at B = 1 and 8 on a 132-SM
# GPU, 264 and 256 programs; 64 is about twice B = 1's and gives B = 8
# 4096 programs, a finer tail); the plain flash_attention call is each
# cell's reference, but not timed (the first window measured it: 4.6-4.9x
# slower). Each call is timed DECODE_CALLS to a jitted program, and one to
# a program beside it: the B = 1 call took 47.3, 51.2 and 68.5 us timed
# one to a program in three processes (ff8094b, b85705a twice: the host's
# dispatch) and 37.8 us a call in a program of 20 (b85705a's cache forms).
# The dry run's chunked one, tiny, with the plain call timed, two calls to
# a program.
DECODE_SPLITS = 64
DECODE_CALLS = 20
DECODE_FLAGS = {
  False: (
    "--implementations=triton", "--peers=none",
    f"--num_splits=default,{DECODE_SPLITS}", "--batch=1,8",
    "--seq_lens=32768", "--kv_heads=8", "--heads=32", "--head_dims=128",
    "--new_tokens=1", "--dtype=bfloat16", "--max_cache_gib=4",
    "--repeats=10", f"--calls_per_program={DECODE_CALLS}",
  ),
  True: (
    "--implementations=chunked", "--peers=flash_attention",
    "--num_splits=default,2", "--batch=1,2", "--seq_lens=256",
    "--kv_heads=2", "--heads=4", "--head_dims=16", "--new_tokens=1",
    "--dtype=float32", "--repeats=2", "--calls_per_program=2",
  ),
}  # fmt: skip


# By --dry-run: the cache forms (`bench.decode_forms`), each checked
# against its plain equivalent, with bf16 queries, in this order: triton's
# quantized caches (and the bfloat16 cache through mosaic_gpu's split
# kernel, contiguous, as pages of 16 and int8 with one and two consumer
# warpgroups and in 128-key blocks, and the float8 cache's four), the
# latent cache (and through mosaic_gpu's kernel, contiguous and paged),
# the shared prefix (its one-warpgroup prefix pass against the 8 warps it
# replaced, the folded path before that, and both parts through
# mosaic_gpu), T_new = 16 (64 query rows a K/V head: one warpgroup a
# program over an int8 cache against 8 warps; mosaic_gpu's), paged; the
# dry run's chunked latent cell. A form's rows are written when the form
# ends (its cells are timed in turns), so one cut short is lost whole: the
# forms go in the order of what they answer, the 1-byte caches and the
# Mosaic GPU decode kernel first. At 07213ac a cell took 3.3-4.2 s (dtype
# 12 cells in 48 s, latent 7 in 29 s, prefix 6 in 20 s); the forms now
# hold 14, 5, 10, 5 and 3 cells, about 140 s, of which the first three
# (about 115 s) fit the forms' share; the settled cells have left
# (`bench.decode_forms`'s doc).
DECODE_FORMS = {
  False: ("dtype", "latent", "prefix", "tnew", "paged"),
  True: ("latent",),
}
DECODE_FORMS_FLAGS = {
  False: ("--implementations=triton", "--repeats=10"),
  True: ("--implementations=chunked", "--repeats=2"),
}  # fmt: skip
# The seconds the cache forms (with the process's start) and the grid need
# (b85705a: 87 s and 31 s): the forms run first, with their need and what
# the grid's least leaves; the grid gets the rest. The grid writes its
# JSON after every cell (bf16, B = 1 with the default splits first), so
# its least is one cell's time, where a form cut short is lost whole.
DECODE_NEED_S = {False: {"forms": 115, "grid": 20},
                 True: {"forms": 15, "grid": 15}}


def step_decode(ctx: Context, timeout: float) -> dict[str, Any]:
  deadline = time.monotonic() + timeout
  need = DECODE_NEED_S[ctx.dry_run]
  forms = _decode_forms(ctx, max(min(need["forms"], timeout),
                                 timeout - need["grid"]))
  ctx.progress({"forms": forms})
  grid = _decode_grid(ctx, deadline - time.monotonic())
  problem = "; ".join(f"{part}: {reason}" for part, reason in (
    ("cache forms", forms["reason"]), ("grid", grid.pop("reason")))
    if reason)
  return {**grid, "forms": forms,
          "status": "failed" if problem else "ok", "reason": problem}


def _decode_forms(ctx: Context, timeout: float) -> dict[str, Any]:
  """The cache forms' cells (`DECODE_FORMS`, in order) within `timeout`;
  the reason names the forms that were not measured."""
  path = ctx.out / plan.DECODE_FORMS_JSON
  path.unlink(missing_ok=True)
  wanted = DECODE_FORMS[ctx.dry_run]
  if timeout < MIN_STEP_S:
    return {"status": "failed", "rows": [], "reason": "out of time; not "
            f"measured: {', '.join(wanted)}"}
  log = ctx.work / "decode_forms.log"
  cmd = [sys.executable, str(DECODE_BENCHMARK),
         *DECODE_FORMS_FLAGS[ctx.dry_run],
         f"--cache_forms={','.join(wanted)}", f"--json={path}"]
  proc = runner.run_logged(cmd, log_path=log, timeout=timeout,
                           env=runner.child_env())
  forms = _read_json(path) or {}
  rows = [{k: r.get(k) for k in ("form", "impl", "status", "ms", "reason")}
          for r in forms.get("rows") or []]
  bad = [f"{r['form']} {r['impl']}: {r['status']} {r['reason']}"
         for r in rows if r["status"] != "ok"]
  measured = {r["form"] for r in rows}
  lost = [form for form in wanted if form not in measured]
  problem = "; ".join(filter(None, [
    _proc_problem(proc, timeout, log),
    f"not measured: {', '.join(lost)}" if lost else "", *bad]))
  return {"command": ctx.shown(cmd), "rows": rows,
          "ratios": forms.get("ratios"), **_proc_fields(proc),
          "status": "failed" if problem else "ok", "reason": problem}


def _decode_grid(ctx: Context, timeout: float) -> dict[str, Any]:
  path = ctx.out / plan.DECODE_JSON
  path.unlink(missing_ok=True)
  log = ctx.work / "decode.log"
  cmd = [
    sys.executable,
    str(DECODE_BENCHMARK),
    *DECODE_FLAGS[ctx.dry_run],
    f"--json={path}",
  ]

  def record_so_far() -> dict[str, Any]:
    decode = _read_json(path)
    return {
      "command": ctx.shown(cmd),
      "decode": report.summarise_decode(decode) if decode else None,
    }

  if timeout < MIN_STEP_S:
    return {**record_so_far(), "reason": "out of time after the cache forms"}
  proc = runner.run_logged(
    cmd,
    log_path=log,
    timeout=timeout,
    env=runner.child_env(),
    on_wait=lambda: ctx.progress(record_so_far()),
  )
  record = {**record_so_far(), **_proc_fields(proc)}
  rows = (record["decode"] or {}).get("rows") or []
  bad = [
    f"{r['impl']} B={r['B']}: {r['status']} {r['reason']}"
    for r in rows
    if r["status"] != "ok"
  ]
  problem = "; ".join(filter(None, [_proc_problem(proc, timeout, log), *bad]))
  if not problem and not rows:
    problem = "no decode cell was measured"
  return {**record, "reason": problem}


# ---------------------------------------------------------------------------
# extra: with the time the others leave


# argparse's exit status is 2 as well: a usage error is a failure.
_USAGE_ERROR = re.compile(r"^usage: |: error: ", re.MULTILINE)


def step_compile(ctx: Context, timeout: float) -> dict[str, Any]:
  """The on-device compile report (scripts/compile_check.py)."""
  plugin = runner.cuda_plugin()
  if ctx.dry_run and plugin is None:
    return {
      "status": "skipped",
      "reason": "no CUDA plugin (none of "
      f"{', '.join(runner.CUDA_PLUGINS)} importable)",
    }
  path = ctx.work / "compile_check.json"
  log = ctx.work / "compile_check.log"
  if ctx.dry_run:
    # Deviceless, as compile_check.py documents: no CUDA backend is started.
    # One case per backend (--quick's 12 take over a minute on 2 cores).
    args = [
      "--target=h100",
      "--backends=triton,mosaic_gpu",
      "--head-dims=64",
      "--variants=plain",
      "--dtypes=bfloat16",
    ]
    env = runner.child_env(JAX_PLATFORMS="cpu")
  else:
    # H 64/128/256, plain and causal, bf16, on this GPU: the registers,
    # spills and shared memory that CI's deviceless check predicts.
    args = ["--target=local", "--quick"]
    env = runner.child_env()
  cmd = [sys.executable, str(COMPILE_CHECK), *args, f"--json={path}"]
  proc = runner.run_logged(cmd, log_path=log, timeout=timeout, env=env)
  record = {"command": ctx.shown(cmd), **_proc_fields(proc)}
  result = _read_json(path)
  if result is not None:
    record.update(report.summarise_compile(result))
  if proc.timed_out:
    return {
      **record,
      "status": "failed",
      "reason": f"timed out after {timeout:.0f} s",
    }
  if proc.returncode == 0:
    return {**record, "status": "ok", "reason": ""}
  if proc.returncode == 2 and not _USAGE_ERROR.search(
    log.read_text(errors="replace")
  ):
    return {
      **record,
      "status": "skipped",
      "reason": f"cannot run here (exit 2): {runner.log_tail(log, 1)}",
    }
  what = (
    "compile problems"
    if proc.returncode == 1
    else f"exit status {proc.returncode}"
  )
  return {
    **record,
    "status": "failed",
    "reason": f"{what}: {runner.log_tail(log, 2)}",
  }


def _other_tests(ctx: Context, timeout: float) -> dict[str, Any]:
  return run_tests(ctx, "other", timeout, OTHER_TESTS[ctx.dry_run])


def _other_head_dims(ctx: Context, timeout: float) -> dict[str, Any]:
  return run_benchmarks(ctx, timeout, OTHER_BENCH_RUNS[ctx.dry_run])


# End to end: training tokens/s of the default model (scripts/train.py
# --benchmark_steps) at a long context, one process an attention
# implementation (ours, and the baselines cuDNN and XLA through jax.nn,
# `models.layers.BASELINES`), each with an equal share of the part's time.
# pystdlib: Python's own sources, read locally.
TRAIN_RUNS = {
  False: (("mosaic_gpu", "cudnn", "xla"),
          ("--task=pystdlib", "--seq_len=4096", "--batch_size=8",
           "--dtype=bfloat16", "--benchmark_steps=10")),
  True: (("chunked", "xla"), ("--task=sort", "--batch_size=2",
                              "--benchmark_steps=2")),
}
_TOKENS_PER_S = re.compile(r'^\{.*"tokens_per_s".*\}$', re.M)


def _train(ctx: Context, timeout: float) -> dict[str, Any]:
  """`TRAIN_RUNS`: {"rows": [{"attention_impl", "tokens_per_s", ...}]},
  each run's training tokens/s (its printed JSON line) or why it has
  none."""
  deadline = time.monotonic() + timeout
  impls, flags = TRAIN_RUNS[ctx.dry_run]
  rows = []
  for i, impl in enumerate(impls):
    share = (deadline - time.monotonic()) / (len(impls) - i)
    if share < MIN_PART_S[ctx.dry_run]:
      rows.append({"attention_impl": impl, "status": "skipped",
                   "reason": "out of time"})
      continue
    log = ctx.work / f"train_{impl}.log"
    cmd = [sys.executable, str(TRAIN), *flags, f"--attention_impl={impl}"]
    proc = runner.run_logged(cmd, log_path=log, timeout=share,
                             env=runner.child_env())
    found = _TOKENS_PER_S.findall(log.read_text(errors="replace"))
    problem = _proc_problem(proc, share, log)
    rows.append({
      "command": ctx.shown(cmd),
      **(json.loads(found[-1]) if found else {"attention_impl": impl}),
      "status": "failed" if problem or not found else "ok",
      "reason": problem or ("" if found else "no tokens/s printed"),
    })
    ctx.progress({"rows": rows})
  failed = [f"{r['attention_impl']}: {r['reason']}" for r in rows
            if r["status"] == "failed"]
  if failed:
    return {"rows": rows, "status": "failed", "reason": "; ".join(failed)}
  if all(r["status"] == "skipped" for r in rows):
    return {"rows": rows, "status": "skipped", "reason": "out of time"}
  return {"rows": rows, "status": "ok", "reason": ""}


# The extra step's parts in order, with their relative shares.
EXTRA_PARTS = (
  ("train", 6, _train),
  ("tests", 3, _other_tests),
  ("bench", 2, _other_head_dims),
  ("compile", 1, step_compile),
)


def step_extra(ctx: Context, timeout: float) -> dict[str, Any]:
  deadline = time.monotonic() + timeout
  parts: dict[str, dict[str, Any]] = {}
  for i, (name, weight, run) in enumerate(EXTRA_PARTS):
    left = deadline - time.monotonic()
    share = left * weight / sum(p[1] for p in EXTRA_PARTS[i:])
    if share < MIN_PART_S[ctx.dry_run]:
      parts[name] = {"status": "skipped", "reason": "out of time"}
      continue
    start = time.monotonic()
    step_ctx = dataclasses.replace(
      ctx,
      progress=lambda r, name=name: ctx.progress(
        {"parts": {**parts, name: {**r, "status": "running"}}}
      ),
    )
    parts[name] = {
      **run(step_ctx, share),
      "duration_s": round(time.monotonic() - start, 1),
      "timeout_s": round(share, 1),
    }
    ctx.progress({"parts": dict(parts)})
  failed = [
    f"{n}: {p['reason']}" for n, p in parts.items() if p["status"] == "failed"
  ]
  ran = [n for n, p in parts.items() if p["status"] != "skipped"]
  if failed:
    return {"parts": parts, "status": "failed", "reason": "; ".join(failed)}
  if not ran:
    return {"parts": parts, "status": "skipped", "reason": "out of time"}
  return {"parts": parts, "status": "ok", "reason": ""}


RUNNERS = {
  "env": step_env,
  "bench": step_bench,
  "decode": step_decode,
  "kernels": step_kernels,
  "checks": step_checks,
  "extra": step_extra,
}
