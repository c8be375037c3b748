r"""Times pallas_fa's implementations against JAX's own attention kernels.

Every (implementation, shape, mode) cell is first checked against the float32
materialised reference (`pallas_fa.testing.reference`) on the same inputs,
then timed: the median of `--repeats` runs after warm-up (with `--rounds=R`,
the candidates of a (shape, mode) are timed R times in turn and each keeps its
fastest round: on a shared machine a slow spell then costs a round, not a
candidate's cell). The table reports
milliseconds, FLOP/s (GFLOP/s on CPU, TFLOP/s elsewhere), the percentage of the
machine's own matmul rate measured in the same run (timed at the start and
again in every round; its fastest counts), the speed-up against the
`jax.nn.dot_product_attention` peers measured in the same run,
`implementation="cudnn"` (on GPU) and `"xla"` (peer time / this time), and
peak memory. `--markdown` writes the same results as one Markdown table.
It and `--json` are rewritten after every cell, so a run stopped part-way
leaves the cells it finished; with `--merge` they also keep the cells of
earlier runs into the same files (one run per implementation, say, so that a
crash loses one implementation, not the table), and the ratios cover them
all.

FLOPs follow the FlashAttention convention: forward 4*B*N*T*S*H, halved for
causal attention when T == S; backward 2.5x forward, so forward+backward is
3.5x forward.

Peak memory: with `--isolate` (the default on CPU) each cell is timed in a
fresh child process, which reports its peak resident set size (`VmHWM` on
Linux; on GPU/TPU the device's `peak_bytes_in_use`). Without isolation the
table shows XLA's compiled memory estimate (arguments + outputs +
temporaries), marked with `~`.

Commands (from the repository root):

  # CPU, the foundation targets: float32, B=1, N=8, H=64, T=S in 512..4096,
  # causal and not, forward and forward+backward, chunked vs jax.nn xla.
  python scripts/benchmark.py --grid=cpu \
      --json=benchmarks/results/cpu.json --plot=benchmarks/results/cpu.png

  # GPU, the FlashAttention protocol: bfloat16, B*T = 16k tokens, N*H = 2048,
  # H in {64, 128, 256}, T in 512..16k, causal and not; peers jax.nn xla and
  # cudnn, JAX's Pallas `mha` and (Hopper) `attention_mgpu`, and tokamax's
  # triton and mosaic kernels where tokamax imports. One head dim per
  # command keeps each run short:
  python scripts/benchmark.py --grid=fa --head_dim=64 \
      --json=benchmarks/results/h100_d64.json \
      --plot=benchmarks/results/h100_d64.png \
      --markdown=benchmarks/results/h100_d64.md

  # A quick look at a few shapes:
  python scripts/benchmark.py --grid=cpu --seq_lens=256,512 --modes=fwd \
      --repeats=3 --noisolate

  # FP8 (e4m3) forward cells beside an earlier bf16 run of the same grid:
  # the float8 columns are labelled '<impl>+e4m3', with their speed-up
  # against cuDNN's bf16 cells and against their own bf16 cells.
  python scripts/benchmark.py --grid=fa --head_dim=128 \
      --impls=mosaic_gpu --dtype=float8_e4m3fn \
      --json=benchmarks/results/h100_d128.json --merge

Every preset value can be overridden by its flag (`--seq_lens`, `--impls`,
`--peers`, `--dtype`, `--batch`, `--heads`, `--head_dim`, `--causal`,
`--modes`, `--repeats`, ...). `--peers=none` times no peer. `--sinks` also
times each implementation with attention sinks, as `<impl>+sinks`.

`--dtype=float8_e4m3fn` times the implementations on float8 query/key/value:
bfloat16 normals quantized per head once per shape
(`pallas_fa.quantize_fp8`), each implementation called with the float8
values and their float32 scales (bfloat16 result), checked against the
attention of the dequantized inputs (the bfloat16 rule plus 2**-4 max|v|,
the rounding of P to e4m3). FLOPs as for bfloat16. Forward only (the
default --modes becomes fwd; fwd_bwd is an error: there is no gradient with
respect to float8 arrays), no bfloat16 peers and no matmul ceiling: the
peers' bfloat16 cells of another run, merged with `--merge`, are the float8
cells' baselines. The one float8 peer, `--peers=cudnn_fp8`, is cuDNN's FP8
attention forward (jax's private
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` with
`fp8_params`, where this JAX has it; a GPU only) on the same normals
quantized per tensor (cuDNN takes one scale per tensor, ours take one per
head), checked against the attention of its own dequantized inputs, its
output (float8 in cuDNN) dequantized to bfloat16 in the timed call; the
float8 cells of the same shape get `speedup_vs_cudnn_fp8` (its time / ours).

The options are declared once, in `bench/options.py`; the cells (candidates,
check, timing, isolation) are in `bench/cells.py`, the table, JSON and plot in
`bench/report.py`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable
from typing import Sequence

import jax
from absl import app
from absl import flags
from bench import cells
from bench import options
from bench import report as report_lib
from bench import timeline as timeline_lib

from pallas_fa import api

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """Defines the command-line flags, one per `options.OPTIONS` entry.

  Called only when this file runs as a script, so importing it (as the tests
  do) registers no global flags that could clash with another script's.
  Defined here rather than in `bench.options` so that `--help` lists them
  under this script.

  Args:
    flag_values: where to define them (a test parses a command line into
      its own `flags.FlagValues`).
  """
  for option in options.OPTIONS:
    if option.kind == "enum":
      flags.DEFINE_enum(option.name, option.default, option.choices,
                        option.help, flag_values=flag_values)
    else:
      define = getattr(flags, f"DEFINE_{option.kind}")
      define(option.name, option.default, option.help,
             flag_values=flag_values)


def _say(verbose: bool):
  return print if verbose else (lambda *a, **k: None)


def run(settings: options.Settings, argv: Sequence[str] | None = None,
        verbose: bool = True, earlier: dict | None = None,
        on_cell: Callable[[dict], None] | None = None,
        timeline: timeline_lib.Timeline | None = None) -> dict:
  """Runs the whole sweep.

  Args:
    settings: what to run (`options.make_settings`).
    argv: the command line recorded in the metadata (default sys.argv).
    verbose: print progress.
    earlier: a report of earlier runs to merge into (`--merge`): its cells
      stay unless this run measures the same one again, and its matmul
      ceiling serves if this run measures none.
    on_cell: called with the report so far after every cell.
    timeline: this process's phases so far (`main` records its start and
      imports); default a new one.

  Returns:
    {"meta": device, versions, command, settings; "matmul": the ceiling;
    "results": one record per cell (see `cells.run_cell`), with the speed-up
    against each `options.BASELINES` peer and the percentage of the matmul
    rate (the fastest of its timings: at the start and in every round);
    "timelines": one entry per process whose cells the report holds (this
    run's last), its phases with their start (seconds since the process
    started) and duration (`bench.timeline`): device initialisation, the
    matmul probe, each shape's inputs and reference, each cell's compile,
    check, warm-up and timing}.
  """
  timeline = timeline or timeline_lib.Timeline()
  with timeline.phase("device_init"):
    platform = api.platform()
    jax.devices()
  say = _say(verbose)
  candidates = []
  for c in settings.candidates:
    reason = (cells.peer_unavailable_reason(c.name, platform)
              if c.kind == "peer" else None)
    if reason:
      say(f"{c.label}: skipped ({reason})")
    else:
      candidates.append(c)

  dtype = settings.shapes[0].dtype if settings.shapes else "float32"

  # A float8 run measures no ceiling: a float8 product's rate would replace
  # the (slower) bfloat16 one that the merged bfloat16 cells are held to.
  matmul_size = 0 if options.is_fp8(dtype) else settings.matmul_size

  def probe():
    with timeline.phase("matmul_probe"):
      return cells.matmul_ceiling(
          matmul_size, dtype, repeats=settings.repeats,
          warmup=settings.warmup, seed=settings.seed,
          min_repeat_s=settings.min_repeat_s)

  ceiling = probe()
  if ceiling:
    say(f"matmul ceiling {ceiling['size']}^3 {dtype}: "
        f"{report_lib.rate(ceiling['flops_per_s'], platform)}")
  report = report_lib.merged(earlier, report_lib.meta(settings, argv),
                             ceiling)
  this_run = {"candidates": [options.cell_label(c.label, dtype)
                             for c in candidates],
              "head_dims": sorted({s.head_dim for s in settings.shapes})}
  report["timelines"].append(timeline.record(**this_run))

  def add(record: dict) -> None:
    report_lib.add_record(report, record)
    report["timelines"][-1] = timeline.record(**this_run)
    if on_cell is not None:
      on_cell(report)

  grads = "fwd_bwd" in settings.modes
  for shape in settings.shapes:
    # A float8 shape's inputs per scale granularity its candidates take
    # (`cells.input_granularity`): per head, per tensor for cuDNN's FP8.
    granularity = {c: (cells.input_granularity(c)
                       if options.is_fp8(shape.dtype) else "head")
                   for c in candidates}
    with timeline.phase("inputs", shape=str(shape)):
      inputs_of = {g: cells.make_inputs(shape, settings.seed, g)
                   for g in sorted(set(granularity.values()) or {"head"})}
      jax.block_until_ready(inputs_of)
    try:
      # One reference with sinks (`--sinks`), one without, for each set of
      # inputs; read back from --reference_dir where an earlier process
      # left it.
      refs = {}
      # (sinks, reference granularity) -> the inputs it is computed from.
      ref_inputs = {}
      for c in candidates:
        ref_inputs.setdefault(
            (c.sinks, cells.reference_granularity(granularity[c])),
            granularity[c])
      for key, inputs_key in ref_inputs.items():
        start = timeline.now_s()
        refs[key] = cells.make_reference(
            shape, inputs_of[inputs_key], settings.check_rows, grads,
            key[0], seed=settings.seed, directory=settings.reference_dir,
            granularity=key[1])
        timeline.add("reference", start, timeline.now_s() - start,
                     shape=str(shape), loaded=refs[key].loaded)
    except Exception as e:  # The reference itself did not fit.
      status, reason = cells.classify(e)
      say(f"{shape}: reference failed ({reason}); cells skipped")
      for mode in settings.modes:
        for c in candidates:
          add({**cells.base_record(c, shape, mode), "status": "skipped",
               "reason": f"reference: {reason}"})
      continue
    for mode in settings.modes:
      rounds = {c: [] for c in candidates}
      for _ in range(settings.rounds):
        # The ceiling is timed again in every round: like the cells, it
        # keeps its fastest, so that a slow spell of a shared machine during
        # the first timing does not inflate every cell's share of it.
        report_lib.add_ceiling(report, probe())
        for c in candidates:
          start = timeline.now_s()
          record = cells.run_cell(
              c, shape, mode, inputs_of[granularity[c]],
              refs[(c.sinks, cells.reference_granularity(granularity[c]))],
              settings)
          for phase, seconds in record.get("phases_s", {}).items():
            timeline.add(phase, start, seconds, cell=f"{c.label} {mode}",
                         shape=str(shape))
            start += seconds
          rounds[c].append(record)
          ms = f"{record['ms']:.3f} ms" if record["ms"] else ""
          say(f"{mode:7s} {shape} {c.label:16s} {record['status']} {ms} "
              f"{record['reason']}", flush=True)
      for c in candidates:
        add(fastest_round(rounds[c]))
    del inputs_of, refs
  cells.release_matmul_probe()
  return report


def fastest_round(records: list[dict]) -> dict:
  """The record of a candidate's fastest round (`--rounds`), with every
  round's time in "rounds_ms"; the first failed round's if any failed.

  Each round's time is already the median of its repeated runs; across
  rounds the fastest is kept because the machine's interference only ever
  slows a round down (a shared CPU's slow spells last seconds, and a round
  that met one says nothing about the code).
  """
  failed = [r for r in records if r["status"] != "ok"]
  if failed:
    return failed[0]
  record = dict(min(records, key=lambda r: r["ms"]))
  if len(records) > 1:
    record["rounds_ms"] = [r["ms"] for r in records]
  return record


def main(argv: Sequence[str]) -> None:
  """Resolves the flags, runs the sweep, prints and writes the results."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if FLAGS.child_spec:
    cells.child_main(FLAGS.child_spec)
    return
  timeline = timeline_lib.Timeline()
  # The interpreter's start and the imports (jax, pallas_fa, absl).
  timeline.add("start", 0.0, timeline.now_s())
  if FLAGS.isolate and "XLA_PYTHON_CLIENT_ALLOCATOR" not in os.environ:
    # The parent only checks; with the platform allocator it hands device
    # memory back at once, leaving it to the isolated children it measures.
    os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
  try:
    settings = options.make_settings(
        **{name: FLAGS[name].value for name in options.SETTING_NAMES})
  except ValueError as e:  # Named by its flag.
    raise app.UsageError(str(e)) from None
  earlier = None
  if FLAGS.merge and FLAGS.json and os.path.exists(FLAGS.json):
    with open(FLAGS.json) as f:
      earlier = json.load(f)

  def write(report: dict) -> None:
    if FLAGS.json:
      report_lib.write_json(report, FLAGS.json)
    if FLAGS.markdown:
      report_lib.write_text(report_lib.format_markdown(report),
                            FLAGS.markdown)

  report = run(settings, argv=sys.argv, earlier=earlier, on_cell=write,
               timeline=timeline)
  write(report)
  print()
  print(report_lib.format_table(report))
  for path in (FLAGS.json, FLAGS.markdown):
    if path:
      print(f"wrote {path}")
  if FLAGS.plot:
    report_lib.plot(report, FLAGS.plot, FLAGS.plot_metric)
    print(f"wrote {FLAGS.plot}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
