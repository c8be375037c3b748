"""The backward Mosaic TPU kernels of `mosaic_tpu` (FlashAttention-2, §3.2).

Two kernels: dQ -- query tile stationary, keys streamed -- and dK/dV (and
dbias) -- key tile stationary, the queries of its GQA group streamed, dK/dV
summed over the group in VMEM. Layouts and metadata words as in
`kernel`. The dQ kernel also returns the cotangents of the score_mod's
differentiable per-(batch, head) values: a scalar's summed per query row,
a table's (`kernel._table_scatter`) as one partial table per (batch row,
head, query tile), both summed outside by XLA (deterministic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa.mosaic_tpu import kernel

_F32 = jnp.float32


# --- dQ -----------------------------------------------------------------------


def _dq_kernel(meta_ref, *refs, st: kernel.Static, names):
  r = kernel.unpack(names, refs)
  b, n, i, j = (pl.program_id(a) for a in range(4))
  nq, nk = st.num_q_blocks, st.num_kv_blocks
  kind = kernel.step_kind(meta_ref[(b * nq + i) * nk + j])
  dq_ref = r["dq_acc"]
  # The score_mod's per-(batch, head) values: cotangents per query row,
  # lane-replicated [bq, 128]; a table's, a partial table [8, width]
  # (sublane-replicated).
  dmod_refs = [r[name] for name in names if name.startswith("dmod_acc")]
  tables = [res.size is not None for res in _differentiable(st)]

  @pl.when(j == 0)
  def _init():
    dq_ref[...] = jnp.zeros(dq_ref.shape, _F32)
    for ref in dmod_refs:
      ref[...] = jnp.zeros(ref.shape, _F32)

  def step(masked):
    k = r["k"][...]
    s_capped, s, score_mod_pullback = kernel.masked_logits(
        st, r, r["q"][...], k, masked, kernel.Tile(b, n, i, j), grad=True)
    p = online_softmax.probs_from_lse(s, r["lse"][0])  # [bq, bk]
    dp = kernel.dot(
        r["do"][...], r["v"][...], kernel.NT, st.precision)  # [bq, bk]
    if st.dropout_rate:
      # dS = P * (dP * factor - delta), FlashAttention-2's dropout backward.
      dp = dp * kernel.dropout_factor(st, r, b, n, i, j)
    ds = online_softmax.softmax_grad(p, dp, r["delta"][0])
    if score_mod_pullback is not None:
      ds, d = score_mod_pullback(ds)
      for ref, x, table in zip(dmod_refs, d, tables):
        if table:  # [1, width]
          ref[...] = ref[...] + x
        else:  # [bq]
          kernel.store_column(ref, kernel.column(ref) + x)
    ds = online_softmax.logits_grad(
        ds, s_capped, scale=st.scale, cap=st.soft_cap)
    dq_ref[...] += kernel.dot(
        ds.astype(k.dtype), k, kernel.NN, st.precision)  # [bq, Hp]

  kernel.dispatch(st, kind, step)

  @pl.when(j == nk - 1)
  def _finalize():
    r["dq"][...] = dq_ref[...].astype(r["dq"].dtype)
    for k, (ref, table) in enumerate(zip(dmod_refs, tables)):
      # Column -> row, as the lse; a table's row as it is.
      r[f"dmod{k}"][...] = ref[:1, :] if table else ref[...].T[:1, :]


def _differentiable(st: kernel.Static):
  """The score_mod's differentiable residuals (the dQ kernel's extra
  outputs, in order)."""
  if st.score_mod is None:
    return []
  return [res for res in st.score_mod.residuals if res.differentiable]


def backward_dq(st: kernel.Static, meta, names, operands, out_dtype):
  """Runs the dQ kernel; metadata as for `forward`. Returns [B, Tp, N * Hp]
  and, for each differentiable per-(batch, head) value of the score_mod,
  its cotangent summed per query, float32 [B, N, 1, Tp] -- a table's per
  query tile, float32 [B, N, 1, nq * width] (`kernel.table_width`), lanes
  past the table's size zero."""
  b, n, hp, hvp = st.batch, st.num_heads, st.head_dim, st.value_head_dim
  bq, nq, nk = st.block_q, st.num_q_blocks, st.num_kv_blocks
  sq = kernel.SQUEEZED
  differentiable = _differentiable(st)
  num_d = len(differentiable)
  out_shapes = [jax.ShapeDtypeStruct((b, st.q_len, n * hp), out_dtype)]
  out_specs = [
      pl.BlockSpec((sq, bq, hp), lambda b, n, i, j, m: (b, i, n))]
  scratch = [pltpu.VMEM((bq, hp), _F32)]
  for res in differentiable:
    width = bq if res.size is None else kernel.table_width(res.size)
    out_shapes.append(jax.ShapeDtypeStruct((b, n, 1, nq * width), _F32))
    out_specs.append(pl.BlockSpec((sq, sq, 1, width),
                                  lambda b, n, i, j, m: (b, n, 0, i)))
    scratch.append(pltpu.VMEM(
        (bq, kernel.NUM_LANES) if res.size is None
        else (kernel.NUM_SUBLANES, width), _F32))
  out_shapes, out_specs = tuple(out_shapes), tuple(out_specs)
  all_names = tuple(names) + ("dq",) + tuple(
      f"dmod{k}" for k in range(num_d)) + ("dq_acc",) + tuple(
          f"dmod_acc{k}" for k in range(num_d))
  tiles = b * n * nq * nk
  cost = kernel.cost_estimate(
      2 * tiles * bq * st.block_kv * (2 * hp + hvp),
      tiles * bq * st.block_kv,
      operands, out_shapes)
  return kernel.launch(
      functools.partial(_dq_kernel, st=st, names=all_names),
      st, (b, n, nq, nk), kernel.row_major_coords(st), names, operands,
      out_specs, out_shapes, scratch, 3,
      meta, cost,
  )


# --- dK, dV (and dbias) ------------------------------------------------------


def _dkv_kernel(meta_ref, *refs, st: kernel.Static, names):
  r = kernel.unpack(names, refs)
  b, h, j, g, i = (pl.program_id(a) for a in range(5))
  nq, nk = st.num_q_blocks, st.num_kv_blocks
  kind = kernel.step_kind(meta_ref[(b * nk + j) * nq + i])
  dk_ref, dv_ref = r["dk_acc"], r["dv_acc"]

  @pl.when((g == 0) & (i == 0))
  def _init():
    dk_ref[...] = jnp.zeros(dk_ref.shape, _F32)
    dv_ref[...] = jnp.zeros(dv_ref.shape, _F32)

  def step(masked):
    q, do = r["q"][...], r["do"][...]
    s_capped, s, score_mod_pullback = kernel.masked_logits(
        st, r, q, r["k"][...], masked, kernel.Tile(b, h * st.group + g, i, j),
        grad=True, args=False)
    p = online_softmax.probs_from_lse(s, r["lse"][0])  # [bq, bk]
    dp = kernel.dot(do, r["v"][...], kernel.NT, st.precision)  # [bq, bk]
    p_used = p
    if st.dropout_rate:
      # dV from the dropped P, dP through the same mask, and
      # dS = P * (dP - delta) (FlashAttention-2's dropout backward).
      z = kernel.dropout_factor(st, r, b, h * st.group + g, i, j)
      p_used, dp = p * z, dp * z
    dv_ref[...] += kernel.dot(
        p_used.astype(do.dtype), do, kernel.TN, st.precision)  # [bk, Hvp]
    ds = online_softmax.softmax_grad(p, dp, r["delta"][0])
    if score_mod_pullback is not None:  # Its values' cotangents: in dQ.
      ds, _ = score_mod_pullback(ds)
    if "dbias" in r:
      r["dbias"][...] = ds
    ds = online_softmax.logits_grad(
        ds, s_capped, scale=st.scale, cap=st.soft_cap)
    dk_ref[...] += kernel.dot(
        ds.astype(q.dtype), q, kernel.TN, st.precision)  # [bk, Hp]

  kernel.dispatch(st, kind, step)

  if "dbias" in r:
    # Every dbias tile is written back, visited or not.
    @pl.when(kind == masking.EMPTY)
    def _zero_dbias():
      r["dbias"][...] = jnp.zeros(r["dbias"].shape, _F32)

  @pl.when((g == st.group - 1) & (i == nq - 1))
  def _finalize():
    r["dk"][...] = dk_ref[...].astype(r["dk"].dtype)
    r["dv"][...] = dv_ref[...].astype(r["dv"].dtype)


def backward_dkv(st: kernel.Static, meta_t, names, operands, out_dtype,
                 with_dbias):
  """Runs the dK/dV kernel.

  Args:
    st: static launch description.
    meta_t: int32 [B * nk * nq] metadata words, row-major over (b, j, i).
    names: names of `operands`.
    operands: kernel inputs in HBM layout.
    out_dtype: dtype of dk and dv.
    with_dbias: also return dbias [B, N, Tp, Sp] float32 (un-reduced).

  Returns:
    (dk [B, Sp, K * Hp], dv [B, Sp, K * Hvp]), plus dbias when requested.
  """
  b, n, kh = st.batch, st.num_heads, st.num_kv_heads
  hp, hvp = st.head_dim, st.value_head_dim
  bq, bk, nq, nk = st.block_q, st.block_kv, st.num_q_blocks, st.num_kv_blocks
  g = st.group
  sq = kernel.SQUEEZED

  def kv_out(width):
    return (jax.ShapeDtypeStruct((b, st.kv_len, kh * width), out_dtype),
            pl.BlockSpec((sq, bk, width), lambda b, h, j, gi, i, m: (b, j, h)))

  (dk_shape, dk_spec), (dv_shape, dv_spec) = kv_out(hp), kv_out(hvp)
  out_shapes = [dk_shape, dv_shape]
  out_specs = [dk_spec, dv_spec]
  out_names = ("dk", "dv")
  if with_dbias:
    out_shapes.append(
        jax.ShapeDtypeStruct((b, n, st.q_len, st.kv_len), _F32))
    out_specs.append(pl.BlockSpec(
        (sq, sq, bq, bk), lambda b, h, j, gi, i, m: (b, h * g + gi, i, j)))
    out_names += ("dbias",)
  scratch = [pltpu.VMEM((bk, hp), _F32), pltpu.VMEM((bk, hvp), _F32)]
  all_names = tuple(names) + out_names + ("dk_acc", "dv_acc")
  tiles = b * n * nq * nk
  cost = kernel.cost_estimate(
      4 * tiles * bq * bk * (hp + hvp), tiles * bq * bk, operands,
      out_shapes)
  return kernel.launch(
      functools.partial(_dkv_kernel, st=st, names=all_names),
      st, (b, kh, nk, g, nq), kernel.col_major_coords(st), names, operands,
      tuple(out_specs), tuple(out_shapes), scratch,
      3,
      meta_t, cost,
  )
