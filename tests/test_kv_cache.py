"""`kv_cache.write`: entries land at each row's cache indices, contiguous or
paged; entries past a row's capacity (or before its start) are dropped,
never written over another entry; bad arguments are named (as they are by
`gather` and the size helpers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fa import kv_cache
from tests.attention_testing import rng


def _expected(cache, new, index, capacity):
  """numpy: row b's entry i of `new` at index[b] + i where that is in
  [0, capacity), everything else as it was ([B, capacity, ...] view)."""
  want = np.array(cache)
  for b, start in enumerate(np.asarray(index)):
    for i in range(new.shape[1]):
      if 0 <= start + i < capacity:
        want[b, start + i] = new[b, i]
  return want


@pytest.mark.parametrize("page_size", [None, 3])
@pytest.mark.parametrize("jit", [False, True])
def test_write_drops_what_falls_outside_each_row(page_size, jit):
  gen = rng("kv_cache write", page_size, jit)
  b, capacity, t, num_kv, h = 3, 9, 4, 2, 5
  rows = gen.standard_normal((b, capacity, num_kv, h)).astype(np.float32)
  new = gen.standard_normal((b, t, num_kv, h)).astype(np.float32)
  # Row 0 inside, row 1 over the end (the last three dropped), row 2 over
  # the end by all but one entry; a traced index may also start below 0.
  index = np.array([2, 8, 6] if not jit else [-2, 8, 6], np.int32)
  write = jax.jit(kv_cache.write) if jit else kv_cache.write
  if page_size is None:
    got = np.asarray(write(jnp.asarray(rows), new, index))
  else:
    max_pages = capacity // page_size
    table = gen.permutation(b * max_pages + 2)[:b * max_pages].reshape(
        b, max_pages).astype(np.int32)
    pool = gen.standard_normal((b * max_pages + 2, page_size, num_kv, h))
    pool = pool.astype(np.float32)
    for r in range(b):
      for p in range(max_pages):
        pool[table[r, p]] = rows[r, p * page_size:(p + 1) * page_size]
    spare = np.setdiff1d(np.arange(len(pool)), table)
    got_pool = np.asarray(write(jnp.asarray(pool), new, index, table))
    np.testing.assert_array_equal(got_pool[spare], pool[spare])
    got = got_pool[table].reshape(b, capacity, num_kv, h)
  np.testing.assert_array_equal(got, _expected(rows, new, index, capacity))


def test_write_of_scales_goes_with_the_entries():
  # A quantized cache's scales ([B, L, K]) take the same calls.
  cache = jnp.zeros((2, 6, 1, 4), jnp.int8)
  scale = jnp.full((2, 6, 1), 7.0)
  new = jnp.asarray(rng("write scales").standard_normal((2, 3, 1, 4)),
                    jnp.float32)
  values, scales = kv_cache.write(cache, new, jnp.array([4, 0]), scale=scale)
  want_values, want_scales = kv_cache.quantize(new, jnp.int8)
  np.testing.assert_array_equal(values[1, :3], want_values[1])
  np.testing.assert_array_equal(values[0, 4:], want_values[0, :2])
  np.testing.assert_array_equal(scales[0, 4:], want_scales[0, :2])
  np.testing.assert_array_equal(scales[0, :4], 7.0)
  np.testing.assert_array_equal(scales[1, 3:], 7.0)


def test_write_names_bad_arguments():
  cache = jnp.zeros((2, 8, 1, 4))
  new = jnp.ones((2, 3, 1, 4))
  index = jnp.array([0, 1])
  pages, table = jnp.zeros((4, 2, 1, 4)), jnp.array([[0, 1], [2, 3]])
  bad = [
      (dict(new=jnp.ones((2, 3, 2, 4))), "new must be"),
      (dict(new=jnp.ones((1, 3, 1, 4))), "new must be"),
      (dict(new=jnp.ones((2, 3, 1, 5))), "new must be"),
      (dict(index=jnp.array([0, 1, 2])), "index must be"),
      (dict(index=jnp.array([0.0, 1.0])), "index must be"),
      (dict(index=jnp.array([0, -1])), "index must be non-negative"),
      (dict(cache=pages, block_table=table[:1]), "new must be"),
      (dict(cache=pages, block_table=jnp.array([[0, 1], [2, 9]])),
       "block_table entries"),
      (dict(cache=pages, block_table=jnp.zeros((2, 2))), "block_table must"),
      (dict(cache=jnp.zeros((2, 8, 1, 4), jnp.int8),
            scale=jnp.ones((2, 8, 3))), "scale must be"),
      (dict(cache=jnp.zeros((2, 8, 1, 4), jnp.int8)), "scale="),
      # jnp.asarray would wrap 2^32 to 0 and overwrite entry 0.
      (dict(index=np.array([2**32, 1], np.int64)), "index must lie in"),
      (dict(cache=pages, block_table=np.array([[0, 1], [2, 2**32 + 3]],
                                              np.int64)),
       "block_table must lie in"),
  ]
  for change, match in bad:
    args = {"cache": cache, "new": new, "index": index, **change}
    with pytest.raises(ValueError, match=match):
      kv_cache.write(**args)


@pytest.mark.parametrize("call, error, match", [
    (lambda: kv_cache.num_pages_per_row(10, 0), ValueError,
     "page_size must be a positive int"),
    (lambda: kv_cache.num_pages_per_row(10, -4), ValueError, "page_size"),
    (lambda: kv_cache.num_pages_per_row(10, 2.0), TypeError,
     "page_size must be an int"),
    (lambda: kv_cache.num_pages_per_row(10, True), TypeError, "page_size"),
    (lambda: kv_cache.num_pages_per_row(10.0, 4), TypeError, "max_length"),
    (lambda: kv_cache.num_pages_per_row(-1, 4), ValueError,
     "max_length must be an int >= 0"),
    (lambda: kv_cache.default_block_table(2.0, 3), TypeError, "batch_size"),
    (lambda: kv_cache.default_block_table(2, 0), ValueError, "max_pages"),
    (lambda: kv_cache.check_paged_config(2, 10, page_size="4"), TypeError,
     "page_size"),
    (lambda: kv_cache.check_paged_config(2, 10, page_size=4, num_pages=6.0),
     TypeError, "num_pages"),
    (lambda: kv_cache.check_page_indices(jnp.zeros((2, 2), int), "4"),
     TypeError, "num_pages must be an int"),
    (lambda: kv_cache.check_page_indices(None, 4), TypeError,
     "block_table must be an array, got None"),
    (lambda: kv_cache.check_page_indices(jnp.array([[0.5, 1.7]]), 3),
     TypeError, "block_table must be an integer array"),
])
def test_sizes_are_checked(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_num_pages_per_row_counts_whole_pages():
  assert kv_cache.num_pages_per_row(10, 4) == 3
  assert kv_cache.num_pages_per_row(np.int64(8), np.int32(4)) == 2
  assert kv_cache.num_pages_per_row(0, 4) == 0


@pytest.mark.parametrize("jit", [False, True])
def test_gather_reads_each_rows_pages(jit):
  gen = rng("kv_cache gather", jit)
  pages = jnp.asarray(gen.standard_normal((7, 3, 2, 5)), jnp.float32)
  # Pages may repeat in a table that is only read.
  table = np.array([[4, 0, 6], [2, 2, 5]], np.int32)
  gather = jax.jit(kv_cache.gather) if jit else kv_cache.gather
  got = gather(pages, jnp.asarray(table))
  want = np.asarray(pages)[table].reshape(2, 9, 2, 5)
  np.testing.assert_array_equal(got, want)


def test_gather_clamps_a_traced_table_as_decode_does():
  """A traced table cannot be checked: its entries out of range read the
  pool's first or last page, as decode_attention's reads clamp them (a -1
  read the last page, by numpy's wrap-around, where decode reads the
  first)."""
  gen = rng("kv_cache gather traced", False)
  pages = jnp.asarray(gen.standard_normal((5, 2, 1, 4)), jnp.float32)
  table = np.array([[-1, 3], [9, 0]], np.int32)
  got = jax.jit(kv_cache.gather)(pages, jnp.asarray(table))
  want = np.asarray(pages)[np.clip(table, 0, 4)].reshape(2, 4, 1, 4)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("pages, table, error, match", [
    ((4, 2, 1, 3), np.array([0, 1]), ValueError,
     r"block_table must be an int \[B, max_pages\].*shape=\(2,\)"),
    ((4, 2, 1, 3), np.zeros((2, 2, 1), np.int32), ValueError,
     "block_table must be"),
    ((4, 2, 1, 3), np.zeros((2, 2), np.float32), ValueError,
     "block_table must be.*float32"),
    ((4, 2, 1, 3), np.array([[0, 1], [2, 7]]), ValueError,
     r"num_pages=4\), got block_table\[1, 1\]=7"),
    ((4, 2, 1, 3), np.array([[0, -1], [2, 3]]), ValueError,
     r"got block_table\[0, 1\]=-1"),
    ((4,), np.array([[0, 1], [2, 3]]), ValueError, "pages must be"),
])
def test_gather_names_bad_arguments(pages, table, error, match):
  pages = jnp.asarray(rng("gather bad", pages).standard_normal(pages),
                      jnp.float32)
  with pytest.raises(error, match=match):
    kv_cache.gather(pages, jnp.asarray(table))


@pytest.mark.parametrize("change, error, match", [
    # A page named twice: rows would overwrite each other.
    (dict(block_table=np.zeros((2, 2), np.int32)), ValueError,
     "block_table must name every page at most once"),
    (dict(block_table=np.array([[0, 3], [2, 3]], np.int32)), ValueError,
     "at most once"),
    (dict(new=np.ones((2, 3, 1, 4), np.complex64)), TypeError,
     "new must be a float array.*complex64"),
    (dict(new=np.ones((2, 3, 1, 4), np.int32)), TypeError,
     "new must be a float array.*int32"),
    (dict(new=np.ones((2, 3, 1, 4), np.bool_)), TypeError, "new.dtype=bool"),
    (dict(new=np.ones((2, 3, 1, 4), np.int8)), TypeError, "new.dtype=int8"),
    (dict(cache=np.zeros((8, 2, 1, 4), np.int32),
          new=np.ones((2, 3, 1, 4), np.int32)), TypeError,
     "cache must be a float array.*int32"),
    (dict(cache=np.zeros((8, 2, 1, 4), np.int8),
          scale=np.ones((8, 2, 1), np.int32)), TypeError,
     "scale must be a float32 array"),
    # bfloat16 scales would round every new one (by up to 0.4 %).
    (dict(cache=np.zeros((8, 2, 1, 4), np.int8),
          scale=np.ones((8, 2, 1), jnp.bfloat16)), TypeError,
     "scale must be a float32 array.*bfloat16"),
])
def test_write_refuses_what_it_would_store_wrongly(change, error, match):
  gen = rng("write refuses", str(change))
  args = dict(cache=np.zeros((8, 2, 1, 4), np.float32),
              new=gen.standard_normal((2, 3, 1, 4)).astype(np.float32),
              index=np.array([0, 1]),
              block_table=np.array([[0, 1], [2, 3]], np.int32)) | change
  args = {name: jnp.asarray(x) for name, x in args.items()}
  with pytest.raises(error, match=match):
    kv_cache.write(**args)


@pytest.mark.parametrize("cache_dtype, new_dtype", [
    (jnp.float32, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32),
    (jnp.float32, jnp.float8_e4m3fn),
    (jnp.int8, jnp.int8),  # Already quantized: stored as it is.
    (jnp.float8_e5m2, jnp.float8_e5m2),
])
def test_write_stores_float_entries_and_quantized_ones_of_its_dtype(
    cache_dtype, new_dtype):
  gen = rng("write dtypes", str(cache_dtype), str(new_dtype))
  # Values of int8's range, rounded: each dtype holds them (an int8 cache
  # as entries already quantized).
  pool = jnp.asarray(np.round(gen.standard_normal((4, 2, 1, 8)) * 20),
                     cache_dtype)
  new = jnp.asarray(np.round(gen.standard_normal((2, 3, 1, 8)) * 20),
                    new_dtype)
  table = np.array([[2, 0], [1, 3]], np.int32)
  index = np.array([1, 3])
  got = kv_cache.write(pool, new, jnp.asarray(index), jnp.asarray(table))
  want = _expected(np.asarray(pool)[table].reshape(2, 4, 1, 8),
                   np.asarray(new.astype(cache_dtype)), index, 4)
  np.testing.assert_array_equal(
      np.asarray(got)[table].reshape(2, 4, 1, 8), want)
