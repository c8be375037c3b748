"""`chunked`: blockwise flash attention in plain jax.numpy.

The portable fallback and the default on CPU. The forward runs the online
softmax over key/value tiles (FlashAttention-2, Algorithm 1) and returns
(out, logsumexp); the backward recomputes the probabilities tile by tile from
the logsumexp, so neither pass ever holds more than one [bq, bk] tile of
logits per head: memory is O(T + S).

Both passes visit only the tiles `masking.classify_blocks` marks non-empty,
with loop bounds taken from that classification (causal, window, padding and
sorted segments all shrink the loops), and skip the masking arithmetic on
FULL tiles. A masked tile whose top-right quarter is empty (the diagonal of
a causal call) is computed as two parts, its top rows against its left keys
and its bottom rows against all of them, so the quarter costs nothing. A
user mask_mod (flex attention) is classified the same way
(`block_mask.tile_kinds`: the call's BlockMask, on whole multiples of its
tiles, or an exact classification made here): tiles it leaves empty are
skipped, and it is evaluated only on the tiles where it is partial. A
score_mod applies to every visited tile; the backward chains dS through its
elementwise derivative and accumulates its arrays' gradients tile by tile
(`online_softmax.ScoreMod.vjp`). GQA is computed in the grouped layout
[B, K, G, T, H], so K/V are never repeated and dK/dV come out summed over
the group by the matmul itself. A K/V shared by every query row (batch 1,
`vjp.Backend.shared_kv`) is read the same way: the tile products broadcast
it over the query's batch and the dK/dV products contract that batch too.
Float8 inputs (`forward(..., scales=...)`) are dequantized to float32 one
tile at a time, the logit scale folded into the query's scales, so the
forward holds no float32 copy of them; their backward gets float32 copies
(`vjp.attention`).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa import dropout
from pallas_fa import layout
from pallas_fa import manual_axes
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import quantize
from pallas_fa import vjp
from pallas_fa.flex import block_mask
from pallas_fa.flex import mods

Array = Any


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ChunkedBlockSizes:
  """Tile sizes of the `chunked` backend (clipped to the sequence lengths).

  The defaults were the fastest measured on a 2-core x86 CPU (float32, N=8,
  H=64, T=S=2048..4096, causal and not): a [256 x 512] forward tile keeps the
  logits of all heads near L2 size while amortising the accumulator rescale;
  the backward, which updates the dQ buffer once per tile, prefers taller
  query tiles.

  Attributes:
    block_q: query rows per tile in the forward pass.
    block_kv: key rows per tile in the forward pass.
    block_q_bwd: query rows per tile in the backward pass.
    block_kv_bwd: key rows per tile in the backward pass.
  """

  block_q: int = 256
  block_kv: int = 512
  block_q_bwd: int = 512
  block_kv_bwd: int = 256

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if (not isinstance(value, (int, np.integer))
          or isinstance(value, (bool, np.bool_)) or value < 1):
        raise ValueError(
            f"ChunkedBlockSizes.{f.name} must be a positive int, got "
            f"{value!r}."
        )
      object.__setattr__(self, f.name, int(value))  # Hashable as an int.


def default_block_sizes(
    *, q_len: int, kv_len: int, head_dim: int, dtype, is_causal: bool = False,
    dropout: bool = False, device_kind: str | None = None,
    value_head_dim: int | None = None,
) -> ChunkedBlockSizes:
  """The tiling of a call made without `block_sizes=`.

  The class defaults, and square [256 x 256] tiles in both passes for a
  causal call: its masked tiles are then the diagonal ones, each visited as
  3/4 of a tile (`_Layout.halves`), so the passes compute 1/2 + bq / 4T of
  the logits instead of the 1/2 + bk / 2T that [256 x 512] tiles do. On a
  2-core x86 CPU (float32, N = 8, H = 64, jax 0.11) that took the causal
  forward from 0.78x to 0.69x of the full one at T = 1024 (0.66x -> 0.61x at
  2048) and forward+backward from 0.76x to 0.62x (see
  `_NARROW_TILES_ARE_CHEAP` for older jax). Tiles are clipped to the sequences
  (see `ChunkedBlockSizes`). The arguments are those every backend's
  `default_block_sizes` takes (`pallas_fa.vjp`).

  Returns:
    A `ChunkedBlockSizes`.
  """
  del q_len, kv_len, head_dim, dtype, dropout, device_kind, value_head_dim
  if is_causal and _NARROW_TILES_ARE_CHEAP:
    return ChunkedBlockSizes(
        block_q=256, block_kv=256, block_q_bwd=256, block_kv_bwd=256)
  return ChunkedBlockSizes()


# XLA:CPU's dots from jax 0.11 on (YNNPACK) run a [256 x 256] tile at ~95 %
# of a [256 x 512] one's rate; jax 0.10's at ~60 % (a full forward at
# T = 2048 took 105 ms against 66), which costs a causal call more than the
# square diagonal saves: there causal calls keep the class defaults (their
# diagonal tiles are still halved).
_NARROW_TILES_ARE_CHEAP = jax.__version_info__ >= (0, 11)


# Tiles are balanced (the padded tail as short as possible) and a multiple
# of 8 rows; the head dims are not padded.
ALIGN = layout.Alignment(rows=8, balanced=True)


class _Layout(layout.Padded):
  """Inputs padded to whole tiles, in the grouped head-major layout."""

  def __init__(self, q, k, v, bias, info, params, block_q, block_kv,
               scales=None):
    mask_tiles = (None, None)
    if info.block_mask is not None:
      mask_tiles = (info.block_mask.block_q, info.block_mask.block_kv)
    self.bq, tp = _tile(block_q, q.shape[1], mask_tiles[0])
    self.bk, sp = _tile(block_kv, k.shape[1], mask_tiles[1])
    # Softmax statistics and accumulators: float32 (float64 inputs: float64).
    self.acc = online_softmax.stats_dtype(q.dtype)
    # The dtype dS enters the backward's products in: the tiles' (float8
    # ones are dequantized to float32), but float32 for float16 inputs,
    # whose range dS = P (dP - delta) leaves with values dP = dO.V that
    # float16 inputs reach (V near 3e4: inf and NaN in dQ and dK).
    # XLA:CPU widens float16 products to float32 anyway.
    self.ds_dtype = (self.acc if q.dtype == jnp.float16 or scales is not None
                     else q.dtype)
    # In full precision the logit scale is folded into q once, saving a
    # multiply per logit; in low precision that would round scale * q.
    # Float8 inputs are dequantized tile by tile (`tile_q`, `tile_kv`) to
    # float32, where the scale folds into q's scales.
    self.scale_folded = q.dtype == self.acc or scales is not None
    self.logit_scale = 1.0 if self.scale_folded else params.scale
    if self.scale_folded and scales is None:
      q = q * params.scale
    super().__init__(q, k, v, bias, info, q_len=tp, kv_len=sp, align=ALIGN)
    self.nq, self.nk = self.tp // self.bq, self.sp // self.bk
    self.scales = None
    if scales is not None:
      # Per-row scales laid out as their rows, [B, K, G, Tp] and
      # [B|1, K, Sp]: padded rows get 0, as their values do (a NaN or inf
      # scale stored there must not turn the zeros into NaN).
      q_scale = scales[0] * params.scale
      self.scales = tuple(
          pad(jnp.broadcast_to(x, y.shape[:-1])[..., None])[..., 0]
          for pad, x, y in ((self.queries, q_scale, q),
                            (self.keys, scales[1], k),
                            (self.keys, scales[2], v)))
    # Tiles span the whole batch here, so a tile is empty (full) only if it
    # is empty (full) for every batch row.
    self.kinds = masking.shared_kinds(
        masking.classify_blocks(self.info, self.bq, self.bk), axis=0)
    # [nq, nk]
    if self.bias is not None:  # -> [B|1, K|1, G|1, Tp|1, Sp|1]
      self.bias = masking.group_heads(self.bias, self.num_kv)
    # Masking arithmetic is needed at all only if something can be masked.
    self.masked = (
        self.info.restricts_positions
        or self.info.has_segments
        or self.info.mask is not None
    )
    self.mod = self.info.mask_mod is not None
    partial_builtin = self.masked and self.kinds == masking.PARTIAL
    partial_mod = False
    if self.mod:
      mod_kinds = masking.shared_kinds(block_mask.tile_kinds(
          info, batch=self.b, heads=self.n, q_len=self.t, kv_len=self.s,
          block_q=self.bq, block_kv=self.bk, num_blocks=(self.nq, self.nk)),
          axis=(0, 1))  # [nq, nk]
      partial_mod = mod_kinds == masking.PARTIAL
      self.kinds = masking.intersect_kinds(self.kinds, mod_kinds)
    # A tile cut by a diagonal (causal, a window's right edge) is visited in
    # two halves when its top-right quarter is empty: the top rows against
    # the left keys, the bottom rows against all keys. That skips a quarter
    # of the tile, so square tiles on the diagonal cost 3/4 instead of 1.
    self.halves = (
        self.masked and self.bq % 2 == 0 and self.bk % 2 == 0
        and (self.info.is_causal or (
            self.info.window is not None and self.info.window[1] is not None))
    )
    halved = False
    if self.halves:
      quarters = masking.shared_kinds(masking.classify_blocks(
          self.info, self.bq // 2, self.bk // 2), axis=0)  # [2 nq, 2 nk]
      halved = partial_builtin & (quarters[0::2, 1::2] == masking.EMPTY)
    # How each visited tile is computed (`Visit`), as a branch of
    # `tile_loop`: only the combinations this call can meet are traced.
    self.branches = [
        Visit(builtin=b, mod=m, halved=h)
        for b in (False, True)[:1 + self.masked]
        for m in (False, True)[:1 + self.mod]
        for h in (False, True)[:1 + (b and self.halves)]]
    branch = jnp.zeros(self.kinds.shape, jnp.int32)
    for n, visit in enumerate(self.branches):
      match = ((partial_builtin == visit.builtin) & (partial_mod == visit.mod)
               & (halved == visit.halved))
      branch = jnp.where(match, n + 1, branch)
    self.branch = jnp.where(self.kinds == masking.EMPTY, 0, branch)
    self.score_uses = None
    if self.info.score_mod is not None:
      self.score_uses = mods.uses_batch_and_head(
          mods.SCORE_MOD, self.info.score_mod, self.info.score_mod_args)
    # The score_mod reads its arrays widened to the accumulators' dtype, so
    # that each tile's share of their gradients is summed in it too
    # (`mods.widen`).
    self.score_args = mods.widen(self.info.score_mod_args, self.acc)

  def tile_q(self, start, size):
    """Query rows [start, start + size) of every head, [B, K, G, size, H],
    dequantized (float32, the logit scale folded in) for float8 inputs."""
    qi = jax.lax.dynamic_slice_in_dim(self.q, start, size, 3)
    if self.scales is None:
      return qi
    scale = jax.lax.dynamic_slice_in_dim(self.scales[0], start, size, 3)
    return quantize.dequantize(qi, scale, self.acc)

  def tile_kv(self, j):
    """Key/value tile j, [B|1, K, bk, H] each, dequantized (float32) for
    float8 inputs."""
    kj, vj = (jax.lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, 2)
              for x in (self.k, self.v))
    if self.scales is None:
      return kj, vj
    return tuple(
        quantize.dequantize(x, jax.lax.dynamic_slice_in_dim(
            scale, j * self.bk, self.bk, 2), self.acc)
        for x, scale in zip((kj, vj), self.scales[1:]))

  def queries(self, x):
    """[B, T, N, H] -> [B, K, G, Tp, H], padded rows zeroed (any H)."""
    x = super().queries(x)
    x = x.reshape(self.b, self.tp, self.num_kv, self.g, x.shape[-1])
    return x.transpose(0, 2, 3, 1, 4)

  def keys(self, x):
    """[B, S, K, H] -> [B, K, Sp, H], padded rows zeroed."""
    return super().keys(x).transpose(0, 2, 1, 3)

  def rows(self, x, fill):
    """[B, T, N] -> [B, K, G, Tp] (per-row statistics)."""
    return super().rows(x, fill).reshape(self.b, self.num_kv, self.g, self.tp)

  def unrows(self, x):
    """[B, K, G, Tp] -> [B, T, N]."""
    return x.transpose(0, 3, 1, 2).reshape(self.b, self.tp, self.n)[:, : self.t]

  def unqueries(self, x):
    """[B, K, G, Tp, H] -> [B, T, N, H] (any H)."""
    x = x.transpose(0, 3, 1, 2, 4).reshape(
        self.b, self.tp, self.n, x.shape[-1])
    return x[:, : self.t]

  def unkeys(self, x):
    """[B, K, Sp, H] -> [B, S, K, H]."""
    return x.transpose(0, 2, 1, 3)[:, : self.s]

  def parts(self, i, j, visit):
    """The `Part`s tile (i, j) is computed in (see `halves`)."""
    q0, k0 = i * self.bq, j * self.bk
    if not visit.halved:
      return (Part(q0, 0, self.bq, k0, 0, self.bk),)
    h, w = self.bq // 2, self.bk // 2
    return (Part(q0, 0, h, k0, 0, w),
            Part(q0 + h, h, self.bq - h, k0, 0, self.bk))

  def logits(self, qi, kj, part, params, with_score_mod=True):
    """(s_capped, s) of `part`, unmasked (`online_softmax.logits`); without
    the score_mod when `with_score_mod` is False."""
    s = _unfold(_with_keys(
        "bkqh,bksh->bkqs", _fold(qi), kj, self.acc, params.precision),
        self.g)
    bias = None
    if self.bias is not None:
      bias = masking.slice_in_dim(self.bias, part.q0, part.rows, 3)
      bias = masking.slice_in_dim(bias, part.k0, part.cols, 4)
    score_mod = self.score_mod(part) if with_score_mod else None
    s, s_capped = online_softmax.logits(
        s, scale=self.logit_scale, cap=params.soft_cap, bias=bias,
        score_mod=score_mod)
    return s_capped, s

  def score_mod(self, part):
    """The call's score_mod bound to `part`, or None."""
    if self.info.score_mod is None:
      return None
    indices = masking.tile_indices(
        self.b, self.n, self.num_kv, part.q0, part.rows, part.k0, part.cols)
    return online_softmax.ScoreMod(
        fn=self.info.score_mod, args=self.score_args,
        batch=indices[0], head=indices[1], q_idx=indices[2],
        kv_idx=indices[3], uses=self.score_uses)

  def dropout_factor(self, part):
    """[B, K, G, rows, cols] factor of attention dropout for `part`: 0 or
    1 / (1 - rate); None without dropout. Masks depend on global indices
    only (`pallas_fa.dropout`), never on the tiling."""
    if not self.info.has_dropout:
      return None
    return dropout.grouped_factor(
        self.info.dropout_seed, self.info.dropout_rate,
        (self.b, self.num_kv, self.g, part.rows, part.cols), self.acc,
        q_start=part.q0, kv_start=part.k0)

  def visibility(self, part, visit):
    """The visibility of `part` under the masks `visit` names
    (`masking.tile_visibility`)."""
    return masking.tile_visibility(
        self.info, self.num_kv, part.q0, part.rows, part.k0, part.cols,
        num_heads=self.n, builtin=visit.builtin, mod=visit.mod)

  def tile_loop(self, branch_row, lo, hi, step, carry, deposit=None):
    """Runs step(j, carry, visit) over the non-empty tiles [lo, hi) of a row
    of `self.branch`, with the `Visit` each tile needs.

    With `deposit` = (buffers, add), `step` returns (carry, tile) and
    `add(buffers, j, tile)` adds each tile into `buffers` after the tile's
    branch (see `_BRANCHES_UPDATE_IN_PLACE`); the loop then returns
    (carry, buffers).
    """
    # The loop's trip count is static (the row's length) and the tiles past
    # `hi` take the empty branch: reverse mode (grad of grad) transposes a
    # loop only when its bounds are static.
    n = branch_row.shape[0]
    # Accumulators start as fresh zeros; inside a shard_map they must vary
    # as the tiles added to them do.
    carry = manual_axes.vary_like(carry, self.q)
    if deposit is not None:
      buffers, add = deposit
      carry = (carry, manual_axes.vary_like(buffers, self.q))

    def body(t, state):
      j = jnp.minimum(lo + t, n - 1)
      # Branch 0 also takes the EMPTY tiles inside the range (unsorted
      # segments, a mask_mod leave holes in it).
      visited = jnp.where(lo + t < hi, branch_row[j], 0)
      visits = [lambda c, visit=visit: step(j, c, visit)
                for visit in self.branches]
      if deposit is None:
        return jax.lax.switch(visited, [lambda c: c] + visits, state)
      c, buffers = state
      zeros = manual_axes.vary_like(
          jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                       jax.eval_shape(visits[0], c)[1]), self.q)
      c, tile = jax.lax.switch(visited, [lambda c: (c, zeros)] + visits, c)
      return c, add(buffers, j, tile)

    return jax.lax.fori_loop(0, n, body, carry)


# Whether XLA:CPU updates a loop's carry in place inside a branch. jax
# 0.10's copies a carried array that a branch updates or passes through, on
# each trip; there the backward adds into its dQ and dbias accumulators
# after the branch, from the tiles it returns (`tile_loop`'s `deposit`),
# and jax 0.11 inside it. On a 2-core x86 (float32, B = 1, N = 8, H = 64, a
# [1, 8, T, S] bias and 4 segments, causal, T = 2048, forward+backward) jax
# 0.10 took 770 ms with the adds in the branch and 185 ms after it; jax
# 0.11 130 and 169 ms.
_BRANCHES_UPDATE_IN_PLACE = jax.__version_info__ >= (0, 11)


class Visit(NamedTuple):
  """How a visited tile is computed.

  Attributes:
    builtin: apply the masks of the public arguments (causal, window,
      segments and padding, dense mask); False on tiles they leave FULL.
    mod: evaluate the mask_mod; False where the block mask says FULL.
    halved: compute the tile as two `Part`s, skipping its empty top-right
      quarter.
  """

  builtin: bool
  mod: bool
  halved: bool


class Part(NamedTuple):
  """A rectangle of a tile: rows [q0, q0 + rows) and keys [k0, k0 + cols)
  of the sequences (q0, k0 may be traced), at static offsets (r0, c0)
  within the tile."""

  q0: Any
  r0: int
  rows: int
  k0: Any
  c0: int
  cols: int


def _tile(block: int, length: int, mask_block: int | None):
  """(tile, padded length): balanced tiles, or with a block mask the
  largest whole multiple of its tile that is at most `block` (at least the
  mask's tile), so that retiling it is exact."""
  if mask_block is None:
    return layout.tile(block, length, ALIGN)
  tile = min(mask_block * max(1, block // mask_block),
             layout.round_up(length, mask_block))
  return tile, layout.round_up(length, tile)


def _rows(x, part):
  """The rows of `part` of a per-tile query array [B, K, G, bq, ...]."""
  if part.rows == x.shape[3]:
    return x
  return jax.lax.slice_in_dim(x, part.r0, part.r0 + part.rows, axis=3)


def _cols(x, part, axis=2):
  """The keys of `part` of a key tile: [B, K, bk, H], or the keys on
  `axis`."""
  if part.cols == x.shape[axis]:
    return x
  return jax.lax.slice_in_dim(x, part.c0, part.c0 + part.cols, axis=axis)


def _add_at(acc, x, starts):
  """acc with x added at `starts` (ints, or traced int32 scalars)."""
  if x.shape == acc.shape:
    return acc + x
  # One dtype for all the starts, as lax's slicing wants.
  starts = [jnp.asarray(s, jnp.int32) for s in starts]
  cur = jax.lax.dynamic_slice(acc, starts, x.shape)
  return jax.lax.dynamic_update_slice(acc, cur + x, starts)


def _keys_last(x):
  """[B, K, bk, H] <-> [B, K, H, bk]."""
  return x.swapaxes(2, 3)


def _fold(x):
  """[B, K, G, rows, X] -> [B, K, G*rows, X]: a GQA group's heads become rows.

  Every tile product is then one plain batched matmul over (B, K), which the
  CPU dot emitter runs without transposing the tile.
  """
  return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])


def _unfold(x, g):
  """Inverse of `_fold`."""
  return x.reshape(x.shape[0], x.shape[1], g, -1, x.shape[-1])


def _with_keys(spec, x, y, acc, precision):
  """`einsum(spec, x, y)`, spec "bkq.,bk..->bkq.", of a query-side tile x
  [B, K, rows, .] and a key/value tile y [B|1, K, ., .].

  A y shared by every batch row (batch 1) takes the batch as more rows of
  x: K is the product's only batch dim, and its [K, B, rows, .] result
  becomes [B, K, rows, .] by moving whole [rows, .] blocks. (einsum's own
  broadcast of y puts y's free axis first and transposes it back element
  by element: 2-3x slower on XLA:CPU.)
  """
  if y.shape[0] == x.shape[0]:
    return jnp.einsum(spec, x, y, preferred_element_type=acc,
                      precision=precision)
  operands, out = spec.split("->")
  x_spec, y_spec = operands.split(",")
  product = jnp.einsum(
      f"{x_spec},{y_spec[1:]}->{out[1]}{out[0]}{out[2:]}", x, y[0],
      preferred_element_type=acc, precision=precision)
  return jnp.moveaxis(product, 0, 1)


def _forward(q, k, v, bias, info, params, scales=None):
  bs = BACKEND.block_sizes(params, q, k, info)
  lay = _Layout(q, k, v, bias, info, params, bs.block_q, bs.block_kv,
                scales)
  lo, hi = masking.block_range(lay.kinds)
  out_dtype = params.out_dtype or q.dtype

  def q_tile(i):
    qi = lay.tile_q(i * lay.bq, lay.bq)
    rows = (lay.b, lay.num_kv, lay.g, lay.bq)
    carry = online_softmax.init(rows, rows + (lay.hv,), lay.acc)

    def step(j, carry, visit):
      kj, vj = lay.tile_kv(j)
      parts = lay.parts(i, j, visit)
      if len(parts) == 1:
        return update(qi, kj, vj, carry, parts[0], visit)
      # Each part updates the statistics of its own rows.
      outs = [update(_rows(qi, part), _cols(kj, part), _cols(vj, part),
                     tuple(_rows(x, part) for x in carry), part, visit)
              for part in parts]
      return tuple(jnp.concatenate(x, axis=3) for x in zip(*outs))

    def update(qi, kj, vj, carry, part, visit):
      m_i, l_i, acc = carry
      _, s = lay.logits(qi, kj, part, params)  # [B, K, G, rows, cols]
      if visit.builtin or visit.mod:
        s = online_softmax.apply_mask(s, lay.visibility(part, visit))
      m_i, l_i, p, alpha = online_softmax.update(m_i, l_i, s)
      # Dropout acts on the normalised probabilities: the denominator l_i
      # sums the undropped ones.
      z = lay.dropout_factor(part)
      if z is not None:
        p = p * z
      pv = _unfold(_with_keys(
          "bkqs,bksh->bkqh", _fold(p.astype(vj.dtype)), vj, lay.acc,
          params.precision), lay.g)
      return m_i, l_i, online_softmax.rescale(acc, alpha) + pv

    m_i, l_i, acc = lay.tile_loop(lay.branch[i], lo[i], hi[i], step, carry)
    out, lse = online_softmax.finalize(m_i, l_i, acc)
    return out.astype(out_dtype), lse

  # Tile indices are int32, as `masking.block_range`'s bounds: under
  # jax_enable_x64 a default arange is int64, and lax's slicing takes
  # start indices of one dtype.
  out, lse = jax.lax.map(q_tile, jnp.arange(lay.nq, dtype=jnp.int32))
  # [nq, B, K, G, bq, (H)] -> [B, K, G, Tp, (H)]
  out = jnp.moveaxis(out, 0, 3).reshape(
      lay.b, lay.num_kv, lay.g, lay.tp, lay.hv)
  lse = jnp.moveaxis(lse, 0, 3).reshape(lay.b, lay.num_kv, lay.g, lay.tp)
  return lay.unqueries(out), lay.unrows(lse)


def _backward(q, k, v, bias, info, params, lse, dout, delta):
  bs = BACKEND.block_sizes(params, q, k, info)
  lay = _Layout(
      q, k, v, bias, info, params, bs.block_q_bwd, bs.block_kv_bwd)
  do = lay.queries(dout.astype(q.dtype))
  lse = lay.rows(lse, online_softmax.MASK_VALUE)
  delta = lay.rows(delta, 0.0)
  kinds_t = lay.kinds.T  # [nk, nq]: per key tile, which query tiles to visit.
  branch_t = lay.branch.T
  lo, hi = masking.block_range(kinds_t)
  args = lay.info.score_mod_args
  # Gradients of score_mod's floating-point arrays, summed over the tiles
  # in the dtype the score_mod reads them in.
  dargs = tuple(
      jnp.zeros(x.shape, online_softmax.stats_dtype(x.dtype))
      if jnp.issubdtype(x.dtype, jnp.inexact) else None
      for x in lay.score_args)
  dbias = None
  if lay.bias is not None:
    dbias = jnp.zeros(lay.bias.shape, lay.acc)
  bias_sum_axes = tuple(
      a for a in range(5)
      if lay.bias is not None and lay.bias.shape[a] == 1
  )
  # A tile's shares: dQ [B, K, G, bq, H], dbias [B|1, K|1, G|1, bq|1, bk|1].
  dq_tile = lay.q.shape[:3] + (lay.bq, lay.q.shape[4])
  bias_tile = None if dbias is None else tuple(
      d if a < 3 or d == 1 else (lay.bq, lay.bk)[a - 3]
      for a, d in enumerate(dbias.shape))

  def key_grad(x, y, rows):
    """x^T.y over a tile's query rows, [B, K, H, bk]; for a K/V shared by
    every query row (`rows` = 1 against B) [1, K, H, bk], summed over the
    batch by the same product. (Per-row key padding has zeroed a shared K/V
    into B rows already, `layout.Padded`: those are summed after the
    loop.)"""
    shared = rows != lay.b
    g = jnp.einsum(
        "bkqs,bkqh->khs" if shared else "bkqs,bkqh->bkhs", _fold(x),
        _fold(y), preferred_element_type=lay.acc, precision=params.precision)
    return g[None] if shared else g

  def kv_tile(carry, j):
    dq, dbias, dargs = carry
    kj, vj = lay.tile_kv(j)
    # dK and dV of this key tile are accumulated transposed, [B, K, H, bk]:
    # XLA:CPU runs P^T.dO and dS^T.Q, contracted over the tile's query rows,
    # in ~0.7x the time with the head dim as the product's rows rather than
    # its columns, which makes the whole backward 5-15 % faster (2-core x86,
    # float32, jax 0.10 and 0.11). They are turned back once per key tile.
    dk_j = jnp.zeros(_keys_last(kj).shape, lay.acc)
    dv_j = jnp.zeros(_keys_last(vj).shape, lay.acc)

    def step(i, carry, visit):
      # dQ and dbias are added into the whole arrays (carried) in place, or
      # into zeroed tiles that `tile_loop` adds after the tile's branch.
      if _BRANCHES_UPDATE_IN_PLACE:
        small, buffers = carry
      else:
        small, buffers = carry, (
            jnp.zeros(dq_tile, lay.acc),
            None if dbias is None else jnp.zeros(bias_tile, lay.acc))
      for part in lay.parts(i, j, visit):
        small, buffers = update(kj, vj, small, buffers, part, visit)
      return small, buffers

    def accumulate(buffers, part, grads, in_tile):
      """buffers (dQ, dbias) with `part`'s grads added: at its place in the
      sequences, or `in_tile` at its place in its tile."""
      q0, k0 = (part.r0, part.c0) if in_tile else (part.q0, part.k0)
      (dq, dbias), (dq_i, dbias_i) = buffers, grads
      dq = _add_at(dq, dq_i, (0, 0, 0, q0, 0))
      if dbias is not None:
        dbias = _add_at(dbias, dbias_i, (
            0, 0, 0, q0 if dbias.shape[3] > 1 else 0,
            k0 if dbias.shape[4] > 1 else 0))
      return dq, dbias

    def add_tile(buffers, i, tile):
      whole = Part(i * lay.bq, 0, lay.bq, j * lay.bk, 0, lay.bk)
      return accumulate(buffers, whole, tile, in_tile=False)

    def update(kj, vj, carry, buffers, part, visit):
      dk_all, dv_all, dargs = carry
      kj, vj = _cols(kj, part), _cols(vj, part)
      qi = lay.tile_q(part.q0, part.rows)
      doi = jax.lax.dynamic_slice_in_dim(do, part.q0, part.rows, 3)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, part.q0, part.rows, 3)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, part.q0, part.rows, 3)
      s_capped, s = lay.logits(qi, kj, part, params, with_score_mod=False)
      score_mod = lay.score_mod(part)
      if score_mod is not None:
        s, score_mod_pullback = score_mod.vjp(s)
      if visit.builtin or visit.mod:
        s = online_softmax.apply_mask(s, lay.visibility(part, visit))
      p = online_softmax.probs_from_lse(  # [B, K, G, rows, cols]
          s, lse_i, tile_exp=online_softmax.exp_at_most_one)
      # With dropout (FlashAttention-2 §B): dV takes the dropped
      # probabilities, dP the same mask, and dS = P * (dP - delta) with delta
      # from the dropped output.
      z = lay.dropout_factor(part)
      p_used = p if z is None else p * z
      dv_j = key_grad(p_used.astype(doi.dtype), doi, vj.shape[0])
      dp = _unfold(_with_keys(
          "bkqh,bksh->bkqs", _fold(doi), vj, lay.acc, params.precision),
          lay.g)
      if z is not None:
        dp = dp * z
      ds = online_softmax.softmax_grad(p, dp, delta_i)
      if score_mod is not None:
        # dS w.r.t. the logits before score_mod, which is also the bias
        # gradient; and this tile's share of the arrays' gradients.
        ds, d = score_mod_pullback(ds)
        dargs = tuple(None if a is None else a + b for a, b in zip(dargs, d))
      dbias_i = None
      if dbias is not None:
        dbias_i = ds.sum(axis=bias_sum_axes, keepdims=True)
      # The logit scale is applied to the [bq, H] / [bk, H] products rather
      # than to the [bq, bk] tile: d(scale q.k)/dq = scale * k.
      ds = online_softmax.logits_grad(ds, s_capped, cap=params.soft_cap)
      ds = ds.astype(lay.ds_dtype)
      dq_i = params.scale * _unfold(_with_keys(
          "bkqs,bksh->bkqh", _fold(ds), kj, lay.acc, params.precision), lay.g)
      dk_j = key_grad(ds, qi, kj.shape[0])
      # dK and dV of the part's keys, [B, K, H, cols] (keys last).
      key_cols = (0, 0, 0, part.c0)
      small = (_add_at(dk_all, dk_j, key_cols),
               _add_at(dv_all, dv_j, key_cols), dargs)
      return small, accumulate(buffers, part, (dq_i, dbias_i),
                               in_tile=not _BRANCHES_UPDATE_IN_PLACE)

    if _BRANCHES_UPDATE_IN_PLACE:
      (dk_j, dv_j, dargs), (dq, dbias) = lay.tile_loop(
          branch_t[j], lo[j], hi[j], step, ((dk_j, dv_j, dargs), (dq, dbias)))
    else:
      (dk_j, dv_j, dargs), (dq, dbias) = lay.tile_loop(
          branch_t[j], lo[j], hi[j], step, (dk_j, dv_j, dargs),
          deposit=((dq, dbias), add_tile))
    if not lay.scale_folded:  # q already carries the scale when folded.
      dk_j = dk_j * params.scale
    return (dq, dbias, dargs), (_keys_last(dk_j), _keys_last(dv_j))

  dq0 = jnp.zeros(lay.q.shape, lay.acc)
  (dq, dbias, dargs), (dk, dv) = jax.lax.scan(
      kv_tile, manual_axes.vary_like((dq0, dbias, dargs), lay.q),
      jnp.arange(lay.nk, dtype=jnp.int32))
  # [nk, B|1, K, bk, H] -> [B|1, K, Sp, H]
  dk = jnp.moveaxis(dk, 0, 2).reshape(
      lay.k.shape[0], lay.num_kv, lay.sp, lay.h)
  dv = jnp.moveaxis(dv, 0, 2).reshape(
      lay.v.shape[0], lay.num_kv, lay.sp, lay.hv)
  dq = lay.unqueries(dq).astype(q.dtype)
  dk, dv = (
      # Summed in float32 over the rows a shared K/V was padded into.
      d if d.shape[0] == x.shape[0] else d.sum(0, keepdims=True)
      for d, x in ((dk, k), (dv, v)))
  dk = lay.unkeys(dk).astype(k.dtype)
  dv = lay.unkeys(dv).astype(v.dtype)
  # Padded keys were zeroed on the way in; their gradients are zero too.
  if dbias is not None:
    db, dkh, dg, dt, dsl = dbias.shape
    dbias = dbias.reshape(db, dkh * dg, dt, dsl)
    dbias = dbias[:, :, : bias.shape[2], : bias.shape[3]].astype(bias.dtype)
  if info.score_mod is not None:
    dargs = tuple(None if d is None else d.astype(x.dtype)
                  for d, x in zip(dargs, args))
    return dq, dk, dv, dbias, dargs
  return dq, dk, dv, dbias


def _check(q, k, v, bias, info, params):
  del q, k, v, bias, info, params  # Every feature is supported.


BACKEND = vjp.Backend(
    name="chunked",
    forward=_forward,
    backward=_backward,
    check=_check,
    block_sizes_type=ChunkedBlockSizes,
    default_block_sizes=default_block_sizes,
    dtypes=vjp.WITH_FLOAT8,
    value_head_dim=True,
    dropout=True,
    shared_kv=True,
    differentiable=True,
    symbolic_batch=True,
)
