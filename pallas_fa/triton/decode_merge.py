"""The merge of the split-KV decode kernel's partial results
(`triton.decode`): one small Pallas Triton kernel that merges every
split's normalised partial output (`online_softmax.merge_part_groups`),
adds the sinks and writes the output in the query's dtype, in place of
XLA's three fusions. A shared prefix's partials merge in the same pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # The Triton-specific Pallas API (`jax.experimental.pallas.gpu` once).
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the installed jax.
  from jax.experimental.pallas import gpu as plgpu

from pallas_fa import layout
from pallas_fa import online_softmax
from pallas_fa import triton

_F32 = jnp.float32


def masked_load(ref, mask, other):
  """ref[...], the elements outside `mask` (None: none) read as `other`:
  a block may run past its array (rows, splits), and those addresses must
  not be read."""
  if mask is None:
    return ref[...]
  return plgpu.load(ref, mask=mask, other=other)


def masked_store(ref, value, mask):
  """ref[...] = value where `mask` (None: everywhere)."""
  if mask is None:
    ref[...] = value
  else:
    plgpu.store(ref, value, mask=mask)



# The most float32 elements of a merge program's [splits, rows, columns]
# tile of partial outputs, and the fewest columns of a row it reads: many
# packed rows (a shared prefix's folded queries) are cut into blocks of
# rows, so that a program never reads its parts a few bytes at a time.
MAX_ELEMENTS = 1 << 12
MIN_COLUMNS = 16


def _kernel(refs, *, splits: int, real_rows: int, value_head_dim: int,
                  padded_head_dim: int, column_blocks: int,
                  padded_rows: bool, prefix_splits: int = 0):
  s_pad, rows, chunk = refs["parts"].shape
  column = pl.program_id(2) % column_blocks
  first_row = pl.program_id(2) // column_blocks * rows
  row_ok = first_row + jnp.arange(rows, dtype=jnp.int32) < real_rows
  if not padded_rows:
    real_rows = rows  # Every program's rows are real: no row masks.

  def group(prefix: str, s_pad: int, splits: int):
    part_ok = None
    if s_pad != splits or rows != real_rows:
      split_ok = jnp.arange(s_pad, dtype=jnp.int32) < splits
      part_ok = split_ok[:, None] & row_ok[None, :]  # [S, R]
    # Splits and rows past the arrays read as parts that saw no key.
    lse = masked_load(refs[prefix + "part_lse"], part_ok,
                      online_softmax.MASK_VALUE)
    parts = masked_load(refs[prefix + "parts"],
                        None if part_ok is None else part_ok[:, :, None], 0.0)
    return parts, lse

  groups = [group("", s_pad, splits)]
  if "prefix_parts" in refs:
    groups.append(group("prefix_", refs["prefix_parts"].shape[0],
                        prefix_splits))
  # Forward-only math (Triton lowers no custom_vjp).
  out, lse = online_softmax.merge_part_groups(groups, 0)
  if "sinks" in refs:
    sinks = masked_load(refs["sinks"], None if rows == real_rows else row_ok,
                        0.0)
    out, lse = online_softmax.add_sink.fun(out, lse, sinks)
  out_ok = None
  if rows != real_rows or padded_head_dim != value_head_dim:
    col = column * chunk + jnp.arange(chunk, dtype=jnp.int32)
    out_ok = row_ok[:, None] & (col < value_head_dim)[None, :]
  masked_store(refs["out"], out.astype(refs["out"].dtype), out_ok)

  @pl.when(column == 0)
  def _():
    masked_store(refs["lse"], lse, None if rows == real_rows else row_ok)


def merge_splits(out, lse, sinks, *, dtype, value_head_dim: int,
                 prefix=None, real_rows: int | None = None):
  """The splits' partial results merged (`online_softmax.merge_parts`) and
  the sinks added once (`online_softmax.add_sink`) in one small Pallas
  kernel, which writes the output in `dtype` (XLA would take three
  fusions: the weights, the weighted sum, the division and cast).

  Args:
    out: float32 [B, K, splits, R, Hv padded], normalised partial outputs.
    lse: float32 [B, K, splits, R], their logsumexps (-inf: no key).
    sinks: None or float32 [K, R], each packed row's sink logit.
    dtype: the output's dtype.
    value_head_dim: Hv, the output's head dim (<= out's last dim).
    prefix: None, or a shared prefix's partials merged in the same pass,
      (out [1, K, splits_p, R * B, Hv padded], lse [1, K, splits_p, R *
      B]) as the split kernel leaves them for the B rows' single new
      tokens folded into one row (`attention_with_prefix`, T_new = 1:
      folded row g * B + b is row b's packed row g), read in place.
    real_rows: None, or the rows R of out's R' >= R that are merged (a
      split kernel that writes whole tiles of rows, `mosaic_gpu.decode`);
      the others are never read.

  Returns:
    (out [B, K, R, Hv] in `dtype`, lse float32 [B, K, R]).
  """
  b, num_kv, splits, r, hvp = out.shape
  r = real_rows or r
  s_pad = layout.next_power_of_2(splits)
  read = s_pad  # Parts a program reads per row and column.
  if prefix is not None:
    prefix_pad = layout.next_power_of_2(prefix[0].shape[2])
    read += prefix_pad
  padded = layout.next_power_of_2(r)
  min_columns = min(MIN_COLUMNS, hvp & -hvp)
  rows = padded
  while rows > 1 and read * rows * min_columns > MAX_ELEMENTS:
    rows //= 2
  chunk = 1
  while hvp % (2 * chunk) == 0 and read * rows * 2 * chunk <= (
      MAX_ELEMENTS):
    chunk *= 2
  columns = hvp // chunk

  def rows_of(c):
    return c // columns

  inputs = {
      "parts": (out, triton.block_spec(
          (None, None, s_pad, rows, chunk),
          lambda i, k, c: (i, k, 0, rows_of(c), c % columns))),
      "part_lse": (lse, triton.block_spec(
          (None, None, s_pad, rows), lambda i, k, c: (i, k, 0, rows_of(c)))),
  }
  prefix_splits = 0
  if prefix is not None:
    # [1, K, S_p, R * B, ...] viewed as [K, S_p, R, B, ...]: row b's parts
    # are a strided slice, read without a transposed copy.
    prefix_out, prefix_lse = prefix
    prefix_splits = prefix_out.shape[2]
    inputs["prefix_parts"] = (
        prefix_out.reshape(num_kv, prefix_splits, r, b, hvp),
        triton.block_spec((None, prefix_pad, rows, None, chunk),
                          lambda i, k, c: (k, 0, rows_of(c), i,
                                           c % columns)))
    inputs["prefix_part_lse"] = (
        prefix_lse.reshape(num_kv, prefix_splits, r, b),
        triton.block_spec((None, prefix_pad, rows, None),
                          lambda i, k, c: (k, 0, rows_of(c), i)))
  if sinks is not None:
    inputs["sinks"] = (sinks, triton.block_spec(
        (None, rows), lambda i, k, c: (k, rows_of(c))))
  outputs = {
      "out": (jax.ShapeDtypeStruct((b, num_kv, r, value_head_dim), dtype),
              triton.block_spec((None, None, rows, chunk),
                                lambda i, k, c: (i, k, rows_of(c),
                                                 c % columns))),
      "lse": (jax.ShapeDtypeStruct((b, num_kv, r), _F32),
              triton.block_spec((None, None, rows),
                                lambda i, k, c: (i, k, rows_of(c)))),
  }
  kernel = functools.partial(
      _kernel, splits=splits, real_rows=r,
      value_head_dim=value_head_dim, padded_head_dim=hvp,
      column_blocks=columns, padded_rows=padded != r,
      prefix_splits=prefix_splits)
  warps = 4 if read * rows * chunk <= MAX_ELEMENTS // 2 else 8
  return triton.pallas_call(
      kernel, inputs, outputs, (b, num_kv, padded // rows * columns), warps,
      1, "flash_decode_merge")
