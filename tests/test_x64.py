"""Every implementation with `jax_enable_x64` on.

Under x64 a Python int is int64 and a Python float float64, and
`jnp.arange` and friends default to 64 bits. The kernels' index math is
int32, and lax's integer operations (rem, div, dynamic_slice starts) take
operands of one dtype, so a bare Python int mixed into them fails, or
drags 64-bit values into a kernel that its compiler may not take. Results
keep the inputs' dtype, never float64.
"""

import contextlib
import dataclasses
import functools

import attention_testing
import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import Case
from attention_testing import check_against_reference
from attention_testing import flash
from attention_testing import rng

import pallas_fa
from pallas_fa import api
from pallas_fa import gpu_target
from pallas_fa import testing
from pallas_fa.mosaic_gpu import kernel as mosaic_gpu_kernel

_CASES = [
    # Ragged lengths, GQA, causal, soft cap: masked, unmasked and skipped
    # tiles, and the balanced causal schedule of the GPU kernels.
    Case(b=2, t=40, s=72, n=4, k=2, h=32, causal=True, lengths=True,
         soft_cap=5.0),
    # Window, segments and a per-head bias, whose gradient is sliced at
    # the tiles' starts.
    Case(b=1, t=48, s=64, n=2, k=1, h=32, window=(24, 8), segments=True,
         bias="heads"),
]


@contextlib.contextmanager
def _enable_x64():
  """x64 on, process-wide (interpreted kernels call back into Python on
  other threads), and restored afterwards so that no other test sees it."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


@pytest.fixture
def x64():
  with _enable_x64():
    yield


def _check_or_decline(implementation, case, gen):
  """check_against_reference on bfloat16 inputs (it asserts the results'
  dtypes too); only a bias may be declined."""
  try:
    check_against_reference(
        flash(implementation, conftest.block_sizes_for(implementation)),
        case, jnp.bfloat16, gen)
  except NotImplementedError as e:
    if not case.bias:
      raise
    pytest.skip(f"{implementation} declines a bias: {e}")


@pytest.mark.parametrize("case", _CASES, ids=str)
def test_forward_and_backward(implementation, case, x64):
  del x64  # Active for the whole test.
  _check_or_decline(implementation, case, rng("x64", implementation, case))


@pytest.mark.skipif(
    "mosaic_gpu" in conftest.IMPLEMENTATIONS
    or mosaic_gpu_kernel.interpret_params() is None
    or api.platform() != "cpu",
    reason="the parametrized test runs mosaic_gpu here, or no interpreter")
@attention_testing.gpu_jax_only
def test_mosaic_gpu_interpreted(x64):
  """The Mosaic GPU interpreter on one small case: the conformance suite
  leaves it out on a CPU (too slow for all its cases)."""
  del x64  # Active for the whole test.
  case = dataclasses.replace(_CASES[0], b=1, n=2, k=1)
  _check_or_decline("mosaic_gpu", case, rng("x64", "mosaic_gpu", case))


@pytest.mark.parametrize("implementation, fields, h, dropout, kernels", [
    ("triton", None, 64, True, 3),
    ("mosaic_gpu", {"backward": "split"}, 128, True, 3),
    # The fused backward takes dropout at H = 64 (each consumer adds its
    # own keys' dQ); at H = 128 the two consumers share dQ's columns.
    ("mosaic_gpu", {"backward": "fused"}, 64, True, 2),
    ("mosaic_gpu", {"backward": "fused"}, 128, False, 2),
], ids=["triton", "mosaic_gpu-split", "mosaic_gpu-fused-own-keys",
        "mosaic_gpu-fused-shared-columns"])
def test_gpu_kernels_lower_for_hopper(implementation, fields, h, dropout,
                                      kernels, x64):
  """Forward and backward lower for an H100 (no GPU needed): the compiler,
  not the interpreter, is what refuses a 64-bit scalar. Causal on a grid
  of one CTA per SM: the balanced schedules (`Units`)."""
  del x64  # Active for the whole test.
  case = Case(b=1, t=256, s=384, n=4, k=2, h=h, causal=True, lengths=True)
  q, k, v, kw = testing.make_inputs(
      case, jnp.bfloat16, rng("x64-lower", implementation, fields, h))
  if dropout:
    kw.update(dropout_rate=0.1, dropout_rng=jax.random.key(0))
  block_sizes = fields and pallas_fa.MosaicGpuBlockSizes(**fields)

  def loss(q, k, v):
    out = pallas_fa.flash_attention(
        q, k, v, implementation=implementation, block_sizes=block_sizes,
        **kw)
    return out.astype(jnp.float32).sum()

  with gpu_target.compile_for(gpu_target.H100):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @") == kernels


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("implementation", [
    name for name in ("chunked", "triton", "mosaic_tpu")
    if name in conftest.IMPLEMENTATIONS])
def test_decode(implementation, paged, x64):
  """decode_attention against the reference on the gathered cache."""
  del x64  # Active for the whole test.
  b, t, n, num_kv, h, s_max, page_size = 2, 2, 4, 2, 32, 64, 16
  gen = rng("x64-decode", implementation, paged)
  q = testing.normal(gen, (b, t, n, h), jnp.bfloat16)
  k = testing.normal(gen, (b, s_max, num_kv, h), jnp.bfloat16)
  v = testing.normal(gen, (b, s_max, num_kv, h), jnp.bfloat16)
  lengths = jnp.asarray(gen.integers(t, s_max + 1, b), jnp.int32)
  kw = dict(is_causal=True, local_window_size=(24, 0), logits_soft_cap=10.0)
  table, k_cache, v_cache = None, k, v
  if paged:
    table = attention_testing.page_table(gen, b, s_max // page_size)
    k_cache, v_cache = (jnp.asarray(attention_testing.paged(
        x, table, page_size, np.nan)) for x in (k, v))
  out, lse = pallas_fa.decode_attention(
      q, k_cache, v_cache, lengths, block_table=table, num_splits=2,
      implementation=implementation, return_residual=True, **kw)
  assert out.dtype == q.dtype and lse.dtype == jnp.float32

  q_pos = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
  ref = dict(key_value_seq_lengths=lengths, query_positions=q_pos, **kw)
  ref32 = testing.reference(
      *(x.astype(jnp.float32) for x in (q, k, v)), **ref)
  same = testing.reference(q, k, v, compute_dtype=jnp.bfloat16, **ref)
  testing.assert_close("out", out, ref32[0], same[0], jnp.bfloat16)
  testing.assert_close("lse", lse, ref32[1], same[1], jnp.bfloat16)


@pytest.mark.skipif(
    mosaic_gpu_kernel.interpret_params() is None
    or api.platform() != "cpu",
    reason="the Mosaic GPU interpreter runs on CPU only")
@attention_testing.gpu_jax_only
@pytest.mark.parametrize("pdl_merge", [False, True],
                         ids=["triton-merge", "pdl-merge"])
def test_mosaic_gpu_decode(x64, pdl_merge):
  """The Mosaic GPU decode kernel with x64 on: interpreted against the
  chunked path, and lowered for an H100 (its split kernel and the merge,
  the Triton one or `_pdl_merge`'s Mosaic GPU one)."""
  del x64  # Active for the whole test.
  b, t, n, num_kv, h, s_max = 2, 2, 4, 2, 64, 128
  gen = rng("x64-decode", "mosaic_gpu")
  q = testing.normal(gen, (b, t, n, h), jnp.bfloat16)
  k = testing.normal(gen, (b, s_max, num_kv, h), jnp.bfloat16)
  v = testing.normal(gen, (b, s_max, num_kv, h), jnp.bfloat16)
  lengths = jnp.asarray([s_max, 70], jnp.int32)
  kw = dict(is_causal=True, local_window_size=(24, 0), logits_soft_cap=10.0)

  def decode(implementation, q, k, v):
    extra = {"_pdl_merge": True} if (
        pdl_merge and implementation == "mosaic_gpu") else {}
    return pallas_fa.decode_attention(
        q, k, v, lengths, num_splits=2, implementation=implementation,
        **kw, **extra)

  got = decode("mosaic_gpu", q, k, v)
  want32 = decode("chunked", *(x.astype(jnp.float32) for x in (q, k, v)))
  testing.assert_close("out", got, want32, decode("chunked", q, k, v),
                       jnp.bfloat16)
  with gpu_target.compile_for(gpu_target.H100):
    text = jax.jit(functools.partial(decode, "mosaic_gpu")).trace(
        q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @") == 2


def test_merge_attention(x64):
  """Two halves of the keys merged equal attention over all of them, in
  the parts' dtype."""
  del x64  # Active for the whole test.
  q, k, v, _ = testing.make_inputs(
      Case(b=2, t=8, s=40, n=2, k=2, h=16), jnp.float32, rng("x64-merge"))
  parts = [testing.reference(q, k[:, keys], v[:, keys])
           for keys in (slice(0, 24), slice(24, None))]
  out, lse = pallas_fa.merge_attention(*zip(*parts))
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
  ref_out, ref_lse = testing.reference(q, k, v)
  testing.assert_close("out", out, ref_out)
  testing.assert_close("lse", lse, ref_lse)


def test_x64_is_restored():
  """The fixture leaves the flag as it found it."""
  before = jax.config.jax_enable_x64
  with _enable_x64():
    assert jax.config.jax_enable_x64
    assert jnp.asarray(1).dtype == np.int64
  assert jax.config.jax_enable_x64 == before


def test_traced_64_bit_lengths_past_int32_mean_every_key(x64):
  """A traced int64 length past int32 (which an eager call rejects by
  name) is clamped, not wrapped: 2**32 + 3 keys of 8 are all 8, not 3."""
  gen = np.random.default_rng(17)
  q, k, v = (jnp.asarray(gen.standard_normal((1, 8, 2, 16)), jnp.float32)
             for _ in range(3))
  call = jax.jit(lambda lengths: pallas_fa.flash_attention(
      q, k, v, key_value_seq_lengths=lengths, implementation="chunked"))
  np.testing.assert_array_equal(call(jnp.array([2**32 + 3], jnp.int64)),
                                call(jnp.array([8], jnp.int64)))
