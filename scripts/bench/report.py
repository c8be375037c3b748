"""The benchmark's results: ratios, metadata, text table, JSON and plot."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform as platform_lib
import shlex
import sys
from typing import Sequence

import jax
import jaxlib

import pallas_fa
from bench import options
from pallas_fa import api
from pallas_fa import testing


def _cell_key(r: dict) -> tuple:
  return (r["mode"], r["batch"], r["seq_len"], r["heads"], r["head_dim"],
          r["causal"], r["dtype"])


def _baseline_key(r: dict) -> tuple:
  """The cell key of the cells `r`'s ratios are taken against: the same
  cell in `options.baseline_dtype` (bfloat16 for a float8 cell)."""
  return _cell_key({**r, "dtype": options.baseline_dtype(r["dtype"])})


def add_ratios(results: list[dict], ceiling: dict | None) -> None:
  """Adds each record's speed-up against every baseline peer
  (`options.BASELINES`: peer time / this time; a float8 cell's against
  the peer's bfloat16 cell), a float8 cell's against every float8 peer's
  cell of the same shape and dtype (`options.FP8_BASELINES`) and against
  the same candidate's bfloat16 cell (`options.BF16_RATIO`), and its
  percentage of the matmul ceiling (of the cell's dtype) (None where any
  is unknown)."""
  ms_of = {(r["impl"], _cell_key(r)): r["ms"] for r in results if r["ms"]}
  for field, label in options.BASELINES.items():
    for r in results:
      ms = ms_of.get((label, _baseline_key(r)))
      r[field] = ms / r["ms"] if ms and r["ms"] else None
  for field, label in options.FP8_BASELINES.items():
    for r in results:
      ms = None
      if options.is_fp8(r["dtype"]) and r["impl"] != label:
        ms = ms_of.get((label, _cell_key(r)))
      r[field] = ms / r["ms"] if ms and r["ms"] else None
  for r in results:
    ms = None
    if options.is_fp8(r["dtype"]):
      label = r["impl"].removesuffix(options.FP8_LABEL_SUFFIX)
      ms = ms_of.get((label, _baseline_key(r)))
    r[options.BF16_RATIO] = ms / r["ms"] if ms and r["ms"] else None
  for r in results:
    r["pct_matmul"] = (
        100.0 * r["flops_per_s"] / ceiling["flops_per_s"]
        if ceiling and r.get("flops_per_s")
        and ceiling.get("dtype", r["dtype"]) == r["dtype"] else None)


def merged(earlier: dict | None, run_meta: dict,
           ceiling: dict | None) -> dict:
  """A report for this run that keeps the cells of `earlier` runs.

  Args:
    earlier: a report written by earlier runs (`--merge`), or None.
    run_meta: this run's `meta`.
    ceiling: this run's matmul ceiling; else the earlier one serves.

  Returns:
    {"meta": this run's, with "merged_commands" naming the earlier runs;
    "matmul"; "results": the earlier cells, to which `add_record` adds;
    "timelines": the earlier processes' phases (`bench.timeline`)}.
  """
  if not earlier:
    return {"meta": run_meta, "matmul": ceiling, "results": [],
            "timelines": []}
  before = earlier.get("meta") or {}
  commands = before.get("merged_commands", []) + [before.get("command")]
  return {"meta": {**run_meta, "merged_commands": commands},
          "matmul": ceiling or earlier.get("matmul"),
          "results": list(earlier.get("results") or []),
          "timelines": list(earlier.get("timelines") or [])}


def add_ceiling(report: dict, ceiling: dict | None) -> None:
  """Another timing of the matmul ceiling: the report keeps the fastest
  (its "timings_ms" lists them all) and updates every record's share."""
  if not ceiling:
    return
  best = report.get("matmul")
  timings = best.get("timings_ms", [best["ms"]]) if best else []
  if not best or ceiling["flops_per_s"] > best["flops_per_s"]:
    best = ceiling
  report["matmul"] = {**best, "timings_ms": timings + [ceiling["ms"]]}
  add_ratios(report["results"], report["matmul"])


def add_record(report: dict, record: dict) -> None:
  """Adds one cell's record to `report` (replacing an earlier record of the
  same candidate and cell) and updates every record's ratios."""
  key = (record["impl"], _cell_key(record))
  report["results"] = [r for r in report["results"]
                       if (r["impl"], _cell_key(r)) != key] + [record]
  add_ratios(report["results"], report["matmul"])


def meta(settings: options.Settings, argv: Sequence[str] | None) -> dict:
  """The run's device, versions, command, conventions and settings."""
  device = jax.devices()[0]
  argv = list(argv) if argv is not None else sys.argv
  return {
      "device": str(device),
      "device_kind": getattr(device, "device_kind", None),
      "platform": api.platform(),
      "num_devices": jax.device_count(),
      "jax_version": jax.__version__,
      "jaxlib_version": jaxlib.__version__,
      "pallas_fa_version": getattr(pallas_fa, "__version__", None),
      "python": platform_lib.python_version(),
      "command": " ".join(shlex.quote(a) for a in ["python"] + argv),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "default_matmul_precision": str(
          jax.config.jax_default_matmul_precision),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "flop_convention": testing.FLOP_CONVENTION,
      "timing": (f"median of {settings.repeats} runs after "
                 f"{settings.warmup} warm-up run(s)"
                 + (f"; the fastest of {settings.rounds} rounds, the "
                    "candidates of a (shape, mode) timed in turn"
                    if settings.rounds > 1 else "")),
      "settings": dataclasses.asdict(settings),
  }


def _unit(platform: str) -> tuple[str, float]:
  """The FLOP/s unit and its size: GFLOP/s on CPU, TFLOP/s elsewhere."""
  return ("GFLOP/s", 1e9) if platform == "cpu" else ("TFLOP/s", 1e12)


def rate(flops_per_s: float, platform: str) -> str:
  """A FLOP/s figure in the platform's unit."""
  unit, size = _unit(platform)
  return f"{flops_per_s / size:.1f} {unit}"


def _memory_cell(r: dict) -> str:
  if r.get("peak_bytes"):
    return f"{r['peak_bytes'] / 2**20:.0f}"
  if r.get("xla_mem_bytes"):
    return f"~{r['xla_mem_bytes'] / 2**20:.0f}"
  return "-"


def format_table(report: dict) -> str:
  """The results as a fixed-width text table.

  Args:
    report: the value of `benchmark.run`.

  Returns:
    The table, headed by the device, versions, command and conventions.
  """
  meta, results = report["meta"], report["results"]
  gpu_like = meta["platform"] != "cpu"
  unit, div = _unit(meta["platform"])
  lines = [
      f"device: {meta['device_kind']} ({meta['platform']}), jax "
      f"{meta['jax_version']}, jaxlib {meta['jaxlib_version']}",
      f"command: {meta['command']}",
      f"timing: {meta['timing']}; FLOPs: {meta['flop_convention']}",
  ]
  if report.get("matmul"):
    mm = report["matmul"]
    lines.append(f"matmul ceiling: {mm['size']}^3 {mm['dtype']} "
                 f"{mm['ms']:.3f} ms = {mm['flops_per_s'] / div:.2f} {unit}"
                 + (f" (the fastest of {len(mm['timings_ms'])} timings)"
                    if len(mm.get("timings_ms", ())) > 1 else ""))
  if meta["settings"]["isolate"]:
    lines.append(
        "peak MB: peak of a fresh process per cell (" +
        ("device peak_bytes_in_use" if gpu_like else "RSS") +
        ", including the runtime and inputs)")
  else:
    lines.append("peak MB: ~ = XLA's compiled estimate (arguments + outputs "
                 "+ temporaries); --isolate measures the real peak")
  ratios = _ratio_columns(results)
  for field in ratios:
    lines.append(f"{_ratio_title(field)}: {_baseline_name(field)} time / "
                 "this time (speed-up)")
  header = (f"{'mode':7} {'causal':6} {'B':>3} {'N':>3} {'H':>3} {'T':>6} "
            f"{'impl':20} {'ms':>10} {unit:>8} {'%mm':>5} "
            + "".join(f"{_ratio_title(f):>9} " for f in ratios)
            + f"{'peak MB':>8}  status")
  lines += [header, "-" * len(header)]
  for r in results:
    ms = f"{r['ms']:.3f}" if r["ms"] else "-"
    flops = f"{r['flops_per_s'] / div:.2f}" if r.get("flops_per_s") else "-"
    pct = f"{r['pct_matmul']:.0f}%" if r.get("pct_matmul") else "-"
    status = r["status"] + (f" ({r['reason']})" if r["reason"] else "")
    lines.append(
        f"{r['mode']:7} {str(r['causal']):6} {r['batch']:>3} {r['heads']:>3} "
        f"{r['head_dim']:>3} {r['seq_len']:>6} {r['impl']:20} {ms:>10} "
        f"{flops:>8} {pct:>5} "
        + "".join(f"{_ratio(r, f):>9} " for f in ratios)
        + f"{_memory_cell(r):>8}  {status}")
  return "\n".join(lines)


def _ratio_columns(results: list[dict]) -> list[str]:
  """The `options.BASELINES` fields (and `options.FP8_BASELINES`,
  `options.BF16_RATIO`) that some record has a value for."""
  return [f for f in (*options.BASELINES, *options.FP8_BASELINES,
                      options.BF16_RATIO)
          if any(r.get(f) for r in results)]


def _baseline_name(field: str) -> str:
  if field == options.BF16_RATIO:
    return "the same implementation's bfloat16 cell"
  if field in options.FP8_BASELINES:
    return options.FP8_BASELINES[field]
  return options.BASELINES[field]


def _dtypes(results: list[dict]) -> str:
  """The records' dtypes, in order of appearance, comma-separated."""
  return ", ".join(dict.fromkeys(r["dtype"] for r in results))


def _ratio_title(field: str) -> str:
  return field.replace("speedup_", "").replace("_", " ")  # "vs cudnn"


def _ratio(r: dict, field: str) -> str:
  return f"{r[field]:.2f}x" if r.get(field) else "-"


def format_markdown(report: dict) -> str:
  """The results as one Markdown table: a row per (mode, causal, H, T), a
  column per candidate with its FLOP/s and its speed-up against the first
  of `options.BASELINES` that has a time for the cell (cuDNN where it ran,
  else xla); a float8 candidate's column (`options.FP8_LABEL_SUFFIX`)
  against the peer's bfloat16 cell, and also against its own bfloat16
  column ("1.50x bf16").

  Args:
    report: the value of `benchmark.run`.

  Returns:
    The table, headed by one line naming the device, versions and units.
  """
  meta, results = report["meta"], report["results"]
  unit, div = _unit(meta["platform"])
  ratios = [f for f in _ratio_columns(results) if f in options.BASELINES]
  labels = list(dict.fromkeys(r["impl"] for r in results))
  rows = {}
  for r in results:
    key = (options.MODES.index(r["mode"]), r["causal"], r["head_dim"],
           r["seq_len"])
    rows.setdefault(key, {})[r["impl"]] = r
  peers = ", else ".join(options.BASELINES[f] for f in ratios)
  ratio_note = f"; (ratio) = {peers} time / this time" if ratios else ""
  if any(r.get(options.BF16_RATIO) for r in results):
    ratio_note += (f"; float8 columns ({options.FP8_LABEL_SUFFIX}): the "
                   "peers' bfloat16 time, and (x bf16) the same "
                   "implementation's bfloat16 time, / this time")
  if any(r.get(f) for r in results for f in options.FP8_BASELINES):
    ratio_note += ("; (x cudnn fp8) = jax:cudnn_fp8+e4m3 time (cuDNN's FP8 "
                   "forward, per-tensor scales) / this time")
  lines = [
      f"{meta['device_kind']}, jax {meta['jax_version']}, "
      f"{_dtypes(results)}; {unit}{ratio_note}",
      "",
      "| mode | causal | H | T | " + " | ".join(labels) + " |",
      "|---|---|---|---|" + "---|" * len(labels),
  ]
  for (mode, causal, h, t), by_label in sorted(rows.items()):
    cells = []
    for label in labels:
      r = by_label.get(label)
      if r is None:
        cells.append("")
      elif not r["ms"]:
        cells.append(r["status"])
      else:
        field = next((f for f in ratios if r.get(f)), None)
        shown = [f"{r[field]:.2f}x"] if field else []
        for fp8_field in options.FP8_BASELINES:
          if r.get(fp8_field):
            shown.append(f"{r[fp8_field]:.2f}x {_ratio_title(fp8_field)[3:]}")
        if r.get(options.BF16_RATIO):
          shown.append(f"{r[options.BF16_RATIO]:.2f}x bf16")
        ratio = f" ({'; '.join(shown)})" if shown else ""
        cells.append(f"{r['flops_per_s'] / div:.1f}{ratio}")
    lines.append(f"| {options.MODES[mode]} | {'yes' if causal else 'no'} | "
                 f"{h} | {t} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _make_parent(path: str) -> None:
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)


def write_json(report: dict, path: str) -> None:
  """Writes the report (meta, matmul ceiling, per-cell results) as JSON.

  Args:
    report: the value of `benchmark.run`.
    path: the file to write (its folder is created).
  """
  write_text(json.dumps(report, indent=1, default=str), path)


def write_text(text: str, path: str) -> None:
  """Writes `text` (and a final newline) to `path`, creating its folder.

  The text goes to a temporary file first, which then replaces `path`: the
  files are rewritten after every cell, and a run stopped during a write
  must leave the previous file whole.
  """
  _make_parent(path)
  tmp = os.path.join(os.path.dirname(path),
                     "." + os.path.basename(path) + ".tmp")
  try:
    with open(tmp, "w") as f:
      f.write(text + "\n")
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def plot(report: dict, path: str, metric: str = "flops") -> None:
  """PNG: y = FLOP/s (or ms) vs T, one line per implementation (and H).

  Subplot rows are the modes (fwd, fwd+bwd), columns non-causal / causal.

  Args:
    report: the value of `benchmark.run`.
    path: the PNG to write (its folder is created).
    metric: "flops" or "ms".
  """
  # Imported here: only --plot needs matplotlib.
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot

  results = [r for r in report["results"] if r["ms"]]
  meta = report["meta"]
  unit, div = _unit(meta["platform"])
  modes = [m for m in options.MODES
           if any(r["mode"] == m for r in report["results"])]
  causals = sorted({r["causal"] for r in report["results"]})
  head_dims = sorted({r["head_dim"] for r in report["results"]})
  labels = list(dict.fromkeys(r["impl"] for r in report["results"]))
  fig, axes = pyplot.subplots(
      max(1, len(modes)), max(1, len(causals)), squeeze=False,
      figsize=(5.5 * max(1, len(causals)), 4 * max(1, len(modes))))
  styles = ["-", "--", ":", "-."]
  for i, mode in enumerate(modes):
    for j, causal in enumerate(causals):
      ax = axes[i][j]
      for c, label in enumerate(labels):
        for d, h in enumerate(head_dims):
          rows = sorted(
              (r for r in results if r["impl"] == label and r["mode"] == mode
               and r["causal"] == causal and r["head_dim"] == h),
              key=lambda r: r["seq_len"])
          if not rows:
            continue
          xs = [r["seq_len"] for r in rows]
          ys = ([r["flops_per_s"] / div for r in rows] if metric == "flops"
                else [r["ms"] for r in rows])
          name = label if len(head_dims) == 1 else f"{label} H={h}"
          ax.plot(xs, ys, marker="o", color=f"C{c}",
                  linestyle=styles[d % len(styles)], label=name)
      if report.get("matmul") and metric == "flops":
        ax.axhline(report["matmul"]["flops_per_s"] / div, color="gray",
                   linewidth=0.8, linestyle=":", label="matmul")
      ax.set_xscale("log", base=2)
      if metric == "ms":
        ax.set_yscale("log")
      else:
        ax.set_ylim(bottom=0)
      ax.set_xlabel("sequence length T = S")
      ax.set_ylabel(unit if metric == "flops" else "ms")
      ax.set_title(f"{'fwd+bwd' if mode == 'fwd_bwd' else 'fwd'}, "
                   f"{'causal' if causal else 'non-causal'}")
      ax.grid(True, alpha=0.3)
      ax.legend(fontsize=7)
  dtype = _dtypes(report["results"])
  fig.suptitle(f"{meta['device_kind']} - jax {meta['jax_version']} - {dtype}")
  fig.tight_layout()
  _make_parent(path)
  fig.savefig(path, dpi=120)
  pyplot.close(fig)
