"""Attention sinks: every implementation against the dense sink column, and
the edge cases of `online_softmax.add_sink`.

The oracle is `pallas_fa.testing.reference`, which appends the sink to the
materialised logits and drops it after the softmax
(`pallas_fa.reference.attention`); every implementation, `xla` included,
gets its sinks from `vjp.attention` instead, so the two are independent.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import DTYPES
from attention_testing import Case
from attention_testing import assert_close
from attention_testing import check_against_reference
from attention_testing import flash
from attention_testing import grad_names
from attention_testing import make_inputs
from attention_testing import reference_fn
from attention_testing import rng
from attention_testing import run
from conftest import IMPLEMENTATIONS
from conftest import block_sizes_for

import pallas_fa
from pallas_fa import api
from pallas_fa import testing

# Two cases combine the features that change which keys a row sees or its
# logits, on GQA problems with T != S over ragged tiles: causal + window +
# padding + segments + soft cap (rows with no visible key included), and a
# full bias + a broadcast mask + bottom-right positions. Dropout and
# Hv != H have a test of their own.
CASES = [
    Case(b=2, t=45, s=71, n=4, k=2, h=16, causal=True, window=(20, None),
         lengths=True, segments=True, soft_cap=5.0, sinks=True),
    Case(b=1, t=33, s=50, n=8, k=2, h=32, causal=True, positions=True,
         bias="full", mask="broadcast", sinks=True),
]
_FAST = ("xla", "chunked")


def _interpreted(implementation) -> bool:
  return implementation not in _FAST and api.platform() == "cpu"


def _params(with_cases: bool):
  """(implementation[, case, dtype]) parameters: on CPU the interpreted
  backends run the float32 combined-mask case in the quick suite and the
  rest as slow tests (compiled on their own hardware, every one is quick)."""
  for name in IMPLEMENTATIONS:
    if not with_cases:
      yield pytest.param(name, marks=(
          [pytest.mark.slow] if _interpreted(name) else []))
      continue
    for case in CASES:
      for dtype in ("float32", "bfloat16") if case is CASES[0] else (
          "float32",):
        heavy = _interpreted(name) and (
            case is not CASES[0] or dtype != "float32")
        yield pytest.param(
            name, case, dtype, id=f"{name}-{case}-{dtype}",
            marks=[pytest.mark.slow] if heavy else [])


def _fn(implementation):
  return flash(implementation, block_sizes_for(implementation))


def _require(implementation, dtype):
  if dtype not in api.get_backend(implementation).dtypes:
    pytest.skip(f"{implementation} does not compute in "
                f"{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("implementation, case, dtype", list(_params(True)))
def test_matches_the_sink_column_reference(implementation, case, dtype):
  """out, lse, dq, dk, dv, dbias and dsinks against the dense reference
  (the FlashAttention rule in bfloat16: the sink rescales an output
  already rounded to bfloat16, and must still pass it)."""
  _require(implementation, DTYPES[dtype])
  check_against_reference(_fn(implementation), case, DTYPES[dtype],
                          rng(implementation, str(case), dtype, "sinks"))


@pytest.mark.parametrize("implementation", list(_params(False)))
def test_dropout_and_value_head_dim(implementation):
  """Dropout never drops the sink and draws the mask it draws without
  sinks (the reference drops the sink column before applying it); the
  value head dim differs from the query's."""
  _require(implementation, jnp.float32)
  backend = api.get_backend(implementation)
  if not (backend.dropout and backend.value_head_dim):
    pytest.skip(f"{implementation} lacks dropout or Hv != H")
  case = Case(b=2, t=37, s=45, n=4, k=2, h=16, causal=True, lengths=True,
              sinks=True)
  gen = rng(implementation, "sinks-dropout")
  q, k, _, kw = make_inputs(case, jnp.float32, gen)
  v = testing.normal(gen, (case.b, case.s, case.k, 24))
  kw.update(dropout_rate=0.3, dropout_rng=jax.random.key(gen.integers(99)))
  dout = testing.normal(gen, q.shape[:-1] + (24,))
  dlse = testing.normal(gen, q.shape[:-1])
  got = run(_fn(implementation), q, k, v, kw, dout, dlse)
  want = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  for name, x, r in zip(["out", "lse", *grad_names(kw)],
                        [got[0], got[1], *got[2]],
                        [want[0], want[1], *want[2]], strict=True):
    assert_close(name, x, r)


def _chunked(**kw):
  return functools.partial(
      pallas_fa.flash_attention, implementation="chunked",
      block_sizes=block_sizes_for("chunked"), return_residual=True, **kw)


def test_very_negative_sinks_equal_no_sinks_bitwise():
  case = CASES[0]
  gen = rng("sinks", "-1e30")
  q, k, v, kw = make_inputs(case, jnp.float32, gen)
  dout = testing.normal(gen, q.shape)
  dlse = testing.normal(gen, q.shape[:-1])
  del kw["sinks"]
  plain = run(_chunked(), q, k, v, kw, dout, dlse)
  kw["sinks"] = jnp.full((case.n,), -1e30)
  sunk = run(_chunked(), q, k, v, kw, dout, dlse)
  for name, a, b in zip(["out", "lse", "dq", "dk", "dv"],
                        [plain[0], plain[1], *plain[2]],
                        [sunk[0], sunk[1], *sunk[2][:3]]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), name)
  np.testing.assert_array_equal(np.asarray(sunk[2][3]), 0.0)


@pytest.mark.parametrize("implementation", _FAST)
def test_huge_sinks_give_zero_rows_without_overflow(implementation):
  """A sink of +80 takes (nearly) all of every row: out ~ 0, lse ~ 80,
  nothing NaN or inf, and the reference agrees."""
  case = Case(b=2, t=20, s=30, n=2, k=1, h=16, causal=True, lengths=True)
  gen = rng("sinks", "+80", implementation)
  q, k, v, kw = make_inputs(case, jnp.float32, gen)
  kw["sinks"] = jnp.full((case.n,), 80.0)
  dout = testing.normal(gen, q.shape)
  dlse = testing.normal(gen, q.shape[:-1])
  out, lse, grads = run(_fn(implementation), q, k, v, kw, dout, dlse)
  for x in (out, *grads):
    assert np.all(np.isfinite(np.asarray(x)))
  assert np.abs(np.asarray(out)).max() < 1e-25
  seen = np.isfinite(np.asarray(lse))
  np.testing.assert_allclose(np.asarray(lse)[seen], 80.0, rtol=1e-6)
  ref = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  for name, x, r in zip(["out", "lse", *grad_names(kw)],
                        [out, lse, *grads], [ref[0], ref[1], *ref[2]]):
    assert_close(name, x, r)


@pytest.mark.parametrize("implementation", _FAST)
def test_fully_masked_rows(implementation):
  """A row with no visible key: out 0, lse -inf, its sink gets gradient 0
  (dsinks is that of the other rows alone), nothing NaN."""
  case = Case(b=1, t=24, s=30, n=2, k=1, h=16)
  gen = rng("sinks", "fully-masked", implementation)
  q, k, v, _ = make_inputs(case, jnp.float32, gen)
  seg_q = jnp.where(jnp.arange(case.t) < 10, 5, 1)[None]  # 5: no keys
  seg_kv = jnp.ones((1, case.s), jnp.int32)
  kw = {"segment_ids": pallas_fa.SegmentIds(q=seg_q, kv=seg_kv),
        "sinks": testing.normal(gen, (case.n,)) + 3.0}
  dout = testing.normal(gen, q.shape)
  dlse = testing.normal(gen, q.shape[:-1])
  out, lse, (dq, dk, dv, dsinks) = run(
      _fn(implementation), q, k, v, kw, dout, dlse)
  assert np.all(np.asarray(out[:, :10]) == 0)
  assert np.all(np.isneginf(np.asarray(lse[:, :10])))
  assert np.all(np.asarray(dq[:, :10]) == 0)
  # Only the seen rows' cotangents reach dsinks.
  cut = lambda x: x.at[:, :10].set(0.0)
  _, _, (*_, dsinks_seen) = run(
      _fn(implementation), q, k, v, kw, cut(dout), cut(dlse))
  np.testing.assert_allclose(dsinks, dsinks_seen, rtol=1e-6, atol=1e-7)
  ref = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  for name, x, r in zip(["out", "lse", "dq", "dk", "dv", "dsinks"],
                        [out, lse, dq, dk, dv, dsinks],
                        [ref[0], ref[1], *ref[2]], strict=True):
    assert_close(name, x, r)


def test_dropout_mask_is_the_one_without_sinks():
  """With dropout, out(sinks) = out(no sinks) * exp(lse0 - lse): the same
  keys are dropped, and the sink only rescales the row."""
  case = Case(b=2, t=21, s=33, n=4, k=2, h=8, causal=True, sinks=True)
  q, k, v, kw = make_inputs(case, jnp.float32, rng("sinks", "same-mask"))
  kw.update(dropout_rate=0.4, dropout_rng=3)
  out, lse = _chunked(**kw)(q, k, v)
  out0, lse0 = _chunked(**{a: x for a, x in kw.items() if a != "sinks"})(
      q, k, v)
  np.testing.assert_allclose(
      out, out0 * jnp.exp(lse0 - lse)[..., None], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      lse, jnp.logaddexp(lse0, jnp.broadcast_to(kw["sinks"], lse0.shape)),
      rtol=1e-6)


@pytest.mark.parametrize("implementation", _FAST)
def test_grad_through_vmap_and_remat(implementation):
  """jax.grad in (q, sinks) under vmap (sinks batched too) and remat
  equals the loop of plain gradients and the reference's."""
  case = Case(b=2, t=19, s=26, n=4, k=2, h=8, causal=True, lengths=True)
  gen = rng("sinks", "vmap-remat", implementation)
  q, k, v, kw = make_inputs(case, jnp.float32, gen)
  extra = 3
  qs = jnp.stack([q * (i + 1) for i in range(extra)])
  sinks = jnp.stack([testing.normal(gen, (case.n,)) + 2.0
                     for _ in range(extra)])

  def loss(fn, q, k, v, sinks):
    out = fn(q, k, v, sinks=sinks, **kw)[0]
    return jnp.sum(jnp.sin(out))

  ours = functools.partial(loss, _fn(implementation))
  grad = jax.grad(jax.checkpoint(ours), argnums=(0, 3))
  batched = jax.jit(jax.vmap(grad, in_axes=(0, None, None, 0)))(
      qs, k, v, sinks)
  theirs = jax.grad(functools.partial(loss, reference_fn(jnp.float32)),
                    argnums=(0, 3))
  for i in range(extra):
    looped = jax.grad(ours, argnums=(0, 3))(qs[i], k, v, sinks[i])
    want = theirs(qs[i], k, v, sinks[i])
    for name, a, b, r in zip(["dq", "dsinks"], [x[i] for x in batched],
                             looped, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
      assert_close(name, a, r)


def test_one_shared_sink_and_float64():
  """sinks [1] is shared by every head (its gradient summed); float64
  inputs compute with float64 sinks."""
  case = Case(b=1, t=9, s=14, n=4, k=2, h=8, causal=True)
  q, k, v, kw = make_inputs(case, jnp.float32, rng("sinks", "shared"))
  shared = jnp.array([1.5], jnp.bfloat16)

  def loss(sinks, n):
    out, lse = _chunked(**kw)(q, k, v, sinks=jnp.broadcast_to(sinks, (n,)))
    return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

  g1 = jax.grad(loss)(shared, 1)
  g4 = jax.grad(loss)(shared.astype(jnp.float32), case.n)
  assert g1.dtype == jnp.bfloat16 and g1.shape == (1,)
  np.testing.assert_allclose(np.float32(g1[0]), g4[0], rtol=1e-2)
  with jax.enable_x64(True):
    q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
    sinks = jnp.arange(case.n, dtype=jnp.float32)
    got = _chunked(sinks=sinks, **kw)(q64, k64, v64)
    want = testing.reference(q64, k64, v64, sinks=sinks,
                             compute_dtype=jnp.float64, **kw)
    assert got[0].dtype == jnp.float64 and got[1].dtype == jnp.float64
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sinks, error, needle", [
    (jnp.zeros((3,)), ValueError, "sinks must have shape [N]=(4,)"),
    (jnp.zeros((1, 4)), ValueError, "sinks.shape=(1, 4)"),
    (jnp.zeros(()), ValueError, "sinks.shape=()"),
    (jnp.zeros((4,), jnp.int32), TypeError, "sinks must be a float array"),
])
def test_bad_sinks_are_refused_by_name(sinks, error, needle):
  q = jnp.ones((1, 5, 4, 8))
  with pytest.raises(error, match=re.escape(needle)):
    pallas_fa.flash_attention(q, q[:, :, :2], q[:, :, :2], sinks=sinks)


@pytest.mark.parametrize("implementation", _FAST)
def test_forward_mode_through_sinks(implementation):
  """Hessian-vector products (jvp of grad) in (q, sinks) on xla and
  chunked, and the jvp of the attention itself on xla, equal the dense
  sink column's, rows with no visible key included (their tangents 0, not
  NaN): the sink adds no forward-mode limit of its own."""
  case = Case(b=1, t=24, s=30, n=2, k=1, h=16, causal=True)
  gen = rng("sinks", "forward-mode", implementation)
  q, k, v, _ = make_inputs(case, jnp.float32, gen)
  seg_q = jnp.where(jnp.arange(case.t) < 6, 5, 1)[None]  # 5: no keys
  kw = {"segment_ids": pallas_fa.SegmentIds(
            q=seg_q, kv=jnp.ones((1, case.s), jnp.int32)),
        "is_causal": True}
  sinks = testing.normal(gen, (case.n,)) + 1.0
  tq, tk, tv = (testing.normal(gen, x.shape) for x in (q, k, v))
  tsinks = testing.normal(gen, sinks.shape)
  weights = testing.normal(gen, q.shape)

  def loss(fn, q, sinks):
    out, lse = fn(q, k, v, sinks=sinks, **kw)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(jnp.sin(out) * weights) + jnp.sum(jnp.sin(lse))

  def hvp(fn):
    grad = jax.grad(functools.partial(loss, fn), argnums=(0, 1))
    return jax.jvp(grad, (q, sinks), (tq, tsinks))[1]

  ours = _fn(implementation)
  want = reference_fn(jnp.float32)
  for name, a, b in zip(["hvp dq", "hvp dsinks"], hvp(ours), hvp(want)):
    assert np.all(np.isfinite(np.asarray(a))), name
    assert_close(name, a, b)
  if implementation == "xla":
    def attend(fn):
      return jax.jvp(lambda q, k, v, s: fn(q, k, v, sinks=s, **kw),
                     (q, k, v, sinks), (tq, tk, tv, tsinks))[1]
    (dout, dlse), (rout, rlse) = attend(ours), attend(want)
    assert np.all(np.asarray(dout[:, :6]) == 0)
    assert np.all(np.asarray(dlse[:, :6]) == 0)
    assert_close("jvp out", dout, rout)
    seen = np.isfinite(np.asarray(ours(q, k, v, sinks=sinks, **kw)[1]))
    assert_close("jvp lse", np.asarray(dlse)[seen], np.asarray(rlse)[seen])
