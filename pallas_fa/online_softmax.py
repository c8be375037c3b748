"""The softmax, logit and merge math of every implementation.

This module is the one home of that math (FlashAttention-2 §3.1); a kernel
body calls these functions rather than re-deriving them. Conventions,
identical in every backend:

* logits are `soft_cap(scale * q.k) + bias` (`logits`), then the user's
  `score_mod` (flex attention: `ScoreMod`), then masked; the soft cap comes
  first so that an additive bias (ALiBi, relative positions) is not
  squashed; the backward chains dS through score_mod's elementwise
  derivative (`ScoreMod.vjp`), which also gives its arrays' gradients;
* masked logits are -inf (`MASK_VALUE`); a row whose keys are all masked has
  running max m = -inf, and every formula below guards that case so it gives
  probability 0, output 0 and logsumexp -inf -- never NaN;
* the logsumexp residual is in natural log, float32 (float64 for float64
  inputs: `stats_dtype`).

Two hooks let the kernels keep their own code generation:

* `base2`: kernels may work in base 2, with log2(e) folded into the logits
  so that exp2 replaces exp; the logsumexp still leaves in natural log;
* `per_query`: how a per-query vector [..., q] is broadcast against a tile.
  The default appends a key axis ([..., q, k] tiles); `queries_last` serves
  transposed [..., k, q] tiles (S^T = K Q^T, keys as the matmuls' M
  dimension), and `queries_along(axis)` broadcasts explicitly for register
  layouts that cannot hold a [q, 1] array (Mosaic GPU's wgmma layouts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fa.flex import mods

Array = Any
# (vector [..., q], tile shape) -> the vector, broadcastable to the tile.
PerQuery = Callable[[Array, tuple[int, ...]], Array]

MASK_VALUE = -jnp.inf
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


# --------------------------------------------------------------------------
# Broadcasting per-query vectors against tiles.
# --------------------------------------------------------------------------


def queries_first(x: Array, shape: tuple[int, ...]) -> Array:
  """A per-query vector [..., q] against a [..., q, k] (or [..., q, H])
  tile."""
  del shape  # Implicit broadcasting.
  return x[..., None]


def queries_last(x: Array, shape: tuple[int, ...]) -> Array:
  """A per-query vector [..., q] against a transposed [..., k, q] tile."""
  del shape
  return x[..., None, :]


def _broadcast_along(x: Array, shape: tuple[int, ...], *, axis: int):
  return lax.broadcast_in_dim(x, shape, (axis,))


def queries_along(axis: int) -> PerQuery:
  """Broadcasts a vector [q] straight to a 2-D tile whose `axis` indexes
  queries, never through a [q, 1] intermediate."""
  return functools.partial(_broadcast_along, axis=axis)


# --------------------------------------------------------------------------
# Logits.
# --------------------------------------------------------------------------


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoreMod:
  """A user score_mod bound to one tile of logits (flex attention).

  The tile is [*lead, rows, cols] in the caller's layout; the indices
  broadcast against it (`masking.tile_indices` for the grouped layout).

  Attributes:
    fn: score_mod(score, batch, head, q_idx, kv_idx, *args) -> score.
    args: its extra arrays (`score_mod_args`).
    batch: int32 batch indices.
    head: int32 query-head indices.
    q_idx: int32 query token indices.
    kv_idx: int32 key token indices.
    uses: whether fn reads (batch, head) (`mods.uses_batch_and_head`).
  """

  fn: Callable
  args: tuple[Array, ...]
  batch: Array
  head: Array
  q_idx: Array
  kv_idx: Array
  uses: tuple[bool, bool] = (True, True)

  def _apply(self, s: Array, args) -> Array:
    return mods.evaluate(
        self.fn, s.shape, batch=self.batch, head=self.head,
        q_idx=self.q_idx, kv_idx=self.kv_idx, score=s, args=tuple(args),
        uses=self.uses)

  def __call__(self, s: Array) -> Array:
    """score_mod of the tile s, in s's dtype."""
    return self._apply(s, self.args)

  def vjp(self, s: Array) -> tuple[Array, Callable]:
    """(score_mod(s), pullback) for the backward recomputation.

    pullback(ds) -> (ds_in, dargs): ds chained through score_mod's
    elementwise derivative (the gradient w.r.t. the logits before it, and
    so the bias gradient), and the tile's contribution to each array of
    `args` in float32 (float64 for float64 arrays), None for an integer
    array. The transpose of an elementwise gather (`table[head, kv_idx -
    q_idx]`) is a scatter-add, of a per-head read (`slopes[head]`) a sum.
    """
    diff = [i for i, x in enumerate(self.args)
            if jnp.issubdtype(x.dtype, jnp.inexact)]

    def f(s, *dargs):
      args = list(self.args)
      for i, x in zip(diff, dargs):
        args[i] = x
      return self._apply(s, args)

    out, pull = jax.vjp(f, s, *(self.args[i] for i in diff))

    def pullback(ds):
      ds_in, *dargs = pull(ds.astype(out.dtype))
      grads = [None] * len(self.args)
      for i, d in zip(diff, dargs):
        grads[i] = d.astype(stats_dtype(d.dtype))
      return ds_in, tuple(grads)

    return out, pullback


def logits(
    qk: Array,
    *,
    scale: float,
    cap: float | None = None,
    bias: Array | None = None,
    base2: bool = False,
    score_mod: ScoreMod | None = None,
) -> tuple[Array, Array | None]:
  """The logits `score_mod(soft_cap(scale * qk) + bias)` of a tile of q.k
  products.

  With `base2` they come multiplied by log2(e), for `exp2`; when there is
  neither cap nor bias that factor is folded into the scale, which leaves a
  single multiply per element. A scale of 1 (already folded into q by the
  caller) costs no multiply.

  Args:
    qk: raw q.k products, in the dtype the logits are computed in.
    scale: the logit scale (a Python float).
    cap: the soft cap, or None.
    bias: additive bias broadcastable to `qk`, or None; cast to qk's dtype.
    base2: return the logits in base 2.
    score_mod: the user's score_mod bound to this tile, or None. A backward
      pass leaves it out here and chains its `ScoreMod.vjp` instead.

  Returns:
    (s, s_capped): the logits, unmasked, and the capped logits before bias
    and base change that `logits_grad` needs (None without a soft cap).
  """
  if base2 and cap is None and bias is None and score_mod is None:
    return qk * (scale * LOG2_E), None
  s = qk if scale == 1.0 else qk * scale
  s_capped = soft_cap(s, cap)
  s = s_capped if bias is None else s_capped + bias.astype(qk.dtype)
  if score_mod is not None:
    s = score_mod(s)
  if base2:
    s = s * LOG2_E
  return s, None if cap is None else s_capped


def exponent_scale(scale: float, *, cap: float | None = None,
                   has_bias: bool = False, has_score_mod: bool = False,
                   base2: bool = True) -> float | None:
  """The factor that `update` and `probs` can apply to a tile's raw
  products in the exponent (their `scale`: one fused multiply-add with
  the max's subtraction) in place of `logits` multiplying every product:
  the logit scale (times log2(e) in base 2) when the logits are the
  products times it alone (no cap, bias or score_mod) and it is positive
  (the max of the products then scales to the max of the logits); else
  None."""
  c = scale * LOG2_E if base2 else scale
  linear = cap is None and not has_bias and not has_score_mod
  return c if linear and c > 0 else None


def logits_grad(
    ds: Array,
    s_capped: Array | None,
    *,
    scale: float = 1.0,
    cap: float | None = None,
) -> Array:
  """Chains dS (w.r.t. the natural logits) back to the q.k products.

  The bias gradient is dS itself (after a score_mod's `ScoreMod.vjp`); this
  is d/dqk of `logits`: the soft-cap derivative, then the scale. Kernels
  that accumulate dQ / dK over many tiles may leave `scale` at 1 and apply
  it once to the sum.

  Args:
    ds: gradient w.r.t. the logits (`softmax_grad`).
    s_capped: the second result of `logits`.
    scale: the logit scale, or 1 to leave it to the caller.
    cap: the soft cap, or None.

  Returns:
    The gradient w.r.t. the q.k products.
  """
  ds = soft_cap_grad(ds, s_capped, cap)
  return ds if scale == 1.0 else ds * scale


def apply_mask(s: Array, visible: Array | None) -> Array:
  """Masked logits: -inf where `visible` is False (None: nothing masked)."""
  return s if visible is None else jnp.where(visible, s, MASK_VALUE)


# --------------------------------------------------------------------------
# Forward: the online softmax.
# --------------------------------------------------------------------------


def _finite_or_zero(m: Array) -> Array:
  # exp(x - m) with m = -inf would be exp(nan); a fully-masked row uses 0
  # instead, which gives exp(-inf) = 0 for every (masked) logit.
  return jnp.where(m == MASK_VALUE, 0.0, m)


def stats_dtype(dtype) -> jnp.dtype:
  """The dtype of the softmax statistics, accumulators and logsumexp of
  inputs of `dtype`: float32, or float64 for float64 inputs."""
  # Not `jnp.promote_types(dtype, float32)`: that obeys the caller's
  # `jax_numpy_dtype_promotion`, and under "strict" has no bfloat16/float16
  # to float32 path. The library's own dtype choices must not depend on it.
  return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64
                   else jnp.float32)


def init(rows_shape: tuple[int, ...], acc_shape: tuple[int, ...],
         dtype=jnp.float32):
  """Initial (m_i, l_i, acc): max -inf, denominator 0, accumulator 0."""
  m_i = jnp.full(rows_shape, MASK_VALUE, dtype)
  l_i = jnp.zeros(rows_shape, dtype)
  acc = jnp.zeros(acc_shape, dtype)
  return m_i, l_i, acc


def update(m_i: Array, l_i: Array, s: Array, *, base2: bool = False,
           per_query: PerQuery = queries_first, offset: float = 0.0,
           tile_exp: Callable[..., Array] | None = None,
           scale: float | Array | None = None):
  """One online-softmax step over a tile of logits s [..., rows, keys].

  Args:
    m_i: running max [..., rows] (in the base of s).
    l_i: running denominator [..., rows].
    s: masked logits of the tile.
    base2: s is in base 2 (`logits(base2=True)`).
    per_query: broadcast of a [..., rows] vector against s.
    offset: p and l come out exp(offset) (base 2: 2**offset) larger, p's
      largest entry that value rather than 1 (a low-precision P keeps its
      small entries above the format's subnormals, FlashAttention-3's
      FP8 max offset); the caller passes the same `offset` to
      `finalize`, whose output it does not change.
    tile_exp: `tile_exp(s, shift, scale)`, the tile's exponentials
      exp(s * scale - shift) (scale None: exp(s - shift); shift broadcast
      to s) in the base of s, in place of jnp's (`shifted_exp`): partly
      by a polynomial (`mosaic_gpu.exp2`), or one FMA and one MUFU an
      element (`triton.exp2`); alpha's are jnp's.
    scale: s holds the logits divided by `scale` (the q.k products,
      masked, before a logit scale that is all their transformation): a
      positive Python float, or a positive per-query vector [..., rows]
      (a float8 call's per-row factor, `mosaic_gpu.forward_fp8`); None: s
      holds the logits. The max is taken on s and scaled once a row
      (scaling by a positive factor is monotonic: the same value), so that
      the exponent s * scale - m can be one fused multiply-add an element
      instead of a multiply and a subtract.

  Returns:
    (m_new, l_new, p, alpha): the new running max and denominator, the tile's
    unnormalised probabilities p = exp(s - m_new + offset) and the factor
    alpha by which the caller rescales its accumulator (`rescale`) before
    adding p @ v.
  """
  exp = jnp.exp2 if base2 else jnp.exp
  top = s.max(axis=-1)
  m_new = jnp.maximum(m_i, top if scale is None else top * scale)
  m_safe = _finite_or_zero(m_new)
  alpha = exp(m_i - m_safe)
  shift = per_query(m_safe - offset if offset else m_safe, s.shape)
  if scale is not None and jnp.ndim(scale):
    scale = per_query(scale, s.shape)
  p = (tile_exp or shifted_exp(exp))(s, shift, scale)
  l_new = alpha * l_i + p.sum(axis=-1)
  return m_new, l_new, p, alpha


def exp_at_most_one(s: Array, shift: Array, scale: float | None = None
                    ) -> Array:
  """The `tile_exp` exp(s * scale - shift) of a shift that bounds the
  logits (their max, or their logsumexp), its exponent clamped at 0.

  The exponent can come out positive, and past logits of about 1e9 overflow
  exp (NaN rows), where the shift was computed from other roundings of the
  same logits: XLA:CPU contracts a logit's scaling multiply with the
  subtraction of the shift into one unrounded fused multiply-add; a
  blockwise backward recomputes the logits with other tiles than the
  forward's, whose products round differently; and at optimisation level
  0 XLA:CPU evaluates a score_mod's tanh a rounding apart in two fusions.
  The clamp is gradient-free (the exponent loses a constant), so the
  derivative is exp's own everywhere: a select or jnp.minimum would zero
  or halve it where x is 0 or a rounding above it. `chunked`'s forward
  does without it (its float32 calls fold the scale into q and take the
  max and the exponents from one product); kernels take their own
  exponentials.
  """
  x = (s if scale is None else s * scale) - shift
  return jnp.exp(x - lax.stop_gradient(jnp.maximum(x, 0.0)))


def shifted_exp(exp: Callable[[Array], Array]):
  """The `tile_exp` of an elementwise exp: (s, shift, scale) ->
  exp(s * scale - shift), or exp(s - shift) when scale is None."""

  def tile_exp(s: Array, shift: Array, scale: float | None = None) -> Array:
    return exp((s if scale is None else s * scale) - shift)

  return tile_exp


def rescale(acc: Array, alpha: Array, *,
            per_query: PerQuery = queries_first) -> Array:
  """acc [..., rows, H] * alpha [..., rows]: the accumulator of the previous
  tiles brought to the new running max."""
  return acc * per_query(alpha, acc.shape)


def finalize(m_i: Array, l_i: Array, acc: Array, *, base2: bool = False,
             per_query: PerQuery = queries_first, offset: float = 0.0):
  """Normalises acc [..., rows, H]; returns (out, lse), lse in natural log.

  A row with l_i == 0 saw no visible key: its output is 0 and lse is -inf.

  Args:
    m_i: running max [..., rows].
    l_i: running denominator [..., rows].
    acc: accumulator [..., rows, H].
    base2: m_i is in base 2 (the kernel ran with exp2).
    per_query: broadcast of a [..., rows] vector against acc.
    offset: `update`'s: P and l came out exp(offset) larger; they cancel in
      the output, and the logsumexp takes the offset off the max.
  """
  if offset:
    m_i = m_i - offset
  seen = l_i > 0
  l_safe = jnp.where(seen, l_i, 1.0)
  out = acc / per_query(l_safe, acc.shape)
  if base2:
    lse = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN_2, MASK_VALUE)
  else:
    lse = jnp.where(seen, m_i + jnp.log(l_safe), MASK_VALUE)
  return out, lse


def softmax(s: Array) -> tuple[Array, Array]:
  """(p, lse) of whole rows of masked logits s [..., q, k], in one tile.

  Differentiable by plain autodiff: the max is a constant shift of the
  softmax, so no gradient flows through it, which also keeps rows with no
  visible key (p = 0, lse = -inf) free of NaN.
  """
  m = lax.stop_gradient(s.max(axis=-1))
  e = exp_at_most_one(s, _finite_or_zero(m)[..., None])
  return finalize(m, e.sum(axis=-1), e)


# --------------------------------------------------------------------------
# Backward.
# --------------------------------------------------------------------------


def lse_for_probs(lse: Array, *, base2: bool = False) -> Array:
  """The logsumexp (natural log) as `probs` takes it.

  Rows without a visible key (lse = -inf) become +inf so that exp(s - lse)
  is 0 for every logit of the row, masked or not; with `base2` the others
  are converted to base 2. Kernels may apply this once, outside the loop.
  """
  return jnp.where(lse == MASK_VALUE, jnp.inf, lse * LOG2_E if base2 else lse)


def probs(s: Array, lse: Array, *, base2: bool = False,
          per_query: PerQuery = queries_first,
          tile_exp: Callable[..., Array] | None = None,
          scale: float | None = None) -> Array:
  """Normalised probabilities exp(s - lse) for the backward recomputation.

  Args:
    s: masked logits of a tile.
    lse: per-query logsumexp from `lse_for_probs`, in the base of s.
    base2: s and lse are in base 2.
    per_query: broadcast of the lse against s.
    tile_exp, scale: as for `update` (with `scale`, s holds the logits
      divided by it).
  """
  exp = tile_exp or shifted_exp(jnp.exp2 if base2 else jnp.exp)
  return exp(s, per_query(lse, s.shape), scale)


def probs_from_lse(s: Array, lse: Array, *, base2: bool = False,
                   per_query: PerQuery = queries_first,
                   tile_exp: Callable[..., Array] | None = None,
                   scale: float | None = None) -> Array:
  """`probs` from a logsumexp in the base of s, -inf for queries with no
  visible key (which get probability 0 everywhere)."""
  return probs(s, lse_for_probs(lse), base2=base2, per_query=per_query,
               tile_exp=tile_exp, scale=scale)


def softmax_grad(p: Array, dp: Array, delta: Array, *,
                 per_query: PerQuery = queries_first) -> Array:
  """dS = P * (dP - delta), delta [..., q] = rowsum(out * dout) - dlse.

  Folding the logsumexp cotangent into delta makes the residual lse itself
  differentiable (d lse / d s = p), which exact merging of partial results
  (`merge`, ring attention) relies on.
  """
  return p * (dp - per_query(delta, p.shape))


def _rowdot(out: Array, dout: Array) -> Array:
  """rowsum(out * dout) in the stats dtype of out."""
  dtype = stats_dtype(out.dtype)
  return jnp.sum(out.astype(dtype) * dout.astype(dtype), axis=-1)


def delta(out: Array, dout: Array, dlse: Array | None) -> Array:
  """rowsum(out * dout) - dlse, [..., rows] (FlashAttention-2 §3.2), in the
  `stats_dtype` of out."""
  d = _rowdot(out, dout)
  if dlse is not None:
    d = d - dlse.astype(d.dtype)
  return d


# --------------------------------------------------------------------------
# Merging partial attentions.
# --------------------------------------------------------------------------


def merge(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array):
  """Exactly combines two partial attentions over disjoint key sets
  (`merge_parts` of the two).

  Args:
    out_a: normalised output [..., rows, H] over the first keys.
    lse_a: its logsumexp [..., rows], natural log (-inf: no visible key).
    out_b: the same over the other keys.
    lse_b: its logsumexp.

  Returns:
    (out, lse) of attention over both key sets, differentiable as
    `merge_parts` is.
  """
  return merge_parts(jnp.stack([out_a, out_b]), jnp.stack([lse_a, lse_b]),
                     axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def merge_parts(out: Array, lse: Array, axis: int) -> tuple[Array, Array]:
  """Exactly combines partial attentions over disjoint key sets, stacked on
  `axis`: the one home of this merge (split-KV decoding, ring attention,
  `pallas_fa.merge_attention`).

  With w_s = exp(lse_s - lse), out = sum_s w_s out_s and lse = logsumexp_s
  lse_s, computed relative to the largest lse so that nothing overflows.

  Args:
    out: normalised outputs [..., rows, H], the parts along `axis` (an axis
      before the last two).
    lse: their logsumexps, `out` without its last axis, natural log (-inf:
      the part saw no key).
    axis: the parts' axis.

  Returns:
    (out, lse) over all parts' keys, out in the stats dtype of the parts; a
    row no part saw gets out 0 and lse -inf. Reverse-mode differentiable
    with the cotangents of `merge_grad`, zero for a part with lse = -inf
    (autodiff of the formula would give NaN there).
  """
  return merge_part_groups(((out, lse),), axis)


def merge_part_groups(groups: Sequence[tuple[Array, Array]], axis: int
                      ) -> tuple[Array, Array]:
  """`merge_parts` of parts held in several stacks, (out, lse) each with
  its own number of parts on `axis` and otherwise one shape: the merge of
  their concatenation, computed without concatenating (a kernel that reads
  two arrays of partials merges them in registers). Forward only."""
  top = functools.reduce(jnp.maximum, [
      jnp.max(lse, axis=axis) for _, lse in groups])
  top_safe = jnp.where(top == MASK_VALUE, 0.0, top)
  weights = [jnp.exp(lse - _spread(top_safe, lse.shape, axis))
             for _, lse in groups]
  total = functools.reduce(jnp.add, [jnp.sum(w, axis=axis) for w in weights])
  seen = total > 0
  total_safe = jnp.where(seen, total, 1.0)
  merged = functools.reduce(jnp.add, [
      jnp.sum(_per_row(w, out) * out, axis=axis)
      for w, (out, _) in zip(weights, groups)])
  merged = merged / _per_row(total_safe, merged)
  lse = jnp.where(seen, top_safe + jnp.log(total_safe), MASK_VALUE)
  return merged, lse


def _spread(x: Array, shape: tuple[int, ...], axis: int) -> Array:
  """x (`shape` without `axis`) broadcast along `axis`; a scalar as it is.
  Explicit dims, not keepdims: a Mosaic GPU kernel broadcasts a vector
  along a tile's axis, never through a [.., 1] intermediate
  (`mosaic_gpu.decode_merge`)."""
  if not jnp.ndim(x):
    return x
  axis %= len(shape)
  return lax.broadcast_in_dim(
      x, shape, tuple(d for d in range(len(shape)) if d != axis))


def _per_row(x: Array, like: Array) -> Array:
  """A per-row array ([..., rows]) against a [..., rows, H] one."""
  return _spread(x, like.shape, -1)


def merge_grad(
    out_part: Array, lse_part: Array, lse: Array, dout: Array, delta: Array
) -> tuple[Array, Array]:
  """The cotangents of one part of a merge, from those of the merged result.

  Merging is associative: with out = sum_s w_s out_s and lse = logsumexp_s
  lse_s over any number of parts, w_s = exp(lse_s - lse),

      dout_s = w_s dout,    dlse_s = w_s (rowsum(dout * out_s) - delta),

  where delta = rowsum(out * dout) - dlse is the `delta` of the merged
  result. A part with lse_s = -inf gets zero cotangents.

  Args:
    out_part: the part's output [..., rows, H].
    lse_part: its logsumexp [..., rows].
    lse: the merged logsumexp.
    dout: the cotangent of the merged output.
    delta: `delta(out, dout, dlse)` of the merged result.

  Returns:
    (dout_part, dlse_part) in the dtypes of out_part and lse_part.
  """
  w = jnp.where(lse_part == MASK_VALUE, 0.0, jnp.exp(lse_part - lse))
  dout_part = w[..., None] * dout.astype(stats_dtype(out_part.dtype))
  dlse_part = w * (_rowdot(out_part, dout) - delta)
  return dout_part.astype(out_part.dtype), dlse_part.astype(lse_part.dtype)


def _merge_parts_fwd(out, lse, axis):
  merged = merge_parts(out, lse, axis)
  return merged, (out, lse) + merged


def _merge_parts_bwd(axis, residuals, cotangents):
  out_parts, lse_parts, out, lse = residuals
  dout, dlse = cotangents
  d = delta(out, dout, dlse)
  return merge_grad(out_parts, lse_parts, jnp.expand_dims(lse, axis),
                    jnp.expand_dims(dout, axis), jnp.expand_dims(d, axis))


merge_parts.defvjp(_merge_parts_fwd, _merge_parts_bwd)


# --------------------------------------------------------------------------
# Attention sinks.


def _sink_weights(lse: Array, sinks: Array) -> tuple[Array, Array]:
  """(lse with the sink, exp(lse - that)): lse [..., rows] stays -inf where
  it is -inf (a row that sees no key gets no sink either)."""
  sinks = jnp.broadcast_to(sinks.astype(lse.dtype), lse.shape)
  seen = lse != MASK_VALUE
  # logaddexp's stable form, spelled out: jnp.logaddexp is a custom_jvp
  # and log1p has no Mosaic GPU lowering, which a Mosaic GPU kernel needs
  # (`mosaic_gpu.decode_merge`); add_sink has a rule of its own. Where a
  # row is seen (lse finite) a sink of -inf leaves lse and one of +inf
  # gives +inf; log(1 + e) drops an e under half the dtype's epsilon that
  # log1p would keep, an error under the dtype's rounding in the weight
  # exp(lse - with_sink).
  top = jnp.maximum(lse, sinks)
  with_sink = jnp.where(
      seen, top + jnp.log(1.0 + jnp.exp(-jnp.abs(lse - sinks))), MASK_VALUE)
  # exp(-inf - -inf) would be NaN: an unseen row keeps weight 0 (its out
  # is 0 already).
  w = jnp.where(seen, jnp.exp(lse - jnp.where(seen, with_sink, 0.0)), 0.0)
  return with_sink, w


def _sink_probability(lse: Array, sinks: Array, dtype) -> Array:
  """exp(sinks - lse) in `dtype`, the sink's share of each row of the
  attention with it (lse: its logsumexp), 0 where lse = -inf. Taken
  directly, not as 1 - the keys' share, which loses a small one's
  relative precision."""
  seen = lse != MASK_VALUE
  s = jnp.broadcast_to(sinks.astype(dtype), lse.shape)
  return jnp.where(seen, jnp.exp(s - jnp.where(seen, lse, 0.0)), 0.0)


@jax.custom_jvp
def add_sink(out: Array, lse: Array, sinks: Array) -> tuple[Array, Array]:
  """Adds a sink -- one value-less logit per row -- to finished attention.

  A sink is a virtual key with logit `sinks` and value 0: it joins the
  softmax denominator and adds nothing to the output, so a head can attend
  "nowhere" (gpt-oss). It is `merge` with a part (out 0, lse `sinks`), done
  once after every key has been seen, so a row's running max never needs
  it: `lse' = logaddexp(lse, sink)` and `out' = out * exp(lse - lse')`,
  which a huge sink takes to 0 without overflow. A row that sees no key
  (lse = -inf) keeps out 0 and lse -inf, and its sink gets no gradient.

  Args:
    out: normalised attention over the keys [..., rows, H], any float dtype
      (rescaled in the stats dtype, returned in its own).
    lse: its logsumexp [..., rows], natural log, -inf for a row that saw no
      key.
    sinks: the sink logits, broadcastable to lse (e.g. [N] against
      [B, T, N]).

  Returns:
    (out, lse) of the attention with the sink. Differentiable in all three,
    in forward and reverse mode and to any order (`_add_sink_jvp`: a
    custom_jvp, whose linear rule JAX transposes for reverse mode, so that
    Hessian-vector products through a sink work where the attention
    itself has them).
  """
  lse, w = _sink_weights(lse, sinks)
  rescaled = out.astype(stats_dtype(out.dtype)) * _per_row(w, out)
  return rescaled.astype(out.dtype), lse


@add_sink.defjvp
def _add_sink_jvp(primals, tangents):
  # With p = exp(sinks - lse') the sink's probability and w = 1 - p =
  # exp(lse - lse') the keys' share: lse' moves by w dlse + p dsinks, and
  # out' = w out by w dout + out dw, dw = w (dlse - dlse'). A row that sees
  # no key (w = p = 0) stays constant; the guards keep its tangents 0, not
  # NaN, whatever the incoming ones are.
  out, lse, sinks = primals
  dout, dlse, dsinks = tangents
  new_lse, w = _sink_weights(lse, sinks)
  dtype = stats_dtype(out.dtype)
  seen = lse != MASK_VALUE
  p = _sink_probability(new_lse, sinks, lse.dtype)  # Not 1 - w: see there.
  dsinks = jnp.broadcast_to(dsinks.astype(lse.dtype), lse.shape)
  dlse = jnp.where(seen, dlse, 0.0)
  dnew_lse = w * dlse + p * dsinks
  dw = (w * (dlse - dnew_lse)).astype(dtype)
  wide = out.astype(dtype)
  new_out = wide * w.astype(dtype)[..., None]
  dnew_out = (dout.astype(dtype) * w.astype(dtype)[..., None]
              + wide * dw[..., None])
  return ((new_out.astype(out.dtype), new_lse),
          (dnew_out.astype(out.dtype), dnew_lse))


def sink_grad(lse: Array, sinks: Array, delta: Array) -> Array:
  """d/dsinks of attention with a sink, from its final lse and delta.

  With p_sink = exp(sinks - lse) the sink's probability and v_sink = 0, the
  softmax Jacobian gives `dsinks = -sum p_sink * delta`, delta = rowsum(out
  * dout) - dlse (`delta`) being that of the result *with* the sink; rows
  with lse = -inf add nothing. Every other gradient is the plain
  FlashAttention backward run with that same lse and delta: the sink only
  lowers each probability p = exp(s - lse).

  Args:
    lse: the logsumexp with the sink [..., rows].
    sinks: the sink logits, broadcast along lse's leading axes.
    delta: `delta(out, dout, dlse)` of the result with the sink.

  Returns:
    dsinks, shaped and typed like `sinks`, summed over the axes it was
    broadcast along.
  """
  dtype = stats_dtype(lse.dtype)
  p_sink = _sink_probability(lse, sinks, dtype)
  d = -p_sink * delta.astype(dtype)
  d = d.sum(axis=tuple(range(d.ndim - sinks.ndim)))
  d = d.sum(axis=tuple(i for i, n in enumerate(sinks.shape) if n == 1),
            keepdims=True)
  return d.astype(sinks.dtype)
