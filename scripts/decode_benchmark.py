r"""Benchmarks `decode_attention` against the plain calls it replaces.

Decoding is memory-bound, so each cell reports the K/V bytes it must read,
the achieved rate, and that rate's share of the machine's memory bandwidth,
measured in the same run (the faster of a large on-device copy and a large
read-only reduction, `memory_bandwidth`). With several new tokens and few
K/V heads the matmuls can outweigh the reads, so each cell also reports its
roofline, max(K/V bytes / bandwidth, FLOPs / matmul rate), the matmul rate a
large square product measured in the same run (`cells.matmul_ceiling`), and
the share of it that the call reached (roofline time / measured time). Both
rates are timed at the start and again before every cell, and the shares
are taken against the fastest timings of the run (a shared CPU's slow
spells only ever slow a probe down; "probe_timings" lists them all). Each
`decode_attention` implementation of --implementations is a candidate
(`decode/chunked`, `decode/triton`, `decode/mosaic_tpu`; the kernels run
interpreted off their platform, so keep shapes tiny there) once per split
count of --num_splits (`decode/<impl>` with the library's default split,
`decode/<impl>:num_splits=N` with N); "decode x" is how many times faster
the first of them ran than each row. "timeline" records where the
process's time went (`bench.timeline`: its start, the probes, and each
cell's inputs, reference, and each candidate's compile and check and its
timing). Peers in the same run: `flash_attention` on the same cache (key
lengths and query positions; the plain call that decoding used before),
and `jax.nn.dot_product_attention` with a [B, 1, T_new, S] mask.

A decode step on a GPU takes about what one call of a jitted program costs
the host, so each candidate is timed --calls_per_program calls to one
jitted program (`bench.repeated`; 20 on an accelerator, 1 on a CPU): "ms"
is the time per call in that program, and the rates, shares and speed-ups
are taken from it; with more than one call, "ms_one_call" is the same call
timed one to a program (the host's dispatch included). A cell's
candidates are checked first, then timed in turn, the candidates and both
programs of each, so that every ratio of two of its rows is of
interleaved runs.

    python scripts/decode_benchmark.py                    # CPU subset
    python scripts/decode_benchmark.py --batch=1,8,32 \
        --seq_lens=1024,4096,16384,32768,65536,131072 --kv_heads=32,8,1 \
        --head_dims=128,512,4096 --new_tokens=1,4 --dtype=bfloat16 \
        --max_cache_gib=16 --json=decode.json            # the full grid
    python scripts/decode_benchmark.py --implementations=chunked,triton \
        --page_size=64                                   # both, paged
    python scripts/decode_benchmark.py --window_sinks=1024,4  # StreamingLLM

With --cache_forms (no grid) it times the cache forms instead, each
against its plain equivalent in the same run (`bench.decode_forms`), with
bfloat16 queries: int8 and float8 caches against a bfloat16 one, a shared
prefix against the materialised per-row concatenation (and each of its
parts alone), paged against contiguous, T_new = 16 against 1 (and over an
int8 cache), a latent (MLA) cache against a separate value cache and one
576-wide read:

    python scripts/decode_benchmark.py --cache_forms=all \
        --json=benchmarks/results/decode_forms_cpu.json
    python scripts/decode_benchmark.py --implementations=triton \
        --cache_forms=dtype,prefix,paged,tnew,latent --repeats=10

With --window_sinks=W,SINKS every call masks the cache to the last W tokens
and the first SINKS (`flex.sliding_window_with_sinks`: a mask_mod for
`decode_attention`, the same visibility as a dense mask for the peers), and
the roofline counts only the keys a new token sees: a call that skips the
hidden blocks can approach it, one that reads the whole cache cannot.

Cells whose cache exceeds --max_cache_gib are listed as skipped.
"""

from __future__ import annotations

import functools
import os
import platform as host_platform
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags
from bench import cells
from bench import decode_forms
from bench import repeated
from bench import report as report_lib
from bench import timeline as timeline_lib
from gpu import environment

import pallas_fa
from pallas_fa import api
from pallas_fa import flex
from pallas_fa import testing
from pallas_fa.decode import front as decode_front

_BATCH = flags.DEFINE_list("batch", ["1", "8"], "Batch sizes B.")
_SEQ = flags.DEFINE_list(
    "seq_lens", ["4096", "32768"], "Cache lengths S (all rows full).")
_HEADS = flags.DEFINE_integer("heads", 32, "Query heads N.")
_KV_HEADS = flags.DEFINE_list("kv_heads", ["32", "8", "1"], "K/V heads K.")
_HEAD_DIMS = flags.DEFINE_list("head_dims", ["128"], "Head dims H.")
_NEW = flags.DEFINE_list("new_tokens", ["1", "4"], "New tokens T_new.")
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", list(testing.DTYPES), "Input dtype.")
_PAGE = flags.DEFINE_integer(
    "page_size", 0, "Read the cache as shuffled pages of this size (0: "
    "contiguous).")
_MAX_GIB = flags.DEFINE_float(
    "max_cache_gib", 1.0, "Skip cells whose K/V cache exceeds this.")
_IMPLEMENTATIONS = flags.DEFINE_list(
    "implementations", None, "decode_attention implementations timed "
    "(default: chunked,triton on a GPU, chunked,mosaic_tpu on a TPU, chunked "
    "elsewhere).")
_PEERS = flags.DEFINE_list(
    "peers", ["flash_attention", "jax_nn"],
    "Peers timed in the same run ('none' for none; the cells are still "
    "checked against the plain flash_attention call).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per cell.")
_CALLS = flags.DEFINE_integer(
    "calls_per_program", None, "Calls of each candidate (and of each cache "
    "form's cell) in one timed jitted program: \"ms\" is per call, and with "
    "more than one, \"ms_one_call\" is one call a program (the host's "
    "dispatch included). Default: 20 on an accelerator, 1 on a CPU.",
    lower_bound=1)
_MATMUL_SIZE = flags.DEFINE_integer(
    "matmul_size", 2048, "M = N = K of the matmul-rate probe of the roofline "
    "(0: memory-only roofline).")
_WINDOW_SINKS = flags.DEFINE_list(
    "window_sinks", [], "W,SINKS: mask every call to the last W tokens and "
    "the first SINKS (StreamingLLM; a mask_mod for decode_attention).")
_NUM_SPLITS = flags.DEFINE_list(
    "num_splits", ["default"], "Split counts of the key axis to time each "
    "implementation with: 'default' (the library's choice for the shape) "
    "or a number.")
_CACHE_FORMS = flags.DEFINE_list(
    "cache_forms", [], "Time these cache forms (dtype, prefix, paged, "
    "tnew, latent; 'all' for every one) with the first of "
    "--implementations instead of the grid.")
_JSON = flags.DEFINE_string(
    "json", None, "Write the report here (rewritten after every cell).")


def memory_bandwidth(nbytes: int, repeats: int) -> dict[str, float]:
  """Bytes per second the device moves, by two probes over `nbytes`.

  "copy": an elementwise copy (read + write bytes); "read": a sum (read
  bytes only), the access pattern of decoding. On a CPU they differ several
  times over (XLA runs the copy on one thread and pays write-allocate
  traffic; the reduction is multi-threaded), so the share of bandwidth is
  taken against the faster one, "peak". The probes run in float32 whatever
  the cells' dtype: the bandwidth is the machine's, and a CPU's 16-bit
  arithmetic would bound them below it.
  """
  x = jnp.ones((nbytes // 4,), jnp.float32)

  def rate(fn, moved):
    return moved / testing.time_call(fn, x, repeats=repeats).median_s

  rates = {"copy": rate(_copy_probe, 2 * x.nbytes),
           "read": rate(_read_probe, x.nbytes)}
  return rates | {"peak": max(rates.values())}


@jax.jit
def _copy_probe(x):
  return x * 2


@jax.jit
def _read_probe(x):
  # Row sums over 64 rows: a reduction XLA splits across threads.
  return x.reshape(64, -1).sum(1)


def attention_flops(b, s, n, h, t) -> int:
  """FLOPs of one call: Q.K^T and P.V over all S keys, 2 * N * T * S * H
  each (the causal triangle among the T new tokens is negligible)."""
  return 4 * b * n * t * s * h


def roofline_s(kv_bytes: int, flops: int, bandwidth: float,
               matmul_rate: float | None) -> float:
  """The fastest a call can run: its reads at the memory bandwidth or its
  FLOPs at the matmul rate, whichever takes longer."""
  compute = flops / matmul_rate if matmul_rate else 0.0
  return max(kv_bytes / bandwidth, compute)


def _inputs(b, s, n, num_kv, h, t, dtype, seed=0):
  """q, k, v (a contiguous cache) and lengths (every row full)."""
  gen = np.random.default_rng(seed)
  q = testing.normal(gen, (b, t, n, h), dtype)
  k = testing.normal(gen, (b, s, num_kv, h), dtype)
  v = testing.normal(gen, (b, s, num_kv, h), dtype)
  return q, k, v, jnp.full((b,), s, jnp.int32)


def implementations() -> list[str]:
  """The decode implementations this run times."""
  if _IMPLEMENTATIONS.value:
    return list(_IMPLEMENTATIONS.value)
  kernels = {"gpu": ["triton"], "tpu": ["mosaic_tpu"]}
  return ["chunked"] + kernels.get(api.platform(), [])


def named_peers() -> list[str]:
  """The peers `--peers` names; 'none' names none."""
  return [p for p in _PEERS.value if p != "none"]


def split_counts() -> list[int | None]:
  """The split counts of --num_splits (None: the library's default)."""
  counts = []
  for value in _NUM_SPLITS.value:
    count = None if value.strip().lower() in ("default", "0") else int(value)
    if count is not None and count < 1:
      raise ValueError(f"--num_splits values must be positive, got {value!r}")
    counts.append(count)
  return list(dict.fromkeys(counts))


def window_sinks() -> tuple[int, int] | None:
  """(W, SINKS) of --window_sinks, or None."""
  if not _WINDOW_SINKS.value:
    return None
  window, sinks = (int(x) for x in _WINDOW_SINKS.value)
  return window, sinks


def _query_positions(lengths, t):
  """The new tokens' positions: the last t of each sequence."""
  return lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]


def visible(lengths, t: int, s: int, streaming) -> jax.Array:
  """bool [B, 1, T_new, S]: the keys each new token sees (causal on the
  cache, under `streaming` = (W, SINKS) when given)."""
  q_idx = _query_positions(lengths, t)[:, None, :, None]
  kv_idx = jnp.arange(s, dtype=jnp.int32)[None, None, None, :]
  seen = (kv_idx <= q_idx) & (kv_idx < lengths[:, None, None, None])
  if streaming is not None:
    seen &= flex.sliding_window_with_sinks(None, None, q_idx, kv_idx,
                                           *streaming)
  return seen


def _candidates(t, s, page_size, impls, streaming=None, splits=(None,)):
  mod = {}
  if streaming is not None:
    mod = dict(mask_mod=flex.sliding_window_with_sinks,
               mask_mod_args=tuple(jnp.int32(x) for x in streaming))

  def decode(q, k, v, lengths, table, impl, num_splits):
    return pallas_fa.decode_attention(q, k, v, lengths, block_table=table,
                                      implementation=impl,
                                      num_splits=num_splits, **mod)

  def plain(q, k, v, lengths, table):
    del table
    mask = None if streaming is None else visible(lengths, t, s, streaming)
    return pallas_fa.flash_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=lengths,
        query_positions=_query_positions(lengths, t), mask=mask)

  def jax_nn(q, k, v, lengths, table):
    del table
    return jax.nn.dot_product_attention(
        q, k, v, mask=visible(lengths, t, s, streaming))

  out = {f"decode/{impl}" + (f":num_splits={n}" if n else ""):
         functools.partial(decode, impl=impl, num_splits=n)
         for impl in impls for n in splits}
  if not page_size:  # The peers read a contiguous cache.
    out.update(flash_attention=plain, jax_nn=jax_nn)
  return out


def run_cell(b, s, n, num_kv, h, t, dtype, page_size, peers, repeats,
             timeline=None, calls=1):
  """Times every candidate on one shape, `calls` calls to a jitted program
  (`bench.repeated`), the candidates in turn once each has passed its
  check; returns one row per candidate (their shares of the machine's
  rates come from `add_shares`), and adds its phases to `timeline` (a
  `bench.timeline.Timeline`) when given."""
  timeline = timeline or timeline_lib.Timeline()
  cell = f"B={b} S={s} K={num_kv} H={h} T={t}"
  itemsize = jnp.dtype(dtype).itemsize
  streaming = window_sinks()
  # Keys some new token sees, per sequence summed (all S without a mask).
  keys = int(jnp.sum(jnp.any(visible(
      jnp.full((b,), s, jnp.int32), t, s, streaming), axis=(1, 2))))
  kv_bytes = 2 * keys * num_kv * h * itemsize
  flops = attention_flops(1, keys, n, h, t)
  base = dict(batch=b, seq_len=s, heads=n, kv_heads=num_kv, head_dim=h,
              new_tokens=t, dtype=jnp.dtype(dtype).name,
              page_size=page_size, kv_bytes=kv_bytes, flops=flops,
              window_sinks=list(streaming) if streaming else None)
  cache_bytes = 2 * b * s * num_kv * h * itemsize
  if cache_bytes > _MAX_GIB.value * 2**30:
    return [dict(base, impl="*", status="skipped",
                 reason=f"cache {cache_bytes / 2**30:.1f} GiB > "
                        f"--max_cache_gib")]
  with timeline.phase("inputs", cell=cell):
    q, k, v, lengths = _inputs(b, s, n, num_kv, h, t, dtype)
    args = (q, k, v, lengths, None)
    if page_size:
      k_pages, v_pages, table = decode_forms.paged_cache(k, v, page_size)
      args = (q, k_pages, v_pages, lengths, table)
    jax.block_until_ready(args)
  # What every candidate must return: the plain call, in float32 and in the
  # inputs' dtype (the project's low-precision rule, `testing.compare`).
  with timeline.phase("reference", cell=cell):
    plain = _candidates(t, s, 0, [], streaming)["flash_attention"]
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    ref32 = jax.jit(plain)(*up, lengths, None)
    ref_same = jax.jit(plain)(q, k, v, lengths, None)
    jax.block_until_ready((ref32, ref_same))
  rows, timed = [], []
  candidates = _candidates(t, s, page_size, implementations(), streaming,
                           split_counts())
  first = next(iter(candidates))
  for name, fn in candidates.items():
    if not name.startswith("decode/") and name not in peers:
      continue
    try:
      fn = jax.jit(fn)
      with timeline.phase("compile_check", cell=cell, impl=name):
        check = testing.compare("out", fn(*args), ref32, ref_same,
                                precision="default")
        program = repeated.program(fn, calls)
        if check.ok:
          jax.block_until_ready(program(*args))  # Compiled here.
    except Exception as e:  # noqa: BLE001  (reported, never hidden)
      rows.append(dict(base, impl=name, status="error",
                       reason=str(e).splitlines()[0][:200]))
      continue
    if not check.ok:
      rows.append(dict(base, impl=name, status="wrong",
                       reason=check.message()))
      continue
    row = dict(base, impl=name, status="ok", max_error=check.error,
               tolerance=check.tolerance)
    rows.append(row)
    timed.append((row, (program, fn, args)))
  if timed:
    with timeline.phase("timing", cell=cell,
                        impl=",".join(row["impl"] for row, _ in timed)):
      timings = repeated.time_in_turn(
          [entry for _, entry in timed], calls, repeats)
  else:
    timings = []
  times = {}
  for (row, _), timing in zip(timed, timings):
    # The rates and ratios of the time per call within a program.
    row.update(timing, bytes_per_s=kv_bytes / (timing["ms"] / 1e3))
    times[row["impl"]] = timing["ms"]
  for row, _ in timed:
    if first in times:
      row["decode_speedup"] = times[row["impl"]] / times[first]
  return rows


def add_shares(rows, bandwidth: float, matmul_rate: float | None) -> None:
  """Each row's roofline and its shares of it and of the bandwidth, against
  the given rates (`best_rates`: the fastest probes of the run so far)."""
  for row in rows:
    row["roofline_ms"] = 1e3 * roofline_s(row["kv_bytes"], row["flops"],
                                          bandwidth, matmul_rate)
    if row.get("status") == "ok":
      row["bandwidth_share"] = row["bytes_per_s"] / bandwidth
      row["roofline_share"] = row["roofline_ms"] / row["ms"]


def best_rates(report: dict, probes: dict, matmul: dict | None) -> None:
  """Keeps in `report` the fastest of each probe timed so far: a slow spell
  of a shared machine only ever slows a probe down."""
  timings = report.setdefault("probe_timings", [])
  timings.append({"memory_bandwidth": probes, "matmul": matmul})
  report["memory_bandwidth"] = max(
      (t["memory_bandwidth"] for t in timings), key=lambda p: p["peak"])
  report["matmul"] = max((t["matmul"] for t in timings if t["matmul"]),
                         key=lambda m: m["flops_per_s"], default=None)


def format_table(rows, header: bool = True) -> str:
  lines = ([f"{'B':>3} {'S':>7} {'K':>3} {'H':>5} {'T':>2} "
            f"{'impl':<28} {'ms':>9} {'1-call ms':>9} {'GB/s':>7} {'of bw':>6} "
            f"{'roof ms':>8} {'of roof':>7} {'decode x':>8}"]
           if header else [])
  for r in rows:
    head = (f"{r['batch']:>3} {r['seq_len']:>7} {r['kv_heads']:>3} "
            f"{r['head_dim']:>5} {r['new_tokens']:>2} {r['impl']:<28}")
    if r["status"] != "ok":
      lines.append(f"{head} {r['status']}: {r['reason']}")
      continue
    alone = (f"{r['ms_one_call']:>9.3f}" if "ms_one_call" in r
             else f"{'-':>9}")
    lines.append(
        f"{head} {r['ms']:>9.3f} {alone} {r['bytes_per_s'] / 1e9:>7.2f} "
        f"{r['bandwidth_share']:>6.0%} {r['roofline_ms']:>8.3f} "
        f"{r['roofline_share']:>7.0%} " + (
            f"{r['decode_speedup']:>8.2f}" if "decode_speedup" in r
            else f"{'-':>8}"))
  return "\n".join(lines)


def machine_rates(dtype) -> tuple[dict, dict | None]:
  """(memory_bandwidth probes, matmul ceiling or None), timed now."""
  probes = memory_bandwidth(1 << 28, _REPEATS.value)
  matmul = cells.matmul_ceiling(_MATMUL_SIZE.value, _DTYPE.value,
                                repeats=_REPEATS.value, warmup=1)
  return probes, matmul


def describe_rates(probes: dict, matmul: dict | None) -> str:
  return (f"memory bandwidth {probes['peak'] / 1e9:.1f} GB/s (copy "
          f"{probes['copy'] / 1e9:.1f}, read {probes['read'] / 1e9:.1f})"
          + (f"; matmul {matmul['flops_per_s'] / 1e9:.1f} GFLOP/s"
             if matmul else ""))


# The peers `--peers` may name (`_candidates`).
PEERS = ("flash_attention", "jax_nn")


def check_flags() -> None:
  """Rejects flag values no cell could run, before anything is timed.

  Raises:
    app.UsageError: naming the flag.
  """
  def positive(name, values):
    try:
      numbers = [int(x) for x in values]
    except ValueError:
      numbers = [0]
    if not numbers or min(numbers) < 1:
      raise app.UsageError(f"--{name} must be positive ints, got {values}.")
    return numbers

  positive("batch", _BATCH.value)
  positive("seq_lens", _SEQ.value)
  positive("head_dims", _HEAD_DIMS.value)
  positive("new_tokens", _NEW.value)
  for num_kv in positive("kv_heads", _KV_HEADS.value):
    if _HEADS.value < 1 or _HEADS.value % num_kv:
      raise app.UsageError(
          f"--heads={_HEADS.value} must be a positive multiple of every "
          f"--kv_heads, got {_KV_HEADS.value}.")
  if _PAGE.value < 0 or any(
      _PAGE.value and int(x) % _PAGE.value for x in _SEQ.value):
    raise app.UsageError(
        f"--page_size must be 0 (contiguous) or divide every --seq_lens, "
        f"got {_PAGE.value} and {_SEQ.value}.")
  if _REPEATS.value < 1:
    raise app.UsageError(f"--repeats must be >= 1, got {_REPEATS.value}.")
  unknown = sorted(set(_IMPLEMENTATIONS.value or ()) - set(
      decode_front.IMPLEMENTATIONS))
  if unknown:
    raise app.UsageError(
        f"--implementations must name some of "
        f"{', '.join(decode_front.IMPLEMENTATIONS)}; got {unknown}.")
  unknown = sorted(set(_PEERS.value) - set(PEERS) - {"none"})
  if unknown:
    raise app.UsageError(
        f"--peers must be 'none' or name some of {', '.join(PEERS)}; got "
        f"{unknown}.")
  if _WINDOW_SINKS.value:
    positive("window_sinks", _WINDOW_SINKS.value[:1])
    if len(_WINDOW_SINKS.value) != 2 or not all(
        x.strip().isdigit() for x in _WINDOW_SINKS.value):
      raise app.UsageError(
          f"--window_sinks must be W,SINKS (two ints), got "
          f"{_WINDOW_SINKS.value}.")
  try:
    split_counts()
    if _CACHE_FORMS.value:
      decode_forms.selected(_CACHE_FORMS.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  longest_new, shortest_cache = max(positive("new_tokens", _NEW.value)), min(
      positive("seq_lens", _SEQ.value))
  if longest_new > shortest_cache:
    raise app.UsageError(
        f"--new_tokens must not exceed --seq_lens (the new tokens are the "
        f"cache's last), got {_NEW.value} and {_SEQ.value}.")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  check_flags()
  timeline = timeline_lib.Timeline()
  # The interpreter's start and the imports (jax, pallas_fa, absl).
  timeline.add("start", 0.0, timeline.now_s())
  dtype = testing.DTYPES[_DTYPE.value]
  ints = lambda values: [int(x) for x in values]  # noqa: E731
  with timeline.phase("device_init"):
    print(f"device: {jax.devices()[0].device_kind}")
  rows = []
  report = dict(
      device=jax.devices()[0].device_kind, platform=api.platform(),
      jax=jax.__version__, python=sys.version.split()[0],
      host=host_platform.processor() or host_platform.machine(),
      commit=environment.commit_info(),
      # A shared machine's other work slows every cell and probe alike.
      load_average=dict(zip(("1m", "5m", "15m"), os.getloadavg())),
      command=" ".join(sys.argv), rows=rows, timeline=timeline.phases)
  if _CACHE_FORMS.value:
    forms = decode_forms.selected(_CACHE_FORMS.value)
    for form in forms:
      with timeline.phase("cache_form", form=form):
        rows += decode_forms.FORMS[form](implementations()[0],
                                         _REPEATS.value, calls=_CALLS.value)
      report["ratios"] = decode_forms.ratios(rows)
      if _JSON.value:
        report_lib.write_json(report, _JSON.value)
    print(decode_forms.format_table(rows))
    return
  calls = _CALLS.value or repeated.default_calls()
  with timeline.phase("probes"):
    best_rates(report, *machine_rates(dtype))
  for b in ints(_BATCH.value):
    for s in ints(_SEQ.value):
      for num_kv in ints(_KV_HEADS.value):
        for h in ints(_HEAD_DIMS.value):
          for t in ints(_NEW.value):
            # The rates are timed again before each cell; every share is
            # taken against the fastest timings of the run so far.
            with timeline.phase("probes"):
              probes, matmul = machine_rates(dtype)
            best_rates(report, probes, matmul)
            print(f"  probes: {describe_rates(probes, matmul)}")
            cell = run_cell(b, s, _HEADS.value, num_kv, h, t, dtype,
                            _PAGE.value, named_peers(), _REPEATS.value,
                            timeline, calls)
            rows += cell
            add_shares(rows, report["memory_bandwidth"]["peak"],
                       report["matmul"] and report["matmul"]["flops_per_s"])
            print(format_table(cell, header=False), flush=True)
            if _JSON.value:
              # After every cell: a run stopped part-way keeps its cells.
              report_lib.write_json(report, _JSON.value)
  print(f"rates (the fastest probes of the run): "
        f"{describe_rates(report['memory_bandwidth'], report['matmul'])}")
  print(format_table(rows))
  if _JSON.value:
    report_lib.write_json(report, _JSON.value)


if __name__ == "__main__":
  app.run(main)
