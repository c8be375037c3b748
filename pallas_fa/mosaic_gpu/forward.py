"""The forward Mosaic GPU kernel of `mosaic_gpu` (Hopper).

Q-stationary, on the producer/consumer skeleton of `kernel`: each
consumer keeps a [block_q, H] query tile in shared memory while the producer
streams K (+ key positions / segment ids) and V through the ring; the online
softmax runs in registers in base 2. Two consumers ping-pong through a shared
barrier so that the softmax of one overlaps the matmuls of the other
(FlashAttention-3, §3.2). With `Spec.intra_overlap` each consumer's key loop
is also software-pipelined (FlashAttention-3, §3.2, Algorithm 2): step j
issues Q K_j^T and P_{j-1} V_{j-1} together and runs the softmax of tile j
while P_{j-1} V_{j-1} is still on the tensor cores (`walk_keys_overlapped`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa import online_softmax
from pallas_fa.mosaic_gpu import exp2
from pallas_fa.mosaic_gpu import kernel
from pallas_fa.mosaic_gpu import ops as gpu_ops

_F32 = jnp.float32
_ROWS = online_softmax.queries_along(0)


def tile_exp(spec: kernel.Spec):
  """The logit tiles' exponentials for `online_softmax.update`: partly on
  the FMA pipe with `Spec.poly_exp2` (`exp2.split_exp2`), else None
  (jnp's, MUFU.EX2)."""
  if not spec.poly_exp2:
    return None
  return online_softmax.shifted_exp(functools.partial(
      exp2.split_exp2, every=spec.poly_exp2, interpret=spec.interpret))


def take_turn(schedule):
  """One ping-pong turn: hand the tensor cores to the other consumer and
  wait until they are ours again."""
  plgpu.barrier_arrive(schedule)
  plgpu.barrier_wait(schedule)


def key_tile_products(spec: kernel.Spec, ops, q_smem, wg, k_ready, k_tile,
                      kmeta, kv0, masked: bool, schedule):
  """Q K^T of one key tile once it has landed, float32 [block_q, block_kv]
  (a ping-pong turn taken while the wgmma runs), and with `masked` the
  positions and segment ids of the tile's keys, the first kv0 (else None,
  None)."""
  plgpu.barrier_wait(k_ready)
  qk = ops.mm(
      q_smem.at[kernel.stationary_in_step(spec, wg)], k_tile,
      transpose_b=True,
      between=(lambda: take_turn(schedule)) if spec.pingpong else None)
  if not masked:
    return qk, None, None
  return (qk, *kernel.load_meta(spec, ops, *kmeta, 1, first=kv0,
                                size=spec.block_kv))


def await_values(spec: kernel.Spec, v_ready, schedule):
  """Waits for a V tile after the softmax; with ping-pong, first lets the
  other consumer's matmuls run, and waits for the tensor cores to be ours
  again."""
  if spec.pingpong:
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(v_ready)
    plgpu.barrier_wait(schedule)
  else:
    plgpu.barrier_wait(v_ready)


def walk_keys(spec: kernel.Spec, ops, sched_ref, b, row, wg, step,
              schedule, offset: float = 0.0, alternate=None):
  """A consumer's walk over its key tiles (`kernel.phases` of `step` from
  a fresh online softmax), inside the ping-pong's first and last turns:
  (out float32 [block_q, Hv], lse [block_q], base 2 undone; `offset`:
  the softmax's, `online_softmax.finalize`). `alternate`: None, or
  (other_step, use_other), an int32 scalar 0 or 1 that picks which of the
  two steps walks the unit's keys."""
  bq = spec.block_q
  carry = (
      ops.full_vector(bq, online_softmax.MASK_VALUE, 0),
      ops.full_vector(bq, 0.0, 0),
      ops.full((bq, spec.hv), 0.0),
  )
  if spec.pingpong:
    pl.when(wg == 1)(lambda: take_turn(schedule))
  if alternate is None:
    m_i, l_i, acc = kernel.phases(
        sched_ref, b, row, wg, step, carry, spec.masked)
  else:
    other, use_other = alternate
    carry = kernel.phases(sched_ref, b, row, wg, step, carry, spec.masked,
                          gate=1 - use_other)
    m_i, l_i, acc = kernel.phases(sched_ref, b, row, wg, other, carry,
                                  spec.masked, gate=use_other)
  if spec.pingpong:
    pl.when(wg == 0)(lambda: take_turn(schedule))
  return online_softmax.finalize(m_i, l_i, acc, base2=True, per_query=_ROWS,
                                 offset=offset)


def take_turn_before(spec: kernel.Spec, ready, schedule):
  """Waits for a step's tiles (`ready`: the loaded barriers); with
  ping-pong, arriving at the schedule first, and then waiting until the
  tensor cores are ours."""
  if spec.pingpong:
    plgpu.barrier_arrive(schedule)
  for bar in ready:
    plgpu.barrier_wait(bar)
  if spec.pingpong:
    plgpu.barrier_wait(schedule)


def _clamped(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def walk_keys_overlapped(spec: kernel.Spec, ops, sched_ref, b, row, wg,
                         first, step, last, schedule, p0=None,
                         offset: float = 0.0):
  """`walk_keys` of the software-pipelined loop (`Spec.intra_overlap`).

  Over the unit's key tiles [ulo, uhi): `first` (Q K^T of tile ulo and its
  softmax), `step` over ulo + 1 .. uhi - 1 in `kernel.phases`' masked /
  unmasked / masked runs (Q K_j^T with P_{j-1} V_{j-1}, then the softmax of
  tile j), `last` (P V of tile uhi - 1). `first` and `last` are loops of
  zero or one trip, so that a unit without key tiles runs neither. The
  first tile is softmaxed masked whenever the call masks at all (masking a
  full tile changes nothing). The carry is (m_i, l_i, acc, p): p, the
  probabilities of the last tile softmaxed as P V takes them; `p0`, its
  initial value (None: zeros in spec.dtype in the accumulator layout).
  `offset`: as in `walk_keys`.

  Returns:
    (out float32 [block_q, Hv], lse [block_q], base 2 undone).
  """
  bq = spec.block_q
  carry = (
      ops.full_vector(bq, online_softmax.MASK_VALUE, 0),
      ops.full_vector(bq, 0.0, 0),
      ops.full((bq, spec.hv), 0.0),
      ops.full((bq, spec.block_kv), 0.0, spec.dtype) if p0 is None else p0,
  )
  if spec.pingpong:
    pl.when(wg == 1)(lambda: take_turn(schedule))
  ulo = sched_ref[b, row, 0]
  uhi = sched_ref[b, row, 1]
  some = (uhi > ulo).astype(ulo.dtype)
  carry = lax.fori_loop(
      ulo, ulo + some, functools.partial(first, masked=spec.masked), carry)
  start = ulo + 1
  end = jnp.maximum(uhi, start)
  if spec.masked:
    flo = _clamped(sched_ref[b, row, 2 + 2 * wg], start, end)
    fhi = _clamped(sched_ref[b, row, 3 + 2 * wg], flo, end)
    runs = ((start, flo, True), (flo, fhi, False), (fhi, end, True))
  else:
    runs = ((start, end, False),)
  for lo, hi, masked in runs:
    carry = lax.fori_loop(
        lo, hi, functools.partial(step, masked=masked), carry)
  carry = lax.fori_loop(uhi - some, uhi, last, carry)
  if spec.pingpong:
    pl.when(wg == 0)(lambda: take_turn(schedule))
  m_i, l_i, acc, _ = carry
  return online_softmax.finalize(m_i, l_i, acc, base2=True, per_query=_ROWS,
                                 offset=offset)


def pipelined_steps(spec: kernel.Spec, ops, *, slot_of, q_tile, k_tile,
                    v_operand, probs, ready, last_ready, v_free, schedule,
                    pin, settle=None):
  """(first, overlapped, last) of `walk_keys_overlapped` for a Q-stationary
  forward. Every tensor-core turn (Q K^T of the first tile; Q K_j^T with
  P_{j-1} V_{j-1}; P V of the last tile) is bracketed by two ping-pong
  rendezvous, as the two turns of a plain step.

  Args:
    slot_of: key tile j -> its ring slot.
    q_tile: () -> the consumer's Q tile ref (built inside each step).
    k_tile: slot -> the K tile ref.
    v_operand: slot -> the `mm` keywords of the V side of P V (`b`, and
      `transpose_b` for a transposed V).
    probs: (j, slot, qk, m_i, l_i, *, masked) -> (m_i, l_i, p, alpha): the
      softmax of tile j from its Q K^T, P as P V's A operand; releases the
      K slot.
    ready: (slot, prev) -> the barriers a step waits for (prev: the
      previous tile's slot, None for the first tile).
    last_ready: slot -> those the last P V waits for.
    v_free: the V slots' release barriers.
    schedule: the ping-pong barrier.
    pin: `Ops.mm_overlapped`'s.
    settle: p -> p after each overlapped step (compiled float8: registers
      of its own, `forward_fp8.own_registers`), or None.
  """
  between = (lambda: take_turn(schedule)) if spec.pingpong else None

  def first(j, carry, *, masked):
    m_i, l_i, acc, _ = carry
    slot = slot_of(j)
    take_turn_before(spec, ready(slot, None), schedule)
    qk = ops.mm(q_tile(), k_tile(slot), transpose_b=True, between=between)
    # acc is zero: no rescale.
    m_i, l_i, p, _ = probs(j, slot, qk, m_i, l_i, masked=masked)
    return m_i, l_i, acc, p

  def overlapped(j, carry, *, masked):
    m_i, l_i, acc, p = carry
    slot, prev = slot_of(j), slot_of(j - 1)
    take_turn_before(spec, ready(slot, prev), schedule)
    acc, (m_i, l_i, p, alpha) = ops.mm_overlapped(
        dict(a=q_tile(), b=k_tile(slot), transpose_b=True),
        dict(a=p, a_in_smem=False, acc=acc, **v_operand(prev)),
        # p and alpha are state for their shape only: overwritten.
        then=lambda qk, m_i, l_i, _, __: probs(
            j, slot, qk, m_i, l_i, masked=masked),
        state=(m_i, l_i, p, m_i), between=between, pin=pin)
    plgpu.barrier_arrive(v_free.at[prev])
    if settle is not None:
      p = settle(p)
    acc = online_softmax.rescale(acc, alpha, per_query=_ROWS)
    return m_i, l_i, acc, p

  def last(j, carry):
    m_i, l_i, acc, p = carry
    slot = slot_of(j)
    take_turn_before(spec, last_ready(slot), schedule)
    acc = ops.mm(p, a_in_smem=False, acc=acc, between=between,
                 **v_operand(slot))
    plgpu.barrier_arrive(v_free.at[slot])
    return m_i, l_i, acc, p

  return first, overlapped, last


def forward(spec: kernel.Spec, q, k, v, q_pos, q_seg, kv_pos, kv_seg, sched,
            seed=None, residuals=()):
  """The forward kernel.

  Args:
    spec: launch parameters (two consumers; block_q rows each).
    q: [B, Tp, N, Hp]; padded rows zeroed.
    k: [B, Sp, K, Hp]; padded rows zeroed.
    v: [B, Sp, K, Hvp]; padded rows zeroed.
    q_pos: int32 [B, Tp].
    q_seg: int32 [B, Tp] (ignored without segments).
    kv_pos: int32 [B, Sp].
    kv_seg: int32 [B, Sp] (ignored without segments).
    sched: int32 [B, Tp / (2 block_q), 6], see `kernel.produce` and
      `kernel.phases`.
    seed: uint32 [1] dropout seed, or None (spec.dropout_rate == 0).
    residuals: the score_mod's, then the mask_mod's per-(batch, head) values
      (`Spec.score_mod`, `Spec.mask_mod`).

  Returns:
    (out [B, Tp, N, Hvp] in q.dtype, lse float32 [B, N, Tp], natural log).
  """
  ops = kernel.ops_for(spec)
  bq, h, hv, stages = spec.block_q, spec.head_dim, spec.hv, spec.stages
  nc = spec.consumers
  # The output reuses Q's buffer when the two have one head dim.
  own_out = hv != h
  units = kernel.q_units(spec, table=True)

  def unit(r: kernel.Refs, t, base):
    q_ref, _, _, qpos_ref, qseg_ref, _, _, sched_ref = r.inputs
    o_ref, lse_ref = r.outputs
    (qo_smem, lse_smem, qmeta_smem, *o_smem, k_smem, v_smem,
     kmeta_smem) = r.smem
    q_bar, k_bar, v_bar, k_free, v_free, schedule = r.barriers
    wg = r.wg
    qo = qo_smem.at[wg]  # Q, then (with one head dim) the output.
    o_own = o_smem[0].at[wg] if own_out else qo

    b, n, row = r.units.decode(r.cta, t)
    ulo = sched_ref[b, row, 0]
    row0 = (row * nc + wg) * bq
    rows = pl.ds(row0, bq)
    kernel.load_stationary(
        [(q_ref.at[b, rows, n], qo),
         *kernel.meta_copies(spec, (qpos_ref, qseg_ref),
                             kernel.meta_at(spec, qmeta_smem, wg), b, rows)],
        q_bar.at[wg])
    q_p, q_s = kernel.load_meta(
        spec, ops, *kernel.meta_at(spec, qmeta_smem, wg), 0, first=row0,
        size=bq)

    # The logit scale in the exponent (no multiply for the max's sake).
    scale = online_softmax.exponent_scale(
        spec.scale, cap=spec.soft_cap,
        has_score_mod=spec.score_mod is not None)

    def probs(j, qk, k_p, k_s, m_i, l_i, acc, *, masked):
      """The softmax of key tile j: (m_i, l_i, p in spec.dtype, acc
      rescaled (None: not given), alpha)."""
      if scale is None:
        s, _, _ = kernel.flex_logits(
            spec, ops, qk, r, batch=b, head=n, q0=row0,
            kv0=j * spec.block_kv, q_axis=0)
      else:  # The products, scaled in the exponent's FMA.
        s = qk
      if masked:
        mod = kernel.index_mask_tile(
            spec, ops, r, s.shape, (q_p, q_s), (k_p, k_s), batch=b,
            head=n, q0=row0, kv0=j * spec.block_kv, q_axis=0)
        s = kernel.apply_mask(spec, s, 0, q_p, q_s, k_p, k_s, mod)
      m_i, l_i, p, alpha = online_softmax.update(
          m_i, l_i, s, base2=True, per_query=_ROWS, tile_exp=tile_exp(spec),
          scale=scale)
      if acc is not None:
        acc = online_softmax.rescale(acc, alpha, per_query=_ROWS)
      if spec.dropout_rate:  # After the running sums: they are undropped.
        p = kernel.apply_dropout(
            spec, ops, p, r.seed, batch=b, head=n, q_start=row0,
            kv_start=j * spec.block_kv, q_axis=0)
      return m_i, l_i, p.astype(spec.dtype), acc, alpha

    def step(j, carry, *, masked):
      m_i, l_i, acc = carry
      slot = kernel.rem(base + j - ulo, stages)
      qk, k_p, k_s = key_tile_products(
          spec, ops, qo_smem, wg, k_bar.at[slot], k_smem.at[slot],
          kernel.meta_at(spec, kmeta_smem, slot), j * spec.block_kv, masked,
          schedule)
      plgpu.barrier_arrive(k_free.at[slot])
      m_i, l_i, p, acc, _ = probs(
          j, qk, k_p, k_s, m_i, l_i, acc, masked=masked)
      await_values(spec, v_bar.at[slot], schedule)
      acc = ops.mm(p, v_smem.at[slot], a_in_smem=False, acc=acc)
      plgpu.barrier_arrive(v_free.at[slot])
      return m_i, l_i, acc

    def softmax_k(j, slot, qk, m_i, l_i, *, masked):
      """The softmax of key tile j once Q K_j^T is in: reads the tile's
      key metadata, releases its K slot."""
      k_p = k_s = None
      if masked:
        k_p, k_s = kernel.load_meta(
            spec, ops, *kernel.meta_at(spec, kmeta_smem, slot), 1,
            first=j * spec.block_kv, size=spec.block_kv)
      plgpu.barrier_arrive(k_free.at[slot])
      m_i, l_i, p, _, alpha = probs(
          j, qk, k_p, k_s, m_i, l_i, None, masked=masked)
      return m_i, l_i, p, alpha

    if spec.intra_overlap:
      out, lse = walk_keys_overlapped(
          spec, ops, sched_ref, b, row, wg, *pipelined_steps(
              spec, ops,
              slot_of=lambda j: kernel.rem(base + j - ulo, stages),
              q_tile=lambda: qo_smem.at[kernel.stationary_in_step(spec, wg)],
              k_tile=lambda slot: k_smem.at[slot],
              v_operand=lambda slot: dict(b=v_smem.at[slot]),
              probs=softmax_k,
              ready=lambda slot, prev: [k_bar.at[slot]] + (
                  [] if prev is None else [v_bar.at[prev]]),
              last_ready=lambda slot: [v_bar.at[slot]], v_free=v_free,
              schedule=schedule, pin=(lse_smem.at[wg], 1)),
          schedule)
    else:
      out, lse = walk_keys(spec, ops, sched_ref, b, row, wg, step, schedule)
    o_own[...] = out.astype(spec.dtype)
    lse_smem.at[wg][...] = lse
    kernel.store([(o_own, o_ref.at[b, rows, n]),
                  (lse_smem.at[wg], lse_ref.at[b, n, rows])])
    return base + sched_ref[b, row, 1] - ulo

  smem = (
      ops.smem((nc, bq, h), spec.dtype, True),  # Q, then the output.
      plgpu.SMEM((nc, bq), _F32),  # lse
      kernel.meta_smem(spec, (nc, bq)),  # query positions / segment ids
      *([ops.smem((nc, bq, hv), spec.dtype, True)] if own_out else []),
      *kernel.kv_rings(spec, ops),  # Last: `kv_producer` reads them there.
  )
  barriers = (
      gpu_ops.barrier(nc, 1 + spec.num_meta),  # Q (+ metadata), per consumer.
      *kernel.kv_barriers(spec),
      gpu_ops.barrier(1, nc),  # ping-pong schedule.
  )
  out_types = (
      jax.ShapeDtypeStruct(q.shape[:-1] + (hv,), spec.dtype),
      jax.ShapeDtypeStruct((spec.batch, spec.num_heads, spec.q_len), _F32),
  )
  return kernel.launch(
      spec, name="pfa_mgpu_forward", units=units, reps=1,
      operands=(q, k, v, q_pos, q_seg, kv_pos, kv_seg, sched),
      out_types=out_types, smem_types=smem, barrier_types=barriers,
      unit=unit, producer_groups=kernel.kv_producer(spec), seed=seed,
      residuals=residuals, cross_warp_reductions=False)
