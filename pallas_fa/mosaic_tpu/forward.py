"""The forward Mosaic TPU kernel of `mosaic_tpu` (FlashAttention-2, §3.1).

Query tile stationary, key tiles streamed along the last ("arbitrary") grid
axis; the running statistics stay lane-replicated in VMEM and the logsumexp
residual leaves as a compact row (`kernel` has the layouts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_fa import online_softmax
from pallas_fa.mosaic_tpu import kernel

_F32 = jnp.float32
# float8 tiles are widened to this for the products (`kernel.widen`).
_BF16 = jnp.bfloat16


def _forward_kernel(meta_ref, *refs, st: kernel.Static, names):
  r = kernel.unpack(names, refs)
  b, n, i, j = (pl.program_id(a) for a in range(4))
  nq, nk = st.num_q_blocks, st.num_kv_blocks
  kind = kernel.step_kind(meta_ref[(b * nq + i) * nk + j])
  m_ref, l_ref, acc_ref = r["m_i"], r["l_i"], r["acc"]

  pl.when(j == 0)(lambda: kernel.init_softmax(m_ref, l_ref, acc_ref))

  def tile(name):
    x = r[name][...]
    return x if st.float8 is None else kernel.widen(x, _BF16)

  def step(masked):
    _, s, _ = kernel.masked_logits(st, r, tile("q"), tile("k"), masked,
                                   kernel.Tile(b, n, i, j))
    m_i, l_i, p, alpha = online_softmax.update(
        kernel.column(m_ref), kernel.column(l_ref), s)  # p: [bq, bk]
    if st.dropout_rate:
      # On the normalised probabilities: l_i sums the undropped ones.
      p = p * kernel.dropout_factor(st, r, b, n, i, j)
    if st.float8 is not None and st.float8.value_columns:
      p = p * r["v_scale"][...]  # P . (v * c) = (P * c) . v, c per key
    v = tile("v")
    pv = kernel.dot(p.astype(v.dtype), v, kernel.NN, st.precision)  # [bq, Hvp]
    acc_ref[...] = online_softmax.rescale(acc_ref[...], alpha) + pv
    kernel.store_column(m_ref, m_i)
    kernel.store_column(l_ref, l_i)

  kernel.dispatch(st, kind, step)

  @pl.when(j == nk - 1)
  def _finalize():
    out, lse = online_softmax.finalize(
        kernel.column(m_ref), kernel.column(l_ref), acc_ref[...])
    if st.float8 is not None and not st.float8.value_columns:
      out = out * r["v_scale"][b * st.num_heads + n]  # one per program
    r["out"][...] = out.astype(r["out"].dtype)
    # Column -> row through an explicit (XLU) transpose of a lane-replicated
    # [bq, 128] tile: the residual then travels compactly as [1, bq].
    lse = jnp.broadcast_to(lse[:, None], (st.block_q, kernel.NUM_LANES))
    r["lse"][...] = lse.T[:1, :]  # [1, bq]


def forward(st: kernel.Static, meta, names, operands, out_dtype):
  """Runs the forward kernel.

  Args:
    st: static launch description.
    meta: int32 [B * nq * nk] metadata words, row-major over (b, i, j).
    names: names of `operands` (see `kernel.launch`).
    operands: kernel inputs in HBM layout.
    out_dtype: dtype of the output (bfloat16 or float32).

  Returns:
    (out [B, Tp, N * Hvp], lse [B, N, 1, Tp] float32).
  """
  b, n, hp, hvp = st.batch, st.num_heads, st.head_dim, st.value_head_dim
  bq, nq, nk = st.block_q, st.num_q_blocks, st.num_kv_blocks
  sq = kernel.SQUEEZED
  out_shapes = (
      jax.ShapeDtypeStruct((b, st.q_len, n * hvp), out_dtype),
      jax.ShapeDtypeStruct((b, n, 1, st.q_len), _F32),
  )
  out_specs = (
      pl.BlockSpec((sq, bq, hvp), lambda b, n, i, j, m: (b, i, n)),
      pl.BlockSpec((sq, sq, 1, bq), lambda b, n, i, j, m: (b, n, 0, i)),
  )
  scratch = [
      pltpu.VMEM((bq, kernel.NUM_LANES), _F32),  # m_i
      pltpu.VMEM((bq, kernel.NUM_LANES), _F32),  # l_i
      pltpu.VMEM((bq, hvp), _F32),  # acc
  ]
  all_names = tuple(names) + ("out", "lse", "m_i", "l_i", "acc")
  tiles = b * n * nq * nk
  cost = kernel.cost_estimate(
      2 * tiles * bq * st.block_kv * (hp + hvp), tiles * bq * st.block_kv,
      operands, out_shapes)
  return kernel.launch(
      functools.partial(_forward_kernel, st=st, names=all_names),
      st, (b, n, nq, nk), kernel.row_major_coords(st), names, operands,
      out_specs, out_shapes, scratch, 3,
      meta, cost,
  )

