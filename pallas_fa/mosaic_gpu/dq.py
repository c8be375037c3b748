"""The dQ Mosaic GPU kernel of `mosaic_gpu` (Hopper).

Q-stationary, on the producer/consumer skeleton of `kernel`: each
consumer keeps its query and dO tiles in shared memory while the producer
streams K and V; it recomputes P from the logsumexp and accumulates
dQ = dS K in registers. No atomics: each dQ tile has exactly one owner.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa import online_softmax
from pallas_fa.mosaic_gpu import kernel
from pallas_fa.mosaic_gpu import ops as gpu_ops

_F32 = jnp.float32
_ROWS = online_softmax.queries_along(0)


def backward_dq(spec: kernel.Spec, q, k, v, do, lse2, delta, q_pos, q_seg,
                kv_pos, kv_seg, sched, seed=None, residuals=()):
  """The dQ kernel (Q-stationary; no atomics).

  Args:
    spec: launch parameters (`consumers` tiles of block_q rows per unit).
    q: [B, Tp, N, Hp].
    k: [B, Sp, K, Hp].
    v: [B, Sp, K, Hvp] (Hvp: the padded value head dim).
    do: [B, Tp, N, Hvp]; padded rows zeroed.
    lse2: float32 [B, N, Tp] from `kernel.lse_for_kernel`.
    delta: float32 [B, N, Tp].
    q_pos: int32 [B, Tp].
    q_seg: int32 [B, Tp].
    kv_pos: int32 [B, Sp].
    kv_seg: int32 [B, Sp].
    sched: int32 [B, Tp / (consumers block_q), 2 + 2 consumers].
    seed: uint32 [1] dropout seed, or None (spec.dropout_rate == 0).
    residuals: the score_mod's, then the mask_mod's per-(batch, head) values
      (`Spec.score_mod`, `Spec.mask_mod`).

  Returns:
    dq [B, Tp, N, Hp] in q.dtype, then for each differentiable residual of
    the score_mod its cotangent summed over the keys, float32 [B, N, Tp].
  """
  ops = kernel.ops_for(spec)
  bq, h, stages = spec.block_q, spec.head_dim, spec.stages
  nc = spec.consumers
  units = kernel.q_units(spec, table=False)  # `kernel.Units`
  num_d = 0 if spec.score_mod is None else sum(
      res.differentiable for res in spec.score_mod.residuals)

  def unit(r: kernel.Refs, t, base):
    (q_ref, _, _, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, _, _,
     sched_ref) = r.inputs
    dq_ref, *dmod_refs = r.outputs
    (q_smem, do_smem, lse_smem, delta_smem, qmeta_smem, *dmod_smem, k_smem,
     v_smem, kmeta_smem) = r.smem
    q_bar, k_bar, v_bar, k_free, v_free = r.barriers
    wg = r.wg
    q_own, do_own = q_smem.at[wg], do_smem.at[wg]  # Q, then dQ.

    b, n, row = r.units.decode(r.cta, t)
    ulo = sched_ref[b, row, 0]
    row0 = (row * nc + wg) * bq
    rows = pl.ds(row0, bq)
    kernel.load_stationary(
        [(q_ref.at[b, rows, n], q_own),
         (do_ref.at[b, rows, n], do_own),
         (lse_ref.at[b, n, rows], lse_smem.at[wg]),
         (delta_ref.at[b, n, rows], delta_smem.at[wg]),
         *kernel.meta_copies(spec, (qpos_ref, qseg_ref),
                             kernel.meta_at(spec, qmeta_smem, wg), b, rows)],
        q_bar.at[wg])
    lse2 = ops.load_vector(lse_smem.at[wg], 0)
    delta = ops.load_vector(delta_smem.at[wg], 0)
    q_p, q_s = kernel.load_meta(
        spec, ops, *kernel.meta_at(spec, qmeta_smem, wg), 0, first=row0,
        size=bq)

    def step(j, carry, *, masked):
      dq, dmod = carry
      slot = kernel.rem(base + j - ulo, stages)
      plgpu.barrier_wait(k_bar.at[slot])
      plgpu.barrier_wait(v_bar.at[slot])
      w = kernel.stationary_in_step(spec, wg)
      qk, dp = ops.mm_pair(  # [bq, bk] each
          dict(a=q_smem.at[w], b=k_smem.at[slot], transpose_b=True),
          dict(a=do_smem.at[w], b=v_smem.at[slot], transpose_b=True))
      plgpu.barrier_arrive(v_free.at[slot])
      if spec.dropout_rate:  # dP of the dropped probabilities.
        dp = kernel.apply_dropout(
            spec, ops, dp, r.seed, batch=b, head=n, q_start=row0,
            kv_start=j * spec.block_kv, q_axis=0)
      s, capped, score_mod_pullback = kernel.flex_logits(
          spec, ops, qk, r, batch=b, head=n, q0=row0,
          kv0=j * spec.block_kv, q_axis=0, grad=True)
      if masked:
        k_p, k_s = kernel.load_meta(
            spec, ops, *kernel.meta_at(spec, kmeta_smem, slot), 1,
            first=j * spec.block_kv, size=spec.block_kv)
        mod = kernel.index_mask_tile(
            spec, ops, r, s.shape, (q_p, q_s), (k_p, k_s), batch=b,
            head=n, q0=row0, kv0=j * spec.block_kv, q_axis=0)
        s = kernel.apply_mask(spec, s, 0, q_p, q_s, k_p, k_s, mod)
      p = online_softmax.probs(s, lse2, base2=True, per_query=_ROWS)
      ds = online_softmax.softmax_grad(p, dp, delta, per_query=_ROWS)
      if score_mod_pullback is not None:
        # dS before the score_mod; per query, its values' cotangents.
        ds, d = score_mod_pullback(ds)
        dmod = tuple(a + x for a, x in zip(dmod, d))
      ds = kernel.logits_grad(spec, ds, capped)
      dq = ops.mm(
          ds.astype(spec.dtype), k_smem.at[slot], a_in_smem=False, acc=dq)
      plgpu.barrier_arrive(k_free.at[slot])
      return dq, dmod

    dmod = tuple(ops.full_vector(bq, 0.0, 0) for _ in range(num_d))
    dq, dmod = kernel.phases(
        sched_ref, b, row, wg, step, (ops.full((bq, h), 0.0), dmod),
        spec.masked)
    q_own[...] = kernel.scale_grad(spec, dq).astype(spec.dtype)
    for x, ref in zip(dmod, dmod_smem):
      ref.at[wg][...] = x
    kernel.store([(q_own, dq_ref.at[b, rows, n]),
                  *((ref.at[wg], out.at[b, n, rows])
                    for ref, out in zip(dmod_smem, dmod_refs))])
    return base + sched_ref[b, row, 1] - ulo

  smem = (
      ops.smem((nc, bq, h), spec.dtype, True),  # Q, then dQ.
      ops.smem((nc, bq, spec.hv), spec.dtype, True),  # dO
      plgpu.SMEM((nc, bq), _F32),  # lse (base 2)
      plgpu.SMEM((nc, bq), _F32),  # delta
      kernel.meta_smem(spec, (nc, bq)),  # query positions / segment ids
      *(plgpu.SMEM((nc, bq), _F32) for _ in range(num_d)),  # score_mod
      *kernel.kv_rings(spec, ops),  # Last: `kv_producer` reads them there.
  )
  barriers = (
      # Q, dO, lse, delta (+ metadata) loaded, per consumer.
      gpu_ops.barrier(nc, 4 + spec.num_meta),
      *kernel.kv_barriers(spec),
  )
  return kernel.launch(
      spec, name="pfa_mgpu_dq", units=units, reps=1,
      operands=(q, k, v, do, lse2, delta, q_pos, q_seg, kv_pos, kv_seg,
                sched),
      out_types=(jax.ShapeDtypeStruct(q.shape, spec.dtype),) + (
          jax.ShapeDtypeStruct(lse2.shape, _F32),) * num_d,
      smem_types=smem, barrier_types=barriers, unit=unit,
      producer_groups=kernel.kv_producer(spec), seed=seed,
      residuals=residuals)
