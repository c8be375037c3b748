"""Flex attention examples: score_mods and mask_mods ready to pass.

Each function is written as for one element (see `pallas_fa.flex.mods`) and
reads its arrays from its trailing arguments, which the call passes through
`score_mod_args` / `mask_mod_args`:

    out = pallas_fa.flash_attention(
        q, k, v, is_causal=True,
        score_mod=flex.alibi, score_mod_args=(flex.alibi_slopes(N),))
    out = pallas_fa.flash_attention(
        q, k, v, mask_mod=flex.document, mask_mod_args=(doc_ids,))

`batch` is the flattened batch index, `head` the query head; `q_idx` and
`kv_idx` are token indices from 0 (the same for self-attention when T == S).
Those that index an array declare its shape (`mods.reads`), so that a call
whose array is too short raises instead of reading its last entry again.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from pallas_fa.flex.mods import reads

Array = Any


# --------------------------------------------------------------------------
# score_mods.
# --------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> Array:
  """The ALiBi head slopes 2^(-8 i / n) of Press et al. (2022), float32
  [num_heads]; for a head count that is not a power of two, those of the
  next lower power interleaved with the next higher one's, as in the
  paper's code."""
  def powers(n):
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]

  low = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = powers(low) + powers(2 * low)[0::2][:num_heads - low]
  return jnp.asarray(slopes, jnp.float32)


@reads(("N",))
def alibi(score, batch, head, q_idx, kv_idx, slopes):
  """ALiBi: `score - slopes[head] * |q_idx - kv_idx|` (a per-head linear
  distance penalty; with causal masking, `slopes[head] * (kv_idx - q_idx)`).

  score_mod_args: (slopes [N],), e.g. `alibi_slopes(N)`; differentiable.
  """
  del batch
  return score - slopes[head] * jnp.abs(q_idx - kv_idx).astype(score.dtype)


def t5_bucket(relative: Array, num_buckets: int, max_distance: int = 128,
              bidirectional: bool = True) -> Array:
  """T5's relative position bucket of `relative = kv_idx - q_idx`, int32:
  exact buckets for small distances, logarithmic ones up to max_distance
  (Raffel et al. 2020, `_relative_position_bucket`)."""
  bucket = jnp.zeros_like(relative)
  if bidirectional:
    num_buckets //= 2
    bucket = jnp.where(relative > 0, num_buckets, 0)
    distance = jnp.abs(relative)
  else:
    distance = jnp.maximum(-relative, 0)
  exact = num_buckets // 2
  far = exact + (
      jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact)
      / math.log(max_distance / exact) * (num_buckets - exact)
  ).astype(jnp.int32)
  far = jnp.minimum(far, num_buckets - 1)
  return bucket + jnp.where(distance < exact, distance, far)


@reads(("N", None))
def t5_relative_bias(score, batch, head, q_idx, kv_idx, table):
  """T5-style relative position bias: `score + table[head, bucket]`, the
  bucket of `kv_idx - q_idx` (`t5_bucket`, bidirectional, max distance
  128). An elementwise gather: its gradient is a scatter-add into the
  table.

  score_mod_args: (table [N, num_buckets],), learned.
  """
  del batch
  bucket = t5_bucket(kv_idx - q_idx, table.shape[1])
  return score + table[head, bucket].astype(score.dtype)


def tanh_soft_cap(score, batch, head, q_idx, kv_idx, cap):
  """Logit soft-capping `cap * tanh(score / cap)` (Gemma 2), after the bias
  (`logits_soft_cap=` caps before it).

  score_mod_args: (cap,), a scalar; differentiable.
  """
  del batch, head, q_idx, kv_idx
  cap = cap.astype(score.dtype)
  return cap * jnp.tanh(score / cap)


# --------------------------------------------------------------------------
# mask_mods.
# --------------------------------------------------------------------------


@reads(("B",))
def prefix_lm(batch, head, q_idx, kv_idx, prefix_lengths):
  """Prefix LM: bidirectional over each sequence's prefix, causal after.

  mask_mod_args: (prefix_lengths int [B],).
  """
  del head
  return (kv_idx <= q_idx) | (kv_idx < prefix_lengths[batch])


@reads(("B", "T=S"))
def document(batch, head, q_idx, kv_idx, document_ids):
  """Document masking of packed sequences: attend within equal ids (add
  is_causal=True for causal documents). Self-attention (T == S).

  mask_mod_args: (document_ids int [B, T],).
  """
  del head
  return document_ids[batch, q_idx] == document_ids[batch, kv_idx]


def chunked_causal(batch, head, q_idx, kv_idx, chunk_size):
  """Chunked causal attention (Llama 4's local layers): causal within
  fixed chunks of `chunk_size` tokens, nothing across them.

  mask_mod_args: (chunk_size int scalar,).
  """
  del batch, head
  return (kv_idx <= q_idx) & (q_idx // chunk_size == kv_idx // chunk_size)


def sliding_window_with_sinks(batch, head, q_idx, kv_idx, window, sinks):
  """StreamingLLM: causal over the last `window` tokens (the query
  included) plus the first `sinks` tokens of the sequence ("attention
  sinks").

  mask_mod_args: (window, sinks), int scalars.
  """
  del batch, head
  causal = kv_idx <= q_idx
  return causal & ((q_idx - kv_idx < window) | (kv_idx < sinks))


@reads(("B",))
def causal_with_offset(batch, head, q_idx, kv_idx, offsets):
  """Causal masking with the queries shifted by a per-sequence offset:
  `kv_idx <= q_idx + offsets[batch]` (queries continuing a cache of
  `offsets[batch]` tokens; offset S - T is bottom-right alignment).

  mask_mod_args: (offsets int [B],).
  """
  del head
  return kv_idx <= q_idx + offsets[batch]
