"""The backend contract, and the custom_vjp shared by every implementation.

How to add a backend
--------------------

A backend is a module that defines `BACKEND = vjp.Backend(...)` and is listed
by name in `REGISTRY` below (and, to be chosen automatically, in
`api.AUTO_ORDER`); it is imported on first use, so an `ImportError` there
only makes that one backend unavailable. `api.flash_attention` validates and
canonicalises the public arguments once, so every function of a backend sees
the same shapes whatever the caller passed:

* `q` [B, T, N, H], `k` [B, S, K, H], `v` [B, S, K, Hv]: one batch dim,
  N % K == 0 (GQA: query head n reads key/value head n // (N / K)); a
  backend declaring `Backend.shared_kv` may also get `k`/`v` with batch 1,
  one K/V read by every query row (the others get it broadcast);
* `bias` [B|1, N|1, T|1, S|1] or None;
* `info`: the `masking.MaskInfo` -- causal, window, positions, segment ids
  with the padding lengths folded in, dense mask, dropout -- to be read
  through `masking`'s predicates, never re-derived;
* `params`: `Params` (scale, soft cap, precision, `block_sizes`, the
  caller's tiling config or None, and `deterministic_backward`: a backward
  whose summation order can vary between runs takes a reproducible path
  when it is set).

It provides:

* `forward(q, k, v, bias, info, params) -> (out, lse)`: out [B, T, N, Hv] in
  q's dtype, lse [B, T, N] the natural-log logsumexp in float32 (float64 for
  float64 inputs); a row that sees no key gets out = 0 and lse = -inf. A
  backend that lists float8 dtypes in `Backend.dtypes` is also called as
  `forward(q, k, v, bias, info, params, scales=(q_scale, k_scale,
  v_scale))` with float8 q/k/v: it computes the attention of
  `quantize.dequantize(x, x_scale)` (scales float32 [B|1, T|1, N|1] and
  [B|1, S|1, K|1]) and returns out in `params.out_dtype`;
* `backward(q, k, v, bias, info, params, lse, dout, delta) -> (dq, dk, dv,
  dbias)`: the gradients in the dtypes and shapes of their inputs (dbias
  None without a bias; dK/dV of a shared batch-1 K/V summed over the rows).
  `delta = rowsum(out * dout) - dlse` [B, T, N] arrives computed here once
  for all backends (FlashAttention-2 §3.2), zero on padded query rows;
  `backward=None` differentiates `forward` instead. A backend that
  accepts a score_mod (`info.score_mod`) returns a fifth result, the
  gradients of `info.score_mod_args` (a tuple like it, None for an
  integer array);
* `check(q, k, v, bias, info, params) -> None`: raises NotImplementedError
  naming the reason when the backend cannot honour the call, so the
  automatic choice moves on (dtype, value head dim and dropout support are
  declared as `Backend` fields and checked by `check_call`);
* a frozen, slotted, kw_only tiling config class (`block_sizes_type`, named
  after the backend, exported by `pallas_fa`) and `default_block_sizes(*,
  q_len, kv_len, head_dim, dtype, is_causal=False, dropout=False,
  device_kind=None, value_head_dim=None)` returning the tiling of a call
  made without one (value_head_dim None: equal to head_dim; a backend whose
  tiles do not depend on it accepts and ignores it);
  `Backend.block_sizes` resolves the two. Tunable backends look up records
  persisted by `scripts/tune.py` first (`pallas_fa.tuning`).

Blockwise backends pad their inputs with `pallas_fa.layout` (tile choice,
padded head dims, zeroed padding) and skip tiles with
`masking.classify_blocks`. List the config in `pallas_fa/__init__.py`
(`_LAZY`) and small test tiles in `tests/conftest.py`: the shared
conformance suite (`tests/test_conformance.py`) then runs the backend.

`attention` below wires forward and backward into one `jax.custom_vjp`.
Residuals are (out, lse) only -- never the T x S probabilities -- so memory
stays linear in sequence length.

Float8 calls have a custom_vjp of their own (`attention(..., scales=...)`):
the forward runs the backend on the float8 inputs; the backward runs its
backward on the float32 dequantized ones (4x the float8 bytes, still linear
in T) and turns their gradients into those of the scales
(`quantize.scale_grad`) and, for inputs `flash_attention(quantize=...)`
quantized itself, straight through into the high-precision arrays. The
float8 arrays themselves are not differentiated: their cotangent would be
float8, which rounds typical gradients to zero, so differentiating one
raises a TypeError.

Attention sinks (`flash_attention(sinks=...)`) never reach a backend:
`attention` adds them to the backend's (out, lse) once
(`online_softmax.add_sink`), and the backward hands the backend the final
lse and delta, with which its own recomputation P = exp(s - lse) is exactly
the softmax with the sink column; dsinks comes from the same lse and delta
(`online_softmax.sink_grad`). So every backend has sinks with no kernel
change, and a call without them runs no extra operand or op.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax import custom_derivatives

from pallas_fa import checks
from pallas_fa import manual_axes
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import quantize

Array = Any


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Params:
  """Static (hashable) settings of one attention call.

  Attributes:
    scale: logit scale.
    soft_cap: logit soft-cap value, or None.
    block_sizes: the backend's frozen tiling config, or None for its default.
    precision: the matmul precision of every product of query/key/value-
      derived data (float32 inputs; see `flash_attention`).
    deterministic_backward: the backward must be bitwise reproducible:
      a backend with a faster backward whose summation order varies from
      run to run (mosaic_gpu's fused one) takes its reproducible path
      instead (`flash_attention(deterministic_backward=...)`, resolved).
    out_dtype: the dtype of a float8 call's result (a `jnp.dtype`); None
      for every other call, whose result has q's dtype.
  """

  scale: float
  soft_cap: float | None = None
  block_sizes: Any = None
  precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
  deterministic_backward: bool = False
  out_dtype: Any = None


Forward = Callable[..., tuple[Array, Array]]
Backward = Callable[..., tuple[Array, Array, Array, Array | None]]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Backend:
  """One implementation of the public op.

  Attributes:
    name: the `implementation=` string.
    forward: (q, k, v, bias, info, params) -> (out [B,T,N,H], lse [B,T,N]).
    backward: (q, k, v, bias, info, params, lse, dout, delta) ->
      (dq, dk, dv, dbias or None); None means "differentiate forward".
    check: (q, k, v, bias, info, params) -> None; raises NotImplementedError
      naming the reason when this backend cannot honour the call.
    block_sizes_type: the frozen tiling config class `block_sizes=` must be
      an instance of, or None if the backend takes none.
    default_block_sizes: (*, q_len, kv_len, head_dim, dtype, is_causal,
      dropout, device_kind, value_head_dim) -> the tiling of a call without
      `block_sizes=`; None if the backend takes none.
    dtypes: input dtypes it computes in (others raise NotImplementedError);
      float8 ones mean its forward takes `scales=` (see the module doc).
    value_head_dim: whether value (and the output) may have a head dim Hv
      other than the query/key head dim H.
    dropout: whether it implements attention dropout (`pallas_fa.dropout`).
    shared_kv: whether forward/backward take k and v with batch 1 against
      q's batch B (a K/V shared by every query row, read without copies;
      backward returns dK/dV of batch 1, summed over the rows). Without it
      `api.Call.for_backend` broadcasts such a K/V to B first.
    differentiable: whether `forward` and `backward` are plain jax.numpy
      that JAX can differentiate again (forward over reverse:
      Hessian-vector products). Pallas kernels are not: differentiating
      them raises a NotImplementedError naming the backend (`_kernel`).
    why_not_differentiable: what a second derivative through a backend
      that is not `differentiable` is told (None: it runs Pallas kernels).
    symbolic_batch: whether the batch size may be symbolic (shape
      polymorphism, `jax.export`): the kernels' grids need it concrete.
    symbolic_lengths: whether T, S and the head dims may be symbolic too:
      tiled backends pick their tiles from the lengths.
  """

  name: str
  forward: Forward
  check: Callable[..., None]
  backward: Backward | None = None
  block_sizes_type: type | None = None
  default_block_sizes: Callable[..., Any] | None = None
  dtypes: tuple[Any, ...] = (jnp.float32, jnp.bfloat16, jnp.float16)
  value_head_dim: bool = False
  dropout: bool = False
  shared_kv: bool = False
  differentiable: bool = False
  why_not_differentiable: str | None = None
  symbolic_batch: bool = False
  symbolic_lengths: bool = False

  def check_call(self, q, k, v, bias, info, params) -> None:
    """Raises NotImplementedError naming why this backend cannot run the
    call: the input dtype, symbolic dims, or its own `check`."""
    self.check_symbolic_dims(q, k, v)
    if not any(q.dtype == d for d in self.dtypes):
      if quantize.is_fp8(q.dtype):
        raise NotImplementedError(
            f"implementation {self.name!r} has no float8 path ({q.dtype} "
            "query/key/value with scales); implementation=None runs the "
            "call on one that has.")
      names = ", ".join(jnp.dtype(d).name for d in self.dtypes)
      raise NotImplementedError(
          f"implementation {self.name!r} computes in {names}, not "
          f"{q.dtype}.")
    if v.shape[-1] != q.shape[-1] and not self.value_head_dim:
      raise NotImplementedError(
          f"implementation {self.name!r} needs the value head dim equal to "
          f"the query/key head dim, got {q.shape[-1]} and {v.shape[-1]}.")
    if info.has_dropout and not self.dropout:
      raise NotImplementedError(
          f"implementation {self.name!r} does not implement attention "
          "dropout.")
    self.check(q, k, v, bias, info, params)

  def check_symbolic_dims(self, q, k, v) -> None:
    """Raises NotImplementedError if q, k or v [B, T|S, N|K, H] has a
    symbolic dim this backend cannot run with."""
    batch, lengths = checks.symbolic_batch_and_rest(q, k, v)
    if lengths and not self.symbolic_lengths:
      raise NotImplementedError(
          f"implementation {self.name!r} needs concrete sequence lengths "
          f"and head dims, got the symbolic {', '.join(lengths)} (query "
          f"{q.shape}, key {k.shape}). 'xla' takes them (and is the "
          "automatic choice for them; its memory grows with T * S).")
    if batch and not (self.symbolic_batch or self.symbolic_lengths):
      raise NotImplementedError(
          f"implementation {self.name!r} needs a concrete batch size, got "
          f"the symbolic {', '.join(batch)}; 'chunked' and 'xla' take one.")

  def block_sizes(self, params: Params, q, k, info, v=None) -> Any:
    """The tiling a call runs with: `params.block_sizes`, else this
    backend's `default_block_sizes` for the call (given `v` when the
    backend's tiles depend on the value head dim)."""
    if params.block_sizes is not None or self.default_block_sizes is None:
      return params.block_sizes
    return self.default_block_sizes(
        q_len=q.shape[1], kv_len=k.shape[1], head_dim=q.shape[-1],
        dtype=q.dtype, is_causal=info.is_causal, dropout=info.has_dropout,
        value_head_dim=None if v is None else v.shape[-1])


# The XLA and jax.numpy backends also compute in float64 (with x64 enabled).
WITH_FLOAT64 = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)
# ... and take float8 inputs with scales (`forward(..., scales=...)`).
WITH_FLOAT8 = WITH_FLOAT64 + quantize.FP8_DTYPES


def attention(
    backend: Backend,
    params: Params,
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    info: masking.MaskInfo,
    sinks: Array | None = None,
    scales: tuple[Array, Array, Array] | None = None,
    straight_through: tuple[Array, Array, Array] | None = None,
) -> tuple[Array, Array]:
  """Runs `backend` with its backward wired in as a custom_vjp.

  Args:
    backend, params, q, k, v, bias, info: the canonical call.
    sinks: float [N] (in the stats dtype of q), one sink logit per query
      head, added to the backend's result (see the module docstring); or
      None.
    scales: (q_scale, k_scale, v_scale) of a float8 call (q, k, v float8;
      float32 scales of rank 3, see the module docstring), or None.
    straight_through: with `scales`, the high-precision (q, k, v) the float8
      ones were quantized from (`flash_attention(quantize=...)`), shaped
      like them: they receive the gradients of the dequantized inputs, cast
      to their dtypes (the straight-through estimator); or None.
  """
  if scales is not None:
    dtypes = None
    if straight_through is not None:
      dtypes = tuple(x.dtype for x in straight_through)
    return _fp8_attention(backend, params, dtypes, q, k, v, scales,
                          straight_through, bias, info, sinks)
  if backend.backward is None:
    return _forward(backend, params, q, k, v, bias, info, sinks)
  return _attention(backend, params, q, k, v, bias, info, sinks)


def _forward(backend, params, q, k, v, bias, info, sinks, scales=None):
  def forward(q, k, v, bias, info, *scales):
    if not scales:
      return backend.forward(q, k, v, bias, info, params)
    return backend.forward(q, k, v, bias, info, params, scales=scales[0])

  out, lse = _kernel(backend, forward)(
      q, k, v, bias, info, *(() if scales is None else (scales,)))
  if sinks is None:
    return out, lse
  return online_softmax.add_sink(out, lse, sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(backend, params, q, k, v, bias, info, sinks):
  return _forward(backend, params, q, k, v, bias, info, sinks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _opaque_forward(backend, params, q, k, v, bias, info, sinks,
                    scales=None):
  """`_forward`, which `jax.checkpoint` sees as one call: a remat policy
  that does not save (out, lse) then recomputes them by calling it again,
  where it would otherwise rerun `chunked`'s tile loops keeping what they
  compute that it may save (under `dots_saveable`, every tile's logits,
  T x S). Its derivatives are `_forward`'s."""
  return _forward(backend, params, q, k, v, bias, info, sinks, scales)


@_opaque_forward.defjvp
def _opaque_forward_jvp(backend, params, primals, tangents):
  return jax.jvp(functools.partial(_forward, backend, params), primals,
                 tangents)


def _attention_fwd(backend, params, q, k, v, bias, info, sinks):
  out, lse = _opaque_forward(backend, params, q, k, v, bias, info, sinks)
  return (out, lse), (q, k, v, bias, info, sinks, out, lse)


def _attention_bwd(backend, params, residuals, cotangents):
  q, k, v, bias, info, sinks, out, lse = residuals
  return _backward(backend, params, q, k, v, bias, info, sinks, out, lse,
                   *cotangents)


def _backward(backend, params, q, k, v, bias, info, sinks, out, lse, dout,
              dlse):
  """(dq, dk, dv, dbias, info cotangent, dsinks) of `_forward`'s (out, lse)
  given their cotangents."""
  if backend.backward is None:  # Plain autodiff of the forward.
    _, pullback = jax.vjp(functools.partial(_forward, backend, params),
                          q, k, v, bias, info, sinks)
    return pullback((dout, dlse))
  delta = online_softmax.delta(out, dout, dlse)
  q_pad = masking.is_padding(info.q_segment_ids, masking.Q_PAD_SEGMENT)
  if q_pad is not None:
    # A padded row's probabilities are 0, but 0 * NaN is NaN: a NaN
    # cotangent there must not reach dS = P * (dP - delta).
    delta = jnp.where(q_pad[:, :, None], jnp.zeros((), delta.dtype), delta)
  # With sinks, lse and delta are those of the result with the sink: the
  # backend's backward is then exact as it stands (`online_softmax.sink_grad`).
  def backward(q, k, v, bias, info, lse, dout, delta):
    return backend.backward(q, k, v, bias, info, params, lse, dout, delta)

  dq, dk, dv, dbias, *dargs = _kernel(backend, backward)(
      q, k, v, bias, info, lse, dout, delta)
  dsinks = None if sinks is None else online_softmax.sink_grad(
      lse, sinks, delta)
  info_ct = jax.tree.map(lambda _: None, info)
  if dargs:  # score_mod's arrays are the only differentiable part of info.
    info_ct = info_ct.replace(score_mod_args=dargs[0])
  return dq, dk, dv, dbias, info_ct, dsinks


_attention.defvjp(_attention_fwd, _attention_bwd)


def _kernel(backend, fn):
  """fn, a backend's forward or backward call, as JAX may differentiate it:
  itself where the backend is `differentiable`, else behind a jvp rule that
  refuses by name. A Pallas kernel is reverse-differentiated by the
  `custom_vjp`s here; differentiating it directly (the forward under jvp
  of grad, the backward under grad of grad: both linearize through it)
  fails deep in Pallas's interpreters and lowerings, with internal errors
  or none."""
  if backend.differentiable:
    return fn
  wrapped = jax.custom_jvp(fn)

  def refuse(primals, tangents):
    del primals, tangents
    raise NotImplementedError(
        f"implementation={backend.name!r} has no second derivatives: "
        "neither grad of grad nor forward over reverse (jvp of grad, "
        "Hessian-vector products) goes through it. " + (
            backend.why_not_differentiable or (
                "Its kernels are Pallas calls, which JAX cannot "
                "differentiate twice; implementation='xla' and 'chunked' "
                "have both.")))

  wrapped.defjvp(refuse)
  return wrapped


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_attention(backend, params, dtypes, q, k, v, scales,
                   straight_through, bias, info, sinks):
  """A float8 call (`attention(scales=...)`); `dtypes`: those of
  `straight_through`, or None."""
  del dtypes, straight_through  # Only the backward reads them.
  return _forward(backend, params, q, k, v, bias, info, sinks, scales)


def _fp8_attention_fwd(backend, params, dtypes, *args):
  # With symbolic zeros each argument comes as a `CustomVJPPrimal`, which
  # tells whether it is differentiated.
  for name, x in zip(("query", "key", "value"), args):
    if x.perturbed:
      raise TypeError(
          f"flash_attention does not differentiate float8 inputs, and "
          f"{name} ({x.value.dtype}) is differentiated here: its cotangent "
          "would be float8 too, which rounds typical gradients to zero. "
          "Differentiate the high-precision arrays instead (pass them with "
          "quantize=... for straight-through gradients), or stop_gradient "
          "the float8 ones (their scales stay differentiable).")
  args = jax.tree.map(
      lambda x: x.value, args,
      is_leaf=lambda x: isinstance(x, custom_derivatives.CustomVJPPrimal))
  q, k, v, scales, _, bias, info, sinks = args
  out, lse = _opaque_forward(backend, params, q, k, v, bias, info, sinks,
                             scales)
  return (out, lse), (q, k, v, scales, bias, info, sinks, out, lse)


def _fp8_attention_bwd(backend, params, dtypes, residuals, cotangents):
  q8, k8, v8, scales, bias, info, sinks, out, lse = residuals
  # A symbolic zero made concrete, typed as the output it stands for
  # (inside a shard_map, varying as it does).
  dout, dlse = (
      manual_axes.vary_like(jnp.zeros(ct.aval.shape, ct.aval.dtype), primal)
      if isinstance(ct, custom_derivatives.SymbolicZero) else ct
      for ct, primal in zip(cotangents, (out, lse)))
  quantized = (q8, k8, v8)
  wide = [quantize.dequantize(x, s) for x, s in zip(quantized, scales)]
  *grads, dbias, info_ct, dsinks = _backward(
      backend, params, *wide, bias, info, sinks, out, lse, dout, dlse)
  dscales = tuple(quantize.scale_grad(g, x, s)
                  for g, x, s in zip(grads, quantized, scales))
  straight = None
  if dtypes is not None:
    straight = tuple(g.astype(d) for g, d in zip(grads, dtypes))
  return (None, None, None, dscales, straight, dbias, info_ct, dsinks)


_fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd,
                      symbolic_zeros=True)


# name -> module defining `BACKEND`. Modules are imported on first use so a
# backend whose compiler stack is missing never breaks the others.
REGISTRY = {
    "xla": "pallas_fa.reference",
    "chunked": "pallas_fa.chunked",
    "triton": "pallas_fa.triton",
    "mosaic_gpu": "pallas_fa.mosaic_gpu",
    "mosaic_tpu": "pallas_fa.mosaic_tpu",
}


@functools.cache
def get_backend(name: str) -> Backend:
  """The registered backend called `name`.

  Raises:
    ValueError: unknown name.
    NotImplementedError: the backend's compiler stack cannot be imported here.
  """
  if name not in REGISTRY:
    # jax.nn's other implementation, which a drop-in caller may pass on.
    hint = (" ('cudnn' is jax.nn.dot_product_attention's cuDNN path, which "
            "this library does not wrap: call jax.nn for it, or take None, "
            "the fastest kernel here)") if name == "cudnn" else ""
    raise ValueError(
        f"Unknown implementation={name!r}; expected one of "
        f"{sorted(REGISTRY)} or None{hint}."
    )
  try:
    module = importlib.import_module(REGISTRY[name])
  except ImportError as e:
    raise NotImplementedError(
        f"implementation={name!r} is unavailable: {e}") from e
  return module.BACKEND
