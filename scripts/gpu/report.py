"""The steps' results read back (the test results of `gpu.pytest_plugin`,
junit XML, benchmark, decode and compile_check JSON) as the headline
numbers of summary.json, and the run's summary formatted for a person."""

from __future__ import annotations

import json
import pathlib
from typing import Any
from typing import Collection
from xml.etree import ElementTree

from bench import timeline

# A test's outcome from all its reports: the first of these it has. A test
# that failed and then ended its worker (a sticky CUDA error) is "failed",
# with its own message; "crashed" alone is a worker that died in the test
# (a per-test timeout, or a fault).
_SEVERITY = ("failed", "error", "crashed", "passed", "skipped")
# The outcome of the line written as a test starts (no outcome yet).
STARTED = "started"


def summarise_tests(
  path: pathlib.Path, max_listed: int = 20
) -> dict[str, Any] | None:
  """Counts the outcomes in the results file of `gpu.pytest_plugin`.

  Args:
    path: the JSON-lines file (one line per test report that decides an
      outcome).
    max_listed: how many failures to describe in "problems".

  Returns:
    {"tests", "passed", "failed", "errors", "crashed", "skipped",
    "failed_ids": every test id that did not pass or skip, "finished":
    every test id with an outcome, in the order they finished, "problems":
    [{"test", "outcome", "message"}], "running": the tests that started
    and have no outcome yet (those a stopped run was in)}, or None when
    there is no file.
  """
  try:
    lines = path.read_text().splitlines()
  except OSError:
    return None
  seen: dict[str, dict[str, str]] = {}
  started: dict[str, None] = {}
  for line in lines:
    try:
      record = json.loads(line)
    except ValueError:  # A line cut short by a kill.
      continue
    if record.get("outcome") == STARTED:
      started[record["test"]] = None
      continue
    outcomes = seen.setdefault(record["test"], {})
    # The first message of each outcome is the one that says why.
    outcomes.setdefault(record["outcome"], record.get("message") or "")
  counts = dict(
    tests=len(seen), passed=0, failed=0, errors=0, crashed=0, skipped=0
  )
  failed_ids, problems = [], []
  for test, outcomes in seen.items():
    result = next(o for o in _SEVERITY if o in outcomes)
    counts["errors" if result == "error" else result] += 1
    if result in ("passed", "skipped"):
      continue
    failed_ids.append(test)
    if len(problems) < max_listed:
      problems.append(
        {"test": test, "outcome": result, "message": outcomes[result][:300]}
      )
  running = [test for test in started if test not in seen]
  return {**counts, "failed_ids": failed_ids, "finished": list(seen),
          "problems": problems, "running": running}


def merge_junit(paths: list[pathlib.Path]) -> str | None:
  """One junit XML document holding the test suites of every readable file
  of `paths`, or None when there is none."""
  root = ElementTree.Element("testsuites", name="gpu_check")
  for path in paths:
    try:
      tree = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
      continue
    suites = [tree] if tree.tag == "testsuite" else tree.iter("testsuite")
    for suite in suites:
      suite.set("name", path.stem)
      root.append(suite)
  if not len(root):
    return None
  return ElementTree.tostring(root, encoding="unicode") + "\n"


def summarise_compile(report: Any) -> dict[str, Any]:
  """The key numbers of a scripts/compile_check.py JSON report.

  The report is {"versions", "argv", "results": [one record per case:
  {"backend", "head_dim", "dtype", "variant", "target", "error",
  "kernels": [{"kernel", "problems": [...], "registers",
  "spill_stores", "spill_loads", "smem_bytes", ...}], ...}]}. Problems are
  counted as compile_check counts them: a case that failed to compile, plus
  each kernel row with a problem.

  Args:
    report: the parsed JSON.

  Returns:
    {"cases", "kernels", "problems", "spilling_kernels", "failed": [up to
    10 short descriptions]}; empty if the report has no "results" list.
  """
  results = report.get("results") if isinstance(report, dict) else None
  if not isinstance(results, list):
    return {}
  kernels = problems = spilling = 0
  failed = []
  for case in results:
    if not isinstance(case, dict):
      continue
    label = " ".join(
      str(case[k])
      for k in ("target", "backend", "head_dim", "dtype", "variant")
      if k in case
    )
    if case.get("error"):
      problems += 1
      failed.append(
        f"{label}: {str(case['error']).splitlines()[0][:200]}"
        if str(case["error"]).strip()
        else f"{label}: error"
      )
    for row in case.get("kernels") or ():
      kernels += 1
      if row.get("spill_stores") or row.get("spill_loads"):
        spilling += 1
      if row.get("problems"):
        problems += 1
        failed.append(
          f"{label} {row.get('kernel', '?')}: "
          f"{', '.join(map(str, row['problems']))}"
        )
  return {
    "cases": len(results),
    "kernels": kernels,
    "problems": problems,
    "spilling_kernels": spilling,
    "failed": failed[:10],
  }


def _unit(platform: str | None) -> tuple[str, float]:
  return ("GFLOP/s", 1e9) if platform == "cpu" else ("TFLOP/s", 1e12)


# The backward alone: fwd_bwd less fwd, 2.5x the forward's FLOPs (the
# FlashAttention convention), for a candidate timed in both modes.
BWD = "bwd"
BWD_FLOPS_PER_FWD = 2.5


def _backward_alone(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Records of the backward alone (mode "bwd"), derived from each
  candidate's fwd and fwd_bwd times of the same cell, the speed-up against
  cuDNN's backward derived the same way."""
  timed: dict[tuple, dict[str, dict[str, Any]]] = {}
  for r in results:
    if r.get("ms") and r.get("mode") in ("fwd", "fwd_bwd"):
      key = (
        r.get("impl"),
        r.get("head_dim"),
        r.get("seq_len"),
        bool(r.get("causal")),
        r.get("batch"),
        r.get("heads"),
      )
      timed.setdefault(key, {})[r["mode"]] = r
  derived = {}
  for key, modes in timed.items():
    if "fwd" not in modes or "fwd_bwd" not in modes:
      continue
    ms = modes["fwd_bwd"]["ms"] - modes["fwd"]["ms"]
    if ms <= 0:
      continue
    flops = BWD_FLOPS_PER_FWD * modes["fwd"]["flops"]
    derived[key] = {
      **{
        k: modes["fwd"].get(k)
        for k in (
          "impl",
          "kind",
          "head_dim",
          "seq_len",
          "causal",
          "batch",
          "heads",
        )
      },
      "mode": BWD,
      "status": "ok",
      "ms": ms,
      "flops": flops,
      "flops_per_s": flops / (ms * 1e-3),
    }
  for key, r in derived.items():
    cudnn = derived.get(("jax:cudnn", *key[1:]))
    r["speedup_vs_cudnn"] = cudnn["ms"] / r["ms"] if cudnn else None
  return list(derived.values())


def summarise_timelines(
  report: dict[str, Any], head_dims: Collection[int] | None = None
) -> list[dict[str, Any]]:
  """Where each benchmark process's time went: per process (its
  candidates; only those that ran some H of `head_dims` when given), the
  seconds from its start to its last phase's end, and per phase name
  (`bench.timeline.totals`)."""
  out = []
  for entry in report.get("timelines") or ():
    ran = entry.get("head_dims") or ()
    if head_dims is not None and not set(ran) & set(head_dims):
      continue
    phases = entry.get("phases") or []
    end = max((p["start_s"] + p["s"] for p in phases), default=0.0)
    out.append(
      {
        "candidates": ",".join(entry.get("candidates") or ()),
        "total_s": round(end, 1),
        "by_phase": timeline.totals(phases),
      }
    )
  return out


def summarise_bench(
  report: dict[str, Any], head_dims: Collection[int] | None = None
) -> dict[str, Any]:
  """The headline of a scripts/benchmark.py JSON report: a row per
  (H, T, mode, causal) with each candidate's rate and its speed-up against
  cuDNN (mode "bwd": the backward alone, fwd_bwd less fwd), the cells that
  did not run, and where each process's time went.

  Args:
    report: the parsed JSON ({"meta", "matmul", "results", "timelines"}).
    head_dims: only the cells of these H (default: all).

  Returns:
    {"device_kind", "unit", "matmul", "counts": {candidate: {status: n}},
    "rows": [{"H", "T", "mode", "causal", "rate": {candidate: FLOP/s in
    unit}, "vs_cudnn": {candidate: x}}], "problems": [the cells of ours
    that were wrong or failed, and why], "timelines":
    `summarise_timelines`}.
  """
  meta = report.get("meta") or {}
  unit, size = _unit(meta.get("platform"))
  counts: dict[str, dict[str, int]] = {}
  rows: dict[tuple, dict[str, Any]] = {}
  problems = []
  results = list(report.get("results") or [])
  for r in results + _backward_alone(results):
    if head_dims is not None and r.get("head_dim") not in head_dims:
      continue
    impl, status = r.get("impl", "?"), r.get("status", "?")
    if r.get("mode") != BWD:  # Counted in its two cells.
      by_status = counts.setdefault(impl, {})
      by_status[status] = by_status.get(status, 0) + 1
    key = (
      r.get("head_dim"),
      r.get("seq_len"),
      r.get("mode"),
      bool(r.get("causal")),
    )
    row = rows.setdefault(
      key,
      {
        "H": key[0],
        "T": key[1],
        "mode": key[2],
        "causal": key[3],
        "rate": {},
        "vs_cudnn": {},
      },
    )
    if r.get("flops_per_s"):
      row["rate"][impl] = round(r["flops_per_s"] / size, 1)
    if r.get("speedup_vs_cudnn") and impl != "jax:cudnn":
      row["vs_cudnn"][impl] = round(r["speedup_vs_cudnn"], 2)
    if r.get("kind") == "impl" and status in ("wrong", "failed"):
      problems.append(
        f"{impl} H={key[0]} T={key[1]} {key[2]} "
        f"{'causal' if key[3] else 'full'}: {status}: "
        f"{r.get('reason', '')}"[:300]
      )
  matmul = report.get("matmul") or {}
  modes = ("fwd", "fwd_bwd", BWD)
  return {
    "device_kind": meta.get("device_kind"),
    "unit": unit,
    "matmul": (
      round(matmul["flops_per_s"] / size, 1)
      if matmul.get("flops_per_s")
      else None
    ),
    "counts": counts,
    "rows": [
      rows[k]
      for k in sorted(
        rows,
        key=lambda k: (
          k[0] or 0,
          k[1] or 0,
          modes.index(k[2]) if k[2] in modes else len(modes),
          k[3],
        ),
      )
    ],
    "problems": problems,
    "timelines": summarise_timelines(report, head_dims),
  }


def summarise_decode(report: dict[str, Any]) -> dict[str, Any]:
  """The headline of a scripts/decode_benchmark.py JSON report.

  Args:
    report: the parsed JSON ({"device", "memory_bandwidth", "rows"}).

  Returns:
    {"bandwidth_gb_s": the measured peak, "rows": [{"impl", "B", "S", "K",
    "H", "T_new", "status", "ms", "gb_s", "share", "reason"}]}.
  """
  rows = []
  for r in report.get("rows") or []:
    rows.append(
      {
        "impl": r.get("impl"),
        "B": r.get("batch"),
        "S": r.get("seq_len"),
        "K": r.get("kv_heads"),
        "H": r.get("head_dim"),
        "T_new": r.get("new_tokens"),
        "status": r.get("status"),
        "ms": round(r["ms"], 4) if r.get("ms") else None,
        "gb_s": (
          round(r["bytes_per_s"] / 1e9, 1) if r.get("bytes_per_s") else None
        ),
        "share": (
          round(r["bandwidth_share"], 3) if r.get("bandwidth_share") else None
        ),
        "reason": (r.get("reason") or "")[:300],
      }
    )
  peak = (report.get("memory_bandwidth") or {}).get("peak")
  return {
    "bandwidth_gb_s": round(peak / 1e9, 1) if peak else None,
    "rows": rows,
  }


def _test_line(s: dict[str, Any]) -> str:
  crashed = f", {s['crashed']} crashed" if s.get("crashed") else ""
  return (
    f"{s['passed']} passed, {s['failed']} failed, {s['errors']} "
    f"errors{crashed}, {s['skipped']} skipped"
  )


def _bench_lines(bench: dict[str, Any]) -> list[str]:
  unit = bench.get("unit", "TFLOP/s")
  lines = []
  for row in bench.get("rows") or ():
    items = []
    for impl, value in row["rate"].items():
      ratio = row["vs_cudnn"].get(impl)
      items.append(f"{impl} {value}" + (f" ({ratio}x)" if ratio else ""))
    lines.append(
      f"      H={row['H']} T={row['T']} {row['mode']:7s} "
      f"{'causal' if row['causal'] else 'full':6s} {unit}: "
      + (", ".join(items) or "-")
    )
  lines += [f"      {p}" for p in (bench.get("problems") or [])[:10]]
  for t in bench.get("timelines") or ():
    phases = ", ".join(f"{k} {v:.1f}" for k, v in t["by_phase"].items())
    lines.append(
      f"      time of {t['candidates']}: {t['total_s']} s ({phases})"
    )
  return lines


def _decode_lines(decode: dict[str, Any]) -> list[str]:
  lines = []
  for r in decode.get("rows") or ():
    if r["ms"]:
      share = f", {r['share']:.0%} of bw" if r["share"] else ""
      lines.append(
        f"      {r['impl']} B={r['B']} S={r['S']} K={r['K']}: "
        f"{r['ms']} ms, {r['gb_s']} GB/s{share}"
      )
    else:
      lines.append(f"      {r['impl']} B={r['B']}: {r['status']} {r['reason']}")
  return lines


def _step_lines(name: str, s: dict[str, Any]) -> list[str]:
  duration = s.get("duration_s")
  duration = f"{duration:6.1f}s" if duration is not None else "      -"
  detail = s.get("reason") or ""
  if name == "env" and s.get("brief"):
    detail = s["brief"] + (f" [{detail}]" if detail else "")
  elif "tests" in s:
    detail = _test_line(s) + (f" [{detail}]" if detail else "")
  elif s.get("problems") is not None and "kernels" in s:
    detail = (
      f"{s['problems']} problem(s), {s['spilling_kernels']} "
      f"spilling, in {s['kernels']} kernel(s) of {s['cases']} "
      "case(s)" + (f" [{detail}]" if detail else "")
    )
  lines = [f"  {name:14s} {s['status']:8s} {duration}  {detail}".rstrip()]
  for w in s.get("warnings") or ():
    lines.append(f"      warning: {w}")
  for p in (s.get("problems") if isinstance(s.get("problems"), list) else [])[
    :10
  ]:
    lines.append(f"      {p['outcome']}: {p['test']}: {p['message']}")
  # The compile step lists its failing kernels under "failed"; the test
  # steps count them there.
  if isinstance(s.get("failed"), list):
    lines += [f"      {line}" for line in s["failed"]]
  if s.get("bench"):
    lines += _bench_lines(s["bench"])
  if s.get("decode"):
    lines += _decode_lines(s["decode"])
  for part, record in (s.get("parts") or {}).items():
    lines += _step_lines(f"{name}.{part}", record)
  return lines


def format_summary(summary: dict[str, Any]) -> str:
  """A short human summary of summary.json's content.

  Args:
    summary: the summary record (see gpu_check.py's `main`).

  Returns:
    A few lines: one per step, with its headline numbers.
  """
  lines = [
    f"gpu_check{' --dry-run' if summary['dry_run'] else ''}: "
    f"{summary['out']} ({summary.get('total_s', 0):.0f} s of "
    f"{summary['budget_s']:.0f})"
  ]
  for name, s in summary["steps"].items():
    lines += _step_lines(name, s)
  if summary.get("rerun"):
    lines.append(f"  rerun what failed: {summary['rerun']}")
  return "\n".join(lines)
