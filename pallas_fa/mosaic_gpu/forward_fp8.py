"""The float8 (e4m3) forward Mosaic GPU kernel of `mosaic_gpu` (Hopper).

The forward of `forward` with both products on 8-bit wgmma: Q K^T reads
e4m3 Q and K tiles from shared memory, and P V takes P from registers,
converted from the float32 logit layout to e4m3.

With `Spec.intra_overlap` the key loop is software-pipelined as in
`forward` (`forward.walk_keys_overlapped`): step j issues Q K_j^T with
P_{j-1} V_{j-1} and runs tile j's softmax and P conversion while P_{j-1}
V_{j-1} is still on the tensor cores; the carried P is e4m3 in the 8-bit
A-operand layout.

Hopper's 8-bit wgmma reads its shared-memory operands K-major only (no
transposed B), so V enters the kernel transposed, [B, K, Hv, S] (`layout_v`,
one pass of XLA over V outside the kernel), and its [Hv, block_kv] tiles are
the B operand of P V directly.

P in registers: the float32 accumulator layout gives a thread, in each
16-key slice of a row, keys {2c, 2c+1, 8+2c, 9+2c} (c = lane % 4), and the
8-bit A-operand layout wants four consecutive keys {4c, ..., 4c+3}. Rather
than exchanging registers between lanes, `p_operand` packs each thread's
four values as they are and `layout_v` permutes the keys of every 16-key
slice of V^T the same way (new key 4c + j holds old key (2c, 2c+1, 8+2c,
9+2c)[j]): a contraction does not depend on the order of its terms, so
P V is unchanged and the conversion is two cvt.e4m3x2 and a mov per four
probabilities.

Scales (`quantize.dequantize`): the logits are scale * (q_scale[t] *
k_scale[s]) * (q8 . k8). The query scales (and the logit scale, and key
scales that are one per (batch, head)) form one float32 factor per query row,
loaded with the Q tile; key scales per token also stream with each K tile,
one factor per key. The probabilities enter P V as p * 256 * r[s] with r =
v_scale / max|v_scale| (1 with one value scale per (batch, head)), so P
spans e4m3's range (FlashAttention-3's +8 exponent offset) and per-token
value scales cost one multiply before the single e4m3 rounding; the output
is multiplied by v_scale / 256 (one per (batch, head)) or max|v_scale| /
256. The running sums and the logsumexp use the unscaled p, so they are
those of the dequantized attention.

The row factor in the exponent: without a soft cap the logits are the
products times the row factor (times the key factor), so the row max is
taken on the products and scaled once a row, and the factor rides in the
exponent's fused multiply-add (`online_softmax.update`'s `scale`): one
multiply a logit fewer, on the softmax chain that bounds this loop. That
needs the factor positive, and a scale may be zero or negative (the max
of the products is then the wrong end): zero factors enter as the
smallest normal float32 (a logit of at most 2^-100, exp2 of it 1, as for
0), and a 64-row tile holding a negative factor (`q_mixed`, one int32 a
tile) walks its keys with the factor multiplied into every logit first.
Both loops are in the kernel; each unit runs one of them.

P V accumulates in the 8-bit wgmma's adder across every key tile by
default; with `Spec.two_level` (`MosaicGpuBlockSizes.float8_two_level`)
each tile's P V is a fresh product added to the float32 accumulator as
acc * alpha + P V, the two-level accumulation that FP8 attention needs if
long contexts lose bits in that adder.

Cost model (per [64-row consumer tile] x [block_kv keys] step, H = Hv,
e4m3): bytes streamed into shared memory per step are block_kv * 2H (half
of bfloat16's); tensor-core work 4 * 64 * block_kv * H FLOPs at twice the
bfloat16 rate (H100: 1979 vs 989 dense TFLOP/s); the softmax work per step
is that of bfloat16 (exp2, max, sum over 64 x block_kv) plus one multiply
per probability (the 256 * r factor), one more per logit with per-token key
scales, and the P conversion (0.75 instructions per probability instead of
0.5 for bfloat16's cvt.bf16x2). The matmuls halve, the softmax does not, so
as in FlashAttention-3 the ratio to the bfloat16 forward is set by how much
of the softmax the ping-pong hides: expected 1.3-1.5x the bfloat16 forward's
TFLOP/s at H = 128/256 and long sequences (cuDNN measures 1.5x on an H200,
FlashAttention-3 1.6x on an H100), nearer 1.1-1.2x at H = 64, where the
softmax already bounds the bfloat16 kernel. The V^T pass outside the kernel
reads and writes B * S * K * Hv bytes; the kernel streams (N * T / 128) * S *
(H + Hv) bytes of K/V per batch row through L2, so the pass adds 128 K / (N T)
of that: under 1% at T = 16k, about 25% at T = 512 (H = Hv, K = N), where
it is worth keeping V transposed in memory (a cache stored [B, K, Hv, S]).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa import online_softmax
from pallas_fa.mosaic_gpu import forward as forward_lib
from pallas_fa.mosaic_gpu import kernel
from pallas_fa.mosaic_gpu import ops as gpu_ops

_F32 = jnp.float32
_I32 = jnp.int32
_ROWS = online_softmax.queries_along(0)
FP8 = jnp.float8_e4m3fn
# P is this much larger at its e4m3 cast (2^8: FlashAttention-3's exponent
# offset of 8): by the softmax's offset (P and l alike), or with per-key
# value scales in their factors (the output divides it out).
P_SCALE = 256.0
P_OFFSET = math.log2(P_SCALE)
# Keys of one 16-key slice of V^T in the order the e4m3 P operand holds
# them (`p_operand`): position 4c + j holds key (2c, 2c + 1, 8 + 2c,
# 9 + 2c)[j].
KEY_ORDER = tuple(int(x) for x in np.arange(16).reshape(2, 4, 2)
                  .transpose(1, 0, 2).reshape(16))


def layout_v(v, *, interpret: bool):
  """V [B, Sp, K, Hv] (Sp a multiple of 16) as the kernel reads it:
  [B, K, Hv, Sp], the keys of each 16-key slice in `KEY_ORDER` when
  compiled (the interpreter multiplies P in its natural order)."""
  b, s, kh, hv = v.shape
  if interpret:
    return jnp.transpose(v, (0, 2, 3, 1))
  # Key 16i + 8h + 2c + e goes to 16i + 4c + 2h + e.
  x = v.reshape(b, s // 16, 2, 4, 2, kh, hv)
  return jnp.transpose(x, (0, 5, 6, 1, 3, 2, 4)).reshape(b, kh, hv, s)


def row_factors(q_row, block_q: int):
  """The kernel's row factors from the signed ones, float32 [B, N, Tp]:
  (q_row with every factor under the smallest normal float32 in magnitude
  made that normal, q_mixed int32 [B, N, Tp / block_q]: 1 for a tile of
  block_q rows holding a negative factor). See the module doc: a zero
  factor would turn a masked logit's -inf into NaN in the exponent's
  multiply, and the replacement moves no logit off 0 by more than 2^-100."""
  tiny = jnp.finfo(jnp.float32).tiny
  q_row = jnp.where(jnp.abs(q_row) < tiny, tiny, q_row)
  b, n, tp = q_row.shape
  mixed = (q_row < 0).reshape(b, n, tp // block_q, block_q).any(axis=-1)
  return q_row, mixed.astype(_I32)


def p_operand(p):
  """float32 P [M, N] in the wgmma accumulator layout -> e4m3 P in the
  8-bit A-operand layout, keys of each 16-key slice in `KEY_ORDER` (see
  the module doc). Mosaic GPU has no such layout conversion; this one moves
  no data between lanes."""
  # Imported here: only compiled kernels reach this.
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  from jax._src.lib.mlir.dialects import llvm  # noqa: PLC0415
  from jax._src.lib.mlir.dialects import vector  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415

  p = plgpu.layout_cast(p, plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(
          p.shape, FP8, layout=plgpu.Layout.WGMMA_8BIT))
  def relabel(_, x):
    shape = x.shape
    old = x.registers
    new_shape = fa.WGMMA_LAYOUT_8BIT.registers_shape(shape)
    if old.shape[1] != 2 * new_shape[1] or (
        old.shape[:1] + old.shape[2:] != new_shape[:1] + new_shape[2:]):
      raise NotImplementedError(
          f"p_operand: unexpected register shapes {old.shape} -> "
          f"{new_shape}")
    i32 = ir.IntegerType.get_signless(32)
    out_ty = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())

    def element(reg, i):
      return llvm.extractelement(
          reg, llvm.ConstantOp(i32, ir.IntegerAttr.get(i32, i)).result)

    regs = np.empty(new_shape, dtype=object)
    for idx in np.ndindex(*new_shape):
      lo = old[(idx[0], 2 * idx[1], *idx[2:])]
      hi = old[(idx[0], 2 * idx[1] + 1, *idx[2:])]
      if ir.VectorType(lo.type).shape != [2]:
        raise NotImplementedError(
            f"p_operand: unexpected register type {lo.type}")
      # cvt.e4m3x2 d, a, b puts a in d's upper byte.
      packed = llvm.inline_asm(
          i32, [element(lo, 0), element(lo, 1), element(hi, 0),
                element(hi, 1)],
          "{ .reg .b16 plo, phi;\n"
          "cvt.rn.satfinite.e4m3x2.f32 plo, $2, $1;\n"
          "cvt.rn.satfinite.e4m3x2.f32 phi, $4, $3;\n"
          "mov.b32 $0, {plo, phi}; }",
          "=r,f,f,f,f", asm_dialect=0)
      as_vec = vector.broadcast(ir.VectorType.get((1,), i32), packed)
      regs[idx] = vector.bitcast(out_ty, as_vec)
    return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT_8BIT,
                              _is_signed=None)

  return relabel(p)


def own_registers(p):
  """e4m3 P in the 8-bit A-operand layout, moved into registers of its own
  (an inline `mov` per register, ordered as a side effect).

  In the pipelined loop, P_j is converted while P_{j-1} V_{j-1} is in
  flight; the loop's exit value, which the last P V reads, would otherwise
  be the conversion's own registers, and ptxas serializes every wgmma of a
  kernel where a wgmma's input register is defined inside another's
  pipeline stage (C7513). Moved after the wait, P is defined outside it."""
  # Imported here: only compiled kernels reach this.
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  from jax._src.lib.mlir.dialects import llvm  # noqa: PLC0415
  from jax._src.lib.mlir.dialects import vector  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA_8BIT,),
      return_type=plgpu.ShapeDtypeStruct(
          p.shape, FP8, layout=plgpu.Layout.WGMMA_8BIT))
  def move(_, x):
    i32 = ir.IntegerType.get_signless(32)
    word_ty = ir.VectorType.get((1,), i32)
    regs = np.empty(x.registers.shape, dtype=object)
    for idx, reg in np.ndenumerate(x.registers):
      word = vector.extract(
          vector.bitcast(word_ty, reg), dynamic_position=[],
          static_position=ir.DenseI64ArrayAttr.get([0]))
      moved = llvm.inline_asm(i32, [word], "mov.b32 $0, $1;", "=r,r",
                              has_side_effects=True, asm_dialect=0)
      regs[idx] = vector.bitcast(reg.type,
                                 vector.broadcast(word_ty, moved))
    return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT_8BIT,
                              _is_signed=None)

  return move(p)


def _smem(interpret: bool, shape, dtype, minor_bytes: int):
  """A swizzled SMEM tile whose rows are `minor_bytes` long (the swizzle:
  the widest of 128, 64 and 32 bytes that tiles a row, e.g. 64 for the
  V^T tile of 192 keys)."""
  swizzle = next(w for w in (128, 64, 32) if minor_bytes % w == 0)
  ops = gpu_ops.Ops(interpret, swizzle=swizzle)
  return ops.smem(shape, dtype, True)


def forward(spec: kernel.Spec, q, k, vt, q_pos, q_seg, kv_pos, kv_seg,
            q_row, k_col, v_col, out_mult, q_mixed, sched, *, out_dtype,
            key_scales: bool, value_scales: bool):
  """The e4m3 forward kernel.

  Args:
    spec: launch parameters (`spec.dtype` e4m3; `spec.scale` 1: the logit
      scale is in `q_row`).
    q: e4m3 [B, Tp, N, Hp]; padded rows zeroed.
    k: e4m3 [B, Sp, K, Hp]; padded rows zeroed.
    vt: e4m3 [B, K, Hvp, Sp] (`layout_v`); padded keys zeroed.
    q_pos, q_seg, kv_pos, kv_seg: int32 metadata as in `forward.forward`.
    q_row: float32 [B, N, Tp]: scale * q_scale (* k_scale when
      `key_scales` is off) per query row, none zero (`row_factors`).
    k_col: float32 [B, K, Sp]: k_scale per key (read with `key_scales`).
    v_col: float32 [B, K, Sp]: 256 * v_scale / max|v_scale| per key (read
      with `value_scales`; else P is multiplied by 256).
    out_mult: float32 [B, N]: max|v_scale| / 256 of the query head's K/V
      head.
    q_mixed: int32 [B, N, Tp / block_q]: 1 where a block_q-row tile of
      q_row holds a negative factor (`row_factors`), else 0.
    sched: int32 [B, Tp / (2 block_q), 6], as in `forward.forward`.
    out_dtype: bfloat16 or float16.
    key_scales: whether key scales differ by key.
    value_scales: whether value scales differ by key.

  Returns:
    (out [B, Tp, N, Hvp] in out_dtype, lse float32 [B, N, Tp], natural log).
  """
  interpret = spec.interpret
  ops = kernel.ops_for(spec)
  bq, bk, h, hv, stages = (spec.block_q, spec.block_kv, spec.head_dim,
                           spec.hv, spec.stages)
  nc = spec.consumers
  units = kernel.q_units(spec, table=True)

  def unit(r: kernel.Refs, t, base):
    (q_ref, _, _, qpos_ref, qseg_ref, _, _, qrow_ref, _, _, omult_ref,
     qmixed_ref, sched_ref) = r.inputs
    o_ref, lse_ref = r.outputs
    (q_smem, o_smem, lse_smem, qmeta_smem, qrow_smem, k_smem, vt_smem,
     kmeta_smem, kcol_smem, vcol_smem) = r.smem
    q_bar, k_bar, v_bar, k_free, v_free, schedule = r.barriers
    wg = r.wg
    o_own = o_smem.at[wg]

    b, n, row = r.units.decode(r.cta, t)
    ulo = sched_ref[b, row, 0]
    row0 = (row * nc + wg) * bq
    rows = pl.ds(row0, bq)
    kernel.load_stationary(
        [(q_ref.at[b, rows, n], q_smem.at[wg]),
         (qrow_ref.at[b, n, rows], qrow_smem.at[wg]),
         *kernel.meta_copies(spec, (qpos_ref, qseg_ref),
                             kernel.meta_at(spec, qmeta_smem, wg), b, rows)],
        q_bar.at[wg])
    q_p, q_s = kernel.load_meta(
        spec, ops, *kernel.meta_at(spec, qmeta_smem, wg), 0, first=row0,
        size=bq)
    q_factor = ops.load_vector(qrow_smem.at[wg], 0)  # [bq]

    # P_SCALE: in the exponent (2^(s - m + 8), P and l alike, no multiply)
    # unless per-key value factors multiply P anyway (they carry it).
    p_offset = 0.0 if value_scales else P_OFFSET

    def softmax(j, slot, qk, m_i, l_i, *, masked, k_meta=None, fold=False):
      """The online softmax of key tile j from its e4m3 Q K^T (scaled
      here), releasing its K slot: (m_i, l_i, float32 p, alpha).
      `k_meta`: the tile's key positions and segment ids when already
      loaded (else read here when `masked`). `fold`: the row factors are
      positive and ride in the exponent (the module doc)."""
      if not fold:
        qk = qk * jax.lax.broadcast_in_dim(q_factor, qk.shape, (0,))
      if key_scales:
        k_factor = ops.load_vector(kcol_smem.at[slot], 1)
        qk = qk * jax.lax.broadcast_in_dim(k_factor, qk.shape, (1,))
      if masked and k_meta is None:
        k_meta = kernel.load_meta(
            spec, ops, *kernel.meta_at(spec, kmeta_smem, slot), 1,
            first=j * bk, size=bk)
      plgpu.barrier_arrive(k_free.at[slot])
      if spec.soft_cap is None:
        s = qk  # q_factor carries log2(e): base-2 logits (`_fp8_scales`).
      else:
        s, _ = kernel.logits(spec, qk)
      if masked:
        by_index = kernel.index_mask_tile(
            spec, ops, r, s.shape, (q_p, q_s), k_meta, batch=b, head=n,
            q0=row0, kv0=j * bk, q_axis=0)
        s = kernel.apply_mask(spec, s, 0, q_p, q_s, *k_meta, by_index)
      return online_softmax.update(m_i, l_i, s, base2=True, per_query=_ROWS,
                                   tile_exp=forward_lib.tile_exp(spec),
                                   offset=p_offset,
                                   scale=q_factor if fold else None)

    def operand(p, slot):
      """float32 p of the V tile in `slot` (landed) -> the e4m3 A operand
      of P V: times the tile's value factors (else P_SCALE is in P
      already, `p_offset`), converted."""
      if value_scales:
        v_factor = ops.load_vector(vcol_smem.at[slot], 1)
        p = p * jax.lax.broadcast_in_dim(v_factor, p.shape, (1,))
      return p.astype(FP8) if interpret else p_operand(p)

    def step(j, carry, *, masked, fold=False):
      m_i, l_i, acc = carry
      slot = kernel.rem(base + j - ulo, stages)
      qk, k_p, k_s = forward_lib.key_tile_products(  # e4m3 -> float32
          spec, ops, q_smem, wg, k_bar.at[slot], k_smem.at[slot],
          kernel.meta_at(spec, kmeta_smem, slot), j * bk, masked, schedule)
      m_i, l_i, p, alpha = softmax(j, slot, qk, m_i, l_i, masked=masked,
                                   k_meta=(k_p, k_s), fold=fold)
      acc = online_softmax.rescale(acc, alpha, per_query=_ROWS)
      forward_lib.await_values(spec, v_bar.at[slot], schedule)
      # Two-level: the tile's P V a fresh product, added in float32.
      pv = ops.mm(operand(p, slot), vt_smem.at[slot], a_in_smem=False,
                  transpose_b=True, acc=None if spec.two_level else acc)
      acc = acc + pv if spec.two_level else pv
      plgpu.barrier_arrive(v_free.at[slot])
      return m_i, l_i, acc

    # The software-pipelined loop (`Spec.intra_overlap`), as
    # `forward.forward`'s: step j issues Q K_j^T with P_{j-1} V_{j-1} and
    # runs tile j's softmax and P conversion while P_{j-1} V_{j-1} is in
    # flight. With per-key value factors P_j needs V_j's factors, which
    # land with V_j: step j then waits for V_j (with K_j) rather than for
    # V_{j-1}; else V_{j-1}, as in bfloat16.
    def ready(slot, prev):
      """The barriers of step j's tiles (`prev`: V_{j-1}'s slot, None for
      the first tile)."""
      if value_scales:
        return [k_bar.at[slot], v_bar.at[slot]]
      return [k_bar.at[slot]] + ([] if prev is None else [v_bar.at[prev]])

    def probs(j, slot, qk, m_i, l_i, *, masked):
      m_i, l_i, p, alpha = softmax(j, slot, qk, m_i, l_i, masked=masked)
      return m_i, l_i, operand(p, slot), alpha

    if spec.intra_overlap:
      zeros = ops.full((bq, bk), 0.0)
      out, lse = forward_lib.walk_keys_overlapped(
          spec, ops, sched_ref, b, row, wg, *forward_lib.pipelined_steps(
              spec, ops,
              slot_of=lambda j: kernel.rem(base + j - ulo, stages),
              q_tile=lambda: q_smem.at[kernel.stationary_in_step(spec, wg)],
              k_tile=lambda slot: k_smem.at[slot],
              v_operand=lambda slot: dict(b=vt_smem.at[slot],
                                          transpose_b=True),
              probs=probs, ready=ready,
              last_ready=lambda slot: [] if value_scales else [
                  v_bar.at[slot]],
              v_free=v_free, schedule=schedule,
              # The lse buffer is free until the unit's end.
              pin=(lse_smem.at[wg], 1),
              settle=None if interpret else own_registers),
          schedule, p0=zeros.astype(FP8) if interpret else p_operand(zeros),
          offset=p_offset)
    elif spec.soft_cap is None:  # Linear logits: the factor can fold.
      out, lse = forward_lib.walk_keys(
          spec, ops, sched_ref, b, row, wg,
          functools.partial(step, fold=True), schedule, offset=p_offset,
          alternate=(step, qmixed_ref[b, n, row * nc + wg]))
    else:
      out, lse = forward_lib.walk_keys(spec, ops, sched_ref, b, row, wg,
                                       step, schedule, offset=p_offset)
    o_own[...] = (out * omult_ref[b, n]).astype(out_dtype)
    lse_smem.at[wg][...] = lse
    kernel.store([(o_own, o_ref.at[b, rows, n]),
                  (lse_smem.at[wg], lse_ref.at[b, n, rows])])
    return base + sched_ref[b, row, 1] - ulo

  def producer_groups(r: kernel.Refs):
    k_ref, vt_ref = r.inputs[1], r.inputs[2]
    kpos_ref, kseg_ref = r.inputs[5], r.inputs[6]
    kcol_ref, vcol_ref = r.inputs[8], r.inputs[9]
    *_, k_smem, vt_smem, kmeta_smem, kcol_smem, vcol_smem = r.smem
    k_bar, v_bar, k_free, v_free = r.barriers[1:5]

    def k_copies(b, n, rep, j, slot):
      del rep
      cols = pl.ds(j * bk, bk)
      kh = n // spec.group
      return [
          (k_ref.at[b, cols, kh], k_smem.at[slot]),
          *kernel.meta_copies(spec, (kpos_ref, kseg_ref),
                              kernel.meta_at(spec, kmeta_smem, slot), b,
                              cols),
          *([(kcol_ref.at[b, kh, cols], kcol_smem.at[slot])]
            if key_scales else []),
      ]

    def v_copies(b, n, rep, j, slot):
      del rep
      cols = pl.ds(j * bk, bk)
      kh = n // spec.group
      return [
          (vt_ref.at[b, kh, :, cols], vt_smem.at[slot]),
          *([(vcol_ref.at[b, kh, cols], vcol_smem.at[slot])]
            if value_scales else []),
      ]

    return [(k_bar, k_free, k_copies), (v_bar, v_free, v_copies)]

  smem = (
      _smem(interpret, (nc, bq, h), FP8, h),  # Q
      _smem(interpret, (nc, bq, hv), out_dtype,
            hv * jnp.dtype(out_dtype).itemsize),  # output
      plgpu.SMEM((nc, bq), _F32),  # lse
      kernel.meta_smem(spec, (nc, bq)),  # query positions / segment ids
      plgpu.SMEM((nc, bq), _F32),  # query row factors
      _smem(interpret, (stages, bk, h), FP8, h),  # K ring
      _smem(interpret, (stages, hv, bk), FP8, bk),  # V^T ring
      kernel.meta_smem(spec, (stages, bk)),  # key metadata rings
      plgpu.SMEM((stages, bk), _F32),  # key scales ring
      plgpu.SMEM((stages, bk), _F32),  # value factors ring
  )
  barriers = (
      gpu_ops.barrier(nc, 2 + spec.num_meta),  # Q, row factors (+ meta).
      gpu_ops.barrier(stages, 1 + spec.num_meta + int(key_scales)),
      gpu_ops.barrier(stages, 1 + int(value_scales)),
      gpu_ops.barrier(stages, nc),  # K slot released.
      gpu_ops.barrier(stages, nc),  # V slot released.
      gpu_ops.barrier(1, nc),  # ping-pong schedule.
  )
  out_types = (
      jax.ShapeDtypeStruct(q.shape[:-1] + (hv,), out_dtype),
      jax.ShapeDtypeStruct((spec.batch, spec.num_heads, spec.q_len), _F32),
  )
  return kernel.launch(
      spec, name="pfa_mgpu_forward_fp8", units=units, reps=1,
      operands=(q, k, vt, q_pos, q_seg, kv_pos, kv_seg, q_row, k_col, v_col,
                out_mult, q_mixed, sched),
      out_types=out_types, smem_types=smem, barrier_types=barriers,
      unit=unit, producer_groups=producer_groups,
      cross_warp_reductions=False)

