"""Key/value cache storage for decoding: contiguous rows or a paged pool.

A contiguous cache is `[B, max_length, K, H]`, row b holding sequence b. A
paged cache is a pool of pages `[num_pages, page_size, K, H]` plus a block
table `[B, max_pages]`: page `block_table[b, i]` holds cache indices
`[i * page_size, (i + 1) * page_size)` of sequence b (the layout
`pallas_fa.decode_attention` reads). New tokens are scattered into their
pages; nothing here copies the whole pool.

The allocation is static: every row owns `max_pages` pages for the life of
the cache, and no page is shared (a write would clobber the other owner).

A quantized cache stores int8 or float8 values and a float32 scale per
(entry, K/V head), `[B, max_length, K]` (or `[num_pages, page_size, K]`):
the cache attention sees is `values.astype(float32) * scale[..., None]`.
`quantize` makes the pair (symmetric absmax over the head dim), `write`
quantizes new float entries into such a cache and stores their scales.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa import checks
from pallas_fa import quantize as quantize_lib
from pallas_fa.checks import check_int
from pallas_fa.checks import check_positive_int

Array = Any


# The narrow cache dtypes and their quantization live in `pallas_fa.quantize`
# (one convention for caches and float8 query/key/value); the names stay
# reachable here.
QUANTIZED_DTYPES = quantize_lib.QUANTIZED_DTYPES
is_quantized = quantize_lib.is_quantized


def quantize(x: Array, dtype=jnp.int8) -> tuple[Array, Array]:
  """Symmetric absmax quantization over the last axis (the head dim): one
  scale per cache entry and K/V head, shaped `x.shape[:-1]`. This is
  `pallas_fa.quantize.quantize` with its default axes (same dtypes,
  results and errors).
  """
  return quantize_lib.quantize(x, dtype)


def num_pages_per_row(max_length: int, page_size: int) -> int:
  """Pages a row needs to hold `max_length` cache entries.

  Raises:
    TypeError / ValueError: max_length is not an int >= 0, or page_size
      not a positive int (the message names it).
  """
  max_length = check_int("max_length", max_length, 0)
  page_size = check_positive_int("page_size", page_size)
  return -(-max_length // page_size)


def default_block_table(batch_size: int, max_pages: int) -> Array:
  """Row b owns pages `b, b + B, b + 2B, ...`: int32 [B, max_pages].

  The pages of a row are strided through the pool, as an allocator that
  hands out pages while all rows grow in lockstep would place them; no row
  sees the identity mapping unless B = 1.

  Raises:
    TypeError / ValueError: batch_size or max_pages is not a positive int
      (the message names it).
  """
  batch_size = check_positive_int("batch_size", batch_size)
  max_pages = check_positive_int("max_pages", max_pages)
  slots = np.arange(max_pages, dtype=np.int32)[None, :]
  rows = np.arange(batch_size, dtype=np.int32)[:, None]
  return jnp.asarray(slots * batch_size + rows)


def check_page_indices(block_table: Array, num_pages: int) -> None:
  """Rejects block-table entries outside [0, num_pages) when the table is
  concrete (a traced one cannot be read at trace time).

  Raises:
    TypeError: block_table is not an integer array, or num_pages not an
      int.
    ValueError: an entry out of range (the message names block_table and
      num_pages).
  """
  num_pages = check_int("num_pages", num_pages, 0)
  if isinstance(block_table, jax.core.Tracer):
    return
  block_table = checks.as_array("block_table", block_table)
  if not jnp.issubdtype(block_table.dtype, jnp.integer):
    raise TypeError(f"block_table must be an integer array, got "
                    f"{block_table.dtype=}.")
  pages = np.asarray(block_table)
  bad = np.argwhere((pages < 0) | (pages >= num_pages))
  if len(bad):
    first = tuple(int(i) for i in bad[0])
    raise ValueError(
        f"block_table entries must be pages in [0, {num_pages=}), got "
        f"block_table[{', '.join(map(str, first))}]={pages[first]} "
        f"({len(bad)} of {pages.size} entries out of range).")


def check_paged_config(
    batch_size: int,
    max_length: int,
    *,
    page_size: Any,
    num_pages: Any = None,
    block_table: Any = None,
) -> tuple[int, int, Array]:
  """Validates a paged cache's configuration.

  Args:
    batch_size: B.
    max_length: entries each row must hold.
    page_size: entries per page.
    num_pages: pages in the pool; default B * ceil(max_length / page_size).
    block_table: int [B, ceil(max_length / page_size)] of distinct pages in
      [0, num_pages); default `default_block_table`.

  Returns:
    (page_size, num_pages, block_table as int32).

  Raises:
    ValueError: a bad page size, pool size or block table (the message
      names the argument).
    TypeError: a size that is not an int.
  """
  if page_size is None:
    for name, x in (("num_pages", num_pages), ("block_table", block_table)):
      if x is not None:
        raise ValueError(
            f"{name} describes a paged cache and needs page_size, got "
            f"page_size=None.")
  batch_size = check_positive_int("batch_size", batch_size)
  max_length = check_positive_int("max_length", max_length)
  page_size = check_positive_int("page_size", page_size)
  max_pages = num_pages_per_row(max_length, page_size)
  needed = batch_size * max_pages
  if num_pages is None:
    num_pages = needed
  num_pages = check_positive_int("num_pages", num_pages)
  if block_table is None:
    if num_pages < needed:
      raise ValueError(
          f"num_pages must be at least batch_size * ceil(max_length / "
          f"page_size) = {needed} for the default block table, got "
          f"{num_pages=}.")
    return page_size, num_pages, default_block_table(batch_size, max_pages)
  block_table = jnp.asarray(block_table)
  if (not jnp.issubdtype(block_table.dtype, jnp.integer)
      or block_table.shape != (batch_size, max_pages)):
    raise ValueError(
        f"block_table must be an int [batch_size, ceil(max_length / "
        f"page_size)]={(batch_size, max_pages)} array, got "
        f"{block_table.shape=}, {block_table.dtype=}.")
  check_page_indices(block_table, num_pages)
  check_distinct_pages(block_table)
  return page_size, num_pages, block_table.astype(jnp.int32)


def check_distinct_pages(block_table: Array) -> None:
  """Rejects a concrete block table that names a page twice: two slots
  written into one page would hold only the last write (a traced table
  cannot be read at trace time, and is not checked).

  Raises:
    ValueError: a page named twice (the message names block_table).
  """
  if isinstance(block_table, jax.core.Tracer):
    return
  pages = np.asarray(block_table)
  if len(np.unique(pages)) != pages.size:
    raise ValueError(
        "block_table must name every page at most once (a page written "
        f"by two slots would hold only the last write), got {pages}.")


def write(
    cache: Array, new: Array, index: Array, block_table: Array | None = None,
    *, scale: Array | None = None
) -> Array | tuple[Array, Array]:
  """Stores `new` at each row's cache indices `index[b] + arange(T)`.

  Args:
    cache: [B, max_length, K, H], or pages [num_pages, page_size, K, H]
      with `block_table` (a scale array [B, max_length, K] / [num_pages,
      page_size, K] with `new` [B, T, K] takes the same calls).
    new: [B, T, K, H] keys or values (cast to the cache's dtype; into a
      quantized cache, float entries are quantized first, `quantize`).
    index: int [B], where row b's first new entry goes.
    block_table: int [B, max_pages] for a paged cache, else None: distinct
      pages in [0, num_pages), as `check_paged_config` requires (a page
      named twice would hold only one row's entries).
    scale: a quantized cache's float32 scales [B, max_length, K] (or
      [num_pages, page_size, K]); required when float entries go into an
      int8/float8 cache. Entries already quantized (new of the cache's
      dtype) are stored as they are: write their scales with a second
      `write` into the scale array.

  Returns:
    The updated cache, or (cache, scale) with `scale`. Entry i of row b
    lands at row b's index i (paged: in page `block_table[b, i //
    page_size]` at offset `i % page_size`), one scatter of the new entries;
    entries past a row's capacity (max_length, or its pages) are dropped,
    never written over another entry.

  Raises:
    ValueError: shapes that do not match (the message names the argument),
      a negative index, or an out-of-range or repeated page known at trace
      time (a traced index or table cannot be checked: what falls outside
      is dropped), float entries into a quantized cache without `scale`,
      or `scale` otherwise.
    TypeError: a cache that is neither float nor int8/float8, a `new` that
      is neither float nor of the cache's dtype (a complex, integer or bool
      one would be cast, losing its values), or a `scale` that is not
      float.
  """
  cache, new = (jnp.asarray(x) for x in (cache, new))
  index = checks.as_index_array("index", index)
  if block_table is not None:
    block_table = checks.as_index_array("block_table", block_table)
  _check_write(cache, new, index, block_table, scale)
  quantizing = is_quantized(cache.dtype) and new.dtype != cache.dtype
  if quantizing != (scale is not None):
    raise ValueError(
        f"scale= must be given exactly when float entries go into a "
        f"quantized (int8/float8) cache, got new {new.dtype} into a "
        f"{cache.dtype} cache with scale="
        f"{'None' if scale is None else 'an array'}.")
  if scale is None:
    return _store(cache, new, index, block_table)
  values, new_scale = quantize(new, cache.dtype)
  return (_store(cache, values, index, block_table),
          _store(jnp.asarray(scale), new_scale, index, block_table))


def _store(cache, new, index, block_table):
  """`write`'s scatter of checked arguments (values, or their scales)."""
  new = new.astype(cache.dtype)
  entry = index[:, None] + jnp.arange(new.shape[1], dtype=index.dtype)[None]
  if block_table is None:
    # An index past the row (or below it) makes the scatter skip the entry;
    # a dynamic_update_slice would clamp the whole write onto valid ones.
    rows = jnp.arange(cache.shape[0])[:, None]
    entry = jnp.where(entry >= 0, entry, cache.shape[1])
    return cache.at[rows, entry].set(new, mode="drop")
  num_pages, page_size = cache.shape[:2]
  max_pages = block_table.shape[1]
  slot = entry // page_size  # [B, T]
  page = jnp.take_along_axis(
      block_table, jnp.clip(slot, 0, max_pages - 1), axis=1)
  # An out-of-range page index makes the scatter skip the entry instead of
  # clamping it onto some row's last page.
  page = jnp.where((slot >= 0) & (slot < max_pages), page, num_pages)
  return cache.at[page, entry % page_size].set(new, mode="drop")


def _check_block_table(block_table, num_pages: int) -> Array:
  """A paged cache's block table as an array: int [B, max_pages], its
  known entries pages in [0, num_pages) (`check_page_indices`; a traced
  one is not checked, and its entries out of range are dropped by `write`
  and clamped by `gather`).

  Raises:
    ValueError: another rank or dtype, or a known entry out of range (the
      message names block_table).
  """
  block_table = jnp.asarray(block_table)
  if block_table.ndim != 2 or not jnp.issubdtype(block_table.dtype,
                                                 jnp.integer):
    raise ValueError(
        f"block_table must be an int [B, max_pages] array, got "
        f"{block_table.shape=}, {block_table.dtype=}.")
  check_page_indices(block_table, num_pages)
  return block_table


def _check_write(cache, new, index, block_table, scale) -> None:
  """`write`'s argument checks (shapes and dtypes, and values known at
  trace time; the block table's rank, dtype and range are
  `_check_block_table`'s)."""
  what = ("[B, max_length, K, H]" if block_table is None
          else "[num_pages, page_size, K, H] with block_table [B, ...]")
  if cache.ndim < 3:
    raise ValueError(f"cache must be {what}, got {cache.shape=}.")
  rows = cache.shape[0]
  if block_table is not None:
    _check_block_table(block_table, cache.shape[0])
    rows = block_table.shape[0]
  if new.ndim != cache.ndim or (
      new.shape[0] != rows or new.shape[2:] != cache.shape[2:]):
    raise ValueError(
        f"new must be [B, T, K, H] with the cache's K and H and B rows "
        f"(cache {what}), got {new.shape=}, {cache.shape=}"
        + ("" if block_table is None else f", {block_table.shape=}") + ".")
  if index.shape != (rows,) or not jnp.issubdtype(index.dtype, jnp.integer):
    raise ValueError(
        f"index must be an int [B={rows}] array, got {index.shape=}, "
        f"{index.dtype=}.")
  if scale is not None and jnp.shape(scale) != cache.shape[:-1]:
    raise ValueError(
        f"scale must be the cache's [..., K] scales, shaped "
        f"{cache.shape[:-1]}, got {jnp.shape(scale)}.")
  scale_dtype = None if scale is None else jnp.result_type(scale)
  if scale is not None and not (jnp.issubdtype(scale_dtype, jnp.floating)
                                and jnp.finfo(scale_dtype).bits >= 32):
    # A 16-bit one would round every new scale (bfloat16: by up to 0.4 %).
    raise TypeError(
        f"scale must be a float32 array (the cache's scales), got "
        f"scale.dtype={scale_dtype}.")
  # The store casts `new` to the cache's dtype: only between float dtypes
  # (or into a quantized cache, through `quantize`) does that keep the
  # values; a complex, integer or bool `new` would lose them silently.
  if not (jnp.issubdtype(cache.dtype, jnp.floating)
          or is_quantized(cache.dtype)):
    raise TypeError(
        f"cache must be a float array, or an int8/float8 quantized cache, "
        f"got cache.dtype={cache.dtype}.")
  if new.dtype != cache.dtype and not jnp.issubdtype(new.dtype, jnp.floating):
    raise TypeError(
        f"new must be a float array (cast to the cache's {cache.dtype}, or "
        f"quantized into an int8/float8 cache) or already of the cache's "
        f"dtype, got new.dtype={new.dtype}.")
  if not isinstance(index, jax.core.Tracer) and np.any(np.asarray(index) < 0):
    raise ValueError(f"index must be non-negative, got {index=}.")
  if block_table is not None:
    check_distinct_pages(block_table)


def gather(pages: Array, block_table: Array) -> Array:
  """The contiguous view [B, max_pages * page_size, K, H] of a paged cache
  (copies every row's pages; for calls that need contiguous keys).

  Args:
    pages: [num_pages, page_size, ...] (values [..., K, H], or a quantized
      cache's scales [..., K]).
    block_table: int [B, max_pages], entries in [0, num_pages). Pages may
      repeat (reading is not writing). A traced table cannot be checked:
      its entries out of range are clamped onto the pool's first or last
      page.

  Raises:
    ValueError: pages of rank < 2, a block table of another rank or dtype,
      or a known entry out of range (the message names the argument).
  """
  pages = jnp.asarray(pages)
  if pages.ndim < 2:
    raise ValueError(
        f"pages must be [num_pages, page_size, ...], got {pages.shape=}.")
  block_table = _check_block_table(block_table, pages.shape[0])
  # Clipped, not wrapped: a traced -1 reads page 0, as decode_attention's
  # kernels and gathers clamp it (numpy indexing would read the last).
  rows = pages[jnp.clip(block_table, 0, pages.shape[0] - 1)]  # [B, P, ...]
  b, max_pages, page_size = rows.shape[:3]
  return rows.reshape(b, max_pages * page_size, *rows.shape[3:])
