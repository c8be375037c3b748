r"""Times pallas_fa's implementations against JAX's own attention kernels.

Every (implementation, shape, mode) cell is first checked against the float32
materialised reference (`pallas_fa.reference.attention`) on the same inputs,
then timed: the median of `--repeats` runs after warm-up. The table reports
milliseconds, FLOP/s (GFLOP/s on CPU, TFLOP/s elsewhere), the percentage of the
machine's own matmul rate measured in the same run, the speed-up against the
`jax.nn.dot_product_attention(implementation="xla")` peer
(peer time / this time), and peak memory.

FLOPs follow the FlashAttention convention: forward 4*B*N*T*S*H, halved for
causal attention when T == S; backward 2.5x forward, so forward+backward is
3.5x forward.

Peak memory: with `--isolate` (the default on CPU) each cell is timed in a
fresh child process, which reports its peak resident set size
(`getrusage(RUSAGE_SELF).ru_maxrss`; on GPU/TPU the device's
`peak_bytes_in_use`). Without isolation the table shows XLA's compiled memory
estimate (arguments + outputs + temporaries), marked with `~`.

Commands (from the repository root):

  # CPU, the foundation targets: float32, B=1, N=8, H=64, T=S in 512..4096,
  # causal and not, forward and forward+backward, chunked vs jax.nn xla.
  python scripts/benchmark.py --grid=cpu \
      --json=benchmarks/results/cpu.json --plot=benchmarks/results/cpu.png

  # GPU, the FlashAttention protocol: bfloat16, B*T = 16k tokens, N*H = 2048,
  # H in {64, 128, 256}, T in 512..16k, causal and not; peers jax.nn xla and
  # cudnn, JAX's Pallas `mha` and (Hopper) `attention_mgpu`. One head dim per
  # command keeps each run short:
  python scripts/benchmark.py --grid=fa --head_dim=64 \
      --json=benchmarks/results/h100_d64.json \
      --plot=benchmarks/results/h100_d64.png

  # A quick look at a few shapes:
  python scripts/benchmark.py --grid=cpu --seq_lens=256,512 --modes=fwd \
      --repeats=3 --noisolate

Every preset value can be overridden by its flag (`--seq_lens`, `--impls`,
`--peers`, `--dtype`, `--batch`, `--heads`, `--head_dim`, `--causal`,
`--modes`, `--repeats`, ...). `--peers=none` times no peer.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import math
import os
import platform as platform_lib
import resource
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from absl import app
from absl import flags

import pallas_fa
from pallas_fa import api
from pallas_fa import masking
from pallas_fa import reference

Array = Any

MODES = ("fwd", "fwd_bwd")
DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}
# Peers: `jax.nn.dot_product_attention` (xla, cudnn), JAX's Pallas Triton
# `mha`, its Hopper Mosaic GPU `attention_mgpu` and its TPU `flash_attention`.
PEERS = ("xla", "cudnn", "pallas_mha", "pallas_mgpu", "pallas_tpu")
DEFAULT_PEERS = {
    "cpu": ("xla",),
    "gpu": ("xla", "cudnn", "pallas_mha", "pallas_mgpu"),
    "tpu": ("xla", "pallas_tpu"),
}
# The candidates that materialise the [B, N, T, S] logits: a bare number in
# --peer_max_seq limits these.
MATERIALISING = ("jax:xla", "xla")
# The peer every ratio is taken against.
BASELINE = "jax:xla"

# The check: float32 results must agree with the float32 reference to this
# fraction of max|ref| (loose enough for TF32 matmuls on GPU, tight enough to
# catch a wrong mask, scale or gradient). Lower precision uses the
# FlashAttention rule: |x - ref32| <= 2 |ref_same_dtype - ref32| + floor, the
# floor being a few ulps of max|ref|.
F32_TOL = 1e-2
LOW_PRECISION_FLOOR_ULPS = 4

PRESETS = {
    # The foundation's CPU targets.
    "cpu": dict(
        seq_lens=(512, 1024, 2048, 4096),
        dtype="float32",
        batch=1,
        tokens=0,
        heads=8,
        model_dim=0,
        head_dim=(64,),
        causal="both",
        modes=MODES,
        repeats=5,
        warmup=1,
        peer_max_seq=("8192",),
        matmul_size=2048,
    ),
    # FlashAttention-2 paper protocol: B*T = 16k tokens, N*H = 2048.
    "fa": dict(
        seq_lens=(512, 1024, 2048, 4096, 8192, 16384),
        dtype="bfloat16",
        batch=0,
        tokens=16384,
        heads=0,
        model_dim=2048,
        head_dim=(64, 128, 256),
        causal="both",
        modes=MODES,
        repeats=10,
        warmup=2,
        peer_max_seq=(),
        matmul_size=8192,
    ),
}

_CHILD_MARKER = "BENCHMARK_CHILD_RESULT "

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the command-line flags.

  Called only when this file runs as a script, so importing it (as the tests
  do) registers no global flags that could clash with another script's.
  """
  flags.DEFINE_enum(
      "grid", None, sorted(PRESETS),
      "Preset: 'cpu' (foundation targets) or 'fa' (FlashAttention GPU "
      "protocol). Default: 'fa' on GPU, else 'cpu'.")
  flags.DEFINE_list("seq_lens", None, "T = S values (preset default).")
  flags.DEFINE_list(
      "impls", None,
      "pallas_fa implementations to time; default: those the automatic choice "
      "would try on this platform.")
  flags.DEFINE_list(
      "peers", None,
      f"Peers among {PEERS}, or 'none'; default: those for this platform.")
  flags.DEFINE_enum("dtype", None, sorted(DTYPES), "Input dtype.")
  flags.DEFINE_integer("batch", None, "B; 0 = tokens // T.")
  flags.DEFINE_integer("tokens", None, "B * T when --batch=0.")
  flags.DEFINE_integer("heads", None, "N; 0 = model_dim // H.")
  flags.DEFINE_integer("model_dim", None, "N * H when --heads=0.")
  flags.DEFINE_list("head_dim", None, "H values.")
  flags.DEFINE_enum(
      "causal", None, ["both", "true", "false"], "Causal masking.")
  flags.DEFINE_list("modes", None, f"Subset of {MODES}.")
  flags.DEFINE_integer("repeats", None, "Timed runs per cell (median).")
  flags.DEFINE_integer("warmup", None, "Untimed runs after compilation.")
  flags.DEFINE_string("json", None, "Write the results as JSON here.")
  flags.DEFINE_string("plot", None, "Write a PNG plot here.")
  flags.DEFINE_enum("plot_metric", "flops", ["flops", "ms"], "Plot's y axis.")
  flags.DEFINE_bool(
      "isolate", None,
      "Time each cell in a fresh process and report its peak memory. Default: "
      "on for CPU, off elsewhere.")
  flags.DEFINE_list(
      "peer_max_seq", None,
      "Longest T to run for memory-hungry candidates: 'LEN' applies to the "
      f"materialising ones {MATERIALISING}, 'LABEL=LEN' to one (e.g. "
      "jax:cudnn=8192); longer cells are reported as skipped (memory).")
  flags.DEFINE_integer(
      "check_rows", 256,
      "Above 2x this many queries, the check compares only the first and last "
      "check_rows query rows (the reference is quadratic in memory).")
  flags.DEFINE_integer(
      "matmul_size", None, "M = N = K of the matmul-rate ceiling; 0 = skip.")
  flags.DEFINE_integer("seed", 0, "Seed of the random inputs.")
  flags.DEFINE_integer(
      "cell_timeout", 1800, "Seconds an isolated cell may run.")
  flags.DEFINE_string(
      "child_spec", None, "Internal: run one isolated cell (JSON) and exit.")


# ---------------------------------------------------------------------------
# Problem description.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
  """One self-attention problem (T = S, N query and key/value heads)."""

  batch: int
  seq_len: int
  heads: int
  head_dim: int
  causal: bool
  dtype: str

  def __post_init__(self):
    for name in ("batch", "seq_len", "heads", "head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"Shape.{name} must be a positive int, got {value!r}.")
    if self.dtype not in DTYPES:
      raise ValueError(f"Shape.dtype must be one of {sorted(DTYPES)}, got "
                       f"{self.dtype!r}.")

  def flops(self, mode: str) -> float:
    return attention_flops(
        self.batch, self.heads, self.seq_len, self.seq_len, self.head_dim,
        causal=self.causal, mode=mode)

  def __str__(self):
    return (f"B={self.batch} N={self.heads} H={self.head_dim} "
            f"T={self.seq_len} causal={self.causal} {self.dtype}")


def attention_flops(b, n, t, s, h, *, causal: bool, mode: str) -> float:
  """FLOPs of one call by the FlashAttention convention.

  Args:
    b, n, t, s, h: batch, query heads, query length, key length, head dim.
    causal: causal masking (halves the work when t == s).
    mode: "fwd" or "fwd_bwd" (backward = 2.5x forward).

  Returns:
    The FLOP count as a float.
  """
  flops = 4.0 * b * n * t * s * h
  if causal and t == s:
    flops /= 2
  if mode == "fwd_bwd":
    flops *= 3.5
  elif mode != "fwd":
    raise ValueError(f"mode must be one of {MODES}, got {mode=}.")
  return flops


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
  """Something to time: a pallas_fa implementation or a JAX peer."""

  kind: str  # "impl" | "peer"
  name: str

  @property
  def label(self) -> str:
    return self.name if self.kind == "impl" else f"jax:{self.name}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """Everything one benchmark run needs (flags resolved against a preset)."""

  grid: str
  shapes: tuple[Shape, ...]
  candidates: tuple[Candidate, ...]
  modes: tuple[str, ...]
  repeats: int
  warmup: int
  isolate: bool
  max_seq: tuple[tuple[str, int], ...]  # (label, longest T)
  check_rows: int = 256
  matmul_size: int = 0
  seed: int = 0
  cell_timeout: float = 1800.0
  min_repeat_s: float = 0.05


def _platform() -> str:
  return api.platform()


def default_impls(platform: str) -> tuple[str, ...]:
  """The implementations the automatic choice tries here, if they import.

  Args:
    platform: "cpu" | "gpu" | "tpu".

  Returns:
    Implementation names, fastest first; the others are printed as skipped.
  """
  order = api.AUTO_ORDER.get(platform, ("chunked",))
  names = []
  for name in order:
    try:
      api.get_backend(name)
    except NotImplementedError as e:
      print(f"impl {name}: skipped ({e})")
      continue
    names.append(name)
  return tuple(names)


def _parse_max_seq(entries: Sequence[str]) -> tuple[tuple[str, int], ...]:
  limits = {}
  for entry in entries:
    entry = entry.strip()
    if not entry:
      continue
    label, sep, value = entry.rpartition("=")
    try:
      length = int(value)
    except ValueError:
      raise ValueError(f"--peer_max_seq entries are LEN or LABEL=LEN, got "
                       f"{entry!r}.") from None
    for name in ((label,) if sep else MATERIALISING):
      limits[name] = length
  return tuple(sorted(limits.items()))


def make_settings(
    *,
    grid: str | None = None,
    platform: str | None = None,
    seq_lens: Sequence[int] | None = None,
    impls: Sequence[str] | None = None,
    peers: Sequence[str] | None = None,
    dtype: str | None = None,
    batch: int | None = None,
    tokens: int | None = None,
    heads: int | None = None,
    model_dim: int | None = None,
    head_dim: Sequence[int] | None = None,
    causal: str | None = None,
    modes: Sequence[str] | None = None,
    repeats: int | None = None,
    warmup: int | None = None,
    isolate: bool | None = None,
    peer_max_seq: Sequence[str] | None = None,
    check_rows: int = 256,
    matmul_size: int | None = None,
    seed: int = 0,
    cell_timeout: float = 1800.0,
) -> Settings:
  """Resolves explicit values (None = preset default) into `Settings`.

  Args:
    grid: preset name ("cpu" or "fa"); default "fa" on GPU, else "cpu".
    platform: "cpu" | "gpu" | "tpu"; default the JAX default backend.
    seq_lens .. cell_timeout: as the flags of the same names.

  Returns:
    The resolved settings.

  Raises:
    ValueError: an unknown mode, peer or implementation, or a shape that
      cannot be formed.
  """
  platform = platform or _platform()
  grid = grid or ("fa" if platform == "gpu" else "cpu")
  preset = PRESETS[grid]

  def pick(value, name):
    return preset[name] if value is None else value

  seq_lens = [int(t) for t in pick(seq_lens, "seq_lens")]
  head_dims = [int(h) for h in pick(head_dim, "head_dim")]
  dtype = pick(dtype, "dtype")
  batch, tokens = pick(batch, "batch"), pick(tokens, "tokens")
  heads, model_dim = pick(heads, "heads"), pick(model_dim, "model_dim")
  causal = pick(causal, "causal")
  causals = {"both": (False, True), "true": (True,), "false": (False,)}[
      causal]
  modes = tuple(pick(modes, "modes"))
  for mode in modes:
    if mode not in MODES:
      raise ValueError(f"modes must be a subset of {MODES}, got {modes=}.")

  shapes = []
  for h in head_dims:
    n = heads or model_dim // h
    for t in seq_lens:
      b = batch or tokens // t
      if b < 1 or n < 1:
        raise ValueError(
            f"Cannot form a shape from {batch=}, {tokens=}, {heads=}, "
            f"{model_dim=}, T={t}, H={h}.")
      for c in causals:
        shapes.append(Shape(batch=b, seq_len=t, heads=n, head_dim=h,
                            causal=c, dtype=dtype))

  if impls is None:
    impls = default_impls(platform)
  for name in impls:
    if name not in api.REGISTRY:
      raise ValueError(f"Unknown implementation {name!r}; expected one of "
                       f"{sorted(api.REGISTRY)}.")
  peers = DEFAULT_PEERS.get(platform, ("xla",)) if peers is None else peers
  peers = [p for p in peers if p != "none"]
  for name in peers:
    if name not in PEERS:
      raise ValueError(f"Unknown peer {name!r}; expected one of {PEERS}.")
  candidates = [Candidate(kind="impl", name=n) for n in impls]
  candidates += [Candidate(kind="peer", name=n) for n in peers]

  return Settings(
      grid=grid,
      shapes=tuple(shapes),
      candidates=tuple(candidates),
      modes=modes,
      repeats=int(pick(repeats, "repeats")),
      warmup=int(pick(warmup, "warmup")),
      isolate=(platform == "cpu") if isolate is None else bool(isolate),
      max_seq=_parse_max_seq(pick(peer_max_seq, "peer_max_seq")),
      check_rows=int(check_rows),
      matmul_size=int(pick(matmul_size, "matmul_size")),
      seed=int(seed),
      cell_timeout=float(cell_timeout),
  )


# ---------------------------------------------------------------------------
# The functions under test.


def _import(module: str):
  try:
    return importlib.import_module(module)
  except Exception as e:  # ImportError, or a compiler stack failing to load.
    raise NotImplementedError(f"cannot import {module}: {e}") from e


def _is_hopper() -> bool:
  capability = getattr(jax.devices()[0], "compute_capability", None)
  return capability is not None and str(capability).startswith("9")


def peer_unavailable_reason(name: str, platform: str) -> str | None:
  """Why peer `name` cannot run here.

  Args:
    name: one of PEERS.
    platform: "cpu" | "gpu" | "tpu".

  Returns:
    The reason, or None if the peer may run (its own checks may still
    refuse a shape; that is reported per cell).
  """
  if name == "xla":
    return None
  if name == "cudnn":
    return None if platform == "gpu" else "cuDNN runs only on GPU"
  if name in ("pallas_mha", "pallas_mgpu"):
    # Interpret mode elsewhere would time an emulator, not a kernel.
    if platform != "gpu":
      return "a GPU kernel (needs a GPU)"
    if name == "pallas_mgpu" and not _is_hopper():
      return "Mosaic GPU attention needs Hopper (sm90)"
    module = ("jax.experimental.pallas.ops.gpu.attention" if
              name == "pallas_mha" else
              "jax.experimental.pallas.ops.gpu.attention_mgpu")
  elif name == "pallas_tpu":
    if platform != "tpu":
      return "a TPU kernel (needs a TPU)"
    module = "jax.experimental.pallas.ops.tpu.flash_attention"
  else:
    return f"unknown peer {name!r}"
  try:
    _import(module)
  except NotImplementedError as e:
    return str(e)
  return None


def _mgpu_config(module, causal: bool):
  # Block sizes from the kernel's own sweep; only fields this JAX has.
  fields = {f.name for f in dataclasses.fields(module.TuningConfig)}
  kw = dict(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal,
            block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
  return module.TuningConfig(**{k: v for k, v in kw.items() if k in fields})


def attention_fn(candidate: Candidate, shape: Shape) -> Callable:
  """(q, k, v) -> out for `candidate` on `shape` (default scale 1/sqrt(H)).

  Args:
    candidate: an implementation or peer.
    shape: the problem (its causal flag is baked in).

  Returns:
    A traceable function of (q, k, v), each [B, T, N, H].

  Raises:
    NotImplementedError: the candidate cannot run here.
  """
  causal = shape.causal
  scale = 1.0 / math.sqrt(shape.head_dim)
  if candidate.kind == "impl":
    name = candidate.name

    def ours(q, k, v):
      # Looked up at call time so tests can substitute the entry point.
      return pallas_fa.flash_attention(
          q, k, v, is_causal=causal, implementation=name)

    return ours

  name = candidate.name
  reason = peer_unavailable_reason(name, _platform())
  if reason is not None:
    raise NotImplementedError(reason)
  if name in ("xla", "cudnn"):
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=name)
  if name == "pallas_mha":
    module = _import("jax.experimental.pallas.ops.gpu.attention")
    return lambda q, k, v: module.mha(
        q, k, v, None, sm_scale=scale, causal=causal)
  if name == "pallas_mgpu":
    module = _import("jax.experimental.pallas.ops.gpu.attention_mgpu")
    config = _mgpu_config(module, causal)
    # The kernel applies no logit scale: fold it into q (counted in its time).
    return lambda q, k, v: module.attention(q * scale, k, v, config)
  if name == "pallas_tpu":
    module = _import("jax.experimental.pallas.ops.tpu.flash_attention")

    def tpu(q, k, v):
      bnth = lambda x: x.transpose(0, 2, 1, 3)
      out = module.flash_attention(
          bnth(q), bnth(k), bnth(v), causal=causal, sm_scale=scale)
      return bnth(out)

    return tpu
  raise NotImplementedError(f"unknown peer {name!r}")


def build(candidate: Candidate, shape: Shape, mode: str) -> Callable:
  """The jitted function checked and timed for one cell.

  Args:
    candidate: an implementation or peer.
    shape: the problem.
    mode: "fwd" or "fwd_bwd".

  Returns:
    fwd: (q, k, v, dout) -> out; fwd_bwd: (q, k, v, dout) ->
    (out, dq, dk, dv). dout is an argument of both so that one executable
    serves the check (with a masked dout) and the timing.
  """
  fn = attention_fn(candidate, shape)
  if mode == "fwd":
    return jax.jit(lambda q, k, v, dout: fn(q, k, v))

  def fwd_bwd(q, k, v, dout):
    out, pullback = jax.vjp(fn, q, k, v)
    return (out, *pullback(dout.astype(out.dtype)))

  return jax.jit(fwd_bwd)


def make_inputs(shape: Shape, seed: int) -> tuple[Array, ...]:
  """Random inputs of one shape.

  Args:
    shape: the problem.
    seed: random seed.

  Returns:
    (q, k, v, dout), each [B, T, N, H] in the shape's dtype.
  """
  keys = jax.random.split(jax.random.key(seed), 4)
  dims = (shape.batch, shape.seq_len, shape.heads, shape.head_dim)
  dtype = DTYPES[shape.dtype]
  return tuple(jax.random.normal(key, dims, jnp.float32).astype(dtype)
               for key in keys)


# ---------------------------------------------------------------------------
# Correctness check against the float32 reference.


class Mismatch(Exception):
  """A result disagrees with the reference."""


def check_rows(seq_len: int, rows: int) -> np.ndarray:
  """The query rows the check compares.

  Args:
    seq_len: T.
    rows: rows kept at each end of a long sequence.

  Returns:
    All row indices, or the first and last `rows` when T > 2 * rows.
  """
  if seq_len <= 2 * rows:
    return np.arange(seq_len)
  return np.concatenate([np.arange(rows), np.arange(seq_len - rows, seq_len)])


def reference_results(shape, q, k, v, dout, rows, grads, compute_dtype):
  """Reference (out, dq, dk, dv) on the query rows `rows` only.

  Slicing the queries (with their true positions) keeps the materialised
  logits at [B, N, len(rows), S]. The gradients are those of the full
  problem with dout zero outside `rows`: a query row whose dout is zero adds
  nothing to dK/dV, so the candidate run with that masked dout must match.

  Args:
    shape: the problem (scale and causal flag).
    q, k, v: [B, T, N, H] inputs.
    dout: [B, T, N, H] cotangent; only its `rows` are used.
    rows: query row indices.
    grads: also compute the gradients.
    compute_dtype: dtype of the reference's arithmetic.

  Returns:
    (out [B, R, N, H], dq [B, T, N, H] or None, dk, dv), float32.
  """
  b, t = q.shape[:2]
  s = k.shape[1]
  info = masking.MaskInfo(
      q_positions=jnp.broadcast_to(jnp.asarray(rows, jnp.int32),
                                   (b, len(rows))),
      kv_positions=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
      is_causal=shape.causal,
  )
  scale = 1.0 / math.sqrt(shape.head_dim)

  @jax.jit
  def materialised(qs, k, v, ds):
    def f(qs, k, v):
      return reference.attention(
          qs, k, v, None, info, scale=scale, soft_cap=None,
          compute_dtype=compute_dtype)[0]

    cast = lambda x: x.astype(compute_dtype)
    if not grads:
      return f(cast(qs), cast(k), cast(v)), None, None, None
    out, pullback = jax.vjp(f, cast(qs), cast(k), cast(v))
    dqs, dk, dv = pullback(cast(ds))
    dq = jnp.zeros((b, t) + dqs.shape[2:], dqs.dtype).at[:, rows].set(dqs)
    return out, dq, dk, dv

  results = materialised(q[:, rows], k, v, dout[:, rows])
  return tuple(None if x is None else x.astype(jnp.float32) for x in results)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reference:
  """Reference results of one shape, shared by every candidate."""

  rows: np.ndarray
  dout_masked: Array  # dout, zero outside `rows`
  f32: tuple  # (out, dq, dk, dv) float32 reference
  same: tuple | None  # the same in the input dtype (low precision only)


def make_reference(shape, inputs, rows: int, grads: bool) -> Reference:
  """Computes the float32 (and same-dtype) reference for `shape`.

  Args:
    shape: the problem.
    inputs: (q, k, v, dout) from `make_inputs`.
    rows: see `check_rows`.
    grads: also compute the reference gradients.

  Returns:
    The shape's `Reference`.
  """
  q, k, v, dout = inputs
  idx = check_rows(shape.seq_len, rows)
  masked = jnp.zeros_like(dout).at[:, idx].set(dout[:, idx])
  f32 = reference_results(shape, q, k, v, masked, idx, grads, jnp.float32)
  same = None
  if shape.dtype != "float32":
    same = reference_results(shape, q, k, v, masked, idx, grads,
                             DTYPES[shape.dtype])
  return Reference(rows=idx, dout_masked=masked, f32=f32, same=same)


def _max_abs(x) -> float:
  return float(jnp.max(jnp.abs(x.astype(jnp.float32))))


def compare(results, ref: Reference, dtype: str) -> dict[str, dict]:
  """Compares candidate (out, dq, dk, dv) with the reference.

  Args:
    results: the candidate's outputs (out on every row; grads with
      ref.dout_masked as cotangent), grads may be absent.
    ref: the shape's reference.
    dtype: the input dtype name (selects the tolerance rule).

  Returns:
    {name: {"err": max abs error, "tol": allowed, "ref_max": max|ref|}}.

  Raises:
    Mismatch: some result is not finite or exceeds its tolerance.
  """
  names = ("out", "dq", "dk", "dv")
  report = {}
  got_all = (results[0][:, ref.rows],) + tuple(results[1:])
  for i, got in enumerate(got_all):
    name, want = names[i], ref.f32[i]
    if want is None:
      continue
    ref_max = _max_abs(want)
    err = _max_abs(got.astype(jnp.float32) - want)
    if ref.same is None:
      tol = F32_TOL * ref_max
    else:
      eps = float(jnp.finfo(DTYPES[dtype]).eps)
      same_err = _max_abs(ref.same[i] - want)
      tol = 2 * same_err + LOW_PRECISION_FLOOR_ULPS * eps * ref_max
    report[name] = {"err": err, "tol": tol, "ref_max": ref_max}
    if not err <= tol:  # also catches NaN
      raise Mismatch(
          f"{name} disagrees with the float32 reference: max|err|={err:.3g} "
          f"> tol={tol:.3g} (max|ref|={ref_max:.3g}, rows checked: "
          f"{len(ref.rows)})")
  return report


# ---------------------------------------------------------------------------
# Timing and memory.


def _median_time(fn, args, *, repeats, warmup, min_repeat_s):
  """Median seconds per call; returns (median, all times, calls per run)."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(max(1, warmup)):
    jax.block_until_ready(fn(*args))
  per_call = (time.perf_counter() - start) / max(1, warmup)
  # Short calls are timed in back-to-back batches so that the launch and
  # synchronisation overhead does not dominate.
  inner = int(min(100, max(1, math.ceil(min_repeat_s / max(per_call, 1e-9)))))
  times = []
  for _ in range(max(1, repeats)):
    start = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / inner)
  return statistics.median(times), times, inner


def _compiled_bytes(compiled) -> int | None:
  try:
    stats = compiled.memory_analysis()
  except Exception:  # Not every backend implements it.
    return None
  if stats is None:
    return None
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def _memory_now() -> tuple[int | None, str]:
  """(peak bytes so far, source) of this process on its default device."""
  stats = None
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # Some backends do not report memory.
    pass
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device_peak"
  # Linux: VmHWM is the high-water mark of this process's own address space.
  # ru_maxrss is not usable in a child: fork+exec carries the parent's peak
  # into it, so every isolated cell would report at least the parent's RSS.
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024, "rss_peak"
  except OSError:
    pass
  kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB.
  return int(kib * scale), "rss_peak"


def measure(compiled, args, *, repeats, warmup, min_repeat_s) -> dict:
  """Times an already compiled cell.

  Args:
    compiled: the executable.
    args: its arguments.
    repeats: timed runs (the median is reported).
    warmup: untimed runs first.
    min_repeat_s: a run repeats short calls back to back for this long.

  Returns:
    {"ms": median, "times_ms": every run, "calls_per_run"}.
  """
  median, times, inner = _median_time(
      compiled, args, repeats=repeats, warmup=warmup,
      min_repeat_s=min_repeat_s)
  return {"ms": median * 1e3, "times_ms": [t * 1e3 for t in times],
          "calls_per_run": inner}


def _run_child(spec: dict) -> dict:
  """Body of an isolated cell: compile, time, report peak memory."""
  candidate = Candidate(**spec["candidate"])
  shape = Shape(**spec["shape"])
  inputs = make_inputs(shape, spec["seed"])
  jax.block_until_ready(inputs)
  base_bytes, source = _memory_now()
  start = time.perf_counter()
  compiled = build(candidate, shape, spec["mode"]).lower(*inputs).compile()
  result = {"compile_s": time.perf_counter() - start,
            "xla_mem_bytes": _compiled_bytes(compiled)}
  result.update(measure(compiled, inputs, repeats=spec["repeats"],
                        warmup=spec["warmup"],
                        min_repeat_s=spec["min_repeat_s"]))
  peak, source = _memory_now()
  result.update(peak_bytes=peak, base_bytes=base_bytes, mem_source=source)
  return result


def _child_env() -> dict:
  env = dict(os.environ)
  # The parent may run with the platform allocator (see main); children
  # measure with JAX's default one.
  env.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
  return env


def run_isolated(candidate, shape, mode, settings: Settings) -> dict:
  """Times one cell in a fresh process (see `_run_child`).

  Args:
    candidate, shape, mode: the cell.
    settings: repeats, warm-up, seed and timeout.

  Returns:
    The child's timing and memory record.

  Raises:
    RuntimeError: the child failed; the message carries its reason.
  """
  spec = {
      "candidate": dataclasses.asdict(candidate),
      "shape": dataclasses.asdict(shape),
      "mode": mode,
      "repeats": settings.repeats,
      "warmup": settings.warmup,
      "seed": settings.seed,
      "min_repeat_s": settings.min_repeat_s,
  }
  cmd = [sys.executable, os.path.abspath(__file__),
         "--child_spec=" + json.dumps(spec)]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=settings.cell_timeout, env=_child_env())
  except subprocess.TimeoutExpired:
    raise RuntimeError(f"timed out after {settings.cell_timeout:.0f} s"
                       ) from None
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith(_CHILD_MARKER):
      result = json.loads(line[len(_CHILD_MARKER):])
      if "error" in result:
        raise _ChildError(result["error"], result.get("error_type", ""))
      return result
  if proc.returncode < 0:
    raise RuntimeError(
        f"child killed by signal {-proc.returncode} (out of memory?)")
  tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
  raise RuntimeError(f"child exited with {proc.returncode}: {tail}")


class _ChildError(Exception):
  """An exception raised inside an isolated cell, carried back by type."""

  def __init__(self, message, error_type):
    super().__init__(message)
    self.error_type = error_type


def matmul_ceiling(size: int, dtype: str, *, repeats: int, warmup: int,
                   seed: int = 0, min_repeat_s: float = 0.05) -> dict | None:
  """The machine's own matmul rate: a [size, size] @ [size, size] product.

  Args:
    size: M = N = K; 0 skips the measurement.
    dtype: dtype name of both operands.
    repeats, warmup, seed, min_repeat_s: as for `measure`.

  Returns:
    {"size", "dtype", "ms", "flops_per_s"}, or None when size is 0.
  """
  if not size:
    return None
  ka, kb = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (size, size), jnp.float32).astype(DTYPES[dtype])
  b = jax.random.normal(kb, (size, size), jnp.float32).astype(DTYPES[dtype])
  matmul = jax.jit(jnp.matmul).lower(a, b).compile()
  median, _, _ = _median_time(matmul, (a, b), repeats=repeats,
                              warmup=warmup, min_repeat_s=min_repeat_s)
  return {"size": size, "dtype": dtype, "ms": median * 1e3,
          "flops_per_s": 2.0 * size**3 / median}


# ---------------------------------------------------------------------------
# The sweep.


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return (text[0] if text else type(e).__name__)[:300]


def _is_oom(message: str) -> bool:
  lowered = message.lower()
  return ("resource_exhausted" in lowered or "out of memory" in lowered
          or "oom" in lowered.split())


def _classify(e: BaseException) -> tuple[str, str]:
  """(status, reason) of a failed cell."""
  error_type = getattr(e, "error_type", type(e).__name__)
  message = _first_line(e)
  if error_type == "Mismatch":
    return "wrong", message
  if error_type == "NotImplementedError":
    return "skipped", f"unsupported: {message}"
  if _is_oom(str(e)):
    return "skipped", f"memory: {message}"
  return "failed", f"{error_type}: {message}"


def _max_seq(settings: Settings, label: str) -> int | None:
  limit = dict(settings.max_seq).get(label)
  return limit if limit else None


def run_cell(candidate, shape, mode, inputs, ref, settings) -> dict:
  """Checks, then times, one (candidate, shape, mode); never raises.

  Args:
    candidate, shape, mode: the cell.
    inputs: (q, k, v, dout) of the shape.
    ref: the shape's reference.
    settings: the run's settings.

  Returns:
    The cell's record: status "ok" | "skipped" | "wrong" | "failed" with a
    reason, the check's errors, timings and memory.
  """
  record = {"impl": candidate.label, "kind": candidate.kind, "mode": mode,
            **dataclasses.asdict(shape), "flops": shape.flops(mode),
            "status": "ok", "reason": "", "ms": None}
  limit = _max_seq(settings, candidate.label)
  if limit is not None and shape.seq_len > limit:
    record.update(status="skipped",
                  reason=f"memory: T > --peer_max_seq {limit}")
    return record
  try:
    start = time.perf_counter()
    compiled = build(candidate, shape, mode).lower(*inputs).compile()
    record["compile_s"] = time.perf_counter() - start
    record["xla_mem_bytes"] = _compiled_bytes(compiled)
    q, k, v, dout = inputs
    results = compiled(q, k, v, ref.dout_masked)
    if mode == "fwd":
      results = (results,)
    record["check"] = compare(results, ref, shape.dtype)
    del results
    if settings.isolate:
      del compiled
      record.update(run_isolated(candidate, shape, mode, settings))
    else:
      record.update(measure(compiled, inputs, repeats=settings.repeats,
                            warmup=settings.warmup,
                            min_repeat_s=settings.min_repeat_s))
  except Exception as e:  # One bad cell must not end the sweep.
    status, reason = _classify(e)
    record.update(status=status, reason=reason, ms=None)
  if record["ms"]:
    record["flops_per_s"] = record["flops"] / (record["ms"] * 1e-3)
  return record


def _add_ratios(results: list[dict], ceiling: dict | None) -> None:
  baseline = {}
  for r in results:
    if r["impl"] == BASELINE and r["ms"]:
      baseline[_cell_key(r)] = r["ms"]
  for r in results:
    peer_ms = baseline.get(_cell_key(r))
    r["speedup_vs_xla"] = peer_ms / r["ms"] if peer_ms and r["ms"] else None
    r["pct_matmul"] = (
        100.0 * r["flops_per_s"] / ceiling["flops_per_s"]
        if ceiling and r.get("flops_per_s") else None)


def _cell_key(r: dict) -> tuple:
  return (r["mode"], r["batch"], r["seq_len"], r["heads"], r["head_dim"],
          r["causal"], r["dtype"])


def _meta(settings: Settings, argv: Sequence[str] | None) -> dict:
  device = jax.devices()[0]
  argv = list(argv) if argv is not None else sys.argv
  return {
      "device": str(device),
      "device_kind": getattr(device, "device_kind", None),
      "platform": _platform(),
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
      "flop_convention": (
          "fwd = 4*B*N*T*S*H, halved for causal when T == S; "
          "fwd_bwd = 3.5 * fwd"),
      "timing": (f"median of {settings.repeats} runs after "
                 f"{settings.warmup} warm-up run(s)"),
      "settings": dataclasses.asdict(settings),
  }


def run(settings: Settings, argv: Sequence[str] | None = None,
        verbose: bool = True) -> dict:
  """Runs the whole sweep.

  Args:
    settings: what to run.
    argv: the command line recorded in the metadata (default sys.argv).
    verbose: print progress.

  Returns:
    {"meta": device, versions, command, settings; "matmul": the ceiling;
    "results": one record per cell (see `run_cell`), with the speed-up
    against jax:xla and the percentage of the matmul rate}.
  """
  platform = _platform()
  say = print if verbose else (lambda *a, **k: None)
  candidates = []
  for c in settings.candidates:
    reason = (peer_unavailable_reason(c.name, platform)
              if c.kind == "peer" else None)
    if reason:
      say(f"{c.label}: skipped ({reason})")
    else:
      candidates.append(c)

  dtype = settings.shapes[0].dtype if settings.shapes else "float32"
  ceiling = matmul_ceiling(
      settings.matmul_size, dtype, repeats=settings.repeats,
      warmup=settings.warmup, seed=settings.seed,
      min_repeat_s=settings.min_repeat_s)
  if ceiling:
    say(f"matmul ceiling {ceiling['size']}^3 {dtype}: "
        f"{_rate(ceiling['flops_per_s'], platform)}")

  results = []
  grads = "fwd_bwd" in settings.modes
  for shape in settings.shapes:
    inputs = make_inputs(shape, settings.seed)
    try:
      ref = make_reference(shape, inputs, settings.check_rows, grads)
    except Exception as e:  # The reference itself did not fit.
      status, reason = _classify(e)
      say(f"{shape}: reference failed ({reason}); cells skipped")
      for mode in settings.modes:
        for c in candidates:
          results.append({
              "impl": c.label, "kind": c.kind, "mode": mode,
              **dataclasses.asdict(shape), "flops": shape.flops(mode),
              "status": "skipped", "reason": f"reference: {reason}",
              "ms": None})
      continue
    for mode in settings.modes:
      for c in candidates:
        record = run_cell(c, shape, mode, inputs, ref, settings)
        results.append(record)
        ms = f"{record['ms']:.3f} ms" if record["ms"] else ""
        say(f"{mode:7s} {shape} {c.label:16s} {record['status']} {ms} "
            f"{record['reason']}", flush=True)
    del inputs, ref

  _add_ratios(results, ceiling)
  return {"meta": _meta(settings, argv), "matmul": ceiling,
          "results": results}


# ---------------------------------------------------------------------------
# Output.


def _rate(flops_per_s: float, platform: str) -> str:
  if platform == "cpu":
    return f"{flops_per_s / 1e9:.1f} GFLOP/s"
  return f"{flops_per_s / 1e12:.1f} TFLOP/s"


def _memory_cell(r: dict) -> str:
  if r.get("peak_bytes"):
    return f"{r['peak_bytes'] / 2**20:.0f}"
  if r.get("xla_mem_bytes"):
    return f"~{r['xla_mem_bytes'] / 2**20:.0f}"
  return "-"


def format_table(report: dict) -> str:
  """The results as a fixed-width text table.

  Args:
    report: the value of `run`.

  Returns:
    The table, headed by the device, versions, command and conventions.
  """
  meta, results = report["meta"], report["results"]
  gpu_like = meta["platform"] != "cpu"
  unit, div = ("TFLOP/s", 1e12) if gpu_like else ("GFLOP/s", 1e9)
  lines = [
      f"device: {meta['device_kind']} ({meta['platform']}), jax "
      f"{meta['jax_version']}, jaxlib {meta['jaxlib_version']}",
      f"command: {meta['command']}",
      f"timing: {meta['timing']}; FLOPs: {meta['flop_convention']}",
  ]
  if report.get("matmul"):
    mm = report["matmul"]
    lines.append(f"matmul ceiling: {mm['size']}^3 {mm['dtype']} "
                 f"{mm['ms']:.3f} ms = {mm['flops_per_s'] / div:.2f} {unit}")
  if meta["settings"]["isolate"]:
    lines.append(
        "peak MB: peak of a fresh process per cell (" +
        ("device peak_bytes_in_use" if gpu_like else "RSS") +
        ", including the runtime and inputs)")
  else:
    lines.append("peak MB: ~ = XLA's compiled estimate (arguments + outputs "
                 "+ temporaries); --isolate measures the real peak")
  lines.append(f"vs xla: {BASELINE} time / this time (speed-up)")
  header = (f"{'mode':7} {'causal':6} {'B':>3} {'N':>3} {'H':>3} {'T':>6} "
            f"{'impl':16} {'ms':>10} {unit:>8} {'%mm':>5} {'vs xla':>7} "
            f"{'peak MB':>8}  status")
  lines += [header, "-" * len(header)]
  for r in results:
    ms = f"{r['ms']:.3f}" if r["ms"] else "-"
    rate = f"{r['flops_per_s'] / div:.2f}" if r.get("flops_per_s") else "-"
    pct = f"{r['pct_matmul']:.0f}%" if r.get("pct_matmul") else "-"
    ratio = (f"{r['speedup_vs_xla']:.2f}x" if r.get("speedup_vs_xla")
             else "-")
    status = r["status"] + (f" ({r['reason']})" if r["reason"] else "")
    lines.append(
        f"{r['mode']:7} {str(r['causal']):6} {r['batch']:>3} {r['heads']:>3} "
        f"{r['head_dim']:>3} {r['seq_len']:>6} {r['impl']:16} {ms:>10} "
        f"{rate:>8} {pct:>5} {ratio:>7} {_memory_cell(r):>8}  {status}")
  return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
  """Writes the report (meta, matmul ceiling, per-cell results) as JSON.

  Args:
    report: the value of `run`.
    path: the file to write (its folder is created).
  """
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=1, default=str)
    f.write("\n")


def plot(report: dict, path: str, metric: str = "flops") -> None:
  """PNG: y = FLOP/s (or ms) vs T, one line per implementation (and H).

  Subplot rows are the modes (fwd, fwd+bwd), columns non-causal / causal.

  Args:
    report: the value of `run`.
    path: the PNG to write (its folder is created).
    metric: "flops" or "ms".
  """
  # Imported here: only --plot needs matplotlib.
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot

  results = [r for r in report["results"] if r["ms"]]
  meta = report["meta"]
  gpu_like = meta["platform"] != "cpu"
  unit, div = ("TFLOP/s", 1e12) if gpu_like else ("GFLOP/s", 1e9)
  modes = [m for m in MODES if any(r["mode"] == m for r in report["results"])]
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
  dtype = report["results"][0]["dtype"] if report["results"] else ""
  fig.suptitle(f"{meta['device_kind']} - jax {meta['jax_version']} - {dtype}")
  fig.tight_layout()
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  fig.savefig(path, dpi=120)
  pyplot.close(fig)


# ---------------------------------------------------------------------------
# Entry point.


def _child_main(spec_json: str) -> None:
  try:
    result = _run_child(json.loads(spec_json))
  except Exception as e:  # Reported to the parent, which classifies it.
    error_type = "Mismatch" if isinstance(e, Mismatch) else type(e).__name__
    result = {"error": str(e)[:2000], "error_type": error_type}
  print(_CHILD_MARKER + json.dumps(result), flush=True)


def main(argv: Sequence[str]) -> None:
  """Resolves the flags, runs the sweep, prints and writes the results."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if FLAGS.child_spec:
    _child_main(FLAGS.child_spec)
    return
  if FLAGS.isolate and "XLA_PYTHON_CLIENT_ALLOCATOR" not in os.environ:
    # The parent only checks; with the platform allocator it hands device
    # memory back at once, leaving it to the isolated children it measures.
    os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
  settings = make_settings(
      grid=FLAGS.grid,
      seq_lens=FLAGS.seq_lens,
      impls=FLAGS.impls,
      peers=FLAGS.peers,
      dtype=FLAGS.dtype,
      batch=FLAGS.batch,
      tokens=FLAGS.tokens,
      heads=FLAGS.heads,
      model_dim=FLAGS.model_dim,
      head_dim=FLAGS.head_dim,
      causal=FLAGS.causal,
      modes=FLAGS.modes,
      repeats=FLAGS.repeats,
      warmup=FLAGS.warmup,
      isolate=FLAGS.isolate,
      peer_max_seq=FLAGS.peer_max_seq,
      check_rows=FLAGS.check_rows,
      matmul_size=FLAGS.matmul_size,
      seed=FLAGS.seed,
      cell_timeout=FLAGS.cell_timeout,
  )
  report = run(settings, argv=sys.argv)
  print()
  print(format_table(report))
  if FLAGS.json:
    write_json(report, FLAGS.json)
    print(f"wrote {FLAGS.json}")
  if FLAGS.plot:
    plot(report, FLAGS.plot, FLAGS.plot_metric)
    print(f"wrote {FLAGS.plot}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
