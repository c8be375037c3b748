"""The dK/dV Mosaic GPU kernel of `mosaic_gpu` (Hopper).

KV-stationary, on the producer/consumer skeleton of `kernel`:
each consumer keeps a [block_kv, H] tile of K and V in shared memory while
the producer streams Q, dO, logsumexp and delta for every query head of the
GQA group, so dK and dV come out summed over the group inside the kernel. It
works in the transposed orientation (S^T = K Q^T) so that P^T and dS^T are
register operands of the dV and dK wgmmas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa import online_softmax
from pallas_fa.mosaic_gpu import kernel
from pallas_fa.mosaic_gpu import ops as gpu_ops

_F32 = jnp.float32
_I32 = jnp.int32
# Tiles are [keys, queries]: per-query vectors run along axis 1.
_COLUMNS = online_softmax.queries_along(1)


def backward_dkv(spec: kernel.Spec, q, k, v, do, lse2, delta, q_pos, q_seg,
                 kv_pos, kv_seg, sched, seed=None, residuals=(), *,
                 outputs=("dk", "dv")):
  """The dK/dV kernel (KV-stationary; GQA group summed inside).

  Works on S^T = K Q^T so that P^T and dS^T are register operands of the
  dV += P^T dO and dK += dS^T Q wgmmas. With `outputs` = ("dv",) or ("dk",)
  only one accumulator is kept (for head dims whose two float32 accumulators
  would not fit the register file); the caller then runs the kernel twice.

  Args:
    spec: launch parameters (`consumers` tiles of block_kv keys per unit).
    q, k, v, do, lse2, delta, q_pos, q_seg, kv_pos, kv_seg: as for
      `dq.backward_dq`.
    sched: int32 [B, Sp / (consumers block_kv), 2 + 2 consumers]; ranges of
      query tiles.
    seed: uint32 [1] dropout seed, or None (spec.dropout_rate == 0).
    residuals: the score_mod's, then the mask_mod's per-(batch, head) values
      (`Spec.score_mod`, `Spec.mask_mod`).
    outputs: which of "dk", "dv" to compute.

  Returns:
    A tuple with the requested of dk [B, Sp, K, Hp] and dv [B, Sp, K, Hvp]
    (Hvp: the padded value head dim), in k.dtype.
  """
  ops = kernel.ops_for(spec)
  bq, bk, h, stages = spec.block_q, spec.block_kv, spec.head_dim, spec.stages
  nc, g = spec.consumers, spec.group
  want_dk, want_dv = "dk" in outputs, "dv" in outputs
  units = kernel.Units(
      spec.batch, spec.num_kv_heads, spec.kv_len // (nc * bk),
      spec.num_ctas, balance=spec.is_causal)

  def unit(r: kernel.Refs, t, base):
    _, k_ref, v_ref, _, _, _, _, _, kpos_ref, kseg_ref, sched_ref = r.inputs
    (k_smem, v_smem, kpos_smem, kseg_smem, q_smem, do_smem, lse_smem,
     delta_smem, qpos_smem, qseg_smem) = r.smem
    kv_bar, q_bar, do_bar, q_free, do_free = r.barriers
    wg = r.wg
    k_own, v_own = k_smem.at[wg], v_smem.at[wg]  # K, V, then dK, dV.

    b, kh, row = units.decode(r.cta, t)
    ulo = sched_ref[b, row, 0]
    length = sched_ref[b, row, 1] - ulo
    key0 = (row * nc + wg) * bk
    keys = pl.ds(key0, bk)
    kernel.load_stationary(
        [(k_ref.at[b, keys, kh], k_own),
         (v_ref.at[b, keys, kh], v_own),
         *kernel.meta_copies(spec, (kpos_ref, kseg_ref),
                             (kpos_smem.at[wg], kseg_smem.at[wg]), b, keys)],
        kv_bar.at[wg])
    k_p, k_s = kernel.load_meta(
        spec, ops, kpos_smem.at[wg], kseg_smem.at[wg], 0)

    def group_member(rep, carry):
      rep_base = base + rep * length

      def step(i, carry, *, masked):
        dk, dv = carry
        slot = lax.rem(rep_base + i - ulo, stages)
        plgpu.barrier_wait(q_bar.at[slot])
        w = kernel.stationary_in_step(spec, wg)
        k_tile, v_tile = k_smem.at[w], v_smem.at[w]
        qk_t = ops.mm(k_tile, q_smem.at[slot], transpose_b=True)  # [bk, bq]
        s_t, capped_t, score_mod_pullback = kernel.flex_logits(
            spec, ops, qk_t, r, batch=b, head=kh * g + rep, q0=i * bq,
            kv0=key0, q_axis=1, grad=want_dk, args=False)
        lse2 = ops.load_vector(lse_smem.at[slot], 1)
        if masked:
          q_p, q_s = kernel.load_meta(
              spec, ops, qpos_smem.at[slot], qseg_smem.at[slot], 1)
          mod = kernel.mask_mod_tile(
              spec, ops, r, s_t.shape, (q_p, q_s), (k_p, k_s), batch=b,
              head=kh * g + rep, q0=i * bq, kv0=key0, q_axis=1)
          s_t = kernel.apply_mask(spec, s_t, 1, q_p, q_s, k_p, k_s, mod)
        p_t = online_softmax.probs(s_t, lse2, base2=True, per_query=_COLUMNS)

        def dropped(x):
          # The mask is hashed afresh at each use: cheaper than keeping it
          # live across the matmuls, which spills.
          if not spec.dropout_rate:
            return x
          return kernel.apply_dropout(
              spec, ops, x, r.seed, batch=b, head=kh * g + rep,
              q_start=i * bq, kv_start=key0, q_axis=1)

        plgpu.barrier_wait(do_bar.at[slot])
        dp_t_fresh = dict(a=v_tile, b=do_smem.at[slot], transpose_b=True)
        if want_dv:  # Built only when used: dead code can stall Mosaic.
          dv_update = dict(a=dropped(p_t).astype(spec.dtype),
                           b=do_smem.at[slot], a_in_smem=False, acc=dv)
        if want_dv and want_dk:
          dv, dp_t = ops.mm_pair(dv_update, dp_t_fresh)
        elif want_dv:
          dv = ops.mm(**dv_update)
        else:
          dp_t = ops.mm(**dp_t_fresh)
        if want_dk:
          delta = ops.load_vector(delta_smem.at[slot], 1)
        plgpu.barrier_arrive(do_free.at[slot])
        if want_dk:
          ds_t = online_softmax.softmax_grad(  # dP^T of the dropped P^T.
              p_t, dropped(dp_t), delta, per_query=_COLUMNS)
          if score_mod_pullback is not None:  # Its values': in dQ.
            ds_t, _ = score_mod_pullback(ds_t)
          ds_t = kernel.logits_grad(spec, ds_t, capped_t)
          dk = ops.mm(
              ds_t.astype(spec.dtype), q_smem.at[slot], a_in_smem=False,
              acc=dk)
        plgpu.barrier_arrive(q_free.at[slot])
        return dk, dv

      return kernel.phases(sched_ref, b, row, wg, step, carry, spec.masked)

    carry = (ops.full((bk, h), 0.0) if want_dk else None,
             ops.full((bk, spec.hv), 0.0) if want_dv else None)
    dk, dv = lax.fori_loop(0, g, group_member, carry)
    results = []
    if want_dk:
      k_own[...] = dk.astype(spec.dtype)
      results.append(k_own)
    if want_dv:
      v_own[...] = dv.astype(spec.dtype)
      results.append(v_own)
    kernel.store([(src, dst.at[b, keys, kh])
                  for src, dst in zip(results, r.outputs, strict=True)])
    return base + g * length

  def producer_groups(r: kernel.Refs):
    (q_ref, _, _, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, _, _,
     _) = r.inputs
    q_smem, do_smem, lse_smem, delta_smem, qpos_smem, qseg_smem = r.smem[4:]
    q_bar, do_bar, q_free, do_free = r.barriers[1:]

    def query_tile(kh, rep, i):
      # Query head `rep` of the GQA group of key/value head kh, tile i.
      return kh * g + rep, pl.ds(i * bq, bq)

    def q_copies(b, kh, rep, i, slot):
      n, rows = query_tile(kh, rep, i)
      return [
          (q_ref.at[b, rows, n], q_smem.at[slot]),
          (lse_ref.at[b, n, rows], lse_smem.at[slot]),
          *kernel.meta_copies(spec, (qpos_ref, qseg_ref),
                              (qpos_smem.at[slot], qseg_smem.at[slot]), b,
                              rows),
      ]

    def do_copies(b, kh, rep, i, slot):
      n, rows = query_tile(kh, rep, i)
      return [
          (do_ref.at[b, rows, n], do_smem.at[slot]),
          (delta_ref.at[b, n, rows], delta_smem.at[slot]),
      ]

    return [(q_bar, q_free, q_copies), (do_bar, do_free, do_copies)]

  smem = (
      ops.smem((nc, bk, h), spec.dtype, True),  # K, then dK.
      ops.smem((nc, bk, spec.hv), spec.dtype, True),  # V, then dV.
      plgpu.SMEM((nc, bk), _I32),  # key positions
      plgpu.SMEM((nc, bk), _I32),  # key segment ids
      ops.smem((stages, bq, h), spec.dtype, True),  # Q ring
      ops.smem((stages, bq, spec.hv), spec.dtype, True),  # dO ring
      plgpu.SMEM((stages, bq), _F32),  # lse ring
      plgpu.SMEM((stages, bq), _F32),  # delta ring
      plgpu.SMEM((stages, bq), _I32),  # query positions ring
      plgpu.SMEM((stages, bq), _I32),  # query segment ids ring
  )
  barriers = (
      gpu_ops.barrier(nc, 2 + spec.num_meta),  # K, V (+ metadata) loaded.
      gpu_ops.barrier(stages, 2 + spec.num_meta),  # Q, lse (+ metadata).
      gpu_ops.barrier(stages, 2),  # dO, delta loaded.
      gpu_ops.barrier(stages, nc),  # Q slot released.
      gpu_ops.barrier(stages, nc),  # dO slot released.
  )
  return kernel.launch(
      spec, name="pfa_mgpu_" + "_".join(outputs), units=units, reps=g,
      operands=(q, k, v, do, lse2, delta, q_pos, q_seg, kv_pos, kv_seg,
                sched),
      out_types=tuple(
          jax.ShapeDtypeStruct((v if name == "dv" else k).shape, spec.dtype)
          for name in outputs),
      smem_types=smem, barrier_types=barriers, unit=unit,
      producer_groups=producer_groups, seed=seed, residuals=residuals)
