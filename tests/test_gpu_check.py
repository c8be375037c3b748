"""Tests of scripts/gpu_check.py (and scripts/gpu/): its parsers and a whole
--dry-run."""

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from conftest import script_module

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_SCRIPT = _ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
  with script_module("gpu_check") as module:
    yield module


_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests">
 <testsuite name="pytest" errors="1" failures="2" skipped="1" tests="7"
            time="12.5">
  <testcase classname="tests.test_a" name="test_ok[xla]" time="0.1"/>
  <testcase classname="tests.test_a" name="test_ok[triton]" time="0.2"/>
  <testcase classname="tests.test_a" name="test_skip" time="0.0">
   <skipped type="pytest.skip" message="needs a GPU">skip</skipped>
  </testcase>
  <testcase classname="tests.test_a" name="test_wrong" time="0.3">
   <failure message="AssertionError: out disagrees">trace</failure>
  </testcase>
  <testcase classname="tests.test_b" name="test_hangs" time="90.0">
   <failure message="Failed: Timeout (&gt;90.0s) from pytest-timeout.">
   trace</failure>
  </testcase>
  <testcase classname="tests.test_b" name="test_crash" time="0.0">
   <error message="worker 'gw0' crashed while running 'test_crash'">x</error>
  </testcase>
  <testcase time="0.000"/>
 </testsuite>
</testsuites>
"""


def test_parse_junit(gpu_check):
  got = gpu_check.report.parse_junit(_JUNIT)
  assert {k: got[k] for k in (
      "tests", "passed", "failed", "errors", "skipped", "timeouts",
      "crashed", "interrupted")} == dict(
          tests=6, passed=2, failed=2, errors=1, skipped=1, timeouts=1,
          crashed=1, interrupted=1)
  assert got["time_s"] == 12.5
  assert [p["test"] for p in got["problems"]] == [
      "tests.test_a::test_wrong", "tests.test_b::test_hangs",
      "tests.test_b::test_crash"]
  assert got["problems"][0] == {
      "test": "tests.test_a::test_wrong", "outcome": "failed",
      "message": "AssertionError: out disagrees"}
  assert got["problems"][2]["outcome"] == "error"
  # A bare <testsuite> root (older pytest) parses the same way.
  suite = _JUNIT.split("<testsuites name=\"pytest tests\">")[1].split(
      "</testsuites>")[0]
  assert gpu_check.report.parse_junit(suite)["passed"] == 2


def test_summarise_compile(gpu_check):
  report = {"versions": {}, "argv": [], "results": [
      {"backend": "triton", "head_dim": 64, "dtype": "bfloat16",
       "variant": "plain", "target": "h100", "error": None, "kernels": [
           {"kernel": "flash_fwd", "problems": [], "spill_stores": 0},
           {"kernel": "flash_bwd_dq", "problems": ["spills"],
            "spill_stores": 8, "spill_loads": 8}]},
      {"backend": "mosaic_gpu", "head_dim": 256, "dtype": "bfloat16",
       "variant": "causal", "target": "h100",
       "error": "ValueError: smem\nmore", "kernels": []},
  ]}
  got = gpu_check.report.summarise_compile(report)
  assert {k: got[k] for k in ("cases", "kernels", "problems",
                              "spilling_kernels")} == dict(
      cases=2, kernels=2, problems=2, spilling_kernels=1)
  assert got["failed"] == [
      "h100 triton 64 bfloat16 plain flash_bwd_dq: spills",
      "h100 mosaic_gpu 256 bfloat16 causal: ValueError: smem"]
  assert gpu_check.report.summarise_compile({"unexpected": 1}) == {}


@pytest.mark.parametrize("exit_code, message, status", [
    (0, "done", "ok"),
    (1, "1 problem(s)", "failed"),
    (2, "compile_check: cannot run here: no GPU", "skipped"),
    (2, "usage: compile_check.py [-h]", "failed"),  # argparse's exit 2
    (3, "crash", "failed"),
])
def test_compile_step_exit_status(gpu_check, monkeypatch, tmp_path,
                                  exit_code, message, status):
  fake = tmp_path / "compile_check.py"
  fake.write_text(textwrap.dedent(f"""
      import json, sys
      path = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--json")]
      json.dump({{"results": [{{"error": None, "kernels": [
          {{"kernel": "k", "problems": {["x"] if exit_code else []}}}]}}]}},
          open(path[0], "w"))
      print({message!r})
      sys.exit({exit_code})
  """))
  monkeypatch.setattr(gpu_check.steps, "COMPILE_CHECK", fake)
  ctx = gpu_check.steps.Context(out=tmp_path, dry_run=False,
                                test_timeout=10, workers=0)
  record = gpu_check.steps.step_compile(ctx, timeout=60)
  assert record["status"] == status, record
  assert record["returncode"] == exit_code
  assert record["problems"] == (1 if exit_code else 0)
  assert "--target=local" in record["command"]
  if status != "ok":
    assert record["reason"]


def test_stopped_at_timeout(gpu_check, tmp_path):
  log = tmp_path / "sleep.log"
  result = gpu_check.runner.run_logged(
      [sys.executable, "-c", "import time; print('hi', flush=True); "
       "time.sleep(60)"], log_path=log, timeout=1)
  assert result.timed_out and result.duration_s < 15
  text = log.read_text()
  assert "hi" in text and "timed out after 1 s" in text


def test_step_timeout_flag(gpu_check):
  args = gpu_check.parse_args(["--step-timeout=100,tests=300"])
  assert args.step_timeouts == {"env": 100, "compile": 100, "tests": 300,
                                "bench": 100}
  with pytest.raises(SystemExit):
    gpu_check.parse_args(["--steps=env,nope"])


def test_dry_run(tmp_path):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}
  # A roomier budget than the dry run's default (110 s): on a loaded 2-core
  # machine its steps can take twice as long as usual.
  proc = subprocess.run(
      [sys.executable, str(_SCRIPT), "--dry-run", "--budget=200",
       f"--out={tmp_path}"],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=260)
  output = proc.stdout + proc.stderr
  summary = json.loads((tmp_path / "summary.json").read_text())
  steps = summary["steps"]
  assert list(steps) == ["env", "compile", "tests", "bench"], output
  for name, step in steps.items():
    assert step["status"] in ("ok", "failed", "skipped"), (name, step)
    assert step["status"] == "ok" or step["reason"], (name, step)

  env_json = json.loads((tmp_path / "env.json").read_text())
  assert env_json["jax_version"] == importlib.metadata.version("jax")
  assert steps["env"]["status"] == "ok", output

  compile_step = steps["compile"]
  assert compile_step["status"] in ("ok", "skipped"), output
  if compile_step["status"] == "skipped":
    assert compile_step["reason"]

  tests = steps["tests"]
  assert tests["status"] == "ok", output
  assert tests["passed"] > 0 and tests["failed"] == tests["errors"] == 0
  assert (tmp_path / "pytest.xml").exists()

  bench = steps["bench"]
  assert bench["status"] == "ok", output
  report = json.loads((tmp_path / bench["runs"][0]["json"]).read_text())
  measured = [r for r in report["results"] if r["status"] == "ok"
              and r["ms"] and r["flops_per_s"]]
  assert measured, report["results"]
  assert bench["measured_cells"] >= len(measured)

  assert proc.returncode == 0, output
  assert "tests" in output and "passed" in output
