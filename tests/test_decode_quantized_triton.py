"""The triton decode kernel over quantized (int8 / float8) KV caches: the
narrow tiles read as stored and dequantized in registers, against the
float64 oracle of the dequantized cache (`test_decode_quantized`) and
against `chunked` on the same quantized inputs (a mask_mod, scales with
broadcast dims)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from pallas_fa import gpu_target
from pallas_fa.triton import int8 as int8_lib
from tests import test_decode_prefix_latent as latent
from tests import test_decode_quantized as quantized
from tests.attention_testing import assert_close
from tests.attention_testing import rng


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
        (jnp.float8_e5m2, None, "scalar", 1, 1),
        (jnp.int8, None, "full", 2**16, 2**-24),
        (jnp.int8, 16, "head", 1, 2**20)])
def test_triton_1_byte_cache_in_float16_under_a_bfloat16_query(
    cache_dtype, page_size, scale_form, query_scale, value_scale):
  """A float8 or int8 cache under bfloat16 queries multiplies in float16: the
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


@pytest.mark.parametrize("dtype, scale_form, t, splits", [
    (jnp.int8, "full", 2, 3), (jnp.int8, "head", 1, 2),
    (jnp.float8_e4m3fn, "full", 3, 2)])
def test_triton_quantized_decode_over_16_key_pages(dtype, scale_form, t,
                                                   splits):
  """A 1-byte cache in 16-key pages, read four pages to a 64-key block
  (each row and its scale gathered through the key's table entry): GQA,
  lengths that end mid-page and mid-block (S_max = 200 is no whole number
  of blocks), extreme values and NaN scales past them, shuffled pages;
  against the float64 oracle of the dequantized cache."""
  gen = rng("triton quantized 16-key pages", str(dtype), scale_form, t,
            splits)
  q, args, lengths, q_pos, k_deq, v_deq = quantized._case(
      gen, b=3, t=t, n=8, num_kv=2, h=64, s_max=200, dtype=dtype,
      page_size=16, scale_form=scale_form)
  out, lse = pallas_fa.decode_attention(
      jnp.asarray(q), lengths=jnp.asarray(lengths), num_splits=splits,
      return_residual=True, implementation="triton",
      **{name: None if x is None else jnp.asarray(x)
         for name, x in args.items()})
  ref_out, ref_lse = quantized._oracle(q, k_deq, v_deq, lengths, q_pos)
  assert_close("out", out, ref_out)
  assert_close("lse", lse, ref_lse)


def test_triton_quantized_latent_cache_over_16_key_pages():
  """A latent int8 cache (H = 128, Hv = 64) in 16-key pages: the key
  tiles, their value columns and the key scales gathered four pages to a
  block; equal to `chunked` on the same inputs."""
  gen = rng("triton latent 16-key pages")
  args = latent.latent_case(gen, quantized_as=jnp.int8, page_size=16,
                            h=128, hv=64, n=4, t=1, s_max=112)
  kw = dict(return_residual=True, num_splits=2, **args)
  out, lse = pallas_fa.decode_attention(implementation="triton", **kw)
  want_out, want_lse = pallas_fa.decode_attention(implementation=None, **kw)
  assert_close("out", out, want_out)
  assert_close("lse", lse, want_lse)


def _emulated_to_float16(words):
  """`int8.to_float16`'s PTX on uint32 words (four int8 values each, value
  i in byte i), instruction by instruction: uint16 [n, 4], the float16
  bits of values 0-3."""
  t = words ^ np.uint32(int8_lib.SIGN_FLIP)  # xor.b32
  out = []
  for word in t:
    pool = [(int(word) >> 8 * i) & 0xFF for i in range(4)] + [
        (int8_lib.EXPONENT >> 8 * i) & 0xFF for i in range(4)]
    for sel in int8_lib.SELECTORS:  # prmt.b32: result byte i <- nibble i.
      d = sum(pool[(sel >> 4 * i) & 0x7] << 8 * i for i in range(4))
      halves = np.array([d & 0xFFFF, d >> 16], np.uint16).view(np.float16)
      offset = np.array([int8_lib.OFFSET & 0xFFFF, int8_lib.OFFSET >> 16],
                        np.uint16).view(np.float16)
      out.append(halves - offset)  # sub.f16x2, exact.
  return np.concatenate(out).reshape(len(words), 4)


def test_int8_to_float16_instructions_are_exact_for_every_value():
  """Every int8 value in every byte of the packed word, through the
  conversion's instructions (xor, two prmt, two float16x2 subtractions;
  their constants are the module's): each float16 equals the int8."""
  gen = rng("int8 to float16 words")
  # Each byte position holds every value once, in its own order.
  values = np.stack([gen.permutation(np.arange(-128, 128, dtype=np.int8))
                     for _ in range(4)], axis=1)
  words = np.ascontiguousarray(values).view(np.uint32).reshape(-1)
  got = _emulated_to_float16(words)
  np.testing.assert_array_equal(got, values.astype(np.float16))


def test_int8_tiles_convert_by_the_inline_conversion_when_built(monkeypatch):
  """Built for CUDA, an int8 cache under bfloat16 queries converts its K
  and V tiles by `int8.to_float16` (packed four to an instruction group);
  interpreted, by astype (the same float16 values)."""
  calls = []
  real = int8_lib.pltriton.elementwise_inline_asm

  def spy(code, **kwargs):
    calls.append((code, kwargs["pack"], kwargs["args"][0].shape))
    return real(code, **kwargs)

  monkeypatch.setattr(int8_lib.pltriton, "elementwise_inline_asm", spy)
  spec = jax.ShapeDtypeStruct
  kv = spec((1, 96, 2, 64), jnp.int8)
  scales = spec((1, 96, 2), jnp.float32)

  def decode(q, k, v, ks, vs):
    return pallas_fa.decode_attention(
        q, k, v, jnp.full((1,), 90, jnp.int32), key_scale=ks,
        value_scale=vs, implementation="triton")

  with gpu_target.compile_for(gpu_target.H100):
    jax.jit(decode).trace(spec((1, 1, 4, 64), jnp.bfloat16), kv, kv, scales,
                          scales).lower(lowering_platforms=("cuda",))
  built = len(calls)
  # The K and V tiles of each traced loop body (the others: exponentials).
  tiles = [(pack, shape) for code, pack, shape in calls
           if code == int8_lib._TO_FLOAT16]
  assert len(tiles) >= 4 and len(tiles) % 2 == 0, calls
  assert all(pack == 4 for pack, _ in tiles), tiles
  gen = rng("int8 tiles interpreted")
  x = jnp.asarray(gen.integers(-128, 128, (16, 64)), jnp.int8)
  np.testing.assert_array_equal(int8_lib.to_float16(x),
                                np.asarray(x).astype(np.float16))
  assert len(calls) == built
