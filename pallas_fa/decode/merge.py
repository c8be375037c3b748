"""`merge_attention`: the exact merge of partial attention results.

Attention over a key set that is the disjoint union of parts equals the
merge of each part's normalised result and logsumexp (the FlashDecoding and
ring-attention identity): a serving loop that attends to a shared prefix
and to each request's own cache separately, or to several shards of a
cache, combines them here. The math is `online_softmax.merge_parts`, which
the split-KV merge and ring attention use too.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import jax.numpy as jnp

from pallas_fa import online_softmax

Array = Any


def merge_attention(outs: Sequence[Array] | Array,
                    lses: Sequence[Array] | Array) -> tuple[Array, Array]:
  """The attention over the union of disjoint key sets, from each set's.

  Args:
    outs: the parts' normalised results [..., T, N, Hv], as a list (or
      tuple) of arrays or one array stacked on a leading parts axis.
    lses: their logsumexps [..., T, N] (natural log, -inf where a part saw
      no key: `return_residual=True` of `flash_attention` and
      `decode_attention`), listed or stacked the same way.

  Returns:
    (out, lse): out [..., T, N, Hv] in the parts' (promoted) dtype, lse
    float32 (float64 for float64 parts). A row that no part saw gets out 0
    and lse -inf. Differentiable: every part's out and lse get their
    cotangents (zero for a part with lse -inf, never NaN).

  Raises:
    ValueError: no parts, a different number of outs and lses, or shapes
      that do not match (each lse is its out without the last axis).
    TypeError: non-float parts.
  """
  outs, lses = _stacked("outs", outs), _stacked("lses", lses)
  if outs.shape[0] != lses.shape[0]:
    raise ValueError(
        f"outs and lses must have as many parts, got {outs.shape[0]} and "
        f"{lses.shape[0]}.")
  if outs.ndim < 2 or lses.shape != outs.shape[:-1]:
    raise ValueError(
        f"each lse must be its out without the last (head) axis, got "
        f"outs [parts, ...]={outs.shape} and lses={lses.shape}.")
  stats = online_softmax.stats_dtype(outs.dtype)
  out, lse = online_softmax.merge_parts(outs, lses.astype(stats), axis=0)
  return out.astype(outs.dtype), lse


def _stacked(name: str, parts) -> Array:
  if isinstance(parts, (list, tuple)):
    if not parts:
      raise ValueError(f"{name} must hold at least one part, got none.")
    parts = [jnp.asarray(p) for p in parts]
    shapes = {p.shape for p in parts}
    if len(shapes) != 1:
      raise ValueError(
          f"{name} must all have one shape, got {sorted(shapes)}.")
    parts = jnp.stack(parts)
  parts = jnp.asarray(parts)
  if not jnp.issubdtype(parts.dtype, jnp.floating):
    raise TypeError(f"{name} must be floating, got {name}.dtype={parts.dtype}.")
  if parts.ndim == 0 or parts.shape[0] == 0:
    raise ValueError(f"{name} must hold at least one part, got none.")
  return parts
