"""Tests of scripts/gpu_check.py (and scripts/gpu/): the plan, its parts, the
pytest plugin, and the CPU rehearsal of the whole plan, whole and stopped
mid-bench by SIGTERM."""

import itertools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest
from conftest import script_module

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_SCRIPT = _ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
  with script_module("gpu_check") as module:
    yield module


def _env(**extra):
  """This environment without the outer pytest-xdist's variables."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))
  }
  return {**env, **extra}


def _run_script(*args, timeout=60):
  return subprocess.run(
    [sys.executable, str(_SCRIPT), *args],
    cwd=_ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


# --------------------------------------------------------------------------
# The plan.


def test_plan_fits_a_15_minute_window():
  """Two calls, the second straight after the first on the warm machine:
  with a machine start of about 90 s both fit the 900 s of a window."""
  limits = {}
  for call, steps, budget in (
      ("speed", {"env": 20, "bench": 265, "decode": 135}, 420),
      ("correctness", {"env": 20, "kernels": 180, "checks": 50}, 250)):
    proc = _run_script("--plan", f"--call={call}")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert {s["name"]: s["budget_s"] for s in got["steps"]} == steps
    assert list(steps) == [s["name"] for s in got["steps"]]
    assert got["budget_s"] == budget
    assert got["time_limit_s"] == budget + 30
    assert len(got["files"]) <= 8 and "summary.json" in got["files"]
    assert "bundle.tgz" in got["files"]
    assert all("/" not in f for f in got["files"])
    assert len(got["source_hash"]) == 16
    limits[call] = got["time_limit_s"]
  assert 90 + limits["speed"] + limits["correctness"] <= 840
  commands = got["commands"]
  first, second = commands["first"], commands["second"]
  assert (first["timeout_s"], second["timeout_s"]) == (450, 280)
  assert first["command"].endswith("--call=speed")
  assert second["command"].endswith("--call=correctness")
  for command in (first["command"], second["command"]):
    assert len(command) < 2000
    assert "PYTHONPATH=." in command and '--out="$OUT"' in command
    assert "PALLAS_FA_COMMIT=" in command


def test_kernels_run_what_the_last_window_left_first(gpu_check):
  """The baseline junit's finished tests are named as pytest names them,
  its crashed ones are not; 07213ac's failures run first and the finished
  tests after, ff8094b's, b85705a's then 07213ac's; no test crashed a
  worker at b85705a or 07213ac, so none runs alone."""
  steps = gpu_check.steps
  finished = steps.finished_tests(steps.BASELINE_JUNIT)
  assert len(finished) == 296, len(finished)
  assert all(t.startswith("tests/test_") and ".py::" in t for t in finished)
  assert ("tests/test_mosaic_gpu.py::test_block_sizes_rejects_bad_fields"
          "[block_q-32]") in finished
  assert steps.finished_tests(steps.BASELINE_JUNIT.with_name("none")) == ()
  assert "--xla_gpu_autotune_level=0" in steps.test_xla_flags()
  failed = steps.recorded_tests(steps.LAST_KERNELS, failed=True)
  recent = steps.recorded_tests(steps.LAST_KERNELS)
  assert (len(failed), len(recent)) == (5, 723)
  assert ("tests/test_triton.py::test_compiled_kernels_run_inside_a_user_"
          "shard_map") in failed
  assert set(failed) <= set(recent)
  earlier = steps.recorded_tests(steps.EARLIER_KERNELS)
  assert len(steps.recorded_tests(steps.EARLIER_KERNELS, failed=True)) == 13
  assert len(earlier) == 423 and not set(earlier) & set(finished)
  assert len(steps.recorded_tests(steps.EARLIER_CHECKS)) == 54
  assert len(steps.recorded_tests(steps.LAST_CHECKS)) == 165
  assert steps.recorded_tests(steps.LAST_CHECKS.with_name("none")) == ()
  # An id's escapes survive as pytest wrote them.
  assert any("block_table\\\\[1, 1\\\\]" in t for t in earlier)
  assert steps.ALONE_TESTS[False] == ()
  # The xla and chunked cases of the kernel files are left out, not a
  # kernel's own that names chunked.
  drop = re.compile(steps.KERNEL_TESTS[False].drop)
  for test, dropped in (
      ("tests/test_flex.py::test_example_float32[t5-xla]", True),
      ("tests/test_fp8.py::test_padding_never_leaks[chunked]", True),
      ("tests/test_fp8.py::test_e5m2_and_mixed_formats[chunked-e5m2 q/k]",
       True),
      ("tests/test_flex.py::test_example_bfloat16[triton-chunked_causal]",
       False),
      ("tests/test_decode_latent_triton.py::"
       "test_triton_latent_cache_matches_chunked[int8-16-576-512-64-1]",
       False),
      ("tests/test_conformance.py::test_float32[mosaic_gpu-B2T64S64N2K2H32]",
       False)):
    assert bool(drop.search(test)) == dropped, test
  # The checks leave the float32 conformance cases of mosaic_gpu and
  # triton to the kernels step.
  select = " ".join(steps.CHECK_TESTS[False].select)
  assert "float32 and not mosaic_gpu and not triton" in select


def test_every_window_variant_builds_its_tiling_for_each_cell(gpu_check):
  """Each --impls variant of the window's bench runs replaces fields of
  the default tiling of every cell it runs (full and causal, each T and
  head dim, its dtype): a pair its config refuses (`fused_overlap` on a
  full call's default `fused_pipeline`) would lose the cell in the
  window, so it fails here."""
  steps = gpu_check.steps
  sides = {"both": (False, True), "true": (True,), "false": (False,)}
  built = 0
  with script_module("benchmark") as benchmark:
    options, cells = benchmark.options, benchmark.cells
    for run in steps.BENCH_RUNS[False]:
      for spec in run.impls:
        name, fields = options.parse_impl(
            spec.removesuffix(options.NEGATED_QUERY))
        if not fields:
          continue
        candidate = options.Candidate(kind="impl", name=name,
                                      block_sizes=fields)
        for h, t, causal in itertools.product(
            run.head_dims, run.seq_lens, sides[run.causal]):
          shape = options.Shape(batch=1, seq_len=t, heads=16, head_dim=h,
                                causal=causal,
                                dtype=run.dtype or "bfloat16")
          bs = cells.block_sizes_for(candidate, shape)
          assert all(getattr(bs, k) == v for k, v in fields), (spec, bs)
          built += 1
  assert built > 20, built


def test_the_gpu_benchmarks_measure_what_the_window_must_answer(gpu_check):
  """The bench step's processes: one implementation each (its variants
  beside it), the ones that answer the window's questions first with their
  time kept: mosaic_gpu's fused backward and cuDNN at T = 16384 and
  4096, causal and not, fwd and fwd+bwd; the float8 forwards of
  mosaic_gpu (beside its consumers without ping-pong) and
  cuDNN on the headline's forward cells; then, in what those leave, the
  fused backward's step orders (dS^T staged under dK's product; each
  step's dQ issued ahead of the next step's S^T), the bf16 forward's
  exponentials partly on the FMA pipe and its 192-key tiles,
  mosaic_gpu's float8 forward variants at T = 16384, a forward variant on
  the causal forward cells, triton's bf16 forward with its former tiles
  beside it and JAX's Pallas mha at T = 16384, the split backward at T =
  16384, the fused backward's variants on the causal fwd+bwd cell,
  triton's float8 forward (widened, and converting its tiles) on the
  headline's forward cells; each variant a config that validates, and
  otherwise the default tiling; the cache forms, then decode at B = 1 and
  8 with two split counts."""
  steps = gpu_check.steps
  runs = {run.label: run for run in steps.BENCH_RUNS[False]}
  assert list(runs) == ["mosaic_gpu", "cudnn", "mosaic_gpu_fp8", "cudnn_fp8",
                        "mosaic_gpu_fused_step", "mosaic_gpu_fp8_tiles",
                        "mosaic_gpu_forward_tiles", "triton",
                        "pallas_mha", "mosaic_gpu_split",
                        "mosaic_gpu_fused_tiles", "triton_fp8"]
  essential = [label for label, run in runs.items() if run.essential]
  assert essential == list(runs)[:4]
  for run in runs.values():
    names = {spec.split(":")[0].removesuffix("+negated_query")
             for spec in run.impls} | set(run.peers)
    assert len(names) == 1, run  # One implementation per process.
    assert run.head_dims == (128,)
  headline = dict(seq_lens=(16384, 4096), causal="both",
                  modes=("fwd", "fwd_bwd"))
  for label in ("mosaic_gpu", "cudnn"):
    run = runs[label]
    assert {k: getattr(run, k) for k in headline} == headline, run
  assert runs["mosaic_gpu"].impls == ("mosaic_gpu:backward=fused",)
  split = runs["mosaic_gpu_split"]
  assert (split.impls, split.seq_lens, split.modes) == (
    ("mosaic_gpu:backward=split",), (16384,), ("fwd_bwd",))
  # The essential runs leave time for the others.
  need = sum(run.need_s for run in runs.values() if run.essential)
  assert need <= 220, need
  # The ceiling is measured once, off the first run's time.
  assert [label for label, run in runs.items() if run.matmul_size] == [
    "cudnn"]
  # The float8 forwards: the run's --dtype follows the step's bfloat16 one
  # and wins (absl keeps a flag's last value).
  with script_module("benchmark") as benchmark:
    from absl import flags  # noqa: PLC0415
    for label, impls, peer in (
        ("mosaic_gpu_fp8", ("mosaic_gpu", "mosaic_gpu:pingpong=false"), None),
        ("triton_fp8", ("triton", "triton:widen_float8=false"), None),
        ("cudnn_fp8", (), "cudnn_fp8")):
      run = runs[label]
      assert (run.impls, run.peers, run.dtype, run.modes) == (
        impls, (peer,) if peer else (), "float8_e4m3fn", ("fwd",)), run
      assert (run.seq_lens, run.causal) == ((16384, 4096), "both"), run
      values = flags.FlagValues()
      benchmark.define_flags(values)
      values(["benchmark.py", *steps.BENCH_FLAGS[False], *run.args()])
      settings = benchmark.options.make_settings(
        platform="gpu",
        **{n: values[n].value for n in benchmark.options.SETTING_NAMES})
      assert {s.dtype for s in settings.shapes} == {"float8_e4m3fn"}
      assert settings.modes == ("fwd",)
      assert [c.label for c in settings.candidates] == (
        list(impls) or [f"jax:{peer}"])
  dry = {run.label: run for run in steps.BENCH_RUNS[True]}
  assert (dry["chunked_fp8"].dtype, dry["chunked_fp8"].modes) == (
    "float8_e4m3fn", ("fwd",))
  assert [run.essential for run in dry.values()] == [True] * 3 + [False]
  assert dry["chunked_fp8"].impls == ("chunked", "chunked+negated_query")
  # The fused backward's step orders beside the default, full and
  # causal: the in-step order the full default replaced, and the pipeline
  # the causal default has not taken yet.
  fused_step = runs["mosaic_gpu_fused_step"]
  assert fused_step.impls == ("mosaic_gpu:backward=fused",
                              *steps.FUSED_STEP_VARIANTS)
  assert {"fused_pipeline=true", "fused_pipeline=false"} <= {
    part for spec in fused_step.impls for part in spec.split(":")}
  # FlashAttention-3's order on top of each call's default order (with
  # the pipeline in a full call), not in place of it.
  softmax = [spec for spec in fused_step.impls
             if "fused_softmax_overlap=true" in spec.split(":")]
  assert len(softmax) == 1 and "fused_pipeline" not in softmax[0], softmax
  assert (fused_step.seq_lens, fused_step.causal, fused_step.modes) == (
    (16384,), "both", ("fwd_bwd",))
  # The float8 forward: the default beside the 128-key ring full calls
  # had, the 256-key tiles causal calls do not have yet, and the
  # free-running pipelined loop (at 128 keys: it spills at 256).
  fp8_tiles = runs["mosaic_gpu_fp8_tiles"]
  assert steps.FP8_WIDE_KEYS == "mosaic_gpu:block_kv=256:num_stages=2"
  assert fp8_tiles.impls == ("mosaic_gpu", steps.FP8_NARROW_KEYS,
                             steps.FP8_WIDE_KEYS, steps.FP8_FREE_OVERLAP)
  assert (fp8_tiles.dtype, fp8_tiles.seq_lens, fp8_tiles.causal,
          fp8_tiles.modes) == ("float8_e4m3fn", (16384,), "both", ("fwd",))
  # Each variant beside the path it would replace, on the cells the last
  # window lost.
  fused = runs["mosaic_gpu_fused_tiles"]
  assert fused.impls[0] == "mosaic_gpu:backward=fused"
  assert all(i.startswith("mosaic_gpu:backward=fused:") for i in
             fused.impls[1:])
  assert (fused.seq_lens, fused.causal, fused.modes) == (
    (16384,), "true", ("fwd_bwd",))
  forward = runs["mosaic_gpu_forward_tiles"]
  assert forward.impls[0] == "mosaic_gpu" and forward.modes == ("fwd",)
  assert forward.causal == "true"
  assert runs["triton"].impls == ("triton", "triton:block_kv=64")
  assert (runs["triton"].seq_lens, runs["triton"].modes) == (
    (16384, 4096), ("fwd",))
  assert runs["pallas_mha"].peers == ("pallas_mha",)

  # The benchmark resolves every variant to its block sizes (the default
  # tiling of the shape, those fields replaced) without a GPU.
  with script_module("benchmark") as benchmark:
    specs = [(spec, run) for run in runs.values() for spec in run.impls
             if ":" in spec]
    for (spec, run), causal in itertools.product(specs, (True, False)):
      shape = benchmark.options.Shape(batch=1, seq_len=16384, heads=16,
                                      head_dim=128, causal=causal,
                                      dtype=run.dtype or "bfloat16")
      name, fields = benchmark.options.parse_impl(spec)
      candidate = benchmark.options.Candidate(kind="impl", name=name,
                                              block_sizes=fields)
      assert candidate.label == spec
      tiles = benchmark.cells.block_sizes_for(candidate, shape)
      assert type(tiles).__name__ in ("MosaicGpuBlockSizes",
                                      "TritonBlockSizes")
      for field, value in fields:
        assert getattr(tiles, field) == value
      if "backward=fused" in spec:
        # A fused label must time the fused kernel, never the split path
        # that a config it does not fit falls back to.
        from pallas_fa import mosaic_gpu
        assert mosaic_gpu.fused_backward_applies(tiles, 128, 128,
                                                 interpret=True), spec

  decode = " ".join(steps.DECODE_FLAGS[False])
  assert "--batch=1,8" in decode and "--seq_lens=32768" in decode
  assert "--kv_heads=8" in decode and "--head_dims=128" in decode
  assert "--num_splits=default,64" in decode
  # In-loop times: one call a program is the host's dispatch at B = 1.
  assert "--calls_per_program=20" in decode
  assert "--calls_per_program=2" in steps.DECODE_FLAGS[True]
  # Every cache form, in the order of what they answer (a form cut short
  # is lost whole): the 1-byte caches and the Mosaic GPU kernel's cells
  # first, the latent one (lost at b85705a) second.
  with script_module("decode_benchmark") as decode_benchmark:
    forms = decode_benchmark.decode_forms.FORMS
  assert steps.DECODE_FORMS[False][:3] == ("dtype", "latent", "prefix")
  assert sorted(steps.DECODE_FORMS[False]) == sorted(forms)


def test_build_md_has_the_commands_to_paste(gpu_check):
  build = (_ROOT / "BUILD.md").read_text()
  commands = gpu_check.plan.commands("COMMIT")
  for name, timeout in (("first", 450), ("second", 280)):
    assert commands[name]["timeout_s"] == timeout
    assert f"\n{commands[name]['command']}\n" in build, name
    assert f"`timeout_s={timeout}`" in build
  # The table of the steps gives the plan's shares.
  plan = gpu_check.plan
  for call in ("speed", "correctness"):
    described = plan.describe(plan.CALLS[call].steps,
                              plan.CALLS[call].budget_s, False)
    for step in described["steps"]:
      assert f"| `{step['name']}` | {step['budget_s']:.0f} s |" in build, step


def test_plan_of_a_rerun_scales_its_shares(gpu_check):
  args = gpu_check.parse_args(["--steps=env,kernels", "--budget=150"])
  got = gpu_check.plan_json(args)
  assert [s["name"] for s in got["steps"]] == ["env", "kernels"]
  assert sum(s["budget_s"] for s in got["steps"]) == pytest.approx(150, 0.01)
  assert got["files"] == ["summary.json", "bundle.tgz", "junit.xml"]
  plan = gpu_check.plan
  shares = plan.shares(plan.CALLS["speed"].steps, 420, dry_run=False)
  # Each step ends where the later steps' shares begin.
  assert plan.reserved_after("env", shares) == 400
  assert plan.reserved_after("decode", shares) == 0
  assert "--only=@gpu_summary.json" in plan.rerun_command("C")
  for bad in (["--steps=env,nope"], ["--out="], ["--call=nope"]):
    with pytest.raises(SystemExit):
      gpu_check.parse_args(bad)


@pytest.mark.parametrize("argv", [
  ["--call=speed"],
  ["--call=correctness"],
  ["--steps=env,kernels", "--budget=150"],  # The rerun of BUILD.md.
  ["--call=speed", "--budget=12"],
])
def test_env_always_runs(gpu_check, monkeypatch, tmp_path, argv):
  """The window at b85705a skipped env in both calls, at 0 s, "out of
  time": its 15 s share less the 10 s grace of stopping a step left 5 s
  less the microseconds since the start, under the 5 s a step needs. It
  runs in every call and rerun, for at least plan.ENV_TIMEOUT_S, and the
  later steps still get their shares."""
  ran = {}

  def fake(name):
    def step(ctx, timeout):
      ran[name] = timeout
      return {"status": "ok", "reason": ""}
    return step

  monkeypatch.setattr(gpu_check.steps, "RUNNERS",
                      {name: fake(name) for name in gpu_check.plan.NAMES})
  out, work = tmp_path / "out", tmp_path / "work"
  out.mkdir()
  work.mkdir()
  args = gpu_check.parse_args([*argv, f"--out={out}"])
  run = gpu_check._Run(args, out, work)
  assert gpu_check.run_steps(args, run) is None
  records = run.records
  assert records["env"]["status"] == "ok", records
  assert ran["env"] >= gpu_check.plan.ENV_TIMEOUT_S
  assert records["env"]["timeout_s"] >= gpu_check.plan.ENV_TIMEOUT_S
  if args.budget >= 150:
    assert list(ran) == args.steps, records
    plan = gpu_check.plan
    shares = plan.shares(args.steps, args.budget, False)
    grace = sum(gpu_check.runner.STOP_GRACE)
    # The fakes take no time: each step may use all that the steps before
    # it left, up to the later steps' shares.
    for name in args.steps[1:]:
      assert ran[name] == pytest.approx(
        args.budget - plan.reserved_after(name, shares) - grace, abs=1)
      assert ran[name] >= shares[name] - grace
  else:
    assert list(ran) == ["env"]
    assert records["bench"]["status"] == "skipped"


def test_step_shares_leave_each_step_time_to_start(gpu_check):
  """Every step of every call gets more than the grace of stopping it and
  the least a step is started with."""
  plan = gpu_check.plan
  floor = sum(gpu_check.runner.STOP_GRACE) + gpu_check.steps.MIN_STEP_S
  for call in plan.CALLS.values():
    for dry_run in (False, True):
      budget = call.dry_run_budget_s if dry_run else call.budget_s
      for name, share in plan.shares(call.steps, budget, dry_run).items():
        assert share > floor, (call.name, dry_run, name, share)
  assert plan.by_name("env").budget_s >= (
    plan.ENV_TIMEOUT_S + sum(gpu_check.runner.STOP_GRACE))


def test_bench_runs_answer_the_window_first(gpu_check):
  """The essential runs fit the bench step's time in the speed call; each
  gets its need even when the step is short, and the first also what the
  later essential runs' needs leave; the others get what is left."""
  steps, plan = gpu_check.steps, gpu_check.plan
  runs = steps.BENCH_RUNS[False]
  essential = [r for r in runs if r.essential]
  # The bench step's timeout when env takes its 4 s.
  shares = plan.shares(plan.CALLS["speed"].steps, 420, False)
  timeout = 420 - shares["decode"] - 4 - sum(gpu_check.runner.STOP_GRACE)
  assert sum(r.need_s for r in essential) <= timeout - 10

  def play(left, used):
    """Each run's timeout when each uses `used(run, share)` seconds."""
    got = []
    for i, run in enumerate(runs):
      share = steps.run_share(runs, i, left)
      got.append(share)
      left -= min(used(run, share), share)
    return got

  needs = [r.need_s for r in runs]
  # Every run taking its need: the essential ones get at least that.
  got = play(timeout, lambda run, share: run.need_s)
  for run, share in zip(runs, got):
    if run.essential:
      assert share >= run.need_s, (run.label, share)
  assert got[0] == pytest.approx(timeout - sum(needs[1:len(essential)]))
  # A short step: the first runs still get their need, the last less.
  got = play(160, lambda run, share: run.need_s)
  assert got[:3] == needs[:3], got
  assert got[4] < needs[4] and got[-1] < 1, got
  # The first hangs: it keeps the later essential runs' needs for them.
  got = play(timeout, lambda run, share: share)
  assert got[1:len(essential)] == needs[1:len(essential)]
  # A run that is not essential keeps the needs of every later run.
  left = sum(needs[len(essential):])
  assert steps.run_share(runs, len(essential), left) == needs[len(essential)]


@pytest.mark.long
@pytest.mark.slow  # 8-12 s of processes and XLA compiles
def test_a_stopped_test_run_names_the_test_it_was_in(gpu_check, tmp_path):
  """At b85705a the checks step's alone_0 run had 11 s and was stopped
  while its one selected test compiled: pytest's summary of such a run
  counts only the deselected tests ("163 deselected"), and the record said
  no test had run. The plugin writes each test's start: the record names
  the test the run was stopped in."""
  folder = tmp_path / "tests"
  folder.mkdir()
  (folder / "test_alone.py").write_text(textwrap.dedent("""
    import time
    import pytest

    @pytest.mark.parametrize("dtype", [int, float], ids=str)
    @pytest.mark.parametrize("case", ["B2T512S512N4K2H128-causal", "B1T1"])
    def test_compiled(case, dtype):
      if dtype is float and case.endswith("causal"):
        time.sleep(60)
  """))
  test = "test_compiled[B2T512S512N4K2H128-causal-<class 'float'>]"
  steps = gpu_check.steps
  ctx = steps.Context(out=tmp_path / "out", work=tmp_path / "work",
                      dry_run=False, test_timeout=60, workers=0)
  ctx.work.mkdir()
  tests = steps.Tests(files=(str(folder / "test_alone.py"),),
                      implementations="triton", patterns=(test,))
  record = steps.run_tests(ctx, "alone_0", 6, tests)
  assert record["status"] == "failed" and record["timed_out"], record
  assert record["tests"] == 0, record
  (running,) = record["running"]
  assert running.endswith(test), record
  assert record["reason"].startswith("timed out after 6 s in 1 test(s): ")
  assert test in record["reason"], record
  # Only that test was selected, and started.
  lines = (ctx.work / "tests_alone_0.jsonl").read_text().splitlines()
  assert [json.loads(line)["test"] for line in lines] == [running]


def test_checks_start_an_alone_test_only_with_its_need(gpu_check,
                                                      monkeypatch,
                                                      tmp_path):
  """The x64/float32 run gets the step's time less the alone tests'
  needs (at least half); an alone test runs with its need or more, or is
  skipped, never started with a sliver (b85705a's 11 s)."""
  steps = gpu_check.steps
  clock = [0.0]
  calls = []

  def fake_run_tests(ctx, name, timeout, tests):
    calls.append((name, timeout))
    clock[0] += timeout  # Each part uses all of its time.
    return {"status": "ok", "reason": ""}

  monkeypatch.setattr(steps, "run_tests", fake_run_tests)
  monkeypatch.setattr(steps.time, "monotonic", lambda: clock[0])
  monkeypatch.setitem(steps.ALONE_TESTS, False, ("tests/a.py::t",
                                                 "tests/b.py::u"))
  need = steps.ALONE_NEED_S[False]
  ctx = steps.Context(out=tmp_path, work=tmp_path, dry_run=False,
                      test_timeout=120, workers=8)
  record = steps.step_checks(ctx, 200)
  assert record["parts"]["alone_0"]["test"] == "tests/a.py::t"
  assert calls == [("checks", 100), ("alone_0", need)], calls
  assert record["parts"]["alone_1"]["status"] == "skipped"
  assert "of the 60 s it needs" in record["parts"]["alone_1"]["reason"]
  calls.clear()
  clock[0] = 0.0
  steps.step_checks(ctx, 300)
  assert calls == [("checks", 300 - 2 * need), ("alone_0", need),
                   ("alone_1", need)], calls
  calls.clear()
  clock[0] = 0.0
  record = steps.step_checks(ctx, 100)
  assert calls == [("checks", 50)], calls
  # None of b85705a's tests crashed a worker: the checks get it all.
  monkeypatch.setitem(steps.ALONE_TESTS, False, ())
  calls.clear()
  steps.step_checks(ctx, 50)
  assert calls == [("checks", 50)], calls


_FAKE_DECODE = """
import json, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
with open(args["--json"] + ".calls", "a") as f:
  f.write(("forms" if "--cache_forms" in args else "grid") + "\\n")
if "--cache_forms" in args:
  json.dump({"rows": [{"form": "dtype", "impl": "int8", "status": "ok",
                       "ms": 0.045}]}, open(args["--json"], "w"))
  time.sleep(60)
json.dump({"rows": [{"impl": "decode/triton", "batch": 1, "seq_len": 32768,
                     "kv_heads": 8, "head_dim": 128, "new_tokens": 1,
                     "status": "ok", "ms": 0.05}]}, open(args["--json"], "w"))
"""


@pytest.mark.long
@pytest.mark.slow  # 8-12 s of processes and XLA compiles
def test_decode_runs_the_cache_forms_first_and_names_what_was_lost(
    gpu_check, monkeypatch, tmp_path):
  """At b85705a the grid ran first and the cache forms' process was stopped
  at its 73 s in the last form (latent), whose cells were lost: the step
  said only "timed out after 73 s". The forms run first now, with their
  need, and the reason names the part and the forms not measured."""
  steps = gpu_check.steps
  fake = tmp_path / "decode_benchmark.py"
  fake.write_text(_FAKE_DECODE)
  monkeypatch.setattr(steps, "DECODE_BENCHMARK", fake)
  # The grid's need leaves it 20 s after the forms' 6: a loaded machine's
  # process kill and start (about 3 s under CI's two workers and another
  # run) must not eat its time.
  monkeypatch.setitem(steps.DECODE_NEED_S, False, {"forms": 6, "grid": 20})
  out, work = tmp_path / "out", tmp_path / "work"
  out.mkdir()
  work.mkdir()
  ctx = steps.Context(out=out, work=work, dry_run=False, test_timeout=1,
                      workers=0)
  record = steps.step_decode(ctx, 26)
  calls = (out / "decode_forms.json.calls").read_text().split()
  calls += (out / "decode.json.calls").read_text().split()
  assert calls == ["forms", "grid"]
  forms = record["forms"]
  assert forms["timed_out"] and forms["status"] == "failed", forms
  assert forms["rows"][0]["form"] == "dtype"
  assert "--cache_forms=dtype,latent,prefix,tnew,paged" in forms["command"]
  assert record["reason"] == ("cache forms: timed out after 6 s; not "
                              "measured: latent, prefix, tnew, paged")
  assert record["decode"]["rows"][0]["ms"] == 0.05
  assert record["status"] == "failed"


def test_only_reads_the_failures_of_a_summary(gpu_check, tmp_path):
  summary = tmp_path / "gpu_summary.json"
  summary.write_text(
    json.dumps(
      {
        "steps": {
          "kernels": {"failed_ids": ["tests/a.py::t[x, y]", "tests/b.py::u"]},
          "extra": {"parts": {"tests": {"failed_ids": ["tests/c.py::v"]}}},
        }
      }
    )
  )
  args = gpu_check.parse_args([f"--only=@{summary}", "--only=w"])
  assert args.only == (
    "tests/a.py::t[x, y]",
    "tests/b.py::u",
    "tests/c.py::v",
    "w",
  )
  lines = tmp_path / "ids.txt"
  lines.write_text("# failed\ntests/a.py::t\n\n")
  assert gpu_check.parse_args([f"--only=@{lines}"]).only == ("tests/a.py::t",)
  summary.write_text(json.dumps({"steps": {"kernels": {"failed_ids": []}}}))
  with pytest.raises(SystemExit):
    gpu_check.parse_args([f"--only=@{summary}"])


# --------------------------------------------------------------------------
# Its parts.


def test_summarise_tests_counts_each_test_once(gpu_check, tmp_path):
  lines = [
    dict(test="t::ok", outcome="passed"),
    dict(test="t::skip", outcome="skipped", message="needs a GPU"),
    dict(test="t::wrong", outcome="failed", message="out disagrees"),
    # A sticky CUDA error: the test failed, then its worker was ended.
    dict(test="t::fault", outcome="failed", message="CUDA_ERROR_ILLEGAL_ADDR"),
    dict(test="t::fault", outcome="crashed", message="worker crashed"),
    dict(test="t::hang", outcome="crashed", message="worker crashed"),
    dict(test="t::teardown", outcome="passed"),
    dict(test="t::teardown", outcome="error", message="fixture"),
    # Each test's start: one still running when the run was stopped.
    dict(test="t::ok", outcome="started"),
    dict(test="t::stopped", outcome="started"),
  ]
  path = tmp_path / "results.jsonl"
  path.write_text(
    "".join(json.dumps(x) + "\n" for x in lines) + '{"cut sh'  # A kill.
  )
  got = gpu_check.report.summarise_tests(path)
  assert {k: got[k] for k in ("tests", "passed", "failed", "errors")} == dict(
    tests=6, passed=1, failed=2, errors=1
  )
  assert got["crashed"] == 1 and got["skipped"] == 1
  assert got["failed_ids"] == ["t::wrong", "t::fault", "t::hang", "t::teardown"]
  assert got["running"] == ["t::stopped"]
  assert got["problems"][1] == {
    "test": "t::fault",
    "outcome": "failed",
    "message": "CUDA_ERROR_ILLEGAL_ADDR",
  }
  assert gpu_check.report.summarise_tests(tmp_path / "none.jsonl") is None


def test_format_summary_of_a_real_run(gpu_check):
  """The summary an H200 run wrote (failing, crashed and timed-out steps
  included) formats: every problem and headline cell is in the text."""
  path = _ROOT / "benchmarks" / "results" / "h200_gpu_check_summary.json"
  summary = json.loads(path.read_text())
  text = gpu_check.report.format_summary(summary)
  assert "334 passed, 3 failed, 0 errors, 3 crashed" in text
  assert text.count("crashed: tests/") == 3
  assert "mosaic_gpu 592.2 (1.02x)" in text
  assert "decode/triton B=8 S=32768 K=8" in text


def test_merge_junit(gpu_check, tmp_path):
  suite = '<testsuites><testsuite name="pytest" tests="1"><testcase name="{}"/>'
  end = "</testsuite></testsuites>"
  (tmp_path / "junit_a.xml").write_text(suite.format("a") + end)
  (tmp_path / "junit_b.xml").write_text(suite.format("b"))  # Cut short.
  (tmp_path / "junit_c.xml").write_text(
    '<testsuite name="pytest"><testcase name="c"/></testsuite>'
  )
  merged = gpu_check.report.merge_junit(sorted(tmp_path.glob("junit_*.xml")))
  root = gpu_check.report.ElementTree.fromstring(merged)
  assert [s.get("name") for s in root] == ["junit_a", "junit_c"]
  assert [c.get("name") for c in root.iter("testcase")] == ["a", "c"]
  assert gpu_check.report.merge_junit([tmp_path / "junit_b.xml"]) is None


def test_summarise_compile(gpu_check):
  report = {
    "results": [
      {
        "backend": "triton",
        "head_dim": 64,
        "dtype": "bfloat16",
        "variant": "plain",
        "target": "h100",
        "error": None,
        "kernels": [
          {"kernel": "flash_fwd", "problems": [], "spill_stores": 0},
          {
            "kernel": "flash_bwd_dq",
            "problems": ["spills"],
            "spill_stores": 8,
            "spill_loads": 8,
          },
        ],
      },
      {
        "backend": "mosaic_gpu",
        "head_dim": 256,
        "dtype": "bfloat16",
        "variant": "causal",
        "target": "h100",
        "error": "ValueError: smem\nmore",
        "kernels": [],
      },
    ]
  }
  got = gpu_check.report.summarise_compile(report)
  assert {
    k: got[k] for k in ("cases", "kernels", "problems", "spilling_kernels")
  } == dict(cases=2, kernels=2, problems=2, spilling_kernels=1)
  assert got["failed"] == [
    "h100 triton 64 bfloat16 plain flash_bwd_dq: spills",
    "h100 mosaic_gpu 256 bfloat16 causal: ValueError: smem",
  ]
  assert gpu_check.report.summarise_compile({"unexpected": 1}) == {}


@pytest.mark.parametrize(
  "exit_code, message, status",
  [
    (0, "done", "ok"),
    (1, "1 problem(s)", "failed"),
    (2, "compile_check: cannot run here: no GPU", "skipped"),
    (2, "usage: compile_check.py [-h]", "failed"),  # argparse's exit 2
    (3, "crash", "failed"),
  ],
)
def test_compile_step_exit_status(
  gpu_check, monkeypatch, tmp_path, exit_code, message, status
):
  fake = tmp_path / "compile_check.py"
  fake.write_text(
    textwrap.dedent(f"""
      import json, sys
      path = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--json")]
      json.dump({{"results": [{{"error": None, "kernels": [
          {{"kernel": "k", "problems": {["x"] if exit_code else []}}}]}}]}},
          open(path[0], "w"))
      print({message!r})
      sys.exit({exit_code})
  """)
  )
  monkeypatch.setattr(gpu_check.steps, "COMPILE_CHECK", fake)
  ctx = gpu_check.steps.Context(
    out=tmp_path, work=tmp_path, dry_run=False, test_timeout=10, workers=0
  )
  record = gpu_check.steps.step_compile(ctx, timeout=60)
  assert record["status"] == status, record
  assert record["returncode"] == exit_code
  assert record["problems"] == (1 if exit_code else 0)
  assert "--target=local" in record["command"]
  if status != "ok":
    assert record["reason"]


@pytest.mark.long
@pytest.mark.slow  # 8-12 s of processes and XLA compiles
def test_stopped_at_timeout_and_polled(gpu_check, tmp_path):
  log = tmp_path / "sleep.log"
  polls = []
  result = gpu_check.runner.run_logged(
    [
      sys.executable,
      "-c",
      "import time; print('hi', flush=True); time.sleep(60)",
    ],
    log_path=log,
    timeout=1.5,
    on_wait=lambda: polls.append(1),
    poll_s=0.3,
  )
  assert result.timed_out and result.duration_s < 15
  assert polls
  text = log.read_text()
  assert "hi" in text and "timed out after 2 s" in text


def test_bundle_keeps_every_file_within_its_size(gpu_check, tmp_path):
  work = tmp_path / "work"
  work.mkdir()
  (work / "small.log").write_text("small")
  big = b"head" + b"x" * (gpu_check.runner.BUNDLE_FILE_BYTES + 100) + b"tail"
  (work / "big.log").write_bytes(big)
  bundle = tmp_path / "bundle.tgz"
  gpu_check.runner.write_bundle(work, bundle)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle.tgz", "work"]
  with tarfile.open(bundle) as tar:
    assert tar.getnames() == ["gpu_check/big.log", "gpu_check/small.log"]
    got = tar.extractfile("gpu_check/big.log").read()
    assert tar.extractfile("gpu_check/small.log").read() == b"small"
  assert got.startswith(b"head") and got.endswith(b"tail")
  assert b"bytes cut here" in got and len(got) < len(big)


# --------------------------------------------------------------------------
# The pytest plugin.

_SYNTHETIC = """
import hypothesis
import hypothesis.strategies as st

_POISONED = []  # What a sticky CUDA error does to the rest of a process.

def test_a_plain():
  pass

def test_b_triton():
  assert not _POISONED

def test_c_mosaic_gpu():
  _POISONED.append(1)
  raise RuntimeError("INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal "
                     "memory access was encountered")

def test_d_mosaic_gpu_after():
  assert not _POISONED

def test_e_after():
  assert not _POISONED

@hypothesis.settings(max_examples=50, derandomize=True, database=None)
@hypothesis.given(st.integers(0, 10**6))
def test_f_property(x):
  assert x < 1000

def test_g_dies():
  import os
  os.write(2, b"F0000 fatal: out of resources in a compile\\n")
  os._exit(134)

def test_h_dropped():
  pass
"""


@pytest.mark.long
@pytest.mark.slow  # 8-12 s of processes and XLA compiles
def test_pytest_plugin(gpu_check, tmp_path):
  """Order, selection, results as they finish, no shrinking, and a fresh
  worker after a sticky CUDA error (one worker, so that the tests after the
  fault run where it happened)."""
  (tmp_path / "test_synthetic.py").write_text(_SYNTHETIC)
  only = tmp_path / "only.txt"
  only.write_text("mosaic_gpu\ntest_b\ntest_e\ntest_f\ntest_g\ntest_h\n"
                  "no_such_test\n")
  # The last window: test_f failed (it runs first), test_b passed; the one
  # before it finished test_b and test_e (test_e runs after every test no
  # window finished, test_b after it).
  order_file = tmp_path / "order.json"
  order_file.write_text(json.dumps({
    "first": ["test_synthetic.py::test_f_property"],
    "last": [["test_synthetic.py::test_b_triton",
              "test_synthetic.py::test_e_after"],
             ["test_synthetic.py::test_b_triton",
              "test_synthetic.py::test_f_property"]]}))
  results = tmp_path / "results.jsonl"
  env = _env(
    PYTHONPATH=str(_ROOT / "scripts"),
    PALLAS_FA_TEST_RESULTS=str(results),
    PALLAS_FA_TEST_ONLY=str(only),
    PALLAS_FA_TEST_ORDER=str(order_file),
    PALLAS_FA_TEST_DROP=r"::test_h_",
    PALLAS_FA_TEST_STDERR_DIR=str(tmp_path / "stderr"),
  )
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-p", "gpu.pytest_plugin", "-n", "1"]
    + ["-p", "no:cacheprovider", "-q", "--capture=sys", "test_synthetic.py"],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  output = proc.stdout + proc.stderr
  lines = [json.loads(x) for x in results.read_text().splitlines()]
  order = list(dict.fromkeys(x["test"].split("::")[1] for x in lines))
  # What failed in the last window first, then mosaic_gpu, then triton, then
  # the rest, then what the window before the last finished (test_e), then
  # what the last one finished (test_b): the order each worker collects
  # (xdist sends the tests that a worker had been sent when it died again
  # later, so the run's own order differs after a crash).
  collected = subprocess.run(
    [sys.executable, "-m", "pytest", "-p", "gpu.pytest_plugin", "-q"]
    + ["-p", "no:cacheprovider", "--collect-only", "test_synthetic.py"],
    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert [line.split("::")[1] for line in collected.stdout.splitlines()
          if "::" in line] == [
    "test_f_property",
    "test_c_mosaic_gpu",
    "test_d_mosaic_gpu_after",
    "test_g_dies",
    "test_e_after",
    "test_b_triton",
  ], collected.stdout + collected.stderr
  # test_h was selected, then dropped; no_such_test matched nothing.
  assert "match no test: ['no_such_test']" in collected.stderr
  assert "6/8 tests collected (2 deselected)" in collected.stdout
  assert order[:2] == ["test_f_property", "test_c_mosaic_gpu"], output
  assert sorted(order) == [
    "test_b_triton",
    "test_c_mosaic_gpu",
    "test_d_mosaic_gpu_after",
    "test_e_after",
    "test_f_property",
    "test_g_dies",
  ], output
  # Each test's start is written before its outcome; none is left running.
  starts = [x["test"] for x in lines if x["outcome"] == "started"]
  assert sorted(set(starts)) == sorted({x["test"] for x in lines
                                       if x["outcome"] != "started"})
  for test in starts:
    outcomes = [x["outcome"] for x in lines if x["test"] == test]
    assert outcomes[0] == "started", (test, outcomes)
  # A worker that died is reported with the last lines of its stderr.
  (died,) = [x for x in lines if x["test"].endswith("test_g_dies")
             and x["outcome"] != "started"]
  assert died["outcome"] == "crashed", died
  assert "its stderr ended: F0000 fatal: out of resources" in died["message"]
  got = gpu_check.report.summarise_tests(results)
  assert got["failed_ids"] == [
    "test_synthetic.py::test_f_property",
    "test_synthetic.py::test_c_mosaic_gpu",
    "test_synthetic.py::test_g_dies",
  ], output
  assert got["passed"] == 3 and got["running"] == []
  assert "ILLEGAL_ADDRESS" in got["problems"][1]["message"]
  # The first failing example, not a shrunk one (which would be 1000).
  message = got["problems"][0]["message"]
  assert message.startswith("assert ") and message.endswith(" < 1000")
  assert message != "assert 1000 < 1000", message
  # The first worker reports the collection, into its stderr file.
  worker_stderr = (tmp_path / "stderr" / "stderr_gw0.log").read_text()
  assert "match no test: ['no_such_test']" in worker_stderr


# --------------------------------------------------------------------------
# The CPU rehearsal.


def _files(out):
  return sorted(p.name for p in out.iterdir())


@pytest.mark.long
@pytest.mark.slow  # About a minute on 2 cores; the test below runs most of it.
def test_dry_run(gpu_check, tmp_path):
  out, work = tmp_path / "out", tmp_path / "work"
  # A roomier budget than the dry run's own: on a loaded 2-core machine its
  # steps can take twice as long as usual.
  proc = _run_script(
    "--dry-run", "--call=all", "--budget=400", f"--out={out}",
    f"--work={work}", timeout=460
  )
  output = proc.stdout + proc.stderr
  summary = json.loads((out / "summary.json").read_text())
  steps = summary["steps"]
  assert list(steps) == ["env", "bench", "decode", "kernels", "checks",
                         "extra"]
  # The same files as the plan, all at the top of --out.
  assert _files(out) == sorted(summary["plan"]["files"]), output
  for name, step in steps.items():
    assert step["status"] == "ok", (name, step, output)
    assert step["duration_s"] <= step["timeout_s"] + 15, (name, step)

  assert (
    steps["env"]["env"]["source_hash"]
    == json.loads(_run_script("--plan").stdout)["source_hash"]
  )

  kernels = steps["kernels"]
  assert kernels["passed"] == 4 and not kernels["failed_ids"], kernels
  # What failed in the last window first, then what no window finished,
  # then what each finished, the stalest window's first.
  order = [json.loads(line)["test"] for line in
           (work / "tests_kernels.jsonl").read_text().splitlines()
           if json.loads(line)["outcome"] != "started"]
  steps_lib = gpu_check.steps
  groups = (set(steps_lib.finished_tests(steps_lib.BASELINE_JUNIT)),
            set(steps_lib.recorded_tests(steps_lib.EARLIER_KERNELS)),
            set(steps_lib.recorded_tests(steps_lib.LAST_KERNELS)))
  failed = steps_lib.recorded_tests(steps_lib.LAST_KERNELS, failed=True)

  def tier(test):
    if test in failed:
      return 0
    return max((2 + i for i, g in enumerate(groups) if test in g), default=1)

  tiers = [tier(test) for test in order]
  assert tiers == sorted(tiers) and len(set(tiers)) > 1, (order, tiers)
  checks = steps["checks"]["parts"]
  x64 = checks["x64_float32"]
  assert x64["passed"] and not x64["failed_ids"], x64
  alone = checks["alone_0"]
  assert alone["passed"] == alone["tests"] == 1, alone
  assert alone["test"].endswith("test_block_sizes_frozen_and_hashable")
  junit = (out / "junit.xml").read_text()
  # 3 kernels, the x64 checks, 1 alone, 1 extra.
  assert junit.count("<testcase") == 4 + x64["tests"] + 1 + 1, junit

  bench = json.loads((out / "bench.json").read_text())
  cells = {(r["impl"], r["head_dim"], r["seq_len"]) for r in bench["results"]}
  assert ("chunked", 16, 256) in cells and ("jax:xla", 16, 128) in cells
  assert ("jax:xla", 16, 256) not in cells  # The peer at the first T only.
  assert ("chunked", 32, 128) in cells  # The extra step's head dim.
  assert all(r["status"] == "ok" for r in bench["results"])
  # Each candidate ran in a process of its own; the ratios span them.
  assert all(
    r["speedup_vs_xla"]
    for r in bench["results"]
    if r["seq_len"] == 128 and r["head_dim"] == 16
    and r["dtype"] == "float32"
  )
  # The float8 forward, checked like the others (its ratios are against
  # bfloat16 cells, which the float32 dry run has none of).
  fp8 = [r for r in bench["results"] if r["impl"] == "chunked+e4m3"]
  assert {(r["dtype"], r["mode"], r["seq_len"], r["causal"]) for r in fp8} == {
    ("float8_e4m3fn", "fwd", 128, causal) for causal in (False, True)}
  assert (
    "| chunked | chunked:block_q_bwd=64 | jax:xla | chunked+e4m3 | "
    "chunked+negated_query+e4m3 | chunked:block_kv=64 |"
    in (out / "bench.md").read_text()
  )
  # The negated query: the same attention, checked against the reference
  # of the inputs it negates (no reference of its own, below).
  negated = [r for r in bench["results"]
             if r["impl"] == "chunked+negated_query+e4m3"]
  assert len(negated) == 2 and all(r["status"] == "ok" for r in negated)
  # H = 16, T 128 and 256, causal and not, fwd, fwd_bwd and the backward
  # alone (fwd_bwd less fwd).
  rows = steps["bench"]["bench"]["rows"]
  assert len(rows) == 12 and rows[0]["vs_cudnn"] == {}
  modes = ["fwd", "fwd", "fwd_bwd", "fwd_bwd", "bwd", "bwd"]
  assert [r["mode"] for r in rows[:6]] == modes
  variant = "chunked:block_q_bwd=64"
  assert {"chunked", variant} <= set(rows[4]["rate"])
  tiles = "chunked:block_kv=64"
  (causal_fwd,) = [r for r in rows if (r["T"], r["mode"], r["causal"])
                   == (256, "fwd", True)]
  assert {"chunked", variant, tiles} <= set(causal_fwd["rate"])
  # Where each process's time went; the later ones read the references
  # back.
  timelines = steps["bench"]["bench"]["timelines"]
  assert [t["candidates"] for t in timelines] == [
    f"chunked,{variant}", "jax:xla",
    "chunked+e4m3,chunked+negated_query+e4m3", f"chunked,{tiles}"]
  for t in timelines:
    assert {"start", "device_init", "inputs", "reference"} <= set(
      t["by_phase"]), t
  loaded = [p["loaded"] for t in bench["timelines"][:3] for p in t["phases"]
            if p["phase"] == "reference"]
  # chunked's 4 shapes, xla's 2 (read back), chunked_fp8's 2 (float8
  # inputs: references of their own).
  assert loaded == [False] * 4 + [True] * 2 + [False] * 2, loaded

  decode = json.loads((out / "decode.json").read_text())
  assert {r["impl"] for r in decode["rows"]} == {
    "decode/chunked",
    "decode/chunked:num_splits=2",
    "flash_attention",
  }
  assert {"probes", "reference", "timing"} <= {
    p["phase"] for p in decode["timeline"]}
  # Two calls a program in the dry run, the one-call time beside them.
  assert all(r["calls_per_program"] == 2 and r["ms_one_call"] > 0
             for r in decode["rows"]), decode["rows"]
  assert all(r["share"] > 0 for r in steps["decode"]["decode"]["rows"])
  # Then the cache forms, each checked before it is timed.
  forms = steps["decode"]["forms"]
  assert forms["status"] == "ok", forms
  assert [(r["form"], r["impl"], r["status"]) for r in forms["rows"]] == [
    ("latent", name, "ok")
    for name in ("latent", "separate_values", "one_read_floor")]
  assert json.loads((out / "decode_forms.json").read_text())["ratios"]

  parts = steps["extra"]["parts"]
  assert parts["tests"]["passed"] == 1 and parts["bench"]["status"] == "ok"
  # End to end: the training script's tokens/s, one process an attention.
  train = parts["train"]
  assert train["status"] == "ok", train
  assert [(r["attention_impl"], r["status"]) for r in train["rows"]] == [
    ("chunked", "ok"), ("xla", "ok")]
  assert all(r["tokens_per_s"] > 0 for r in train["rows"])
  assert parts["compile"]["status"] in ("ok", "skipped")

  with tarfile.open(out / "bundle.tgz") as tar:
    names = {pathlib.PurePath(n).name for n in tar.getnames()}
  assert {"env.json", "pytest_kernels.log", "bench_chunked.log"} <= names
  assert {"decode.log", "bench_xla.log", "tests_kernels.jsonl"} <= names
  assert proc.returncode == 0, output
  assert "kernels" in output and "4 passed" in output


@pytest.mark.long
@pytest.mark.slow
def test_dry_run_stopped_mid_bench_leaves_its_files(tmp_path):
  """The CPU rehearsal, stopped by SIGTERM (the command's time limit) while
  the benchmark runs: every file is on disk and readable, with what was
  done."""
  out, work = tmp_path / "out", tmp_path / "work"
  proc = subprocess.Popen(
    [sys.executable, str(_SCRIPT), "--dry-run", "--call=all", "--budget=400"]
    + [f"--out={out}", f"--work={work}"],
    cwd=_ROOT,
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  deadline = time.monotonic() + 300
  try:
    while time.monotonic() < deadline and proc.poll() is None:
      try:
        summary = json.loads((out / "summary.json").read_text())
        bench = json.loads((out / "bench.json").read_text())
      except (OSError, ValueError):
        time.sleep(0.1)
        continue
      if summary["steps"]["bench"]["status"] == "running" and bench["results"]:
        break
      time.sleep(0.1)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, output
  summary = json.loads((out / "summary.json").read_text())
  steps = summary["steps"]
  assert steps["env"]["status"] == "ok", output
  assert steps["bench"]["status"] == "failed"
  assert "SIGTERM" in steps["bench"]["reason"]
  for name in ("decode", "kernels", "checks", "extra"):
    assert steps[name]["status"] == "skipped", steps[name]
    assert "SIGTERM" in steps[name]["reason"]
  # No half-written file is left beside them.
  assert _files(out) == [
    "bench.json",
    "bench.md",
    "bundle.tgz",
    "summary.json",
  ]
  bench = json.loads((out / "bench.json").read_text())
  assert bench["results"] and bench["results"][0]["impl"] == "chunked"
  assert steps["bench"]["bench"]["rows"], steps["bench"]
  with tarfile.open(out / "bundle.tgz") as tar:
    names = {pathlib.PurePath(n).name for n in tar.getnames()}
    log = tar.extractfile("gpu_check/bench_chunked.log").read().decode()
  assert {"env.json", "bench_chunked.log"} <= names
  assert "exit status" in log  # Written after the benchmark was stopped.


def test_records_name_no_path_of_the_machine(gpu_check, tmp_path):
  ctx = gpu_check.steps.Context(out=tmp_path / "out", work=tmp_path / "w",
                                dry_run=True, test_timeout=1, workers=0)
  cmd = [sys.executable, str(gpu_check.steps.BENCHMARK),
         f"--json={tmp_path / 'out' / 'bench.json'}",
         str(tmp_path / "w" / "x.log"), "-k", "a b"]
  assert ctx.shown(cmd) == (
    "python3 scripts/benchmark.py '--json=$OUT/bench.json' '$WORK/x.log' "
    "-k 'a b'")


def test_compile_check_refuses_a_venv_with_cuda_libraries(monkeypatch):
  """The deviceless compile check stops, naming the cause, in a venv with
  jax[cuda12]'s nvJitLink (no ptxas report) or a CUDA 12.8-12.9 runtime
  (masked mosaic_gpu kernels refused), and runs in one with the plugin
  and ptxas only (or a runtime outside that range)."""
  monkeypatch.setattr(os, "environ", dict(os.environ))  # the script's
  with script_module("compile_check") as compile_check:
    monkeypatch.setattr(compile_check, "_cuda_device", lambda target: None)
    installed = {}

    def version(name):
      if name not in installed:
        raise compile_check.importlib.metadata.PackageNotFoundError(name)
      return installed[name]

    monkeypatch.setattr(compile_check.importlib.metadata, "version", version)
    runtime = compile_check.mosaic_gpu
    monkeypatch.setattr(runtime, "cuda_runtime_version", lambda: 13000)
    assert compile_check._can_compile_for_cuda("h100") is None  # noqa: SLF001
    installed["nvidia-nvjitlink-cu12"] = "12.9.86"
    reason = compile_check._can_compile_for_cuda("h100")  # noqa: SLF001
    assert "nvidia-nvjitlink-cu12 12.9.86" in reason
    assert "nvidia-cuda-nvcc-cu12 only" in reason
    del installed["nvidia-nvjitlink-cu12"]
    monkeypatch.setattr(runtime, "cuda_runtime_version", lambda: 12090)
    reason = compile_check._can_compile_for_cuda("h100")  # noqa: SLF001
    assert "a CUDA runtime 12090" in reason
