"""Tests of scripts/benchmark.py on tiny shapes (the sweep, JSON, the check)."""

import dataclasses
import functools
import json
import pathlib
import subprocess
import sys
import types

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


def test_sinks_time_each_implementation_with_sinks_too(benchmark):
  """--sinks adds '<impl>+sinks', checked against the reference with the
  same sinks (a wrong one would be reported "wrong", not "ok")."""
  settings = _settings(benchmark, causal="true", peers=["none"],
                       modes=["fwd_bwd"], sinks=True, matmul_size=0)
  cells = _by_cell(benchmark.run(settings, verbose=False))
  assert set(cells) == {("chunked", "fwd_bwd", True),
                        ("chunked+sinks", "fwd_bwd", True)}
  for r in cells.values():
    assert r["status"] == "ok", r["reason"]
  # The sinks matter: without them the check would fail.
  shape = settings.shapes[0]
  inputs = benchmark.cells.make_inputs(shape, settings.seed)
  plain = benchmark.cells.make_reference(shape, inputs, 16, False)
  sunk = benchmark.cells.make_reference(shape, inputs, 16, False, True)
  assert abs(plain.f32[0] - sunk.f32[0]).max() > 0.1


@pytest.mark.slow  # A child process per cell: CI runs it in the slow leg.
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
  # No cuDNN on a CPU: its ratio is None and has no column.
  assert all(r["speedup_vs_cudnn"] is None for r in report["results"])
  assert "vs xla" in table and "vs cudnn" not in table

  markdown = benchmark.report_lib.format_markdown(report)
  lines = markdown.splitlines()
  assert lines[2] == "| mode | causal | H | T | chunked | jax:xla |"
  rows = [line for line in lines if line.startswith("| fwd")]
  assert len(rows) == 2  # fwd, fwd_bwd (causal only)
  for row in rows:
    mode, causal, h, t, ours, peer = (c.strip() for c in row.strip("|")
                                      .split("|"))
    r = cells[("chunked", mode, True)]
    assert (causal, h, t) == ("yes", "16", "64")
    assert ours == (f"{r['flops_per_s'] / 1e9:.1f} "
                    f"({r['speedup_vs_xla']:.2f}x)")
    assert peer.endswith("(1.00x)")
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


def test_float8_cells_are_checked_on_the_dequantized_inputs(
    benchmark, monkeypatch):
  """--dtype=float8_e4m3fn: the implementation gets the float8 values and
  their per-head scales; its cells, '<impl>+e4m3', forward only and with no
  peers, are checked against the attention of the dequantized inputs (a
  wrong result is reported "wrong", not timed), counted as bf16's FLOPs,
  and their ratios are against the bf16 cells of a merged earlier run."""
  fp8 = "float8_e4m3fn"
  calls = []
  real = pallas_fa.flash_attention

  def recording(q, k, v, **kw):
    calls.append((q.dtype, k.dtype, v.dtype,
                  *(kw.get(f"{n}_scale") for n in ("query", "key", "value"))))
    return real(q, k, v, **kw)

  monkeypatch.setattr(pallas_fa, "flash_attention", recording)
  bf16 = benchmark.run(_settings(benchmark, dtype="bfloat16", modes=["fwd"],
                                 matmul_size=0), verbose=False)
  assert calls and all(c[0] == jax.numpy.bfloat16 for c in calls)
  calls.clear()
  # The float8 defaults: fwd only, no peers.
  settings = _settings(benchmark, dtype=fp8, modes=None, peers=None)
  assert settings.modes == ("fwd",)
  assert [c.label for c in settings.candidates] == ["chunked"]
  report = benchmark.run(settings, verbose=False, earlier=bf16)
  assert calls
  for call in calls:
    assert all(d == jax.numpy.float8_e4m3fn for d in call[:3])
    assert all(s.shape == (1, 1, 2) and s.dtype == jax.numpy.float32
               for s in call[3:])  # Per head: [B, 1, N].
  got = {(r["impl"], r["dtype"], r["causal"]): r for r in report["results"]}
  assert set(got) == {(impl, dtype, causal) for causal in (False, True)
                      for impl, dtype in (("chunked", "bfloat16"),
                                          ("jax:xla", "bfloat16"),
                                          ("chunked+e4m3", fp8))}
  for causal in (False, True):
    r = got[("chunked+e4m3", fp8, causal)]
    assert r["status"] == "ok" and r["ms"] > 0, r
    assert r["mode"] == "fwd" and set(r["check"]) == {"out"}
    assert r["check"]["out"]["err"] <= r["check"]["out"]["tol"]
    plain = got[("chunked", "bfloat16", causal)]
    assert r["flops"] == plain["flops"]
    assert r["speedup_vs_bf16"] == pytest.approx(plain["ms"] / r["ms"])
    assert r["speedup_vs_xla"] == pytest.approx(
        got[("jax:xla", "bfloat16", causal)]["ms"] / r["ms"])
    assert plain["speedup_vs_bf16"] is None
  markdown = benchmark.report_lib.format_markdown(report)
  assert "| chunked | jax:xla | chunked+e4m3 |" in markdown
  assert "x bf16)" in markdown and "bfloat16, float8_e4m3fn" in markdown
  assert "vs bf16" in benchmark.report_lib.format_table(report)

  # A wrong result (the value scales dropped) is reported, not timed.
  monkeypatch.setattr(
      pallas_fa, "flash_attention",
      lambda q, k, v, **kw: real(q, k, v, **{**kw, "value_scale": None}))
  wrong = benchmark.run(settings, verbose=False)
  for r in wrong["results"]:
    assert r["status"] == "wrong" and r["ms"] is None, r
    assert r["reason"].startswith("out disagrees"), r["reason"]
    assert "e4m3 rounding of P" in r["reason"]

  for bad in (dict(modes=["fwd", "fwd_bwd"]), dict(peers=["xla"])):
    with pytest.raises(ValueError, match="float8_e4m3fn"):
      _settings(benchmark, dtype=fp8, **{"modes": ["fwd"], **bad})


def _fake_tokamax(calls, *, honour_causal=True):
  """A stand-in for the `tokamax` package: its `dot_product_attention`
  records its keyword arguments and computes with `jax.nn`."""
  module = types.ModuleType("tokamax")

  def dot_product_attention(q, k, v, *, scale, is_causal, implementation):
    calls.append(dict(scale=scale, is_causal=is_causal,
                      implementation=implementation))
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=is_causal and honour_causal)

  module.dot_product_attention = dot_product_attention
  return module


def test_tokamax_peer_is_called_as_documented_and_checked(
    benchmark, monkeypatch):
  calls = []
  monkeypatch.setitem(sys.modules, "tokamax", _fake_tokamax(calls))
  settings = _settings(benchmark, causal="true", impls=[],
                       peers=["tokamax_xla_chunked", "tokamax_triton"],
                       matmul_size=0)
  report = benchmark.run(settings, verbose=False)
  cells = _by_cell(report)
  # Triton kernels are not timed in interpret mode: no cell at all.
  assert set(cells) == {("tokamax:xla_chunked", m, True)
                        for m in ("fwd", "fwd_bwd")}
  for r in cells.values():
    assert r["status"] == "ok" and r["kind"] == "peer", r
  assert calls and all(
      c == dict(scale=0.25, is_causal=True, implementation="xla_chunked")
      for c in calls)
  assert benchmark.cells.peer_unavailable_reason(
      "tokamax_mosaic", "cpu") == "a GPU kernel (needs a GPU)"

  # A peer with wrong results is reported as wrong, not timed.
  monkeypatch.setitem(sys.modules, "tokamax",
                      _fake_tokamax([], honour_causal=False))
  report = benchmark.run(settings, verbose=False)
  for r in report["results"]:
    assert r["status"] == "wrong" and r["ms"] is None, r


def test_missing_tokamax_is_reported_not_raised(benchmark, monkeypatch):
  monkeypatch.setitem(sys.modules, "tokamax", None)  # import fails
  reason = benchmark.cells.peer_unavailable_reason(
      "tokamax_xla_chunked", "cpu")
  assert reason.startswith("cannot import tokamax"), reason
  settings = _settings(benchmark, peers=["tokamax_xla_chunked"],
                       matmul_size=0)
  report = benchmark.run(settings, verbose=False)
  assert {r["impl"] for r in report["results"]} == {"chunked"}


def _fake_cudnn_fp8(calls, *, fp8=True):
  """A stand-in for jax's private cuDNN attention module: with `fp8`, its
  `dot_product_attention(..., fp8_params=, use_fp8=True)` records its
  arguments and computes with `jax.nn` on the descaled inputs, writing the
  output scaled by scale_o in the inputs' float8 dtype like cuDNN."""
  module = types.ModuleType("fused_attention_stablehlo")
  module.MaskType = types.SimpleNamespace(NO_MASK="no_mask", CAUSAL="causal")
  if not fp8:  # jax 0.10's: no FP8 path.
    module.dot_product_attention = lambda query, key, value, *, scale: None
    return module
  module.fp8_params_keys = ["amax_dQ", "descale_q", "descale_k", "descale_v",
                            "descale_s", "scale_s", "scale_o", "scale_dQ"]

  def dot_product_attention(query, key, value, bias=None, mask=None,
                            fp8_params=None, *, scale=1.0, mask_type=None,
                            qkv_layout="BTNH", use_fp8=False):
    params = fp8_params
    calls.append(dict(dtypes=(query.dtype, key.dtype, value.dtype),
                      keys=sorted(params), scale=scale, mask_type=mask_type,
                      layout=qkv_layout, use_fp8=use_fp8,
                      shapes={p.shape for p in params.values()}))
    descaled = [x.astype(jax.numpy.float32) * params[f"descale_{n}"].reshape(())
                for x, n in ((query, "q"), (key, "k"), (value, "v"))]
    out = jax.nn.dot_product_attention(
        *descaled, scale=scale, is_causal=mask_type == "causal")
    amax = jax.numpy.ones((1, 1, 1, 1), jax.numpy.float32)
    return (out * params["scale_o"].reshape(())).astype(query.dtype), amax, amax

  module.dot_product_attention = dot_product_attention
  return module


def test_cudnn_fp8_peer_is_feature_detected_not_raised(
    benchmark, monkeypatch):
  cells = benchmark.cells
  assert cells.peer_unavailable_reason(
      "cudnn_fp8", "cpu") == "cuDNN runs only on GPU"
  monkeypatch.setitem(sys.modules, cells.CUDNN_FP8_MODULE,
                      _fake_cudnn_fp8([], fp8=False))
  reason = cells.peer_unavailable_reason("cudnn_fp8", "gpu")
  assert "has no cuDNN FP8 attention" in reason, reason
  monkeypatch.setitem(sys.modules, cells.CUDNN_FP8_MODULE, None)
  reason = cells.peer_unavailable_reason("cudnn_fp8", "gpu")
  assert reason.startswith("cannot import jax._src.cudnn"), reason
  # Here (a CPU): our float8 cells only, no ratio, nothing raised.
  settings = _settings(benchmark, dtype="float8_e4m3fn", modes=["fwd"],
                       peers=["cudnn_fp8"], matmul_size=0)
  assert [c.label for c in settings.candidates] == ["chunked",
                                                    "jax:cudnn_fp8"]
  report = benchmark.run(settings, verbose=False)
  assert {r["impl"] for r in report["results"]} == {"chunked+e4m3"}
  assert all(r["status"] == "ok" and r["speedup_vs_cudnn_fp8"] is None
             for r in report["results"])
  # The float8 peer on bfloat16 inputs is refused.
  with pytest.raises(ValueError, match="take float8 inputs"):
    _settings(benchmark, peers=["cudnn_fp8"])


def test_cudnn_fp8_peer_gets_per_tensor_inputs_and_gives_the_ratio(
    benchmark, monkeypatch):
  calls = []
  cells = benchmark.cells
  monkeypatch.setitem(sys.modules, cells.CUDNN_FP8_MODULE,
                      _fake_cudnn_fp8(calls))
  real = cells.peer_unavailable_reason
  monkeypatch.setattr(  # As on a GPU.
      cells, "peer_unavailable_reason",
      lambda name, platform: real(name, "gpu" if name == "cudnn_fp8"
                                  else platform))
  settings = _settings(benchmark, dtype="float8_e4m3fn", modes=["fwd"],
                       peers=["cudnn_fp8"], matmul_size=0)
  report = benchmark.run(settings, verbose=False)
  got = _by_cell(report)
  assert set(got) == {(label, "fwd", causal) for causal in (False, True)
                      for label in ("chunked+e4m3", "jax:cudnn_fp8+e4m3")}
  for r in report["results"]:
    assert r["status"] == "ok" and r["ms"], r["reason"]
  for causal in (False, True):
    ours = got[("chunked+e4m3", "fwd", causal)]
    peer = got[("jax:cudnn_fp8+e4m3", "fwd", causal)]
    assert ours["speedup_vs_cudnn_fp8"] == pytest.approx(
        peer["ms"] / ours["ms"])
    assert peer["speedup_vs_cudnn_fp8"] is None
  fp8 = jax.numpy.dtype(jax.numpy.float8_e4m3fn)
  assert {c["mask_type"] for c in calls} == {"no_mask", "causal"}
  for call in calls:
    assert call["dtypes"] == (fp8,) * 3 and call["use_fp8"], call
    assert call["layout"] == "BTNH" and call["scale"] == 0.25, call
    assert call["keys"] == sorted(_fake_cudnn_fp8([]).fp8_params_keys)
    assert call["shapes"] == {(1, 1, 1, 1)}  # One scale per tensor.
  # Its inputs: the same normals, quantized per tensor.
  shape = settings.shapes[0]
  per_head = cells.make_inputs(shape, settings.seed)
  per_tensor = cells.make_inputs(shape, settings.seed, "tensor")
  assert per_tensor[0][1].shape == () and per_head[0][1].ndim == 3
  for a, b in zip(per_head[:3], per_tensor[:3]):
    assert float(jax.numpy.max(jax.numpy.abs(
        cells.dequantized(a) - cells.dequantized(b)))) < 0.5
  markdown = benchmark.report_lib.format_markdown(report)
  assert "x cudnn fp8" in markdown, markdown
  assert "vs cudnn fp8" in benchmark.report_lib.format_table(report)


@pytest.mark.slow
def test_isolated_cell_reports_peak_memory(benchmark):
  settings = _settings(benchmark, causal="false", modes=["fwd"],
                       peers=["none"], isolate=True, matmul_size=0)
  report = benchmark.run(settings, verbose=False)
  (r,) = report["results"]
  assert r["status"] == "ok", r["reason"]
  assert r["mem_source"] == "rss_peak"
  assert r["peak_bytes"] >= r["base_bytes"] > 0


def _decode_benchmark(tmp_path, *flags) -> dict:
  """The JSON report of scripts/decode_benchmark.py on a tiny cache (B = 2,
  S = 128, N = 4, K = 2, H = 16, T_new = 2) with `flags`."""
  script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / (
      "decode_benchmark.py")
  out = tmp_path / "decode.json"
  proc = subprocess.run(
      [sys.executable, str(script), "--batch=2", "--seq_lens=128",
       "--heads=4", "--kv_heads=2", "--head_dims=16", "--new_tokens=2",
       "--repeats=1", "--matmul_size=128", f"--json={out}", *flags],
      capture_output=True, text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  return json.loads(out.read_text())


@pytest.mark.slow  # A child process per cell: CI runs it in the slow leg.
def test_decode_benchmark_checks_every_candidate_against_the_plain_call(
    tmp_path):
  """scripts/decode_benchmark.py on a tiny shuffled-page cache: each timed
  decode is first compared with the float32 flash_attention on the same
  cache (a wrong page table would show as status "wrong")."""
  report = _decode_benchmark(tmp_path, "--page_size=32", "--dtype=bfloat16")
  assert report["memory_bandwidth"]["peak"] == max(
      report["memory_bandwidth"]["copy"], report["memory_bandwidth"]["read"])
  (row,) = report["rows"]
  assert row["impl"] == "decode/chunked" and row["status"] == "ok", row
  assert 0 <= row["max_error"] <= row["tolerance"], row
  assert row["bytes_per_s"] > 0 and row["page_size"] == 32
  # One call a program on a CPU (`bench.repeated.default_calls`).
  assert row["calls_per_program"] == 1 and "ms_one_call" not in row, row
  # The roofline: the slower of the reads at the bandwidth and the FLOPs at
  # the matmul rate, both the fastest of their timings in the run (at the
  # start and before the cell).
  timings = report["probe_timings"]
  assert len(timings) == 2
  assert report["memory_bandwidth"]["peak"] == max(
      t["memory_bandwidth"]["peak"] for t in timings)
  assert report["matmul"]["flops_per_s"] == max(
      t["matmul"]["flops_per_s"] for t in timings)
  roofline_ms = 1e3 * max(
      row["kv_bytes"] / report["memory_bandwidth"]["peak"],
      row["flops"] / report["matmul"]["flops_per_s"])
  assert row["roofline_ms"] == pytest.approx(roofline_ms), row
  assert row["roofline_share"] == pytest.approx(
      row["roofline_ms"] / row["ms"]), row


@pytest.mark.long
@pytest.mark.slow  # A child process per cell: CI runs it in the slow leg.
def test_decode_benchmark_times_calls_per_program_in_turn(tmp_path):
  """--calls_per_program=3: every candidate, the peers too, is timed three
  calls to a jitted program, and its rates, shares and speed-up are of that
  time per call; its one-call time is beside it, and one timing phase
  holds the cell's candidates (timed in turn)."""
  report = _decode_benchmark(tmp_path, "--calls_per_program=3",
                             "--num_splits=default,2", "--dtype=float32")
  rows = report["rows"]
  assert [r["impl"] for r in rows] == [
      "decode/chunked", "decode/chunked:num_splits=2", "flash_attention",
      "jax_nn"]
  peak = report["memory_bandwidth"]["peak"]
  for row in rows:
    assert row["status"] == "ok", row
    assert row["calls_per_program"] == 3 and row["ms_one_call"] > 0, row
    assert row["bytes_per_s"] == pytest.approx(
        row["kv_bytes"] / (row["ms"] / 1e3)), row
    assert row["bandwidth_share"] == pytest.approx(
        row["bytes_per_s"] / peak), row
    assert row["roofline_share"] == pytest.approx(
        row["roofline_ms"] / row["ms"]), row
    assert row["decode_speedup"] == pytest.approx(
        row["ms"] / rows[0]["ms"]), row
  (timing,) = [p for p in report["timeline"] if p["phase"] == "timing"]
  assert timing["impl"] == ",".join(r["impl"] for r in rows), timing


def test_repeated_program_makes_each_call_its_own():
  """`bench.repeated.program`: `calls` calls of `fn` in one program, each
  with its own lengths (a `minimum` XLA cannot fold), their results summed;
  `fn` itself for one call. `time_in_turn` gives each entry its time per
  call and, with more than one call, its one-call time."""
  with script_module("decode_benchmark") as module:
    repeated = module.repeated
  traced = []

  def fn(q, k, v, lengths, table):
    del table
    traced.append(lengths)
    return q * k.sum() + v * lengths.sum()

  args = (jax.numpy.ones((2, 3)), jax.numpy.ones(4), jax.numpy.ones((2, 3)),
          jax.numpy.full((2,), 5, jax.numpy.int32), None)
  assert repeated.program(fn, 1) is fn
  out = repeated.program(fn, 3)(*args)
  assert len(traced) == 3 and out.dtype == jax.numpy.float32
  assert jax.numpy.allclose(out, 3 * fn(*args))
  twice = repeated.program(fn, 2)
  fields = repeated.time_in_turn([(twice, fn, args)] * 2, 2, 1)
  assert [sorted(f) for f in fields] == [
      ["calls_per_program", "ms", "ms_one_call"]] * 2
  assert all(f["calls_per_program"] == 2 and f["ms"] > 0 for f in fields)
  (one,) = repeated.time_in_turn([(fn, fn, args)], 1, 1)
  assert one["calls_per_program"] == 1 and "ms_one_call" not in one


@pytest.mark.slow  # A child process per cell: CI runs it in the slow leg.
def test_decode_benchmark_streaming_counts_only_the_keys_it_shows(tmp_path):
  """--window_sinks: decode_attention with the StreamingLLM mask_mod and
  both peers with the same dense mask agree with the float32 masked plain
  call, and the roofline's bytes are those of the keys a new token sees:
  at S = 128, T_new = 2, W = 16 and 4 sinks, keys 111..127 and 0..3 (21 per
  sequence)."""
  rows = _decode_benchmark(tmp_path, "--window_sinks=16,4",
                           "--dtype=float32")["rows"]
  assert {r["impl"] for r in rows} == {
      "decode/chunked", "flash_attention", "jax_nn"}
  for row in rows:
    assert row["status"] == "ok", row
    assert 0 <= row["max_error"] <= row["tolerance"], row
    assert row["window_sinks"] == [16, 4]
    assert row["kv_bytes"] == 2 * (2 * 21) * 2 * 16 * 4, row
    assert row["flops"] == 4 * (2 * 21) * 4 * 2 * 16, row


def test_rounds_time_the_peers_in_turn_and_keep_the_fastest(
    benchmark, monkeypatch):
  """--rounds=3: every candidate of a (shape, mode) is run once per round,
  in turn, and keeps the record of its fastest round (all rounds' times
  listed); a failed round is reported as the failure."""
  settings = _settings(benchmark, causal="true", modes=["fwd"], rounds=3,
                       matmul_size=0)
  order = []
  times = {"chunked": iter([5.0, 1.0, 3.0]), "xla": iter([2.0, 9.0, 4.0])}

  def fake_run_cell(candidate, shape, mode, inputs, ref, settings):
    del inputs, ref, settings
    order.append(candidate.name)
    return {**benchmark.cells.base_record(candidate, shape, mode),
            "status": "ok", "reason": "", "ms": next(times[candidate.name])}

  monkeypatch.setattr(benchmark.cells, "run_cell", fake_run_cell)
  report = benchmark.run(settings, verbose=False)
  assert order == ["chunked", "xla"] * 3
  cells = _by_cell(report)
  assert cells[("chunked", "fwd", True)]["ms"] == 1.0
  assert cells[("chunked", "fwd", True)]["rounds_ms"] == [5.0, 1.0, 3.0]
  assert cells[("jax:xla", "fwd", True)]["ms"] == 2.0
  assert "fastest of 3 rounds" in report["meta"]["timing"]
  failed = benchmark.fastest_round([
      {"status": "ok", "ms": 1.0},
      {"status": "error", "ms": None, "reason": "boom"}])
  assert failed["status"] == "error"
  with pytest.raises(ValueError, match="rounds"):
    _settings(benchmark, rounds=0)


def test_the_matmul_ceiling_is_timed_in_every_round_and_keeps_its_fastest(
    benchmark, monkeypatch):
  """The ceiling is timed at the start and again before every round; the
  report keeps the fastest timing (all listed), and every cell's %mm is
  taken against it, cells recorded before it included."""
  settings = _settings(benchmark, causal="true", modes=["fwd"], rounds=3,
                       matmul_size=64, peers=["none"])
  events = []
  rates = iter([100.0, 50.0, 200.0, 25.0])  # The start, then each round.

  def fake_ceiling(size, dtype, **kw):
    del kw
    events.append("matmul")
    rate = next(rates)
    return {"size": size, "dtype": dtype, "ms": 1e3 / rate,
            "flops_per_s": rate}

  def fake_run_cell(candidate, shape, mode, inputs, ref, settings):
    del inputs, ref, settings
    events.append(candidate.name)
    record = benchmark.cells.base_record(candidate, shape, mode)
    return {**record, "status": "ok", "reason": "", "ms": 2.0,
            "flops_per_s": 40.0}

  monkeypatch.setattr(benchmark.cells, "matmul_ceiling", fake_ceiling)
  monkeypatch.setattr(benchmark.cells, "run_cell", fake_run_cell)
  report = benchmark.run(settings, verbose=False)
  assert events == ["matmul"] + ["matmul", "chunked"] * 3
  assert report["matmul"]["flops_per_s"] == 200.0
  assert report["matmul"]["timings_ms"] == [10.0, 20.0, 5.0, 40.0]
  (r,) = report["results"]
  assert r["pct_matmul"] == pytest.approx(20.0)
  assert "fastest of 4 timings" in benchmark.report_lib.format_table(report)


@pytest.mark.slow  # A child process per cell: CI runs it in the slow leg.
def test_tiling_variants_and_references_read_back(benchmark, monkeypatch,
                                                  tmp_path):
  """An --impls entry NAME:FIELD=VALUE is a candidate of its own: the
  default tiling of each shape with that field replaced. With
  --reference_dir a second process reads each shape's reference back
  instead of computing it, and checks its cells against it all the same;
  the report says where each process's time went."""
  calls = []
  real = pallas_fa.flash_attention

  def recording(q, k, v, **kw):
    calls.append(kw.get("block_sizes"))
    return real(q, k, v, **kw)

  monkeypatch.setattr(pallas_fa, "flash_attention", recording)
  variant = "chunked:block_q=16:block_kv_bwd=32"
  settings = _settings(benchmark, causal="true", impls=["chunked", variant],
                       peers=["none"], matmul_size=0,
                       reference_dir=str(tmp_path / "refs"))
  report = benchmark.run(settings, verbose=False)
  cells = _by_cell(report)
  assert set(cells) == {(label, mode, True) for label in ("chunked", variant)
                        for mode in ("fwd", "fwd_bwd")}
  assert all(r["status"] == "ok" for r in cells.values()), cells
  default = benchmark.cells.api.get_backend("chunked").default_block_sizes(
      q_len=64, kv_len=64, head_dim=16, dtype=jax.numpy.float32,
      is_causal=True)
  assert dataclasses.replace(default, block_q=16, block_kv_bwd=32) in calls
  assert None in calls  # The plain candidate: no block_sizes at all.
  (saved,) = (tmp_path / "refs").iterdir()
  assert saved.suffix == ".npz"

  (timeline,) = report["timelines"]
  assert timeline["candidates"] == ["chunked", variant]
  phases = [p["phase"] for p in timeline["phases"]]
  for phase in ("device_init", "inputs", "reference", "compile", "check",
                "warmup", "timing"):
    assert phase in phases, phases
  (ref,) = [p for p in timeline["phases"] if p["phase"] == "reference"]
  assert ref["loaded"] is False
  starts = [p["start_s"] for p in timeline["phases"]]
  assert starts == sorted(starts) and starts[0] >= 0
  assert set(cells[(variant, "fwd_bwd", True)]["phases_s"]) == {
      "compile", "check", "warmup", "timing"}

  # Another process: the reference is read back, not computed.
  def no_reference(*args, **kwargs):
    raise AssertionError("the reference was computed again")

  monkeypatch.setattr(benchmark.cells, "reference_results", no_reference)
  again = benchmark.run(settings, verbose=False, earlier=report)
  assert all(r["status"] == "ok" for r in again["results"])
  assert len(again["timelines"]) == 2
  (ref,) = [p for p in again["timelines"][1]["phases"]
            if p["phase"] == "reference"]
  assert ref["loaded"] is True

  # A wrong result is still caught against the reference read back.
  monkeypatch.setattr(pallas_fa, "flash_attention",
                      lambda q, k, v, **kw: real(q * 1.25, k, v, **kw))
  wrong = benchmark.run(settings, verbose=False)
  assert {r["status"] for r in wrong["results"]} == {"wrong"}

  for bad in ("chunked:no_such_field=1", "chunked:block_q", "nope:x=1"):
    with pytest.raises(ValueError):
      _settings(benchmark, impls=[bad])


@pytest.fixture(scope="module")
def readme_performance():
  with script_module("readme_performance") as module:
    yield module


def test_readme_performance_section_is_what_the_committed_jsons_give(
    readme_performance):
  """README.md's Performance section equals what the generator makes of the
  committed JSONs, so a new result file or an edit by hand cannot leave it
  stale (fix: `python scripts/readme_performance.py`)."""
  m = readme_performance
  readme = (m.REPO / "README.md").read_text()
  section = m.render(m.REPO / m.RESULTS)
  assert m.replace_section(readme, section) == readme, (
      "README.md's Performance section is stale: run "
      "python scripts/readme_performance.py")
  # It speaks of the repository's own files, never of this machine's.
  assert str(m.REPO) not in section and "](/" not in section
  history = [run[k] for run in m.SOURCES["gpu_history"]
             for k in ("notes", "plot") if k in run]
  environment = m.SOURCES["gpu_environment"]
  for name in (*m.SOURCES["gpu_bench"], *m.SOURCES["gpu_forms"],
               m.SOURCES["gpu_summary"], *([environment] * bool(environment)),
               m.SOURCES["gpu_notes"], *history, m.SOURCES["cpu_bench"],
               m.SOURCES["cpu_plot"]):
    assert name in section, name
    assert (m.REPO / m.RESULTS / name).is_file(), name


def _copy_results(m, tmp_path):
  """The committed JSONs under tmp_path, in their folders."""
  results = m.REPO / m.RESULTS
  for source in results.rglob("*.json"):
    copy = tmp_path / source.relative_to(results)
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(source.read_text())
  return results


def _gpu_table(section):
  """{(mode, causal, T): {header: cell}} of the section's first table."""
  lines = [line for line in section.splitlines() if line.startswith("|")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  table = {}
  for line in lines[2:]:
    if not line.startswith("| ") or line.startswith("| candidate"):
      break
    cells = [c.strip() for c in line.strip("|").split("|")]
    table[tuple(cells[:3])] = dict(zip(header[3:], cells[3:]))
  return table


def test_readme_performance_gpu_table_is_the_runs_own(readme_performance):
  """Every cell of the GPU table, the backward-alone rows included, is the
  rate and cuDNN ratio that gpu_check.py's summary of the same run gives,
  under the column of the candidate that ran it; a cell the main file
  lost comes from the later process's file, starred, its ratio against
  the main file's cuDNN cell."""
  m = readme_performance
  table = _gpu_table(m.render(m.REPO / m.RESULTS))
  summary = json.loads(
      (m.REPO / m.RESULTS / m.SOURCES["gpu_summary"]).read_text())
  headers = dict(m.GPU_COLUMNS)
  renamed = m.GPU_RENAMED.get(m.SOURCES["gpu_bench"][0], {})
  rows = summary["steps"]["bench"]["bench"]["rows"]
  mode = {"fwd": "fwd", "fwd_bwd": "fwd+bwd", "bwd": "bwd alone"}
  compared = 0
  for row in rows:
    key = (mode[row["mode"]], "yes" if row["causal"] else "no", str(row["T"]))
    shown = {renamed.get(impl, impl): rate
             for impl, rate in row["rate"].items()
             if renamed.get(impl, impl) in headers}
    if set(shown) <= {m.GPU_PEER}:
      assert key not in table or "*" in " ".join(table[key].values()), key
      continue
    cells = table[key]
    for impl, rate in shown.items():
      cell = cells[headers[impl]]
      assert cell.startswith(f"{rate:.1f}") and "*" not in cell, (
          row, impl, cell)
      if impl in row["vs_cudnn"]:
        assert f"({row['vs_cudnn'][impl]:.2f}x)" in cell, (row, impl, cell)
      compared += 1
  assert compared > 20
  assert "split (reproducible)" in " ".join(headers.values())


def test_readme_performance_fills_lost_cells_from_a_later_file(
    readme_performance, tmp_path, monkeypatch):
  """A cell the main file lost comes from a later process's file, starred,
  its ratio against the main file's cuDNN cell (its time / theirs)."""
  m = readme_performance
  _copy_results(m, tmp_path)
  main = m.SOURCES["gpu_bench"][0]
  data = json.loads((tmp_path / main).read_text())
  fused = "mosaic_gpu:backward=fused"

  def lost(r):
    return (r["impl"] == fused and r["seq_len"] == 4096 and r["causal"]
            and r["mode"] == "fwd_bwd")
  moved = [r for r in data["results"] if lost(r)]
  assert moved
  later = {**data, "results": moved}
  data["results"] = [r for r in data["results"] if not lost(r)]
  (tmp_path / main).write_text(json.dumps(data))
  name = main.replace("bench.json", "bench_later.json")
  (tmp_path / name).write_text(json.dumps(later))
  monkeypatch.setitem(m.SOURCES, "gpu_bench", (main, name))
  table = _gpu_table(m.render(tmp_path))
  cell = table[("fwd+bwd", "yes", "4096")][dict(m.GPU_COLUMNS)[fused]]
  cudnn = next(r for r in data["results"]
               if r["impl"] == m.GPU_PEER and r["seq_len"] == 4096
               and r["causal"] and r["mode"] == "fwd_bwd")
  ratio = cudnn["ms"] / moved[0]["ms"]
  assert cell == f"{moved[0]['flops_per_s'] / 1e12:.1f} ({ratio:.2f}x)*", (
      cell)


def test_readme_performance_not_measured_follows_the_data(
    readme_performance, tmp_path):
  """The not-measured line names what the run planned but lost, and names a
  variant again once its results are gone."""
  m = readme_performance
  _copy_results(m, tmp_path)
  section = " ".join(m.render(tmp_path).split())
  # Lost to this run's deadlines, or never timed.
  for lost in ("JAX's Pallas `mha`", "H = 64 and 256",
               "causal head sections"):
    assert lost in section, lost
  for measured in ("causal against cuDNN", "cuDNN's FP8 forward",
                   "float8 (e4m3) inputs", "the decode cache forms at"):
    assert measured not in section, measured
  name = m.SOURCES["gpu_bench"][0]
  data = json.loads((tmp_path / name).read_text())
  data["results"] = [r for r in data["results"]
                     if not r["impl"].endswith("+e4m3")]
  (tmp_path / name).write_text(json.dumps(data))
  section = " ".join(m.render(tmp_path).split())
  assert "float8 (e4m3) inputs" in section
  assert "cuDNN's FP8 forward" in section


def test_readme_performance_versions_from_the_summary_first(
    readme_performance, tmp_path, monkeypatch):
  """The toolchain comes from gpu_check.py's env record where its env step
  ran, from environment.json where it was skipped; a ValueError names the
  file and field where neither has it."""
  m = readme_performance
  _copy_results(m, tmp_path)
  section = " ".join(m.render(tmp_path).split())
  assert "cuDNN 9.19, ptxas 13.0, commit `07213ac`" in section
  # A run whose env step was skipped names a separate environment.json.
  env_name = "h200_b85705a/environment.json"
  monkeypatch.setitem(m.SOURCES, "gpu_environment", env_name)
  summary_name = m.SOURCES["gpu_summary"]
  summary = json.loads((tmp_path / summary_name).read_text())
  summary["steps"]["env"]["env"] = {
      "cuda_runtime": 13010, "cudnn": 92000, "commit": "0123456789",
      "ptxas": "Cuda compilation tools, release 13.1, V13.1.80"}
  (tmp_path / summary_name).write_text(json.dumps(summary))
  section = " ".join(m.render(tmp_path).split())
  assert ("CUDA runtime 13.1, cuDNN 9.20, ptxas 13.1, commit `0123456`"
          ) in section
  del summary["steps"]["env"]["env"]
  (tmp_path / summary_name).write_text(json.dumps(summary))
  section = " ".join(m.render(tmp_path).split())
  assert "cuDNN 9.19, ptxas 13.0, commit `b85705a`" in section
  env = json.loads((tmp_path / env_name).read_text())
  del env["ptxas"]
  (tmp_path / env_name).write_text(json.dumps(env))
  with pytest.raises(ValueError, match=rf"^{env_name}: .*'ptxas'.*"
                     rf"{summary_name}"):
    m.render(tmp_path)


def test_readme_performance_names_the_decode_rows_calls_a_program(
    readme_performance, tmp_path):
  """A decode.json row timed many calls to a jitted program is labelled
  with them, and its one-call time ("ms_one_call") is a line of its own at
  the share of the same bytes; a row with one call a program, named or
  not, keeps the plain label."""
  m = readme_performance
  results = _copy_results(m, tmp_path)
  name = m.SOURCES["gpu_decode"]
  data = json.loads((tmp_path / name).read_text())
  default = {}
  for r in data["rows"]:
    if r["impl"] == "decode/triton":
      r.update(calls_per_program=20, ms_one_call=2 * r["ms"])
      default[r["batch"]] = r
    else:
      r["calls_per_program"] = 1
  assert sorted(default) == [1, 8]
  (tmp_path / name).write_text(json.dumps(data))
  lines = m.render(tmp_path).splitlines()

  def line(label, cells):
    return f"| {label} | " + " | ".join(cells) + " |"

  in_loop = [m._decode_cell(default[b]["ms"], default[b]["bandwidth_share"])
             for b in (1, 8)]
  alone = [m._decode_cell(2 * default[b]["ms"],
                          default[b]["bandwidth_share"] / 2)
           for b in (1, 8)]
  assert line("default splits, 20 calls a program", in_loop) in lines
  assert line("default splits, one call a program", alone) in lines
  assert not any(x.startswith("| default splits |") for x in lines)
  assert any(x.startswith("| 64 splits |") for x in lines)
  assert not any(x.startswith("| 64 splits, ") for x in lines)
  # Rows that name no calls_per_program: one call a program.
  for r in data["rows"]:
    r.pop("calls_per_program"), r.pop("ms_one_call", None)
  (tmp_path / name).write_text(json.dumps(data))
  plain = m.render(tmp_path).splitlines()
  assert any(x.startswith("| default splits |") for x in plain)
  assert not any(" calls a program |" in x for x in plain
                 if x.startswith(("| default", "| 64")))
  # The committed run timed 20 calls a program.
  committed = m.render(results).splitlines()
  assert any(x.startswith("| default splits, 20 calls a program |")
             for x in committed)


@pytest.mark.parametrize("name, path", [
    ("h200_07213ac/bench.json", ("results", 0, "flops_per_s")),
    ("h200_07213ac/bench.json", ("results", 16, "speedup_vs_bf16")),
    ("h200_07213ac/summary_speed.json", ("date_utc",)),
    ("h200_07213ac/summary_speed.json", ("steps", "env", "env", "cudnn")),
    ("h200_07213ac/decode.json", ("rows", 0, "bandwidth_share")),
    ("h200_07213ac/decode_forms.json", ("rows", 0, "kv_bytes")),
    ("h200_07213ac/decode_forms.json", ("ratios", 0, "target")),
    ("h200_07213ac/decode_forms_paged_tnew.json", ("ratios", 0, "met")),
    ("h200_b85705a/environment.json", ("commit",)),
    ("h200_ff8094b/summary.json", ("steps", "env", "env", "commit")),
    ("cpu_tokamax.json", ("meta", "jax_version")),
    ("decode_cpu.json", ("rows", 0, "bandwidth_share")),
])
def test_readme_performance_names_the_file_that_lacks_a_field(
    readme_performance, tmp_path, name, path):
  m = readme_performance
  results = _copy_results(m, tmp_path)
  data = json.loads((tmp_path / name).read_text())
  parent = data
  for key in path[:-1]:
    parent = parent[key]
  del parent[path[-1]]
  (tmp_path / name).write_text(json.dumps(data))
  with pytest.raises(ValueError, match=rf"^{name}: .*{path[-1]}"):
    m.render(tmp_path)
  # The untouched copies still give the committed section.
  (tmp_path / name).write_text((results / name).read_text())
  assert m.render(tmp_path) == m.render(results)


@pytest.mark.long
@pytest.mark.slow  # 40 s: every cache form's cells on chunked
def test_decode_cache_forms_check_then_time_each_form(monkeypatch):
  """`decode_benchmark.py --cache_forms`' cells on tiny shapes: every
  candidate agrees with its plain equivalent before it is timed, the
  target ratios are computed from the run's own times, and a wrong result
  is reported as "wrong", a raising one as "failed", neither timed."""
  with script_module("decode_benchmark") as module:
    forms = module.decode_forms
    row = dict(s=256, num_kv=2, n=4, h=16)
    rows = forms.dtype_rows("chunked", 1, **row)
    rows += forms.prefix_rows("chunked", 1, b=3, s_p=64, s_own=32, n=4,
                              num_kv=2, h=16)
    rows += forms.paged_rows("chunked", 1, **row)
    # Two calls a timed program (an accelerator's default is 20); 4 query
    # heads a K/V head, so that T_new = 16 fills a 64-row tile.
    rows += forms.tnew_rows("chunked", 1, calls=2, **dict(row, n=8))
    rows += forms.latent_rows("chunked", 1, s=64, n=4, h=24, hv=16)
    assert [(r["form"], r["impl"]) for r in rows] == [
        ("dtype", "bfloat16"), ("dtype", "int8"),
        ("dtype", "float8_e4m3fn"), ("prefix", "materialised"),
        ("prefix", "prefix"), ("prefix", "prefix_two_merges"),
        ("prefix", "prefix_pass_alone"),
        ("prefix", "own_parts_alone"),
        ("paged", "contiguous"), ("paged", "paged_16"), ("paged", "paged_64"),
        ("tnew", "t_new_1"), ("tnew", "t_new_16"),
        ("tnew", "t_new_16_int8"), ("latent", "latent"),
        ("latent", "separate_values"), ("latent", "one_read_floor")]
    for r in rows:
      assert r["status"] == "ok", r
      assert 0 <= r["max_error"] <= r["tolerance"], r
      assert r["kv_bytes"] > 0, r
    by_name = {r["impl"]: r for r in rows}
    # bfloat16 queries unless the cell says otherwise.
    assert by_name["int8"]["query_dtype"] == "bfloat16"
    assert by_name["float8_e4m3fn"]["cache_dtype"] == "float8_e4m3fn"
    assert by_name["t_new_16"]["new_tokens"] == 16
    assert by_name["t_new_16_int8"]["cache_dtype"] == "int8"
    assert by_name["t_new_16"]["calls_per_program"] == 2
    assert by_name["t_new_16"]["ms_one_call"] > 0
    assert by_name["int8"]["calls_per_program"] == 1
    assert "ms_one_call" not in by_name["int8"]
    ratios = {r["name"]: r for r in forms.ratios(rows)}
    # Every target but the triton-only cells' (warps, value chunks).
    assert set(ratios) == {name for name, *_ in forms.TARGETS} - {
        "prefix_vs_8_warps",
        "prefix_pass_vs_8_warps", "prefix_pass_vs_32_keys_8_warps",
        "tnew16_int8_vs_8_warps", "mosaic_gpu_vs_triton",
        "mosaic_gpu_paged_vs_contiguous", "tnew16_mosaic_gpu_vs_triton",
        "mosaic_gpu_int8_vs_bf16", "mosaic_gpu_int8_vs_triton",
        "mosaic_gpu_int8_two_consumers", "mosaic_gpu_int8_128_keys",
        "mosaic_gpu_float8_float16_products", "mosaic_gpu_float8_vs_bf16",
        "mosaic_gpu_float8_quantized_query_vs_widened",
        "mosaic_gpu_float8_quantized_query_vs_bf16",
        "mosaic_gpu_int8_quantized_query_vs_widened",
        "mosaic_gpu_int8_quantized_query_vs_bf16", "mosaic_gpu_pdl_merge",
        "mosaic_gpu_float8_pdl_merge", "latent_mosaic_gpu_vs_triton",
        "latent_mosaic_gpu_vs_separate",
        "latent_mosaic_gpu_paged_vs_contiguous",
        "prefix_mosaic_gpu_vs_materialised",
        "prefix_pass_mosaic_gpu_vs_triton"}
    ms = {(r["form"], r["impl"]): r["ms"] for r in rows}
    assert ratios["prefix_vs_materialised"]["ratio"] == pytest.approx(
        ms["prefix", "prefix"] / ms["prefix", "materialised"])
    assert ratios["int8_vs_bf16"]["ratio"] == pytest.approx(
        ms["dtype", "int8"] / ms["dtype", "bfloat16"])
    assert "int8_vs_bf16: int8 / bfloat16" in forms.format_table(rows)
    assert forms.selected(["all"]) == list(forms.FORMS)
    assert forms.selected(["tnew", "dtype"]) == ["tnew", "dtype"]
    with pytest.raises(ValueError, match="unknown.*'pages'.*paged"):
      forms.selected(["pages"])
    real = pallas_fa.decode_attention

    def wrong_or_raising(*a, **kw):
      if kw.get("_fold_prefix") == "two_merges":
        raise NotImplementedError("no such path here")
      return real(*a, **kw) * (1.5 if "prefix_key" in kw else 1)

    monkeypatch.setattr(pallas_fa, "decode_attention", wrong_or_raising)
    (_, prefix, two, alone, own) = forms.prefix_rows(
        "chunked", 1, b=3, s_p=64, s_own=32, n=4, num_kv=2, h=16)
    # The prefix alone is checked against attention over the prefix only;
    # the own parts, without a prefix, are right.
    assert alone["status"] == "wrong" and own["status"] == "ok", alone
    assert prefix["status"] == "wrong" and "ms" not in prefix, prefix
    assert two["status"] == "failed" and "ms" not in two, two
    assert "NotImplementedError: no such path" in two["reason"]


@pytest.mark.slow  # the triton kernels interpreted
def test_prefix_cells_on_triton_time_the_replaced_pass_tilings():
  """On triton the prefix form adds the call and its pass alone with the
  folded tile's former 8 warps, the pass in 32-key blocks, and the call
  and its pass through mosaic_gpu's split kernel, each checked before it
  is timed, with its tiling or kernel in the row."""
  with script_module("decode_benchmark") as module:
    forms = module.decode_forms
    rows = forms.prefix_rows("triton", 1, b=3, s_p=64, s_own=64, n=4,
                             num_kv=2, h=64)
  by_name = {r["impl"]: r for r in rows}
  assert list(by_name) == [
      "materialised", "prefix", "prefix_two_merges", "prefix_pass_alone",
      "prefix_mosaic_gpu", "prefix_pass_alone_mosaic_gpu",
      "prefix_8_warps", "prefix_pass_alone_8_warps",
      "prefix_pass_alone_32_keys_8_warps", "own_parts_alone"]
  for r in rows:
    assert r["status"] == "ok" and 0 <= r["max_error"] <= r["tolerance"], r
  assert by_name["prefix_8_warps"]["prefix_num_warps"] == 8
  assert by_name["prefix_pass_alone_32_keys_8_warps"]["prefix_block_kv"] == 32
  assert by_name["prefix_mosaic_gpu"]["kernel"] == "mosaic_gpu"
  ratios = {r["name"]: r for r in forms.ratios(rows)}
  assert {"prefix_vs_8_warps", "prefix_pass_vs_8_warps",
          "prefix_pass_vs_32_keys_8_warps"} <= set(ratios)
  assert ratios["prefix_mosaic_gpu_vs_materialised"]["ratio"] == (
      pytest.approx(by_name["prefix_mosaic_gpu"]["ms"]
                    / by_name["materialised"]["ms"]))


@pytest.mark.slow  # the triton and Mosaic GPU kernels interpreted
def test_latent_cells_on_triton_time_the_mosaic_gpu_kernel():
  """On triton the latent form adds the latent cache through mosaic_gpu's
  split kernel (a unit per 256 value columns: one here), contiguous and
  as shuffled 64-key pages, each checked before it is timed, and their
  ratios to triton's latent and separate-value cells and to each other."""
  with script_module("decode_benchmark") as module:
    forms = module.decode_forms
    rows = forms.latent_rows("triton", 1, s=128, n=4, h=320, hv=256)
  by_name = {r["impl"]: r for r in rows}
  cell, paged = by_name["latent_mosaic_gpu"], by_name[
      "latent_mosaic_gpu_paged_64"]
  for c in (cell, paged):
    assert c["status"] == "ok" and 0 <= c["max_error"] <= c["tolerance"], c
    assert c["kernel"] == "mosaic_gpu" and c["ms"] > 0
  assert paged["page_size"] == 64
  ratios = {r["name"]: r for r in forms.ratios(rows)}
  for name, got, baseline in (
      ("latent_mosaic_gpu_vs_triton", cell, "latent"),
      ("latent_mosaic_gpu_vs_separate", cell, "separate_values"),
      ("latent_mosaic_gpu_paged_vs_contiguous", paged, "latent_mosaic_gpu")):
    assert ratios[name]["ratio"] == pytest.approx(
        got["ms"] / by_name[baseline]["ms"])


@pytest.mark.long
@pytest.mark.slow  # the triton and Mosaic GPU kernels interpreted
def test_dtype_cells_on_triton_time_the_mosaic_gpu_kernel():
  """On triton the dtype form adds the bfloat16 cache through mosaic_gpu's
  split kernel, contiguous and paged, and the int8 cache, each checked
  before it is timed, and their ratios to triton's and to each other."""
  with script_module("decode_benchmark") as module:
    forms = module.decode_forms
    rows = forms.dtype_rows("triton", 1, b=1, s=128, n=4, num_kv=2, h=64)
  by_name = {r["impl"]: r for r in rows}
  cell = by_name["mosaic_gpu_bfloat16"]
  assert cell["status"] == "ok" and 0 <= cell["max_error"] <= (
      cell["tolerance"]), cell
  assert cell["kernel"] == "mosaic_gpu" and cell["ms"] > 0
  paged = by_name["mosaic_gpu_paged_16"]
  assert paged["status"] == "ok" and paged["page_size"] == 16, paged
  ratios = {r["name"]: r for r in forms.ratios(rows)}
  assert ratios["mosaic_gpu_vs_triton"]["ratio"] == pytest.approx(
      cell["ms"] / by_name["bfloat16"]["ms"])
  assert ratios["mosaic_gpu_paged_vs_contiguous"]["ratio"] == (
      pytest.approx(paged["ms"] / cell["ms"]))
  int8 = by_name["mosaic_gpu_int8"]
  assert int8["status"] == "ok" and int8["cache_dtype"] == "int8", int8
  assert ratios["mosaic_gpu_int8_vs_triton"]["ratio"] == pytest.approx(
      int8["ms"] / by_name["int8"]["ms"])
  assert by_name["mosaic_gpu_int8_8_warps"]["status"] == "ok"
  assert by_name["mosaic_gpu_int8_8_warps"]["num_warps"] == 8
  wide = by_name["mosaic_gpu_int8_128_keys"]
  assert wide["status"] == "ok" and wide["block_kv"] == 128, wide
  assert ratios["mosaic_gpu_int8_128_keys"]["ratio"] == pytest.approx(
      wide["ms"] / int8["ms"])
  fp8, widened, bf16_products = (
      by_name[f"mosaic_gpu_float8_{x}"]
      for x in ("quantized_query", "per_tensor",
                "per_tensor_bfloat16_products"))
  for row in (fp8, widened, bf16_products):
    assert row["status"] == "ok" and row["scales"] == "tensor", row
  assert fp8["_quantized_query"] is True
  assert "_quantized_query" not in widened
  assert bf16_products["_float16_products"] is False
  assert ratios["mosaic_gpu_float8_float16_products"]["ratio"] == (
      pytest.approx(widened["ms"] / bf16_products["ms"]))
  assert ratios["mosaic_gpu_float8_quantized_query_vs_widened"]["ratio"] == (
      pytest.approx(fp8["ms"] / widened["ms"]))
  int8_query = by_name["mosaic_gpu_int8_quantized_query"]
  assert int8_query["status"] == "ok", int8_query
  assert ratios["mosaic_gpu_int8_quantized_query_vs_widened"]["ratio"] == (
      pytest.approx(int8_query["ms"] / int8["ms"]))
  # The merge launched under the split kernel, bfloat16 and float8.
  for name, base, ratio in (
      ("mosaic_gpu_bfloat16_pdl_merge", cell, "mosaic_gpu_pdl_merge"),
      ("mosaic_gpu_float8_per_tensor_pdl_merge", widened,
       "mosaic_gpu_float8_pdl_merge")):
    row = by_name[name]
    assert row["status"] == "ok" and row["_pdl_merge"] is True, row
    assert ratios[ratio]["ratio"] == pytest.approx(row["ms"] / base["ms"])


@pytest.mark.parametrize("argv, match", [
    (["--peers=bogus"], "--peers"),
    (["--implementations=xla"], "--implementations"),
    (["--seq_lens=128", "--page_size=7"], "--page_size"),
    (["--window_sinks=16"], "--window_sinks"),
    (["--heads=4", "--kv_heads=3"], "--heads=4"),
    (["--seq_lens=0"], "--seq_lens"),
    (["--new_tokens=0"], "--new_tokens"),
    (["--repeats=0"], "--repeats"),
    (["--num_splits=-2"], "--num_splits"),
    (["--cache_forms=bogus"], "--cache_forms"),
    (["--seq_lens=2", "--new_tokens=4"], "--new_tokens must not exceed"),
])
def test_decode_benchmark_names_bad_flags(argv, match):
  """Flag values no cell could run are usage errors before any timing."""
  with script_module("decode_benchmark") as module:
    flag_values = module.flags.FLAGS
    saved = flag_values.flags_into_string()
    try:
      flag_values(["decode_benchmark.py", *argv])
      with pytest.raises(module.app.UsageError, match=match):
        module.check_flags()
    finally:
      flag_values.unparse_flags()
      flag_values(["decode_benchmark.py", *saved.split()])


@pytest.mark.parametrize("dry_run", [False, True])
def test_decode_benchmark_accepts_the_windows_grid_flags(dry_run):
  """The GPU window's decode grid (`gpu/steps.DECODE_FLAGS`) passes the
  script's flag checks; its `--peers=none` times no peer."""
  with script_module("gpu_check") as gpu_check, \
      script_module("decode_benchmark") as module:
    steps = gpu_check.steps
    flag_values = module.flags.FLAGS
    saved = flag_values.flags_into_string()
    try:
      flag_values(["decode_benchmark.py", *steps.DECODE_FLAGS[dry_run]])
      module.check_flags()
      expected = [] if not dry_run else ["flash_attention"]
      assert module.named_peers() == expected
    finally:
      flag_values.unparse_flags()
      flag_values(["decode_benchmark.py", *saved.split()])
