"""`kv_cache.write`: entries land at each row's cache indices, contiguous or
paged; entries past a row's capacity (or before its start) are dropped,
never written over another entry; bad arguments are named."""

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
  ]
  for change, match in bad:
    args = {"cache": cache, "new": new, "index": index, **change}
    with pytest.raises(ValueError, match=match):
      kv_cache.write(**args)
