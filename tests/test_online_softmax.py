"""The shared softmax, logit and merge math against float64 NumPy and autodiff.

Every helper of `online_softmax` is checked on fresh random tiles, with rows
whose keys are all masked (-inf) among them: those give probability 0, output
0, logsumexp -inf and zero gradients, never NaN. The hooks the kernels use
(base 2, explicit broadcasts, transposed tiles) must give the same numbers as
the plain formulas.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import rng

from pallas_fa import online_softmax

MASK = online_softmax.MASK_VALUE
ROWS, KEYS, H = 8, 24, 16
# Rows of the test tiles whose keys are all masked.
DEAD_ROWS = np.array([0, 5])


def _normal(gen, *shape, scale=1.0):
  return jnp.asarray(gen.standard_normal(shape).astype(np.float32) * scale)


def _masked_logits(gen, rows=ROWS, keys=KEYS, dead=DEAD_ROWS):
  """Random logits with some masked entries and fully masked rows."""
  s = _normal(gen, rows, keys, scale=3.0)
  visible = gen.random((rows, keys)) < 0.7
  visible[np.asarray(dead)] = False
  return jnp.where(visible, s, MASK), visible


def _np_softmax(s):
  """(p, lse) in float64 with the library's conventions for dead rows."""
  s = np.asarray(s, np.float64)
  m = s.max(axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.exp(s - m)
  denom = e.sum(axis=-1, keepdims=True)
  seen = denom > 0
  p = np.where(seen, e / np.where(seen, denom, 1.0), 0.0)
  with np.errstate(divide="ignore"):
    lse = np.where(seen[..., 0], m[..., 0] + np.log(denom[..., 0]), -np.inf)
  return p, lse


def _assert_finite(*xs):
  for x in jax.tree.leaves(xs):
    assert not np.isnan(np.asarray(x)).any()


# --------------------------------------------------------------------------
# Logits and their gradient.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("base2", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_logits_match_numpy(cap, with_bias, base2, scale):
  gen = rng("logits", cap, with_bias, base2, scale)
  qk = _normal(gen, ROWS, KEYS, scale=4.0)
  bias = _normal(gen, 1, KEYS) if with_bias else None
  s, s_capped = online_softmax.logits(
      qk, scale=scale, cap=cap, bias=bias, base2=base2)
  x = np.asarray(qk, np.float64) * scale
  capped = x if cap is None else cap * np.tanh(x / cap)
  expect = capped + (0.0 if bias is None else np.asarray(bias, np.float64))
  if base2:
    expect = expect * np.log2(np.e)
  np.testing.assert_allclose(s, expect, rtol=2e-6, atol=2e-6)
  if cap is None:
    assert s_capped is None
  else:
    np.testing.assert_allclose(s_capped, capped, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_logits_grad_matches_autodiff(cap, scale):
  gen = rng("logits_grad", cap, scale)
  qk = _normal(gen, ROWS, KEYS, scale=4.0)
  bias = _normal(gen, ROWS, KEYS)
  ds = _normal(gen, ROWS, KEYS)

  def f(qk, bias):
    s, _ = online_softmax.logits(qk, scale=scale, cap=cap, bias=bias)
    return jnp.sum(s * ds)

  dqk, dbias = jax.grad(f, argnums=(0, 1))(qk, bias)
  _, s_capped = online_softmax.logits(qk, scale=scale, cap=cap, bias=bias)
  ours = online_softmax.logits_grad(ds, s_capped, scale=scale, cap=cap)
  np.testing.assert_allclose(ours, dqk, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(dbias, ds)  # d logits / d bias = 1
  # The scale may be left to the caller, applied once to a sum.
  deferred = online_softmax.logits_grad(ds, s_capped, cap=cap) * scale
  np.testing.assert_allclose(deferred, dqk, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------
# Forward: online softmax over tiles, and the one-tile softmax.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("base2", [False, True])
@pytest.mark.parametrize("tile", [KEYS, 8, 5])
def test_online_softmax_over_tiles_matches_numpy(base2, tile):
  gen = rng("online", base2, tile)
  s, _ = _masked_logits(gen)
  v = _normal(gen, KEYS, H)
  s_kernel = s * online_softmax.LOG2_E if base2 else s
  m_i, l_i, acc = online_softmax.init((ROWS,), (ROWS, H))
  for j in range(0, KEYS, tile):
    m_i, l_i, p, alpha = online_softmax.update(
        m_i, l_i, s_kernel[:, j:j + tile], base2=base2)
    acc = online_softmax.rescale(acc, alpha) + p @ v[j:j + tile]
  out, lse = online_softmax.finalize(m_i, l_i, acc, base2=base2)
  _assert_finite(out)
  p_ref, lse_ref = _np_softmax(s)
  np.testing.assert_allclose(out, p_ref @ np.asarray(v, np.float64),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[DEAD_ROWS] == 0)
  assert np.all(np.asarray(lse)[DEAD_ROWS] == -np.inf)


def test_softmax_matches_numpy_and_differentiates_without_nan():
  gen = rng("softmax")
  s, visible = _masked_logits(gen)
  p, lse = online_softmax.softmax(s)
  p_ref, lse_ref = _np_softmax(s)
  np.testing.assert_allclose(p, p_ref, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-6, atol=1e-6)
  dp, dlse = _normal(gen, ROWS, KEYS), _normal(gen, ROWS)

  def f(s):
    p, lse = online_softmax.softmax(s)
    return jnp.sum(p * dp) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)
                                     * dlse)

  ds = jax.grad(f)(s)
  _assert_finite(ds)
  assert np.all(np.asarray(ds)[~visible] == 0)


def test_hooks_give_the_plain_formulas():
  """Explicit broadcasts (Mosaic GPU layouts) and transposed tiles (keys
  as the matmul M dimension) compute exactly what the defaults do."""
  gen = rng("hooks")
  s, _ = _masked_logits(gen)
  s = s * online_softmax.LOG2_E
  m_i = _normal(gen, ROWS).at[1].set(MASK)
  l_i = jnp.abs(_normal(gen, ROWS)).at[1].set(0.0)
  acc, dp, delta = _normal(gen, ROWS, H), _normal(gen, ROWS, KEYS), _normal(
      gen, ROWS)
  lse = _normal(gen, ROWS).at[DEAD_ROWS].set(MASK)
  rows = online_softmax.queries_along(0)
  cols = online_softmax.queries_along(1)

  @jax.jit
  def both():
    plain, explicit, transposed = {}, {}, {}
    plain["update"] = online_softmax.update(m_i, l_i, s, base2=True)
    explicit["update"] = online_softmax.update(
        m_i, l_i, s, base2=True, per_query=rows)
    m_new, l_new, p, alpha = plain["update"]
    plain["rescale"] = online_softmax.rescale(acc, alpha)
    explicit["rescale"] = online_softmax.rescale(acc, alpha, per_query=rows)
    plain["finalize"] = online_softmax.finalize(m_new, l_new, acc, base2=True)
    explicit["finalize"] = online_softmax.finalize(
        m_new, l_new, acc, base2=True, per_query=rows)
    lse2 = online_softmax.lse_for_probs(lse, base2=True)
    plain["probs"] = online_softmax.probs_from_lse(
        s, lse * online_softmax.LOG2_E, base2=True)
    explicit["probs"] = online_softmax.probs(
        s, lse2, base2=True, per_query=rows)
    transposed["probs"] = online_softmax.probs(
        s.T, lse2, base2=True, per_query=cols).T
    plain["softmax_grad"] = online_softmax.softmax_grad(p, dp, delta)
    explicit["softmax_grad"] = online_softmax.softmax_grad(
        p, dp, delta, per_query=rows)
    transposed["softmax_grad"] = online_softmax.softmax_grad(
        p.T, dp.T, delta, per_query=online_softmax.queries_last).T
    return plain, explicit, transposed

  plain, explicit, transposed = both()
  for name in plain:
    for other in (explicit, transposed):
      if name in other:
        chex.assert_trees_all_close(plain[name], other[name], rtol=1e-6,
                                    atol=0, custom_message=name)


@pytest.mark.parametrize("per_query", ["first", "along"])
def test_update_with_a_per_row_scale_is_the_scaled_update(per_query):
  """`update(scale=)` with a positive vector a row (float8's row factors):
  the max on the unscaled tile, the factor in the exponent, the same
  (m, l, p, alpha) as the update of the scaled logits, dead rows and tiny
  factors included."""
  gen = rng("per-row scale", per_query)
  s, _ = _masked_logits(gen)
  scale = jnp.abs(_normal(gen, ROWS)) + 0.1
  scale = scale.at[3].set(jnp.finfo(jnp.float32).tiny)
  m_i = _normal(gen, ROWS).at[1].set(MASK)
  l_i = jnp.abs(_normal(gen, ROWS)).at[1].set(0.0)
  kw = dict(base2=True, offset=8.0)
  if per_query == "along":
    kw["per_query"] = online_softmax.queries_along(0)
  want = online_softmax.update(m_i, l_i, s * scale[:, None], **kw)
  got = online_softmax.update(m_i, l_i, s, scale=scale, **kw)
  _assert_finite(got)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  # A dead row stays dead: p 0, l its rescaled old value.
  assert not np.asarray(got[2])[DEAD_ROWS].any()


# --------------------------------------------------------------------------
# Backward: probabilities from the logsumexp, dS, delta.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("base2", [False, True])
def test_probs_from_lse_zero_for_rows_without_keys(base2):
  gen = rng("probs", base2)
  s, _ = _masked_logits(gen)
  _, lse = online_softmax.softmax(s)
  # The logits of a dead row are finite here: its lse (-inf) alone must
  # zero them.
  s_any = s.at[DEAD_ROWS].set(_normal(gen, len(DEAD_ROWS), KEYS))
  factor = online_softmax.LOG2_E if base2 else 1.0
  p = online_softmax.probs_from_lse(s_any * factor, lse * factor, base2=base2)
  p_ref, _ = _np_softmax(s)
  _assert_finite(p)
  np.testing.assert_allclose(p, p_ref, rtol=2e-5, atol=1e-7)
  p = online_softmax.probs(
      s_any * factor, online_softmax.lse_for_probs(lse, base2=base2),
      base2=base2)
  np.testing.assert_allclose(p, p_ref, rtol=2e-5, atol=1e-7)


def test_softmax_grad_and_delta_match_autodiff():
  """dS = P (dP - delta) with delta = rowsum(out dout) - dlse is the
  gradient of (out, lse) w.r.t. the logits."""
  gen = rng("softmax_grad")
  s, visible = _masked_logits(gen)
  v = _normal(gen, KEYS, H)
  dout, dlse = _normal(gen, ROWS, H), _normal(gen, ROWS)

  def attention(s):
    p, lse = online_softmax.softmax(s)
    return p @ v, lse

  (out, _), pullback = jax.vjp(attention, s)
  (ds_ref,) = pullback((dout, dlse))
  p = online_softmax.probs_from_lse(s, attention(s)[1])
  delta = online_softmax.delta(out, dout, dlse)
  ds = online_softmax.softmax_grad(p, dout @ v.T, delta)
  _assert_finite(ds, ds_ref)
  np.testing.assert_allclose(ds, ds_ref, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(ds)[~visible] == 0)
  np.testing.assert_allclose(
      delta, np.sum(np.asarray(out, np.float64) * np.asarray(dout), axis=-1)
      - np.asarray(dlse), rtol=1e-5, atol=1e-5)


def test_delta_promotes_low_precision():
  gen = rng("delta")
  out = _normal(gen, ROWS, H).astype(jnp.bfloat16)
  dout = _normal(gen, ROWS, H).astype(jnp.bfloat16)
  d = online_softmax.delta(out, dout, None)
  assert d.dtype == jnp.float32
  np.testing.assert_allclose(
      d, np.sum(np.asarray(out, np.float64) * np.asarray(dout, np.float64),
                axis=-1), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Merging partial attentions, and its gradient.
# --------------------------------------------------------------------------


def _split_problem(gen, cuts):
  """Logits over KEYS keys split at `cuts`: row 0 sees no key at all, row 1
  sees keys of the first part only, row 2 of the last part only."""
  s, _ = _masked_logits(gen, dead=(0,))
  edges = [0, *cuts, KEYS]
  s = s.at[1, edges[1]:].set(MASK)
  s = s.at[2, :edges[-2]].set(MASK)
  v = _normal(gen, KEYS, H)
  return s, v, list(zip(edges[:-1], edges[1:]))


def _partial(s, v):
  p, lse = online_softmax.softmax(s)
  return p @ v, lse


def _finite(lse):
  return jnp.where(jnp.isfinite(lse), lse, 0.0)


def test_merge_is_attention_over_all_keys():
  gen = rng("merge")
  s, v, parts = _split_problem(gen, [10])
  (a0, a1), (b0, b1) = parts
  out, lse = online_softmax.merge(*_partial(s[:, a0:a1], v[a0:a1]),
                                  *_partial(s[:, b0:b1], v[b0:b1]))
  p_ref, lse_ref = _np_softmax(s)
  _assert_finite(out)
  np.testing.assert_allclose(out, p_ref @ np.asarray(v, np.float64),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[0] == 0) and lse[0] == -np.inf


def test_merge_gradient_matches_full_softmax():
  """Autodiff through the partials and `merge` gives the gradients of one
  softmax over the concatenated keys -- also for rows that see no key in
  one part (lse = -inf there) or in both."""
  gen = rng("merge_grad")
  s, v, parts = _split_problem(gen, [10])
  (a0, a1), (b0, b1) = parts
  dout, dlse = _normal(gen, ROWS, H), _normal(gen, ROWS)

  def loss(out, lse):
    return jnp.sum(out * dout) + jnp.sum(_finite(lse) * dlse)

  def merged(s, v):
    return loss(*online_softmax.merge(*_partial(s[:, a0:a1], v[a0:a1]),
                                      *_partial(s[:, b0:b1], v[b0:b1])))

  def full(s, v):
    return loss(*_partial(s, v))

  ours = jax.grad(merged, argnums=(0, 1))(s, v)
  ref = jax.grad(full, argnums=(0, 1))(s, v)
  _assert_finite(ours, ref)
  chex.assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_merge_grad_gives_each_parts_cotangents():
  """Each part's cotangents from the merged (lse, delta), pulled back through
  that part alone (as a ring of partial attentions does, step by step), give
  the gradients of one softmax over all keys, for any number of parts."""
  gen = rng("merge_parts")
  s, v, parts = _split_problem(gen, [7, 15])
  partials = [_partial(s[:, lo:hi], v[lo:hi]) for lo, hi in parts]
  dout, dlse = _normal(gen, ROWS, H), _normal(gen, ROWS)
  # Row 0 sees no key: its lse is -inf, and a finite cotangent there must
  # not turn into NaN.
  out, lse = partials[0]
  for out_s, lse_s in partials[1:]:
    out, lse = online_softmax.merge(out, lse, out_s, lse_s)
  delta = online_softmax.delta(out, dout, dlse)

  def full(s, v):
    out, lse = _partial(s, v)
    return jnp.sum(out * dout) + jnp.sum(_finite(lse) * dlse)

  ds_ref, dv_ref = jax.grad(full, argnums=(0, 1))(s, v)
  for (lo, hi), (out_s, lse_s) in zip(parts, partials, strict=True):
    dout_s, dlse_s = online_softmax.merge_grad(out_s, lse_s, lse, dout, delta)
    assert dout_s.dtype == out_s.dtype and dlse_s.dtype == lse_s.dtype
    dead = np.asarray(lse_s) == -np.inf
    assert np.all(np.asarray(dlse_s)[dead] == 0)
    assert np.all(np.asarray(dout_s)[dead] == 0)
    _, pullback = jax.vjp(_partial, s[:, lo:hi], v[lo:hi])
    ds, dv = pullback((dout_s, dlse_s))
    _assert_finite(ds, dv)
    np.testing.assert_allclose(ds, ds_ref[:, lo:hi], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dv, dv_ref[lo:hi], rtol=1e-5, atol=1e-5)


def test_merge_grad_is_the_vjp_of_merging():
  """`merge_grad` agrees with autodiff through a chain of merges, whose
  intermediate results it never sees."""
  gen = rng("merge_vjp")
  s, v, parts = _split_problem(gen, [7, 15])
  partials = [_partial(s[:, lo:hi], v[lo:hi]) for lo, hi in parts]
  dout, dlse = _normal(gen, ROWS, H), _normal(gen, ROWS)
  dlse = dlse.at[0].set(3.0)  # on the row that sees no key

  def chain(partials):
    out, lse = partials[0]
    for out_s, lse_s in partials[1:]:
      out, lse = online_softmax.merge(out, lse, out_s, lse_s)
    return out, lse

  (out, lse), pullback = jax.vjp(chain, partials)
  (ref,) = pullback((dout, dlse))
  delta = online_softmax.delta(out, dout, dlse)
  for (out_s, lse_s), (dout_ref, dlse_ref) in zip(partials, ref, strict=True):
    dout_s, dlse_s = online_softmax.merge_grad(out_s, lse_s, lse, dout, delta)
    _assert_finite(dout_ref, dlse_ref)
    chex.assert_trees_all_close((dout_s, dlse_s), (dout_ref, dlse_ref),
                                rtol=1e-5, atol=1e-6)


def test_add_sink_is_a_value_less_logit_column():
  """`add_sink` (and its `sink_grad`) give the softmax over the logits plus
  a column of sinks whose value is 0: outputs, lse and the gradients in
  the logits, values and sinks. A row that sees no key keeps out 0 and lse
  -inf and gives its sink no gradient (row 0; the column is masked there).
  A huge sink gives 0 without overflow, a tiny one changes nothing."""
  gen = rng("sinks")
  s, v, _ = _split_problem(gen, [10])
  sinks = _normal(gen, ROWS, scale=2.0) + 1.0
  dout, dlse = _normal(gen, ROWS, H), _normal(gen, ROWS)

  def loss(out, lse):
    return jnp.sum(out * dout) + jnp.sum(_finite(lse) * dlse)

  def ours(s, v, sinks):
    return online_softmax.add_sink(*_partial(s, v), sinks)

  def column(s, v, sinks):
    seen = jnp.any(s != MASK, axis=-1)
    sink = jnp.where(seen, sinks, MASK)[:, None]
    return _partial(jnp.concatenate([s, sink], axis=-1),
                    jnp.concatenate([v, jnp.zeros((1, H))]))

  out, lse = ours(s, v, sinks)
  out_ref, lse_ref = column(s, v, sinks)
  np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-6)
  assert np.all(np.asarray(out[0]) == 0) and lse[0] == -np.inf
  grads = jax.grad(lambda *a: loss(*ours(*a)), argnums=(0, 1, 2))(s, v, sinks)
  ref = jax.grad(lambda *a: loss(*column(*a)), argnums=(0, 1, 2))(
      s, v, sinks)
  _assert_finite(grads)
  assert grads[2][0] == 0
  for a, b in zip(grads, ref, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  out, lse = ours(s, v, jnp.full((ROWS,), 1e30))
  _assert_finite(out)
  assert np.all(np.asarray(out) == 0)
  plain = _partial(s, v)
  for a, b in zip(ours(s, v, jnp.full((ROWS,), -1e30)), plain, strict=True):
    np.testing.assert_array_equal(a, b)
