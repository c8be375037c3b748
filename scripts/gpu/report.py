"""The steps' results read back (junit XML, compile_check and benchmark JSON)
and the run's summary formatted for a person."""

from __future__ import annotations

import re
from typing import Any
from xml.etree import ElementTree

# pytest-timeout's failure: "Timeout (>90.0s) from pytest-timeout." (2.x) or
# "Timeout >90s" (1.x).
_TIMEOUT_MESSAGE = re.compile(r"Timeout \(?>")


def parse_junit(xml_text: str, max_listed: int = 20) -> dict[str, Any]:
  """Counts the outcomes in a pytest junit XML report.

  Args:
    xml_text: the report.
    max_listed: how many failed/errored tests to name.

  Returns:
    {"tests", "passed", "failed", "errors", "skipped", "timeouts",
    "crashed", "interrupted", "time_s", "problems": [{"test", "outcome",
    "message"}]}. A timeout (pytest-timeout) or a crashed xdist worker is
    also counted as failed or errors; "interrupted" counts the nameless
    record pytest writes for a test stopped by SIGINT (not in "tests").
  """
  root = ElementTree.fromstring(xml_text)
  counts = dict(tests=0, passed=0, failed=0, errors=0, skipped=0,
                timeouts=0, crashed=0, interrupted=0)
  problems = []
  time_s = 0.0
  suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
  for suite in suites:
    time_s += float(suite.get("time") or 0.0)
  for case in root.iter("testcase"):
    if case.get("name") is None:
      # The test that was running when pytest was interrupted (SIGINT).
      counts["interrupted"] += 1
      continue
    counts["tests"] += 1
    failure, error = case.find("failure"), case.find("error")
    bad = failure if failure is not None else error
    if bad is None:
      counts["skipped" if case.find("skipped") is not None else "passed"] += 1
      continue
    counts["failed" if failure is not None else "errors"] += 1
    message = (bad.get("message") or "") + "\n" + (bad.text or "")
    if _TIMEOUT_MESSAGE.search(message):
      counts["timeouts"] += 1
    if "crashed while running" in message:
      counts["crashed"] += 1
    if len(problems) < max_listed:
      name = case.get("name", "?")
      classname = case.get("classname", "")
      first = next((line.strip() for line in message.splitlines()
                    if line.strip()), "")
      problems.append({
          "test": f"{classname}::{name}" if classname else name,
          "outcome": "failed" if failure is not None else "error",
          "message": first[:300]})
  return {**counts, "time_s": round(time_s, 1), "problems": problems}


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
    label = " ".join(str(case[k]) for k in (
        "target", "backend", "head_dim", "dtype", "variant") if k in case)
    if case.get("error"):
      problems += 1
      failed.append(f"{label}: {str(case['error']).splitlines()[0][:200]}"
                    if str(case["error"]).strip() else f"{label}: error")
    for row in case.get("kernels") or ():
      kernels += 1
      if row.get("spill_stores") or row.get("spill_loads"):
        spilling += 1
      if row.get("problems"):
        problems += 1
        failed.append(f"{label} {row.get('kernel', '?')}: "
                      f"{', '.join(map(str, row['problems']))}")
  return {"cases": len(results), "kernels": kernels, "problems": problems,
          "spilling_kernels": spilling, "failed": failed[:10]}


def summarise_bench(report: dict[str, Any]) -> dict[str, Any]:
  """The per-cell numbers of one scripts/benchmark.py JSON report.

  Args:
    report: the parsed JSON ({"meta", "matmul", "results"}).

  Returns:
    {"platform", "device_kind", "unit", "matmul_flops_per_s", "counts":
    {status: n}, "cells": [{impl, mode, causal, head_dim, seq_len, status,
    reason, ms, flops_per_s}]}.
  """
  meta = report.get("meta") or {}
  cells, counts = [], {}
  for r in report.get("results") or []:
    status = r.get("status", "?")
    counts[status] = counts.get(status, 0) + 1
    cells.append({k: r.get(k) for k in (
        "impl", "kind", "mode", "causal", "head_dim", "seq_len", "batch",
        "heads", "dtype", "status", "reason", "ms", "flops_per_s")})
  platform_name = meta.get("platform")
  matmul = report.get("matmul") or {}
  return {
      "platform": platform_name,
      "device_kind": meta.get("device_kind"),
      "unit": "GFLOP/s" if platform_name == "cpu" else "TFLOP/s",
      "matmul_flops_per_s": matmul.get("flops_per_s"),
      "counts": counts,
      "cells": cells,
  }


def _rate(flops_per_s: float | None, unit: str) -> str:
  if not flops_per_s:
    return "-"
  return f"{flops_per_s / (1e9 if unit == 'GFLOP/s' else 1e12):.1f}"


def format_summary(summary: dict[str, Any]) -> str:
  """A short human summary of summary.json's content.

  Args:
    summary: the summary record (see `main`).

  Returns:
    A few lines: one per step, with its key numbers.
  """
  lines = [f"gpu_check{' --dry-run' if summary['dry_run'] else ''}: "
           f"{summary['out']} ({summary.get('total_s', 0):.0f} s)"]
  for name, s in summary["steps"].items():
    duration = s.get("duration_s")
    duration = f"{duration:6.1f}s" if duration is not None else "      -"
    head = f"  {name:8s} {s['status']:8s} {duration}"
    detail = s.get("reason") or ""
    if name == "env" and s.get("brief"):
      detail = s["brief"] + (f" [{detail}]" if detail else "")
    elif name == "compile" and s.get("problems") is not None:
      detail = (f"{s['problems']} problem(s), {s['spilling_kernels']} "
                f"spilling, in {s['kernels']} kernel(s) of {s['cases']} "
                "case(s)" + (f" [{detail}]" if detail else ""))
    elif name == "tests" and "tests" in s:
      crashed = f", {s['crashed']} crashed" if s.get("crashed") else ""
      detail = (f"{s['passed']} passed, {s['failed']} failed, "
                f"{s['errors']} errors, {s['timeouts']} timeouts{crashed}, "
                f"{s['skipped']} skipped" + (f" [{detail}]" if detail else ""))
    lines.append(f"{head}  {detail}".rstrip())
    for w in s.get("warnings") or ():
      lines.append(f"      warning: {w}")
    if name == "tests" and isinstance(s.get("problems"), list):
      for p in s["problems"][:10]:
        lines.append(f"      {p['outcome']}: {p['test']}: {p['message']}")
    if name == "compile":
      for line in s.get("failed") or ():
        lines.append(f"      {line}")
    if name == "bench":
      for run in s.get("runs") or ():
        lines.extend(_bench_lines(run))
  return "\n".join(lines)


def _bench_lines(run: dict[str, Any]) -> list[str]:
  if not run.get("cells"):
    return [f"      H={run['head_dim']}: {run['status']} {run['reason']}"]
  unit = run.get("unit", "TFLOP/s")
  groups: dict[tuple, list[str]] = {}
  for c in run["cells"]:
    key = (c["seq_len"], c["mode"], c["causal"])
    value = _rate(c.get("flops_per_s"), unit) if c.get("ms") else c["status"]
    groups.setdefault(key, []).append(f"{c['impl']} {value}")
  lines = []
  for (t, mode, causal), items in groups.items():
    lines.append(f"      H={run['head_dim']} T={t} {mode:7s} "
                 f"{'causal' if causal else 'full':6s} {unit}: "
                 + ", ".join(items))
  if run.get("reason"):
    lines.append(f"      H={run['head_dim']}: {run['reason']}")
  return lines
