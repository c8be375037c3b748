"""Ring (context-parallel) attention: the per-device code, run inside
`shard_map` over a sequence axis.

Each device keeps its query shard; its key/value shard -- with the key
positions and segment ids, into which padding is folded -- travels around
the ring with `ppermute`, issued before each step's compute so the transfer
overlaps it. The partial results of the steps are merged exactly through
their logsumexp (`online_softmax.merge`), and attention sinks join once, after
the last step (`online_softmax.add_sink`). The backward pass is a second trip
around the ring: it recomputes every step from the final logsumexp (nothing
per step is stored) and carries the dK/dV accumulators with K/V, so after
the last rotation they are back on the device that owns those keys.

Steps in which no query may see any key (causal, window or segments, decided
from the per-shard min/max of positions and segment ids) are skipped. Flex
functions (score_mod, mask_mod) see global token indices on every step
(`_RingIndices`: contiguous shards or the zig-zag layout's chunks), and the
score_mod's array gradients are summed over the steps.
Masking is always computed from the true token positions, which travel with
the tokens, so any token order (e.g. `parallel.zigzag`) is exact.

A dense bias or mask travels differently: each device keeps its query rows
against all keys ([..., T/P, S]) and slices the columns of the visiting
shard, so it costs O(T S / P) per device, as dense masks do.

Ring layout over P devices (K/V shard held by device r at step s):

    step:      0    1    2    3
    device 0:  kv0  kv3  kv2  kv1
    device 1:  kv1  kv0  kv3  kv2
    device 2:  kv2  kv1  kv0  kv3
    device 3:  kv3  kv2  kv1  kv0
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_fa import api
from pallas_fa import manual_axes
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import vjp

Array = Any
_F32 = jnp.float32


def axis_size(axis_name) -> int:
  """The number of devices along mesh axis `axis_name` (inside shard_map)."""
  if hasattr(jax.lax, "axis_size"):
    return jax.lax.axis_size(axis_name)
  return jax.lax.psum(1, axis_name)




def _rotate(tree, axis_name, size):
  """Sends every leaf to the next device of the ring (r -> r + 1)."""
  perm = [(i, (i + 1) % size) for i in range(size)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


def _kv_columns(x, src, s_local):
  """Columns of the dense bias/mask [..., S] that belong to kv shard src."""
  if x is None or x.shape[3] == 1:
    return x
  return jax.lax.dynamic_slice_in_dim(x, src * s_local, s_local, 3)


@dataclasses.dataclass(frozen=True)
class _RingIndices:
  """A score_mod / mask_mod as one ring step calls it: the local query and
  key indices arrive mapped to global token indices, from the query's and
  the visiting key's shards, which are the function's last two arguments
  (traced data, not closures). Frozen and compared by value, so the steps
  share one trace.

  Shards hold consecutive tokens, or with `zigzag` the chunks r and
  2P - 1 - r of 2P (`parallel.zigzag`).
  """

  fn: Any
  score: bool  # Whether fn takes a score first (a score_mod).
  q_len: int  # Local T.
  kv_len: int  # Local S.
  ring_size: int
  zigzag: bool

  def _global(self, index, shard, length):
    if not self.zigzag:
      return shard * length + index
    half = length // 2
    return jnp.where(index < half, shard * half + index,
                     (2 * self.ring_size - 1 - shard) * half + index - half)

  def __call__(self, *xs):
    lead = int(self.score)
    *args, q_shard, kv_shard = xs[lead + 4:]
    batch, head, q_idx, kv_idx = xs[lead:lead + 4]
    return self.fn(*xs[:lead], batch, head,
                   self._global(q_idx, q_shard, self.q_len),
                   self._global(kv_idx, kv_shard, self.kv_len), *args)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where this device sits in the ring, for flex functions' indices."""

  me: Any
  size: int
  q_len: int
  kv_len: int
  zigzag: bool


def _step_inputs(bias, info, kv_pos, kv_seg, src, layout: _Layout):
  """Bias and MaskInfo of one ring step (the keys of shard `src`)."""
  s_local = layout.kv_len
  step_info = info.replace(
      kv_positions=kv_pos,
      kv_segment_ids=kv_seg,
      mask=_kv_columns(info.mask, src, s_local),
  )
  shards = (jnp.asarray(layout.me, jnp.int32), jnp.asarray(src, jnp.int32))
  for name in ("score_mod", "mask_mod"):
    fn = getattr(info, name)
    if fn is not None:
      step_info = step_info.replace(**{
          name: _RingIndices(fn, name == "score_mod", layout.q_len,
                             layout.kv_len, layout.size, layout.zigzag),
          f"{name}_args": getattr(info, f"{name}_args") + shards})
  return _kv_columns(bias, src, s_local), step_info


def step_is_empty(info: masking.MaskInfo):
  """Whether no query of this shard may see any key of this step, or None.

  Decided from the min/max of positions and segment ids over the whole shard
  (`classify_blocks` with one block per shard), so it is conservative.
  """
  if not (info.restricts_positions or info.has_segments
          or info.mask is not None):
    return None
  t = info.q_positions.shape[1]
  s = info.kv_positions.shape[1]
  kinds = masking.classify_blocks(info, t, s)  # [B, 1, 1]
  return jnp.all(kinds == masking.EMPTY)


def _cond(empty, skip, run, like):
  """run(), or skip() where the step is empty; inside a user's shard_map
  both typed to vary as `like` does (`manual_axes`)."""
  if empty is None:
    return run()
  return jax.lax.cond(empty, lambda: manual_axes.vary_like(skip(), like),
                      lambda: manual_axes.vary_like(run(), like))


def _step_forward(backend, params, q, k, v, bias, info, scales=None):
  """(out float32, lse) of q against one K/V shard (a float8 call's with
  its `scales`); skipped when empty."""
  b, t, n, _ = q.shape
  h = v.shape[-1]

  def run():
    kw = {} if scales is None else {"scales": scales}
    out, lse = backend.forward(q, k, v, bias, info, params, **kw)
    return out.astype(_F32), lse.astype(_F32)

  def skip():
    return (jnp.zeros((b, t, n, h), _F32),
            jnp.full((b, t, n), online_softmax.MASK_VALUE, _F32))

  return _cond(step_is_empty(info), skip, run, q)


def _step_backward(backend, params, q, k, v, bias, info, lse, dout, delta):
  """(dq, dk, dv, dbias, dscore_mod_args) of one step, in float32, from the
  final lse/delta (the last None without a score_mod; its entries None for
  integer arrays)."""
  score_args = info.score_mod_args if info.score_mod is not None else None

  def run():
    if backend.backward is not None:
      # p = exp(s - lse) with the *final* lse are this step's share of the
      # global probabilities, and delta is global too: the backend's own
      # backward gives exact gradients (ring FlashAttention-2 backward).
      grads = backend.backward(q, k, v, bias, info, params, lse, dout, delta)
    else:
      # Plain-autodiff backend: pull the step's share of the merged
      # cotangents back through its forward.
      def f(q, k, v, bias, args):
        step = info if args is None else info.replace(score_mod_args=args)
        return backend.forward(q, k, v, bias, step, params)

      (out_s, lse_s), pullback = jax.vjp(f, q, k, v, bias, score_args)
      grads = pullback(
          online_softmax.merge_grad(out_s, lse_s, lse, dout, delta))
    grads = tuple(grads) + (None,) * (5 - len(grads))
    if score_args is not None:  # Integer arrays (and shard ids): None.
      grads = grads[:4] + (tuple(
          None if not jnp.issubdtype(x.dtype, jnp.inexact) else g
          for g, x in zip(grads[4], score_args)),)
    return jax.tree.map(lambda g: g.astype(_F32), grads)

  def skip():
    zeros = lambda x: None if x is None else jnp.zeros(x.shape, _F32)
    dargs = None if score_args is None else tuple(
        zeros(x) if jnp.issubdtype(x.dtype, jnp.inexact) else None
        for x in score_args)
    return zeros(q), zeros(k), zeros(v), zeros(bias), dargs

  return _cond(step_is_empty(info), skip, run, q)


def _add_columns(acc, d, src, s_local):
  """acc[..., columns of shard src] += d (dense-bias gradient)."""
  if acc is None:
    return None
  if acc.shape[3] == 1:
    return acc + d
  start = src * s_local
  cur = jax.lax.dynamic_slice_in_dim(acc, start, s_local, 3)
  return jax.lax.dynamic_update_slice_in_dim(acc, cur + d, start, 3)


def _ring_forward(step_backend, axis_name, zigzag, q, k, v, bias, info,
                  params, scales=None):
  """The ring's (out, lse), merged over its steps in float32 (the forward
  of `_ring_backend`). A float8 call's key and value scales travel with
  their shard."""
  size = axis_size(axis_name)
  me = jax.lax.axis_index(axis_name)
  if q.dtype == jnp.float64:
    # The ring merges partial results in float32.
    raise NotImplementedError(
        "ring attention computes in float32; float64 query/key/value are "
        "not supported over a sequence axis.")
  b, t, n, _ = q.shape
  h = v.shape[-1]
  layout = _Layout(me, size, t, k.shape[1], zigzag)
  q_scale, k_scale, v_scale = (None,) * 3 if scales is None else scales

  def body(carry, step):
    out, lse, kv = carry
    # Issued before the compute it does not depend on, so the transfer of
    # the next shard overlaps this step (the last one is hidden the same
    # way and brings the shard home).
    kv_next = _rotate(kv, axis_name, size)
    k_s, v_s, kv_pos, kv_seg, k_scale_s, v_scale_s = kv
    src = (me - step) % size
    bias_s, info_s = _step_inputs(bias, info, kv_pos, kv_seg, src, layout)
    out_s, lse_s = _step_forward(
        step_backend, params, q, k_s, v_s, bias_s, info_s,
        None if scales is None else (q_scale, k_scale_s, v_scale_s))
    out, lse = online_softmax.merge(out, lse, out_s, lse_s)
    return (out, lse, kv_next), None

  carry = (
      jnp.zeros((b, t, n, h), _F32),
      jnp.full((b, t, n), online_softmax.MASK_VALUE, _F32),
      (k, v, info.kv_positions, info.kv_segment_ids, k_scale, v_scale),
  )
  (out, lse, _), _ = jax.lax.scan(
      body, manual_axes.vary_like(carry, q), jnp.arange(size))
  return out.astype(params.out_dtype or q.dtype), lse


def _ring_backward(step_backend, axis_name, zigzag, q, k, v, bias, info,
                   params, lse, dout, delta):
  """The ring's (dq, dk, dv, dbias[, score_mod_args' gradients]) from the
  final lse and delta (the backward of `_ring_backend`): a second trip
  around the ring, recomputing every step, dK/dV travelling with their
  shard."""
  size = axis_size(axis_name)
  me = jax.lax.axis_index(axis_name)
  s_local = k.shape[1]
  layout = _Layout(me, size, q.shape[1], s_local, zigzag)

  def body(carry, step):
    dq, dbias, dargs, kv, dkv = carry
    kv_next = _rotate(kv, axis_name, size)  # overlaps this step's compute
    k_s, v_s, kv_pos, kv_seg = kv
    src = (me - step) % size
    bias_s, info_s = _step_inputs(bias, info, kv_pos, kv_seg, src, layout)
    dq_s, dk_s, dv_s, dbias_s, dargs_s = _step_backward(
        step_backend, params, q, k_s, v_s, bias_s, info_s, lse, dout, delta
    )
    dk, dv = dkv
    # dK/dV travel with the K/V shard they belong to; after `size`
    # rotations they are back on its owner.
    dkv_next = _rotate((dk + dk_s, dv + dv_s), axis_name, size)
    dbias = _add_columns(dbias, dbias_s, src, s_local)
    if dargs is not None:  # The score_mod's arrays: summed over the steps.
      dargs = jax.tree.map(jnp.add, dargs, dargs_s[:len(dargs)])
    return (dq + dq_s, dbias, dargs, kv_next, dkv_next), None

  dargs = None
  if info.score_mod is not None:
    dargs = tuple(jnp.zeros(x.shape, _F32)
                  if jnp.issubdtype(x.dtype, jnp.inexact) else None
                  for x in info.score_mod_args)
  carry = (
      jnp.zeros(q.shape, _F32),
      None if bias is None else jnp.zeros(bias.shape, _F32),
      dargs,
      (k, v, info.kv_positions, info.kv_segment_ids),
      (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32)),
  )
  (dq, dbias, dargs, _, (dk, dv)), _ = jax.lax.scan(
      body, manual_axes.vary_like(carry, q), jnp.arange(size))
  if dbias is not None:
    dbias = dbias.astype(bias.dtype)
  grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias)
  if dargs is None:
    return grads
  # This device's share of the score_mod's array gradients (shard_map sums
  # the shares).
  return grads + (tuple(None if d is None else d.astype(x.dtype)
                        for d, x in zip(dargs, info.score_mod_args)),)


def _ring_backend(step_backend: vjp.Backend, axis_name,
                  zigzag: bool) -> vjp.Backend:
  """`step_backend` run around the ring as one backend, so that
  `vjp.attention` wires the ring's custom_vjp as it does a single
  device's: the sinks join once, after the last step, and their gradient
  is this device's rows' share; a float8 call's backward runs the ring on
  the dequantized inputs and turns their gradients into the scales'."""
  return vjp.Backend(
      name=f"{step_backend.name} (ring)",
      forward=functools.partial(_ring_forward, step_backend, axis_name,
                                zigzag),
      backward=functools.partial(_ring_backward, step_backend, axis_name,
                                 zigzag),
      check=step_backend.check, dtypes=step_backend.dtypes,
      value_head_dim=step_backend.value_head_dim,
      dropout=step_backend.dropout,
      symbolic_batch=step_backend.symbolic_batch,
      symbolic_lengths=step_backend.symbolic_lengths,
      why_not_differentiable=(
          "Ring attention merges its steps' partial results under a "
          "custom_vjp of its own; without a sequence axis, "
          "sharded_flash_attention on 'xla' or 'chunked' has them."))


def ring_local(implementation, params, axis_name, q, k, v, bias, info,
               sinks=None, zigzag=False, scales=None, straight_through=None):
  """Chooses the implementation for one ring step and runs the ring
  (`zigzag`: the shards hold the zig-zag layout's chunks, which flex
  functions' global indices follow; `scales`, `straight_through`: a float8
  call's, see `vjp.attention`)."""
  layout = _Layout(0, axis_size(axis_name), q.shape[1], k.shape[1], zigzag)
  # A shard's positions are a slice of the sequence's, not its indices.
  info = info.replace(positions_are_indices=False)
  bias_0, info_0 = _step_inputs(
      bias, info, info.kv_positions, info.kv_segment_ids, 0, layout
  )
  backend = api.choose_backend(implementation, api.Call(
      q=q, k=k, v=v, bias=bias_0, info=info_0, params=params,
      batch_shape=q.shape[:1]))
  return vjp.attention(_ring_backend(backend, axis_name, bool(zigzag)),
                       params, q, k, v, bias, info, sinks, scales=scales,
                       straight_through=straight_through)


def ring_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    *,
    axis_name: str,
    scale: float | None = None,
    is_causal: bool = False,
    local_window_size: int | Sequence[int | None] | None = None,
    segment_ids: masking.SegmentIds | None = None,
    query_positions: Array | None = None,
    key_positions: Array | None = None,
    logits_soft_cap: float | None = None,
    sinks: Array | None = None,
    implementation: str | None = None,
    block_sizes: Any = None,
    precision: str | jax.lax.Precision | None = None,
    deterministic_backward: bool | None = None,
    return_residual: bool = False,
    score_mod: Any = None,
    score_mod_args: Sequence[Array] = (),
    mask_mod: Any = None,
    mask_mod_args: Sequence[Array] = (),
    query_scale: Array | None = None,
    key_scale: Array | None = None,
    value_scale: Array | None = None,
    quantize: str | None = None,
    out_dtype: Any = None,
):
  """Ring attention over mesh axis `axis_name`, called inside `shard_map`.

  Every argument is this device's shard along the sequence: query [B, T, N,
  H] and key/value [B, S, K, H] hold T and S consecutive rows of the (caller-
  ordered) sequence; positions and segment ids are the shards' own rows. The
  result equals `pallas_fa.flash_attention` on the concatenated shards, for
  every mask argument and every implementation. Use `sharded_flash_attention`
  to start from global arrays.

  Args:
    query: local query shard [B, T, N, H].
    key: local key shard [B, S, K, H].
    value: local value shard, like key.
    bias: float [B|1, N|1, T|1, S_total|1]: this device's query rows against
      *all* keys (in ring order, shard p at columns [p*S, (p+1)*S)).
    mask: bool, shaped like bias; True = may attend.
    axis_name: the mesh axis (of the enclosing shard_map) forming the ring.
    scale: see `pallas_fa.flash_attention`.
    is_causal: see `pallas_fa.flash_attention` (measured on positions).
    local_window_size: see `pallas_fa.flash_attention`.
    segment_ids: local `SegmentIds(q=[B, T], kv=[B, S])`. Padding is
      expressed here (`masking.padding_segments` folds lengths in), since a
      shard cannot interpret global lengths.
    query_positions: int [B, T] true positions of the local queries; default
      `axis_index * T + arange(T)` (contiguous shards).
    key_positions: int [B, S], default `axis_index * S + arange(S)`.
    logits_soft_cap: see `pallas_fa.flash_attention`.
    sinks: float [N] (or [1]), the local query heads' sinks, the same on
      every device of the ring (see `pallas_fa.flash_attention`); each
      row's sink joins once, after the last ring step. Its gradient is
      this device's share: replicate it into the `shard_map` (whose
      transpose sums the shares).
    implementation: see `pallas_fa.flash_attention`.
    block_sizes: see `pallas_fa.flash_attention`.
    precision: see `pallas_fa.flash_attention` (None follows
      `jax.default_matmul_precision` where this is traced).
    deterministic_backward: see `pallas_fa.flash_attention` (None follows
      `XLA_FLAGS` where this is traced); every ring step's backward.
    return_residual: also return the local logsumexp [B, T, N].
    score_mod, score_mod_args, mask_mod, mask_mod_args: flex attention (see
      `pallas_fa.flash_attention`): q_idx and kv_idx are global token
      indices (shard r holds tokens [r * T, (r + 1) * T) of the caller's
      order), batch and head this device's own; pass the arrays whole
      (their gradients are this device's share, as for sinks).
    query_scale, key_scale, value_scale, quantize, out_dtype: a float8
      call, see `pallas_fa.flash_attention`: the local shards' scales (the
      key's and value's travel with their shard); `quantize` quantizes
      each device's shards on their own (scales from the shard's values).

  Returns:
    The local output shard [B, T, N, Hv] (typed like query, or a float8
    call's `out_dtype`), or (out, lse) with return_residual.

  Raises:
    ValueError / TypeError: invalid arguments (the message names them).
    NotImplementedError: the named implementation cannot honour this call.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  query, query_scale, scale = api.fold_traced_scale(query, query_scale, scale)
  if query.ndim != 4 or key.ndim != 4:
    raise ValueError(
        f"ring_attention takes batched [B, T, N, H] shards, got "
        f"{query.shape=}, {key.shape=}."
    )
  try:
    size = axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"ring_attention runs inside shard_map over a mesh with {axis_name=}"
        f": {e}"
    ) from e
  api.check_flag("return_residual", return_residual)
  me = jax.lax.axis_index(axis_name)
  b, t, n, _ = query.shape
  s = key.shape[1]
  if query_positions is None:
    query_positions = jnp.broadcast_to(
        me * t + jnp.arange(t, dtype=jnp.int32), (b, t))
  if key_positions is None:
    key_positions = jnp.broadcast_to(
        me * s + jnp.arange(s, dtype=jnp.int32), (b, s))
  call = api.canonicalize(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      local_window_size=local_window_size, segment_ids=segment_ids,
      query_positions=query_positions, key_positions=key_positions,
      logits_soft_cap=logits_soft_cap, block_sizes=block_sizes,
      precision=precision, deterministic_backward=deterministic_backward,
      bias_key_length=s * size, sinks=sinks, score_mod=score_mod,
      score_mod_args=score_mod_args, mask_mod=mask_mod,
      mask_mod_args=mask_mod_args, query_scale=query_scale,
      key_scale=key_scale, value_scale=value_scale, quantize=quantize,
      out_dtype=out_dtype, float8=True,
  )
  q, k, v, bias, info, params = call.arrays

  # Under jit, as `flash_attention` runs: called eagerly inside a user's
  # shard_map, a float8 call's custom_vjp (symbolic zeros) has no eager
  # rule there.
  @jax.jit
  def ring(q, k, v, bias, info, sinks, scales, straight_through):
    return ring_local(implementation, params, axis_name, q, k, v, bias, info,
                      sinks, scales=scales, straight_through=straight_through)

  out, lse = ring(q, k, v, bias, info, call.sinks, call.scales,
                  call.straight_through)
  return (out, lse) if return_residual else out
