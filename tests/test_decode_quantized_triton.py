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
from pallas_fa.triton import one_byte
from tests import attention_testing
from tests import test_decode_prefix_latent as latent
from tests import test_decode_quantized as quantized
from tests.attention_testing import assert_close
from tests.attention_testing import rng

# Triton's interpreter on a CPU: CI runs these with the GPU machines' jax
# (leg 2), as every test parametrized with implementation="triton".
pytestmark = attention_testing.gpu_jax_only_on_cpu_module()


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
    "cache_dtype, page_size, scale_form, query_scale, value_scale, h", [
        (jnp.float8_e4m3fn, None, "full", 1, 1, 32),
        (jnp.float8_e5m2, 16, "full", 1, 2**20, 128),
        (jnp.float8_e4m3fn, 16, "full", 2**16, 2**-24, 32),
        (jnp.float8_e4m3fn, None, "head", 2**16, 1, 128),
        (jnp.float8_e5m2, None, "scalar", 1, 1, 32),
        (jnp.int8, None, "full", 2**16, 2**-24, 128),
        (jnp.int8, 16, "head", 1, 2**20, 128),
        (jnp.int8, None, "full", 1, 1, 32)])
def test_triton_1_byte_cache_in_float16_under_a_bfloat16_query(
    cache_dtype, page_size, scale_form, query_scale, value_scale, h):
  """A float8 or int8 cache under bfloat16 queries multiplies in float16: the
  queries scaled by a power of two into float16's range (queries past its
  largest value, 65504, and all-zero ones decode as in bfloat16), P by
  one per block from the block's value scales (per entry, NaN past the
  lengths; 2^20 times smaller or 2^24 larger than the values' own, past
  float16's range) or by a constant (one per K/V head or for the
  cache); at H = 128 the values read as int32 words (`one_byte`)."""
  quantized.check_quantized_decode_with_a_narrow_query(
      "triton", jnp.bfloat16, cache_dtype=cache_dtype,
      query_scale=query_scale, value_scale=value_scale,
      page_size=page_size, scale_form=scale_form, h=h)


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


def _prmt(a, b, selector):
  """PTX prmt.b32 (default mode) on Python ints."""
  pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [
      (b >> 8 * i) & 0xFF for i in range(4)]
  return sum(pool[(selector >> 4 * i) & 0x7] << 8 * i for i in range(4))


def _halves(word):
  """float16x2 bits -> float16 [low, high]."""
  return np.array([word & 0xFFFF, word >> 16], np.uint16).view(np.float16)


def _values(gen):
  """int8 [256, 4]: each byte position holds every value once, in its own
  order."""
  return np.stack([gen.permutation(np.arange(-128, 128, dtype=np.int8))
                   for _ in range(4)], axis=1)


def test_int8_to_float16_instructions_are_exact_for_every_value():
  """Every int8 value in every byte of the packed word, through the key
  tiles' conversion instruction by instruction (xor, two prmt, two
  float16x2 subtractions; the module's constants): each float16 equals
  its int8."""
  values = _values(rng("int8 to float16 words"))
  words = np.ascontiguousarray(values).view(np.uint32).reshape(-1)
  offset = _halves(one_byte.OFFSET)
  got = []
  for word in words:
    t = int(word) ^ one_byte.SIGN_FLIP  # xor.b32
    for sel in one_byte.SELECTORS:
      got.append(_halves(_prmt(t, one_byte.EXPONENT, sel)) - offset)
  np.testing.assert_array_equal(np.concatenate(got).reshape(-1, 4),
                                values.astype(np.float16))


def test_value_words_instructions_are_exact_for_every_value():
  """Value j of two words (consecutive keys) to one float16x2, for every
  j and every byte value, instruction by instruction: int8 by prmt, the
  LOP3 (a & b) ^ c and a float16x2 subtraction; float8 by prmt and the
  float8x2 conversion (emulated by ml_dtypes). The low half is the first
  word's value."""
  gen = rng("value words")
  offset = _halves(one_byte.OFFSET)
  first, second = _values(gen), _values(gen)
  words = [np.ascontiguousarray(v).view(np.uint32).reshape(-1)
           for v in (first, second)]
  for j in range(4):
    got = []
    for a, b in zip(*words):
      x = _prmt(int(a), int(b), one_byte.pair_selector(j))
      x = (x & one_byte.LOW_BYTES) ^ one_byte.OFFSET  # lop3 0x6a
      got.append(_halves(x) - offset)
    np.testing.assert_array_equal(
        np.stack(got), np.stack([first[:, j], second[:, j]], 1).astype(
            np.float16))
    assert f"{one_byte.pair_selector(j):#x}" in one_byte._int8_pair(j)
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
      code = one_byte._float8_pair(j, dtype)
      selector = int(code.split("prmt.b32 x, $1, $2, ")[1].split(";")[0], 16)
      got = []
      for a, b in zip(*words):
        low = _prmt(int(a), int(b), selector) & 0xFFFF  # mov {lo, hi}
        got.append(np.array([low & 0xFF, low >> 8], np.uint8))
      want = np.stack([first[:, j], second[:, j]], 1).view(np.uint8)
      np.testing.assert_array_equal(np.stack(got), want)
      kind = "e4m3x2" if dtype == jnp.float8_e4m3fn else "e5m2x2"
      assert f"cvt.rn.f16x2.{kind} $0, lo;" in code


def test_as_words_and_word_values_take_value_j_of_each_word(monkeypatch):
  """`as_words` packs four values along the head dim (value j in byte j);
  `word_values(w, j)` interpreted is the float16 of columns j, j + 4, ...,
  for int8 and both float8 dtypes."""
  # Interpreted (on a GPU too, with no GPU target): jax.numpy.
  monkeypatch.setattr(gpu_target, "current", lambda: None)
  gen = rng("as words")
  raw = gen.integers(-128, 128, (3, 16, 32)).astype(np.int8)
  for dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2):
    x = jax.lax.bitcast_convert_type(jnp.asarray(raw), dtype)
    words = one_byte.as_words(x)
    assert words.shape == (3, 16, 8) and words.dtype == jnp.int32
    for j in range(4):
      got = one_byte.word_values(words, j, dtype)
      want = np.asarray(x[..., j::4].astype(jnp.float16))
      np.testing.assert_array_equal(np.asarray(got), want)


def test_1_byte_tiles_convert_inline_when_built(monkeypatch):
  """Built for CUDA, a 1-byte cache under bfloat16 queries comes in as
  value words (an int32 cache operand) and converts inline: int8 keys by
  `to_float16` (four values an instance), each value tile as four word
  parts (two words an instance); interpreted, jax.numpy (the same
  float16 values)."""
  calls = []
  real = one_byte.pltriton.elementwise_inline_asm

  def spy(code, **kwargs):
    calls.append((code, kwargs["pack"], kwargs["args"][0].dtype))
    return real(code, **kwargs)

  monkeypatch.setattr(one_byte.pltriton, "elementwise_inline_asm", spy)
  spec = jax.ShapeDtypeStruct

  def lowered(dtype, h=128):
    kv = spec((1, 96, 2, h), dtype)
    scales = spec((1, 96, 2), jnp.float32)

    def decode(q, k, v, ks, vs):
      return pallas_fa.decode_attention(
          q, k, v, jnp.full((1,), 90, jnp.int32), key_scale=ks,
          value_scale=vs, implementation="triton")

    with gpu_target.compile_for(gpu_target.H100):
      return jax.jit(decode).trace(
          spec((1, 1, 4, h), jnp.bfloat16), kv, kv, scales,
          scales).lower(lowering_platforms=("cuda",)).as_text()

  text = lowered(jnp.int8)
  # The key tiles (the unmasked and the masked loop): to_float16.
  keys = [c for c in calls if c[0] == one_byte._TO_FLOAT16]
  assert len(keys) >= 2 and all(
      pack == 4 and dtype == jnp.int8 for _, pack, dtype in keys), calls
  # The value tiles: four word parts each.
  for j in range(4):
    parts = [c for c in calls if c[0] == one_byte._int8_pair(j)]
    assert len(parts) == len(keys) and all(
        pack == 2 and dtype == jnp.int32 for _, pack, dtype in parts), calls
  assert "tensor<1x96x2x32xi32>" in text.replace(" ", ""), text[:2000]
  built = len(calls)
  lowered(jnp.float8_e4m3fn)
  fp8 = calls[built:]
  for j in range(4):
    assert one_byte._float8_pair(j, jnp.float8_e4m3fn) in [
        c[0] for c in fp8], fp8
  # Value chunks under 128 columns stay byte tiles (their quarter-width
  # products would take about twice the registers).
  built = len(calls)
  text = lowered(jnp.int8, h=64)
  assert not any(c[0] == one_byte._int8_pair(0) for c in calls[built:])
  assert "tensor<1x96x2x16xi32>" not in text.replace(" ", "")
  assert "tensor<1x96x2x64xi8>" in text.replace(" ", "")
  built = len(calls)
  # Interpreted (on a GPU too, with no GPU target): jax.numpy.
  monkeypatch.setattr(gpu_target, "current", lambda: None)
  gen = rng("1-byte tiles interpreted")
  x = jnp.asarray(gen.integers(-128, 128, (16, 64)), jnp.int8)
  np.testing.assert_array_equal(one_byte.to_float16(x),
                                np.asarray(x).astype(np.float16))
  one_byte.word_values(one_byte.as_words(x), 1, jnp.int8)
  assert len(calls) == built
