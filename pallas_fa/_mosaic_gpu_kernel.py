"""Warp-specialised Mosaic GPU kernels of the `mosaic_gpu` backend (Hopper).

Three persistent kernels share one skeleton (FlashAttention-3, §3.1):

* a *producer* warpgroup streams tiles with TMA into a `stages`-deep ring of
  shared-memory slots; every slot has a "loaded" barrier (completed by the TMA
  transaction count) and a "consumed" barrier (one arrival per consumer);
* one or two *consumer* warpgroups each own a tile of rows that stays in
  shared memory for the whole unit of work, run the matmuls on wgmma and keep
  the softmax state in registers;
* every CTA walks a static round-robin list of units of work, so the grid is
  at most one CTA per SM and the prologue of one unit overlaps the tail of the
  previous one (the producer runs ahead across unit boundaries).

Kernels:

* `forward`: Q-stationary; streams K (+ key positions / segment ids) and V.
  Two consumers ping-pong through a shared barrier so that the softmax of one
  overlaps the matmuls of the other (FlashAttention-3, §3.2).
* `backward_dq`: Q-stationary; recomputes P from the logsumexp and
  accumulates dQ = dS K. No atomics: each dQ tile has exactly one owner.
* `backward_dkv`: KV-stationary; streams Q, dO, logsumexp and delta for every
  query head of the GQA group, so dK and dV come out summed over the group
  inside the kernel. It works in the transposed orientation (S^T = K Q^T) so
  that P^T and dS^T are register operands of the dV and dK wgmmas.

Each consumer splits the key (or query) tiles of a unit into a masked prefix,
an unmasked middle and a masked suffix, from the tile classification of
`masking.classify_blocks`; the unmasked middle skips the masking arithmetic,
and tiles outside the union of the consumers' non-empty ranges are never
loaded (causal, window, padding and sorted segments all shrink the loops).

The same kernel bodies run in the Mosaic GPU interpreter on CPU: `_Ops` swaps
the few GPU-only operations (wgmma, register layouts, layout-aware loads) for
plain jax.numpy equivalents; barriers, TMA copies, ring slots and the schedule
are executed as written.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa import masking
from pallas_fa import online_softmax

Array = Any
_F32 = jnp.float32
_I32 = jnp.int32

# Producer register budget (setmaxnreg, the hardware minimum); it only
# issues TMA copies.
_PRODUCER_REGISTERS = 24


def _consumer_registers(consumers: int) -> int:
  """setmaxnreg budget of a consumer thread. Three warpgroups launch with
  168 registers a thread (64K / 384), 504 in all: the 24-register producer
  leaves 2 x 240 for two consumers (FlashAttention-3's split); one consumer
  gets the hardware maximum, 256."""
  return 240 if consumers == 2 else 256


# --------------------------------------------------------------------------
# Version-dependent API (jax 0.10.x and 0.11.x).
# --------------------------------------------------------------------------


def interpret_params():
  """A Mosaic GPU interpreter parameter object, or None when unavailable."""
  for name in ("InterpretGPUParams", "InterpretParams"):
    cls = getattr(plgpu, name, None)
    if cls is not None:
      return cls()
  # jax 0.10 keeps the interpreter private.
  try:
    interpret_module = importlib.import_module(
        "jax._src.pallas.mosaic_gpu.interpret.params")
  except ImportError:
    return None
  cls = getattr(interpret_module, "InterpretGPUParams", None)
  return None if cls is None else cls()


def _load_whole(ref, *, layout):
  """`plgpu.load` of a whole ref: jax 0.10 wants the index `()`, jax 0.12
  takes none."""
  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def _kernel_call(body, *, name, out_types, scratch, interpret,
                 lowering_semantics=None, **mesh):
  """`plgpu.kernel` with whichever keyword names this jax version accepts.

  `name` becomes the kernel's symbol (its ptxas entry is
  `<name>_mosaic_gpu_kernel`), so profiles and compile reports tell the
  kernels apart. `lowering_semantics` ("lane", "warpgroup" or None for
  jax's default) applies to compiled kernels only.
  """
  params = inspect.signature(plgpu.kernel).parameters
  kwargs = dict(mesh, kernel_name=name)
  if "out_type" in params:
    kwargs["out_type"] = out_types
  else:
    kwargs["out_shape"] = out_types
  if "scratch_types" in params:
    kwargs["scratch_types"] = scratch
  else:
    kwargs["scratch_shapes"] = scratch
  if interpret is not None:
    kwargs["interpret"] = interpret
  else:
    compiler = dict(approx_math=True)
    if lowering_semantics is not None:
      compiler["lowering_semantics"] = getattr(
          plgpu.LoweringSemantics, lowering_semantics.capitalize())
    kwargs["compiler_params"] = plgpu.CompilerParams(**compiler)
  return plgpu.kernel(body, **kwargs)


# --------------------------------------------------------------------------
# Static description of one kernel launch.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
  """Static (hashable) parameters of one kernel launch.

  Attributes:
    batch: B.
    q_len: padded query length (a multiple of the query tiles).
    kv_len: padded key length (a multiple of the key tiles).
    num_heads: N.
    num_kv_heads: K.
    head_dim: padded head dim (a multiple of 64, at most 256).
    dtype: bfloat16 or float16.
    block_q: query rows per consumer tile.
    block_kv: key rows per consumer tile.
    stages: depth of the shared-memory ring.
    consumers: consumer warpgroups per CTA (1 or 2).
    num_ctas: persistent grid size.
    pingpong: forward only: alternate the two consumers on the tensor cores.
    is_causal: causal masking on positions.
    window: (left, right) or None; a None side is unbounded.
    has_segments: whether segment ids (padding included) take part.
    scale: logit scale.
    soft_cap: logit soft cap or None.
    interpret: run in the Mosaic GPU interpreter (CPU).
    lowering_semantics: "lane", "warpgroup" or None (jax's default).
  """

  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: Any
  block_q: int
  block_kv: int
  stages: int
  consumers: int = 2
  num_ctas: int = 1
  pingpong: bool = True
  is_causal: bool = False
  window: tuple[int | None, int | None] | None = None
  has_segments: bool = False
  scale: float = 1.0
  soft_cap: float | None = None
  interpret: bool = False
  lowering_semantics: str | None = None

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def need_positions(self) -> bool:
    return self.is_causal or self.window is not None

  @property
  def masked(self) -> bool:
    return self.need_positions or self.has_segments

  @property
  def num_q_tiles(self) -> int:
    return self.q_len // self.block_q

  @property
  def num_kv_tiles(self) -> int:
    return self.kv_len // self.block_kv


# --------------------------------------------------------------------------
# The shared softmax math in explicit-layout form.
#
# Mosaic GPU register arrays cannot be reshaped to [rows, 1], so the
# `x[..., None]` broadcasts of `online_softmax` are spelled as
# `lax.broadcast_in_dim` here. Each function is the same formula as its
# `online_softmax` namesake (tests check they agree elementwise); `axis` names
# the axis of the tile that indexes queries (0, or 1 in the transposed
# orientation of the dK/dV kernel).
# --------------------------------------------------------------------------


def expand(x: Array, shape: tuple[int, ...], axis: int) -> Array:
  """Broadcasts a per-row (axis=0) or per-column (axis=1) vector to `shape`."""
  return lax.broadcast_in_dim(x, shape, (axis,))


def softmax_update(m_i, l_i, s):
  """`online_softmax.update` with exp2; s is [rows, keys] in base 2."""
  m_new = jnp.maximum(m_i, s.max(axis=1))
  m_safe = jnp.where(m_new == online_softmax.MASK_VALUE, 0.0, m_new)
  alpha = jnp.exp2(m_i - m_safe)
  p = jnp.exp2(s - expand(m_safe, s.shape, 0))
  l_new = alpha * l_i + p.sum(axis=1)
  return m_new, l_new, p, alpha


def softmax_finalize(m_i, l_i, acc):
  """`online_softmax.finalize_base2`: (out, lse in natural log)."""
  seen = l_i > 0
  l_safe = jnp.where(seen, l_i, 1.0)
  out = acc / expand(l_safe, acc.shape, 0)
  lse = jnp.where(
      seen,
      (m_i + jnp.log2(l_safe)) * online_softmax.LN_2,
      online_softmax.MASK_VALUE,
  )
  return out, lse


def lse_for_kernel(lse: Array) -> Array:
  """Natural-log lse -> base-2 with the `probs_from_lse` guard applied.

  Rows without a visible key (lse = -inf) become +inf so that
  exp2(s - lse) is 0 for every logit of the row, masked or not.
  """
  return jnp.where(
      lse == online_softmax.MASK_VALUE, jnp.inf, lse * online_softmax.LOG2_E
  )


def probs(s, lse2, axis: int):
  """`online_softmax.probs_from_lse` (exp2) with lse from `lse_for_kernel`."""
  return jnp.exp2(s - expand(lse2, s.shape, axis))


def dlogits(p, dp, delta, axis: int):
  """`online_softmax.logits_grad`: dS = P * (dP - delta)."""
  return p * (dp - expand(delta, p.shape, axis))


def _logits(spec: Spec, qk):
  """(s in base 2, soft-capped natural logits or None) of a qk tile."""
  if spec.soft_cap is None:
    return qk * (spec.scale * online_softmax.LOG2_E), None
  capped = online_softmax.soft_cap(qk * spec.scale, spec.soft_cap)
  return capped * online_softmax.LOG2_E, capped


def _logits_grad_to_qk(spec: Spec, ds, capped):
  """Chains dS (w.r.t. the capped logits) back to the raw q.k products."""
  ds = online_softmax.soft_cap_grad(ds, capped, spec.soft_cap)
  return ds * spec.scale


def _visible(spec: Spec, shape, axis, q_pos, q_seg, kv_pos, kv_seg):
  """`masking.visible` on a tile; axis indexes queries (0 or 1)."""
  other = 1 - axis
  return masking.visible(
      is_causal=spec.is_causal,
      window=spec.window,
      q_pos=None if q_pos is None else expand(q_pos, shape, axis),
      kv_pos=None if kv_pos is None else expand(kv_pos, shape, other),
      q_seg=None if q_seg is None else expand(q_seg, shape, axis),
      kv_seg=None if kv_seg is None else expand(kv_seg, shape, other),
  )


# --------------------------------------------------------------------------
# Compiled / interpreted operations.
# --------------------------------------------------------------------------


class _Ops:
  """The GPU-only operations, with interpreter equivalents.

  The interpreter executes barriers, TMA copies and ref accesses as on the
  GPU but has no register layouts and no transposed wgmma operands; there
  the matmuls are jnp.dot on the loaded tiles. Everything else in a kernel
  body is shared by both modes.
  """

  def __init__(self, interpret: bool):
    self.interpret = interpret

  def full(self, shape, value, dtype=_F32):
    """A register array in the wgmma accumulator layout."""
    x = jnp.full(shape, value, dtype)
    if self.interpret:
      return x
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)

  def full_vector(self, size, value, axis):
    """A per-row (axis 0) or per-column (axis 1) vector of a wgmma tile."""
    x = jnp.full((size,), value, _F32)
    if self.interpret:
      return x
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1 - axis))

  def load_vector(self, ref, axis):
    """Loads a [size] SMEM vector laid out along `axis` of a wgmma tile."""
    if self.interpret:
      return ref[...]
    return _load_whole(ref, layout=plgpu.Layout.WGMMA.reduce(1 - axis))

  def set_max_registers(self, n, action):
    if not self.interpret:
      plgpu.set_max_registers(n, action=action)

  def mm(self, a, b, *, a_in_smem=True, transpose_b=False, acc=None,
         between: Callable[[], None] | None = None):
    """acc + a @ b (or a @ b^T) in float32.

    Args:
      a: [M, K] SMEM ref (`a_in_smem`) or register array.
      b: [K, N] SMEM ref, or [N, K] with `transpose_b`.
      a_in_smem: whether `a` is a ref.
      transpose_b: use b^T.
      acc: float32 [M, N] accumulator to add to, or None.
      between: called after the wgmma is issued and before its result is
        awaited (the ping-pong schedule barrier).

    Returns:
      float32 [M, N].
    """
    if self.interpret:
      a_val = a[...] if a_in_smem else a
      b_val = b[...]
      if transpose_b:
        b_val = b_val.T
      out = jnp.dot(a_val, b_val, preferred_element_type=_F32)
      if between is not None:
        between()
      return out if acc is None else acc + out
    b_op = plgpu.transpose_ref(b, (1, 0)) if transpose_b else b
    shape = (a.shape[0], b.shape[0] if transpose_b else b.shape[1])

    if acc is None:
      def fresh(acc_ref):
        plgpu.wgmma(acc_ref, a, b_op)
        if between is not None:
          between()
        return acc_ref[...]

      return pl.run_scoped(fresh, plgpu.ACC(shape, _F32))

    def accumulate(acc_ref):
      plgpu.wgmma(acc_ref, a, b_op)
      if between is not None:
        between()

    return pl.run_state(accumulate)(plgpu.ACC.init(acc))

  def mm_pair(self, first: dict[str, Any], second: dict[str, Any]):
    """Two independent `mm`s (keyword dicts) issued back to back before
    either is awaited, so that their wgmma latencies overlap."""
    if self.interpret:
      return self.mm(**first), self.mm(**second)
    operands = []
    for m in (first, second):
      b = m["b"]
      transpose_b = m.get("transpose_b", False)
      shape = (m["a"].shape[0], b.shape[0] if transpose_b else b.shape[1])
      acc = m.get("acc")
      operands.append((
          m["a"], plgpu.transpose_ref(b, (1, 0)) if transpose_b else b,
          self.full(shape, 0.0) if acc is None else acc))

    def issue(acc_refs):
      for acc_ref, (a, b, _) in zip(acc_refs, operands, strict=True):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(issue)(
        tuple(plgpu.ACC.init(acc) for _, _, acc in operands))


def _smem(spec: Spec, shape, dtype, swizzled: bool):
  """SMEM scratch; 2-D+ bf16/f16 tiles use the 128-byte-swizzled layout."""
  if swizzled and not spec.interpret:
    transforms = (
        plgpu.TilingTransform((8, 64)),
        plgpu.SwizzleTransform(128),
    )
    return plgpu.SMEM(shape, dtype, transforms=transforms)
  return plgpu.SMEM(shape, dtype)


def _barrier(num_barriers, num_arrivals=1):
  return plgpu.Barrier(num_arrivals=num_arrivals, num_barriers=num_barriers)


# --------------------------------------------------------------------------
# The shared skeleton: units of work, producer loop.
# --------------------------------------------------------------------------


class _Units:
  """Static round-robin assignment of units of work to persistent CTAs.

  A unit is (batch, head, row tile) with `rows` row tiles per batch x head;
  `reverse` visits row tiles last-first so that (for causal attention) the
  longest units start first.
  """

  def __init__(self, batch, heads, rows, num_ctas, reverse):
    self.batch, self.heads, self.rows = batch, heads, rows
    self.total = batch * heads * rows
    self.num_ctas = num_ctas
    self.reverse = reverse

  def count(self, cta):
    """Units handled by `cta` (traced)."""
    return (self.total - cta + self.num_ctas - 1) // self.num_ctas

  def decode(self, cta, t):
    """(b, head, row tile) of this CTA's t-th unit."""
    u = cta + t * self.num_ctas
    row = lax.rem(u, self.rows)
    bh = lax.div(u, self.rows)
    head = lax.rem(bh, self.heads)
    b = lax.div(bh, self.heads)
    if self.reverse:
      row = self.rows - 1 - row
    return b, head, row


def _produce(*, units, cta, reps, sched_ref, groups, stages):
  """The producer warpgroup: streams every step's tiles into the ring.

  Args:
    units: the `_Units` of the kernel.
    cta: this CTA's index.
    reps: steps are repeated `reps` times per unit (the GQA group of dK/dV).
    sched_ref: int32 [B, rows, 2 + 2 * consumers]; [ulo, uhi) is the union
      of the consumers' tile ranges.
    groups: list of (loaded barriers, consumed barriers, copies) where
      copies(b, head, rep, j, slot) returns [(gmem view, smem view)].
    stages: ring depth.
  """

  def unit(t, base):
    b, head, row = units.decode(cta, t)
    ulo = sched_ref[b, row, 0]
    uhi = sched_ref[b, row, 1]
    length = uhi - ulo

    def rep(r, base):
      def load(j, _):
        step = base + j - ulo
        slot = lax.rem(step, stages)
        for loaded, consumed, copies in groups:
          # A slot is refilled only once every consumer released it.
          @pl.when(step >= stages)
          def _(consumed=consumed):
            plgpu.barrier_wait(consumed.at[slot])

          for src, dst in copies(b, head, r, j, slot):
            plgpu.copy_gmem_to_smem(src, dst, loaded.at[slot])

      lax.fori_loop(ulo, uhi, load, None)
      return base + length

    return lax.fori_loop(0, reps, rep, base)

  total = lax.fori_loop(0, units.count(cta), unit, jnp.int32(0))

  # Drain: observe the release of the last `stages` steps, so that every
  # phase of every consumed barrier is awaited exactly once.
  def drain(step, _):
    slot = lax.rem(step, stages)
    for _, consumed, _ in groups:
      plgpu.barrier_wait(consumed.at[slot])

  lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)


def _phases(sched_ref, b, row, wg, step_fn, carry, masked: bool):
  """Runs step_fn over [ulo, uhi) as masked / unmasked / masked phases."""
  ulo = sched_ref[b, row, 0]
  uhi = sched_ref[b, row, 1]
  if not masked:
    return lax.fori_loop(
        ulo, uhi, functools.partial(step_fn, masked=False), carry)
  flo = sched_ref[b, row, 2 + 2 * wg]
  fhi = sched_ref[b, row, 3 + 2 * wg]
  carry = lax.fori_loop(
      ulo, flo, functools.partial(step_fn, masked=True), carry)
  carry = lax.fori_loop(
      flo, fhi, functools.partial(step_fn, masked=False), carry)
  return lax.fori_loop(
      fhi, uhi, functools.partial(step_fn, masked=True), carry)


def _kv_stream(spec: Spec, k_refs, k_rings, v_ref, v_ring):
  """Copy lists of the Q-stationary kernels: K (+ metadata), then V.

  Args:
    spec: launch parameters.
    k_refs: (k, key positions, key segment ids) GMEM refs.
    k_rings: the matching SMEM rings.
    v_ref: the V GMEM ref.
    v_ring: the V SMEM ring.

  Returns:
    (k_copies, v_copies) for `_produce`; query head n reads K/V head
    n // group (GQA without repeating K/V).
  """
  bk = spec.block_kv
  (k_ref, kpos_ref, kseg_ref), (k_smem, kpos_smem, kseg_smem) = k_refs, k_rings

  def k_copies(b, n, r, j, slot):
    del r
    cols = pl.ds(j * bk, bk)
    out = [(k_ref.at[b, cols, n // spec.group], k_smem.at[slot])]
    if spec.need_positions:
      out.append((kpos_ref.at[b, cols], kpos_smem.at[slot]))
    if spec.has_segments:
      out.append((kseg_ref.at[b, cols], kseg_smem.at[slot]))
    return out

  def v_copies(b, n, r, j, slot):
    del r
    cols = pl.ds(j * bk, bk)
    return [(v_ref.at[b, cols, n // spec.group], v_ring.at[slot])]

  return k_copies, v_copies


def _mesh(spec: Spec):
  return dict(
      grid=(spec.num_ctas,),
      grid_names=("cta",),
      num_threads=spec.consumers + 1,
      thread_name="wg",
  )


# --------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------


def forward(spec: Spec, q, k, v, q_pos, q_seg, kv_pos, kv_seg, sched):
  """The forward kernel.

  Args:
    spec: launch parameters (two consumers; block_q rows each).
    q: [B, Tp, N, Hp]; padded rows zeroed.
    k: [B, Sp, K, Hp]; padded rows zeroed.
    v: [B, Sp, K, Hp]; padded rows zeroed.
    q_pos: int32 [B, Tp].
    q_seg: int32 [B, Tp] (ignored without segments).
    kv_pos: int32 [B, Sp].
    kv_seg: int32 [B, Sp] (ignored without segments).
    sched: int32 [B, Tp / (2 block_q), 6], see `_produce` and `_phases`.

  Returns:
    (out [B, Tp, N, Hp] in q.dtype, lse float32 [B, N, Tp], natural log).
  """
  ops = _Ops(spec.interpret)
  bq, bk, h, stages = spec.block_q, spec.block_kv, spec.head_dim, spec.stages
  nc = spec.consumers
  units = _Units(
      spec.batch, spec.num_heads, spec.q_len // (nc * bq), spec.num_ctas,
      reverse=spec.is_causal)
  n_meta = int(spec.need_positions) + int(spec.has_segments)

  def body(q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref,
           sched_ref, o_ref, lse_ref, smem, barriers):
    (qo_smem, lse_smem, qpos_smem, qseg_smem, k_smem, v_smem, kpos_smem,
     kseg_smem) = smem
    q_bar, k_bar, v_bar, k_free, v_free, schedule = barriers
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")

    def perform_schedule_barrier():
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

    @pl.when(wg < nc)
    def _consumer():
      ops.set_max_registers(_consumer_registers(nc), "increase")
      qo = qo_smem.at[wg]

      def unit(t, base):
        b, n, row = units.decode(cta, t)
        ulo = sched_ref[b, row, 0]
        q0 = (row * nc + wg) * bq
        rows = pl.ds(q0, bq)
        # The previous unit's output store must have read qo / lse.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, n], qo, q_bar.at[wg])
        if spec.need_positions:
          plgpu.copy_gmem_to_smem(
              qpos_ref.at[b, rows], qpos_smem.at[wg], q_bar.at[wg])
        if spec.has_segments:
          plgpu.copy_gmem_to_smem(
              qseg_ref.at[b, rows], qseg_smem.at[wg], q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        q_p = q_s = None
        if spec.need_positions:
          q_p = ops.load_vector(qpos_smem.at[wg], 0)
        if spec.has_segments:
          q_s = ops.load_vector(qseg_smem.at[wg], 0)

        def step(j, carry, *, masked):
          m_i, l_i, acc = carry
          slot = lax.rem(base + j - ulo, stages)
          plgpu.barrier_wait(k_bar.at[slot])
          qk = ops.mm(
              qo, k_smem.at[slot], transpose_b=True,
              between=perform_schedule_barrier if spec.pingpong else None,
          )  # [bq, bk]
          k_p = k_s = None
          if masked and spec.need_positions:
            k_p = ops.load_vector(kpos_smem.at[slot], 1)
          if masked and spec.has_segments:
            k_s = ops.load_vector(kseg_smem.at[slot], 1)
          plgpu.barrier_arrive(k_free.at[slot])
          s, _ = _logits(spec, qk)
          if masked:
            s = online_softmax.apply_mask(
                s, _visible(spec, s.shape, 0, q_p, q_s, k_p, k_s))
          m_i, l_i, p, alpha = softmax_update(m_i, l_i, s)
          acc = acc * expand(alpha, acc.shape, 0)
          p = p.astype(spec.dtype)
          if spec.pingpong:
            # Done with the softmax: let the other consumer's matmuls run
            # and wait for the tensor cores to be ours again.
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(schedule)
          else:
            plgpu.barrier_wait(v_bar.at[slot])
          acc = ops.mm(p, v_smem.at[slot], a_in_smem=False, acc=acc)
          plgpu.barrier_arrive(v_free.at[slot])
          return m_i, l_i, acc

        carry = (
            ops.full_vector(bq, online_softmax.MASK_VALUE, 0),
            ops.full_vector(bq, 0.0, 0),
            ops.full((bq, h), 0.0),
        )
        if spec.pingpong:
          pl.when(wg == 1)(perform_schedule_barrier)
        m_i, l_i, acc = _phases(
            sched_ref, b, row, wg, step, carry, spec.masked)
        if spec.pingpong:
          pl.when(wg == 0)(perform_schedule_barrier)
        out, lse = softmax_finalize(m_i, l_i, acc)
        qo[...] = out.astype(spec.dtype)
        lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo, o_ref.at[b, rows, n], commit_group=False)
        plgpu.copy_smem_to_gmem(
            lse_smem.at[wg], lse_ref.at[b, n, rows], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        return base + sched_ref[b, row, 1] - ulo

      lax.fori_loop(0, units.count(cta), unit, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == nc)
    def _producer():
      ops.set_max_registers(_PRODUCER_REGISTERS, "decrease")

      k_copies, v_copies = _kv_stream(
          spec, (k_ref, kpos_ref, kseg_ref), (k_smem, kpos_smem, kseg_smem),
          v_ref, v_smem)
      _produce(
          units=units, cta=cta, reps=1, sched_ref=sched_ref, stages=stages,
          groups=[(k_bar, k_free, k_copies), (v_bar, v_free, v_copies)])

  smem = (
      _smem(spec, (nc, bq, h), spec.dtype, True),  # Q, then the output.
      plgpu.SMEM((nc, bq), _F32),  # lse
      plgpu.SMEM((nc, bq), _I32),  # query positions
      plgpu.SMEM((nc, bq), _I32),  # query segment ids
      _smem(spec, (stages, bk, h), spec.dtype, True),  # K ring
      _smem(spec, (stages, bk, h), spec.dtype, True),  # V ring
      plgpu.SMEM((stages, bk), _I32),  # key positions ring
      plgpu.SMEM((stages, bk), _I32),  # key segment ids ring
  )
  barriers = (
      _barrier(nc, 1 + n_meta),  # Q (+ metadata) loaded, per consumer.
      _barrier(stages, 1 + n_meta),  # K (+ metadata) loaded.
      _barrier(stages),  # V loaded.
      _barrier(stages, nc),  # K slot released.
      _barrier(stages, nc),  # V slot released.
      _barrier(1, nc),  # ping-pong schedule.
  )
  out_types = (
      jax.ShapeDtypeStruct(q.shape, spec.dtype),
      jax.ShapeDtypeStruct((spec.batch, spec.num_heads, spec.q_len), _F32),
  )
  call = _kernel_call(
      body, name="pfa_mgpu_forward", out_types=out_types,
      scratch=[smem, barriers],
      interpret=interpret_params() if spec.interpret else None,
      lowering_semantics=spec.lowering_semantics, **_mesh(spec))
  return call(q, k, v, q_pos, q_seg, kv_pos, kv_seg, sched)


# --------------------------------------------------------------------------
# Backward: dQ.
# --------------------------------------------------------------------------


def backward_dq(spec: Spec, q, k, v, do, lse2, delta, q_pos, q_seg, kv_pos,
                kv_seg, sched):
  """The dQ kernel (Q-stationary; no atomics).

  Args:
    spec: launch parameters (`consumers` tiles of block_q rows per unit).
    q: [B, Tp, N, Hp].
    k: [B, Sp, K, Hp].
    v: [B, Sp, K, Hp].
    do: [B, Tp, N, Hp]; padded rows zeroed.
    lse2: float32 [B, N, Tp] from `lse_for_kernel`.
    delta: float32 [B, N, Tp].
    q_pos: int32 [B, Tp].
    q_seg: int32 [B, Tp].
    kv_pos: int32 [B, Sp].
    kv_seg: int32 [B, Sp].
    sched: int32 [B, Tp / (consumers block_q), 2 + 2 consumers].

  Returns:
    dq [B, Tp, N, Hp] in q.dtype.
  """
  ops = _Ops(spec.interpret)
  bq, bk, h, stages = spec.block_q, spec.block_kv, spec.head_dim, spec.stages
  nc = spec.consumers
  units = _Units(
      spec.batch, spec.num_heads, spec.q_len // (nc * bq), spec.num_ctas,
      reverse=spec.is_causal)
  n_meta = int(spec.need_positions) + int(spec.has_segments)

  def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref,
           qseg_ref, kpos_ref, kseg_ref, sched_ref, dq_ref, smem, barriers):
    (q_smem, do_smem, lse_smem, delta_smem, qpos_smem, qseg_smem, k_smem,
     v_smem, kpos_smem, kseg_smem) = smem
    q_bar, k_bar, v_bar, k_free, v_free = barriers
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")

    @pl.when(wg < nc)
    def _consumer():
      ops.set_max_registers(_consumer_registers(nc), "increase")
      q_own, do_own = q_smem.at[wg], do_smem.at[wg]

      def unit(t, base):
        b, n, row = units.decode(cta, t)
        ulo = sched_ref[b, row, 0]
        rows = pl.ds((row * nc + wg) * bq, bq)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        copies = [
            (q_ref.at[b, rows, n], q_own),
            (do_ref.at[b, rows, n], do_own),
            (lse_ref.at[b, n, rows], lse_smem.at[wg]),
            (delta_ref.at[b, n, rows], delta_smem.at[wg]),
        ]
        if spec.need_positions:
          copies.append((qpos_ref.at[b, rows], qpos_smem.at[wg]))
        if spec.has_segments:
          copies.append((qseg_ref.at[b, rows], qseg_smem.at[wg]))
        for src, dst in copies:
          plgpu.copy_gmem_to_smem(src, dst, q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        lse2 = ops.load_vector(lse_smem.at[wg], 0)
        delta = ops.load_vector(delta_smem.at[wg], 0)
        q_p = q_s = None
        if spec.need_positions:
          q_p = ops.load_vector(qpos_smem.at[wg], 0)
        if spec.has_segments:
          q_s = ops.load_vector(qseg_smem.at[wg], 0)

        def step(j, dq, *, masked):
          slot = lax.rem(base + j - ulo, stages)
          plgpu.barrier_wait(k_bar.at[slot])
          plgpu.barrier_wait(v_bar.at[slot])
          qk, dp = ops.mm_pair(  # [bq, bk] each
              dict(a=q_own, b=k_smem.at[slot], transpose_b=True),
              dict(a=do_own, b=v_smem.at[slot], transpose_b=True))
          plgpu.barrier_arrive(v_free.at[slot])
          s, capped = _logits(spec, qk)
          if masked:
            k_p = k_s = None
            if spec.need_positions:
              k_p = ops.load_vector(kpos_smem.at[slot], 1)
            if spec.has_segments:
              k_s = ops.load_vector(kseg_smem.at[slot], 1)
            s = online_softmax.apply_mask(
                s, _visible(spec, s.shape, 0, q_p, q_s, k_p, k_s))
          p = probs(s, lse2, 0)
          ds = _logits_grad_to_qk(spec, dlogits(p, dp, delta, 0), capped)
          dq = ops.mm(
              ds.astype(spec.dtype), k_smem.at[slot], a_in_smem=False,
              acc=dq)
          plgpu.barrier_arrive(k_free.at[slot])
          return dq

        dq = _phases(
            sched_ref, b, row, wg, step, ops.full((bq, h), 0.0),
            spec.masked)
        q_own[...] = dq.astype(spec.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_own, dq_ref.at[b, rows, n])
        return base + sched_ref[b, row, 1] - ulo

      lax.fori_loop(0, units.count(cta), unit, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == nc)
    def _producer():
      ops.set_max_registers(_PRODUCER_REGISTERS, "decrease")

      k_copies, v_copies = _kv_stream(
          spec, (k_ref, kpos_ref, kseg_ref), (k_smem, kpos_smem, kseg_smem),
          v_ref, v_smem)
      _produce(
          units=units, cta=cta, reps=1, sched_ref=sched_ref, stages=stages,
          groups=[(k_bar, k_free, k_copies), (v_bar, v_free, v_copies)])

  smem = (
      _smem(spec, (nc, bq, h), spec.dtype, True),  # Q, then dQ.
      _smem(spec, (nc, bq, h), spec.dtype, True),  # dO
      plgpu.SMEM((nc, bq), _F32),  # lse (base 2)
      plgpu.SMEM((nc, bq), _F32),  # delta
      plgpu.SMEM((nc, bq), _I32),  # query positions
      plgpu.SMEM((nc, bq), _I32),  # query segment ids
      _smem(spec, (stages, bk, h), spec.dtype, True),  # K ring
      _smem(spec, (stages, bk, h), spec.dtype, True),  # V ring
      plgpu.SMEM((stages, bk), _I32),  # key positions ring
      plgpu.SMEM((stages, bk), _I32),  # key segment ids ring
  )
  barriers = (
      _barrier(nc, 4 + n_meta),  # Q, dO, lse, delta (+ metadata) loaded.
      _barrier(stages, 1 + n_meta),  # K (+ metadata) loaded.
      _barrier(stages),  # V loaded.
      _barrier(stages, nc),  # K slot released.
      _barrier(stages, nc),  # V slot released.
  )
  call = _kernel_call(
      body, name="pfa_mgpu_dq",
      out_types=jax.ShapeDtypeStruct(q.shape, spec.dtype),
      scratch=[smem, barriers],
      interpret=interpret_params() if spec.interpret else None,
      lowering_semantics=spec.lowering_semantics, **_mesh(spec))
  return call(q, k, v, do, lse2, delta, q_pos, q_seg, kv_pos, kv_seg, sched)


# --------------------------------------------------------------------------
# Backward: dK and dV.
# --------------------------------------------------------------------------


def backward_dkv(spec: Spec, q, k, v, do, lse2, delta, q_pos, q_seg, kv_pos,
                 kv_seg, sched, *, outputs=("dk", "dv")):
  """The dK/dV kernel (KV-stationary; GQA group summed inside).

  Works on S^T = K Q^T so that P^T and dS^T are register operands of the
  dV += P^T dO and dK += dS^T Q wgmmas. With `outputs` = ("dv",) or ("dk",)
  only one accumulator is kept (for head dims whose two float32 accumulators
  would not fit the register file); the caller then runs the kernel twice.

  Args:
    spec: launch parameters (`consumers` tiles of block_kv keys per unit).
    q: [B, Tp, N, Hp].
    k: [B, Sp, K, Hp].
    v: [B, Sp, K, Hp].
    do: [B, Tp, N, Hp]; padded rows zeroed.
    lse2: float32 [B, N, Tp] from `lse_for_kernel`.
    delta: float32 [B, N, Tp].
    q_pos: int32 [B, Tp].
    q_seg: int32 [B, Tp].
    kv_pos: int32 [B, Sp].
    kv_seg: int32 [B, Sp].
    sched: int32 [B, Sp / (consumers block_kv), 2 + 2 consumers]; ranges of
      query tiles.
    outputs: which of "dk", "dv" to compute.

  Returns:
    A tuple with the requested of dk, dv, each [B, Sp, K, Hp] in k.dtype.
  """
  ops = _Ops(spec.interpret)
  bq, bk, h, stages = spec.block_q, spec.block_kv, spec.head_dim, spec.stages
  nc, g = spec.consumers, spec.group
  want_dk, want_dv = "dk" in outputs, "dv" in outputs
  units = _Units(
      spec.batch, spec.num_kv_heads, spec.kv_len // (nc * bk),
      spec.num_ctas, reverse=False)
  n_meta = int(spec.need_positions) + int(spec.has_segments)

  def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref,
           qseg_ref, kpos_ref, kseg_ref, sched_ref, *rest):
    out_refs = rest[: len(outputs)]
    smem, barriers = rest[len(outputs):]
    (k_smem, v_smem, kpos_smem, kseg_smem, q_smem, do_smem, lse_smem,
     delta_smem, qpos_smem, qseg_smem) = smem
    kv_bar, q_bar, do_bar, q_free, do_free = barriers
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")

    @pl.when(wg < nc)
    def _consumer():
      ops.set_max_registers(_consumer_registers(nc), "increase")
      k_own, v_own = k_smem.at[wg], v_smem.at[wg]

      def unit(t, base):
        b, kh, row = units.decode(cta, t)
        ulo = sched_ref[b, row, 0]
        length = sched_ref[b, row, 1] - ulo
        keys = pl.ds((row * nc + wg) * bk, bk)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        copies = [
            (k_ref.at[b, keys, kh], k_own),
            (v_ref.at[b, keys, kh], v_own),
        ]
        if spec.need_positions:
          copies.append((kpos_ref.at[b, keys], kpos_smem.at[wg]))
        if spec.has_segments:
          copies.append((kseg_ref.at[b, keys], kseg_smem.at[wg]))
        for src, dst in copies:
          plgpu.copy_gmem_to_smem(src, dst, kv_bar.at[wg])
        plgpu.barrier_wait(kv_bar.at[wg])
        k_p = k_s = None
        if spec.need_positions:
          k_p = ops.load_vector(kpos_smem.at[wg], 0)
        if spec.has_segments:
          k_s = ops.load_vector(kseg_smem.at[wg], 0)

        def group_member(r, carry):
          rep_base = base + r * length

          def step(i, carry, *, masked):
            dk, dv = carry
            slot = lax.rem(rep_base + i - ulo, stages)
            plgpu.barrier_wait(q_bar.at[slot])
            qk_t = ops.mm(k_own, q_smem.at[slot], transpose_b=True)  # [bk, bq]
            s_t, capped_t = _logits(spec, qk_t)
            lse2 = ops.load_vector(lse_smem.at[slot], 1)
            if masked:
              q_p = q_s = None
              if spec.need_positions:
                q_p = ops.load_vector(qpos_smem.at[slot], 1)
              if spec.has_segments:
                q_s = ops.load_vector(qseg_smem.at[slot], 1)
              s_t = online_softmax.apply_mask(
                  s_t, _visible(spec, s_t.shape, 1, q_p, q_s, k_p, k_s))
            p_t = probs(s_t, lse2, 1)
            plgpu.barrier_wait(do_bar.at[slot])
            dv_update = dict(a=p_t.astype(spec.dtype), b=do_smem.at[slot],
                             a_in_smem=False, acc=dv)
            dp_t_fresh = dict(a=v_own, b=do_smem.at[slot], transpose_b=True)
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
              ds_t = _logits_grad_to_qk(
                  spec, dlogits(p_t, dp_t, delta, 1), capped_t)
              dk = ops.mm(
                  ds_t.astype(spec.dtype), q_smem.at[slot], a_in_smem=False,
                  acc=dk)
            plgpu.barrier_arrive(q_free.at[slot])
            return dk, dv

          return _phases(sched_ref, b, row, wg, step, carry, spec.masked)

        zeros = ops.full((bk, h), 0.0)
        carry = (zeros if want_dk else None, zeros if want_dv else None)
        dk, dv = lax.fori_loop(0, g, group_member, carry)
        results = []
        if want_dk:
          k_own[...] = dk.astype(spec.dtype)
          results.append(k_own)
        if want_dv:
          v_own[...] = dv.astype(spec.dtype)
          results.append(v_own)
        plgpu.commit_smem()
        for src, dst in zip(results, out_refs, strict=True):
          plgpu.copy_smem_to_gmem(
              src, dst.at[b, keys, kh], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        return base + g * length

      lax.fori_loop(0, units.count(cta), unit, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == nc)
    def _producer():
      ops.set_max_registers(_PRODUCER_REGISTERS, "decrease")

      def q_copies(b, kh, r, i, slot):
        n = kh * g + r
        rows = pl.ds(i * bq, bq)
        out = [
            (q_ref.at[b, rows, n], q_smem.at[slot]),
            (lse_ref.at[b, n, rows], lse_smem.at[slot]),
        ]
        if spec.need_positions:
          out.append((qpos_ref.at[b, rows], qpos_smem.at[slot]))
        if spec.has_segments:
          out.append((qseg_ref.at[b, rows], qseg_smem.at[slot]))
        return out

      def do_copies(b, kh, r, i, slot):
        n = kh * g + r
        rows = pl.ds(i * bq, bq)
        return [
            (do_ref.at[b, rows, n], do_smem.at[slot]),
            (delta_ref.at[b, n, rows], delta_smem.at[slot]),
        ]

      _produce(
          units=units, cta=cta, reps=g, sched_ref=sched_ref, stages=stages,
          groups=[(q_bar, q_free, q_copies), (do_bar, do_free, do_copies)])

  smem = (
      _smem(spec, (nc, bk, h), spec.dtype, True),  # K, then dK.
      _smem(spec, (nc, bk, h), spec.dtype, True),  # V, then dV.
      plgpu.SMEM((nc, bk), _I32),  # key positions
      plgpu.SMEM((nc, bk), _I32),  # key segment ids
      _smem(spec, (stages, bq, h), spec.dtype, True),  # Q ring
      _smem(spec, (stages, bq, h), spec.dtype, True),  # dO ring
      plgpu.SMEM((stages, bq), _F32),  # lse ring
      plgpu.SMEM((stages, bq), _F32),  # delta ring
      plgpu.SMEM((stages, bq), _I32),  # query positions ring
      plgpu.SMEM((stages, bq), _I32),  # query segment ids ring
  )
  barriers = (
      _barrier(nc, 2 + n_meta),  # K, V (+ metadata) loaded.
      _barrier(stages, 2 + n_meta),  # Q, lse (+ metadata) loaded.
      _barrier(stages, 2),  # dO, delta loaded.
      _barrier(stages, nc),  # Q slot released.
      _barrier(stages, nc),  # dO slot released.
  )
  out_types = tuple(jax.ShapeDtypeStruct(k.shape, spec.dtype) for _ in outputs)
  call = _kernel_call(
      body, name="pfa_mgpu_" + "_".join(outputs),
      out_types=out_types, scratch=[smem, barriers],
      interpret=interpret_params() if spec.interpret else None,
      lowering_semantics=spec.lowering_semantics, **_mesh(spec))
  return call(q, k, v, do, lse2, delta, q_pos, q_seg, kv_pos, kv_seg, sched)
