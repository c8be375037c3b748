"""The plan of scripts/gpu_check.py: its steps in run order, each step's
share of the budget, the two calls of a GPU window, and every file a run
may write under --out.

A GPU machine is lent for 15 minutes in all (its start, every command and
idle time count) and one command runs at most 10 minutes, of which 8 files
come back. A window is two calls, each a prepared command:

* speed (`--call=speed`, 420 s under a 450 s limit): the questions that
  decide the next kernel work, the T = 16384 and 4096 cells of mosaic_gpu,
  cuDNN and the float8 forwards first, then the variants in the time they
  leave, then decode's cache forms and grid;
* correctness (`--call=correctness`, 250 s under a 280 s limit): the
  compiled kernel tests (those that failed in the last window first, then
  those no window finished), the x64 and float32 (precision="highest")
  checks of every backend, and the tests that crashed a pytest-xdist
  worker in the last window, each alone in its own process.

The second runs straight after the first while the machine is still warm
(a fresh start costs a minute or more of the 15), so it does not depend on
the first's results.

The shares, from the window at b85705a (every process's phases were
timed, `steps.BenchRun.need_s`): `env` takes 2-4 s; its share is its 10 s
timeout and the 10 s grace of stopping it (at b85705a its 15 s share less
that grace was under the 5 s a step is started with: it was skipped in
both calls). `bench`'s essential runs need 215 s of its 270 (mosaic_gpu's
fused backward 60, cuDNN with the matmul ceiling 34, the
float8 forwards of mosaic_gpu, cuDNN and triton 44, 44 and 33); the rest
run in what they leave. `decode`: the cache forms took 87 s (the latent
one 17 s, lost at b85705a to the 73 s the grid left them), the grid 31 s.
`kernels` finished 423 of 792 tests in 185 s with 8 workers (712 without
the xla and chunked cases); the next window runs the 13 that failed, the
64 no window finished and the 280 only ff8094b finished first, about
160 s. `checks` finished 54 of 212 tests in 22 s; 164 without the cases
the kernels step runs, about 35 s. `extra` runs only when named in
--steps.
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
    min_timeout_s: None: the step is skipped when its time is spent; else
      it always runs (unless a signal stopped the run), for at least this
      long: the env record says what every other step ran on.
  """

  name: str
  budget_s: float
  dry_run_budget_s: float
  files: tuple[str, ...]
  what: str
  min_timeout_s: float | None = None


# The env collection took 2-4 s in every window (one Python process: jax's
# import, nvidia-smi, ptxas --version); its share is this timeout and the
# grace of stopping it (`runner.STOP_GRACE`, 10 s).
ENV_TIMEOUT_S = 10
_ENV = Step(
  name="env",
  budget_s=20,
  dry_run_budget_s=30,
  files=(),
  what="versions (python, jax, jaxlib, CUDA plugin, CUDA runtime, "
  "cuDNN, ptxas), nvidia-smi, jax.devices(), PALLAS_FA_COMMIT "
  "and the source hash; it always runs, for at least 10 s",
  min_timeout_s=ENV_TIMEOUT_S,
)
_BENCH = Step(
  name="bench",
  budget_s=265,
  dry_run_budget_s=60,
  files=(BENCH_JSON, BENCH_MD),
  what="bf16, H = 128, T in (16384, 4096), causal and not, fwd and "
  "fwd+bwd (and the backward alone, their difference), each "
  "implementation in its own process with the seconds it needs, those "
  "that answer the window's questions first and with their time kept: "
  "mosaic_gpu with its default, fused backward, cuDNN through jax.nn "
  "(and the matmul ceiling), the float8 forward of mosaic_gpu (e4m3 "
  "inputs quantized per head, fwd, its speed-up against cuDNN's bf16 and "
  "FP8 cells and its own bf16 ones; its two consumers without ping-pong "
  "beside it, pingpong=false) and cuDNN's FP8 forward (per-tensor scales, "
  "through jax's private cudnn module); then, in the time those leave "
  "and in this order: the fused backward's step orders "
  "(fused_pipeline=false and =true, and the softmax under dP^T's and "
  "dV's products, fused_softmax_overlap=true, on top of each call's "
  "default order, beside the default; T = "
  "16384, full and causal, fwd+bwd), the float8 forward's 128-key "
  "four-stage ring and "
  "256-key tiles and the free-running pipelined loop beside the default "
  "(T = 16384, full and causal), the "
  "forward's pipelined key loop without ping-pong and its 192-key tiles "
  "(causal fwd), triton's bf16 "
  "forward with its 128-key tiles against its former 64-key ones, JAX's "
  "Pallas mha (T = 16384), the split backward (T = 16384, fwd+bwd), the fused "
  "backward's tile variants (T = 16384, causal, fwd+bwd) and triton's "
  "float8 forward. Each cell checked first on its "
  "first and last 256 rows against a reference computed once per shape "
  "(compiled without autotuning) and read back by the later processes; "
  "a timestamp per phase; the JSON and Markdown rewritten after every "
  "cell",
)
_DECODE = Step(
  name="decode",
  budget_s=135,
  dry_run_budget_s=30,
  files=(DECODE_JSON, DECODE_FORMS_JSON),
  what="triton decode_attention's cache forms first "
  "(decode_benchmark.py --cache_forms), with bf16 queries, in this "
  "order: int8 and float8 caches against bf16, and the bf16 cache "
  "through mosaic_gpu's split kernel against triton's (and as pages of "
  "16 keys against its contiguous cell, with its merge launched under the "
  "split kernel (PDL) against the Triton merge, and the int8 cache against "
  "triton's and its bf16 cell, with one and two consumer warpgroups and "
  "its query quantized, and a float8 cache with one scale for K and V on "
  "float16 products against the bfloat16 ones they replaced, with the "
  "PDL merge and with its query in e4m3); the latent cache against "
  "separate K and V (and through mosaic_gpu's split kernel, contiguous "
  "and in 64-key pages); the shared prefix against the materialised "
  "concatenation (and each of its parts alone, and the call and its "
  "prefix pass with 8 warps and the pass in 32-key blocks of 8 against "
  "the default one warpgroup, and both through mosaic_gpu's split "
  "kernel); T_new = 16 against 1 (also over the int8 cache, with one "
  "warpgroup a program and the 8 warps it replaced, and through "
  "mosaic_gpu's split kernel); paged against "
  "contiguous; then the grid: bf16, B in "
  "{1, 8}, S = 32768, K = 8, H = 128, T_new = 1, with the default split "
  "count and 64 splits, checked against the plain flash_attention "
  "call, then timed 20 calls to a jitted program (and one to a program "
  "beside them: the host's dispatch), in turn, with the share of the "
  "measured HBM bandwidth and a timestamp per phase",
)
_KERNELS = Step(
  name="kernels",
  budget_s=180,
  dry_run_budget_s=60,
  files=(JUNIT,),
  what="compiled correctness of every GPU kernel, in this order: the "
  "tests that failed in the last window, those no window of record "
  "finished, then those each finished, the stalest window's first "
  "(benchmarks/results/h200_ff8094b/junit.xml, "
  "h200_b85705a/ and h200_07213ac/tests_kernels.jsonl): "
  "the conformance suite for mosaic_gpu and triton (forward and "
  "every gradient against the reference: causal, window, "
  "segments, GQA, soft cap, bias, dropout, Hv != H, H up to "
  "256), tests/test_mosaic_gpu.py, test_triton.py, test_decode.py "
  "(the triton decode kernel, contiguous and paged), "
  "test_decode_mosaic_gpu.py (the Mosaic GPU decode kernel compiled), "
  "test_decode_quantized_triton.py and test_decode_latent_triton.py "
  "(its int8/float8 and latent caches), "
  "test_dropout.py and test_flex.py (score_mod/mask_mod fused "
  "into triton, score_mods into mosaic_gpu), test_fp8.py and "
  "test_mosaic_gpu_fp8.py (the float8 forwards of triton and "
  "mosaic_gpu against the float64 oracle), "
  "test_decode_prefix_latent.py (the shared prefix's one merge, the "
  "latent caches), test_decode_property.py (random decode calls, every "
  "cache form and feature at once, against the float64 oracle), "
  "test_fp8_property.py (random float8 calls on triton, every feature "
  "at once), "
  "without their xla and chunked cases (no GPU kernel); "
  "pytest-xdist, a "
  "per-test timeout, each worker's stderr kept (a crashed worker's last "
  "lines reported), the references compiled without autotuning, "
  "--tb=short, no hypothesis shrinking",
)
_CHECKS = Step(
  name="checks",
  budget_s=50,
  dry_run_budget_s=30,
  files=(JUNIT,),
  what="every backend (mosaic_gpu, triton, xla, chunked; the decode "
  "kernels) forward and backward with jax_enable_x64 on "
  "(tests/test_x64.py), the reproducible backward rerun bitwise-equal "
  "on every backend (tests/test_determinism.py), the float32 tests at "
  "precision='highest' (test_precision.py, the conformance suite's "
  "float32 cases of xla and chunked: the kernels step runs mosaic_gpu's "
  "and triton's), those the last window did not finish first; then "
  "each test that crashed a worker in the last window alone in a "
  "process of its own, without pytest-xdist, if its time is left (none "
  "crashed one at b85705a)",
)
EXTRA = Step(
  name="extra",
  budget_s=300,
  dry_run_budget_s=60,
  files=(JUNIT, BENCH_JSON, BENCH_MD),
  what="only when named in --steps: training tokens/s of the default "
  "model at T = 4096 (scripts/train.py --benchmark_steps) with "
  "mosaic_gpu, cuDNN and XLA attention, each in a process of its own; the "
  "conformance suite for xla and chunked and other tests, XLA through "
  "jax.nn at T = 4096 and H = 64 and 256 in the benchmark, then the "
  "on-device compile report "
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
