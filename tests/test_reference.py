"""The reference itself: against jax.nn and against float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import Case
from attention_testing import assert_close
from attention_testing import make_inputs
from attention_testing import reference_fn
from attention_testing import rng
from attention_testing import run

# Arguments shared with jax.nn.dot_product_attention, with no fully-masked
# rows (where the two differ by design: zeros here, mean of V there).
SHARED_CASES = [
    Case(b=2, t=37, s=37, n=4, k=2, h=16, causal=True),
    Case(b=1, t=29, s=41, n=2, k=1, h=8, window=(5, 3)),
    Case(b=2, t=33, s=33, n=4, k=4, h=16, bias="full"),
    Case(b=2, t=33, s=33, n=4, k=2, h=16, bias="heads", causal=True),
]


@pytest.mark.parametrize("case", SHARED_CASES, ids=str)
def test_agrees_with_jax_nn(case):
  gen = rng("jax.nn", str(case))
  q, k, v, kw = make_inputs(case, jnp.float32, gen)
  dout = jnp.asarray(gen.standard_normal(q.shape, np.float32))
  dlse = jnp.zeros(q.shape[:-1])

  def nn(q, k, v, **kw):
    return jax.nn.dot_product_attention(
        q, k, v, implementation="xla", return_residual=True, **kw)

  ours = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  theirs = run(nn, q, k, v, kw, dout, dlse)
  for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dbias"],
                        [ours[0], ours[1], *ours[2]],
                        [theirs[0], theirs[1], *theirs[2]]):
    assert_close(name, a, b)


def test_agrees_with_jax_nn_on_padding():
  """Padding lengths: equal wherever a row has a visible key."""
  case = Case(b=2, t=31, s=40, n=2, k=2, h=16, causal=True)
  gen = rng("jax.nn", "padding")
  q, k, v, kw = make_inputs(case, jnp.float32, gen)
  q_len = jnp.array([31, 17], jnp.int32)
  kv_len = jnp.array([25, 40], jnp.int32)
  ours = reference_fn(jnp.float32)(
      q, k, v, is_causal=True, query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len)[0]
  theirs = jax.nn.dot_product_attention(
      q, k, v, is_causal=True, query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len)
  valid = np.arange(case.t)[None, :] < np.asarray(q_len)[:, None]
  np.testing.assert_allclose(
      np.asarray(ours)[valid], np.asarray(theirs)[valid], atol=2e-6)
  assert np.all(np.asarray(ours)[~valid] == 0)


@pytest.mark.parametrize("case", [
    Case(b=1, t=40, s=52, n=4, k=2, h=16, causal=True, lengths=True,
         soft_cap=3.0, bias="full"),
    Case(b=2, t=23, s=31, n=2, k=1, h=8, segments=True, window=(6, 2),
         mask="broadcast"),
], ids=str)
def test_float32_matches_float64(case):
  gen = rng("f64", str(case))
  q, k, v, kw = make_inputs(case, jnp.float32, gen)
  dout = jnp.asarray(gen.standard_normal(q.shape, np.float32))
  dlse = jnp.asarray(gen.standard_normal(q.shape[:-1], np.float32))
  f32 = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  with jax.enable_x64(True):
    f64 = run(reference_fn(jnp.float64), q, k, v, kw, dout, dlse)
    f64 = jax.tree.map(lambda x: np.asarray(x, np.float64), f64)
  for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dbias"],
                        [f32[0], f32[1], *f32[2]], [f64[0], f64[1], *f64[2]]):
    assert_close(name, a, b)
