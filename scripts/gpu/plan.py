"""The plan of scripts/gpu_check.py: its steps in run order, each step's
share of the budget, and every file a run may write under --out.

A GPU machine is lent for 15 minutes in all (its start, every command and
idle time count) and one command runs at most 10 minutes, of which 8 files
come back. The first command therefore runs under a 480 s limit and this
plan fits 450 s, so that the answers that decide the next month of work
(is every GPU kernel correct, how fast is H = 128 against cuDNN with the
split and the fused backward, how fast is causal per head-section size,
what share of the memory bandwidth does decoding reach) come first and are
on disk whenever it is stopped.

The shares: `env` took 4 s in the first window, and what a step leaves
goes to the next, so its 20 s mostly feed `kernels`. `bench` runs five
processes (about 45 cells); the first window's showed each spending 20-25 s
before its first cell (starting, then the reference check at T = 16384,
which the later processes now read back) and 2-4 s per cell. `decode` took
29 s for four cells and now times six. `extra` runs on what is left.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Sequence

# The whole run (--budget), and the margin between it and the time limit of
# the command that runs it on a GPU machine (480 s for the first command):
# Python's start, the last flush of the files and the stopping of a step's
# processes.
BUDGET_S = 450
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
    budget_s: its share of `BUDGET_S` on a GPU; a step may also use what
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


_MAIN = (
  Step(
    name="env",
    budget_s=20,
    dry_run_budget_s=30,
    files=(),
    what="versions (python, jax, jaxlib, CUDA plugin, CUDA runtime, "
    "cuDNN, ptxas), nvidia-smi, jax.devices(), PALLAS_FA_COMMIT "
    "and the source hash",
  ),
  Step(
    name="kernels",
    budget_s=150,
    dry_run_budget_s=90,
    files=(JUNIT,),
    what="compiled correctness of every GPU kernel, mosaic_gpu first: "
    "the conformance suite for mosaic_gpu and triton (forward and "
    "every gradient against the reference: causal, window, "
    "segments, GQA, soft cap, bias, dropout, Hv != H, H up to "
    "256), tests/test_mosaic_gpu.py, test_triton.py, test_decode.py "
    "(the triton decode kernel, contiguous and paged), "
    "test_decode_quantized_triton.py and test_decode_latent_triton.py "
    "(its int8/float8 and latent caches), "
    "test_dropout.py and test_flex.py (score_mod/mask_mod fused "
    "into triton, score_mods into mosaic_gpu); pytest-xdist, a "
    "per-test timeout, --tb=short, no hypothesis shrinking",
  ),
  Step(
    name="bench",
    budget_s=240,
    dry_run_budget_s=60,
    files=(BENCH_JSON, BENCH_MD),
    what="bf16, H = 128, T in (16384, 4096), causal and not, fwd and "
    "fwd+bwd (and the backward alone, their difference), each "
    "implementation in its own process, in this order: mosaic_gpu with "
    "the split and the fused backward (MosaicGpuBlockSizes(backward="
    "'fused')), cuDNN through jax.nn, triton, JAX's Pallas mha; then "
    "mosaic_gpu's causal forward at T = 16384 per head-section size "
    "(2, 4, 8, 16 and the default) in one process. Each cell checked "
    "first on its first and last 256 rows; a timestamp per phase "
    "(start, device init, probes, inputs, reference, compile, check, "
    "warm-up, timing); the JSON and Markdown rewritten after every cell",
  ),
  Step(
    name="decode",
    budget_s=40,
    dry_run_budget_s=30,
    files=(DECODE_JSON, DECODE_FORMS_JSON),
    what="triton decode_attention, bf16, B in {1, 8}, S = 32768, K = 8, "
    "H = 128, T_new = 1, with the default split count and 64 splits, "
    "checked against the plain flash_attention call, with the share of "
    "the measured HBM bandwidth and a timestamp per phase; then, with the "
    "time left, the cache forms (decode_benchmark.py --cache_forms): "
    "bf16, int8 and float8 caches against float32 at B = 1, S = 32768, and "
    "16 rows sharing a 16k prefix against the materialised concatenation",
  ),
)
EXTRA = Step(
  name="extra",
  budget_s=BUDGET_S - sum(s.budget_s for s in _MAIN),
  dry_run_budget_s=DRY_RUN_BUDGET_S - sum(s.dry_run_budget_s for s in _MAIN),
  files=(JUNIT, BENCH_JSON, BENCH_MD),
  what="with the time the other steps leave: the conformance suite for "
  "xla and chunked and other tests, XLA through jax.nn at T = 4096 and "
  "H = 64 and 256 in the benchmark, then the on-device compile report "
  "(scripts/compile_check.py)",
)
STEPS = _MAIN + (EXTRA,)
NAMES = tuple(s.name for s in STEPS)


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


# The second command reads the first's failed tests from its summary.json,
# copied to the repository root under this name (an untracked file travels
# with the working tree).
RERUN_SUMMARY = "gpu_summary.json"
RERUN_BUDGET_S = 150


def commands(commit: str) -> dict[str, dict[str, Any]]:
  """The two commands of a 15-minute GPU window, ready to paste: the whole
  plan, and a rerun of the tests that failed in it.

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
    "first": {"command": run, "timeout_s": BUDGET_S + MARGIN_S},
    "second": {
      "command": f"{run} --steps=env,kernels "
      f"--budget={RERUN_BUDGET_S} "
      f"--only=@{RERUN_SUMMARY}",
      "timeout_s": RERUN_BUDGET_S + MARGIN_S,
    },
  }
