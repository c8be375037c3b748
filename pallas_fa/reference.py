"""`xla`: the materialised reference attention -- the spec of every backend.

It builds the whole [B, N, T, S] logit tensor, so its memory is quadratic; it
exists to be obviously right, and is differentiated by plain autodiff. It
computes in float32 by default; the test suite also runs it in float64 (to
check it) and in the input dtype (the "same-dtype reference" of the
FlashAttention error rule).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa import dropout
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import vjp

Array = Any


def attention(
    q: Array,
    k: Array,
    v: Array,
    bias: Array | None,
    info: masking.MaskInfo,
    *,
    scale: float,
    soft_cap: float | None,
    compute_dtype=jnp.float32,
    precision=jax.lax.Precision.HIGHEST,
) -> tuple[Array, Array]:
  """Materialised attention: returns (out [B,T,N,Hv], lse [B,T,N] float32).

  Args:
    q, k, v: [B, T, N, H], [B, S, K, H], [B, S, K, Hv].
    bias: additive bias broadcastable to [B, N, T, S] (4-D), or None.
    info: the canonical mask description.
    scale: logit scale.
    soft_cap: soft-cap value or None.
    compute_dtype: dtype of every intermediate (float32, float64, or the input
      dtype for the same-dtype reference).
    precision: matmul precision of q.k and p.v (HIGHEST: the oracle).
  """
  b, t, n, h = q.shape
  num_kv = k.shape[2]
  g = n // num_kv
  q = masking.zero_padding(q, info.q_segment_ids, masking.Q_PAD_SEGMENT)
  k = masking.zero_padding(k, info.kv_segment_ids, masking.KV_PAD_SEGMENT)
  v = masking.zero_padding(v, info.kv_segment_ids, masking.KV_PAD_SEGMENT)
  qg = q.astype(compute_dtype).reshape(b, t, num_kv, g, h)
  s = jnp.einsum(
      "btkgh,bskh->bkgts",
      qg,
      k.astype(compute_dtype),
      precision=precision,
  )
  if bias is not None:
    bias = masking.group_heads(bias, num_kv)
  s, _ = online_softmax.logits(s, scale=scale, cap=soft_cap, bias=bias)
  s = online_softmax.apply_mask(s, masking.tile_visibility(info, num_kv))
  p, lse = online_softmax.softmax(s)
  if info.has_dropout:
    p = p * dropout.grouped_factor(
        info.dropout_seed, info.dropout_rate, p.shape, p.dtype)
  out = jnp.einsum(
      "bkgts,bskh->btkgh",
      p,
      v.astype(compute_dtype),
      precision=precision,
  )
  out = out.reshape(b, t, n, v.shape[-1]).astype(q.dtype)
  lse = lse.transpose(0, 3, 1, 2).reshape(b, t, n)
  return out, lse.astype(online_softmax.stats_dtype(compute_dtype))


def _forward(q, k, v, bias, info, params):
  return attention(
      q, k, v, bias, info, scale=params.scale, soft_cap=params.soft_cap,
      compute_dtype=online_softmax.stats_dtype(q.dtype),
      precision=params.precision,
  )


def _check(q, k, v, bias, info, params):
  del q, k, v, bias, info, params  # The reference supports every call.


# Differentiated by plain autodiff (no custom backward).
BACKEND = vjp.Backend(
    name="xla", forward=_forward, check=_check, dtypes=vjp.WITH_FLOAT64,
    value_head_dim=True, dropout=True)
