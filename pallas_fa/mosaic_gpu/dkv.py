"""The dK/dV Mosaic GPU kernel of `mosaic_gpu` (Hopper).

KV-stationary, on the producer/consumer skeleton of `kernel`:
each consumer keeps a [block_kv, H] tile of K and V in shared memory while
the producer streams Q, dO, logsumexp and delta for every query head of the
GQA group, so dK and dV come out summed over the group inside the kernel. It
works in the transposed orientation (S^T = K Q^T) so that P^T and dS^T are
register operands of the dV and dK wgmmas.

With `outputs` naming "dq" it is FlashAttention-3's fused backward: each
step's dS^T also goes to shared memory, and dQ = dS K for the step's query
tile is added to a float32 dQ in global memory with a TMA reduce-add, so
the separate dQ kernel (which recomputes QK^T and dO V^T) is not needed:
5 tile products instead of 7. Where each consumer's half of the head dim
is whole 64-column swizzle tiles (H = 128 with two consumers) and
`dq_split` is "columns" (the default) the two consumers split dQ by
columns, each summing both consumers' keys (their dS^T are exchanged
through shared memory behind a barrier); otherwise each adds its own keys'
partial over every column, 64 columns at a time. The Mosaic GPU interpreter
has no TMA reductions: there every unit writes its partials to an output
of their own, which XLA sums.
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
from pallas_fa.mosaic_gpu import tiles

_F32 = jnp.float32
_I32 = jnp.int32
# dQ columns per product, staging tile and reduce-add: one 128-byte swizzle
# tile of float32 wide (head dims are padded to multiples of 64).
_DQ_CHUNK = 64
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
    outputs: which of "dk", "dv" and "dq" to compute ("dq" with both
      others: the fused backward, `tiles.dq_columns`).

  Returns:
    A tuple with the requested of dk [B, Sp, K, Hp] and dv [B, Sp, K, Hvp]
    (Hvp: the padded value head dim), in k.dtype, and dq float32
    [B, Tp, N, Hp] (dS K, the logit scale not applied: `kernel.scale_grad`
    of it is dQ; its summation order is not fixed).
  """
  ops = kernel.ops_for(spec)
  bq, bk, h, stages = spec.block_q, spec.block_kv, spec.head_dim, spec.stages
  nc, g = spec.consumers, spec.group
  want_dk, want_dv = "dk" in outputs, "dv" in outputs
  want_dq = "dq" in outputs
  if want_dq and not (want_dk and want_dv):
    raise ValueError(f"the fused backward computes all three, {outputs=}.")
  if want_dq and spec.score_mod is not None and any(
      res.differentiable for res in spec.score_mod.residuals):
    raise ValueError("the fused backward takes no score_mod gradients.")
  # dQ columns per consumer; both consumers' keys go into each when they
  # share dQ (`tiles.dq_columns`).
  dq_cols = tiles.dq_columns(h, nc, spec.dq_split)
  shared_dq = want_dq and dq_cols < h
  ds_slots = tiles.ds_slots(h, nc, spec.dq_split)
  chunks = dq_cols // _DQ_CHUNK
  # Interpreted: dQ partials, one per unit (shared dQ) or consumer tile.
  writers = 1 if shared_dq else nc
  kv_rows = spec.kv_len // (nc * bk)
  # Dealt in waves, not from a table (`kernel.Units`).
  units = kernel.Units(
      spec.batch, spec.num_kv_heads, kv_rows, spec.num_ctas,
      balance=spec.is_causal, section=spec.head_section, table=False)

  def unit(r: kernel.Refs, t, base):
    _, k_ref, v_ref, _, _, _, _, _, kpos_ref, kseg_ref, sched_ref = r.inputs
    (k_smem, v_smem, kpos_smem, kseg_smem, q_smem, do_smem, lse_smem,
     delta_smem, qpos_smem, qseg_smem, *dq_smem) = r.smem
    kv_bar, q_bar, do_bar, q_free, do_free, *dq_bars = r.barriers
    wg = r.wg
    k_own, v_own = k_smem.at[wg], v_smem.at[wg]  # K, V, then dK, dV.

    b, kh, row = r.units.decode(r.cta, t)
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

    def add_dq(ds_t, dk_product, head, i, step, release):
      """Adds this step's dS K (its columns of it) to the query tile's dQ;
      returns dK + dS^T Q, the product `dk_product` (`mm` keywords),
      issued first (with `Spec.fused_overlap` dS^T is staged and
      exchanged while it runs, and the first dQ chunk's chain is awaited
      with it: `ops.mm_around`), then `release()` (dK's operands are
      read).

      ds_t: the step's dS^T [bk, bq] in the kernel's dtype.
      """
      ds_smem, stage = dq_smem
      # See `tiles.ds_slots`.
      ds_slot = kernel.rem(step, 2) if ds_slots == 2 else 0
      if shared_dq:
        col0, sources = wg * dq_cols, range(nc)
      else:
        col0, sources = 0, (wg,)

      def stage_ds():
        ds_smem.at[ds_slot, wg][...] = ds_t
        plgpu.commit_smem()  # Visible to the wgmmas (the async proxy).
        if shared_dq:
          # Both consumers' dS^T are in before either reads them. A slot
          # is rewritten two steps later, after both passed the next
          # step's barrier, so after both read it here (each awaits its
          # wgmma).
          (ds_ready, _) = dq_bars
          plgpu.barrier_arrive(ds_ready.at[ds_slot])
          plgpu.barrier_wait(ds_ready.at[ds_slot])

      def products(cols):
        # Opaque, so that K's descriptors are built here, not kept live
        # across the loop (`kernel.stationary_in_step`). Every source's
        # product goes in one wgmma chain.
        ws = [kernel.stationary_in_step(spec, w) for w in sources]
        return [(ds_smem.at[ds_slot, w], k_smem.at[w, :, cols]) for w in ws]

      rows = pl.ds(i * bq, bq)
      chunk_cols = [pl.ds(col0 + c * _DQ_CHUNK, _DQ_CHUNK)
                    for c in range(chunks)]
      if spec.fused_overlap:
        dk, dq = ops.mm_around(dk_product, stage_ds,
                               lambda: products(chunk_cols[0]),
                               (bq, _DQ_CHUNK), transpose_a=True)
        release()
      else:
        dk = ops.mm(**dk_product)
        release()
        stage_ds()
        dq = ops.mm_sum(products(chunk_cols[0]), transpose_a=True)
      # In 64-column chunks: one chunk's float32 product is live at a time.
      for c, cols in enumerate(chunk_cols):
        if c:
          dq = ops.mm_sum(products(cols), transpose_a=True)
        else:
          # The previous step's reduce-adds have read the staging tiles.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        stage.at[wg, c][...] = dq  # [bq, _DQ_CHUNK]
      plgpu.commit_smem()
      for c, cols in enumerate(chunk_cols):
        if spec.interpret:
          part = row if shared_dq else row * nc + wg
          plgpu.copy_smem_to_gmem(
              stage.at[wg, c], r.outputs[-1].at[b, part, rows, head, cols])
        else:  # The output shares the zeroed accumulator's buffer.
          plgpu.copy_smem_to_gmem(
              stage.at[wg, c], r.outputs[-1].at[b, rows, head, cols],
              reduction_op="add")
      return dk

    def group_member(rep, carry):
      rep_base = base + rep * length

      def step(i, carry, *, masked):
        dk, dv = carry
        slot = kernel.rem(rep_base + i - ulo, stages)
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
          ds_t = kernel.logits_grad(spec, ds_t, capped_t).astype(spec.dtype)
          dk_product = dict(a=ds_t, b=q_smem.at[slot], a_in_smem=False,
                            acc=dk)

        def release_q():  # Q's slot: dK's product, its last reader, is done.
          plgpu.barrier_arrive(q_free.at[slot])

        if want_dq:
          dk = add_dq(ds_t, dk_product, kh * g + rep, i,
                      rep_base + i - ulo, release_q)
        else:
          if want_dk:
            dk = ops.mm(**dk_product)
          release_q()
        return dk, dv

      return kernel.phases(sched_ref, b, row, wg, step, carry, spec.masked)

    carry = (ops.full((bk, h), 0.0) if want_dk else None,
             ops.full((bk, spec.hv), 0.0) if want_dv else None)
    dk, dv = lax.fori_loop(0, g, group_member, carry)
    if shared_dq:
      # The other consumer's last dQ products read this one's K tile,
      # which dK is about to overwrite.
      (_, unit_done) = dq_bars
      plgpu.barrier_arrive(unit_done.at[0])
      plgpu.barrier_wait(unit_done.at[0])
    results = []
    if want_dk:
      k_own[...] = kernel.scale_grad(spec, dk).astype(spec.dtype)
      results.append(k_own)
    if want_dv:
      v_own[...] = dv.astype(spec.dtype)
      results.append(v_own)
    kernel.store([(src, dst.at[b, keys, kh])
                  for src, dst in zip(results, r.outputs)])
    return base + g * length

  def producer_groups(r: kernel.Refs):
    (q_ref, _, _, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, _, _,
     _) = r.inputs
    q_smem, do_smem, lse_smem, delta_smem, qpos_smem, qseg_smem = (
        r.smem[4:10])
    q_bar, do_bar, q_free, do_free = r.barriers[1:5]

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
  out_types = tuple(
      jax.ShapeDtypeStruct((v if name == "dv" else k).shape, spec.dtype)
      for name in outputs if name != "dq")
  accumulators = ()
  if want_dq:
    smem += (
        ops.smem((ds_slots, nc, bk, bq), spec.dtype, True),  # dS^T
        # dQ staging (`MosaicGpuBlockSizes.dq_swizzle`).
        ops.smem((nc, chunks, bq, _DQ_CHUNK), _F32, True,
                 swizzle=spec.dq_swizzle),
    )
    if shared_dq:
      barriers += (
          gpu_ops.barrier(2, nc),  # Both consumers' dS^T stored.
          gpu_ops.barrier(1, nc),  # Both consumers' last dQ done.
      )
    dq_shape = (spec.batch, spec.q_len, spec.num_heads, h)
    if spec.interpret:
      out_types += (jax.ShapeDtypeStruct(
          (spec.batch, kv_rows * writers, *dq_shape[1:]), _F32),)
    else:
      accumulators = (jnp.zeros(dq_shape, _F32),)
  outs = kernel.launch(
      spec, name="pfa_mgpu_" + "_".join(outputs), units=units, reps=g,
      operands=(q, k, v, do, lse2, delta, q_pos, q_seg, kv_pos, kv_seg,
                sched),
      out_types=out_types, smem_types=smem, barrier_types=barriers,
      unit=unit, producer_groups=producer_groups, seed=seed,
      residuals=residuals, accumulators=accumulators)
  if not want_dq:
    return outs
  *outs, dq = outs
  if spec.interpret:
    dq = _sum_partials(dq, sched, writers, bq)
  return (*outs, dq)


def _sum_partials(parts, sched, writers, block_q):
  """The interpreted fused backward's dQ: its per-unit partials
  [B, P, Tp, N, H] summed over P, each counted only on the query tiles its
  unit visited ([ulo, uhi) of `sched`; the rest was never written)."""
  tiles = jnp.arange(parts.shape[2], dtype=jnp.int32) // block_q
  tiles = tiles[None, None, :]
  lo = jnp.repeat(sched[:, :, 0], writers, axis=1)[..., None]
  hi = jnp.repeat(sched[:, :, 1], writers, axis=1)[..., None]
  visited = (tiles >= lo) & (tiles < hi)  # [B, P, Tp]
  return jnp.where(visited[..., None, None], parts, 0.0).sum(axis=1)
