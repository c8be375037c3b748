"""The plan of scripts/gpu_check.py: its steps in run order, each step's
share of the budget, the two calls of a GPU window, and every file a run
may write under --out.

A GPU machine is lent for 15 minutes in all (its start, every command and
idle time count) and one command runs at most 10 minutes, of which 8 files
come back. A window is two calls, each a prepared command:

* speed (`--call=speed`, 420 s under a 450 s limit): the questions that
  decide the next kernel work, every T = 16384 and 4096 cell of the
  implementations, their variants and the peers, then decode;
* correctness (`--call=correctness`, 250 s under a 280 s limit): the
  compiled kernel tests (those the last window did not finish first), the
  x64 and float32 (precision="highest") checks of every backend, and the
  tests that crashed a pytest-xdist worker in the last window, each alone
  in its own process.

The second runs straight after the first while the machine is still warm
(a fresh start costs a minute or more of the 15), so it does not depend on
the first's results.

The shares: `env` took 4 s in each window, and what a step leaves goes to
the next. `bench` runs one process per implementation (about 100 cells);
the first H200 window's showed each spending 10 s before its first cell
and 1-8 s per cell, and its reference check 35 s of one process's 79 s
(now compiled without autotuning). `decode` took 29 s for the grid's six
cells; the cache forms get the rest. `kernels` finished 298 of 619 tests
in 155 s with 8 workers. `extra` runs only when named in --steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Sequence

# The margin between a call's budget and the time limit of the command that
# runs it on a GPU machine: Python's start, the last flush of the files and
# the stopping of a step's processes.
MARGIN_S = 30
DRY_RUN_BUDGET_S = 240

# The files under --out, all at its top level (a lent machine returns at
# most 8 files, at most 2 folders deep).
SUMMARY = "summary.json"
BUNDLE = "bundle.tgz"
JUNIT = "junit.xml"
BENCH_JSON = "bench.json"
BENCH_MD = "bench.md"
DECODE_JSON = "decode.json"
DECODE_FORMS_JSON = "decode_forms.json"
FILES = (SUMMARY, BUNDLE, JUNIT, BENCH_JSON, BENCH_MD, DECODE_JSON,
         DECODE_FORMS_JSON)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
  """One step of the plan.

  Attributes:
    name: the --steps name.
    budget_s: its share of a call's budget on a GPU; a step may also use what
      the steps before it left unused, never the later steps' shares.
    dry_run_budget_s: the same for --dry-run.
    files: the files under --out it writes (besides the summary and the
      bundle, which every step rewrites).
    what: what it runs, for --plan.
  """

  name: str
  budget_s: float
  dry_run_budget_s: float
  files: tuple[str, ...]
  what: str


_ENV = Step(
  name="env",
  budget_s=15,
  dry_run_budget_s=30,
  files=(),
  what="versions (python, jax, jaxlib, CUDA plugin, CUDA runtime, "
  "cuDNN, ptxas), nvidia-smi, jax.devices(), PALLAS_FA_COMMIT "
  "and the source hash",
)
_BENCH = Step(
  name="bench",
  budget_s=300,
  dry_run_budget_s=60,
  files=(BENCH_JSON, BENCH_MD),
  what="bf16, H = 128, T in (16384, 4096), causal and not, fwd and "
  "fwd+bwd (and the backward alone, their difference), each "
  "implementation in its own process, in this order: mosaic_gpu with "
  "the split and the fused backward (MosaicGpuBlockSizes(backward="
  "'fused')), cuDNN through jax.nn, the fused backward's tile variants "
  "(fwd+bwd), the forward's tile variants (fwd), triton, JAX's Pallas "
  "mha, the float8 forwards of mosaic_gpu and triton (e4m3 inputs "
  "quantized per head, fwd, their speed-up against cuDNN's and their own "
  "bf16 cells) and cuDNN's FP8 forward (per-tensor scales, through jax's "
  "private cudnn module); then mosaic_gpu's causal forward at T = 16384 per "
  "head-section size (2, 4, 8, 16 and the default) in one process. Each "
  "cell checked "
  "first on its first and last 256 rows against a reference computed "
  "once per shape (compiled without autotuning) and read back by the "
  "later processes; a timestamp per phase; the JSON and Markdown "
  "rewritten after every cell",
)
_DECODE = Step(
  name="decode",
  budget_s=105,
  dry_run_budget_s=30,
  files=(DECODE_JSON, DECODE_FORMS_JSON),
  what="triton decode_attention, bf16, B in {1, 8}, S = 32768, K = 8, "
  "H = 128, T_new = 1, with the default split count and 64 splits, "
  "checked against the plain flash_attention call, with the share of "
  "the measured HBM bandwidth and a timestamp per phase; then the cache "
  "forms (decode_benchmark.py --cache_forms) with bf16 queries: int8 "
  "and float8 caches against bf16, the shared prefix against the "
  "materialised concatenation, paged against contiguous, T_new = 4 "
  "against 1, the latent cache against separate K and V, the "
  "float32-query cells beside them, and both 1-byte caches with two "
  "warps a program against four",
)
_KERNELS = Step(
  name="kernels",
  budget_s=180,
  dry_run_budget_s=60,
  files=(JUNIT,),
  what="compiled correctness of every GPU kernel, the tests the last "
  "window did not finish first (its junit.xml under benchmarks/results/): "
  "the conformance suite for mosaic_gpu and triton (forward and "
  "every gradient against the reference: causal, window, "
  "segments, GQA, soft cap, bias, dropout, Hv != H, H up to "
  "256), tests/test_mosaic_gpu.py, test_triton.py, test_decode.py "
  "(the triton decode kernel, contiguous and paged), "
  "test_decode_quantized_triton.py and test_decode_latent_triton.py "
  "(its int8/float8 and latent caches), "
  "test_dropout.py and test_flex.py (score_mod/mask_mod fused "
  "into triton, score_mods into mosaic_gpu), test_fp8.py and "
  "test_mosaic_gpu_fp8.py (the float8 forwards of triton and "
  "mosaic_gpu against the float64 oracle), "
  "test_decode_prefix_latent.py (the shared prefix's one merge, the "
  "latent caches); pytest-xdist, a "
  "per-test timeout, each worker's stderr kept (a crashed worker's last "
  "lines reported), the references compiled without autotuning, "
  "--tb=short, no hypothesis shrinking",
)
_CHECKS = Step(
  name="checks",
  budget_s=55,
  dry_run_budget_s=30,
  files=(JUNIT,),
  what="every backend (mosaic_gpu, triton, xla, chunked; the decode "
  "kernels) forward and backward with jax_enable_x64 on "
  "(tests/test_x64.py), the reproducible backward rerun bitwise-equal "
  "on every backend (tests/test_determinism.py), the float32 tests at precision='highest' "
  "(test_precision.py, the conformance suite's float32 cases), then "
  "each test that crashed a worker in the last window alone in a "
  "process of its own, without pytest-xdist",
)
EXTRA = Step(
  name="extra",
  budget_s=120,
  dry_run_budget_s=60,
  files=(JUNIT, BENCH_JSON, BENCH_MD),
  what="only when named in --steps: the conformance suite for xla and "
  "chunked and other tests, XLA through jax.nn at T = 4096 and H = 64 "
  "and 256 in the benchmark, then the on-device compile report "
  "(scripts/compile_check.py)",
)
STEPS = (_ENV, _BENCH, _DECODE, _KERNELS, _CHECKS, EXTRA)
NAMES = tuple(s.name for s in STEPS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
  """One prepared command of a GPU window.

  Attributes:
    name: the --call name.
    steps: the steps it runs, in run order.
    budget_s: seconds for them (the command's limit is MARGIN_S more).
    dry_run_budget_s: the same for --dry-run.
  """

  name: str
  steps: tuple[str, ...]
  budget_s: float
  dry_run_budget_s: float


CALLS = {
  c.name: c
  for c in (
    Call(name="speed", steps=("env", "bench", "decode"), budget_s=420,
         dry_run_budget_s=120),
    Call(name="correctness", steps=("env", "kernels", "checks"),
         budget_s=250, dry_run_budget_s=120),
    # The CPU rehearsal of both calls in one process (CI's dry run).
    Call(name="all", steps=NAMES, budget_s=sum(s.budget_s for s in STEPS),
         dry_run_budget_s=DRY_RUN_BUDGET_S),
  )
}
DEFAULT_CALL = "speed"


def by_name(name: str) -> Step:
  """The step called `name`."""
  return next(s for s in STEPS if s.name == name)


def shares(
  names: Sequence[str], budget: float, dry_run: bool
) -> dict[str, float]:
  """Each chosen step's share of `budget`: its own, scaled down in
  proportion when the chosen steps' shares add up to more.

  Args:
    names: the chosen steps.
    budget: seconds for the whole run.
    dry_run: use the --dry-run shares.

  Returns:
    {name: seconds}, in run order.
  """
  own = {
    s.name: s.dry_run_budget_s if dry_run else s.budget_s
    for s in STEPS
    if s.name in names
  }
  total = sum(own.values())
  scale = min(1.0, budget / total) if total else 1.0
  return {name: value * scale for name, value in own.items()}


def reserved_after(name: str, step_shares: dict[str, float]) -> float:
  """Seconds kept for the steps after `name`: its deadline is the run's end
  less this, so it may use what earlier steps left, never the later ones'
  shares."""
  order = list(step_shares)
  return sum(step_shares[n] for n in order[order.index(name) + 1 :])


def files_for(names: Sequence[str]) -> list[str]:
  """Every file under --out that a run of steps `names` may write."""
  wanted = {SUMMARY, BUNDLE}
  for step in STEPS:
    if step.name in names:
      wanted.update(step.files)
  return [f for f in FILES if f in wanted]


def describe(
  names: Sequence[str], budget: float, dry_run: bool
) -> dict[str, Any]:
  """The plan of a run, as --plan prints it.

  Args:
    names: the chosen steps.
    budget: seconds for the whole run.
    dry_run: the --dry-run plan.

  Returns:
    {"budget_s", "time_limit_s" (of the command that runs it), "steps":
    [{"name", "budget_s", "what"}] in run order, "files": every file the
    run may write under --out}.
  """
  step_shares = shares(names, budget, dry_run)
  return {
    "budget_s": budget,
    "time_limit_s": budget + MARGIN_S,
    "steps": [
      {"name": name, "budget_s": round(seconds, 1), "what": by_name(name).what}
      for name, seconds in step_shares.items()
    ],
    "files": files_for(names),
  }


def commands(commit: str) -> dict[str, dict[str, Any]]:
  """The two commands of a 15-minute GPU window, ready to paste: the speed
  call, and the correctness call run straight after it on the warm machine.

  Args:
    commit: what PALLAS_FA_COMMIT records (the lent machine's copy of the
      working tree has no .git).

  Returns:
    {"first": {"command", "timeout_s"}, "second": {...}}: each command
    is one line for the repository root of the machine, writing into $OUT.
  """
  env = f"PALLAS_FA_COMMIT={commit} PYTHONPATH=. PYTHONUNBUFFERED=1"
  run = f'{env} python3 scripts/gpu_check.py --out="$OUT"'
  return {
    key: {"command": f"{run} --call={call}",
          "timeout_s": CALLS[call].budget_s + MARGIN_S}
    for key, call in (("first", "speed"), ("second", "correctness"))
  }


# A rerun reads the failed tests of a returned summary.json, copied to the
# repository root under this name (an untracked file travels with the
# working tree).
RERUN_SUMMARY = "gpu_summary.json"
RERUN_BUDGET_S = 150


def rerun_command(commit: str) -> str:
  """The command that reruns the tests a summary.json lists as failed."""
  env = f"PALLAS_FA_COMMIT={commit} PYTHONPATH=. PYTHONUNBUFFERED=1"
  return (f'{env} python3 scripts/gpu_check.py --out="$OUT" '
          f"--steps=env,kernels --budget={RERUN_BUDGET_S} "
          f"--only=@{RERUN_SUMMARY}")
