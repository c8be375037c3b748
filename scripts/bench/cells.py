"""One benchmark cell: the function timed, its check, its timing and memory.

A cell is (candidate, shape, mode): a pallas_fa implementation or a JAX peer,
one `options.Shape`, and "fwd" or "fwd_bwd". It is checked against the float32
reference of `pallas_fa.testing` (the FlashAttention error rule for low
precision) and timed with `testing.time_call`, either here or in a fresh
child process (`run_isolated`) that also reports the cell's peak memory.

Float8 shapes (`options.FP8_DTYPES`): query, key and value are (values,
scales) pairs, bfloat16 normals quantized per head by
`pallas_fa.quantize_fp8`; an implementation gets both, and its result is
checked against the attention of the dequantized inputs (`compare`). The
float8 peer cudnn_fp8 (cuDNN's FP8 forward) takes one scale per tensor: its
inputs are the same bfloat16 normals quantized per tensor
(`input_granularity`), checked against the reference of those.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import math
import os
import pathlib
import resource
import subprocess
import sys
import time
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa
from bench import options
from pallas_fa import api
from pallas_fa import quantize
from pallas_fa import testing

Array = Any

# Isolated cells run the benchmark's own entry point with --child_spec.
SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmark.py"
CHILD_MARKER = "BENCHMARK_CHILD_RESULT "


# ---------------------------------------------------------------------------
# The functions under test.


def _import(module: str):
  try:
    return importlib.import_module(module)
  except Exception as e:  # ImportError, or a compiler stack failing to load.
    raise NotImplementedError(f"cannot import {module}: {e}") from e


# cuDNN's FP8 attention: not in jax's public API; in jax 0.11 the
# `fp8_params=` of this private module's `dot_product_attention`.
CUDNN_FP8_MODULE = "jax._src.cudnn.fused_attention_stablehlo"


def _cudnn_fp8_module():
  """The module with cuDNN's FP8 attention forward.

  Raises:
    NotImplementedError: it does not import, or has no FP8 path.
  """
  module = _import(CUDNN_FP8_MODULE)
  fn = getattr(module, "dot_product_attention", None)
  try:
    fp8 = fn is not None and "fp8_params" in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    fp8 = False
  if not fp8 or not hasattr(module, "fp8_params_keys"):
    raise NotImplementedError(
        f"jax {jax.__version__} has no cuDNN FP8 attention "
        f"({CUDNN_FP8_MODULE}.dot_product_attention takes no fp8_params)")
  return module


def input_granularity(candidate: options.Candidate) -> str:
  """The `quantize_fp8` granularity of a candidate's float8 inputs: "tensor"
  for the float8 peers (cuDNN takes one scale per tensor), else "head";
  followed by `options.NEGATED_QUERY` for a candidate that takes the query
  negated (`make_inputs`)."""
  if candidate.kind == "peer" and candidate.name in options.FP8_PEERS:
    return "tensor"
  return "head" + (options.NEGATED_QUERY if candidate.negated_query else "")


def reference_granularity(granularity: str) -> str:
  """The granularity whose reference checks inputs of `granularity`: a
  negated query dequantizes to the same attention."""
  return granularity.removesuffix(options.NEGATED_QUERY)


def _is_hopper() -> bool:
  capability = getattr(jax.devices()[0], "compute_capability", None)
  return capability is not None and str(capability).startswith("9")


def peer_unavailable_reason(name: str, platform: str) -> str | None:
  """Why peer `name` cannot run here.

  Args:
    name: one of `options.PEERS`.
    platform: "cpu" | "gpu" | "tpu".

  Returns:
    The reason, or None if the peer may run (its own checks may still
    refuse a shape; that is reported per cell).
  """
  if name == "xla":
    return None
  if name == "cudnn":
    return None if platform == "gpu" else "cuDNN runs only on GPU"
  if name == "cudnn_fp8":
    if platform != "gpu":
      return "cuDNN runs only on GPU"
    try:
      _cudnn_fp8_module()
    except NotImplementedError as e:
      return str(e)
    return None
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
  elif (tokamax := options.tokamax_implementation(name)) is not None:
    if tokamax != "xla_chunked" and platform != "gpu":
      return "a GPU kernel (needs a GPU)"
    module = "tokamax"
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


def attention_fn(candidate: options.Candidate,
                 shape: options.Shape) -> Callable:
  """(q, k, v) -> out for `candidate` on `shape` (default scale 1/sqrt(H)).

  Args:
    candidate: an implementation or peer.
    shape: the problem (its causal flag is baked in).

  Returns:
    A traceable function of (q, k, v), each [B, T, N, H] (for a float8
    shape, each a (values, scales) pair of `make_inputs`).

  Raises:
    NotImplementedError: the candidate cannot run here.
  """
  causal = shape.causal
  scale = 1.0 / math.sqrt(shape.head_dim)
  fp8 = options.is_fp8(shape.dtype)
  if candidate.kind == "impl":
    name = candidate.name
    if candidate.negated_query and not fp8:
      raise NotImplementedError(
          f"{options.NEGATED_QUERY} times float8 inputs only")
    extra = {"sinks": sinks_for(shape)} if candidate.sinks else {}
    if candidate.block_sizes:
      extra["block_sizes"] = block_sizes_for(candidate, shape)

    def ours(q, k, v):
      kw = dict(extra)
      if fp8:  # (values, scales) pairs.
        (q, qs), (k, ks), (v, vs) = q, k, v
        kw.update(query_scale=qs, key_scale=ks, value_scale=vs)
      # Looked up at call time so tests can substitute the entry point.
      return pallas_fa.flash_attention(
          q, k, v, is_causal=causal, implementation=name, **kw)

    return ours

  name = candidate.name
  if fp8 != (name in options.FP8_PEERS):
    raise NotImplementedError(
        f"peer {name} takes float8 inputs" if not fp8 else
        f"peer {name} takes no {shape.dtype} inputs (its bfloat16 cells are "
        "the baselines)")
  reason = peer_unavailable_reason(name, api.platform())
  if reason is not None:
    raise NotImplementedError(reason)
  if name == "cudnn_fp8":
    return _cudnn_fp8_fn(_cudnn_fp8_module(), shape, scale)
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
  implementation = options.tokamax_implementation(name)
  if implementation is not None:
    module = _import("tokamax")
    # tokamax picks its own block sizes: its shipped autotuning cache for
    # this device and shape, else its heuristics (it autotunes nothing).
    return lambda q, k, v: module.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal,
        implementation=implementation)
  raise NotImplementedError(f"unknown peer {name!r}")


def _cudnn_fp8_fn(module, shape: options.Shape, scale: float) -> Callable:
  """cuDNN's FP8 forward on per-tensor (values, scale) pairs, [B, T, N, H].

  `module.dot_product_attention(q, k, v, fp8_params=..., use_fp8=True,
  qkv_layout="BTNH")` with descale_q/k/v the inputs' scalar scales, the
  softmax P stored unscaled (scale_s = descale_s = 1: P is in [0, 1]), and
  the output, which cuDNN writes in the inputs' float8 dtype, scaled by
  1 / descale_v (|O| <= max|v|: the whole e4m3 range) and dequantized to
  bfloat16 like ours (one elementwise pass, inside the timed call). The
  other keys it requires (backward scales, amax placeholders) are 1.
  """
  mask_type = (module.MaskType.CAUSAL if shape.causal
               else module.MaskType.NO_MASK)

  def cudnn_fp8(q, k, v):
    (q, qs), (k, ks), (v, vs) = q, k, v
    scalar = lambda x: jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)
    params = dict.fromkeys(module.fp8_params_keys, scalar(1.0))
    params.update(descale_q=scalar(qs), descale_k=scalar(ks),
                  descale_v=scalar(vs), scale_o=1.0 / scalar(vs))
    out, _, _ = module.dot_product_attention(
        q, k, v, fp8_params=params, scale=scale, mask_type=mask_type,
        qkv_layout="BTNH", use_fp8=True)
    return quantize.dequantize(out, jnp.reshape(vs, ()),
                               dtype=jnp.bfloat16)

  return cudnn_fp8


def block_sizes_for(candidate: options.Candidate, shape: options.Shape):
  """The tiling of a candidate with block-sizes fields: what a call of
  `shape` gets by default (tuned records, else the heuristic), with the
  candidate's fields replaced, so that a variant differs from the plain
  candidate in those fields only.

  Raises:
    NotImplementedError: the backend does not import here.
    TypeError, ValueError: a field the config rejects.
  """
  backend = api.get_backend(candidate.name)
  base = backend.default_block_sizes(
      q_len=shape.seq_len, kv_len=shape.seq_len, head_dim=shape.head_dim,
      dtype=options.DTYPES[shape.dtype], is_causal=shape.causal)
  return dataclasses.replace(base, **dict(candidate.block_sizes))


def build(candidate: options.Candidate, shape: options.Shape,
          mode: str) -> Callable:
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


def sinks_for(shape: options.Shape) -> Array:
  """The sink logits of a `+sinks` candidate: one per head, spread over
  [0, 4], about a row's logsumexp (so each takes a real share)."""
  return jnp.linspace(0.0, 4.0, shape.heads, dtype=jnp.float32)


def make_inputs(shape: options.Shape, seed: int,
                granularity: str = "head") -> tuple[Array, ...]:
  """Random inputs of one shape (`testing.make_inputs`).

  Args:
    shape: the problem.
    seed: random seed.
    granularity: of a float8 shape's scales (`input_granularity`): "head"
      or "tensor" (then each scale is a float32 scalar); with
      `options.NEGATED_QUERY` after it, the query's values and scales are
      both negated (exact in float8: the same attention).

  Returns:
    (q, k, v, dout), each [B, T, N, H] in the shape's dtype. For a float8
    shape, q, k and v are (values, scales) pairs: the bfloat16 inputs of
    the same seed quantized per head (`quantize.quantize_fp8`, scales
    float32 [B, 1, N]), and dout is bfloat16.
  """
  gen = testing.rng(seed)
  fp8 = options.is_fp8(shape.dtype)
  dtype = jnp.bfloat16 if fp8 else options.DTYPES[shape.dtype]
  q, k, v, _ = testing.make_inputs(shape.case(), dtype, gen)
  dout = testing.normal(gen, q.shape, dtype)
  if fp8:
    quantized = functools.partial(quantize.quantize_fp8,
                                  granularity=reference_granularity(
                                      granularity),
                                  dtype=options.DTYPES[shape.dtype])
    q, k, v = (tuple(quantized(x)) for x in (q, k, v))
    if granularity.endswith(options.NEGATED_QUERY):
      q = (-q[0], -q[1])
  return q, k, v, dout


def dequantized(x) -> Array:
  """An input of `make_inputs` as the float32 array it means: a float8
  (values, scales) pair dequantized, any other array as it is."""
  if isinstance(x, tuple):
    return quantize.dequantize(*x, dtype=jnp.float32)
  return x


# ---------------------------------------------------------------------------
# Correctness check against the float32 reference.


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


# The reference is compiled once per shape and run once: XLA:GPU's autotuning
# of its matmul fusions (several seconds each) would cost more than every
# cell it checks (35 of 79 s of a process in the first H200 window), and a
# matmul's algorithm does not change what the check accepts.
REFERENCE_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


def reference_results(shape, q, k, v, dout, rows, grads, compute_dtype,
                      sinks=None, keys=None):
  """Reference (out, dq, dk, dv) on the query rows `rows` (and dK, dV on the
  key rows `keys`) only.

  Slicing the queries (with their true positions) keeps the materialised
  logits at [B, N, len(rows), S]. The gradients are those of the full
  problem with dout zero outside `rows`: a query row whose dout is zero adds
  nothing to dK/dV (and has zero dQ), so the candidate run with that masked
  dout must match on the rows and keys compared.

  Args:
    shape: the problem (its causal flag).
    q, k, v: [B, T, N, H] inputs.
    dout: [B, T, N, H] cotangent; only its `rows` are used.
    rows: query row indices.
    grads: also compute the gradients.
    compute_dtype: dtype of the reference's arithmetic.
    sinks: the sink logits [N], or None.
    keys: key row indices of dK and dV (default: all).

  Returns:
    (out [B, R, N, H], dq [B, R, N, H] or None, dk [B, len(keys), N, H] or
    None, dv likewise), float32.
  """
  b = q.shape[0]
  keys = np.arange(k.shape[1]) if keys is None else keys
  positions = jnp.broadcast_to(jnp.asarray(rows, jnp.int32), (b, len(rows)))

  @functools.partial(jax.jit, compiler_options=REFERENCE_COMPILER_OPTIONS)
  def materialised(qs, k, v, ds):
    def f(qs, k, v):
      return testing.reference(
          qs, k, v, is_causal=shape.causal, query_positions=positions,
          compute_dtype=compute_dtype, sinks=sinks)[0]

    cast = lambda x: x.astype(compute_dtype)
    if not grads:
      return f(cast(qs), cast(k), cast(v)), None, None, None
    out, pullback = jax.vjp(f, cast(qs), cast(k), cast(v))
    dqs, dk, dv = pullback(cast(ds))
    return out, dqs, dk[:, keys], dv[:, keys]

  results = materialised(q[:, rows], k, v, dout[:, rows])
  return tuple(None if x is None else x.astype(jnp.float32) for x in results)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reference:
  """Reference results of one shape, shared by every candidate."""

  rows: np.ndarray  # the query rows of out and dq compared
  keys: np.ndarray  # the key rows of dk and dv compared
  dout_masked: Array  # dout, zero outside `rows`
  f32: tuple  # (out, dq, dk, dv) float32 reference, on rows and keys
  same: tuple | None  # the same in the input dtype (low precision only)
  loaded: bool = False  # read back from `reference_dir`
  value_max: float | None = None  # max|dequantized v| (float8 only)


_RESULT_NAMES = ("out", "dq", "dk", "dv")


def _reference_path(directory, shape, seed, rows, grads, sinks,
                    granularity="head"):
  fields = "_".join(f"{v}" for v in dataclasses.asdict(shape).values())
  extra = ("_grads" if grads else "") + ("_sinks" if sinks else "")
  if options.is_fp8(shape.dtype) and granularity != "head":
    extra += f"_{granularity}"
  return pathlib.Path(directory) / f"ref_{fields}_s{seed}_r{rows}{extra}.npz"


def _save_reference(path, f32, same, value_max=None) -> None:
  arrays = {}
  if value_max is not None:
    arrays["value_max"] = np.float32(value_max)
  for prefix, results in (("f32", f32), ("same", same)):
    for name, x in zip(_RESULT_NAMES, results or ()):
      if x is not None:
        arrays[f"{prefix}_{name}"] = np.asarray(x, np.float32)
  path.parent.mkdir(parents=True, exist_ok=True)
  # Whole or absent: a run stopped while writing leaves no half file.
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
  try:
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def _load_reference(path, low_precision: bool):
  try:
    with np.load(path) as data:
      f32 = tuple(jnp.asarray(data[f"f32_{n}"]) if f"f32_{n}" in data
                  else None for n in _RESULT_NAMES)
      same = (tuple(jnp.asarray(data[f"same_{n}"]) if f"same_{n}" in data
                    else None for n in _RESULT_NAMES)
              if low_precision else None)
      value_max = (float(data["value_max"]) if "value_max" in data
                   else None)
  except (OSError, ValueError, KeyError):
    return None
  return f32, same, value_max


def make_reference(shape, inputs, rows: int, grads: bool,
                   sinks: bool = False, seed: int | None = None,
                   directory: str | None = None,
                   granularity: str = "head") -> Reference:
  """Computes the float32 (and same-dtype) reference for `shape`.

  Args:
    shape: the problem.
    inputs: (q, k, v, dout) from `make_inputs`.
    rows: see `check_rows` (query rows, and key rows of dK and dV).
    grads: also compute the reference gradients.
    sinks: with the sinks of `sinks_for(shape)`.
    seed: the seed `inputs` were made with; with `directory`, the results
      are kept there under the shape, seed, rows, grads and sinks, and
      read back instead of computed when a file is there (the inputs of a
      seed are the same in every process).
    directory: see `seed`; None computes every time.
    granularity: that of a float8 shape's `inputs` (`make_inputs`): the
      inputs of another granularity are other arrays, kept apart.

  Returns:
    The shape's `Reference`. For a float8 shape: that of the dequantized
    inputs (`dequantized`), "same" computed in bfloat16 (the result's
    dtype), with the largest |dequantized v| for `compare`'s bound.
  """
  fp8 = options.is_fp8(shape.dtype)
  q, k, v, dout = (dequantized(x) for x in inputs)
  idx = check_rows(shape.seq_len, rows)
  keys = check_rows(k.shape[1], rows)
  masked = jnp.zeros_like(dout).at[:, idx].set(dout[:, idx])
  low_precision = shape.dtype != "float32"
  path = None
  if directory is not None and seed is not None:
    path = _reference_path(directory, shape, seed, rows, grads, sinks,
                           granularity)
    loaded = _load_reference(path, low_precision) if path.exists() else None
    if loaded is not None and (loaded[2] is not None or not fp8):
      return Reference(rows=idx, keys=keys, dout_masked=masked, f32=loaded[0],
                       same=loaded[1], loaded=True, value_max=loaded[2])
  extra = {"sinks": sinks_for(shape)} if sinks else {}
  f32 = reference_results(shape, q, k, v, masked, idx, grads, jnp.float32,
                          keys=keys, **extra)
  same = None
  if low_precision:
    same_dtype = jnp.bfloat16 if fp8 else options.DTYPES[shape.dtype]
    same = reference_results(shape, q, k, v, masked, idx, grads, same_dtype,
                             keys=keys, **extra)
  value_max = float(jnp.max(jnp.abs(v))) if fp8 else None
  if path is not None:
    _save_reference(path, f32, same, value_max)
  return Reference(rows=idx, keys=keys, dout_masked=masked, f32=f32,
                   same=same, value_max=value_max)


# A float8 forward may round P to e4m3 for the P.V product (FlashAttention-3;
# mosaic_gpu's float8 kernel, triton's with float8 operands): each
# probability within 2**-4 of itself (3 mantissa bits), so each output
# within 2**-4 of the largest |v| it averages.
FP8_P_ROUNDING = 2.0**-4


def compare(results, ref: Reference, dtype: str) -> dict[str, dict]:
  """Compares candidate (out, dq, dk, dv) with the reference.

  The rule is `testing.compare`'s at the default matmul precision, scale-
  free (`min_scale=0`): long sequences have small gradients. A float8
  cell's output (bfloat16) is held to the bfloat16 rule against the
  reference of the dequantized inputs, plus `FP8_P_ROUNDING` times the
  largest |dequantized v| (`ref.value_max`): the rounding of P to e4m3.

  Args:
    results: the candidate's outputs (out on every row; grads with
      ref.dout_masked as cotangent, on every row), grads may be absent;
      out and dq are compared on ref.rows, dk and dv on ref.keys.
    ref: the shape's reference.
    dtype: the input dtype name (selects the tolerance rule).

  Returns:
    {name: {"err": max abs error, "tol": allowed, "ref_max": max|ref|}}.

  Raises:
    testing.Mismatch: some result is not finite or exceeds its tolerance.
  """
  names = _RESULT_NAMES
  report = {}
  # On the host: a row subset of a device array costs an eager gather (and
  # its compilation) per shape; the copy of the whole array, milliseconds.
  index = (ref.rows, ref.rows, ref.keys, ref.keys)
  for i, result in enumerate(results):
    if ref.f32[i] is None:
      continue
    got = np.asarray(jax.device_get(result))[:, index[i]]
    fp8 = options.is_fp8(dtype)
    comparison = testing.compare(
        names[i], got, ref.f32[i], None if ref.same is None else ref.same[i],
        dtype=jnp.bfloat16 if fp8 else options.DTYPES[dtype],
        precision="default", min_scale=0.0)
    context = f"rows checked: {len(ref.rows)}"
    if fp8:
      rounding = FP8_P_ROUNDING * ref.value_max
      comparison = dataclasses.replace(
          comparison, tolerance=comparison.tolerance + rounding)
      context += (f"; tol includes the e4m3 rounding of P, 2**-4 * "
                  f"max|v| = {rounding:.3g}")
    comparison.check(context)
    report[names[i]] = {"err": comparison.error,
                        "tol": comparison.tolerance,
                        "ref_max": comparison.ref_max}
  return report


# ---------------------------------------------------------------------------
# Timing and memory.


def compiled_bytes(compiled) -> int | None:
  """XLA's estimate of an executable's memory, or None if unknown."""
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


def measure(fn, args, *, repeats, warmup, min_repeat_s) -> dict:
  """Times a compiled cell (or any function) with `testing.time_call`.

  Args:
    fn: the executable.
    args: its arguments.
    repeats: timed runs (the median is reported).
    warmup: untimed runs first.
    min_repeat_s: a run repeats short calls back to back for this long.

  Returns:
    {"ms": median, "times_ms": every run, "calls_per_run"}.
  """
  timing = testing.time_call(fn, *args, repeats=repeats, warmup=warmup,
                             min_run_s=min_repeat_s)
  return {"ms": timing.ms, "times_ms": [t * 1e3 for t in timing.times_s],
          "calls_per_run": timing.calls_per_run}


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
  matmul, a, b = _matmul_probe(size, dtype, seed)
  timing = testing.time_call(matmul, a, b, repeats=repeats, warmup=warmup,
                             min_run_s=min_repeat_s)
  return {"size": size, "dtype": dtype, "ms": timing.ms,
          "flops_per_s": 2.0 * size**3 / timing.median_s}


@functools.lru_cache(maxsize=1)
def _matmul_probe(size: int, dtype: str, seed: int):
  """The compiled product and its operands, built once per run: the
  ceiling is timed again in every round (`benchmark.run`)."""
  gen = testing.rng("matmul", seed)
  a, b = (testing.normal(gen, (size, size), options.DTYPES[dtype])
          for _ in range(2))
  return jax.jit(jnp.matmul).lower(a, b).compile(), a, b


def release_matmul_probe() -> None:
  """Frees the operands `matmul_ceiling` keeps for the run."""
  _matmul_probe.cache_clear()


# ---------------------------------------------------------------------------
# Isolated cells.


def _run_child(spec: dict) -> dict:
  """Body of an isolated cell: compile, time, report peak memory."""
  fields = spec["candidate"]
  candidate = options.Candidate(**{
      **fields, "block_sizes": tuple(map(tuple, fields["block_sizes"]))})
  shape = options.Shape(**spec["shape"])
  inputs = make_inputs(shape, spec["seed"], input_granularity(candidate))
  jax.block_until_ready(inputs)
  base_bytes, source = _memory_now()
  start = time.perf_counter()
  compiled = build(candidate, shape, spec["mode"]).lower(*inputs).compile()
  result = {"compile_s": time.perf_counter() - start,
            "xla_mem_bytes": compiled_bytes(compiled)}
  result.update(measure(compiled, inputs, repeats=spec["repeats"],
                        warmup=spec["warmup"],
                        min_repeat_s=spec["min_repeat_s"]))
  peak, source = _memory_now()
  result.update(peak_bytes=peak, base_bytes=base_bytes, mem_source=source)
  return result


def child_main(spec_json: str) -> None:
  """Runs one isolated cell and prints its record for the parent."""
  try:
    result = _run_child(json.loads(spec_json))
  except Exception as e:  # Reported to the parent, which classifies it.
    result = {"error": str(e)[:2000], "error_type": type(e).__name__}
  print(CHILD_MARKER + json.dumps(result), flush=True)


def _child_env() -> dict:
  env = dict(os.environ)
  # The parent may run with the platform allocator (see benchmark.main);
  # children measure with JAX's default one.
  env.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
  return env


class ChildError(Exception):
  """An exception raised inside an isolated cell, carried back by type."""

  def __init__(self, message, error_type):
    super().__init__(message)
    self.error_type = error_type


def run_isolated(candidate, shape, mode, settings: options.Settings) -> dict:
  """Times one cell in a fresh process (see `_run_child`).

  Args:
    candidate, shape, mode: the cell.
    settings: repeats, warm-up, seed and timeout.

  Returns:
    The child's timing and memory record.

  Raises:
    ChildError: the cell raised in the child (its type is carried).
    RuntimeError: the child failed otherwise.
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
  cmd = [sys.executable, str(SCRIPT), "--child_spec=" + json.dumps(spec)]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=settings.cell_timeout, env=_child_env())
  except subprocess.TimeoutExpired:
    raise RuntimeError(f"timed out after {settings.cell_timeout:.0f} s"
                       ) from None
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith(CHILD_MARKER):
      result = json.loads(line[len(CHILD_MARKER):])
      if "error" in result:
        raise ChildError(result["error"], result.get("error_type", ""))
      return result
  if proc.returncode < 0:
    raise RuntimeError(
        f"child killed by signal {-proc.returncode} (out of memory?)")
  tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
  raise RuntimeError(f"child exited with {proc.returncode}: {tail}")


# ---------------------------------------------------------------------------
# One cell.


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return (text[0] if text else type(e).__name__)[:300]


def _is_oom(message: str) -> bool:
  lowered = message.lower()
  return ("resource_exhausted" in lowered or "out of memory" in lowered
          or "oom" in lowered.split())


def classify(e: BaseException) -> tuple[str, str]:
  """(status, reason) of a failed cell."""
  error_type = getattr(e, "error_type", type(e).__name__)
  message = _first_line(e)
  if error_type == testing.Mismatch.__name__:
    return "wrong", message
  if error_type == "NotImplementedError":
    return "skipped", f"unsupported: {message}"
  if _is_oom(str(e)):
    return "skipped", f"memory: {message}"
  return "failed", f"{error_type}: {message}"


def base_record(candidate, shape, mode) -> dict:
  """The fields every record of a cell has, before it runs."""
  return {"impl": options.cell_label(candidate.label, shape.dtype),
          "kind": candidate.kind, "mode": mode,
          **dataclasses.asdict(shape), "flops": shape.flops(mode),
          "status": "ok", "reason": "", "ms": None}


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
  record = base_record(candidate, shape, mode)
  limit = dict(settings.max_seq).get(candidate.label)
  if limit and shape.seq_len > limit:
    record.update(status="skipped",
                  reason=f"memory: T > --peer_max_seq {limit}")
    return record
  phases = record["phases_s"] = {}
  try:
    start = time.perf_counter()
    compiled = build(candidate, shape, mode).lower(*inputs).compile()
    record["compile_s"] = phases["compile"] = time.perf_counter() - start
    record["xla_mem_bytes"] = compiled_bytes(compiled)
    q, k, v, dout = inputs
    start = time.perf_counter()
    results = compiled(q, k, v, ref.dout_masked)
    if mode == "fwd":
      results = (results,)
    record["check"] = compare(results, ref, shape.dtype)
    del results
    phases["check"] = time.perf_counter() - start
    start = time.perf_counter()
    if settings.isolate:
      del compiled
      record.update(run_isolated(candidate, shape, mode, settings))
      phases["isolated"] = time.perf_counter() - start
    else:
      record.update(measure(compiled, inputs, repeats=settings.repeats,
                            warmup=settings.warmup,
                            min_repeat_s=settings.min_repeat_s))
      # The timed runs; the rest of `measure` is its first call and the
      # warm-up.
      total = time.perf_counter() - start
      timed = sum(record["times_ms"]) * 1e-3 * record["calls_per_run"]
      phases.update(warmup=max(0.0, total - timed), timing=timed)
  except Exception as e:  # One bad cell must not end the sweep.
    status, reason = classify(e)
    record.update(status=status, reason=reason, ms=None)
  record["phases_s"] = {k: round(v, 3) for k, v in phases.items()}
  if record["ms"]:
    record["flops_per_s"] = record["flops"] / (record["ms"] * 1e-3)
  return record
