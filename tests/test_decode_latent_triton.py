"""The triton decode kernel over latent (MLA) caches, in interpret mode:
value=None with value_head_dim, the values the key's first Hv columns read
from the key tiles (no value operand), against `chunked` on the same
inputs: contiguous and paged caches, float32 and bfloat16 queries, int8 /
float8 caches dequantized by the key scales, a mask_mod (`partials`)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import pallas_fa
from pallas_fa import flex
from tests import attention_testing
from tests import test_decode_prefix_latent as latent
from tests.attention_testing import assert_close
from tests.attention_testing import rng

# Triton's interpreter on a CPU: CI runs these with the GPU machines' jax
# (leg 2), as every test parametrized with implementation="triton".
pytestmark = attention_testing.gpu_jax_only_on_cpu_module()


def _against_chunked(args, **kw):
  """(out, lse) of triton and of chunked on the same arguments."""
  kw = dict(return_residual=True, **kw)
  got = pallas_fa.decode_attention(**args, implementation="triton", **kw)
  want = pallas_fa.decode_attention(**args, implementation=None, **kw)
  return got, want


@pytest.mark.parametrize("quantized_as, page_size, h, hv, n, t", [
    # DeepSeek's absorbed MLA: 576 = 9 key chunks of 64, one value chunk
    # of 512 (eight of them) at 8 query heads.
    (None, None, 576, 512, 8, 1),
    (None, 16, 576, 512, 8, 1),
    (jnp.int8, None, 576, 512, 8, 1),
    (jnp.int8, 32, 576, 512, 8, 1),
    # 64 rows: two value chunks of 256, the second program's value
    # columns in the middle of the key row.
    (jnp.int8, 16, 576, 512, 64, 1),
    # Padded head dims (72 -> 128, Hv 64 half the key chunk), two new
    # tokens; a float8 cache.
    (None, None, 72, 64, 4, 2),
    (jnp.float8_e5m2, 16, 192, 128, 4, 2),
    # Hv = H: the whole key tile is the value tile (no other key chunk).
    (None, None, 64, 64, 4, 1),
])
def test_triton_latent_cache_matches_chunked(quantized_as, page_size, h, hv,
                                             n, t):
  """value=None with value_head_dim, contiguous and paged, float and
  quantized: the kernel reads each key block once, its first Hv columns
  the values (the key scales dequantizing both); equal to `chunked`."""
  gen = rng("triton latent", str(quantized_as), page_size, h, n, t)
  args = latent.latent_case(gen, quantized_as=quantized_as, page_size=page_size,
                      h=h, hv=hv, n=n, t=t)
  (out, lse), (want_out, want_lse) = _against_chunked(args, num_splits=2)
  assert out.shape == (2, t, n, hv)
  assert_close("out", out, want_out)
  assert_close("lse", lse, want_lse)


def test_triton_latent_cache_with_sinks_and_one_split():
  """One split per sequence (the merge adds the sinks)."""
  gen = rng("triton latent sinks")
  args = latent.latent_case(gen, quantized_as=jnp.int8, page_size=16, n=4)
  sinks = jnp.asarray(gen.standard_normal(4), jnp.float32)
  (out, lse), (want_out, want_lse) = _against_chunked(
      args, num_splits=1, sinks=sinks)
  assert_close("out", out, want_out)
  assert_close("lse", lse, want_lse)


@pytest.mark.parametrize("quantized_as, page_size", [
    (None, None), (jnp.int8, 16)])
def test_triton_latent_cache_with_a_bfloat16_query(quantized_as, page_size):
  """A bfloat16 query (and float cache): the FlashAttention rule against
  `chunked` in float32 on the same values, with `chunked` in bfloat16 as
  the same-dtype reference; an int8 cache converts to bfloat16 exactly."""
  gen = rng("triton latent bfloat16", str(quantized_as), page_size)
  args = latent.latent_case(gen, quantized_as=quantized_as, page_size=page_size)
  low = dict(args, query=args["query"].astype(jnp.bfloat16))
  if quantized_as is None:
    low["key"] = args["key"].astype(jnp.bfloat16)
  wide = dict(low, query=low["query"].astype(jnp.float32),
              key=low["key"] if quantized_as else low["key"].astype(
                  jnp.float32))
  out = pallas_fa.decode_attention(**low, implementation="triton")
  ref32 = pallas_fa.decode_attention(**wide, implementation=None)
  same = pallas_fa.decode_attention(**low, implementation=None)
  assert out.dtype == jnp.bfloat16
  assert_close("out", out, ref32, same, jnp.bfloat16)


@pytest.mark.parametrize("quantized_as, page_size", [
    (None, None), (jnp.int8, None), (None, 16), (jnp.int8, 16)])
def test_triton_latent_cache_with_a_mask_mod(quantized_as, page_size):
  """A mask_mod takes `partials` (each K/V head's listed blocks, merged in
  JAX): StreamingLLM's window with sink tokens hides whole blocks, shows
  some whole (unmasked: their value columns and scales used as read) and
  some in part; equal to `chunked`."""
  gen = rng("triton latent mask_mod", str(quantized_as), page_size)
  args = latent.latent_case(gen, quantized_as=quantized_as, page_size=page_size,
                      t=2, s_max=96)
  (out, lse), (want_out, want_lse) = _against_chunked(
      args, mask_mod=flex.sliding_window_with_sinks,
      mask_mod_args=(jnp.int32(40), jnp.int32(3)), num_splits=2,
      block_kv=None if page_size else 16)
  assert_close("out", out, want_out)
  assert_close("lse", lse, want_lse)


@pytest.mark.parametrize("paged", [False, True])
def test_triton_latent_kernel_has_one_cache_operand(paged):
  """The split kernel's operands: the int8 cache itself, once (no value
  operand, no copy of its first Hv columns), and nothing else of the
  cache's size (no dequantized copy)."""
  h, hv = 576, 512
  shape = (8, 16) if paged else (2, 64)
  cache = jnp.zeros(shape + (1, h), jnp.int8)
  scale = jnp.ones(shape + (1,), jnp.float32)
  q = jnp.ones((2, 1, 8, h), jnp.float32)
  lengths = jnp.asarray([64, 37], jnp.int32)
  table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4) if paged else None

  def step(q, k, ks):
    return pallas_fa.decode_attention(
        q, k, None, lengths, block_table=table, value_head_dim=hv,
        key_scale=ks, implementation="triton")

  split, merge = attention_testing.pallas_call_operands(step, q, cache, scale)
  del merge
  narrow = [x for x in split if x.dtype == jnp.int8]
  assert [x.shape for x in narrow] == [cache.shape]
  assert all(x.size < cache.size for x in split if x.dtype != jnp.int8)


def test_triton_latent_value_chunk_defaults_to_128_columns(monkeypatch):
  """A latent call's programs cover `LATENT_VALUE_CHUNK` value columns
  unless `_value_chunk` picks others (a mask_mod's path keeps its own);
  the one 512-column chunk it replaced still equals `chunked`."""
  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415
  seen = []
  real = triton_decode.attention

  def spy(*args, **kw):
    seen.append(kw.get("max_value_chunk"))
    return real(*args, **kw)

  monkeypatch.setattr(triton_decode, "attention", spy)
  gen = rng("triton latent chunk default")
  args = latent.latent_case(gen, quantized_as=None, page_size=None, h=576,
                            hv=512, n=8, t=1)
  (out, lse), (want_out, want_lse) = _against_chunked(args, num_splits=2)
  assert triton_decode.LATENT_VALUE_CHUNK == 128 and seen == [128]
  assert_close("out", out, want_out)
  assert_close("lse", lse, want_lse)
  out, lse = pallas_fa.decode_attention(
      **args, implementation="triton", num_splits=2, return_residual=True,
      _value_chunk=512)
  assert seen[-1] == 512
  assert_close("out", out, want_out)
  assert_close("lse", lse, want_lse)
