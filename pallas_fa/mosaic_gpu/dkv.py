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


def pipelines_dq(spec: kernel.Spec) -> bool:
  """Whether the fused kernel of `spec` runs `Spec.fused_pipeline`'s order
  (elsewhere each step's dQ is its own): not with segment ids or a
  mask_mod, whose masked steps keep more registers live (the pipelined
  kernel spilled 16-84 B at H = 128), and not compiled by jax 0.10, which
  cannot stage under a wgmma (its in-order pipeline spilled 44-68 B)."""
  return (spec.fused_pipeline and not spec.carries_seg
          and spec.mask_mod is None
          and (spec.interpret or gpu_ops.STORES_UNDER_WGMMA))


def softmax_overlaps(spec: kernel.Spec) -> bool:
  """Whether the fused kernel of `spec` runs `Spec.fused_softmax_overlap`'s
  order: not with a soft cap or a score_mod (their capped logits and
  pullback would stay live across dP^T's product), and not compiled by
  jax 0.10, which cannot store to shared memory under a wgmma."""
  return (spec.fused_softmax_overlap and spec.soft_cap is None
          and spec.score_mod is None
          and (spec.interpret or gpu_ops.STORES_UNDER_WGMMA))


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
  overlap = want_dq and softmax_overlaps(spec)
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
    (k_smem, v_smem, kmeta_smem, q_smem, do_smem, lse_smem, delta_smem,
     qmeta_smem, *dq_smem) = r.smem
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
                             kernel.meta_at(spec, kmeta_smem, wg), b, keys)],
        kv_bar.at[wg])
    k_p, k_s = kernel.load_meta(
        spec, ops, *kernel.meta_at(spec, kmeta_smem, wg), 0, first=key0,
        size=bk)

    if want_dq:
      ds_smem, stage = dq_smem
      ds_ready = dq_bars[0] if shared_dq else None
      if shared_dq:
        col0, sources = wg * dq_cols, range(nc)
      else:
        col0, sources = 0, (wg,)
      chunk_cols = [pl.ds(col0 + c * _DQ_CHUNK, _DQ_CHUNK)
                    for c in range(chunks)]

    def ds_slot_of(step):  # See `tiles.ds_slots`.
      return kernel.rem(step, 2) if ds_slots == 2 else 0

    def stage_ds(ds_t, ds_slot):
      """Stores the step's dS^T [bk, bq] (kernel dtype) for dQ's products
      (None: `softmax_overlaps` stored it under dV's product); with shared
      dQ, until both consumers' are in. A slot is rewritten two steps
      later, after both passed the next step's barrier, so after both
      read it (each awaits its dQ products before it stages its next
      dS^T)."""
      if ds_t is not None:
        ds_smem.at[ds_slot, wg][...] = ds_t
      plgpu.commit_smem()  # Visible to the wgmmas (the async proxy).
      if shared_dq:
        plgpu.barrier_arrive(ds_ready.at[ds_slot])
        plgpu.barrier_wait(ds_ready.at[ds_slot])

    def dq_pairs(ds_slot, c):
      """The (dS^T, K) operands of dQ's column chunk c: every source's in
      one wgmma chain. Built here, so that K's descriptors are not kept
      live across the loop (`kernel.stationary_in_step`)."""
      ws = [kernel.stationary_in_step(spec, w) for w in sources]
      return [(ds_smem.at[ds_slot, w], k_smem.at[w, :, chunk_cols[c]])
              for w in ws]

    def stage_dq(dq, c, head, i):
      """Stages chunk c of a step's dS K (float32 [bq, _DQ_CHUNK]); after
      the last chunk, adds the staged tiles to query tile i of `head`."""
      if c == 0:
        # The previous step's reduce-adds have read the staging tiles.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      stage.at[wg, c][...] = dq
      if c < chunks - 1:
        return
      plgpu.commit_smem()
      rows = pl.ds(i * bq, bq)
      for c, cols in enumerate(chunk_cols):
        if spec.interpret:
          part = row if shared_dq else row * nc + wg
          plgpu.copy_smem_to_gmem(
              stage.at[wg, c], r.outputs[-1].at[b, part, rows, head, cols])
        else:  # The output shares the zeroed accumulator's buffer.
          plgpu.copy_smem_to_gmem(
              stage.at[wg, c], r.outputs[-1].at[b, rows, head, cols],
              reduction_op="add")

    def dq_chunks(ds_slot, head, i, first=1):
      """dQ's column chunks from `first` on: products, staging, adds."""
      for c in range(first, chunks):
        stage_dq(ops.mm_sum(dq_pairs(ds_slot, c), transpose_a=True), c,
                 head, i)

    def add_dq(ds_t, dk_product, head, i, step, release):
      """Adds this step's dS K (its columns of it) to the query tile's dQ;
      returns dK + dS^T Q, the product `dk_product` (`mm` keywords),
      issued first (with `Spec.fused_overlap`, or `softmax_overlaps`, dS^T
      is staged and exchanged while it runs, and the first dQ chunk's
      chain is awaited with it: `ops.mm_around`), then `release()` (dK's
      operands are read).

      ds_t: the step's dS^T [bk, bq] in the kernel's dtype, or None
      where it is in its slot already (`stage_ds`).
      """
      ds_slot = ds_slot_of(step)
      if spec.fused_overlap or overlap:
        dk, dq = ops.mm_around(dk_product, lambda: stage_ds(ds_t, ds_slot),
                               lambda: dq_pairs(ds_slot, 0),
                               (bq, _DQ_CHUNK), transpose_a=True)
        release()
      else:
        dk = ops.mm(**dk_product)
        release()
        stage_ds(ds_t, ds_slot)
        dq = ops.mm_sum(dq_pairs(ds_slot, 0), transpose_a=True)
      stage_dq(dq, 0, head, i)
      dq_chunks(ds_slot, head, i)
      return dk

    def step_index(rep, i):
      """The unit's steps in order (ring slots, dS^T slots): query tile i
      of query head `rep` of the group."""
      return base + rep * length + i - ulo

    # `pipelines_dq`: a step's dQ is left to the next one (or to the
    # unit's end), which is handed (rep, i) of it.
    def deferred_dq(pending, second=None, before_second=None):
      """The pending step's dQ: its first chunk's chain issued ahead of
      `second` (`mm` keywords of the step's S^T, issued after
      `before_second()`; None at the unit's end) and staged and added
      while `second` runs, then the other chunks. Returns `second`'s
      result."""
      rep, i = pending
      head = kh * g + rep
      ds_slot = ds_slot_of(step_index(rep, i))
      if second is None:
        dq_chunks(ds_slot, head, i, first=0)
        return None
      out = ops.mm_sum_ahead(dq_pairs(ds_slot, 0),
                             lambda dq: stage_dq(dq, 0, head, i), second,
                             transpose_a=True, before=before_second)
      dq_chunks(ds_slot, head, i)
      return out

    def step(rep, i, carry, *, masked, first=False):
      """Query tile i of query head `rep` of the group. `first`: the
      unit's first step under `Spec.fused_pipeline` (no dQ pending)."""
      dk, dv, *pending = carry
      n = step_index(rep, i)
      slot = kernel.rem(n, stages)
      head = kh * g + rep
      w = kernel.stationary_in_step(spec, wg)
      k_tile, v_tile = k_smem.at[w], v_smem.at[w]
      qk_t_fresh = dict(a=k_tile, b=q_smem.at[slot], transpose_b=True)

      def q_ready():
        plgpu.barrier_wait(q_bar.at[slot])

      if pending and not first:
        qk_t = deferred_dq(pending[0], qk_t_fresh, q_ready)
      else:
        q_ready()
        qk_t = ops.mm(**qk_t_fresh)  # [bk, bq]
      def probs_t(qk_t):
        """(P^T, the capped logits or None, the score_mod's pullback or
        None) of the step's S^T."""
        s_t, capped_t, pullback = kernel.flex_logits(
            spec, ops, qk_t, r, batch=b, head=head, q0=i * bq,
            kv0=key0, q_axis=1, grad=want_dk, args=False)
        lse2 = ops.load_vector(lse_smem.at[slot], 1)
        if masked:
          q_p, q_s = kernel.load_meta(
              spec, ops, *kernel.meta_at(spec, qmeta_smem, slot), 1,
              first=i * bq, size=bq)
          mod = kernel.index_mask_tile(
              spec, ops, r, s_t.shape, (q_p, q_s), (k_p, k_s), batch=b,
              head=head, q0=i * bq, kv0=key0, q_axis=1)
          s_t = kernel.apply_mask(spec, s_t, 1, q_p, q_s, k_p, k_s, mod)
        p_t = online_softmax.probs(s_t, lse2, base2=True,
                                   per_query=_COLUMNS)
        return p_t, capped_t, pullback

      def dropped(x):
        # The mask is hashed afresh at each use: cheaper than keeping it
        # live across the matmuls, which spills.
        if not spec.dropout_rate:
          return x
        return kernel.apply_dropout(
            spec, ops, x, r.seed, batch=b, head=head,
            q_start=i * bq, kv_start=key0, q_axis=1)

      def ds_of(p_t, dp_t, delta, capped_t=None, score_mod_pullback=None):
        """dS^T in the kernel's dtype, from the dP^T of the dropped P^T."""
        ds_t = online_softmax.softmax_grad(
            p_t, dropped(dp_t), delta, per_query=_COLUMNS)
        if score_mod_pullback is not None:  # Its values': in dQ.
          ds_t, _ = score_mod_pullback(ds_t)
        return kernel.logits_grad(spec, ds_t, capped_t).astype(spec.dtype)

      dp_t_fresh = dict(a=v_tile, b=do_smem.at[slot], transpose_b=True)
      if overlap:
        # `softmax_overlaps`: P^T while dP^T's product runs, then dS^T
        # while dV's does, each pinned (`Ops.mm_while`) by a store to the
        # step's dS^T slot: P^T's is scratch, overwritten by dS^T's,
        # which is dQ's operand (`stage_ds` then only commits it). Under
        # `pipelines_dq` the step before's dQ, issued ahead of S^T, read
        # the other slot, or (one slot) was awaited before S^T's product.
        def pin(new):
          # (The slot's view is built here, inside the product's state:
          # built outside, a constant slot index fails to lower.)
          ds_smem.at[ds_slot_of(n), wg][...] = new[0].astype(spec.dtype)

        plgpu.barrier_wait(do_bar.at[slot])
        dp_t, (p_t,) = ops.mm_while(
            dp_t_fresh, lambda qk_t: probs_t(qk_t)[:1], (qk_t,), pin=pin)
        p_op = dropped(p_t).astype(spec.dtype)
        delta = ops.load_vector(delta_smem.at[slot], 1)
        # P^T's operand is the placeholder of dS^T (the same shape, dtype
        # and layout): its value is overwritten.
        dv, (ds_t,) = ops.mm_while(
            dict(a=p_op, b=do_smem.at[slot], a_in_smem=False, acc=dv),
            lambda _: (ds_of(p_t, dp_t, delta),), (p_op,), pin=pin)
        plgpu.barrier_arrive(do_free.at[slot])
        ds_store = None
      else:
        p_t, capped_t, score_mod_pullback = probs_t(qk_t)
        plgpu.barrier_wait(do_bar.at[slot])
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
          ds_t = ds_of(p_t, dp_t, delta, capped_t, score_mod_pullback)
        ds_store = ds_t if want_dk else None
      if want_dk:
        dk_product = dict(a=ds_t, b=q_smem.at[slot], a_in_smem=False,
                          acc=dk)

      def release_q():  # Q's slot: dK's product, its last reader, is done.
        plgpu.barrier_arrive(q_free.at[slot])

      if pending:
        dk = ops.mm_beside(
            dk_product, lambda: stage_ds(ds_store, ds_slot_of(n)))
        release_q()
        pending = [tuple(jnp.asarray(x).astype(_I32) for x in (rep, i))]
      elif want_dq:
        dk = add_dq(ds_store, dk_product, head, i, n, release_q)
      else:
        if want_dk:
          dk = ops.mm(**dk_product)
        release_q()
      return dk, dv, *pending

    carry = (ops.full((bk, h), 0.0) if want_dk else None,
             ops.full((bk, spec.hv), 0.0) if want_dv else None)
    pipelined = want_dq and pipelines_dq(spec)
    # Loops of zero or one trip: a unit may have no query tiles.
    some = jnp.minimum(length, 1)
    if pipelined:
      # The unit's first step (masked whenever the call masks: masking a
      # whole tile changes nothing) leaves the first dQ pending.
      carry = lax.fori_loop(
          ulo, ulo + some,
          lambda i, c: step(0, i, c, masked=spec.masked, first=True),
          (*carry, (jnp.int32(0),) * 2))

    def group_member(rep, carry):
      start = None
      if pipelined:
        start = ulo + jnp.where(rep == 0, some, 0)
      return kernel.phases(sched_ref, b, row, wg,
                           lambda i, c, masked: step(rep, i, c, masked=masked),
                           carry, spec.masked, start=start)

    dk, dv, *pending = lax.fori_loop(0, g, group_member, carry)
    if pipelined:  # The last step's dQ.
      def last(_, pending):
        deferred_dq(pending)
        return pending

      lax.fori_loop(0, some, last, pending[0])
    if shared_dq:
      # The other consumer's last dQ products read this one's K tile,
      # which dK is about to overwrite. The barrier's address is built
      # here, not kept in a register across the unit (with
      # `Spec.fused_pipeline` ptxas spilled it).
      done = dq_bars[1].at[kernel.stationary_in_step(spec, 0)]
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
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
    q_smem, do_smem, lse_smem, delta_smem, qmeta_smem = r.smem[3:8]
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
                              kernel.meta_at(spec, qmeta_smem, slot), b,
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
      kernel.meta_smem(spec, (nc, bk)),  # key positions / segment ids
      ops.smem((stages, bq, h), spec.dtype, True),  # Q ring
      ops.smem((stages, bq, spec.hv), spec.dtype, True),  # dO ring
      plgpu.SMEM((stages, bq), _F32),  # lse ring
      plgpu.SMEM((stages, bq), _F32),  # delta ring
      kernel.meta_smem(spec, (stages, bq)),  # query metadata rings
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
