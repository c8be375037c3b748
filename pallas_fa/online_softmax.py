"""The shared softmax math of every implementation (FlashAttention-2 §3.1).

Conventions, identical in every backend:

* masked logits are -inf (`MASK_VALUE`); a row whose keys are all masked has
  running max m = -inf, and every formula below guards that case so it gives
  probability 0, output 0 and logsumexp -inf -- never NaN;
* the logsumexp residual is in natural log, float32 (float64 for float64
  inputs: `stats_dtype`);
* logits are `soft_cap(scale * q.k) + bias`, then masked; the soft cap comes
  first so that an additive bias (ALiBi, relative positions) is not squashed.

Kernels may work in base 2 (exp2 with log2(e) folded into the scale); they pass
`exp=jnp.exp2` and finish with `finalize_base2`.
"""

from __future__ import annotations

import math
from typing import Any
from typing import Callable

import jax.numpy as jnp

Array = Any

MASK_VALUE = -jnp.inf
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def soft_cap(s: Array, cap: float | None) -> Array:
  """`cap * tanh(s / cap)` (Gemma-2 style logit capping); identity if None."""
  if cap is None:
    return s
  return cap * jnp.tanh(s / cap)


def soft_cap_grad(ds: Array, s_capped: Array, cap: float | None) -> Array:
  """Chains ds through the soft cap: d(cap tanh(s/cap))/ds = 1 - tanh^2.

  `s_capped` is the capped logit *before* masking (finite everywhere).
  """
  if cap is None:
    return ds
  t = s_capped / cap
  return ds * (1.0 - t * t)


def apply_mask(s: Array, visible: Array | None) -> Array:
  return s if visible is None else jnp.where(visible, s, MASK_VALUE)


def _finite_or_zero(m: Array) -> Array:
  # exp(x - m) with m = -inf would be exp(nan); a fully-masked row uses 0
  # instead, which gives exp(-inf) = 0 for every (masked) logit.
  return jnp.where(m == MASK_VALUE, 0.0, m)


def stats_dtype(dtype) -> jnp.dtype:
  """The dtype of the softmax statistics, accumulators and logsumexp of
  inputs of `dtype`: float32, or float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


def init(rows_shape: tuple[int, ...], acc_shape: tuple[int, ...],
         dtype=jnp.float32):
  """Initial (m_i, l_i, acc): max -inf, denominator 0, accumulator 0."""
  m_i = jnp.full(rows_shape, MASK_VALUE, dtype)
  l_i = jnp.zeros(rows_shape, dtype)
  acc = jnp.zeros(acc_shape, dtype)
  return m_i, l_i, acc


def update(
    m_i: Array, l_i: Array, s: Array, exp: Callable[[Array], Array] = jnp.exp
) -> tuple[Array, Array, Array, Array]:
  """One online-softmax step over a tile of logits s [..., rows, keys].

  Returns:
    (m_new, l_new, p, alpha): the new running max and denominator, the tile's
    unnormalised probabilities p = exp(s - m_new) and the factor alpha by which
    the caller rescales its accumulator before adding p @ v.
  """
  m_new = jnp.maximum(m_i, s.max(axis=-1))
  m_safe = _finite_or_zero(m_new)
  alpha = exp(m_i - m_safe)
  p = exp(s - m_safe[..., None])
  l_new = alpha * l_i + p.sum(axis=-1)
  return m_new, l_new, p, alpha


def finalize(m_i: Array, l_i: Array, acc: Array) -> tuple[Array, Array]:
  """Normalises acc [..., rows, H]; returns (out, lse) in the base of m_i.

  A row with l_i == 0 saw no visible key: its output is 0 and lse is -inf.
  """
  seen = l_i > 0
  l_safe = jnp.where(seen, l_i, 1.0)
  out = acc / l_safe[..., None]
  lse = jnp.where(seen, m_i + jnp.log(l_safe), MASK_VALUE)
  return out, lse


def finalize_base2(m_i: Array, l_i: Array, acc: Array):
  """`finalize` for a kernel that ran with exp2: lse returned in natural log."""
  seen = l_i > 0
  l_safe = jnp.where(seen, l_i, 1.0)
  out = acc / l_safe[..., None]
  lse = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN_2, MASK_VALUE)
  return out, lse


def per_query(x: Array, queries_last: bool = False) -> Array:
  """A per-query vector [..., q] against a [..., q, k] tile, or against a
  transposed [..., k, q] tile with `queries_last` (kernels that compute
  S^T = K Q^T so that the key axis is the matmuls' M dimension)."""
  return x[..., None, :] if queries_last else x[..., None]


def probs_from_lse(s: Array, lse: Array, exp=jnp.exp, *,
                   queries_last: bool = False) -> Array:
  """Normalised probabilities exp(s - lse) for the backward recomputation.

  lse [..., q] must be in the base of `exp`. Queries with lse = -inf (no
  visible key) get probability 0 everywhere. `queries_last`: s is [..., k, q]
  (see `per_query`).
  """
  lse_safe = jnp.where(lse == MASK_VALUE, jnp.inf, lse)
  return exp(s - per_query(lse_safe, queries_last))


def logits_grad(p: Array, dp: Array, delta: Array, *,
                queries_last: bool = False) -> Array:
  """dS = P * (dP - delta), delta [..., q] = rowsum(out * dout) - dlse.

  Folding the logsumexp cotangent into delta makes the residual lse itself
  differentiable (d lse / d s = p), which exact merging of partial results
  (ring attention) relies on. `queries_last`: p, dp are [..., k, q].
  """
  return p * (dp - per_query(delta, queries_last))


def delta(out: Array, dout: Array, dlse: Array | None) -> Array:
  """rowsum(out * dout) - dlse, [B, T, N] (FlashAttention-2 §3.2), in the
  `stats_dtype` of out."""
  dtype = stats_dtype(out.dtype)
  d = jnp.sum(out.astype(dtype) * dout.astype(dtype), axis=-1)
  if dlse is not None:
    d = d - dlse.astype(dtype)
  return d


def merge(out_a, lse_a, out_b, lse_b):
  """Exactly combines two partial attentions over disjoint key sets.

  out_* [..., rows, H] normalised, lse_* [..., rows] natural log.
  """
  lse = jnp.logaddexp(lse_a, lse_b)
  lse_safe = jnp.where(lse == MASK_VALUE, 0.0, lse)
  wa = jnp.exp(lse_a - lse_safe)[..., None]
  wb = jnp.exp(lse_b - lse_safe)[..., None]
  return wa * out_a + wb * out_b, lse
