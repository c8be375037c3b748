"""The mosaic_tpu decode kernel over quantized (int8 / float8) and latent
(MLA) KV caches, in Pallas's TPU interpret mode: the narrow tiles read as
stored and dequantized in the kernel, against the float64 oracle of the
dequantized cache (`test_decode_quantized`) and against `chunked` on the
same inputs (a mask_mod, broadcast scales, latent caches); the Mosaic
lowering by exporting for the "tpu" platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_fa
from pallas_fa.mosaic_tpu import kernel
from tests import attention_testing
from tests import test_decode_prefix_latent as latent
from tests import test_decode_quantized as quantized
from tests.attention_testing import assert_close
from tests.attention_testing import rng

# An int8 / float8 cache tiles (32, 128) on a TPU: its blocks and pages are
# multiples of 32 keys (`test_decode_quantized.LAYOUTS` pages 16).
PAGE = 32
LAYOUTS = [(None, "full", 1), (None, "head", 3), (PAGE, "full", 2),
           (PAGE, "scalar", 1)]


@pytest.mark.parametrize("dtype, page_size, scale_form, splits",
                         list(quantized.kernel_matrix(LAYOUTS)))
def test_mosaic_tpu_quantized_decode_matches_the_dequantized_oracle(
    dtype, page_size, scale_form, splits):
  """Contiguous (blocks of 32 keys, the last one partial) and paged caches;
  scales per entry (NaN past the lengths), per K/V head and one for the
  cache; one split and several."""
  quantized.check_quantized_decode("mosaic_tpu", dtype, page_size,
                                   scale_form, splits, h=128, block_kv=32)


def test_mosaic_tpu_quantized_decode_with_a_padded_head_dim():
  """H = 32: the narrow cache padded to 128 lanes (an int8 copy)."""
  quantized.check_quantized_decode("mosaic_tpu", jnp.int8, PAGE, "full", 2)


@pytest.mark.parametrize("change, error, match", [
    (dict(page_size=16), NotImplementedError,
     "page_size must be a multiple of 32, got 16"),
    (dict(block_kv=16), ValueError, "block_kv must be a multiple of 32"),
])
def test_mosaic_tpu_declines_narrow_blocks_below_a_tile(change, error,
                                                        match):
  """A float cache takes pages and blocks of 8 keys; an int8 one 32."""
  gen = rng("mosaic_tpu narrow blocks")
  q, args, lengths, _, _, _ = quantized._case(  # noqa: SLF001
      gen, page_size=change.get("page_size"))
  with pytest.raises(error, match=match):
    pallas_fa.decode_attention(
        jnp.asarray(q), lengths=jnp.asarray(lengths),
        implementation="mosaic_tpu", block_kv=change.get("block_kv"),
        **{name: None if x is None else jnp.asarray(x)
           for name, x in args.items()})


@pytest.mark.parametrize("dtype, page_size, scales", [
    (jnp.int8, None, "full"),
    # The same walk with another conversion: the slow leg (6 s).
    pytest.param(jnp.float8_e4m3fn, PAGE, "full", marks=pytest.mark.slow),
    (jnp.int8, PAGE, "lead"),
    pytest.param(jnp.float8_e5m2, None, "rows", marks=pytest.mark.slow)])
def test_mosaic_tpu_quantized_decode_with_a_mask_mod(dtype, page_size,
                                                     scales):
  """Over 160 keys in blocks of 32: the kernel walks each K/V head's listed
  blocks."""
  quantized.check_quantized_decode_with_a_mask_mod(
      "mosaic_tpu", dtype, page_size, scales, block_kv=32, h=128, s_max=160)


def test_mosaic_tpu_quantized_decode_with_a_bfloat16_query():
  """The tiles widen to bfloat16 (int8 values are exact in it)."""
  quantized.check_quantized_decode_with_a_narrow_query(
      "mosaic_tpu", jnp.bfloat16, page_size=PAGE, h=128)


@pytest.mark.parametrize("quantized_as, page_size, h, hv", [
    (None, None, 72, 64),  # H and Hv padded to 128 lanes alike
    # Hv a lane-aligned part of the key tile (slow: 4 s each in Mosaic TPU's
    # interpreter; the float8 case below has the same tiles).
    pytest.param(None, PAGE, 192, 128, marks=pytest.mark.slow),
    pytest.param(jnp.int8, None, 192, 128, marks=pytest.mark.slow),
    (jnp.int8, PAGE, 72, 64),
    (jnp.float8_e4m3fn, PAGE, 192, 128),
])
def test_mosaic_tpu_latent_cache_reads_values_from_the_keys(
    quantized_as, page_size, h, hv):
  """value=None with value_head_dim: the kernel reads each key block once
  and takes its first Hv columns as the values (the key scales
  dequantizing both); equal to `chunked` on the same inputs."""
  gen = rng("mosaic_tpu latent", str(quantized_as), page_size, h)
  args = latent.latent_case(gen, quantized_as=quantized_as,
                            page_size=page_size, h=h, hv=hv, t=2, s_max=96)
  kw = dict(num_splits=2, return_residual=True,
            block_kv=None if page_size else 32)
  out, lse = pallas_fa.decode_attention(**args, implementation="mosaic_tpu",
                                        **kw)
  kw["block_kv"] = None
  want_out, want_lse = pallas_fa.decode_attention(**args, implementation=None,
                                                  **kw)
  assert out.shape == (2, 2, 8, hv)
  assert_close("out", out, want_out)
  assert_close("lse", lse, want_lse)


@pytest.mark.parametrize("latent", [False, True])
def test_mosaic_tpu_kernel_reads_the_narrow_cache_as_stored(latent):
  """The kernel's operands: the int8 cache itself (a free reshape), once
  for a latent cache (no value operand), and no float array of the
  cache's size (no dequantized copy)."""
  b, s_max, h = 2, 256, 128
  cache = jnp.zeros((b, s_max, 1, h), jnp.int8)
  scale = jnp.ones((b, s_max, 1), jnp.float32)
  q = jnp.ones((b, 1, 4, h), jnp.float32)
  lengths = jnp.asarray([s_max, 100], jnp.int32)

  def step(q, k, ks):
    if latent:
      return pallas_fa.decode_attention(
          q, k, None, lengths, value_head_dim=h, key_scale=ks,
          implementation="mosaic_tpu")
    return pallas_fa.decode_attention(
        q, k, k, lengths, key_scale=ks, value_scale=ks,
        implementation="mosaic_tpu")

  (operands,) = attention_testing.pallas_call_operands(step, q, cache,
                                                       scale)
  narrow = [x for x in operands if x.dtype == jnp.int8]
  assert [x.size for x in narrow] == [cache.size] * (1 if latent else 2)
  assert all(x.size < cache.size for x in operands if x.dtype != jnp.int8)


@pytest.fixture
def compiled_for_tpu(monkeypatch):
  """The kernels as a TPU compiles them (no interpreter), freshly traced."""
  monkeypatch.setattr(kernel, "interpret_params", lambda: False)
  jax.clear_caches()
  yield
  jax.clear_caches()


@pytest.mark.parametrize("dtype, page_size, latent", [
    (jnp.int8, None, False), (jnp.float8_e4m3fn, 64, False),
    (jnp.bfloat16, None, True), (jnp.int8, 64, True)])
def test_quantized_and_latent_decode_lower_to_mosaic_for_tpu(
    dtype, page_size, latent, compiled_for_tpu):
  """One Mosaic kernel, compiled (not interpreted), for an int8 / float8
  cache with its scales and DeepSeek's latent cache (H = 576, Hv = 512,
  one K/V head, 16 query heads), contiguous and paged."""
  del compiled_for_tpu
  b, s_max = 2, 256
  num_kv, n, h, hv = (1, 16, 576, 512) if latent else (2, 8, 128, 128)
  q = jnp.ones((b, 1, n, h), jnp.bfloat16)
  shape = (b, s_max) if page_size is None else (b * s_max // page_size,
                                                page_size)
  key = jnp.ones(shape + (num_kv, h), dtype)
  value = None if latent else jnp.ones(shape + (num_kv, hv), dtype)
  table = None if page_size is None else jnp.arange(
      b * s_max // page_size, dtype=jnp.int32).reshape(b, -1)
  scales = {}
  if dtype != jnp.bfloat16:
    scales = dict(key_scale=jnp.ones(shape + (num_kv,), jnp.float32))
    if not latent:
      scales["value_scale"] = jnp.ones((num_kv,), jnp.float32)
  lengths = jnp.asarray([200, 77], jnp.int32)

  def decode(q, key, value, lengths, table, scales):
    return pallas_fa.decode_attention(
        q, key, value, lengths, block_table=table, num_splits=2,
        value_head_dim=hv if latent else None, implementation="mosaic_tpu",
        **scales)

  exported = jax.export.export(jax.jit(decode), platforms=["tpu"])(
      q, key, value, lengths, table, scales)
  module = exported.mlir_module()
  assert module.count("tpu_custom_call") == 1
  assert "callback" not in module  # a compiled kernel, not the interpreter
