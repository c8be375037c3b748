"""`mosaic_tpu`: flash attention for TPU, in Pallas, compiled by Mosaic.

Three kernels (in this folder's `forward` and `backward`, on the shared
pieces of `kernel`): the forward (FlashAttention-2, Algorithm 1),
and a backward split into a dK/dV kernel and a dQ kernel that both recompute
the probabilities from the logsumexp residual. On a TPU they are compiled by
Mosaic; anywhere else they run in Pallas's TPU interpret mode,
which simulates the TPU's memories and DMAs on the host (slow: for tests).

This module prepares the kernels' inputs on device:

* pads T and S to whole tiles and the head dims (H of q/k, Hv of v/out) to
  multiples of 128 (lanes) with `pallas_fa.layout`, which marks the tails as
  padding and zeroes padded rows so that NaN/inf stored there cannot leak;
* keeps the public BTNH layout (as a free [B, L, heads * Hp] reshape), so GQA
  needs no repeated K/V: a query head reads key/value head `n // G`;
* classifies every (query tile, key tile) pair as EMPTY / PARTIAL / FULL from
  the canonical mask description (`masking.classify_blocks`) and turns that
  into one int32 per grid step -- the tile kind and the block the step fetches
  -- passed to the kernels by scalar prefetch. An empty step fetches the block
  needed next (or the one already resident), so it costs no DMA and no
  compute;
* fuses flex attention: a score_mod / mask_mod split by `fused_mods` brings
  its per-(batch, head) values in SMEM and its per-query (per-key) ones
  lane- (sublane-) replicated like positions, and a mask_mod's tile kinds,
  taken over all heads, join the metadata. A table the tile part reads at
  offsets computed per element (T5's buckets, a learned relative bias:
  `fused_mods.split(..., tables=True)`) travels in SMEM too, each program's
  part flattened, and the kernels select its entries one-hot
  (`kernel._table_load`); its gradient comes from the dQ kernel as
  per-(batch row, head, query tile) partial tables, summed here by XLA
  (deterministic). Tables of more than `kernel.MAX_TABLE_ENTRIES` entries
  per program, or that would not fit in scalar memory beside the metadata,
  are declined;
* keeps a float8 call's q, k and v as stored (1 byte an element; their
  formats may differ) and turns its scales into float32 rows, one value
  per query row (the logit scale folded in, and the key's scale where it
  is one per head) or per key; the forward widens each tile to bfloat16
  and applies them to the logits' rows and columns and to P's columns, a
  value scale per head to the output (`kernel.Float8`). Its backward runs
  on the dequantized float32 inputs (`vjp`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa import layout
from pallas_fa import manual_axes
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import quantize
from pallas_fa import vjp
from pallas_fa.flex import block_mask
from pallas_fa.flex import fused_mods
from pallas_fa.mosaic_tpu import backward as backward_kernels
from pallas_fa.mosaic_tpu import forward as forward_kernel
from pallas_fa.mosaic_tpu import kernel

Array = Any
_F32 = jnp.float32
_LANES = kernel.NUM_LANES
_SUBLANES = kernel.NUM_SUBLANES
# Tiles and head dims are multiples of the lane width: key tiles are the lane
# dimension of the logits, query tiles that of the logsumexp rows.
ALIGN = layout.Alignment(rows=_LANES, head_dim=_LANES)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicTpuBlockSizes:
  """Tile sizes of the `mosaic_tpu` kernels.

  Every size is a multiple of 128: key tiles are the lane dimension of the
  [block_q, block_kv] logit tile, query tiles the lane dimension of the
  logsumexp rows, and both feed the 128-wide matrix unit. A sequence shorter
  than its tile runs as one tile of its own length rounded up to 128.

  Attributes:
    block_q: query rows per tile in the forward kernel.
    block_kv: key rows per tile in the forward kernel.
    block_q_bwd: query rows per tile in the dK/dV and dQ kernels.
    block_kv_bwd: key rows per tile in the dK/dV and dQ kernels.
  """

  block_q: int = 512
  block_kv: int = 512
  block_q_bwd: int = 512
  block_kv_bwd: int = 512

  def __post_init__(self):
    name = type(self).__name__
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{name}.{f.name} must be a positive int, got {value!r}."
        )
      if value % _LANES:
        raise ValueError(
            f"{name}.{f.name} must be a multiple of {_LANES} (the TPU "
            f"lane width), got {f.name}={value}."
        )


def default_block_sizes(
    *, q_len: int, kv_len: int, head_dim: int, dtype, is_causal: bool = False,
    dropout: bool = False, device_kind: str | None = None,
    value_head_dim: int | None = None,
) -> MosaicTpuBlockSizes:
  """The tiling of a call made without `block_sizes=` (a heuristic; tiles
  are clipped to the sequences by the kernels).

  512 x 512 tiles keep the forward's double-buffered q/k/v tiles plus the
  float32 logit temporaries well inside the default scoped VMEM (16 MiB) for
  any head dims <= 256. The backward holds four [bq, bk] float32 temporaries
  (s, p, dp, ds; five with dropout's factor) plus q/dO and k/v tiles and two
  float32 accumulators, so it halves its tiles once the wider padded head
  row (H or Hv) exceeds 256 bytes.

  Args:
    q_len: T.
    kv_len: S.
    head_dim: H (unpadded).
    dtype: the input dtype.
    is_causal: whether the call is causal.
    dropout: whether the call has attention dropout.
    device_kind: a `jax.Device.device_kind`.
    value_head_dim: Hv (unpadded); None means H.

  Returns:
    A `MosaicTpuBlockSizes`.
  """
  # Tiles are clipped to the sequences by the kernels, and neither masking
  # nor the TPU generation changes what fits the default scoped VMEM.
  del q_len, kv_len, is_causal, dropout, device_kind
  itemsize = jnp.dtype(compute_dtype(dtype)).itemsize
  widest = max(head_dim, value_head_dim or head_dim)
  row_bytes = layout.padded_head_dim(widest, ALIGN) * itemsize
  bwd = 512 if row_bytes <= 256 else 256
  return MosaicTpuBlockSizes(block_q=512, block_kv=512, block_q_bwd=bwd,
                             block_kv_bwd=bwd)


def compute_dtype(dtype):
  """The dtype the kernels compute inputs of `dtype` in: the TPU's matrix
  unit takes bfloat16 and float32, not float16."""
  return _F32 if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def kernel_precision(precision: jax.lax.Precision,
                     dtype) -> jax.lax.Precision:
  """The kernels' matmul precision for inputs of `dtype`.

  float32 inputs run at the requested precision, but HIGH (three bfloat16
  passes) runs at HIGHEST on jax older than 0.11.2, whose Mosaic lowers only
  DEFAULT and HIGHEST. bfloat16 products are exact in one pass, and float16
  inputs, computed in float32, keep their products exact at HIGHEST.
  """
  if jnp.dtype(dtype) == jnp.bfloat16:
    return jax.lax.Precision.DEFAULT
  if jnp.dtype(dtype) == jnp.float16:
    return jax.lax.Precision.HIGHEST
  if (precision == jax.lax.Precision.HIGH
      and jax.__version_info__ < (0, 11, 2)):
    return jax.lax.Precision.HIGHEST
  return precision


def fetch_schedule(kinds: Array) -> Array:
  """Per-step metadata words of a sweep over `kinds` [B, R, C].

  The grid visits, per batch row (and head), rows r in order and within a row
  the C inner steps in order. Step (r, c) fetches block c if its tile is
  non-empty; an empty step fetches the next non-empty block of its row (the
  one needed next), or, in a row's empty tail, the last block the sweep
  fetched, so the pipeline sees an unchanged block index and issues no DMA.

  Args:
    kinds: int32 [B, R, C] tile kinds (`masking.classify_blocks` layout).

  Returns:
    int32 [B * R * C]: (block to fetch << KIND_BITS) | kind, row-major.
  """
  b, rows, cols = kinds.shape
  nonempty = kinds != masking.EMPTY
  col = jax.lax.broadcasted_iota(jnp.int32, kinds.shape, 2)
  flat = col + cols * jax.lax.broadcasted_iota(jnp.int32, kinds.shape, 1)
  # Next non-empty column at or after c in the same row.
  nxt = jax.lax.cummin(jnp.where(nonempty, col, cols), axis=2, reverse=True)
  # Last non-empty step at or before (r, c) in sweep order, and the first.
  flat_ne = jnp.where(nonempty, flat, -1).reshape(b, rows * cols)
  prv = jax.lax.cummax(flat_ne, axis=1).reshape(kinds.shape)
  first = jnp.min(jnp.where(nonempty, flat, rows * cols), axis=(1, 2))
  first = jnp.where(first < rows * cols, first % cols, 0)[:, None, None]
  fallback = jnp.where(prv >= 0, prv % cols, first)
  fetch = jnp.where(nxt < cols, nxt, fallback)
  words = (fetch << kernel.KIND_BITS) | kinds
  return words.reshape(-1).astype(jnp.int32)


class Layout(layout.Padded):
  """One pass's inputs, padded to whole tiles, in the kernels' HBM layout.

  `scales`: a float8 call's (q_scale, k_scale, v_scale) (`vjp`'s
  convention); its q/k/v keep their 1-byte formats, which may differ, and
  the scales become the kernel's inputs (`kernel.Float8`).
  """

  def __init__(self, q, k, v, bias, info, params, block_q, block_kv,
               scales=None):
    self.bq, tp = layout.tile(block_q, q.shape[1], ALIGN)
    self.bk, sp = layout.tile(block_kv, k.shape[1], ALIGN)
    float8 = scales is not None
    super().__init__(q, k, v, bias, info, q_len=tp, kv_len=sp, align=ALIGN,
                     dtype=None if float8 else compute_dtype(q.dtype))
    self.hvp = layout.padded_head_dim(self.hv, ALIGN)
    padded = self.info  # Tails marked as padding.
    self.kinds = masking.classify_blocks(padded, self.bq, self.bk)
    self.names = ["q", "k", "v"]
    self.operands = [self.q, self.k, self.v]
    self.score_mod, self.mask_mod = flex_mods(info)
    if self.mask_mod is not None:
      self.kinds = self._with_mask_mod(info)
    for mod in (self.score_mod, self.mask_mod):
      if mod is not None:
        self._add_residuals(mod)
    if padded.has_dropout:
      # int32 in scalar memory (the kernel hashes it as uint32).
      seed = jnp.asarray(padded.dropout_seed, jnp.uint32).reshape(1)
      self._add("seed", jax.lax.bitcast_convert_type(seed, jnp.int32))
    if padded.restricts_positions:
      self._add("q_pos", lane_rows(padded.q_positions))
      self._add("kv_pos", _sublane_rows(padded.kv_positions))
    if padded.has_segments:
      self._add("q_seg", lane_rows(padded.q_segment_ids))
      self._add("kv_seg", _sublane_rows(padded.kv_segment_ids))
    self.bias_shape = None
    if self.bias is not None:
      if self.bias.dtype == jnp.float16:
        self.bias = self.bias.astype(_F32)
      self.bias_shape = self.bias.shape
      self._add("bias", self.bias)
    self.float8 = None
    if float8:
      self.float8 = self._add_scales(*scales, params.scale)
    mask_shape = None
    if padded.mask is not None:
      mask = padded.mask.astype(jnp.int8)  # Mosaic has no bool memrefs.
      mask_shape = mask.shape
      self._add("mask", mask)
    interpret = kernel.interpret_params()
    self.static = kernel.Static(
        scale=1.0 if float8 else params.scale,
        soft_cap=params.soft_cap,
        is_causal=info.is_causal,
        window=info.window,
        batch=self.b,
        num_heads=self.n,
        num_kv_heads=self.num_kv,
        head_dim=self.hp,
        value_head_dim=self.hvp,
        q_len=self.tp,
        kv_len=self.sp,
        block_q=self.bq,
        block_kv=self.bk,
        positions=padded.restricts_positions,
        segments=padded.has_segments,
        bias_shape=self.bias_shape,
        mask_shape=mask_shape,
        dropout_rate=padded.dropout_rate,
        precision=kernel_precision(
            params.precision, jnp.bfloat16 if float8 else q.dtype),
        interpret=interpret,
        parallel=kernel.parallel_grid(interpret),
        score_mod=self.score_mod,
        mask_mod=self.mask_mod,
        float8=self.float8,
    )

  def _add(self, name, x):
    self.names.append(name)
    self.operands.append(x)

  def _add_scales(self, q_scale, k_scale, v_scale, logit_scale):
    """A float8 call's scales as kernel inputs (`kernel.Float8`): the
    query's times the logit scale (and the key's, if one per head) as
    rows; a key's or value's per-key scales as rows, else the value's as
    one SMEM scalar per (batch row, query head)."""
    per_key = [x.shape[1] > 1 for x in (k_scale, v_scale)]
    q_factor = q_scale * logit_scale
    if not per_key[0]:
      q_factor = q_factor * self.per_query_head(k_scale)
    self._add("q_scale", self.scale_rows(q_factor, queries=True)[:, :, None])
    if per_key[0]:
      self._add("k_scale", self.scale_rows(k_scale, queries=False)[:, :, None])
    if per_key[1]:
      v_scale = self.scale_rows(v_scale, queries=False)[:, :, None]
    else:
      v_scale = self.per_query_head(v_scale).reshape(-1).astype(_F32)
    self._add("v_scale", v_scale)
    return kernel.Float8(key_columns=per_key[0], value_columns=per_key[1])

  def _with_mask_mod(self, info):
    """The tile kinds [B, nq, nk] intersected with the mask_mod's, which
    are reduced over heads (the metadata has one word per batch row and
    tile): a tile is EMPTY (FULL) only if it is for every head."""
    mod = block_mask.tile_kinds(
        info, batch=self.b, heads=self.n, q_len=self.t, kv_len=self.s,
        block_q=self.bq, block_kv=self.bk,
        num_blocks=self.kinds.shape[1:])  # [Bm, Hm, nq, nk]
    return masking.intersect_kinds(self.kinds,
                                   masking.shared_kinds(mod, axis=1))

  def _add_residuals(self, mod):
    """A split score_mod/mask_mod's values as kernel inputs (see
    `kernel.Static`): [Bm * Hm] scalars ([Bm * Hm * size] for a table),
    32-bit (float32 or int32: scalar memory holds 32-bit words),
    [Bm, Tp, 128] per query, [Bm, 8, Sp] per key; bool as int32 (no bool
    memrefs)."""
    args = (self.info.score_mod_args if mod.is_score_mod
            else self.info.mask_mod_args)
    arrays = mod.residual_arrays(
        args, batch=self.b, heads=self.n, q_len=self.t, kv_len=self.s,
        q_padded=self.tp, kv_padded=self.sp)
    for i, (res, x) in enumerate(zip(mod.residuals, arrays)):
      if x.dtype == jnp.bool_:
        x = x.astype(jnp.int32)
      if res.level == fused_mods.Level.PROGRAM:
        x = x.reshape(-1).astype(
            _F32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32)
      elif res.level == fused_mods.Level.ROW:
        x = _lanes_of(x[:, 0])
      else:
        x = _sublanes_of(x[:, 0])
      self._add(f"{mod.name}.{i}", x)

  def queries(self, x):
    """[B, T, N, H] -> [B, Tp, N * Hp], padded rows zeroed (any H)."""
    return super().queries(x).reshape(self.b, self.tp, -1)

  def keys(self, x):
    """[B, S, K, H] -> [B, Sp, K * Hp], padded rows zeroed (any H)."""
    return super().keys(x).reshape(self.b, self.sp, -1)

  def rows(self, x, fill):
    """Per-row statistic [B, T, N] -> [B, N, 1, Tp] float32."""
    return super().rows(x.astype(_F32), fill)[:, :, None, :]

  def unqueries(self, x, head_dim, dtype):
    """[B, Tp, N * Hp] -> [B, T, N, head_dim] (Hp: head_dim padded)."""
    x = x.reshape(self.b, self.tp, self.n, -1)
    return x[:, : self.t, :, :head_dim].astype(dtype)

  def unkeys(self, x, head_dim, dtype):
    """[B, Sp, K * Hp] -> [B, S, K, head_dim] (Hp: head_dim padded)."""
    x = x.reshape(self.b, self.sp, self.num_kv, -1)
    return x[:, : self.s, :, :head_dim].astype(dtype)

  def unrows(self, x):
    """[B, N, 1, Tp] -> [B, T, N]."""
    return x[:, :, 0, : self.t].transpose(0, 2, 1)


def lane_rows(x):
  """[B, L] -> int32 [B, L, 128]: one value per sublane row, replicated on
  lanes."""
  return _lanes_of(x.astype(jnp.int32))


def _lanes_of(x):
  """[B, L] -> [B, L, 128] of x's dtype (`lane_rows`)."""
  return jnp.broadcast_to(x[:, :, None], x.shape + (_LANES,))


def _sublane_rows(x):
  """[B, L] -> int32 [B, 8, L]: one value per lane, replicated on
  sublanes."""
  return _sublanes_of(x.astype(jnp.int32))


def _sublanes_of(x):
  """[B, L] -> [B, 8, L] of x's dtype (`_sublane_rows`)."""
  b, length = x.shape
  return jnp.broadcast_to(x[:, None, :], (b, _SUBLANES, length))


def flex_mods(info):
  """(score_mod, mask_mod) of a call split for the kernels (`fused_mods`,
  tables included), None where absent.

  Raises:
    NotImplementedError: one the kernels cannot fuse, one that computes
      a value per query or per key that depends on the head (those travel
      lane- or sublane-replicated per batch row, as positions do), or one
      that reads a table of more than `kernel.MAX_TABLE_ENTRIES` entries per
      (batch row, head) program (the kernels select its entries one-hot).
  """
  fused = fused_mods.split_call(info, "mosaic_tpu", tables=True)
  for mod in fused:
    for res in () if mod is None else mod.residuals:
      if res.size is not None and res.size > kernel.MAX_TABLE_ENTRIES:
        raise NotImplementedError(
            f"mosaic_tpu cannot fuse this {mod.name}: it reads a table at "
            f"offsets computed per element, and each (batch row, head) "
            f"program's part of that table has {res.size} entries, more "
            f"than the {kernel.MAX_TABLE_ENTRIES} its kernels select from "
            "(one compare and select per entry on every element); "
            "\"chunked\" and \"xla\" run it.")
      if res.level != fused_mods.Level.PROGRAM and res.head:
        raise NotImplementedError(
            f"mosaic_tpu cannot fuse this {mod.name}: it computes a value "
            f"per {'query' if res.level == fused_mods.Level.ROW else 'key'}"
            " that depends on the head; \"chunked\" and \"xla\" run it.")
  return fused


def _forward(q, k, v, bias, info, params, scales=None):
  bs = BACKEND.block_sizes(params, q, k, info, v=v)
  lay = Layout(q, k, v, bias, info, params, bs.block_q, bs.block_kv, scales)
  out_dtype = q.dtype if scales is None else params.out_dtype
  out, lse = forward_kernel.forward(
      lay.static, fetch_schedule(lay.kinds), tuple(lay.names), lay.operands,
      compute_dtype(out_dtype))
  return lay.unqueries(out, lay.hv, out_dtype), lay.unrows(lse)


def _backward(q, k, v, bias, info, params, lse, dout, delta):
  bs = BACKEND.block_sizes(params, q, k, info, v=v)
  lay = Layout(q, k, v, bias, info, params, bs.block_q_bwd, bs.block_kv_bwd)
  names = tuple(lay.names) + ("do", "lse", "delta")
  operands = lay.operands + [
      lay.queries(dout),
      lay.rows(lse, online_softmax.MASK_VALUE),
      lay.rows(delta, 0.0),
  ]
  dq, *dmod = backward_kernels.backward_dq(
      lay.static, fetch_schedule(lay.kinds), names, operands, lay.dtype)
  # The dK/dV sweep runs over query tiles per key tile: transposed kinds.
  outs = backward_kernels.backward_dkv(
      lay.static, fetch_schedule(lay.kinds.transpose(0, 2, 1)), names,
      operands, lay.dtype, with_dbias=bias is not None)
  dq = lay.unqueries(dq, lay.h, q.dtype)
  dk = lay.unkeys(outs[0], lay.h, k.dtype)
  dv = lay.unkeys(outs[1], lay.hv, v.dtype)
  dbias = None
  if bias is not None:
    dbias = outs[2]  # [B, N, Tp, Sp]: sum over the bias's broadcast dims.
    axes = tuple(a for a in range(4) if bias.shape[a] == 1)
    dbias = dbias.sum(axis=axes, keepdims=True)
    dbias = dbias[:, :, : bias.shape[2], : bias.shape[3]].astype(bias.dtype)
  if lay.score_mod is None:
    return dq, dk, dv, dbias
  # Per query, [B, N, 1, Tp] (padded rows have zero cotangent); a table's
  # per query tile, [B, N, 1, nq * width] -> [B, N, nq, size].
  differentiable = [r for r in lay.score_mod.residuals if r.differentiable]
  nq = lay.tp // lay.bq
  dmod = [d if r.size is None else d.reshape(
      lay.b, lay.n, nq, -1)[..., :r.size] for d, r in zip(dmod,
                                                          differentiable)]
  return dq, dk, dv, dbias, lay.score_mod.args_grad_from_partials(
      info.score_mod_args, dmod, batch=lay.b, heads=lay.n)


def _check(q, k, v, bias, info, params):
  """Declines only calls whose per-step metadata would not fit in SMEM.

  Every feature of the public op runs in the kernels: bias (with its
  gradient), dense masks, GQA/MQA, positions, segment ids, windows, soft
  capping, attention dropout and a value head dim Hv != H; float16
  computes in float32 (the TPU's matrix unit has no float16 mode), and
  float8 inputs (the forward; `kernel.Float8`) in bfloat16. The
  grid's metadata -- one int32 per (batch row, query tile, key tile) --
  lives in scalar memory; past its capacity the call is declined (larger
  `block_sizes` shrink it). Flex attention is fused (`flex_mods`), except
  a function whose per-tile part a kernel cannot run, whose per-query or
  per-key values depend on the head, or that reads a table of more than
  `kernel.MAX_TABLE_ENTRIES` entries per program; a table's words (every
  program's part) share the scalar memory with the metadata, and one that
  would not fit beside it is declined too.
  """
  manual_axes.check_kernels(
      "mosaic_tpu", q, k, v, bias, info,
      interpreted=lambda: kernel.interpret_params() is not False)
  fused = flex_mods(info)
  capacity = kernel.metadata_capacity()
  if capacity is None:
    return
  bs = BACKEND.block_sizes(params, q, k, info, v=v)
  (b, t, n), s = q.shape[:3], k.shape[1]
  # The functions' per-program values and tables, in scalar memory too.
  flex_words = sum(
      (b if r.batch else 1) * (n if r.head else 1) * (r.size or 1)
      for mod in fused if mod is not None for r in mod.residuals
      if r.level == fused_mods.Level.PROGRAM)
  if quantize.is_fp8(q.dtype):  # A value scale per program, at most.
    flex_words += b * n
  for block_q, block_kv in ((bs.block_q, bs.block_kv),
                            (bs.block_q_bwd, bs.block_kv_bwd)):
    (bq, tp), (bk, sp) = (layout.tile(block_q, t, ALIGN),
                          layout.tile(block_kv, s, ALIGN))
    words = b * (tp // bq) * (sp // bk)
    if words > capacity:
      raise NotImplementedError(
          f"mosaic_tpu: {words} per-step metadata words (B * T/block_q * "
          f"S/block_kv with {block_q=}, {block_kv=}) exceed the "
          f"{capacity} that fit in this TPU's scalar memory; use larger "
          "block_sizes."
      )
    if words + flex_words > capacity:
      raise NotImplementedError(
          f"mosaic_tpu: the per-(batch row, head) values and tables "
          f"({flex_words} words: the score_mod/mask_mod's, a float8 call's "
          f"value scales) and {words} per-step "
          f"metadata words exceed the {capacity} that fit in this TPU's "
          "scalar memory; \"chunked\" and \"xla\" run it.")


BACKEND = vjp.Backend(
    name="mosaic_tpu",
    forward=_forward,
    backward=_backward,
    check=_check,
    block_sizes_type=MosaicTpuBlockSizes,
    default_block_sizes=default_block_sizes,
    dtypes=(jnp.float32, jnp.bfloat16, jnp.float16) + quantize.FP8_DTYPES,
    value_head_dim=True,
    dropout=True,
)
