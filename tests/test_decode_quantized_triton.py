"""The triton decode kernel over quantized (int8 / float8) KV caches: the
narrow tiles read as stored and dequantized in registers, against the
float64 oracle of the dequantized cache (`test_decode_quantized`) and
against `chunked` on the same quantized inputs (a mask_mod, scales with
broadcast dims)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from pallas_fa import flex
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


def _broadcast_scales(gen, args, form):
  """Scales with broadcast dims in place of `args`' full ones (the
  quantized values are kept: any positive scale is a valid cache), the
  cache's leading axis being B (contiguous) or P (the pool's pages):
  "lead" one key scale per sequence / page and K/V head [B|P, 1, K], one
  value scale per cache position / page row [1, S_max|page_size, 1];
  "rows" the key scales [1, S_max|page_size, K] and the value scales
  [B|P, 1, 1]."""
  lead, rows, heads = args["key"].shape[:3]
  shapes = {"lead": ((lead, 1, heads), (1, rows, 1)),
            "rows": ((1, rows, heads), (lead, 1, 1))}[form]
  k_scale, v_scale = (gen.uniform(0.01, 0.05, s).astype(np.float32)
                      for s in shapes)
  if args["block_table"] is not None:
    # The pool's pages no sequence uses are never read.
    unused = np.setdiff1d(np.arange(lead), args["block_table"])
    for x in (k_scale, v_scale):
      if x.shape[0] == lead:
        x[unused] = np.nan
  return dict(args, key_scale=k_scale, value_scale=v_scale)


# (quantized dtype, page size, scales): full per-entry scales (NaN past the
# lengths), or broadcast ones (`_broadcast_scales`).
_MASKED = [(jnp.int8, None, "full"), (jnp.float8_e4m3fn, 16, "full"),
           (jnp.int8, 16, "lead"), (jnp.float8_e5m2, None, "lead"),
           (jnp.float8_e4m3fn, 16, "rows"), (jnp.int8, None, "rows")]


@pytest.mark.parametrize("dtype, page_size, scales", _MASKED)
def test_triton_quantized_decode_with_a_mask_mod(dtype, page_size, scales):
  """A mask_mod takes `partials` (the kernel over each K/V head's listed
  blocks, merged in JAX): StreamingLLM's window with sink tokens hides
  whole blocks (never read), shows some whole (no masking: scales applied
  unmasked) and some in part; equal to `chunked` on the same quantized
  inputs."""
  gen = rng("triton quantized mask_mod", str(dtype), page_size, scales)
  q, args, lengths, _, _, _ = quantized._case(  # noqa: SLF001
      gen, dtype=dtype, page_size=page_size)
  if scales != "full":
    args = _broadcast_scales(gen, args, scales)
  kw = dict(mask_mod=flex.sliding_window_with_sinks,
            mask_mod_args=(jnp.int32(40), jnp.int32(3)), num_splits=2,
            return_residual=True,
            **{name: None if x is None else jnp.asarray(x)
               for name, x in args.items()})
  q, lengths = jnp.asarray(q), jnp.asarray(lengths)
  out, lse = pallas_fa.decode_attention(
      q, lengths=lengths, implementation="triton",
      block_kv=None if page_size else 16, **kw)
  want_out, want_lse = pallas_fa.decode_attention(
      q, lengths=lengths, implementation=None, **kw)
  assert_close("out", out, want_out)
  assert_close("lse", lse, want_lse)


def test_triton_quantized_decode_with_a_bfloat16_query():
  """The tiles convert to the query's dtype (int8 values are exact in
  bfloat16): the FlashAttention rule against the float64 oracle, with
  the dequantized cache in bfloat16 through `xla` as the same-dtype
  reference."""
  gen = rng("triton quantized bfloat16")
  q, args, lengths, q_pos, k_deq, v_deq = quantized._case(  # noqa: SLF001
      gen, page_size=16)
  out = pallas_fa.decode_attention(
      jnp.asarray(q, jnp.bfloat16), lengths=jnp.asarray(lengths),
      implementation="triton",
      **{name: None if x is None else jnp.asarray(x)
         for name, x in args.items()})
  ref32 = quantized._oracle(q, k_deq, v_deq, lengths, q_pos)[0]  # noqa: SLF001
  same = pallas_fa.flash_attention(
      jnp.asarray(q, jnp.bfloat16), jnp.asarray(k_deq, jnp.bfloat16),
      jnp.asarray(v_deq, jnp.bfloat16),
      key_value_seq_lengths=jnp.asarray(lengths),
      query_positions=jnp.asarray(q_pos), is_causal=True,
      implementation="xla")
  assert out.dtype == jnp.bfloat16
  assert_close("out", out, jnp.asarray(ref32, jnp.float32), same,
               jnp.bfloat16)
