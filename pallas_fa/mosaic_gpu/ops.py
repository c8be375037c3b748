"""The GPU-only operations of the Mosaic GPU kernels, with interpreter twins.

The kernels of `mosaic_gpu` are written once and run both compiled (wgmma,
register layouts, swizzled shared memory) and in the Mosaic GPU interpreter
on CPU, which executes barriers, TMA copies and ref accesses as on the GPU.
`Ops` holds the few operations that differ between the two.
"""

from __future__ import annotations

import inspect
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_F32 = jnp.float32
# Whether a kernel may store to a shared-memory ref while a wgmma is in
# flight (`Ops.mm_around`, `mm_beside`, `mm_sum_ahead`; elsewhere they run
# in turn, `dkv.pipelines_dq`): jax 0.10's discharge of the accumulator's
# `run_state` rejects a store to a ref its body closes over.
STORES_UNDER_WGMMA = jax.__version_info__ >= (0, 11)


def _load_whole(ref, *, layout):
  """`plgpu.load` of a whole ref: jax 0.10 wants the index `()`, jax 0.12
  takes none."""
  if "idx" in inspect.signature(plgpu.load).parameters:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


class Ops:
  """The GPU-only operations, with interpreter equivalents.

  The interpreter executes barriers, TMA copies and ref accesses as on the
  GPU but has no register layouts and no transposed wgmma operands; there
  the matmuls are jnp.dot on the loaded tiles. Everything else in a kernel
  body is shared by both modes.
  """

  def __init__(self, interpret: bool, swizzle: int = 128):
    self.interpret = interpret
    self.swizzle = swizzle

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

  def iota_vector(self, size, axis):
    """0 .. size - 1 (int32) laid out along `axis` of a wgmma tile."""
    x = lax.broadcasted_iota(jnp.int32, (size,), 0)
    if self.interpret:
      return x
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1 - axis))

  def load_vector(self, ref, axis):
    """Loads a [size] SMEM vector laid out along `axis` of a wgmma tile."""
    if self.interpret:
      return ref[...]
    return _load_whole(ref, layout=plgpu.Layout.WGMMA.reduce(1 - axis))

  def load_tile(self, ref, *, eight_bit=False):
    """Loads a 2-D SMEM tile into registers in the wgmma accumulator
    layout (rows of 64 a warpgroup), so that per-row vectors broadcast
    against it; with `eight_bit` (a 1-byte tile) in the 8-bit A-operand
    layout, four consecutive bytes a thread (`iota` gives its
    indices)."""
    if self.interpret:
      return ref[...]
    return _load_whole(ref, layout=plgpu.Layout.WGMMA_8BIT if eight_bit
                       else plgpu.Layout.WGMMA)

  def iota(self, shape, axis, *, eight_bit=False):
    """Indices along `axis` (int32) of a 2-D tile in `load_tile`'s
    layout."""
    if self.interpret:
      return lax.broadcasted_iota(jnp.int32, shape, axis)
    return plgpu.broadcasted_iota(
        jnp.int32, shape, axis,
        layout=plgpu.Layout.WGMMA_8BIT if eight_bit else plgpu.Layout.WGMMA)

  def set_max_registers(self, n, action):
    if not self.interpret:
      plgpu.set_max_registers(n, action=action)

  def smem(self, shape, dtype, swizzled: bool, swizzle: int | None = None):
    """SMEM scratch; 2-D+ bf16/f16 tiles use the swizzled layout of
    `self.swizzle` bytes (or `swizzle`; the interpreter takes plain refs)."""
    swizzle = swizzle or self.swizzle
    if swizzled and not self.interpret:
      transforms = (
          plgpu.TilingTransform(
              (8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle),
      )
      return plgpu.SMEM(shape, dtype, transforms=transforms)
    return plgpu.SMEM(shape, dtype)

  def mm(self, a, b, *, a_in_smem=True, transpose_a=False, transpose_b=False,
         acc=None, between: Callable[[], None] | None = None):
    """acc + a @ b (or with a^T, b^T) in float32.

    Args:
      a: [M, K] SMEM ref (`a_in_smem`) or register array; [K, M] with
        `transpose_a` (an SMEM ref of a 16-bit type only: wgmma reads a
        transposed A from shared memory, never from registers).
      b: [K, N] SMEM ref, or [N, K] with `transpose_b`.
      a_in_smem: whether `a` is a ref.
      transpose_a: use a^T.
      transpose_b: use b^T.
      acc: float32 [M, N] accumulator to add to, or None.
      between: called after the wgmma is issued and before its result is
        awaited (the ping-pong schedule barrier).

    Returns:
      float32 [M, N]; int8 operands (acc None only) are summed exactly in
      int32, wgmma's integer accumulator, and the sum made float32.
    """
    exact_ints = jnp.issubdtype(a.dtype, jnp.integer)
    if self.interpret:
      a_val = a[...] if a_in_smem else a
      b_val = b[...]
      if transpose_a:
        a_val = a_val.T
      if transpose_b:
        b_val = b_val.T
      out = jnp.dot(a_val, b_val, preferred_element_type=(
          jnp.int32 if exact_ints else _F32)).astype(_F32)
      if between is not None:
        between()
      return out if acc is None else acc + out
    # A ref's own transpose (a view for wgmma's operand layout; the
    # plgpu.transpose_ref wrapper is deprecated from jax 0.12).
    b_op = b.transpose((1, 0)) if transpose_b else b
    shape = (a.shape[1] if transpose_a else a.shape[0],
             b.shape[0] if transpose_b else b.shape[1])
    if transpose_a:
      a = a.transpose((1, 0))

    if exact_ints and acc is not None:
      raise ValueError("int8 operands sum a fresh product only (acc=None)")
    if acc is None:
      def fresh(acc_ref):
        plgpu.wgmma(acc_ref, a, b_op)
        if between is not None:
          between()
        return acc_ref[...]

      sums = pl.run_scoped(
          fresh, plgpu.ACC(shape, jnp.int32 if exact_ints else _F32))
      return sums.astype(_F32) if exact_ints else sums

    def accumulate(acc_ref):
      plgpu.wgmma(acc_ref, a, b_op)
      if between is not None:
        between()

    return pl.run_state(accumulate)(plgpu.ACC.init(acc))

  def mm_sum(self, pairs, *, transpose_a=False):
    """sum_i a_i @ b_i (with each a_i^T under `transpose_a`) in float32:
    one chain of wgmmas into one accumulator, awaited once (a sum of `mm`
    calls waits for each product before it issues the next).

    Args:
      pairs: (a, b) SMEM refs, as for `mm` ([M, K_i] or [K_i, M], [K_i, N]).
      transpose_a: use each a^T.

    Returns:
      float32 [M, N].
    """
    if self.interpret:
      return sum(self.mm(a, b, transpose_a=transpose_a) for a, b in pairs)
    a0, b0 = pairs[0]
    shape = (a0.shape[1] if transpose_a else a0.shape[0], b0.shape[1])

    def chain(acc_ref):
      _issue_sum(acc_ref, pairs, transpose_a)
      return acc_ref[...]

    return pl.run_scoped(chain, plgpu.ACC(shape, _F32))

  def mm_around(self, first: dict[str, Any], between: Callable[[], None],
                pairs: Callable[[], list], shape: tuple[int, int], *,
                transpose_a=False):
    """`mm(**first)` issued, `between()` run while it is in flight, then
    `mm_sum(pairs())` issued behind it; both awaited once, at the end.

    The first product's drain then overlaps `between`'s shared-memory
    traffic and barriers instead of preceding them (the fused backward's
    dK product around its dS^T staging and exchange, then its dQ chain).

    Args:
      first: `mm` keywords with an `acc`; its `a` may be a register array
        (`a_in_smem=False`), which `between` may read but not change.
      between: side effects the second product's operands need (shared
        memory stores, their commit, barriers).
      pairs: () -> the (a, b) SMEM refs of the second product, as for
        `mm_sum`, built after `between`.
      shape: the second product's [M, N].
      transpose_a: use each of the second's a^T.

    Returns:
      (first's result, the sum's), float32.
    """
    if self.interpret or not STORES_UNDER_WGMMA:
      out = self.mm(**first)
      between()
      return out, self.mm_sum(pairs(), transpose_a=transpose_a)
    a, b = first["a"], first["b"]
    if first.get("transpose_b", False):
      b = b.transpose((1, 0))

    # The sum's accumulator is allocated after `between`, just before its
    # chain, as in `mm_sum`: ptxas then starts the chain from RZ. Allocated
    # before the first product, its zeros were 16 CS2R a thread, live across
    # `between`, and ptxas injected a warpgroup.arrive for them (C7519).
    def chain(sum_ref):
      _issue_sum(sum_ref, pairs(), transpose_a)
      return sum_ref[...]  # Awaits every wgmma in flight, the first's too.

    def issue(refs):
      acc_ref, sum_out = refs
      plgpu.wgmma(acc_ref, a, b)
      between()
      sum_out[...] = pl.run_scoped(chain, plgpu.ACC(shape, _F32))

    # The second state is the sum's value, written before it is read (its
    # initial zeros are dead code).
    return pl.run_state(issue)(
        (plgpu.ACC.init(first["acc"]), self.full(shape, 0.0)))

  def mm_beside(self, product: dict[str, Any], side: Callable[[], None]):
    """`mm(**product)` with `side()` run while it is in flight: shared
    memory stores, their commit, barriers (jax 0.10 runs them after the
    product, `STORES_UNDER_WGMMA`)."""
    if self.interpret or not STORES_UNDER_WGMMA:
      out = self.mm(**product)
      side()
      return out
    return self.mm(**product, between=side)

  def mm_sum_ahead(self, pairs, use: Callable[[jax.Array], None],
                   second: dict[str, Any], *, transpose_a=False,
                   before: Callable[[], None] | None = None):
    """`mm_sum(pairs)` issued, then the fresh product `mm(**second)` behind
    it; `use(sum)` runs once the sum lands, while the second is still in
    flight (wgmma groups complete in order). Returns the second's result.

    A step's deferred product then drains under the next step's first one
    (the fused backward's dQ of step j - 1 under S^T of step j), and
    `use`'s shared-memory stores under it too.

    Args:
      pairs: the sum's (a, b) SMEM refs, as for `mm_sum`.
      use: side effects on the sum (float32 [M, N]): stores, copies.
      second: `mm` keywords of a fresh product (no `acc`).
      transpose_a: use each of the sum's a^T.
      before: called after the sum is issued, before the second is (a
        wait for the second's operands).
    """
    if second.get("acc") is not None:
      raise ValueError("mm_sum_ahead: the second product takes no acc.")
    if self.interpret or not STORES_UNDER_WGMMA:
      use(self.mm_sum(pairs, transpose_a=transpose_a))
      if before is not None:
        before()
      return self.mm(**second)
    a0, b0 = pairs[0]
    sum_shape = (a0.shape[1] if transpose_a else a0.shape[0], b0.shape[1])
    a, b = second["a"], second["b"]
    transpose_b = second.get("transpose_b", False)
    shape = (a.shape[0], b.shape[0] if transpose_b else b.shape[1])
    b_op = b.transpose((1, 0)) if transpose_b else b

    # Each accumulator is allocated just before its own chain, so that
    # ptxas starts both from RZ (see `mm_around`).
    def issue(sum_ref):
      _issue_sum(sum_ref, pairs, transpose_a)
      if before is not None:
        before()

      def behind(acc_ref):
        plgpu.wgmma(acc_ref, a, b_op)
        use(plgpu.wgmma_accumulator_load(sum_ref, wait_n=1))
        return acc_ref[...]

      return pl.run_scoped(behind, plgpu.ACC(shape, _F32))

    return pl.run_scoped(issue, plgpu.ACC(sum_shape, _F32))

  def mm_while(self, product: dict[str, Any], then: Callable[..., tuple],
               state: tuple, *, pin: Callable[[tuple], None]):
    """`mm(**product)` issued, `then(*state)` run while it is in flight,
    and the product awaited after that: register work that does not feed
    the product hides under its tensor-core time (the fused backward's
    P^T under dP^T's product, dS^T under dV's, FlashAttention-3's order).

    Args:
      product: `mm` keywords (no `transpose_a`); its `a` may be a register
        array (`a_in_smem=False`), kept unchanged until the product lands.
      then: then(*state) -> new state: arrays of the shapes, dtypes and
        layouts of `state` (an initial value may be a placeholder that
        `then` overwrites).
      state: `then`'s arrays.
      pin: pin(new state) stores a value `then` computes last to shared
        memory. ptxas moves a wgmma wait ahead of register-only work up
        to the previous memory operation, which would drain the product
        before `then` runs; the store keeps the wait after `then`'s work.

    Returns:
      (the product, float32; `then`'s new state, a tuple).
    """
    if self.interpret or not STORES_UNDER_WGMMA:
      out = self.mm(**product)
      new_state = tuple(then(*state))
      pin(new_state)
      return out, new_state
    a, b = product["a"], product["b"]
    transpose_b = product.get("transpose_b", False)
    shape = (a.shape[0], b.shape[0] if transpose_b else b.shape[1])
    b_op = b.transpose((1, 0)) if transpose_b else b
    acc = product.get("acc")

    def body(refs):
      acc_ref, state_refs = refs
      plgpu.wgmma(acc_ref, a, b_op)
      new = tuple(then(*(r[...] for r in state_refs)))
      for r, x in zip(state_refs, new, strict=True):
        r[...] = x
      pin(new)

    out, new_state = pl.run_state(body)((
        plgpu.ACC.init(self.full(shape, 0.0) if acc is None else acc),
        tuple(state)))
    if product.get("a_in_smem", True):
      return out, tuple(new_state)
    # As in `mm_overlapped`: the register operand stays live until the
    # product has landed.
    _, *new_state = lax.optimization_barrier((a, *new_state))
    return out, tuple(new_state)

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
          m["a"], b.transpose((1, 0)) if transpose_b else b,
          self.full(shape, 0.0) if acc is None else acc))

    def issue(acc_refs):
      for acc_ref, (a, b, _) in zip(acc_refs, operands, strict=True):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(issue)(
        tuple(plgpu.ACC.init(acc) for _, _, acc in operands))

  def mm_overlapped(self, first: dict[str, Any], second: dict[str, Any], *,
                    then: Callable[..., tuple], state: tuple,
                    between: Callable[[], None] | None = None,
                    pin: tuple[Any, int] | None = None):
    """Two `mm`s (keyword dicts) issued back to back, and `then` run on
    the first's result while the second is still in flight.

    The first is a fresh product (no `acc`), the second may accumulate.
    wgmma groups complete in order, so waiting until one group is pending
    (`wgmma_wait_group 1`) completes the first and leaves the second
    running: the register work of `then` overlaps the second's tensor-core
    time (FlashAttention-3's intra-warpgroup overlap, §3.2). The second's
    result is awaited only when `then` returns.

    Args:
      first: `mm` keywords of the product awaited first; no `acc`.
      second: `mm` keywords of the product left in flight; `a` may be a
        register array (`a_in_smem=False`), which must then stay unchanged
        until the product completes (it is `then`'s closure, not state).
      then: then(first_result, *state) -> new state: arrays of the shapes,
        dtypes and layouts of `state`.
      state: the arrays `then` updates (its initial values).
      between: called once both products are issued, before the first is
        awaited (the ping-pong schedule barrier).
      pin: (an SMEM ref, i): `then`'s new state[i] is stored to the ref
        before the second product is awaited. ptxas hoists a wgmma wait
        over register-only work up to the previous memory operation, which
        would drain the second product before `then`'s work; a store of a
        value computed at the end of `then` keeps the wait after it.
        (The ref is scratch: its contents are not read.)

    Returns:
      (the second's result, float32; `then`'s new state, a tuple).
    """
    if first.get("acc") is not None:
      raise ValueError("mm_overlapped: the first product takes no acc.")
    if self.interpret:
      first_out = self.mm(**first)
      second_out = self.mm(**second)
      if between is not None:
        between()
      new_state = tuple(then(first_out, *state))
      if pin is not None:
        pin[0][...] = new_state[pin[1]]
      return second_out, new_state
    issued = []
    for m in (first, second):
      a, b = m["a"], m["b"]
      transpose_b = m.get("transpose_b", False)
      shape = (a.shape[0], b.shape[0] if transpose_b else b.shape[1])
      acc = m.get("acc")
      issued.append((
          a, b.transpose((1, 0)) if transpose_b else b,
          self.full(shape, 0.0) if acc is None else acc))

    def products(refs):
      acc_refs, state_refs = refs
      for acc_ref, (a, b, _) in zip(acc_refs, issued, strict=True):
        plgpu.wgmma(acc_ref, a, b)
      if between is not None:
        between()
      first_out = plgpu.wgmma_accumulator_load(acc_refs[0], wait_n=1)
      new = then(first_out, *(r[...] for r in state_refs))
      for r, x in zip(state_refs, new, strict=True):
        r[...] = x
      if pin is not None:
        pin[0][...] = new[pin[1]]

    (_, second_out), new_state = pl.run_state(products)((
        tuple(plgpu.ACC.init(acc) for _, _, acc in issued), tuple(state)))
    if second.get("a_in_smem", True):
      return second_out, tuple(new_state)
    # The register operand stays live, beside the new state, until after
    # the product is awaited (run_state's exit): a new value carried in a
    # loop then never takes its registers while the wgmma still reads
    # them (ptxas would serialize the wgmmas instead, C7513). A
    # side-effecting barrier, so not hoisted above the wait.
    _, *new_state = lax.optimization_barrier((second["a"], *new_state))
    return second_out, tuple(new_state)


def _issue_sum(acc_ref, pairs, transpose_a: bool):
  """Issues acc += a_i @ b_i (a_i^T under `transpose_a`) for each SMEM
  pair, one wgmma chain into `acc_ref`; not awaited."""
  for a, b in pairs:
    plgpu.wgmma(acc_ref, a.transpose((1, 0)) if transpose_a else a,
                b)


def barrier(num_barriers, num_arrivals=1):
  """`num_barriers` barriers, each completed by `num_arrivals` arrivals."""
  return plgpu.Barrier(num_arrivals=num_arrivals, num_barriers=num_barriers)
