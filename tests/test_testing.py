"""pallas_fa.testing: the error rule, FLOPs, reference, inputs and timer."""

import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from pallas_fa import testing


def _chunked_and_references(dtype, gen):
  case = testing.Case(b=1, t=40, s=40, n=2, k=1, h=16, causal=True)
  q, k, v, kw = testing.make_inputs(case, dtype, gen)
  out = pallas_fa.flash_attention(q, k, v, implementation="chunked", **kw)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref32, _ = testing.reference(*f32, **kw)
  same, _ = testing.reference(q, k, v, compute_dtype=dtype, **kw)
  return out, ref32, same


def test_rule_accepts_a_good_low_precision_result_and_rejects_a_bad_one():
  out, ref32, same = _chunked_and_references(
      jnp.bfloat16, testing.rng("rule", "bf16"))
  good = testing.compare("out", out, ref32, same)
  assert good.ok and good.same_error is not None, good
  assert good.error <= good.tolerance
  assert testing.assert_close("out", out, ref32, same) == good
  # One element off by a little more than the rule allows.
  bad = out.at[0, 3, 1, 2].add(3 * good.tolerance)
  comparison = testing.compare("out", bad, ref32, same)
  assert not comparison.ok
  with pytest.raises(testing.Mismatch, match="out disagrees .*same-dtype"):
    comparison.check()
  with pytest.raises(AssertionError):  # Mismatch is an AssertionError
    testing.assert_close("out", bad, ref32, same)


def test_rule_uses_the_float32_table():
  out, ref32, _ = _chunked_and_references(
      jnp.float32, testing.rng("rule", "f32"))
  good = testing.compare("out", out, ref32)
  assert good.ok and good.same_error is None
  scale = max(1.0, good.ref_max)
  assert good.tolerance == pytest.approx(
      testing.F32_TOLERANCES["highest"]["out"] * scale)
  assert testing.compare("dq", out, ref32).tolerance == pytest.approx(
      testing.F32_TOLERANCES["highest"]["grad"] * scale)
  loose = testing.compare("out", out, ref32, precision="default",
                          min_scale=0.0)
  assert loose.tolerance == pytest.approx(1e-2 * good.ref_max)
  assert not testing.compare("out", out * 1.001, ref32).ok
  # A float32 dtype keeps the table even when a same-dtype reference is given.
  assert testing.compare("out", out, ref32, ref32,
                         dtype=jnp.float32).same_error is None


def test_rule_checks_non_finite_values_and_shapes():
  ref = jnp.array([[0.5, -jnp.inf], [1.0, 2.0]], jnp.float32)
  assert testing.compare("lse", ref, ref).ok  # matching -inf is no error
  missing = ref.at[0, 1].set(0.0)
  assert "-inf" in testing.compare("lse", missing, ref).message()
  nan = ref.at[1, 0].set(jnp.nan)
  comparison = testing.compare("lse", nan, ref)
  assert not comparison.ok and "NaN" in comparison.message()
  with pytest.raises(ValueError, match="shapes differ"):
    testing.compare("out", ref[0], ref)


def test_flops_follow_the_flashattention_convention():
  fwd = 4 * 2 * 4 * 128 * 128 * 64  # 4 B N T S H
  assert fwd == 33_554_432
  flops = lambda **kw: testing.attention_flops(2, 4, 128, 128, 64, **kw)
  assert flops() == fwd
  assert flops(causal=True) == fwd / 2
  assert flops(mode="bwd") == 2.5 * fwd
  assert flops(mode="fwd_bwd") == 117_440_512  # 3.5x forward
  assert flops(causal=True, mode="fwd_bwd") == 58_720_256
  # Causal with T != S is not halved; Hv counts in the p.v product.
  assert testing.attention_flops(1, 1, 8, 16, 4, causal=True) == 4 * 8 * 16 * 4
  assert testing.attention_flops(1, 1, 8, 16, 4, value_head_dim=12) == (
      2 * 8 * 16 * (4 + 12))
  with pytest.raises(ValueError, match="mode"):
    flops(mode="backward")


def test_reference_keeps_the_public_batch_layout():
  gen = testing.rng("reference layout")
  q, k, v, kw = testing.make_inputs(testing.Case(b=1, t=9, s=11, h=8),
                                    jnp.float32, gen)
  out, lse = testing.reference(q, k, v, **kw)
  unbatched_out, unbatched_lse = testing.reference(q[0], k[0], v[0], **kw)
  assert out.shape == q.shape and lse.shape == q.shape[:-1]
  assert lse.dtype == jnp.float32
  np.testing.assert_array_equal(unbatched_out, out[0])
  np.testing.assert_array_equal(unbatched_lse, lse[0])
  same, _ = testing.reference(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                              v.astype(jnp.bfloat16),
                              compute_dtype=jnp.bfloat16, **kw)
  assert same.dtype == jnp.bfloat16


def test_inputs_are_fresh_random_and_reproducible():
  case = testing.Case(b=2, t=8, s=12, n=4, k=2, h=8, causal=True,
                      window=(3, 1), lengths=True, segments=True,
                      positions=True, soft_cap=5.0, bias="full", mask="full")
  q, k, v, kw = testing.make_inputs(case, jnp.bfloat16, testing.rng("a"))
  assert (q.shape, k.shape, v.shape) == ((2, 8, 4, 8), (2, 12, 2, 8),
                                         (2, 12, 2, 8))
  assert q.dtype == k.dtype == v.dtype == jnp.bfloat16
  for x in (q, k, v, kw["bias"]):
    assert np.count_nonzero(np.asarray(x, np.float32)) == x.size
  assert set(kw) == {
      "is_causal", "local_window_size", "query_seq_lengths",
      "key_value_seq_lengths", "segment_ids", "query_positions",
      "key_positions", "logits_soft_cap", "bias", "mask"}
  again = testing.make_inputs(case, jnp.bfloat16, testing.rng("a"))[0]
  other = testing.make_inputs(case, jnp.bfloat16, testing.rng("b"))[0]
  np.testing.assert_array_equal(q, again)
  assert not np.array_equal(q, other)


def test_timer_returns_positive_times():
  x = testing.normal(testing.rng("timer"), (64, 64))
  fn = jax.jit(lambda x: x @ x)
  timing = testing.time_call(fn, x, repeats=3, warmup=1, min_run_s=0.0)
  assert timing.median_s > 0 and timing.ms == timing.median_s * 1e3
  assert len(timing.times_s) == 3 and all(t > 0 for t in timing.times_s)
  assert timing.calls_per_run == 1
  # Calls shorter than min_run_s (by default 50 ms) are batched, at most
  # 100 to a run.
  batched = testing.time_call(fn, x, repeats=2, warmup=1)
  assert 1 < batched.calls_per_run <= 100


def test_interleaved_timer_times_each_call_in_turn():
  # Plain Python callables with a known floor on their time: the check is
  # of the timer's bookkeeping (the order of runs, whose time goes where),
  # not of this machine's speed, so a loaded machine cannot fail it.
  log = []

  def call(name, seconds):
    def fn(x):
      log.append(name)
      time.sleep(seconds)
      return x
    return fn

  x = np.arange(4.0)
  short, long = testing.time_calls(
      [(call("short", 0.0), (x,)), (call("long", 0.02), (x,))],
      repeats=3, warmup=1, min_run_s=0.0)
  for timing in (short, long):
    assert len(timing.times_s) == 3 and timing.calls_per_run == 1
    assert all(t > 0 for t in timing.times_s)
  # Each of the long call's runs holds its own sleep and none of the other's.
  assert min(long.times_s) >= 0.02
  # One compile-and-check call and one warmup each, then the runs in turn.
  assert log == ["short"] * 2 + ["long"] * 2 + ["short", "long"] * 3


def test_importing_it_needs_no_test_framework():
  code = ("import sys; import pallas_fa.testing; "
          "assert 'pytest' not in sys.modules, 'pytest imported'")
  subprocess.run([sys.executable, "-c", code], check=True)
