"""`pallas_fa.flex.fused_mods`: a score_mod/mask_mod split for the kernels.

The split must be exact: its residuals (computed outside a kernel) fed to
its tile part give what `mods.evaluate` gives on the dense [B, N, T, S]
grid, for every example of `pallas_fa.flex` it accepts, on fresh random
inputs; its gradients (per-tile partial sums chained through the outside
part) what `jax.grad` gives; and what a kernel cannot run is declined with
a message naming the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import rng

from pallas_fa import flex
from pallas_fa.flex import fused_mods
from pallas_fa.flex import mods

Level = fused_mods.Level
B, N, T, S = 2, 3, 12, 20


def _examples(gen):
  doc = jnp.asarray(np.sort(gen.integers(0, 3, (B, S)), axis=1), jnp.int32)
  return {
      "alibi": (mods.SCORE_MOD, flex.alibi, (jnp.asarray(
          gen.uniform(0.1, 1.0, N), jnp.float32),)),
      "tanh_soft_cap": (mods.SCORE_MOD, flex.tanh_soft_cap,
                        (jnp.float32(gen.uniform(2, 5)),)),
      "document": (mods.MASK_MOD, flex.document, (doc,)),
      "chunked_causal": (mods.MASK_MOD, flex.chunked_causal,
                         (jnp.int32(4),)),
      "prefix_lm": (mods.MASK_MOD, flex.prefix_lm, (jnp.asarray(
          gen.integers(0, T, B), jnp.int32),)),
      "sliding_window_with_sinks": (mods.MASK_MOD,
                                    flex.sliding_window_with_sinks,
                                    (jnp.int32(5), jnp.int32(2))),
      "causal_with_offset": (mods.MASK_MOD, flex.causal_with_offset,
                             (jnp.asarray(gen.integers(0, 6, B),
                                          jnp.int32),)),
  }


# What each example's tile reads: (level, depends on batch, on head).
LEVELS = {
    "alibi": [(Level.PROGRAM, False, True)],
    "tanh_soft_cap": [(Level.PROGRAM, False, False)],
    "document": [(Level.ROW, True, False), (Level.COLUMN, True, False)],
    "chunked_causal": [(Level.ROW, False, False),
                       (Level.COLUMN, False, False)],
    "prefix_lm": [(Level.COLUMN, True, False)],
    "sliding_window_with_sinks": [(Level.PROGRAM, False, False),
                                  (Level.COLUMN, False, False)],
    "causal_with_offset": [(Level.ROW, True, False)],
}


def _dense(fn, name, args, score):
  return mods.evaluate(
      fn, (B, N, T, S), batch=jnp.arange(B).reshape(B, 1, 1, 1),
      head=jnp.arange(N).reshape(1, N, 1, 1),
      q_idx=jnp.arange(T).reshape(1, 1, T, 1),
      kv_idx=jnp.arange(S).reshape(1, 1, 1, S),
      score=score if name == mods.SCORE_MOD else None, args=args)


def _tile_values(mod, arrays, b, h):
  """Each residual for program (b, h), shaped against a [T, S] tile."""
  out = []
  for r, a in zip(mod.residuals, arrays):
    a = a[b if r.batch else 0, h if r.head else 0]
    if r.level == Level.ROW:
      a = a[:T, None]
    elif r.level == Level.COLUMN:
      a = a[None, :S]
    out.append(a)
  return out


def _split_grid(mod, args, score):
  # Padded lengths as a kernel pads them: the tails are never visible.
  arrays = mod.residual_arrays(args, batch=B, heads=N, q_len=T, kv_len=S,
                               q_padded=T + 4, kv_padded=S + 4)
  return jnp.stack([jnp.stack([
      mod.tile(_tile_values(mod, arrays, b, h),
               q_idx=jnp.arange(T)[:, None], kv_idx=jnp.arange(S)[None, :],
               score=None if score is None else score[b, h])
      for h in range(N)]) for b in range(B)])


@pytest.mark.parametrize("example", sorted(LEVELS))
def test_split_is_exact(example):
  gen = rng("fused-mods", example)
  name, fn, args = _examples(gen)[example]
  mod = fused_mods.split(name, fn, args, "test")
  assert [(r.level, r.batch, r.head) for r in mod.residuals] == (
      LEVELS[example])
  score = jnp.asarray(gen.normal(size=(B, N, T, S)), jnp.float32)
  got = _split_grid(mod, args, score if name == mods.SCORE_MOD else None)
  want = _dense(fn, name, args, score)
  if name == mods.MASK_MOD:
    assert want.any() and not want.all()
    np.testing.assert_array_equal(got, want)
  else:
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("example", ["alibi", "tanh_soft_cap"])
def test_gradients_are_exact(example):
  """Per-(batch, head) sums of the tile cotangents, chained outside, give
  jax.grad of the dense evaluation; and dS through the tile part."""
  gen = rng("fused-mods-grad", example)
  name, fn, args = _examples(gen)[example]
  mod = fused_mods.split(name, fn, args, "test")
  score = jnp.asarray(gen.normal(size=(B, N, T, S)), jnp.float32)
  ds = jnp.asarray(gen.normal(size=(B, N, T, S)), jnp.float32)
  want_args, want_score = jax.grad(
      lambda a, s: (_dense(fn, name, a, s) * ds).sum(), argnums=(0, 1))(
          args, score)
  arrays = mod.residual_arrays(args, batch=B, heads=N, q_len=T, kv_len=S,
                               q_padded=T, kv_padded=S)
  diff = [r for r in mod.residuals if r.differentiable]
  assert diff
  cotangents = [jnp.zeros((B if r.batch else 1, N if r.head else 1))
                for r in diff]
  got_score = []
  for b in range(B):
    for h in range(N):
      _, pull = mod.tile_vjp(_tile_values(mod, arrays, b, h),
                             q_idx=jnp.arange(T)[:, None],
                             kv_idx=jnp.arange(S)[None, :], score=score[b, h])
      d_score, d_values = pull(ds[b, h])
      got_score.append(d_score)
      cotangents = [c.at[b if r.batch else 0, h if r.head else 0].add(d)
                    for c, r, d in zip(cotangents, diff, d_values)]
  got_args = mod.args_grad(args, cotangents, batch=B, heads=N)
  np.testing.assert_allclose(jnp.stack(got_score).reshape(score.shape),
                             want_score, rtol=1e-5, atol=1e-5)
  for g, w in zip(got_args, want_args):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_declines_what_a_kernel_cannot_run():
  gen = rng("fused-mods-decline")
  table = jnp.asarray(gen.normal(size=(N, 8)), jnp.float32)
  with pytest.raises(NotImplementedError,
                     match="cannot fuse this score_mod.*dynamic_slice"):
    fused_mods.split(mods.SCORE_MOD, flex.t5_relative_bias, (table,), "k")

  def key_bias(score, batch, head, q_idx, kv_idx, bias):
    return score + bias[kv_idx]

  # A learned per-key bias: a per-token gradient, which kernels lack ...
  with pytest.raises(NotImplementedError, match="gradient per token"):
    fused_mods.split(mods.SCORE_MOD, key_bias,
                     (jnp.zeros((S,), jnp.float32),), "k")
  # ... but an integer one (no gradient) is a per-key value.
  mod = fused_mods.split(mods.SCORE_MOD, key_bias,
                         (jnp.zeros((S,), jnp.int32),), "k")
  assert [r.level for r in mod.residuals] == [Level.COLUMN]

  def needs_a_tile(score, batch, head, q_idx, kv_idx):
    return score + q_idx[0, 0] * 0

  with pytest.raises(NotImplementedError, match="failed on them"):
    fused_mods.split(mods.SCORE_MOD, needs_a_tile, (), "k")


def _powers(score, batch, head, q_idx, kv_idx, c):
  """Divisions and integer powers of the score and a learned scalar."""
  del batch, head, q_idx, kv_idx
  return score ** 2 / c ** 3 + c * jnp.tanh(score / c) - score ** -2


def _primitives(closed):
  """(name, params) of every primitive of a jaxpr, inner ones included."""
  out = []
  for eqn in closed.jaxpr.eqns:
    out.append((eqn.primitive.name, eqn.params))
    for p in eqn.params.values():
      if hasattr(p, "jaxpr"):
        out += _primitives(p)
  return out


def test_tile_and_its_pullback_use_what_every_kernel_compiler_lowers():
  """Mosaic GPU lowers no add_any (transposition's sum of a value used
  twice) and integer_pow only for y >= 2 or y == -1, which the derivatives
  of a division and of x ** 2 produce; the tile part and its pullback are
  built without them, and still give jax.grad."""
  gen = rng("fused-mods-lowerable")
  c = jnp.float32(gen.uniform(2, 3))
  mod = fused_mods.split(mods.SCORE_MOD, _powers, (c,), "test")
  score = jnp.asarray(gen.uniform(0.5, 2.0, size=(T, S)), jnp.float32)
  ds = jnp.asarray(gen.normal(size=(T, S)), jnp.float32)
  # Its values (c, c ** 3, ... made outside), one program's, on the tile.
  values = [jnp.full((T, S), a[0, 0]) for a in mod.residual_arrays(
      (c,), batch=1, heads=1, q_len=T, kv_len=S, q_padded=T, kv_padded=S)]

  def run(score, ds):
    out, pull = mod.tile_vjp(values, q_idx=None, kv_idx=None, score=score,
                             reduce=lambda d: d.sum())
    return out, pull(ds)

  for name, params in _primitives(jax.make_jaxpr(run)(score, ds)):
    assert name != "add_any"
    if name == "integer_pow":
      assert params["y"] >= 2 or params["y"] == -1, params
  out, (d_score, d_values) = run(score, ds)
  (d_c,) = mod.args_grad((c,), [d.reshape(1, 1) for d in d_values],
                         batch=1, heads=1)
  want_score, want_c = jax.grad(
      lambda s, c: (_powers(s, 0, 0, 0, 0, c) * ds).sum(), argnums=(0, 1))(
          score, c)
  np.testing.assert_allclose(out, _powers(score, 0, 0, 0, 0, c), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(d_score, want_score, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(d_c, want_c, rtol=1e-4)


@pytest.mark.parametrize("example,indices", [
    ("alibi", {"q_idx", "kv_idx"}), ("tanh_soft_cap", set()),
    ("document", set()), ("chunked_causal", {"q_idx", "kv_idx"}),
    ("sliding_window_with_sinks", {"q_idx", "kv_idx"}),
    ("causal_with_offset", {"kv_idx"})])
def test_tile_indices_are_those_the_tile_reads(example, indices):
  name, fn, args = _examples(rng("fused-mods-indices", example))[example]
  assert fused_mods.split(name, fn, args, "test").tile_indices == indices


@pytest.mark.parametrize("fn, indices", [
    (lambda score, b, h, q, kv: 4.0 * jnp.tanh(score / 4.0), set()),
    (lambda score, b, h, q, kv: score - 0.5 * (q - kv), {"q_idx", "kv_idx"}),
    (lambda score, b, h, q, kv: jnp.float32(1.0), set()),
], ids=["scaled-tanh", "bias", "constant"])
def test_tile_indices_with_constants(fn, indices):
  """A score_mod with Python constants (literals in its jaxpr), or whose
  result is one, still names the indices its tile reads."""
  assert fused_mods.split("score_mod", fn, (), "test").tile_indices == (
      indices)


def _t5_grid(mod, table, score):
  """T5 on the [B, N, T, S] grid from the split: each program's table
  (a vector) read at the tile's offsets."""
  (arrays,) = mod.residual_arrays((table,), batch=B, heads=N, q_len=T,
                                  kv_len=S, q_padded=T, kv_padded=S)
  return arrays, jnp.stack([jnp.stack([
      mod.tile([arrays[0, h]], q_idx=jnp.arange(T)[:, None],
               kv_idx=jnp.arange(S)[None, :], score=score[b, h])
      for h in range(N)]) for b in range(B)])


def test_tables_are_split_per_program_and_exact():
  """With `tables`, T5's read table[head, bucket] becomes one per-head
  table (a PROGRAM residual of the row's size) read in the tile at the
  bucket; values, dS and the table's gradient (scatter-added per program,
  chained outside back into its row) are those of the dense evaluation."""
  gen = rng("fused-mods-tables")
  table = jnp.asarray(gen.normal(size=(N, 8)), jnp.float32)
  mod = fused_mods.split(mods.SCORE_MOD, flex.t5_relative_bias, (table,),
                         "test", tables=True)
  assert [(r.level, r.batch, r.head, r.size, r.differentiable)
          for r in mod.residuals] == [(Level.PROGRAM, False, True, 8, True)]
  assert mod.has_tables and "table" in mod.tile_primitives
  score = jnp.asarray(gen.normal(size=(B, N, T, S)), jnp.float32)
  ds = jnp.asarray(gen.normal(size=(B, N, T, S)), jnp.float32)
  arrays, got = _t5_grid(mod, table, score)
  np.testing.assert_allclose(
      got, _dense(flex.t5_relative_bias, mods.SCORE_MOD, (table,), score),
      rtol=1e-6, atol=1e-6)
  want_table, want_score = jax.grad(
      lambda a, s: (_dense(flex.t5_relative_bias, mods.SCORE_MOD, (a,), s)
                    * ds).sum(), argnums=(0, 1))(table, score)
  cotangent = jnp.zeros((1, N, 8))
  got_score = []
  for b in range(B):
    for h in range(N):
      _, pull = mod.tile_vjp([arrays[0, h]], q_idx=jnp.arange(T)[:, None],
                             kv_idx=jnp.arange(S)[None, :], score=score[b, h])
      d_score, (d_table,) = pull(ds[b, h])
      got_score.append(d_score)
      cotangent = cotangent.at[0, h].add(d_table)
  (got_table,) = mod.args_grad((table,), [cotangent], batch=B, heads=N)
  np.testing.assert_allclose(jnp.stack(got_score).reshape(score.shape),
                             want_score, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_table, want_table, rtol=1e-4, atol=1e-4)
  # From per-program partials (a kernel's [B, N, blocks, size]) alike.
  partials = jnp.broadcast_to(cotangent[:, :, None] / 2, (B, N, 1, 8)) / B
  (from_partials,) = mod.args_grad_from_partials(
      (table,), [jnp.concatenate([partials, partials], axis=2)],
      batch=B, heads=N)
  np.testing.assert_allclose(from_partials, want_table, rtol=1e-4,
                             atol=1e-4)


def test_tables_made_per_token_are_declined():
  """A table that differs per query (a row of a per-query table read at
  kv_idx) is not one table per program: declined, naming why; a kernel
  without tables declines every table read."""
  def per_query_table(score, batch, head, q_idx, kv_idx, table):
    return score + (table * q_idx.astype(table.dtype))[kv_idx - q_idx + T]

  table = jnp.zeros((T + S,), jnp.float32)
  with pytest.raises(NotImplementedError, match="made per query or key"):
    fused_mods.split(mods.SCORE_MOD, per_query_table, (table,), "k",
                     tables=True)
  with pytest.raises(NotImplementedError, match="do not gather"):
    fused_mods.split(mods.SCORE_MOD, flex.t5_relative_bias,
                     (jnp.zeros((N, 8)),), "k")
