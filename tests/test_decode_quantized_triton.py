"""The triton decode kernel over quantized (int8 / float8) KV caches: the
narrow tiles read as stored and dequantized in registers, against the
float64 oracle of the dequantized cache (`test_decode_quantized`) and
against `chunked` on the same quantized inputs (a mask_mod, scales with
broadcast dims)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from tests import test_decode_quantized as quantized


@pytest.mark.parametrize("dtype, page_size, scale_form, splits",
                         list(quantized.kernel_matrix()))
def test_triton_quantized_decode_matches_the_dequantized_oracle(
    dtype, page_size, scale_form, splits):
  """Contiguous and paged caches; scales per entry (NaN past the lengths),
  per K/V head and one for the cache; one split and several (`attention`,
  the two-kernel path)."""
  quantized.check_quantized_decode("triton", dtype, page_size, scale_form,
                                   splits)


# (quantized dtype, page size, scales): full per-entry scales (NaN past the
# lengths), or broadcast ones (`quantized.broadcast_scales`).
_MASKED = [(jnp.int8, None, "full"), (jnp.float8_e4m3fn, 16, "full"),
           (jnp.int8, 16, "lead"), (jnp.float8_e5m2, None, "lead"),
           (jnp.float8_e4m3fn, 16, "rows"), (jnp.int8, None, "rows")]


@pytest.mark.parametrize("dtype, page_size, scales", _MASKED)
def test_triton_quantized_decode_with_a_mask_mod(dtype, page_size, scales):
  """A mask_mod takes `partials` (the kernel over each K/V head's listed
  blocks, merged in JAX)."""
  quantized.check_quantized_decode_with_a_mask_mod(
      "triton", dtype, page_size, scales, block_kv=16)


def test_triton_quantized_decode_with_a_bfloat16_query():
  """The tiles convert to the query's dtype (int8 values are exact in
  bfloat16)."""
  quantized.check_quantized_decode_with_a_narrow_query(
      "triton", jnp.bfloat16, page_size=16)


@pytest.mark.parametrize(
    "cache_dtype, page_size, scale_form, query_scale, value_scale", [
        (jnp.float8_e4m3fn, None, "full", 1, 1),
        (jnp.float8_e5m2, 16, "full", 1, 2**20),
        (jnp.float8_e4m3fn, 16, "full", 2**16, 2**-24),
        (jnp.float8_e4m3fn, None, "head", 2**16, 1),
        (jnp.float8_e5m2, None, "scalar", 1, 1)])
def test_triton_float8_in_float16_under_a_bfloat16_query(
    cache_dtype, page_size, scale_form, query_scale, value_scale):
  """A float8 cache under bfloat16 queries multiplies in float16: the
  queries scaled by a power of two into float16's range (queries past its
  largest value, 65504, and all-zero ones decode as in bfloat16), P by
  one per block from the block's value scales (per entry, NaN past the
  lengths; 2^20 times smaller or 2^24 larger than the values' own, past
  float16's range) or by a constant (one per K/V head or for the
  cache)."""
  quantized.check_quantized_decode_with_a_narrow_query(
      "triton", jnp.bfloat16, cache_dtype=cache_dtype,
      query_scale=query_scale, value_scale=value_scale,
      page_size=page_size, scale_form=scale_form)
