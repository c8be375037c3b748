"""Reference, error rule, FLOP counts, inputs and timer for checking attention.

The one home of what the tests, `scripts/benchmark.py` and `scripts/tune.py`
share when they check or time an attention implementation:

- `reference`: the materialised attention of `flash_attention`'s own public
  arguments (through `api.canonicalize` and `pallas_fa.reference`), in
  float32 or any chosen compute dtype;
- `compare` / `assert_close`: the FlashAttention error rule for low-precision
  results, `max|x - ref32| <= 2 max|x_same_dtype_ref - ref32| + floor`, and
  one table of float32 tolerances;
- `attention_flops`: FLOP counts by the FlashAttention convention;
- `Case`, `make_inputs`, `rng`, `normal`: fresh random inputs (never zeros);
- `time_call`: a device-correct timer (blocks on results, warms up, reports
  the median of repeated runs); `time_calls` times several in turn.

Example:

  gen = testing.rng("my check")
  q, k, v, kw = testing.make_inputs(testing.Case(causal=True), jnp.bfloat16,
                                    gen)
  out = pallas_fa.flash_attention(q, k, v, **kw)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]  # exact cast
  ref32, _ = testing.reference(*f32, **kw)
  ref_same, _ = testing.reference(q, k, v, compute_dtype=jnp.bfloat16, **kw)
  testing.assert_close("out", out, ref32, ref_same)

Free of test-framework imports: failed checks raise `Mismatch`, an
`AssertionError`, so test runners report them as failed assertions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
import zlib
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa import api
from pallas_fa import masking
from pallas_fa import reference as reference_lib
from pallas_fa.flex import examples as flex_examples

Array = Any

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}

# float32 results are held to fixed tolerances relative to the reference's
# size (see `compare`), keyed by the matmul precision they were computed
# with: "highest" is true float32; "default" allows one TensorFloat-32 or
# bfloat16 pass (GPU and TPU defaults), loose enough for that, tight enough
# to catch a wrong mask, scale or gradient.
F32_TOLERANCES = {
    "highest": {"out": 2e-5, "lse": 2e-5, "grad": 1e-4},
    "default": {"out": 1e-2, "lse": 1e-2, "grad": 1e-2},
}
# The floor of the low-precision rule, in ulps of the reference's size: it
# keeps a same-dtype reference that happens to be exact from demanding
# exactness.
LOW_PRECISION_FLOOR_ULPS = 4

FLOP_CONVENTION = ("fwd = 4*B*N*T*S*H, halved for causal when T == S; "
                   "fwd_bwd = 3.5 * fwd")
# Backward work relative to forward (FlashAttention-2 §4): five matmuls
# against the forward's two.
BACKWARD_FLOP_RATIO = 2.5
FLOP_MODES = ("fwd", "bwd", "fwd_bwd")


# ---------------------------------------------------------------------------
# Inputs.


def rng(*names) -> np.random.Generator:
  """A generator seeded by `names`: fresh, reproducible inputs per check.

  Args:
    *names: anything with a stable repr (a test's name and parameters).

  Returns:
    A numpy generator; equal names give equal streams.
  """
  return np.random.default_rng(zlib.crc32(repr(names).encode()))


def normal(gen: np.random.Generator, shape, dtype=jnp.float32) -> Array:
  """Standard-normal values of `shape`, drawn in float32, cast to `dtype`
  (rounded to nearest even, as XLA's conversion rounds)."""
  return _on_device(gen.standard_normal(shape, np.float32), dtype)


def _on_device(values, dtype) -> Array:
  """`values` converted on the host and copied to the default device.

  Eagerly, `jnp.asarray` of a numpy array and `astype` each compile an XLA
  program for every new shape (about 20-50 ms on a CPU), and a check makes
  inputs of fresh shapes all the time.
  """
  return jax.device_put(np.asarray(values).astype(jnp.dtype(dtype)))


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: shapes plus mask/feature arguments.

  Attributes:
    b, t, s, n, k, h: batch, query length, key length, query heads,
      key/value heads, head dim.
    causal: `is_causal`.
    window: `local_window_size`, or None.
    lengths: random query and key/value padding lengths.
    segments: random sorted segment ids (three segments).
    positions: bottom-right aligned (decode-like) positions.
    soft_cap: `logits_soft_cap`, or None.
    bias: None | "full" ([B, N, T, S]) | "heads" (broadcast over B).
    mask: None | "full" ([B, N, T, S]) | "broadcast" (over N).
    sinks: random sink logits [N], large enough to take a good share of
      each row's probability.
    hv: the value head dim, or None for h.
    score_mod: None | "alibi" (`flex.alibi` with random slopes).
    mask_mod: None | "chunked_causal" | "streaming" (`flex.chunked_causal`
      and `flex.sliding_window_with_sinks`, random sizes).
    dropout: `dropout_rate` (a random `dropout_rng`), 0 for none.
  """

  b: int = 2
  t: int = 48
  s: int = 48
  n: int = 2
  k: int = 2
  h: int = 32
  causal: bool = False
  window: Any = None
  lengths: bool = False
  segments: bool = False
  positions: bool = False
  soft_cap: float | None = None
  bias: str | None = None
  mask: str | None = None
  sinks: bool = False
  hv: int | None = None
  score_mod: str | None = None
  mask_mod: str | None = None
  dropout: float = 0.0

  def __str__(self):
    base = f"B{self.b}T{self.t}S{self.s}N{self.n}K{self.k}H{self.h}"
    extras = [
        name for name in ("causal", "lengths", "segments", "positions",
                          "sinks")
        if getattr(self, name)
    ]
    if self.window is not None:
      extras.append(f"window{self.window}")
    if self.soft_cap:
      extras.append(f"cap{self.soft_cap}")
    if self.bias:
      extras.append(f"bias-{self.bias}")
    if self.mask:
      extras.append(f"mask-{self.mask}")
    if self.hv is not None:
      extras.append(f"hv{self.hv}")
    for name in ("score_mod", "mask_mod"):
      if getattr(self, name):
        extras.append(f"{name}-{getattr(self, name)}")
    if self.dropout:
      extras.append(f"dropout{self.dropout}")
    return "-".join([base] + extras)


def make_inputs(case: Case, dtype, gen: np.random.Generator):
  """Random q, k, v and the keyword arguments of `case`.

  Args:
    case: the problem.
    dtype: dtype of q, k and v (bias stays float32).
    gen: the random stream (`rng`).

  Returns:
    (q [B, T, N, H], k [B, S, K, H], v [B, S, K, H], kwargs): kwargs are
    `flash_attention`'s keyword arguments for the case (`is_causal` always,
    the others as the case asks), bias and mask included.
  """
  q = normal(gen, (case.b, case.t, case.n, case.h), dtype)
  k = normal(gen, (case.b, case.s, case.k, case.h), dtype)
  v = normal(gen, (case.b, case.s, case.k, case.hv or case.h), dtype)
  kw: dict[str, Any] = {"is_causal": case.causal}
  if case.window is not None:
    kw["local_window_size"] = case.window
  if case.lengths:
    kw["query_seq_lengths"] = _on_device(
        gen.integers(1, case.t + 1, case.b), jnp.int32)
    kw["key_value_seq_lengths"] = _on_device(
        gen.integers(1, case.s + 1, case.b), jnp.int32)
  if case.segments:
    def segment_ids(length):
      ids = np.sort(gen.integers(0, 3, (case.b, length)))
      return _on_device(ids, jnp.int32)

    kw["segment_ids"] = masking.SegmentIds(
        q=segment_ids(case.t), kv=segment_ids(case.s))
  if case.positions:
    offset = case.s - case.t
    kw["query_positions"] = _on_device(np.broadcast_to(
        np.arange(case.t) + offset, (case.b, case.t)), jnp.int32)
    kw["key_positions"] = _on_device(
        np.broadcast_to(np.arange(case.s), (case.b, case.s)), jnp.int32)
  if case.soft_cap:
    kw["logits_soft_cap"] = case.soft_cap
  if case.bias == "full":
    kw["bias"] = normal(gen, (case.b, case.n, case.t, case.s))
  elif case.bias == "heads":
    kw["bias"] = normal(gen, (1, case.n, case.t, case.s))
  if case.mask == "full":
    kw["mask"] = _on_device(
        gen.random((case.b, case.n, case.t, case.s)) < .8, bool)
  elif case.mask == "broadcast":
    kw["mask"] = _on_device(gen.random((case.b, 1, case.t, case.s)) < .8,
                            bool)
  if case.sinks:
    # About the size of a row's logsumexp over O(10-100) keys: the sink
    # takes a share of each row comparable to its keys'.
    kw["sinks"] = _on_device(
        2.0 + 1.5 * gen.standard_normal(case.n, np.float32), jnp.float32)
  if case.score_mod == "alibi":
    kw["score_mod"] = flex_examples.alibi
    kw["score_mod_args"] = (flex_examples.alibi_slopes(case.n)
                            * float(gen.uniform(0.5, 2.0)),)
  elif case.score_mod is not None:
    raise ValueError(f"Unknown score_mod={case.score_mod!r}.")
  if case.mask_mod == "chunked_causal":
    kw["mask_mod"] = flex_examples.chunked_causal
    kw["mask_mod_args"] = (int(gen.integers(1, 64)),)
  elif case.mask_mod == "streaming":
    kw["mask_mod"] = flex_examples.sliding_window_with_sinks
    kw["mask_mod_args"] = (int(gen.integers(1, 50)), int(gen.integers(0, 5)))
  elif case.mask_mod is not None:
    raise ValueError(f"Unknown mask_mod={case.mask_mod!r}.")
  if case.dropout:
    kw["dropout_rate"] = case.dropout
    kw["dropout_rng"] = int(gen.integers(0, 1 << 30))
  return q, k, v, kw


# ---------------------------------------------------------------------------
# The reference.

# Arguments that shape the computation rather than feed it: they are static
# under jit (and must be hashable).
_STATIC = ("scale", "is_causal", "local_window_size", "logits_soft_cap",
           "dropout_rate", "score_mod", "mask_mod")


def reference(query, key, value, bias=None, mask=None, *,
              compute_dtype=jnp.float32, **kwargs) -> tuple[Array, Array]:
  """Materialised attention of `flash_attention`'s public arguments.

  The arguments go through `api.canonicalize` exactly as those of
  `flash_attention` do, then through `pallas_fa.reference.attention` with
  HIGHEST matmul precision: the oracle every implementation is checked
  against. Differentiable (plain autodiff) in query, key, value, bias and
  sinks and score_mod_args.

  Args:
    query, key, value, bias, mask: as for `flash_attention`.
    compute_dtype: dtype of every intermediate: float32 (the reference),
      float64 (to check the reference itself; needs x64) or the inputs'
      dtype (the same-dtype reference of the FlashAttention rule).
    **kwargs: `flash_attention`'s mask, scale, soft-cap, dropout, sinks
      and flex (score_mod, mask_mod, their args, block_mask) keyword
      arguments (not implementation, block_sizes, precision or
      return_residual, which do not change the math). Sinks are the
      appended logit column of `pallas_fa.reference.attention`.

  Returns:
    (out [*B, T, N, Hv] typed like query, lse [*B, T, N] float32 (float64
    when computed in float64)). For an unrounded float32 reference of
    low-precision inputs, cast them to float32 first (the cast is exact).
  """
  static = {name: kwargs.pop(name) for name in _STATIC if name in kwargs}
  for name in ("scale", "logits_soft_cap"):
    if name in static:
      static[name] = api.check_static_float(name, static[name])
  if "local_window_size" in static:
    static["local_window_size"] = api.check_window(
        static["local_window_size"])
  return _reference(query, key, value, bias, mask, kwargs,
                    compute_dtype=jnp.dtype(compute_dtype),
                    static=tuple(sorted(static.items())))


@functools.partial(jax.jit, static_argnames=("compute_dtype", "static"))
def _reference(query, key, value, bias, mask, arrays, *, compute_dtype,
               static):
  call = api.canonicalize(query, key, value, bias, mask, **dict(static),
                          **arrays)
  out, lse = reference_lib.attention(
      call.q, call.k, call.v, call.bias, call.info, scale=call.params.scale,
      soft_cap=call.params.soft_cap, compute_dtype=compute_dtype,
      sinks=call.sinks)
  return call.unfold(out, lse)


# ---------------------------------------------------------------------------
# The error rule.


class Mismatch(AssertionError):
  """A result disagrees with its reference beyond the allowed error."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
  """One result measured against its float32 reference.

  Attributes:
    name: what was compared ("out", "lse", "dq", ...).
    error: max|result - ref32| (matching -inf entries count as equal; NaN
      counts as inf).
    tolerance: the largest error allowed.
    ref_max: max|ref32| over its finite entries.
    same_error: max|ref_same - ref32| under the low-precision rule, else
      None (the float32 table applied).
    floor: the low-precision rule's floor, else None.
    problem: a non-finite value the reference does not have, or None.
  """

  name: str
  error: float
  tolerance: float
  ref_max: float
  same_error: float | None = None
  floor: float | None = None
  problem: str | None = None

  @property
  def ok(self) -> bool:
    # `<=` is False for a NaN error as well.
    return self.problem is None and self.error <= self.tolerance

  def message(self, context: str = "") -> str:
    """Why the comparison failed (or its numbers, if it did not)."""
    if self.problem is not None:
      return f"{self.name}: {self.problem}"
    text = (f"{self.name} disagrees with the float32 reference: "
            f"max|err|={self.error:.3g} > tol={self.tolerance:.3g}")
    if self.same_error is not None:
      text += (f" = 2 * {self.same_error:.3g} (same-dtype reference error) "
               f"+ {self.floor:.3g}")
    details = [f"max|ref|={self.ref_max:.3g}"] + ([context] if context else [])
    return text + f" ({', '.join(details)})"

  def check(self, context: str = "") -> Comparison:
    """Returns self if ok, else raises `Mismatch` (with `context` added)."""
    if not self.ok:
      raise Mismatch(self.message(context))
    return self


def _host_f32(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float32)


def _max_error(x: np.ndarray, ref: np.ndarray) -> float:
  both_neg_inf = np.isneginf(x) & np.isneginf(ref)
  with np.errstate(invalid="ignore"):  # -inf - -inf, replaced just below
    diff = np.where(both_neg_inf, 0.0, np.abs(x - ref))
  return float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0))


def _finite_max(ref: np.ndarray) -> float:
  return float(np.abs(ref[np.isfinite(ref)]).max(initial=0.0))


def _kind(name: str) -> str:
  return name if name in ("out", "lse") else "grad"


def compare(name: str, result, ref32, ref_same=None, *, dtype=None,
            precision: str = "highest", min_scale: float = 1.0
            ) -> Comparison:
  """Measures `result` against the float32 reference by the project's rule.

  A low-precision result (`dtype` narrower than 32 bits, with `ref_same`
  given) passes the FlashAttention rule:
  `max|result - ref32| <= 2 * max|ref_same - ref32| + floor`, the floor being
  `LOW_PRECISION_FLOOR_ULPS` ulps of `dtype` at scale. Otherwise
  `max|result - ref32| <= F32_TOLERANCES[precision][kind] * scale`, kind
  being "out", "lse" or "grad" (any other name). Scale is
  `max(min_scale, max|ref32|)`. A result must also be -inf exactly where
  the reference is (fully masked rows' lse) and nowhere NaN or +inf.

  Args:
    name: what is compared; "out" and "lse" select their own float32
      tolerance, anything else the gradients'.
    result: the result under test.
    ref32: the float32 (or float64) reference, same shape.
    ref_same: the reference computed in `dtype`, or None.
    dtype: the inputs' dtype (it sets the floor's ulp; an lse is float32
      even for bfloat16 inputs); default the result's.
    precision: "highest" or "default", the matmul precision the result was
      computed with (selects the float32 table's row).
    min_scale: 1 (default) keeps near-zero references from demanding more
      than float accuracy on O(1) inputs; 0 makes the rule scale-free (long
      sequences, whose gradients shrink).

  Returns:
    The `Comparison`; `.ok` tells, `.check()` raises `Mismatch` if not.

  Raises:
    ValueError: result and reference shapes differ.
  """
  x, ref = _host_f32(result), _host_f32(ref32)
  if x.shape != ref.shape:
    raise ValueError(
        f"{name}: result and reference shapes differ, result {x.shape}, "
        f"reference {ref.shape}.")
  problem = None
  if np.any(np.isneginf(x) != np.isneginf(ref)):
    problem = "-inf where the reference has none (or the reverse)"
  elif np.any(np.isnan(x) | np.isposinf(x)):
    problem = "NaN or +inf"
  ref_max = _finite_max(ref)
  scale = max(min_scale, ref_max)
  dtype = jnp.dtype(getattr(result, "dtype", x.dtype) if dtype is None
                    else dtype)
  common = dict(name=name, error=_max_error(x, ref), ref_max=ref_max,
                problem=problem)
  if ref_same is None or jnp.finfo(dtype).bits >= 32:
    tolerance = F32_TOLERANCES[precision][_kind(name)] * scale
    return Comparison(tolerance=tolerance, **common)
  same_error = _max_error(_host_f32(ref_same), ref)
  floor = LOW_PRECISION_FLOOR_ULPS * float(jnp.finfo(dtype).eps) * scale
  return Comparison(tolerance=2 * same_error + floor, same_error=same_error,
                    floor=floor, **common)


def assert_close(name: str, result, ref32, ref_same=None, dtype=None,
                 **kwargs) -> Comparison:
  """`compare(...).check()`: raises `Mismatch` unless the rule holds.

  Args:
    name, result, ref32, ref_same, dtype: as for `compare`.
    **kwargs: `compare`'s precision and min_scale.

  Returns:
    The passing `Comparison`.
  """
  return compare(name, result, ref32, ref_same, dtype=dtype,
                 **kwargs).check()


# ---------------------------------------------------------------------------
# FLOPs.


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int,
                    head_dim: int, *, causal: bool = False,
                    mode: str = "fwd", value_head_dim: int | None = None
                    ) -> float:
  """FLOPs of one attention call by the FlashAttention convention.

  Forward: `2*B*N*T*S*H` for q.k plus `2*B*N*T*S*Hv` for p.v, that is
  `4*B*N*T*S*H` when Hv = H; halved for causal attention when T == S
  (the visible half). Backward counts 2.5x forward, so forward+backward is
  3.5x forward (`FLOP_CONVENTION`). Softmax and masking are not counted.

  Args:
    batch, heads, q_len, kv_len, head_dim: B, N (query heads), T, S, H.
    causal: causal masking.
    mode: "fwd", "bwd" or "fwd_bwd".
    value_head_dim: Hv, default H.

  Returns:
    The FLOP count.

  Raises:
    ValueError: an unknown mode.
  """
  if mode not in FLOP_MODES:
    raise ValueError(f"mode must be one of {FLOP_MODES}, got {mode=}.")
  hv = head_dim if value_head_dim is None else value_head_dim
  flops = 2.0 * batch * heads * q_len * kv_len * (head_dim + hv)
  if causal and q_len == kv_len:
    flops /= 2
  return flops * {"fwd": 1.0, "bwd": BACKWARD_FLOP_RATIO,
                  "fwd_bwd": 1.0 + BACKWARD_FLOP_RATIO}[mode]


# ---------------------------------------------------------------------------
# Timing.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
  """Seconds per call of a timed function.

  Attributes:
    median_s: the median over runs.
    times_s: each run's seconds per call.
    calls_per_run: calls made back to back in each run.
  """

  median_s: float
  times_s: tuple[float, ...]
  calls_per_run: int

  @property
  def ms(self) -> float:
    return self.median_s * 1e3


def time_call(fn: Callable, *args, repeats: int = 5, warmup: int = 1,
              min_run_s: float = 0.05) -> Timing:
  """Times `fn(*args)` on its device: the median of `repeats` runs.

  The first call (which may compile) and `warmup` more are untimed. Every
  run ends with `jax.block_until_ready` on the result, so the time is the
  device's, not the asynchronous dispatch's. A call shorter than
  `min_run_s` is repeated back to back within a run (up to 100 times) so
  that launch and synchronisation overhead do not dominate: one call of a
  decode step on a GPU (tens of microseconds) would otherwise time the
  host's dispatch, not the kernels.

  Args:
    fn: a function of JAX arrays (best jitted or compiled).
    *args: its arguments.
    repeats: timed runs; the median is reported.
    warmup: untimed calls after the first.
    min_run_s: the shortest a run should take.

  Returns:
    The `Timing`.
  """
  return time_calls([(fn, args)], repeats=repeats, warmup=warmup,
                    min_run_s=min_run_s)[0]


def time_calls(calls: Sequence[tuple[Callable, tuple]], *, repeats: int = 5,
               warmup: int = 1, min_run_s: float = 0.05) -> list[Timing]:
  """Times several `(fn, args)` as `time_call` does, their runs taken in
  turn (one run of each, `repeats` times over).

  Interleaving is what makes two calls' ratio trustworthy on a shared
  machine: a slow phase (another process, a frequency change) then slows
  every call alike instead of whichever happened to be timed during it.
  """
  plans = []
  for fn, args in calls:
    jax.block_until_ready(args)
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(max(1, warmup)):
      jax.block_until_ready(fn(*args))
    per_call = (time.perf_counter() - start) / max(1, warmup)
    plans.append(int(min(100, max(1, math.ceil(
        min_run_s / max(per_call, 1e-9))))))
  times = [[] for _ in calls]
  for _ in range(max(1, repeats)):
    for (fn, args), count, runs in zip(calls, plans, times):
      start = time.perf_counter()
      for _ in range(count):
        out = fn(*args)
      # In-order device execution: the last result ready means all are.
      jax.block_until_ready(out)
      runs.append((time.perf_counter() - start) / count)
  return [Timing(median_s=statistics.median(runs), times_s=tuple(runs),
                 calls_per_run=count) for runs, count in zip(times, plans)]
