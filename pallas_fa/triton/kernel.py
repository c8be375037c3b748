"""The Pallas kernel bodies of the `triton` backend.

`triton` pads the inputs, builds the BlockSpecs and launches; these are the
programs it launches (FlashAttention-2, Algorithm 1 and §3.2), written against
one dict of refs each (`triton.pallas_call`): the forward, the dK/dV kernel
(transposed orientation, the GQA group summed inside) and the dQ kernel (with
dbias). They work in base 2, with log2(e) folded into the logits.

Flex attention arrives split (`pallas_fa.flex.fused_mods`): the kernels read a
score_mod's and a mask_mod's per-program, per-query and per-key values as
inputs and run their tile parts on each tile; with a mask_mod, a program
walks the lists of its FULL and PARTIAL tiles (`refs["lists"]`) instead of
a range. A table the tile part reads at computed offsets (T5's buckets,
`table[head, bucket(kv_idx - q_idx)]`) is an input holding each program's
table; the read is a load at those offsets (a gather from global memory,
cached in L1), and its gradient (dQ kernel) a scatter-add into a vector of
the table's size per program, carried across the program's tiles and
written once (`_scatter_add`), which `triton` sums over the programs
afterwards: no atomics, so the table's gradient is deterministic too.

Float8 calls (`Fp8`) run the forward on the 1-byte tiles as stored,
converted in registers for the products (float32 accumulation), the
scales acting on the float32 logits, on P's columns and on the output;
with one key scale a head the row factor rides in the exponent's fused
multiply-add (`Fp8.exponent_scale`), as the logit scale of a 16-bit
call does. (On Hopper `triton` widens long calls' inputs to float16
before the kernel, which then converts nothing: `triton.widens_float8`.)
The products take float16 operands, which hold every float8 value
exactly: jax's Pallas-Triton lowering (0.10 and 0.11) builds a float8
`tt.dot` with max_num_imprecise_acc = 0, which Triton's Hopper path
(MMAv3, wgmma) refuses for float8, so a float8 dot there becomes float16
mma.sync after the same conversion (ptxas, H100: `cvt.rn.f16x2.e4m3x2`
and `mma.sync.aligned.m16n8k16...f16`), while float16 operands get
wgmma. `FLOAT8_OPERANDS` switches to float8 operands (and P rounded to
e4m3, FlashAttention-3) for a lowering that sets it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_fa import dropout
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa.flex import fused_mods
from pallas_fa.triton import exp2

_F32 = jnp.float32


# Whether a float8 forward's products take float8 operands (P rounded to
# e4m3) rather than float16 ones (see the module docstring): not while the
# Pallas lowering leaves Triton's max_num_imprecise_acc at 0.
FLOAT8_OPERANDS = False


@dataclasses.dataclass(frozen=True)
class Fp8:
  """How the forward computes a float8 call (`triton` builds it).

  The kernel reads per program or per query row a float32 `q_scale`
  (the query's scale times the key's when that is one per program, times
  the logit scale and log2(e) when `folded`), per key the key's
  (`k_cols`) and the value's (`v_cols`, divided by their largest over the
  program's keys so that it is at most 1), and per program `o_scale`,
  the value's scale (or that largest), which multiplies the output once.

  Attributes:
    qk_dtype: the operand dtype of Q.K^T: float16, or with
      `FLOAT8_OPERANDS` the float8 format of query and key when they
      share it.
    pv_dtype: that of P.V: float16, or with `FLOAT8_OPERANDS`
      float8_e4m3fn against an e4m3 V with one scale per program, P
      rounded to it (FlashAttention-3); never e5m2 (P would keep 2
      mantissa bits) nor with per-key value scales (P c rounded to e4m3
      loses the exactness of P's largest entry: 3.5x the largest error of
      per-head scales on tests/test_fp8.py's inputs).
    q_rows: `q_scale` is one per query row (else one per program).
    k_cols: per-key key scales multiply the logits' columns.
    v_cols: per-key value scales multiply P's columns.
    folded: the logit scale and log2(e) are in `q_scale` (no soft cap,
      bias or score_mod): the scaled product is the base-2 logit.
    offset: P = exp2(s - m + offset) (and the row sum with it), so that
      P's largest entry, 2**offset, lies near the top of `pv_dtype`'s
      range and small entries keep their bits above its subnormals
      (FlashAttention-3's max offset 8 for e4m3; `p_offset`).
  """

  qk_dtype: Any
  pv_dtype: Any
  q_rows: bool
  k_cols: bool
  v_cols: bool
  folded: bool
  offset: float

  @property
  def exponent_scale(self) -> bool:
    """Whether `q_scale` rides in the exponent's fused multiply-add
    (`online_softmax.update`'s `scale`): when it is all that scales the
    products (`folded`, no per-key key scales), the row max is taken on
    the raw products and scaled once a row, one multiply and one subtract
    a logit fewer. The factor must then be positive: `triton` folds its
    sign into the queries (exact) before the kernel."""
    return self.folded and not self.k_cols


def p_offset(pv_dtype, dropout_rate: float) -> float:
  """`Fp8.offset`: the largest power of two P may reach, by the format of
  P.V's operands: 2**8 below e4m3's 448 (FlashAttention-3), 2**15 below
  float16's 65504 (its smallest normal is 2**-14), less when dropout's
  factor 1 / (1 - rate) would take P past that largest value; 0 for
  bfloat16 (float32's exponent range). A power of two, so an overshoot of
  exp2 cannot round past the format's largest value."""
  dtype = jnp.dtype(pv_dtype)
  if dtype == jnp.dtype(jnp.bfloat16):
    return 0.0
  cap = 8 if dtype == jnp.dtype(jnp.float8_e4m3fn) else 15
  largest = float(jnp.finfo(dtype).max)
  return float(min(cap, math.floor(math.log2(largest * (1 - dropout_rate)))))


@dataclasses.dataclass(frozen=True)
class Features:
  """What the kernels must compute (hashable: it parameterises the kernels).

  `mask` / `bias` are None or, per axis (B, N, T, S), whether the dense array
  is full along that axis (False: broadcast, size 1).
  """

  scale: float
  soft_cap: float | None
  is_causal: bool
  window: tuple[int | None, int | None] | None
  segments: bool
  mask: tuple[bool, bool, bool, bool] | None
  bias: tuple[bool, bool, bool, bool] | None
  groups: int
  precision: Any = None
  dropout_rate: float = 0.0
  score_mod: fused_mods.FusedMod | None = None
  mask_mod: fused_mods.FusedMod | None = None
  # Whether the tile lists of a mask_mod differ between query heads.
  lists_per_head: bool = False
  # A float8 forward: how its products and scales run (None: not one).
  fp8: Fp8 | None = None

  @property
  def positions(self) -> bool:
    return self.is_causal or self.window is not None

  @property
  def builtin_mask(self) -> bool:
    """Whether positions, segments or a dense mask can mask an element."""
    return self.positions or self.segments or self.mask is not None

  @property
  def masked(self) -> bool:
    return self.builtin_mask or self.mask_mod is not None

  @property
  def softmax_scale(self) -> float | None:
    """When a tile's base-2 logits are its products times one positive
    constant (no cap, bias, score_mod or float8 scaling), that constant:
    the kernels then leave the multiply to the exponential's fused
    multiply-add (`online_softmax.update(scale=...)`, `probs(scale=...)`,
    `exp2`). Else None: the logits come scaled."""
    if self.fp8 is not None:
      return None
    return online_softmax.exponent_scale(
        self.scale, cap=self.soft_cap, has_bias=self.bias is not None,
        has_score_mod=self.score_mod is not None)


@dataclasses.dataclass(frozen=True)
class Tile:
  """Where a tile lies, for a flex function's indices and values.

  Attributes:
    q_idx, kv_idx: int32 token indices broadcasting against the tile.
    rows: the ref index of its queries in the per-query inputs of the
      dK/dV kernel (None: the program's own block).
    cols: likewise for its keys in the query-major kernels.
    group: the query head's index within its GQA group (dK/dV kernel),
      None in the query-major kernels.
  """

  q_idx: Any
  kv_idx: Any
  rows: Any = None
  cols: Any = None
  group: Any = None

  @property
  def queries_last(self) -> bool:
    return self.group is not None


def query_major_tile(row0, rows: int, col0, cols: int, col_slice) -> Tile:
  """The Tile of queries [row0, row0 + rows) x keys [col0, col0 + cols)."""
  return Tile(q_idx=row0 + jnp.arange(rows, dtype=jnp.int32)[:, None],
              kv_idx=col0 + jnp.arange(cols, dtype=jnp.int32)[None, :],
              cols=col_slice)


def mod_values(refs, mod: fused_mods.FusedMod, tile: Tile) -> list:
  """The residuals of `mod` (`fused_mods.FusedMod.residuals`) for a tile,
  shaped to broadcast against it; bool ones arrive as int8. A table's is
  a load of the program's table at int32 offsets."""
  level = fused_mods.Level
  values = []
  for i, r in enumerate(mod.residuals):
    ref = refs[residual_name(mod, i)]
    if r.size is not None:  # [width], or [G|1, width] in dK/dV.
      values.append(_table_load(ref, r, tile))
      continue
    if not tile.queries_last:  # [1], the program's [rows], all [Sp].
      if r.level == level.PROGRAM:
        v = ref[...][None, :]
      elif r.level == level.ROW:
        v = ref[...][:, None]
      else:
        v = ref[tile.cols][None, :]
    else:  # [G|1, 1], [G|1, Tp], the program's [G|1, cols].
      g = tile.group if r.head else 0
      if r.level == level.PROGRAM:
        v = ref[g, :][None, :]
      elif r.level == level.ROW:
        v = ref[g, tile.rows][None, :]
      else:
        v = ref[g, :][:, None]
    values.append(v != 0 if r.dtype == jnp.bool_ else v)
  return values


def residual_name(mod: fused_mods.FusedMod, i: int) -> str:
  """The kernel input holding residual i of `mod`."""
  return f"{mod.name}.{i}"


def table_width(size: int) -> int:
  """The padded length of a table input of `size` elements (a power of
  two, for Triton's block shapes); offsets never reach the padding."""
  return max(16, 1 << (size - 1).bit_length())


def _table_load(ref, r: fused_mods.Residual, tile: Tile):
  """The load of a table residual at a tile of offsets."""
  def load(offsets):
    if tile.queries_last:
      x = ref[tile.group if r.head else 0, offsets]
    else:
      x = ref[offsets]
    return x != 0 if r.dtype == jnp.bool_ else x
  return load


def _scatter_add(offsets, d, size: int):
  """`d` [rows, cols] added at `offsets` into a float32 vector of the
  table's width: one masked sum per offset the tile reads, in a loop over
  [min, max] of its offsets (a few for a T5 tile away from the diagonal).
  A fixed order, so deterministic; the tables are small (one program's)."""
  width = table_width(size)
  lanes = jnp.arange(width, dtype=jnp.int32)
  # Two one-axis reductions (see `_modded_logits`).
  lo = offsets.min(axis=1).min(axis=0)
  hi = offsets.max(axis=1).max(axis=0)

  def body(e, acc):
    total = jnp.where(offsets == e, d, 0.0).sum(axis=1).sum(axis=0)
    return acc + jnp.where(lanes == e, total, 0.0)

  return jax.lax.fori_loop(lo, hi + 1, body, jnp.zeros((width,), _F32))


def _dot(a, b, feat: Features):
  """a @ b, float32 accumulation at the call's matmul precision (float32
  inputs: DEFAULT/HIGH run TF32 on tensor cores, HIGHEST full float32)."""
  return jax.lax.dot_general(
      a, b, (((1,), (0,)), ((), ())), precision=feat.precision,
      preferred_element_type=_F32)


def _dot_nt(a, b, feat: Features):
  """a @ b.T, as `_dot`."""
  return jax.lax.dot_general(
      a, b, (((1,), (1,)), ((), ())), precision=feat.precision,
      preferred_element_type=_F32)


def _logits(feat: Features, qk, bias):
  """(base-2 logits, capped natural logits or None) of a tile."""
  return online_softmax.logits(
      qk, scale=feat.scale, cap=feat.soft_cap, bias=bias, base2=True)


def _program_ids():
  """The three grid indices, read at the kernel's top level (the
  interpreter resolves `program_id` there, not inside loop bodies)."""
  return pl.program_id(0), pl.program_id(1), pl.program_id(2)


def _dropout_factor(refs, feat: Features, batch, head, row0, rows: int,
                    col0, cols: int, *, queries_last: bool = False):
  """The [rows, cols] attention-dropout factor of a tile (0 or
  1 / (1 - rate), `pallas_fa.dropout`): rows are queries and columns keys,
  or the converse with `queries_last`."""
  seed = refs["seed"][...][None, :]  # [1, 1] uint32
  r = row0 + jnp.arange(rows, dtype=jnp.int32)[:, None]
  c = col0 + jnp.arange(cols, dtype=jnp.int32)[None, :]
  q_index, kv_index = (c, r) if queries_last else (r, c)
  keep = dropout.keep_mask(seed, feat.dropout_rate, batch, head, q_index,
                           kv_index)
  return dropout.factor(keep, feat.dropout_rate, _F32)


def _visible(feat: Features, row_pos, col_pos, row_seg, col_seg, dense, *,
             queries_last: bool = False):
  """`masking.visible` for a [rows, cols] tile from per-row/column data.

  Rows are queries and columns keys, or the converse with `queries_last`
  (the transposed dK/dV tile).
  """
  def rows(x):
    return None if x is None else x[:, None]

  def cols(x):
    return None if x is None else x[None, :]

  q_pos, kv_pos = rows(row_pos), cols(col_pos)
  q_seg, kv_seg = rows(row_seg), cols(col_seg)
  if queries_last:
    q_pos, kv_pos = cols(col_pos), rows(row_pos)
    q_seg, kv_seg = cols(col_seg), rows(row_seg)
  return masking.visible(
      is_causal=feat.is_causal, window=feat.window,
      q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg,
      dense=None if dense is None else dense != 0,
  )


def _visit(refs, tile, carry, feat: Features, num_tiles: int, group=None):
  """Runs tile(j, carry, masked) over the non-empty tiles of this program.

  `refs["bounds"]` holds (lo, full_lo, full_hi, hi): tiles in
  [full_lo, full_hi) are FULL and skip the masking arithmetic; the others in
  [lo, hi) are masked; everything outside [lo, hi) is EMPTY and not visited.
  With a mask_mod, whose non-empty tiles need not be contiguous,
  `refs["lists"]` holds (number FULL, number PARTIAL, the FULL tiles, the
  PARTIAL tiles) instead (`tile_lists`), per query head of the GQA group
  `group` in the dK/dV kernel.
  """
  if feat.mask_mod is not None:
    lists = refs["lists"]
    if group is not None:
      g = group if feat.lists_per_head else 0

      def at(i):
        return lists[g, i]
    else:
      def at(i):
        return lists[i]

    def listed(start, masked):
      def body(step, carry):
        return tile(at(start + step), carry, masked=masked)
      return body

    carry = jax.lax.fori_loop(0, at(0), listed(2, False), carry)
    return jax.lax.fori_loop(0, at(1), listed(2 + at(0), True), carry)
  if not feat.masked:
    return jax.lax.fori_loop(
        0, num_tiles, functools.partial(tile, masked=False), carry)
  bounds = refs["bounds"]
  lo, full_lo, full_hi, hi = (bounds[i] for i in range(4))
  head = full_lo - lo

  def masked_tile(step, carry):
    # The partial tiles before and after the FULL run, in one loop: one copy
    # of the masked body (the online softmax does not depend on tile order).
    j = jnp.where(step < head, lo + step, full_hi + (step - head))
    return tile(j, carry, masked=True)

  carry = jax.lax.fori_loop(
      full_lo, full_hi, functools.partial(tile, masked=False), carry)
  return jax.lax.fori_loop(0, head + hi - full_hi, masked_tile, carry)


def _dense_tile(ref, full, lead, rows, cols):
  """Loads a dense tile; broadcast axes load as size 1."""
  return ref[(*lead, rows if full[2] else slice(None),
              cols if full[3] else slice(None))]


def _modded_logits(refs, feat: Features, qk, bias, tile: Tile, grad: bool,
                   args: bool = True):
  """(base-2 logits, capped logits, score_mod pullback or None) of a tile:
  `_logits`, with the score_mod applied to the natural logits (and its
  pullback kept when `grad`, `fused_mods.FusedMod.tile_vjp`; with the
  cotangents of its arrays' values when `args`)."""
  if feat.score_mod is None:
    return (*_logits(feat, qk, bias), None)
  s, s_capped = online_softmax.logits(
      qk, scale=feat.scale, cap=feat.soft_cap, bias=bias)
  values = mod_values(refs, feat.score_mod, tile)
  pullback = None
  if grad:
    # Broadcast to the tile, so that the cotangents come back as tiles and
    # are summed one axis at a time (Triton's lowering of a two-axis
    # reduction fails under jax 0.11's explicit meshes).
    values = [v if callable(v) else jnp.broadcast_to(v, s.shape)
              for v in values]
    s, pullback = feat.score_mod.tile_vjp(
        values, q_idx=tile.q_idx, kv_idx=tile.kv_idx, score=s,
        reduce=lambda d: d.sum(axis=1).sum(axis=0), args=args,
        scatter=_scatter_add)
  else:
    s = feat.score_mod.tile(values, q_idx=tile.q_idx, kv_idx=tile.kv_idx,
                            score=s)
  return s * online_softmax.LOG2_E, s_capped, pullback


def _tile_scores(refs, feat: Features, qk, bias, tile: Tile, grad: bool,
                 args: bool = True):
  """`_modded_logits` of a tile, or its products themselves when the
  exponential applies the logit scale (`Features.softmax_scale`)."""
  if feat.softmax_scale is not None:
    return qk, None, None
  return _modded_logits(refs, feat, qk, bias, tile, grad, args)


def _with_mask_mod(refs, feat: Features, visible, tile: Tile):
  """`visible` (None: all) intersected with the mask_mod on the tile."""
  if feat.mask_mod is None:
    return visible
  mod = feat.mask_mod.tile(mod_values(refs, feat.mask_mod, tile),
                           q_idx=tile.q_idx, kv_idx=tile.kv_idx)
  return mod if visible is None else jnp.logical_and(visible, mod)


def _tile_logits(refs, feat: Features, q, k, tile: Tile, q_pos, q_seg,
                 masked, grad=False, dequantize=None):
  """(s, s_capped, score_mod pullback) of the [block_q, block_k] tile of
  the keys `tile.cols` in the query-major kernels (forward, dQ), masked
  when `masked` (base 2; with a `Features.softmax_scale`, the masked
  products: the exponential scales them). `dequantize`: a float8
  forward's scaling of the float32 products (`_fp8_scales`)."""
  cols = tile.cols
  bias = None
  if feat.bias is not None:
    bias = _dense_tile(refs["bias"], feat.bias, (), slice(None), cols)
  qk = _dot_nt(q, k, feat)
  if dequantize is not None:
    qk = dequantize(qk)
  if feat.fp8 is not None and feat.fp8.folded:
    s, s_capped, pullback = qk, None, None  # Base-2 logits already.
  else:
    s, s_capped, pullback = _tile_scores(refs, feat, qk, bias, tile, grad)
  if masked:
    visible = None
    if feat.builtin_mask:
      dense = None
      if feat.mask is not None:
        dense = _dense_tile(refs["mask"], feat.mask, (), slice(None), cols)
      visible = _visible(
          feat, q_pos, refs["kv_pos"][cols] if feat.positions else None,
          q_seg, refs["kv_seg"][cols] if feat.segments else None, dense)
    s = online_softmax.apply_mask(
        s, _with_mask_mod(refs, feat, visible, tile))
  return s, s_capped, pullback


# ----------------------------------------------------------------------------
# Forward.


def forward(refs, *, feat: Features, block_k: int, num_tiles: int,
                    reverse_rows: bool):
  q = refs["q"][...]  # [block_q, Hp]
  block_q = q.shape[0]
  hvp = refs["v"].shape[-1]  # the value head dim, padded
  row, head, batch = _program_ids()
  if reverse_rows:
    row = pl.num_programs(0) - 1 - row
  q_pos = refs["q_pos"][...] if feat.positions else None  # [block_q]
  q_seg = refs["q_seg"][...] if feat.segments else None
  fp8 = feat.fp8
  offset = 0.0
  # The logits' scale left to the exponential (None: s holds the logits).
  exponent_scale = feat.softmax_scale
  if fp8 is not None:
    q = q.astype(fp8.qk_dtype)
    offset = fp8.offset
    if fp8.exponent_scale:
      exponent_scale = refs["q_scale"][...]  # [block_q], or [1]

  def tile(j, carry, masked):
    m_i, l_i, acc = carry
    cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k = refs["k"][cols, :]  # [block_k, Hp]
    v = refs["v"][cols, :]  # [block_k, Hvp]
    dequantize = None
    if fp8 is not None:
      k = k.astype(fp8.qk_dtype)
      v = v.astype(fp8.pv_dtype)
      if not fp8.exponent_scale:
        dequantize = functools.partial(_fp8_logits, refs, fp8, cols)
    s, _, _ = _tile_logits(
        refs, feat, q, k, query_major_tile(row * block_q, block_q,
                                           j * block_k, block_k, cols),
        q_pos, q_seg, masked, dequantize=dequantize)
    m_i, l_i, p, alpha = online_softmax.update(
        m_i, l_i, s, base2=True, offset=offset, tile_exp=exp2.exp2,
        scale=exponent_scale)
    if feat.dropout_rate:
      # On the normalised probabilities: l_i sums the undropped ones.
      p = p * _dropout_factor(refs, feat, batch, head, row * block_q,
                              block_q, j * block_k, block_k)
    if fp8 is not None and fp8.v_cols:
      # (P c) . v = P . (v c): the value scales on P's columns.
      p = p * refs["v_scale"][cols][None, :]
    acc = online_softmax.rescale(acc, alpha) + _dot(p.astype(v.dtype), v, feat)
    return m_i, l_i, acc

  carry = online_softmax.init((block_q,), (block_q, hvp))
  m_i, l_i, acc = _visit(refs, tile, carry, feat, num_tiles)
  out, lse = online_softmax.finalize(m_i, l_i, acc, base2=True,
                                    offset=offset)
  if fp8 is not None:
    out = out * refs["o_scale"][...][None, :]
  refs["out"][...] = out.astype(refs["out"].dtype)
  refs["lse"][...] = lse


def _fp8_logits(refs, fp8: Fp8, cols, qk):
  """A float8 tile's float32 products -> the dequantized products (the
  base-2 logits when `fp8.folded`): the per-program or per-query scale
  on the rows, a per-key key scale on the columns."""
  qk = qk * refs["q_scale"][...][:, None]
  if fp8.k_cols:
    qk = qk * refs["k_scale"][cols][None, :]
  return qk


# ----------------------------------------------------------------------------
# Backward.


def backward_dkv(refs, *, feat: Features, block_q: int, num_tiles: int):
  # Transposed orientation (S^T = K Q^T, FlashAttention-2 §3.1.2): every
  # matmul has M = block_kv, and P^T / dS^T are the left operands of the
  # dV / dK updates as computed, so no tile is ever transposed in registers.
  k = refs["k"][...]  # [block_kv, Hp]
  v = refs["v"][...]  # [block_kv, Hvp]
  block_kv, hp = k.shape
  kv_block, kv_head, batch = _program_ids()
  kv_pos = refs["kv_pos"][...] if feat.positions else None  # [block_kv]
  kv_seg = refs["kv_seg"][...] if feat.segments else None

  def head(g, carry):
    def tile(i, carry, masked):
      dk, dv = carry
      rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
      q = refs["q"][rows, g, :]  # [block_q, Hp]
      do = refs["do"][rows, g, :]  # [block_q, Hvp]
      lse = refs["lse"][g, rows]  # [block_q], base 2
      delta = refs["delta"][g, rows]
      bias = None
      if feat.bias is not None:
        bias = _dense_tile(refs["bias"], feat.bias,
                           (g if feat.bias[1] else 0,), rows, slice(None)).T
      flex_tile = Tile(
          q_idx=i * block_q + jnp.arange(block_q, dtype=jnp.int32)[None, :],
          kv_idx=kv_block * block_kv + jnp.arange(
              block_kv, dtype=jnp.int32)[:, None],
          rows=rows, group=g)
      # [block_kv, block_q]
      # The score_mod's arrays take their gradients in dQ.
      s, s_capped, score_mod_pullback = _tile_scores(
          refs, feat, _dot_nt(k, q, feat), bias, flex_tile, grad=True,
          args=False)
      if masked:
        visible = None
        if feat.builtin_mask:
          dense = None
          if feat.mask is not None:
            dense = _dense_tile(refs["mask"], feat.mask,
                                (g if feat.mask[1] else 0,), rows,
                                slice(None)).T
          visible = _visible(
              feat, kv_pos, refs["q_pos"][rows] if feat.positions else None,
              kv_seg, refs["q_seg"][rows] if feat.segments else None, dense,
              queries_last=True)
        s = online_softmax.apply_mask(
            s, _with_mask_mod(refs, feat, visible, flex_tile))
      p = online_softmax.probs_from_lse(
          s, lse, base2=True, per_query=online_softmax.queries_last,
          tile_exp=exp2.exp2, scale=feat.softmax_scale)
      dp = _dot_nt(v, do, feat)  # [block_kv, block_q]
      p_used = p
      if feat.dropout_rate:
        # dV from the dropped P^T, dP^T through the same mask, and
        # dS^T = P^T * (dP^T - delta) (FlashAttention-2's dropout backward).
        z = _dropout_factor(
            refs, feat, batch, kv_head * feat.groups + g, kv_block * block_kv,
            block_kv, i * block_q, block_q, queries_last=True)
        p_used, dp = p * z, dp * z
      dv = dv + _dot(p_used.astype(do.dtype), do, feat)  # [block_kv, Hvp]
      ds = online_softmax.softmax_grad(
          p, dp, delta, per_query=online_softmax.queries_last)
      if score_mod_pullback is not None:
        ds, _ = score_mod_pullback(ds)
      ds = online_softmax.logits_grad(ds, s_capped, cap=feat.soft_cap)
      dk = dk + _dot(ds.astype(q.dtype), q, feat)  # unscaled, see below
      return dk, dv

    return _visit(refs, tile, carry, feat, num_tiles, group=g)

  carry = (jnp.zeros((block_kv, hp), _F32),
           jnp.zeros((block_kv, v.shape[1]), _F32))
  if feat.groups == 1:
    dk, dv = head(0, carry)
  else:
    # The whole GQA group, so dK/dV leave the kernel already reduced.
    dk, dv = jax.lax.fori_loop(0, feat.groups, head, carry)
  # d logits / d qk = scale: applied once to the sum, not per tile.
  refs["dk"][...] = (dk * feat.scale).astype(refs["dk"].dtype)
  refs["dv"][...] = dv.astype(refs["dv"].dtype)


def backward_dq(refs, *, feat: Features, block_k: int, num_tiles: int):
  q = refs["q"][...]  # [block_q, Hp]
  do = refs["do"][...]  # [block_q, Hvp]
  lse = refs["lse"][...]  # [block_q], base 2
  delta = refs["delta"][...]
  block_q, hp = q.shape
  q_block, head, batch = _program_ids()
  q_pos = refs["q_pos"][...] if feat.positions else None
  q_seg = refs["q_seg"][...] if feat.segments else None
  db = feat.bias
  # dbias: tiles stored in place when bias has a full key axis, else a
  # running row sum; the query axis is summed in the tile when bias
  # broadcasts over it.
  db_rows = block_q if db is not None and db[2] else 1
  db_carry = db is not None and not db[3]

  def tile(j, carry, masked):
    dq, db_acc, dmod = carry
    cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k = refs["k"][cols, :]  # [block_k, Hp]
    v = refs["v"][cols, :]  # [block_k, Hvp]
    s, s_capped, score_mod_pullback = _tile_logits(
        refs, feat, q, k, query_major_tile(q_block * block_q, block_q,
                                           j * block_k, block_k, cols),
        q_pos, q_seg, masked, grad=True)
    p = online_softmax.probs_from_lse(s, lse, base2=True,
                                      tile_exp=exp2.exp2,
                                      scale=feat.softmax_scale)
    dp = _dot_nt(do, v, feat)  # [block_q, block_k]
    if feat.dropout_rate:
      dp = dp * _dropout_factor(refs, feat, batch, head, q_block * block_q,
                                block_q, j * block_k, block_k)
    ds = online_softmax.softmax_grad(p, dp, delta)
    if score_mod_pullback is not None:
      # dS w.r.t. the logits before score_mod (also the bias gradient), and
      # this tile's share of each per-program value's gradient.
      ds, d = score_mod_pullback(ds)
      dmod = tuple(a + b for a, b in zip(dmod, d))
    if db is not None:
      d = ds if db[2] else ds.sum(axis=0, keepdims=True)
      if db[3]:
        refs["dbias"][:, cols] = d.astype(refs["dbias"].dtype)
      else:
        db_acc = db_acc + d.sum(axis=1, keepdims=True)
    ds = online_softmax.logits_grad(ds, s_capped, cap=feat.soft_cap)
    dq = dq + _dot(ds.astype(k.dtype), k, feat)  # unscaled, see below
    return dq, db_acc, dmod

  if db is not None and db[3] and feat.masked:
    # Tiles outside the visited ones have zero gradient; write it.
    def zero(j, c):
      cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
      refs["dbias"][:, cols] = jnp.zeros((db_rows, block_k), _F32)
      return c

    if feat.mask_mod is not None:  # Visited tiles overwrite theirs.
      jax.lax.fori_loop(0, num_tiles, zero, 0)
    else:
      bounds = refs["bounds"]
      jax.lax.fori_loop(0, bounds[0], zero, 0)
      jax.lax.fori_loop(bounds[3], num_tiles, zero, 0)
  dmod = ()
  if feat.score_mod is not None:
    dmod = tuple(
        jnp.zeros(() if r.size is None else (table_width(r.size),), _F32)
        for r in feat.score_mod.residuals if r.differentiable)
  carry = (jnp.zeros((block_q, hp), _F32),
           jnp.zeros((db_rows, 1), _F32) if db_carry else None, dmod)
  dq, db_acc, dmod = _visit(refs, tile, carry, feat, num_tiles)
  for i, d in enumerate(dmod):
    ref = refs[f"d{feat.score_mod.name}.{i}"]
    ref[...] = jnp.broadcast_to(d, ref.shape)
  if db_carry:
    refs["dbias"][...] = db_acc
  refs["dq"][...] = (dq * feat.scale).astype(refs["dq"].dtype)
