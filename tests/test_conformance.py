"""The one conformance suite, run against every registered implementation.

A backend joins by being registered in `pallas_fa.api` (and listing small
test tiles in conftest.TEST_BLOCK_SIZES). Every check compares against the
float32 materialised reference on fresh random inputs, with the
FlashAttention 2x rule for bfloat16/float16.
"""

import dataclasses
import functools

import attention_testing
import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import flagsaver
from absl.testing import parameterized
from attention_testing import DTYPES
from attention_testing import Case
from attention_testing import assert_close
from attention_testing import check_against_reference
from attention_testing import flash
from attention_testing import make_inputs
from attention_testing import named
from attention_testing import reference_fn
from attention_testing import rng
from attention_testing import run
from conftest import IMPLEMENTATIONS
from conftest import block_sizes_for

import pallas_fa
from pallas_fa import api
from pallas_fa import testing

# Shapes: T = 1, S = 1, T != S, odd lengths, head dims 1..256, GQA 1/2/4/8.
SHAPE_CASES = [
    Case(b=2, t=64, s=64, n=2, k=2, h=32),
    Case(b=1, t=1, s=37, n=2, k=1, h=16),
    Case(b=2, t=9, s=1, n=2, k=2, h=8),
    Case(b=1, t=113, s=203, n=4, k=2, h=72),
    Case(b=1, t=17, s=23, n=2, k=2, h=1),
    Case(b=1, t=40, s=40, n=8, k=1, h=64, causal=True),
    Case(b=1, t=33, s=50, n=8, k=2, h=128),
    Case(b=1, t=24, s=20, n=2, k=2, h=256),
    Case(b=1, t=50, s=50, n=4, k=4, h=8, causal=True),
]

# Features on an odd-length GQA problem (T != S, ragged tiles everywhere).
_BASE = dict(b=2, t=45, s=71, n=4, k=2, h=16)
FEATURE_CASES = [
    Case(**_BASE, causal=True),
    Case(**_BASE, window=(7, 3)),
    Case(**_BASE, causal=True, window=(9, 0)),
    Case(**_BASE, lengths=True),
    Case(**_BASE, segments=True),
    Case(**_BASE, causal=True, positions=True),
    Case(**_BASE, soft_cap=2.5),
    Case(**_BASE, bias="full"),
    Case(**_BASE, bias="heads", causal=True),
    Case(**_BASE, mask="full"),
    Case(**_BASE, mask="broadcast", lengths=True),
    Case(**_BASE, causal=True, lengths=True, segments=True, soft_cap=5.0,
         window=(20, None)),
]

# Low-precision runs: a representative subset, to stay within budget.
LOW_PRECISION_CASES = [
    SHAPE_CASES[0], SHAPE_CASES[3], SHAPE_CASES[6], FEATURE_CASES[0],
    FEATURE_CASES[3], FEATURE_CASES[6], FEATURE_CASES[7], FEATURE_CASES[-1],
]


# Interpreted Pallas backends recompile per shape; on CPU they run these
# subsets (every feature; the shapes whose tiling differs), and every case
# compiled on their own hardware.
_FAST = ("xla", "chunked")
_INTERPRETED = {
    "float32": [
        *(SHAPE_CASES[i] for i in (0, 1, 3, 7)),
        # The last case combines causal, window, lengths, segments and the
        # cap (so causal and segments need no case of their own here).
        *(FEATURE_CASES[i] for i in (5, 7, 9, 11)),
    ],
    "bfloat16": LOW_PRECISION_CASES[:1] + LOW_PRECISION_CASES[-1:],
    "float16": LOW_PRECISION_CASES[:1],
}
# mosaic_tpu's interpreter is the slowest; tests/test_mosaic_tpu.py runs
# positions, broadcast masks and bfloat16 with features over several tiles,
# so here it leaves out those cases, and float16 (which it computes in
# float32: the float32 path plus a conversion).
_MOSAIC_TPU_ELSEWHERE = {
    "float32": [FEATURE_CASES[5], FEATURE_CASES[9]],
    "bfloat16": LOW_PRECISION_CASES[-1:],
    "float16": LOW_PRECISION_CASES,
}
# float16 repeats the bfloat16 code path with another element type: every
# backend runs it on a plain case, the soft cap (whose logits float16's
# range could overflow) and the combined features.
_FLOAT16 = [LOW_PRECISION_CASES[i] for i in (0, 5, 7)]


def _interpreted_on_cpu(implementation) -> bool:
  return implementation not in _FAST and api.platform() == "cpu"


def _skip_outside_interpreted_subset(implementation, case, dtype: str):
  if not _interpreted_on_cpu(implementation):
    return
  if case not in _INTERPRETED[dtype] or (
      implementation == "mosaic_tpu"
      and case in _MOSAIC_TPU_ELSEWHERE[dtype]):
    pytest.skip("outside the interpreted subset (runs compiled on device)")


def _fn(implementation):
  return flash(implementation, block_sizes_for(implementation))


def _check_or_decline(implementation, case, dtype, gen):
  """check_against_reference; an implementation may decline some calls.

  Declining (NotImplementedError) is only acceptable for bias/mask (DESIGN:
  "where feasible") and for dtypes outside the backend's declared `dtypes`;
  any other NotImplementedError is a failure.
  """
  try:
    check_against_reference(_fn(implementation), case, dtype, gen)
  except NotImplementedError as e:
    if case.bias or case.mask:
      pytest.skip(f"{implementation} declines bias/mask: {e}")
    if dtype not in api.get_backend(implementation).dtypes:
      pytest.skip(f"{implementation} declines {jnp.dtype(dtype).name}: {e}")
    raise


def _require_float32(implementation):
  if jnp.float32 not in api.get_backend(implementation).dtypes:
    pytest.skip(f"{implementation} computes in 16-bit only")


# Mosaic TPU's interpreted float32 in the slow leg: README's run checks it
# in its feature files (sinks, flex, x64, its own).
@pytest.mark.slow_for("mosaic_tpu")
@pytest.mark.parametrize("case", SHAPE_CASES + FEATURE_CASES, ids=str)
def test_float32(implementation, case):
  _skip_outside_interpreted_subset(implementation, case, "float32")
  _check_or_decline(implementation, case, jnp.float32,
                    rng(implementation, str(case), "f32"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=str)
def test_low_precision(implementation, case, dtype):
  _skip_outside_interpreted_subset(implementation, case, dtype)
  if dtype == "float16" and case not in _FLOAT16:
    pytest.skip("float16 runs the bfloat16 code path: a subset of cases")
  _check_or_decline(implementation, case, DTYPES[dtype],
                    rng(implementation, str(case), dtype))


# Every feature the logits, masks and statistics take (the bias is float32
# whatever the inputs' dtype), for the run under strict promotion.
_STRICT_CASE = Case(**_BASE, causal=True, lengths=True, segments=True,
                    soft_cap=5.0, window=(20, None), bias="heads")


@pytest.mark.slow_for("mosaic_tpu")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_strict_promotion(implementation, strict_promotion, dtype):
  """The conformance check of every feature under strict dtype promotion
  and rank promotion "raise": no TypePromotionError, the same results."""
  del strict_promotion  # Active for the whole test.
  if _interpreted_on_cpu(implementation) and dtype != "bfloat16":
    # The kernels' dtype logic is one for 16-bit inputs and trivial for
    # float32; compiled on their hardware every dtype runs.
    pytest.skip("interpreted: bfloat16 only")
  gen = rng(implementation, "strict", dtype)
  fn = _fn(implementation)
  try:
    check_against_reference(fn, _STRICT_CASE, DTYPES[dtype], gen)
  except NotImplementedError as e:
    if DTYPES[dtype] not in api.get_backend(implementation).dtypes:
      pytest.skip(f"{implementation} declines {dtype}: {e}")
    # A backend without a bias (mosaic_gpu) runs everything else.
    check_against_reference(
        fn, dataclasses.replace(_STRICT_CASE, bias=None), DTYPES[dtype], gen)


@st.composite
def _cases(draw):
  k = draw(st.sampled_from([1, 2]))
  return Case(
      b=draw(st.integers(1, 2)),
      t=draw(st.integers(1, 70)),
      s=draw(st.integers(1, 70)),
      n=k * draw(st.sampled_from([1, 2, 4])),
      k=k,
      h=draw(st.sampled_from([4, 16, 40])),
      causal=draw(st.booleans()),
      window=draw(st.one_of(
          st.none(),
          st.tuples(st.one_of(st.none(), st.integers(0, 20)),
                    st.one_of(st.none(), st.integers(0, 20))))),
      lengths=draw(st.booleans()),
      segments=draw(st.booleans()),
      positions=draw(st.booleans()),
      soft_cap=draw(st.one_of(st.none(), st.floats(1.0, 30.0))),
      bias=draw(st.sampled_from([None, None, "full", "heads"])),
      mask=draw(st.sampled_from([None, None, "full", "broadcast"])),
      sinks=draw(st.booleans()),
      hv=draw(st.sampled_from([None, None, 8, 24])),
      score_mod=draw(st.sampled_from([None, None, None, "alibi"])),
      mask_mod=draw(st.sampled_from(
          [None, None, None, None, "chunked_causal", "streaming"])),
      dropout=draw(st.sampled_from([0.0, 0.0, 0.0, 0.25])),
  )


# What a backend may decline, dropped in this order until it runs the case
# (or declines a case without any of them: a failure).
_DECLINABLE = (dict(bias=None, mask=None), dict(score_mod=None),
               dict(mask_mod=None), dict(dropout=0.0), dict(hv=None))


@pytest.mark.slow_for("mosaic_tpu")  # its interpreter is the slowest
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_property(implementation):
  """Random shapes and feature combinations (every mask feature, the bias
  and dense mask, sinks, the soft cap, a value head dim of its own, flex
  score_mod/mask_mod, dropout) against the reference, forward and every
  gradient, in float32, or bfloat16 for a 16-bit backend; a backend that
  declines one of `_DECLINABLE`'s features runs the case without them."""
  dtypes = api.get_backend(implementation).dtypes
  dtype = jnp.float32 if jnp.float32 in dtypes else jnp.bfloat16

  def check(case):
    gen = rng(implementation, str(case), "property")
    declinable = list(_DECLINABLE)
    while True:
      try:
        return check_against_reference(_fn(implementation), case, dtype, gen)
      except NotImplementedError:
        while declinable and dataclasses.replace(
            case, **declinable[0]) == case:
          declinable.pop(0)
        if not declinable:
          raise
        case = dataclasses.replace(case, **declinable.pop(0))

  attention_testing.check_property(
      _cases(), check, 4 if implementation in _FAST else 2)


@pytest.mark.slow_for("mosaic_tpu")  # its interpreter is the slowest
def test_padding_never_leaks(implementation):
  """NaN/inf in padded q/k/v must not reach any output or gradient."""
  _require_float32(implementation)
  case = Case(b=2, t=40, s=56, n=4, k=2, h=16, causal=True)
  gen = rng(implementation, "leak")
  q, k, v, kw = make_inputs(case, jnp.float32, gen)
  q_len = jnp.array([33, 40], jnp.int32)
  kv_len = jnp.array([20, 49], jnp.int32)
  kw.update(query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
  q_pad = (jnp.arange(case.t)[None, :] >= q_len[:, None])[..., None, None]
  kv_pad = (jnp.arange(case.s)[None, :] >= kv_len[:, None])[..., None, None]
  q_bad = jnp.where(q_pad, jnp.nan, q)
  k_bad = jnp.where(kv_pad, jnp.inf, k)
  v_bad = jnp.where(kv_pad, jnp.nan, v)
  dout = jnp.asarray(gen.standard_normal(q.shape, np.float32))
  dlse = jnp.zeros(q.shape[:-1])
  fn = _fn(implementation)
  clean = named(run(fn, q, k, v, kw, dout, dlse))
  dirty = named(run(fn, q_bad, k_bad, v_bad, kw, dout, dlse))
  for name, x in dirty.items():
    # Not assert_tree_all_finite: padded rows' lse is -inf by design.
    assert not np.any(np.isnan(np.asarray(x))), f"{name} has NaN"
  chex.assert_trees_all_equal(clean, dirty)
  # Padded query rows are zero, with lse -inf.
  assert np.all(np.asarray(dirty["out"])[np.asarray(q_pad[..., 0, 0])] == 0)


@pytest.mark.slow_for("mosaic_tpu")
def test_fully_masked_rows(implementation):
  """Rows with no visible key: zeros, lse -inf, finite zero gradients."""
  _require_float32(implementation)
  case = Case(b=1, t=24, s=30, n=2, k=1, h=16)
  gen = rng(implementation, "fully-masked")
  q, k, v, _ = make_inputs(case, jnp.float32, gen)
  # Queries 0..9 are in segment 5, which has no keys.
  seg_q = jnp.where(jnp.arange(case.t) < 10, 5, 1)[None]
  seg_kv = jnp.ones((1, case.s), jnp.int32)
  kw = {"segment_ids": pallas_fa.SegmentIds(q=seg_q, kv=seg_kv)}
  dout = jnp.asarray(gen.standard_normal(q.shape, np.float32))
  dlse = jnp.asarray(gen.standard_normal(q.shape[:-1], np.float32))
  out, lse, (dq, dk, dv) = run(_fn(implementation), q, k, v, kw, dout, dlse)
  assert np.all(np.asarray(out[:, :10]) == 0)
  assert np.all(np.isneginf(np.asarray(lse[:, :10])))
  assert np.all(np.isfinite(np.asarray(lse[:, 10:])))
  assert np.all(np.asarray(dq[:, :10]) == 0)
  chex.assert_tree_all_finite((dq, dk, dv))
  ref = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  for name, x, r in zip(["out", "lse", "dq", "dk", "dv"],
                        [out, lse, dq, dk, dv], [ref[0], ref[1], *ref[2]]):
    assert_close(name, x, r)


@pytest.mark.slow_for("mosaic_tpu")  # its interpreter is the slowest
class ComposesWithTransformsTest(chex.TestCase):
  """vmap of grad of remat, with and without jit around it, and under pmap,
  equals per-example grads: every implementation's custom_vjp composes."""

  def setUp(self):
    super().setUp()
    # The test process has one device; pmap over it still traces the op in
    # a mapped axis context, which is what this checks.
    self.enter_context(flagsaver.flagsaver(
        chex_skip_pmap_variant_if_single_device=False))

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  @parameterized.named_parameters((name, name) for name in IMPLEMENTATIONS)
  def test_vmap_grad_remat(self, implementation):
    if jnp.float32 not in api.get_backend(implementation).dtypes:
      self.skipTest(f"{implementation} computes in 16-bit only")
    case = Case(b=2, t=33, s=41, n=4, k=2, h=16, causal=True)
    gen = rng(implementation, "compose")
    q, k, v, _ = make_inputs(case, jnp.float32, gen)
    extra = 3
    qs = jnp.stack([q * (i + 1) for i in range(extra)])
    fn = functools.partial(
        pallas_fa.flash_attention, is_causal=True,
        implementation=implementation,
        block_sizes=block_sizes_for(implementation))

    def loss(q, k, v):
      return jnp.sum(jnp.sin(fn(q, k, v)))

    remat = jax.checkpoint
    if implementation == "mosaic_tpu" and api.platform() != "tpu":
      # The TPU interpreter simulates memory with ordered io_callbacks,
      # which jax.checkpoint cannot partially evaluate; compiled kernels
      # have none.
      remat = lambda f: f  # noqa: E731
    vmapped = self.variant(jax.vmap(jax.grad(remat(loss)),
                                    in_axes=(0, None, None)))(qs, k, v)
    chex.assert_shape(vmapped, qs.shape)
    looped = jnp.stack([jax.grad(loss)(qs[i], k, v) for i in range(extra)])
    chex.assert_trees_all_close(vmapped, looped, atol=1e-5, rtol=1e-5)
    for i in range(extra):
      ref = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(
          pallas_fa.flash_attention(q, k, v, is_causal=True,
                                    implementation="xla"))))(qs[i], k, v)
      assert_close("dq", vmapped[i], ref)


@pytest.mark.slow_for("mosaic_tpu")
def test_deterministic(implementation):
  case = Case(b=1, t=50, s=64, n=4, k=1, h=32, causal=True, segments=True)
  gen = rng(implementation, "determinism")
  q, k, v, kw = make_inputs(case, jnp.bfloat16, gen)
  # The forward is always reproducible; the backward where asked for (the
  # default on every backend but mosaic_gpu, tests/test_determinism.py).
  kw["deterministic_backward"] = True
  dout = jnp.asarray(gen.standard_normal(q.shape, np.float32))
  dlse = jnp.zeros(q.shape[:-1])
  a = run(_fn(implementation), q, k, v, kw, dout, dlse)
  b = run(_fn(implementation), q, k, v, kw, dout, dlse)
  chex.assert_trees_all_equal(named(a), named(b))


@pytest.mark.slow_for("mosaic_tpu")
def test_unbatched_and_residual(implementation):
  _require_float32(implementation)
  case = Case(b=1, t=21, s=30, n=4, k=2, h=8, causal=True)
  gen = rng(implementation, "unbatched")
  q, k, v, _ = make_inputs(case, jnp.float32, gen)
  fn = functools.partial(
      pallas_fa.flash_attention, implementation=implementation,
      block_sizes=block_sizes_for(implementation), is_causal=True)
  out, lse = fn(q[0], k[0], v[0], return_residual=True)
  chex.assert_shape(out, q.shape[1:])
  chex.assert_shape(lse, q.shape[1:-1])
  out_b, lse_b = fn(q, k, v, return_residual=True)
  chex.assert_trees_all_close((out, lse), (out_b[0], lse_b[0]), atol=1e-6)
  # A custom scale means what it means in jax.nn.
  scaled = fn(q, k, v, scale=0.3)
  expect = jax.nn.dot_product_attention(q, k, v, scale=0.3, is_causal=True)
  assert_close("out", scaled, expect)
  # Unbatched calls take jax.nn's forms for their one row: lengths [1],
  # a rank-4 bias or mask with a leading 1.
  nn_args = dict(
      bias=jnp.asarray(gen.standard_normal((1, 1, 21, 30)), jnp.float32),
      # Every row keeps its diagonal key: a row that saw none would be
      # zeros here, the mean of V in jax.nn.
      mask=jnp.asarray((gen.random((1, 4, 21, 30)) > 0.3) | np.eye(21, 30,
                                                                  dtype=bool)),
      query_seq_lengths=jnp.array([17], jnp.int32),
      key_value_seq_lengths=jnp.array([26], jnp.int32))
  got = fn(q[0], k[0], v[0], **nn_args)
  expect = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True,
                                        **nn_args)
  assert_close("out", got[:17], expect[:17])


@pytest.mark.parametrize("b, t, s", [(2, 0, 37), (2, 21, 0), (0, 21, 37)],
                         ids=["T=0", "S=0", "B=0"])
def test_empty_calls(implementation, b, t, s):
  """No queries or no batch rows: the empty output, as jax.nn gives. No
  keys: every row is fully masked, so zeros with lse -inf. Gradients are
  zero (dbias too), never an error."""
  gen = rng(implementation, "empty", b, t, s)
  n, kh, h = 4, 2, 8
  normal = lambda *shape: jnp.asarray(  # noqa: E731
      gen.standard_normal(shape), jnp.float32)
  q, k, v = normal(b, t, n, h), normal(b, s, kh, h), normal(b, s, kh, h)
  kw = dict(bias=normal(b, n, t, s), is_causal=True,
            key_value_seq_lengths=jnp.full((b,), s, jnp.int32),
            segment_ids=pallas_fa.SegmentIds(q=jnp.zeros((b, t), jnp.int32),
                                             kv=jnp.zeros((b, s), jnp.int32)))
  results = named(run(_fn(implementation), q, k, v, kw, normal(b, t, n, h),
                      normal(b, t, n)))
  chex.assert_shape(results["out"], q.shape)
  chex.assert_type(results["out"], q.dtype)
  chex.assert_shape(results["lse"], q.shape[:-1])
  chex.assert_type(results["lse"], jnp.float32)
  want = {"out": jnp.zeros(q.shape), "lse": jnp.full(q.shape[:-1], -jnp.inf),
          "dq": jnp.zeros(q.shape), "dk": jnp.zeros(k.shape),
          "dv": jnp.zeros(v.shape), "dbias": jnp.zeros(kw["bias"].shape)}
  chex.assert_trees_all_equal(results, want)


# The batch dims are folded in `api`, before any backend: two suffice.
@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_any_number_of_batch_dims(implementation):
  """[B1, B2, T, N, H] with per-row lengths, positions, segments and a bias
  broadcast over B2 equals the call on the folded [B1 * B2, ...] batch."""
  b1, b2, t, s, n, kh, h = 2, 3, 13, 19, 4, 2, 8
  gen = rng(implementation, "batch-dims")
  normal = lambda *shape: jnp.asarray(gen.standard_normal(shape), jnp.float32)
  q, k, v = normal(b1, b2, t, n, h), normal(b1, b2, s, kh, h), normal(
      b1, b2, s, kh, h)
  bias = normal(b1, 1, n, t, s)
  kv_len = jnp.asarray(gen.integers(1, s + 1, (b1, b2)), jnp.int32)
  seg = pallas_fa.SegmentIds(
      q=jnp.asarray(gen.integers(0, 2, (b1, b2, t)), jnp.int32),
      kv=jnp.asarray(gen.integers(0, 2, (b1, b2, s)), jnp.int32))
  fn = functools.partial(
      pallas_fa.flash_attention, implementation=implementation,
      block_sizes=block_sizes_for(implementation), is_causal=True,
      return_residual=True)

  def loss(q, k, v, bias, fold):
    if fold:
      flat = lambda x: x.reshape((-1,) + x.shape[2:])
      out, lse = fn(flat(q), flat(k), flat(v), flat(
          jnp.broadcast_to(bias, (b1, b2, n, t, s))),
          key_value_seq_lengths=kv_len.reshape(-1),
          segment_ids=jax.tree.map(flat, seg))
      out, lse = out.reshape(q.shape), lse.reshape(q.shape[:-1])
    else:
      out, lse = fn(q, k, v, bias, key_value_seq_lengths=kv_len,
                    segment_ids=seg)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return (out * q).sum() + lse.sum(), (out, lse)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True),
                 static_argnums=4)
  (g_ours, (out, lse)), (g_ref, (out_ref, lse_ref)) = (
      grad(q, k, v, bias, False), grad(q, k, v, bias, True))
  chex.assert_shape(out, q.shape)
  chex.assert_shape(lse, q.shape[:-1])
  chex.assert_trees_all_close((out, lse), (out_ref, lse_ref), rtol=1e-5,
                              atol=1e-5)
  chex.assert_trees_all_close(g_ours, g_ref, rtol=1e-4, atol=1e-5)


def test_batch_dims_must_match():
  q = jnp.ones((2, 3, 4, 2, 8))
  k = jnp.ones((3, 2, 5, 2, 8))
  with pytest.raises(ValueError, match="batch dims"):
    pallas_fa.flash_attention(q, k, k)
  with pytest.raises(ValueError, match="query_seq_lengths"):
    pallas_fa.flash_attention(q, q, q, query_seq_lengths=jnp.ones(6, int))


# (padded, dtype) of the shared-K/V checks; interpreted Pallas backends run
# the first (their K/V is broadcast before the kernel in `api` either way).
_SHARED_KV = [(True, "float32"), (False, "float32"), (True, "bfloat16")]


@pytest.mark.parametrize("padded, dtype", _SHARED_KV,
                         ids=[f"padded={p}-{d}" for p, d in _SHARED_KV])
def test_key_value_batch_one_is_shared(implementation, padded, dtype):
  """K/V with batch 1 against a query batch of 3 (PyTorch FlexAttention
  broadcasts so): out, lse and every gradient equal the reference on K/V
  broadcast explicitly, whose dK/dV are summed over the batch. Lengths and
  segment ids stay per query row; keys padded in every row hold NaN, which
  must not leak."""
  if (padded, dtype) != _SHARED_KV[0] and _interpreted_on_cpu(
      implementation):
    pytest.skip("interpreted: one case (K/V is broadcast before the kernel)")
  dtype = getattr(jnp, dtype)
  if dtype not in api.get_backend(implementation).dtypes:
    pytest.skip(f"{implementation} declines {jnp.dtype(dtype).name}")
  case = Case(b=3, t=21, s=29, n=4, k=2, h=16, causal=True, lengths=padded,
              segments=padded)
  gen = rng(implementation, "shared-kv", padded, dtype)
  q, k, v, kw = make_inputs(case, dtype, gen)
  k, v = k[:1], v[:1]
  if padded:
    # Per query row; keys 25.. are padding in every row.
    kv_len = jnp.asarray(gen.permutation([25, 13, 19]), jnp.int32)
    kw["key_value_seq_lengths"] = kv_len
    poison = jnp.arange(case.s)[None, :, None, None] >= kv_len.max()
    k, v = (jnp.where(poison, jnp.nan, x).astype(dtype) for x in (k, v))
  dout = testing.normal(gen, q.shape)
  dlse = testing.normal(gen, q.shape[:-1])
  got = named(run(_fn(implementation), q, k, v, kw, dout, dlse))
  chex.assert_shape([got["dk"], got["dv"]], k.shape)

  def reference(compute_dtype):
    wide = lambda x: jnp.broadcast_to(x, (case.b,) + x.shape[1:])
    ref = named(run(reference_fn(compute_dtype), q, wide(k), wide(v), kw,
                    dout, dlse))
    return {**ref, "dk": ref["dk"].sum(0, keepdims=True, dtype=jnp.float32),
            "dv": ref["dv"].sum(0, keepdims=True, dtype=jnp.float32)}

  want = reference(jnp.float32)
  same = reference(dtype) if dtype != jnp.float32 else {}
  for name, x in got.items():
    assert not jnp.isnan(x).any(), name
    assert_close(name, x, want[name], same.get(name), dtype)


def test_key_value_batch_dims_broadcast_separately():
  """Any size-1 batch dim of key or value broadcasts on its own ([2, 1]
  against the query's [2, 3], or only one of the two), with the gradients
  summed over the rows each was broadcast to."""
  gen = rng("shared-kv-dims")
  b1, b2, t, s, n, kh, h = 2, 3, 7, 11, 4, 2, 8
  normal = lambda *shape: jnp.asarray(gen.standard_normal(shape), jnp.float32)
  q = normal(b1, b2, t, n, h)
  wide = lambda x: jnp.broadcast_to(x, (b1, b2) + x.shape[2:])
  for k_rows, v_rows in (((b1, 1), (b1, 1)), ((1, 1), (b1, b2)),
                         ((b1, b2), (1, b2))):
    k, v = normal(*k_rows, s, kh, h), normal(*v_rows, s, kh, h)

    def loss(q, k, v, explicit):
      if explicit:
        k, v = wide(k), wide(v)
      return (pallas_fa.flash_attention(q, k, v, is_causal=True) * q).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, False)
    chex.assert_trees_all_equal_shapes(grads, (q, k, v))
    chex.assert_trees_all_close(
        grads, jax.grad(loss, argnums=(0, 1, 2))(q, k, v, True),
        rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "chunked", None])
def test_float64(implementation):
  """With x64 enabled, float64 runs in float64 (the two float64
  implementations agree to ~1e-12); the Pallas backends decline it by
  name."""
  case = Case(b=2, t=19, s=23, n=4, k=2, h=8, causal=True, window=(7, 3),
              segments=True, lengths=True, soft_cap=5.0)
  gen = rng("float64", str(implementation))
  with jax.enable_x64(True):
    q, k, v, kw = make_inputs(case, jnp.float64, gen)
    assert q.dtype == jnp.float64
    fn = functools.partial(
        pallas_fa.flash_attention, implementation=implementation,
        block_sizes=block_sizes_for(implementation) if implementation
        else None, return_residual=True, **kw)
    # The oracle is the other float64 implementation: materialised vs
    # blockwise, two independent computations.
    other = "chunked" if implementation == "xla" else "xla"
    ref = functools.partial(
        pallas_fa.flash_attention, implementation=other,
        block_sizes=block_sizes_for(other), return_residual=True, **kw)

    def loss(fn, q, k, v):
      out, lse = fn(q, k, v)
      return (out * q).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    (out, lse), grads = fn(q, k, v), jax.grad(
        functools.partial(loss, fn), argnums=(0, 1, 2))(q, k, v)
    chex.assert_type([out, lse, *grads], jnp.float64)
    (out_r, lse_r), grads_r = ref(q, k, v), jax.grad(
        functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close((out, lse), (out_r, lse_r), rtol=1e-10,
                                atol=1e-12)
    chex.assert_trees_all_close(grads, grads_r, rtol=1e-9, atol=1e-11)
    # float32 could not get this close: the computation really is float64.
    out32 = pallas_fa.flash_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        implementation="xla", **kw)
    assert np.abs(np.asarray(out32, np.float64) - out_r).max() > 1e-10
    for name in ("triton", "mosaic_tpu"):
      with pytest.raises(NotImplementedError, match="float64"):
        pallas_fa.flash_attention(q, k, v, implementation=name, **kw)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_runs_under_jax_enable_checks(implementation):
  """JAX's internal invariant checks (as in JAX's own test harness) pass on
  a call that takes every masking path, forward and backward."""
  case = Case(b=2, t=11, s=17, n=4, k=2, h=8, causal=True, window=(5, 2),
              segments=True, lengths=True, soft_cap=5.0, bias="heads")
  gen = rng("enable-checks", implementation)
  with jax.enable_checks(True):
    check_against_reference(
        _fn(implementation), case, jnp.float32, gen)


@pytest.mark.parametrize("hv", [24, 8], ids=["hv>h", "hv<h"])
def test_value_head_dim(implementation, hv):
  """Hv != H equals the Hv == H computation with zero-padded operands: V
  padded to H (Hv < H), or Q and K padded to Hv at the same scale (Hv > H);
  outputs and gradients are compared."""
  _require_float32(implementation)
  if _interpreted_on_cpu(implementation):
    # tests/test_triton.py and tests/test_mosaic_tpu.py check Hv != H
    # against the reference over several tiles, with dropout.
    pytest.skip("interpreted: the backend's own Hv tests cover it")
  b, t, s, n, kh, h = 2, 13, 21, 4, 2, 16
  gen = rng(implementation, "value-head-dim", hv)
  normal = lambda *shape: jnp.asarray(gen.standard_normal(shape), jnp.float32)
  q, k, v = normal(b, t, n, h), normal(b, s, kh, h), normal(b, s, kh, hv)
  kw = dict(is_causal=True, scale=h ** -0.5, local_window_size=(9, 0),
            key_value_seq_lengths=jnp.asarray([s, 11]))
  fn = functools.partial(
      pallas_fa.flash_attention, implementation=implementation,
      block_sizes=block_sizes_for(implementation), return_residual=True, **kw)
  if not api.get_backend(implementation).value_head_dim:
    with pytest.raises(NotImplementedError, match="value head dim"):
      fn(q, k, v)
    return
  dout = normal(b, t, n, hv)
  width = max(h, hv)
  pad = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, width - x.shape[-1]),))

  def loss(q, k, v, padded):
    if padded:
      out, lse = fn(pad(q), pad(k), pad(v))
      out = out[..., :hv]
    else:
      out, lse = fn(q, k, v)
    return (out * dout).sum() + jnp.where(
        jnp.isfinite(lse), lse, 0.0).sum(), out

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True),
                 static_argnums=3)
  (grads, out), (grads_ref, out_ref) = grad(q, k, v, False), grad(
      q, k, v, True)
  chex.assert_shape(out, (b, t, n, hv))
  chex.assert_trees_all_close(out, out_ref, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(grads, grads_ref, rtol=1e-4, atol=1e-5)


def test_automatic_choice_runs_value_head_dim():
  q = jnp.ones((1, 4, 2, 8))
  v = jnp.arange(5 * 2 * 12, dtype=jnp.float32).reshape(1, 5, 2, 12)
  out = pallas_fa.flash_attention(q, q[:, :1].repeat(5, axis=1), v)
  np.testing.assert_allclose(out, jnp.broadcast_to(v.mean(1, keepdims=True),
                                                   (1, 4, 2, 12)), rtol=1e-6)
