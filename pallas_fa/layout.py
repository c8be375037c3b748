"""Tile choice, padded sizes and the padded-inputs prologue of every backend.

Blockwise backends cut T and S into tiles and pad their inputs to whole
tiles; the Pallas ones also pad the head dim to what their matrix units
take. The rules differ only in numbers, which each backend states once as an
`Alignment`:

    backend     tile rows                        head dim
    chunked     balanced, a multiple of 8        as is
    triton      a power of two, at least 16      a power of two, at least 16
    mosaic_gpu  the configured tile, never cut   a multiple of 64
    mosaic_tpu  a multiple of 128                a multiple of 128

`tile` chooses a tile and the padded length (`padded_length` when passes
with different tiles share one padded copy), `padded_head_dim` the head dim,
and `Padded` pads q/k/v (and bias) to them. Padded rows -- the tails
added here and the caller's own padding -- are zeroed, because a masked
logit only makes a probability 0, and 0 * NaN stored in K/V is still NaN;
the tails are marked as padding in the `masking.MaskInfo`
(`masking.pad_sequence`), so they are masked like any other padding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from pallas_fa import masking

Array = Any


def round_up(x: int, multiple: int) -> int:
  """The least multiple of `multiple` that is >= x."""
  return -(-x // multiple) * multiple


def next_power_of_2(x: int) -> int:
  """The least power of two >= x (1 for x <= 1)."""
  return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Alignment:
  """What a backend's kernels need of tile and head-dim sizes.

  Attributes:
    rows: a tile's rows are a multiple of this.
    head_dim: the padded head dim is a multiple of this.
    power_of_two: tiles cut from short sequences, and the head dim, are
      powers of two (Triton's `tl.arange` and `tl.dot` need them).
    balanced: long sequences are cut into equal tiles of at most the
      configured size rather than into tiles of that size, so that the
      padded tail is as short as possible; a sequence that fits one tile is
      not padded at all.
  """

  rows: int = 1
  head_dim: int = 1
  power_of_two: bool = False
  balanced: bool = False


def tile(block: int, length: int, align: Alignment) -> tuple[int, int]:
  """(tile rows, padded length) of a sequence of `length` in `block` tiles.

  A sequence no longer than `block` is one tile: `length` rounded up (to a
  power of two first, with `align.power_of_two`) to `align.rows`, so short
  sequences never pay for a large tile. A longer one is cut into `block`
  tiles, or with `align.balanced` into the fewest equal tiles of at most
  `block` rows, each a multiple of `align.rows`.

  Args:
    block: the configured tile rows.
    length: T or S.
    align: the backend's alignment.

  Returns:
    (tile, padded length), the padded length a multiple of the tile.
  """
  if length <= block:
    if align.balanced:
      return length, length
    rows = next_power_of_2(length) if align.power_of_two else length
    rows = round_up(rows, align.rows)
    return rows, rows
  if align.balanced:
    n = math.ceil(length / block)
    rows = round_up(math.ceil(length / n), align.rows)
    return rows, round_up(length, rows)
  return block, round_up(length, block)


def padded_length(length: int, *tiles: int) -> int:
  """`length` rounded up to whole tiles of every size in `tiles`."""
  return round_up(length, math.lcm(*tiles))


def padded_head_dim(head_dim: int, align: Alignment) -> int:
  """The head dim a backend computes with (zeros change no dot product)."""
  h = next_power_of_2(head_dim) if align.power_of_two else max(head_dim, 1)
  return round_up(h, align.head_dim)


class Padded:
  """q, k, v and bias padded to [Tp, Sp] and the backend's head dim.

  Layouts stay the public BTNH; a backend that wants another one overrides
  `queries` / `keys` (which also serve dout and the other per-query inputs
  of the backward pass).

  Attributes:
    b, t, s, n, h, hv: batch, T, S, query heads, key and value head dims.
    num_kv, g: key/value heads and query heads per key/value head.
    tp, sp: padded T and S.
    hp, hvp: padded key and value head dims.
    info: the MaskInfo padded to [Tp, Sp]: the tails are padding.
    q: `queries(q)`; k, v: `keys(k)`, `keys(v)`.
    bias: [B|1, N|1, Tp|1, Sp|1] or None; broadcast axes stay 1.
  """

  def __init__(self, q, k, v, bias, info: masking.MaskInfo, *, q_len: int,
               kv_len: int, align: Alignment, dtype=None):
    """Pads the inputs of one pass.

    Args:
      q: [B, T, N, H].
      k: [B, S, K, H].
      v: [B, S, K, Hv].
      bias: [B|1, N|1, T|1, S|1] or None.
      info: the call's mask description (unpadded).
      q_len: Tp >= T.
      kv_len: Sp >= S.
      align: the backend's alignment (its head-dim rule).
      dtype: the dtype q/k/v are cast to; None keeps theirs.
    """
    self.b, self.t, self.n, self.h = q.shape
    self.s, self.num_kv = k.shape[1], k.shape[2]
    self.hv = v.shape[-1]
    self.g = self.n // self.num_kv
    self.tp, self.sp = q_len, kv_len
    self.align, self.dtype = align, dtype
    self.hp = padded_head_dim(self.h, align)
    self.hvp = padded_head_dim(self.hv, align)
    # Zeroing reads the caller's padding only: the tails added here are
    # zeros already, so a call without padding of its own is not rewritten.
    self._q_segments = info.q_segment_ids
    self._kv_segments = info.kv_segment_ids
    self.info = masking.pad_sequence(info, q_len, kv_len)
    self.q = self.queries(q)
    self.k = self.keys(k)
    self.v = self.keys(v)
    self.bias = masking.pad_axes(bias, {2: q_len, 3: kv_len}, broadcast=True)

  @property
  def own_segments(self) -> bool:
    """Whether the call has segment ids of its own (`info` has them too
    where it was padded: they mark the padding)."""
    return self._q_segments is not None

  def _pad(self, x, length: int, segments, pad_id: int):
    x = masking.zero_padding(x, segments, pad_id)
    if self.dtype is not None:
      x = x.astype(self.dtype)
    head_dim = padded_head_dim(x.shape[3], self.align)
    return masking.pad_axes(x, {1: length, 3: head_dim})

  def queries(self, x: Array) -> Array:
    """[B, T, N, H] -> [B, Tp, N, Hp], padded rows zeroed."""
    return self._pad(x, self.tp, self._q_segments, masking.Q_PAD_SEGMENT)

  def keys(self, x: Array) -> Array:
    """[B, S, K, H] -> [B, Sp, K, Hp], padded rows zeroed."""
    return self._pad(x, self.sp, self._kv_segments, masking.KV_PAD_SEGMENT)

  def rows(self, x: Array, fill) -> Array:
    """Per-query-row statistics [B, T, N] -> [B, N, Tp] (head-major), the
    tail `fill`."""
    return masking.pad_axes(jnp.swapaxes(x, 1, 2), {2: self.tp}, fill)

  def scale_rows(self, scale, *, queries: bool):
    """A float8 call's scales [B|1, L|1, heads|1] of the queries (or the
    keys) -> float32 [B, heads, Tp (or Sp)]: broadcast, the caller's
    padded rows and the tail zeroed (a NaN or inf scale stored there must
    not turn zero values into NaN)."""
    if queries:
      shape, length = (self.b, self.t, self.n), self.tp
      segments, pad_id = self._q_segments, masking.Q_PAD_SEGMENT
    else:
      shape, length = (self.b, self.s, self.num_kv), self.sp
      segments, pad_id = self._kv_segments, masking.KV_PAD_SEGMENT
    scale = jnp.broadcast_to(scale, shape).astype(jnp.float32)
    scale = masking.zero_padding(scale[..., None], segments, pad_id)[..., 0]
    return masking.pad_axes(scale, {1: length}).transpose(0, 2, 1)

  def per_query_head(self, scale):
    """A scale per (batch row, K/V head), [B|1, 1, K|1] -> [B, 1, N]:
    query head n takes K/V head n // G's."""
    scale = jnp.broadcast_to(scale, (self.b, 1, self.num_kv))
    return jnp.repeat(scale, self.g, axis=2)
