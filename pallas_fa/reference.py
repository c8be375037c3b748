"""`xla`: the materialised reference attention -- the spec of every backend.

It builds the whole [B, N, T, S] logit tensor, so its memory is quadratic; it
exists to be obviously right, and is differentiated by plain autodiff. It
computes in float32 by default (float8 inputs are dequantized to float32
first, `quantize.dequantize`); the test suite also runs it in float64 (to
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
from pallas_fa import quantize
from pallas_fa import vjp
from pallas_fa.flex import mods

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
    sinks: Array | None = None,
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
    sinks: [N] sink logits, or None: the spec of attention sinks, a column
      appended to the materialised logits and dropped after the softmax
      (masked too in a row that sees no key). The `xla` backend does not
      use it: like every backend it gets sinks from `vjp.attention`
      (`online_softmax.add_sink`), which this column checks.
  """
  b, t, n, h = q.shape
  num_kv = k.shape[2]
  g = n // num_kv
  q = masking.zero_padding(q, info.q_segment_ids, masking.Q_PAD_SEGMENT)
  k = masking.zero_padding(k, info.kv_segment_ids, masking.KV_PAD_SEGMENT)
  v = masking.zero_padding(v, info.kv_segment_ids, masking.KV_PAD_SEGMENT)
  # The scale is folded into q in compute_dtype, where it rounds no more
  # than a multiply of each logit would, and leaves XLA no multiply of
  # the logits to contract with the softmax's subtraction of their max
  # (`online_softmax.exp_at_most_one`).
  qg = (q.astype(compute_dtype) * jnp.asarray(scale, compute_dtype)).reshape(
      b, t, num_kv, g, h)
  s = jnp.einsum(
      "btkgh,bskh->bkgts",
      qg,
      k.astype(compute_dtype),
      precision=precision,
  )
  if bias is not None:
    bias = masking.group_heads(bias, num_kv)
  score_mod = None
  if info.score_mod is not None:
    indices = masking.tile_indices(b, n, num_kv, 0, t, 0, k.shape[1])
    # Its arrays' gradients are summed in compute_dtype too, not in theirs
    # (`mods.widen`).
    score_mod = online_softmax.ScoreMod(
        fn=info.score_mod, args=mods.widen(info.score_mod_args, compute_dtype),
        batch=indices[0], head=indices[1], q_idx=indices[2],
        kv_idx=indices[3])
  s, _ = online_softmax.logits(
      s, scale=1.0, cap=soft_cap, bias=bias, score_mod=score_mod)
  s = online_softmax.apply_mask(
      s, masking.tile_visibility(info, num_kv, num_heads=n))
  if sinks is not None:
    sink = sinks.astype(s.dtype).reshape(1, num_kv, g, 1, 1)
    seen = jnp.any(s != online_softmax.MASK_VALUE, axis=-1, keepdims=True)
    sink = jnp.where(seen, sink, online_softmax.MASK_VALUE)
    s = jnp.concatenate([s, sink], axis=-1)
  p, lse = online_softmax.softmax(s)
  if sinks is not None:
    p = p[..., :-1]  # The sink's value is 0.
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


def _forward(q, k, v, bias, info, params, scales=None):
  if scales is not None:
    # Float8 inputs: the attention of the float32 dequantized arrays.
    q, k, v = (quantize.dequantize(x, s) for x, s in zip((q, k, v), scales))
  out, lse = attention(
      q, k, v, bias, info, scale=params.scale, soft_cap=params.soft_cap,
      compute_dtype=online_softmax.stats_dtype(q.dtype),
      precision=params.precision,
  )
  return out.astype(params.out_dtype or out.dtype), lse


def _check(q, k, v, bias, info, params):
  del q, k, v, bias, info, params  # The reference supports every call.


# Differentiated by plain autodiff (no custom backward).
BACKEND = vjp.Backend(
    name="xla", forward=_forward, check=_check, dtypes=vjp.WITH_FLOAT8,
    value_head_dim=True, dropout=True, differentiable=True,
    symbolic_batch=True, symbolic_lengths=True)
