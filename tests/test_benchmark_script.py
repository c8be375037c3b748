"""Tests of scripts/benchmark.py on tiny shapes (the sweep, JSON, the check)."""

import dataclasses
import functools
import json
import pathlib
import subprocess
import sys

import jax
import pytest
from conftest import script_module

import pallas_fa


@pytest.fixture(scope="module")
def benchmark():
  with script_module("benchmark") as module:
    yield module


def _settings(benchmark, **overrides):
  kw = dict(
      grid="cpu", platform="cpu", seq_lens=[64], impls=["chunked"],
      peers=["xla"], head_dim=[16], heads=2, batch=1, causal="both",
      modes=["fwd", "fwd_bwd"], repeats=1, warmup=1, isolate=False,
      check_rows=16,  # 64 > 2 * 16: the sliced check with query positions.
      matmul_size=64,
  )
  kw.update(overrides)
  # One call per timed run: the timings of a test are not looked at.
  return dataclasses.replace(benchmark.options.make_settings(**kw),
                             min_repeat_s=0.0)


def _by_cell(report):
  return {(r["impl"], r["mode"], r["causal"]): r for r in report["results"]}


def test_sweep_writes_json_table_and_plot(benchmark, tmp_path):
  settings = _settings(benchmark, causal="true")
  report = benchmark.run(settings, argv=["benchmark.py"], verbose=False)
  cells = _by_cell(report)
  assert len(cells) == 2 * 2  # (chunked, jax:xla) x modes
  for (impl, mode, causal), r in cells.items():
    assert r["status"] == "ok", (impl, mode, causal, r["reason"])
    assert r["ms"] > 0 and r["flops_per_s"] > 0 and r["pct_matmul"] > 0
    assert r["xla_mem_bytes"] > 0
    want = 4 * 1 * 2 * 64 * 64 * 16 / (2 if causal else 1)
    assert r["flops"] == want * (3.5 if mode == "fwd_bwd" else 1)
    assert set(r["check"]) == (
        {"out", "dq", "dk", "dv"} if mode == "fwd_bwd" else {"out"})
    assert all(c["err"] <= c["tol"] for c in r["check"].values())
  for mode in ("fwd", "fwd_bwd"):
    assert cells[("jax:xla", mode, True)]["speedup_vs_xla"] == 1.0
    r = cells[("chunked", mode, True)]
    assert r["speedup_vs_xla"] == pytest.approx(
        cells[("jax:xla", mode, True)]["ms"] / r["ms"])
  assert report["matmul"]["flops_per_s"] > 0

  path = tmp_path / "out" / "bench.json"
  benchmark.report_lib.write_json(report, str(path))
  loaded = json.loads(path.read_text())
  for key in ("device", "device_kind", "platform", "jax_version",
              "jaxlib_version", "command", "flop_convention", "settings"):
    assert loaded["meta"][key] is not None, key
  assert loaded["results"][0].keys() >= {
      "impl", "kind", "mode", "batch", "seq_len", "heads", "head_dim",
      "causal", "dtype", "status", "ms", "flops", "flops_per_s",
      "speedup_vs_xla", "pct_matmul", "check", "times_ms"}

  table = benchmark.report_lib.format_table(report)
  assert "chunked" in table and "jax:xla" in table and "GFLOP/s" in table
  png = tmp_path / "bench.png"
  benchmark.report_lib.plot(report, str(png))
  assert png.read_bytes()[:4] == b"\x89PNG"


def test_check_catches_wrong_forward(benchmark, monkeypatch):
  real = pallas_fa.flash_attention

  def wrong(q, k, v, **kw):
    return real(q * 1.25, k, v, **kw)  # a wrong logit scale

  monkeypatch.setattr(pallas_fa, "flash_attention", wrong)
  settings = _settings(benchmark, causal="true", peer_max_seq=["32"])
  report = benchmark.run(settings, verbose=False)
  cells = _by_cell(report)
  for mode in ("fwd", "fwd_bwd"):
    r = cells[("chunked", mode, True)]
    assert r["status"] == "wrong" and r["ms"] is None, r
    assert r["reason"].startswith("out disagrees"), r["reason"]
    peer = cells[("jax:xla", mode, True)]
    assert peer["status"] == "skipped" and "memory" in peer["reason"], peer


def test_check_catches_wrong_gradient(benchmark, monkeypatch):
  real = pallas_fa.flash_attention

  def wrong(q, k, v, **kw):
    # Right output, dK off by half.
    @jax.custom_vjp
    def f(q, k, v):
      return real(q, k, v, **kw)

    def fwd(q, k, v):
      out, pullback = jax.vjp(functools.partial(real, **kw), q, k, v)
      return out, pullback

    def bwd(pullback, dout):
      dq, dk, dv = pullback(dout)
      return dq, 1.5 * dk, dv

    f.defvjp(fwd, bwd)
    return f(q, k, v)

  monkeypatch.setattr(pallas_fa, "flash_attention", wrong)
  settings = _settings(benchmark, causal="false", peers=["none"],
                       matmul_size=0)
  report = benchmark.run(settings, verbose=False)
  cells = _by_cell(report)
  assert cells[("chunked", "fwd", False)]["status"] == "ok"
  r = cells[("chunked", "fwd_bwd", False)]
  assert r["status"] == "wrong", r
  assert r["reason"].startswith("dk disagrees"), r["reason"]


@pytest.mark.slow
def test_isolated_cell_reports_peak_memory(benchmark):
  settings = _settings(benchmark, causal="false", modes=["fwd"],
                       peers=["none"], isolate=True, matmul_size=0)
  report = benchmark.run(settings, verbose=False)
  (r,) = report["results"]
  assert r["status"] == "ok", r["reason"]
  assert r["mem_source"] == "rss_peak"
  assert r["peak_bytes"] >= r["base_bytes"] > 0


def test_decode_benchmark_checks_every_candidate_against_the_plain_call(
    tmp_path):
  """scripts/decode_benchmark.py on a tiny shuffled-page cache: each timed
  decode is first compared with the float32 flash_attention on the same
  cache (a wrong page table would show as status "wrong")."""
  script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / (
      "decode_benchmark.py")
  out = tmp_path / "decode.json"
  proc = subprocess.run(
      [sys.executable, str(script), "--batch=2", "--seq_lens=128",
       "--heads=4", "--kv_heads=2", "--head_dims=16", "--new_tokens=2",
       "--page_size=32", "--dtype=bfloat16", "--repeats=1",
       f"--json={out}"],
      capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  report = json.loads(out.read_text())
  assert report["memory_bandwidth"]["peak"] == max(
      report["memory_bandwidth"]["copy"], report["memory_bandwidth"]["read"])
  (row,) = report["rows"]
  assert row["impl"] == "decode/chunked" and row["status"] == "ok", row
  assert 0 <= row["max_error"] <= row["tolerance"], row
  assert row["bytes_per_s"] > 0 and row["page_size"] == 32
