"""The backend interface and the custom_vjp shared by every implementation.

A backend supplies a forward `(q, k, v, bias, info, params) -> (out, lse)` and,
unless it relies on plain autodiff, a backward that receives the logsumexp
residual and `delta = rowsum(out * dout) - dlse`, computed here once for all
backends (FlashAttention-2 §3.2). Residuals are (out, lse) only -- never the
T x S probabilities -- so memory stays linear in sequence length.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_fa import masking
from pallas_fa import online_softmax

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
  """

  scale: float
  soft_cap: float | None = None
  block_sizes: Any = None
  precision: jax.lax.Precision = jax.lax.Precision.DEFAULT


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
    dtypes: input dtypes it computes in (others raise NotImplementedError).
    value_head_dim: whether value (and the output) may have a head dim Hv
      other than the query/key head dim H.
    dropout: whether it implements attention dropout (`pallas_fa.dropout`).
  """

  name: str
  forward: Forward
  check: Callable[..., None]
  backward: Backward | None = None
  block_sizes_type: type | None = None
  dtypes: tuple[Any, ...] = (jnp.float32, jnp.bfloat16, jnp.float16)
  value_head_dim: bool = False
  dropout: bool = False

  def check_call(self, q, k, v, bias, info, params) -> None:
    """Raises NotImplementedError naming why this backend cannot run the
    call: the input dtype, or its own `check`."""
    if not any(q.dtype == d for d in self.dtypes):
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


# The XLA and jax.numpy backends also compute in float64 (with x64 enabled).
WITH_FLOAT64 = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def attention(
    backend: Backend,
    params: Params,
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    info: masking.MaskInfo,
) -> tuple[Array, Array]:
  """Runs `backend` with its backward wired in as a custom_vjp."""
  if backend.backward is None:
    return backend.forward(q, k, v, bias, info, params)
  return _attention(backend, params, q, k, v, bias, info)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(backend, params, q, k, v, bias, info):
  return backend.forward(q, k, v, bias, info, params)


def _attention_fwd(backend, params, q, k, v, bias, info):
  out, lse = backend.forward(q, k, v, bias, info, params)
  return (out, lse), (q, k, v, bias, info, out, lse)


def _attention_bwd(backend, params, residuals, cotangents):
  q, k, v, bias, info, out, lse = residuals
  dout, dlse = cotangents
  delta = online_softmax.delta(out, dout, dlse)
  dq, dk, dv, dbias = backend.backward(
      q, k, v, bias, info, params, lse, dout, delta
  )
  info_ct = jax.tree.map(lambda _: None, info)
  return dq, dk, dv, dbias, info_ct


_attention.defvjp(_attention_fwd, _attention_bwd)
