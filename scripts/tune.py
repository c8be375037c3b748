r"""Sweeps the tilings of the tunable backends on a GPU and persists the best.

Tunable backends: `triton` (any GPU) and `mosaic_gpu` (Hopper); by default
every one this device runs. For every (backend, head dim, sequence length,
causal) cell of the grid, the tiling starts from the backend's heuristic
(`heuristic_block_sizes`) and is swept one pass at a time, the best of each
pass kept for the next: `triton` its forward tiles (block_q, block_kv,
num_warps, num_stages, timing the forward pass), then its dK/dV tiles and
its dQ tiles (with the backward warps/stages, timing forward + backward);
`mosaic_gpu` its forward fields, then its backward fields
(`mosaic_gpu.candidate_block_sizes`). The winner is checked against the
float32 materialised reference (`pallas_fa.reference.attention`) with the
FlashAttention error rule; a config that fails is dropped for the next best.
Results are merged, per backend, into the package data file
`pallas_fa/tuned/<device kind>.json`, which each backend's
`default_block_sizes` reads (`pallas_fa.tuning`) for calls made without
`block_sizes=`.

Commands (from the repository root, on the GPU to tune for):

  # The FlashAttention grid: bfloat16, B*T = 16k tokens, N*H = 2048,
  # H in {64, 128, 256}, T in 512..16k, causal and not (about an hour):
  python scripts/tune.py

  # One head dim, a few lengths, more timing repeats:
  python scripts/tune.py --head_dims=128 --seq_lens=4096,16384 --repeats=20

  # Print the candidate grid of every cell and time nothing (runs anywhere):
  python scripts/tune.py --dry_run --device_kind="NVIDIA H100 80GB HBM3"

  # One backend only:
  python scripts/tune.py --backends=mosaic_gpu --head_dims=128

  # A smoke test of the whole loop on CPU (interpret mode, tiny shapes,
  # written to a scratch file rather than the package data):
  python scripts/tune.py --head_dims=32 --seq_lens=64 --tokens=64 \
      --model_dim=64 --causal=true --max_candidates=2 --repeats=1 \
      --output=/tmp/tuned_cpu.json

Then commit `pallas_fa/tuned/<device kind>.json`.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import pathlib
from typing import Any
from typing import Callable

import compile_check  # scripts/ is on sys.path when run as a script.
import jax
import jax.numpy as jnp
from absl import app
from absl import flags
from absl import logging

import pallas_fa
from pallas_fa import api
from pallas_fa import gpu_target
from pallas_fa import mosaic_gpu
from pallas_fa import testing
from pallas_fa import triton
from pallas_fa import tuning

TUNABLE = ("triton", "mosaic_gpu")

_BACKENDS = flags.DEFINE_list(
    "backends", None,
    f"Backends to tune, of {TUNABLE}; default: every one this device runs "
    "(mosaic_gpu on Hopper only).")
_HEAD_DIMS = flags.DEFINE_list(
    "head_dims", ["64", "128", "256"], "Head dims H to tune.")
_SEQ_LENS = flags.DEFINE_list(
    "seq_lens", ["512", "1024", "2048", "4096", "8192", "16384"],
    "Sequence lengths T = S to tune.")
_DTYPE = flags.DEFINE_enum(
    "dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Input dtype.")
_TOKENS = flags.DEFINE_integer(
    "tokens", 16384, "B * T: the batch is tokens // T (at least 1).")
_MODEL_DIM = flags.DEFINE_integer(
    "model_dim", 2048, "N * H: the query heads are model_dim // H.")
_KV_HEADS = flags.DEFINE_integer(
    "kv_heads", None, "K/V heads (GQA); default: as many as query heads.")
_CAUSAL = flags.DEFINE_enum(
    "causal", "both", ["both", "true", "false"], "Which masks to tune.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed runs (median).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed runs first.")
_MAX_CANDIDATES = flags.DEFINE_integer(
    "max_candidates", None, "Cap on the candidates of each sweep.")
_CHECK_LEN = flags.DEFINE_integer(
    "check_len", 2048, "Longest T used for the correctness check.")
_OUTPUT = flags.DEFINE_string(
    "output", None,
    "JSON file to merge results into; default "
    "pallas_fa/tuned/<device kind>.json.")
_DEVICE_KIND = flags.DEFINE_string(
    "device_kind", None,
    "Device kind for the heuristics and the file name; default: that of the "
    "default device (override only with --dry_run, to preview a GPU's grid).")
_PRUNE = flags.DEFINE_boolean(
    "prune", True,
    "On a GPU, drop candidates that spill registers or overflow shared memory "
    "(scripts/compile_check.py) before timing them.")
_DRY_RUN = flags.DEFINE_boolean(
    "dry_run", False, "Print the candidates of every cell; time nothing.")

_DTYPES = testing.DTYPES


@dataclasses.dataclass(frozen=True)
class Cell:
  """One tuning problem."""

  b: int
  t: int
  n: int
  k: int
  h: int
  causal: bool
  dtype: str

  def flops(self, backward: bool) -> float:
    return testing.attention_flops(
        self.b, self.n, self.t, self.t, self.h, causal=self.causal,
        mode="fwd_bwd" if backward else "fwd")


def _cells() -> list[Cell]:
  causal = {"both": (False, True), "true": (True,), "false": (False,)}
  cells = []
  for h in map(int, _HEAD_DIMS.value):
    n = max(1, _MODEL_DIM.value // h)
    k = _KV_HEADS.value or n
    for t in map(int, _SEQ_LENS.value):
      for c in causal[_CAUSAL.value]:
        cells.append(Cell(b=max(1, _TOKENS.value // t), t=t, n=n, k=k, h=h,
                          causal=c, dtype=_DTYPE.value))
  return cells


def _fits(bs: triton.TritonBlockSizes, cell: Cell, kind: str) -> bool:
  """Shared-memory estimate of the triton kernels (always True on CPU)."""
  if "cpu" in kind.lower():
    return True
  smem = triton.shared_memory_bytes(
      bs, cell.h, jnp.dtype(_DTYPES[cell.dtype]).itemsize)
  return max(smem.values()) <= triton.shared_memory_budget(kind)


def _compiles_cleanly(backend: str, bs, cell: Cell) -> bool:
  """Whether forward + backward compile for this GPU without a spill or a
  shared-memory overflow (`compile_check.py`; True where there is no GPU to
  compile for): spilling candidates are dropped before any timing."""
  target = gpu_target.current()
  if target is None or not _PRUNE.value:
    return True
  case = compile_check.Case(backend, cell.h, cell.dtype,
                            "causal" if cell.causal else "plain")
  result = compile_check.compile_case(case, target="local", seq=cell.t,
                                      block_sizes=bs)
  bad = result["error"] or any(
      compile_check.problems(row, target.shared_memory_per_block, True)
      for row in result["kernels"])
  if bad:
    logging.info("dropped (compile check): %s", bs)
  return not bad


def _capped(backend: str, candidates: list, cell: Cell) -> list:
  seen, out = set(), []
  for c in candidates:
    if c not in seen:
      seen.add(c)
      if _compiles_cleanly(backend, c, cell):
        out.append(c)
  if _MAX_CANDIDATES.value:
    out = out[: _MAX_CANDIDATES.value]
  return out


def _triton_forward(base, cell, kind):
  """Forward tiles around `base` (which comes first)."""
  out = [base]
  for bq, bk, warps, stages in itertools.product(
      (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
    c = dataclasses.replace(base, block_q=bq, block_kv=bk, num_warps=warps,
                            num_stages=stages)
    if _fits(c, cell, kind):
      out.append(c)
  return out


def _triton_dkv(base, cell, kind):
  out = [base]
  for (bq, bkv), warps, stages in itertools.product(
      ((16, 64), (32, 64), (32, 128), (64, 64), (64, 128), (16, 128)),
      (4, 8), (1, 2, 3)):
    c = dataclasses.replace(base, block_q_dkv=bq, block_kv_dkv=bkv,
                            num_warps_bwd=warps, num_stages_bwd=stages)
    if _fits(c, cell, kind):
      out.append(c)
  return out


def _triton_dq(base, cell, kind):
  out = [base]
  for bq, bkv in ((64, 16), (64, 32), (128, 32), (128, 64), (64, 64),
                  (128, 16)):
    c = dataclasses.replace(base, block_q_dq=bq, block_kv_dq=bkv)
    if _fits(c, cell, kind):
      out.append(c)
  return out


def _mosaic_gpu_pass(name):
  def candidates(base, cell, kind):
    del kind  # Every sm90 GPU has the same shared memory.
    return mosaic_gpu.candidate_block_sizes(
        base, head_dim=cell.h, dtype=_DTYPES[cell.dtype], passes=(name,))
  return candidates


@dataclasses.dataclass(frozen=True)
class Tuner:
  """How one backend is tuned.

  Attributes:
    module: the backend module (its `heuristic_block_sizes` is the start).
    passes: (name, candidates(base, cell, kind), whether to time the
      backward pass too), swept in order, each from the best of the last.
    dtypes: the input dtypes it runs.
  """

  module: Any
  passes: tuple[tuple[str, Callable[..., list], bool], ...]
  dtypes: tuple[str, ...]


TUNERS = {
    "triton": Tuner(
        module=triton,
        passes=(("forward", _triton_forward, False),
                ("dK/dV", _triton_dkv, True),
                ("dQ", _triton_dq, True)),
        dtypes=("bfloat16", "float16", "float32")),
    "mosaic_gpu": Tuner(
        module=mosaic_gpu,
        passes=(("forward", _mosaic_gpu_pass("forward"), False),
                ("backward", _mosaic_gpu_pass("backward"), True)),
        dtypes=("bfloat16", "float16")),
}


def _backends(kind: str) -> list[str]:
  """The backends to tune: --backends, else every one this device runs."""
  if _BACKENDS.value:
    unknown = set(_BACKENDS.value) - set(TUNABLE)
    if unknown:
      raise app.UsageError(f"--backends: {sorted(unknown)} not in {TUNABLE}")
    return list(_BACKENDS.value)
  target = gpu_target.current()
  if target is not None:
    hopper = target.major == 9
  else:  # No GPU: Hopper only when previewing one (--dry_run).
    hopper = any(name in kind for name in triton.HOPPER_KINDS)
  return ["triton", "mosaic_gpu"] if hopper else ["triton"]


def _inputs(cell: Cell, t: int | None = None, b: int | None = None,
            seed: int = 0):
  t = cell.t if t is None else t
  b = cell.b if b is None else b
  gen = testing.rng("tune", seed)
  q, k, v, _ = testing.make_inputs(
      testing.Case(b=b, t=t, s=t, n=cell.n, k=cell.k, h=cell.h,
                   causal=cell.causal), _DTYPES[cell.dtype], gen)
  return q, k, v, testing.normal(gen, q.shape, q.dtype)


def _attention(bs, causal):
  # Every tunable config class belongs to exactly one backend.
  backend = {t.module.BACKEND.block_sizes_type: name
             for name, t in TUNERS.items()}[type(bs)]

  def fn(q, k, v):
    return pallas_fa.flash_attention(
        q, k, v, is_causal=causal, implementation=backend, block_sizes=bs)
  return fn


def _compiled(bs, cell, backward, args):
  fn = _attention(bs, cell.causal)
  if backward:
    def fwd_bwd(q, k, v, dout):
      out, pullback = jax.vjp(fn, q, k, v)
      return out, pullback(dout)
    return jax.jit(fwd_bwd).lower(*args).compile()
  return jax.jit(fn).lower(*args[:3]).compile()


def _time(compiled, args) -> float:
  """Median milliseconds per call."""
  return testing.time_call(compiled, *args, repeats=_REPEATS.value,
                           warmup=_WARMUP.value).ms


def sweep(candidates, cell, backward, args) -> list[tuple[float, Any]]:
  """(ms, config) of every candidate that compiles and runs, fastest first."""
  results = []
  for bs in candidates:
    try:
      compiled = _compiled(bs, cell, backward, args)
      ms = _time(compiled, args if backward else args[:3])
    except Exception as e:  # noqa: BLE001 - a config may not compile/fit.
      logging.info("  skipped %s: %s", bs, str(e).splitlines()[0][:200])
      continue
    tflops = cell.flops(backward) / ms * 1e-9
    logging.info("  %8.3f ms %7.1f TFLOP/s  %s", ms, tflops, bs)
    results.append((ms, bs))
  results.sort(key=lambda r: r[0])
  return results


def check(bs, cell: Cell) -> bool:
  """The FlashAttention rule against the float32 reference (fwd + grads),
  on one batch row and a ragged length (so the masked tail tiles are
  exercised too)."""
  t = min(cell.t, _CHECK_LEN.value) - 3
  q, k, v, dout = _inputs(cell, t=t, b=1, seed=1)
  dtype = _DTYPES[cell.dtype]

  def results(fn):
    out, pullback = jax.vjp(fn, q, k, v)
    return [out, *pullback(dout.astype(out.dtype))]

  def reference_fn(compute_dtype):
    def fn(q, k, v):
      return testing.reference(q, k, v, is_causal=cell.causal,
                               compute_dtype=compute_dtype)[0]
    return fn

  got = results(_attention(bs, cell.causal))
  ref32 = results(reference_fn(jnp.float32))
  same = results(reference_fn(dtype))
  ok = True
  for name, x, r, rs in zip(("out", "dq", "dk", "dv"), got, ref32, same,
                            strict=True):
    comparison = testing.compare(name, x, r, rs, dtype=dtype,
                                 precision="default")
    if not comparison.ok:
      logging.warning("  %s fails: %s", bs, comparison.message())
      ok = False
  return ok


def tune_cell(backend: str, cell: Cell, kind: str) -> dict | None:
  """Sweeps one cell of one backend; returns its JSON record (None if
  nothing passed)."""
  tuner = TUNERS[backend]
  # Start from the heuristic, not from earlier tuning results.
  best = tuner.module.heuristic_block_sizes(
      q_len=cell.t, kv_len=cell.t, head_dim=cell.h, dtype=cell.dtype,
      is_causal=cell.causal, device_kind=kind)
  if _DRY_RUN.value:
    for name, candidates, _ in tuner.passes:
      cands = _capped(backend, candidates(best, cell, kind), cell)
      print(f"{backend} {cell}: {len(cands)} {name} candidates")
      for c in cands:
        print(f"  {c}")
    return None
  args = _inputs(cell)
  ranked = []
  for name, candidates, backward in tuner.passes:
    logging.info("%s %s: %s sweep", backend, cell, name)
    results = sweep(_capped(backend, candidates(best, cell, kind), cell),
                    cell, backward, args)
    if not results:
      if not backward:
        return None  # Not even the forward pass runs.
      continue
    best = results[0][1]
    ranked = [bs for _, bs in results]
  # The fastest config of the last pass that passes the correctness check.
  for bs in ranked or [best]:
    if check(bs, cell):
      break
  else:
    logging.error("%s %s: no candidate passed the correctness check",
                  backend, cell)
    return None
  fwd_ms = _time(_compiled(bs, cell, False, args[:3]), args[:3])
  bwd_ms = _time(_compiled(bs, cell, True, args), args)
  record = {
      "key": tuning.tuning_key(head_dim=cell.h, dtype=cell.dtype,
                               q_len=cell.t, kv_len=cell.t,
                               is_causal=cell.causal),
      "block_sizes": dataclasses.asdict(bs),
      "shape": dataclasses.asdict(cell),
      "ms": {"fwd": fwd_ms, "fwd_bwd": bwd_ms},
      "tflops": {"fwd": cell.flops(False) / fwd_ms * 1e-9,
                 "fwd_bwd": cell.flops(True) / bwd_ms * 1e-9},
  }
  logging.info("%s %s: best %s", backend, cell, record)
  return record


def output_path(kind: str) -> pathlib.Path:
  if _OUTPUT.value:
    return pathlib.Path(_OUTPUT.value)
  package = pathlib.Path(tuning.__file__).parent
  return (package / tuning.TUNED_DIR /
          (tuning.device_file_name(kind) + ".json"))


def merge(path: pathlib.Path, records: dict[str, list[dict]],
          kind: str) -> dict:
  """Adds each backend's records to the file's, replacing those with the
  same key."""
  data = {}
  if path.exists():
    data = json.loads(path.read_text())
  data.update(
      device_kind=kind,
      jax_version=jax.__version__,
      updated=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
  )
  for backend, new in records.items():
    keys = {json.dumps(r["key"], sort_keys=True) for r in new}
    kept = [r for r in data.get(backend, [])
            if json.dumps(r.get("key"), sort_keys=True) not in keys]
    data[backend] = sorted(
        kept + new, key=lambda r: json.dumps(r["key"], sort_keys=True))
  return data


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  for flag in (_HEAD_DIMS, _SEQ_LENS):
    if not all(x.strip().isdigit() and int(x) > 0 for x in flag.value):
      raise app.UsageError(
          f"--{flag.name} must be positive ints, got {flag.value}.")
  kind = _DEVICE_KIND.value or tuning.device_kind()
  if api.platform() != "gpu" and not _DRY_RUN.value:
    logging.warning("Tuning on %r: kernels run in interpret mode; timings "
                    "are meaningless.", kind)
  records = {}
  for backend in _backends(kind):
    if _DTYPE.value not in TUNERS[backend].dtypes:
      logging.warning("%s does not run %s: not tuned.", backend,
                      _DTYPE.value)
      continue
    for cell in _cells():
      record = tune_cell(backend, cell, kind)
      if record is not None:
        records.setdefault(backend, []).append(record)
  if _DRY_RUN.value or not records:
    return
  path = output_path(kind)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(merge(path, records, kind), indent=1) + "\n")
  for backend, new in records.items():
    print(f"wrote {len(new)} {backend} records to {path}")
    for r in new:
      print(f"  {r['key']}: {r['block_sizes']} "
            f"fwd {r['tflops']['fwd']:.1f} / fwd+bwd "
            f"{r['tflops']['fwd_bwd']:.1f} TFLOP/s")


if __name__ == "__main__":
  app.run(main)
