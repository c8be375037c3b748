"""Flex attention: score_mod, mask_mod and block masks.

Every example of `pallas_fa.flex` runs on the implementations that support
flex attention (`xla`, `chunked`, `triton` and `mosaic_tpu` -- T5's table
read at computed offsets included, its gradient a scatter-add; `mosaic_tpu`
selects the table's entries one-hot),
forward, logsumexp and every gradient -- q, k, v and the score_mod's arrays
-- against a dense float32 oracle written here, which is itself checked
against `jax.nn.dot_product_attention` with the equivalent dense bias and
mask. Block masks are checked element by element against a dense
evaluation, and the chunked and triton backends' tile visits against the
block mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import assert_close
from attention_testing import gpu_jax_only_on_cpu
from attention_testing import rng
from conftest import block_sizes_for
from conftest import script_module

import pallas_fa
from pallas_fa import api
from pallas_fa import chunked
from pallas_fa import flex
from pallas_fa import gpu_target
from pallas_fa import masking
from pallas_fa import testing
from pallas_fa.flex import block_mask as block_mask_lib

FLEX_IMPLEMENTATIONS = ("xla", "chunked") + tuple(
    name for name in ("triton", "mosaic_tpu")
    if name in pallas_fa.implementations())
# Examples a backend cannot fuse into its kernels (it declines them: the
# automatic choice moves on). None now: T5's table, read at a bucket of
# kv_idx - q_idx, is a kernel input of triton and mosaic_tpu both.
DECLINED: set = set()
# The interpreted kernels are slow: three examples on triton (a per-head
# score_mod, a per-query/key mask_mod, a per-batch one) and two on the TPU
# interpreter by default (T5's table there: test_mosaic_tpu), the others
# in the slow leg.
_SLOW_RUNS = {(impl, name) for impl, names in (
    ("mosaic_tpu", ("tanh_soft_cap", "prefix_lm", "chunked_causal",
                    "sliding_window_with_sinks", "causal_with_offset",
                    "t5")),
    ("triton", ("tanh_soft_cap", "chunked_causal",
                "sliding_window_with_sinks", "causal_with_offset")),
) for name in names}


def _normal(gen, shape, dtype=jnp.float32):
  return testing.normal(gen, shape, dtype)


def _grid(t, s):
  return (jnp.arange(t, dtype=jnp.int32)[:, None],
          jnp.arange(s, dtype=jnp.int32)[None, :])


@dataclasses.dataclass(frozen=True)
class Example:
  """One example with its dense equivalent.

  Attributes:
    name: test id.
    score_mod, mask_mod: the functions under test (or None).
    inputs: (gen, b, t, s, n) -> (score_mod_args, mask_mod_args).
    dense_logits: (s [B, N, T, S], *score_mod_args) -> logits, or None.
    dense_bias: (*score_mod_args, t, s) -> bias [1, N, T, S] when the
      score_mod is additive (jax.nn takes it), or None.
    dense_mask: (*mask_mod_args, b, t, s) -> bool [B|1, 1, T, S], or None.
  """

  name: str
  score_mod: Callable | None
  mask_mod: Callable | None
  inputs: Callable
  dense_logits: Callable | None = None
  dense_bias: Callable | None = None
  dense_mask: Callable | None = None

  def __str__(self):
    return self.name


def _alibi_bias(slopes, t, s):
  qi, ki = _grid(t, s)
  return -slopes[None, :, None, None] * jnp.abs(qi - ki)[None, None]


def _t5_bias(table, t, s):
  qi, ki = _grid(t, s)
  return table[:, flex.t5_bucket(ki - qi, table.shape[1])][None]


def _causal(t, s):
  qi, ki = _grid(t, s)
  return (ki <= qi)[None, None]


def _prefix_mask(prefix, b, t, s):
  qi, ki = _grid(t, s)
  return ((ki <= qi)[None] | (ki[None] < prefix[:, None, None]))[:, None]


def _document_mask(ids, b, t, s):
  return (ids[:, :, None] == ids[:, None, :])[:, None]


def _chunked_causal_mask(chunk, b, t, s):
  qi, ki = _grid(t, s)
  return ((ki <= qi) & (qi // chunk == ki // chunk))[None, None]


def _sinks_mask(window, sinks, b, t, s):
  qi, ki = _grid(t, s)
  return ((ki <= qi) & ((qi - ki < window) | (ki < sinks)))[None, None]


def _offset_mask(offsets, b, t, s):
  qi, ki = _grid(t, s)
  return (ki[None] <= qi[None] + offsets[:, None, None])[:, None]


EXAMPLES = [
    Example(
        "alibi", flex.alibi, None,
        lambda gen, b, t, s, n: ((flex.alibi_slopes(n) * (
            1 + jnp.asarray(gen.random(n), jnp.float32)),), ()),
        dense_logits=lambda x, slopes: x + _alibi_bias(
            slopes, x.shape[2], x.shape[3]),
        dense_bias=_alibi_bias),
    Example(
        "t5", flex.t5_relative_bias, None,
        lambda gen, b, t, s, n: ((_normal(gen, (n, 8)),), ()),
        dense_logits=lambda x, table: x + _t5_bias(
            table, x.shape[2], x.shape[3]),
        dense_bias=_t5_bias),
    Example(
        "tanh_soft_cap", flex.tanh_soft_cap, None,
        lambda gen, b, t, s, n: ((jnp.float32(1.5 + gen.random()),), ()),
        dense_logits=lambda x, cap: cap * jnp.tanh(x / cap)),
    Example(
        "prefix_lm", None, flex.prefix_lm,
        lambda gen, b, t, s, n: ((), (jnp.asarray(
            gen.integers(0, t, b), jnp.int32),)),
        dense_mask=_prefix_mask),
    Example(
        "document", None, flex.document,
        lambda gen, b, t, s, n: ((), (jnp.asarray(np.sort(
            gen.integers(0, 4, (b, t)), axis=1), jnp.int32),)),
        dense_mask=_document_mask),
    Example(
        "chunked_causal", None, flex.chunked_causal,
        lambda gen, b, t, s, n: ((), (jnp.int32(gen.integers(5, 13)),)),
        dense_mask=_chunked_causal_mask),
    Example(
        "sliding_window_with_sinks", None, flex.sliding_window_with_sinks,
        lambda gen, b, t, s, n: ((), (jnp.int32(gen.integers(4, 12)),
                                      jnp.int32(gen.integers(1, 4)))),
        dense_mask=_sinks_mask),
    Example(
        "causal_with_offset", None, flex.causal_with_offset,
        lambda gen, b, t, s, n: ((), (jnp.asarray(
            gen.integers(0, max(1, s - t) + 3, b), jnp.int32),)),
        dense_mask=_offset_mask),
]
EXAMPLE = {e.name: e for e in EXAMPLES}
# (implementation, example) of every example a backend runs.
RUNS = [pytest.param(i, e, id=f"{e.name}-{i}") for i in FLEX_IMPLEMENTATIONS
        for e in EXAMPLES if (i, e.name) not in DECLINED]
FAST_RUNS = [pytest.param(i, e, id=f"{e.name}-{i}")
             for i in FLEX_IMPLEMENTATIONS for e in EXAMPLES
             if (i, e.name) not in DECLINED | _SLOW_RUNS]
SLOW_RUNS = [pytest.param(i, e, id=f"{e.name}-{i}")
             for i, e in ((i, EXAMPLE[n]) for i, n in sorted(_SLOW_RUNS))
             if i in FLEX_IMPLEMENTATIONS]


def _dense(q, k, v, *score_args, example, mask, scale):
  """The oracle: materialised float32 attention, (out, lse) [B, T, N]."""
  g = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, g, axis=2) for x in (k, v))
  s = jnp.einsum("btnh,bsnh->bnts", q, k,
                 precision=jax.lax.Precision.HIGHEST) * scale
  if example.dense_logits is not None:
    s = example.dense_logits(s, *score_args)
  s = jnp.where(mask, s, -jnp.inf)
  m = jax.lax.stop_gradient(s.max(axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.exp(s - m)
  total = e.sum(axis=-1, keepdims=True)
  seen = total > 0
  p = e / jnp.where(seen, total, 1.0)
  out = jnp.einsum("bnts,bsnh->btnh", p, v,
                   precision=jax.lax.Precision.HIGHEST)
  lse = jnp.where(seen, jnp.log(jnp.where(seen, total, 1.0)) + m, -jnp.inf)
  return out, lse[..., 0].transpose(0, 2, 1)


@dataclasses.dataclass
class Problem:
  """Random inputs of one example call."""

  q: Any
  k: Any
  v: Any
  score_args: tuple
  mask_args: tuple
  kv_lengths: Any
  mask: Any  # bool [B, 1, T, S]: the dense equivalent with the padding.
  dout: Any
  dlse: Any


def _problem(example, gen, dtype, *, b=2, t=45, s=45, n=4, k=2, h=16,
             causal=False, padding=False):
  q = _normal(gen, (b, t, n, h), dtype)
  kk = _normal(gen, (b, s, k, h), dtype)
  v = _normal(gen, (b, s, k, h), dtype)
  score_args, mask_args = example.inputs(gen, b, t, s, n)
  kv_lengths = None
  mask = jnp.ones((1, 1, 1, s), bool)
  if padding:
    kv_lengths = jnp.asarray(gen.integers(s // 2, s, b), jnp.int32)
    mask = (jnp.arange(s)[None, None, None, :]
            < kv_lengths[:, None, None, None])
  if example.dense_mask is not None:
    mask = mask & example.dense_mask(*mask_args, b, t, s)
  if causal:
    mask = mask & _causal(t, s)
  mask = jnp.broadcast_to(mask, (b, 1, t, s))
  # Rows that see no key: zeros here, the mean of V in jax.nn; their
  # output cotangent is zero so the two agree on every gradient.
  seen = mask.any(axis=-1)[:, 0, :, None, None]  # [B, T, 1, 1]
  dout = _normal(gen, (b, t, n, h)) * seen
  dlse = _normal(gen, (b, t, n)) * seen[..., 0]
  return Problem(q, kk, v, score_args, mask_args, kv_lengths, mask, dout,
                 dlse)


def _flash(implementation, example, p, **kw):
  """(out, lse) and the gradients of q, k, v and the score_mod arrays."""
  def f(q, k, v, *score_args):
    return pallas_fa.flash_attention(
        q, k, v, score_mod=example.score_mod, score_mod_args=score_args,
        mask_mod=example.mask_mod, mask_mod_args=p.mask_args,
        key_value_seq_lengths=p.kv_lengths, implementation=implementation,
        block_sizes=block_sizes_for(implementation), return_residual=True,
        **kw)

  (out, lse), pullback = jax.vjp(f, p.q, p.k, p.v, *p.score_args)
  return out, lse, pullback((p.dout.astype(out.dtype), p.dlse))


def _oracle(example, p, **kw):
  scale = 1 / np.sqrt(p.q.shape[-1])
  f32 = [x.astype(jnp.float32) for x in (p.q, p.k, p.v)]
  mask = p.mask & _causal(p.q.shape[1], p.k.shape[1]) if kw.get(
      "is_causal") else p.mask
  f = functools.partial(_dense, example=example, mask=mask, scale=scale)
  (out, lse), pullback = jax.vjp(f, *f32, *p.score_args)
  return out, lse, pullback((p.dout, p.dlse))


def _same_dtype_reference(example, p, **kw):
  """`testing.reference` in the inputs' dtype (the FlashAttention rule)."""
  def f(q, k, v, *score_args):
    return testing.reference(
        q, k, v, compute_dtype=p.q.dtype, score_mod=example.score_mod,
        score_mod_args=score_args, mask_mod=example.mask_mod,
        mask_mod_args=p.mask_args, key_value_seq_lengths=p.kv_lengths, **kw)

  (out, lse), pullback = jax.vjp(f, p.q, p.k, p.v, *p.score_args)
  return out, lse, pullback((p.dout.astype(out.dtype), p.dlse))


def _compare(got, ref, same=None, dtype=jnp.float32):
  names = ["out", "lse", "dq", "dk", "dv"] + [
      f"dscore_mod_args[{i}]" for i in range(len(got[2]) - 3)]
  values = [got[0], got[1], *got[2]]
  refs = [ref[0], ref[1], *ref[2]]
  sames = [None] * len(values) if same is None else [
      same[0], same[1], *same[2]]
  for name, x, r, rs in zip(names, values, refs, sames):
    assert x.shape == r.shape, (name, x.shape, r.shape)
    assert_close(name, x, r, rs, dtype)


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_oracle_matches_jax_nn(example):
  """The dense oracle is jax.nn's attention with the dense bias and mask,
  where those express the example (all but the soft cap)."""
  if example.dense_logits is not None and example.dense_bias is None:
    pytest.skip("not an additive bias: jax.nn cannot express it")
  gen = rng("flex-oracle", example.name)
  p = _problem(example, gen, jnp.float32, padding=True)
  p.dlse = jnp.zeros_like(p.dlse)  # jax.nn has no logsumexp output.
  t, s = p.q.shape[1], p.k.shape[1]

  def nn(q, k, v, *score_args):
    bias = None if example.dense_bias is None else example.dense_bias(
        *score_args, t, s)
    return jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=p.mask, implementation="xla",
        key_value_seq_lengths=p.kv_lengths)

  out, pullback = jax.vjp(nn, p.q, p.k, p.v, *p.score_args)
  want = (out, None, pullback(p.dout))
  got = _oracle(example, p)
  seen = p.mask.any(axis=-1)[:, 0, :, None, None]  # jax.nn: mean of V.
  for name, x, r in zip(["out", "dq", "dk", "dv", "dargs"],
                        [got[0] * seen, *got[2]],
                        [want[0] * seen, *want[2]]):
    assert_close(name, x, r)


@pytest.mark.parametrize("implementation,example", FAST_RUNS)
def test_example_float32(implementation, example):
  """GQA, T = S = 45 (ragged against the test tiles 16 x 32)."""
  _check_float32(implementation, example)


@pytest.mark.slow
@pytest.mark.parametrize("implementation,example", SLOW_RUNS)
def test_example_float32_slow(implementation, example):
  _check_float32(implementation, example)


def _check_float32(implementation, example):
  gen = rng("flex-f32", implementation, example.name)
  p = _problem(example, gen, jnp.float32)
  _compare(_flash(implementation, example, p), _oracle(example, p))


def _check_bfloat16(implementation, name):
  """bfloat16 with key padding, by the FlashAttention rule."""
  example = EXAMPLE[name]
  gen = rng("flex-bf16", implementation, name)
  p = _problem(example, gen, jnp.bfloat16, padding=True)
  _compare(_flash(implementation, example, p), _oracle(example, p),
           _same_dtype_reference(example, p), jnp.bfloat16)


# A score_mod with an elementwise gather and a mask_mod per batch row run
# by default; the others in the slow leg.
_BF16_FAST = [("chunked", "t5"), ("chunked", "document"), ("xla", "alibi"),
              ("triton", "alibi"), ("triton", "t5")]
_BF16_FAST = [x for x in _BF16_FAST if x[0] in FLEX_IMPLEMENTATIONS]


@pytest.mark.parametrize("implementation,name", _BF16_FAST)
def test_example_bfloat16(implementation, name):
  _check_bfloat16(implementation, name)


@pytest.mark.slow
@pytest.mark.parametrize("implementation,example", RUNS)
def test_example_bfloat16_all(implementation, example):
  if (implementation, example.name) in _BF16_FAST:
    pytest.skip("runs by default")
  _check_bfloat16(implementation, example.name)


# Score_mods the mosaic_gpu kernels fuse (per-head values only), in the
# Mosaic GPU interpreter on a CPU (seconds to a minute each; a GPU runs them
# compiled).
_MOSAIC_GPU_RUNS = ["alibi", "tanh_soft_cap"]


@gpu_jax_only_on_cpu
@pytest.mark.skipif("mosaic_gpu" not in pallas_fa.implementations(),
                    reason="the mosaic_gpu backend does not import here")
@pytest.mark.parametrize("name", _MOSAIC_GPU_RUNS)
def test_mosaic_gpu_score_mod(name):
  _check_bfloat16("mosaic_gpu", name)


# Mask_mods the mosaic_gpu kernels fuse: their per-query / per-key values
# travel in the position slots beside padding lengths (`_check_bfloat16`),
# in the segment-id slots under causal masking (`_check_causal_gqa`).
_MOSAIC_GPU_MASKS = ["document", "prefix_lm", "chunked_causal",
                     "sliding_window_with_sinks", "causal_with_offset"]


def _check_causal_gqa(implementation, name):
  """Causal, T = S not a multiple of the tiles, GQA, no padding."""
  example = EXAMPLE[name]
  gen = rng("flex-causal-gqa", implementation, name)
  p = _problem(example, gen, jnp.bfloat16, b=2, t=70, s=70, n=4, k=2, h=16,
               causal=True)
  _compare(_flash(implementation, example, p, is_causal=True),
           _oracle(example, p, is_causal=True),
           _same_dtype_reference(example, p, is_causal=True), jnp.bfloat16)


# Every mask through both slots on a GPU; in the interpreter on a CPU, each
# mask once and each slot at least twice.
_MOSAIC_GPU_MASK_CASES = [
    (check, name) for check in ("padding", "causal")
    for name in _MOSAIC_GPU_MASKS]
if jax.default_backend() == "cpu":
  _MOSAIC_GPU_MASK_CASES = [
      ("padding", "document"), ("padding", "chunked_causal"),
      ("padding", "causal_with_offset"), ("causal", "prefix_lm"),
      ("causal", "sliding_window_with_sinks")]


@gpu_jax_only_on_cpu
@pytest.mark.skipif("mosaic_gpu" not in pallas_fa.implementations(),
                    reason="the mosaic_gpu backend does not import here")
@pytest.mark.parametrize("check,name", _MOSAIC_GPU_MASK_CASES)
def test_mosaic_gpu_mask_mod(check, name):
  {"padding": _check_bfloat16, "causal": _check_causal_gqa}[check](
      "mosaic_gpu", name)


def _check_ragged(implementation, name):
  """T != S (neither a multiple of the tiles), MQA, with is_causal and
  key padding intersecting the mask_mod."""
  example = EXAMPLE[name]
  gen = rng("flex-ragged", implementation, name)
  p = _problem(example, gen, jnp.float32, b=2, t=23, s=50, n=3, k=1, h=8,
               causal=True, padding=True)
  _compare(_flash(implementation, example, p, is_causal=True),
           _oracle(example, p, is_causal=True))


_RAGGED_FAST = [("chunked", "causal_with_offset"),
                ("triton", "sliding_window_with_sinks")]
_RAGGED_FAST = [x for x in _RAGGED_FAST if x[0] in FLEX_IMPLEMENTATIONS]


@pytest.mark.parametrize("implementation,name", _RAGGED_FAST)
def test_ragged_lengths_and_causal(implementation, name):
  _check_ragged(implementation, name)


@pytest.mark.slow
@pytest.mark.parametrize("implementation,example", RUNS)
def test_ragged_lengths_and_causal_all(implementation, example):
  if example.name == "document":
    pytest.skip("document ids index keys by query index: T == S only")
  if (implementation, example.name) in _RAGGED_FAST:
    pytest.skip("runs by default")
  _check_ragged(implementation, example.name)


def test_query_padding_and_bias_gradient():
  """query_seq_lengths and a dense bias combine with score_mod and
  mask_mod; chunked equals xla in every gradient, the bias included."""
  gen = rng("flex-padding")
  b, t, n, h = 2, 37, 4, 8
  q, k, v = (_normal(gen, (b, t, n, h)) for _ in range(3))
  bias = _normal(gen, (b, n, t, t))
  table = _normal(gen, (n, 2 * t))
  ids = jnp.asarray(np.sort(gen.integers(0, 3, (b, t)), axis=1), jnp.int32)

  def rel(score, batch, head, q_idx, kv_idx, table):
    return score + table[head, kv_idx - q_idx + t]

  def run(implementation):
    def f(q, k, v, bias, table):
      return pallas_fa.flash_attention(
          q, k, v, bias, score_mod=rel, score_mod_args=(table,),
          mask_mod=flex.document, mask_mod_args=(ids,),
          query_seq_lengths=jnp.array([t, 20]), is_causal=True,
          implementation=implementation,
          block_sizes=block_sizes_for(implementation), return_residual=True)

    (out, lse), pullback = jax.vjp(f, q, k, v, bias, table)
    return out, lse, pullback((_normal(rng("dout"), out.shape),
                               _normal(rng("dlse"), lse.shape)))

  got, want = run("chunked"), run("xla")
  _compare(got, want)


def test_jit_vmap_and_batched_arguments():
  """vmap over a leading axis batches q/k/v and both functions' arrays;
  jit changes nothing."""
  gen = rng("flex-vmap")
  e, b, t, n, h = 3, 1, 40, 2, 8
  q, k, v = (_normal(gen, (e, b, t, n, h)) for _ in range(3))
  slopes = jnp.asarray(gen.random((e, n)), jnp.float32)
  ids = jnp.asarray(np.sort(gen.integers(0, 3, (e, b, t)), axis=-1),
                    jnp.int32)

  def loss(q, k, v, slopes, ids, implementation="chunked"):
    out = pallas_fa.flash_attention(
        q, k, v, score_mod=flex.alibi, score_mod_args=(slopes,),
        mask_mod=flex.document, mask_mod_args=(ids,), is_causal=True,
        implementation=implementation,
        block_sizes=block_sizes_for(implementation))
    return jnp.sum(jnp.sin(out))

  grad = jax.grad(loss, argnums=(0, 3))
  batched = jax.jit(jax.vmap(grad))(q, k, v, slopes, ids)
  for i in range(e):
    want = jax.grad(loss, argnums=(0, 3))(
        q[i], k[i], v[i], slopes[i], ids[i], "xla")
    for x, r in zip(batched, want):
      assert_close("grad", x[i], r)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_grad_of_grad_through_score_mod(implementation):
  """Both jax.numpy backends differentiate twice through a score_mod and
  its arrays.

  Compiled at XLA's optimisation level 1, the default's lowest: at the
  level 0 this suite compiles at (conftest), XLA:CPU's code for chunked's
  program gives NaN once the score_mod reads the indices (levels 1-3 give
  the reference's values, on jax 0.10 and 0.11)."""
  gen = rng("flex-grad2")
  q, k, v = (_normal(gen, (1, 12, 2, 8)) for _ in range(3))
  slopes = jnp.asarray(gen.random(2), jnp.float32)

  def flash(q, slopes):
    return pallas_fa.flash_attention(
        q, k, v, score_mod=flex.alibi, score_mod_args=(slopes,),
        is_causal=True, implementation=implementation,
        block_sizes=block_sizes_for(implementation))

  def dense(q, slopes):
    return jax.nn.dot_product_attention(
        q, k, v, bias=_alibi_bias(slopes, 12, 12), is_causal=True)

  def grad_of_grad(attention):
    def inner(q, slopes):
      return jnp.sum(jnp.sin(attention(q, slopes)))
    fn = jax.jit(jax.grad(lambda q, slopes: jnp.sum(
        jax.grad(inner)(q, slopes) ** 2), argnums=(0, 1)))
    return fn.lower(q, slopes).compile(compiler_options={
        "xla_backend_optimization_level": 1})(q, slopes)

  for name, x, r in zip(("dq", "dslopes"), grad_of_grad(flash),
                        grad_of_grad(dense)):
    assert_close(name, x, r)


@jax.custom_jvp
def _straight_through_round(x):
  return jnp.round(x)


@_straight_through_round.defjvp
def _straight_through_round_jvp(primals, tangents):
  return _straight_through_round(primals[0]), tangents[0]


def _rounded_score(score, batch, head, q_idx, kv_idx, weights):
  del batch, q_idx, kv_idx
  return _straight_through_round(score * weights[head])


@pytest.mark.parametrize("implementation", FLEX_IMPLEMENTATIONS)
def test_score_mod_with_a_custom_derivative(implementation):
  """A score_mod calling a custom_jvp (a straight-through round): the
  kernels would fuse its body and differentiate that, silently (every
  gradient 0 here); they decline it by name, and the automatic choice and
  the jax.numpy backends apply the rule."""
  gen = rng("flex custom derivative", implementation)
  q, k, v = (testing.normal(gen, (1, 32, 2, 16)) for _ in range(3))
  weights = jnp.asarray([1.0, 2.0])

  def grads(implementation):
    def loss(q, weights):
      out = pallas_fa.flash_attention(
          q, k, v, score_mod=_rounded_score, score_mod_args=(weights,),
          implementation=implementation,
          block_sizes=block_sizes_for(implementation))
      return jnp.sum(jnp.sin(out))
    return jax.grad(loss, argnums=(0, 1))(q, weights)

  if implementation not in ("xla", "chunked"):
    with pytest.raises(NotImplementedError, match="custom derivative"):
      grads(implementation)
    implementation = None
  want = jax.grad(lambda q, weights: jnp.sum(jnp.sin(
      pallas_fa.flash_attention(
          q, k, v, score_mod=_rounded_score, score_mod_args=(weights,),
          implementation="xla"))), argnums=(0, 1))(q, weights)
  assert float(jnp.max(jnp.abs(want[0]))) > 0.1  # The rule's gradient.
  for name, x, r in zip(("dq", "dweights"), grads(implementation), want):
    assert_close(name, x, r)


@pytest.mark.parametrize("implementation", FLEX_IMPLEMENTATIONS)
def test_mask_mod_with_float_arrays(implementation):
  """A mask_mod's arrays are never differentiated, float ones included (as
  document ids kept in float): the kernels fuse it (triton refused it as
  needing per-token gradients) and every backend gives xla's values and
  gradients."""
  gen = rng("flex-float-mask-args")
  q, k, v = (_normal(gen, (2, 40, 2, 16)) for _ in range(3))
  docs = jnp.asarray(np.sort(gen.integers(0, 3, (2, 40)), axis=1),
                     jnp.float32)

  def loss(q, k, v, implementation):
    out = pallas_fa.flash_attention(
        q, k, v, is_causal=True,
        mask_mod=lambda b, h, i, j, d: d[b, i] == d[b, j],
        mask_mod_args=(docs,), implementation=implementation,
        block_sizes=block_sizes_for(implementation))
    return jnp.sum(jnp.sin(out))

  grads = jax.grad(loss, argnums=(0, 1, 2))
  for name, x, r in zip("qkv", grads(q, k, v, implementation),
                        grads(q, k, v, "xla")):
    assert_close("d" + name, x, r)


# --------------------------------------------------------------------------
# Block masks.
# --------------------------------------------------------------------------


def _brute_force_kinds(dense, block_q, block_kv):
  """EMPTY/PARTIAL/FULL of dense bool [Bm, Hm, T, S] per tile; elements
  past T or S do not count."""
  bm, hm, t, s = dense.shape
  nq, nk = -(-t // block_q), -(-s // block_kv)
  kinds = np.zeros((bm, hm, nq, nk), np.int32)
  for i in range(nq):
    for j in range(nk):
      tile = dense[:, :, i * block_q:(i + 1) * block_q,
                   j * block_kv:(j + 1) * block_kv]
      seen, whole = tile.any(axis=(2, 3)), tile.all(axis=(2, 3))
      kinds[:, :, i, j] = np.where(
          ~seen, masking.EMPTY, np.where(whole, masking.FULL,
                                         masking.PARTIAL))
  return kinds


def _random_dense_mask(gen, b, h, t, s):
  """A random mask with empty, full and partial tiles at tilings up to 16:
  a solid block top left, noise in the middle, random rectangles (solid or
  noisy), and the bottom right 16 x 16 corner empty."""
  dense = np.zeros((b, h, t, s), bool)
  dense[:, :, :33, :33] = True
  dense[:, :, 10:t - 10, 10:s - 10] |= gen.random(
      (b, h, t - 20, s - 20)) < 0.3
  for _ in range(4):
    r0, c0 = gen.integers(0, t), gen.integers(0, s)
    r1, c1 = r0 + gen.integers(1, t // 2), c0 + gen.integers(1, s // 2)
    patch = dense[:, :, r0:r1, c0:c1]
    patch |= gen.random(patch.shape) < (1.0 if gen.random() < 0.5 else 0.3)
  dense[:, :, t - 16:, s - 16:] = False
  return dense


def _table_mask(batch, head, q_idx, kv_idx, table):
  return table[batch, head, q_idx, kv_idx]


@pytest.mark.parametrize("seed", range(3))
def test_create_block_mask_is_exact(seed):
  gen = rng("block-mask", seed)
  b, h = 2, 3
  t, s = gen.integers(40, 70, 2)
  bq, bk = (int(x) for x in gen.choice([4, 8, 16], 2))
  dense = _random_dense_mask(gen, b, h, t, s)
  bm = pallas_fa.create_block_mask(
      _table_mask, (jnp.asarray(dense),), batch=b, heads=h, q_len=int(t),
      kv_len=int(s), block_q=bq, block_kv=bk)
  want = _brute_force_kinds(dense, bq, bk)
  np.testing.assert_array_equal(np.asarray(bm.kinds()), want)
  assert {masking.EMPTY, masking.FULL, masking.PARTIAL} <= set(want.flat)
  # The lists: non-empty key tiles ascending, flags, and the transpose.
  count = np.asarray(bm.kv_num_blocks)
  indices, full = np.asarray(bm.kv_indices), np.asarray(bm.kv_full)
  for (i, j, r), n in np.ndenumerate(count):
    listed = indices[i, j, r, :n]
    np.testing.assert_array_equal(listed, np.flatnonzero(
        want[i, j, r] != masking.EMPTY))
    np.testing.assert_array_equal(full[i, j, r, :n],
                                  want[i, j, r, listed] == masking.FULL)
  transposed = block_mask_lib._kinds_from_lists(
      bm.q_num_blocks, bm.q_indices, bm.q_full)
  np.testing.assert_array_equal(np.swapaxes(np.asarray(transposed), 2, 3),
                                want)


def test_block_mask_under_jit_and_broadcast_dims():
  """Made under jit from traced arguments; a mask that reads neither batch
  nor head is stored once (Bm = Hm = 1)."""
  gen = rng("block-mask-jit")
  ids = jnp.asarray(np.sort(gen.integers(0, 5, (2, 50)), axis=1), jnp.int32)

  @jax.jit
  def make(ids):
    return pallas_fa.create_block_mask(
        flex.document, (ids,), batch=2, heads=4, q_len=50, kv_len=50,
        block_q=8, block_kv=16)

  bm = make(ids)
  assert bm.kv_indices.shape == (2, 1, 7, 4)
  dense = np.asarray(ids)[:, None, :, None] == np.asarray(ids)[:, None,
                                                               None, :]
  np.testing.assert_array_equal(np.asarray(bm.kinds()),
                                _brute_force_kinds(dense, 8, 16))
  shared = pallas_fa.create_block_mask(
      flex.chunked_causal, (jnp.int32(7),), batch=2, heads=4, q_len=50,
      kv_len=50, block_q=8, block_kv=8)
  assert shared.kv_indices.shape == (1, 1, 7, 7)


def test_retile_nested_tilings():
  gen = rng("retile")
  dense = _random_dense_mask(gen, 1, 2, 45, 61)
  fine = _brute_force_kinds(dense, 8, 4)
  # Coarser, whole multiples: exactly the classification at those tiles.
  coarse = block_mask_lib.retile(jnp.asarray(fine), old=(8, 4),
                                 new=(16, 12), q_len=45, kv_len=61)
  np.testing.assert_array_equal(np.asarray(coarse),
                                _brute_force_kinds(dense, 16, 12))
  # Finer: EMPTY and FULL stay exact, parts of PARTIAL tiles stay PARTIAL.
  finer = np.asarray(block_mask_lib.retile(
      jnp.asarray(fine), old=(8, 4), new=(4, 2), q_len=45, kv_len=61))
  exact = _brute_force_kinds(dense, 4, 2)
  parent = np.repeat(np.repeat(fine, 2, axis=2), 2, axis=3)[
      :, :, :exact.shape[2], :exact.shape[3]]
  np.testing.assert_array_equal(
      finer, np.where(parent == masking.PARTIAL, masking.PARTIAL, exact))
  with pytest.raises(ValueError, match="block_q=8.*block_q=12"):
    block_mask_lib.retile(jnp.asarray(fine), old=(8, 4), new=(12, 4),
                          q_len=45, kv_len=61)


def _document_problem(gen, b=1, t=64, n=2, h=8):
  q, k, v = (_normal(gen, (b, t, n, h)) for _ in range(3))
  ids = jnp.asarray(np.sort(gen.integers(0, 4, (b, t)), axis=1), jnp.int32)
  return q, k, v, ids


def test_block_mask_is_reused_and_supplies_the_mask_mod():
  gen = rng("block-mask-reuse")
  q, k, v, ids = _document_problem(gen, b=2, t=50)
  want = pallas_fa.flash_attention(q, k, v, mask_mod=flex.document,
                                   mask_mod_args=(ids,), implementation="xla")
  # Tiles the chunked tiles (16 x 32, 32 x 16) are multiples of, and odd
  # ones they are not (the chunked backend then runs on the mask's tiles).
  for tiles, kw in (((8, 16), {}),
                    ((5, 7), dict(mask_mod=flex.document,
                                  mask_mod_args=(ids,)))):
    bm = pallas_fa.create_block_mask(
        flex.document, (ids,), batch=2, heads=None, q_len=50, kv_len=50,
        block_q=tiles[0], block_kv=tiles[1])
    got = pallas_fa.flash_attention(
        q, k, v, block_mask=bm, implementation="chunked",
        block_sizes=block_sizes_for("chunked"), **kw)
    assert_close("out", got, want)


def test_block_mask_mutation_is_caught():
  """Marking a partial tile full skips its mask: the result is wrong, and
  the exactness check sees it. (This is what the tests above guard.)"""
  gen = rng("block-mask-mutation")
  q, k, v, ids = _document_problem(gen)
  bm = pallas_fa.create_block_mask(
      flex.document, (ids,), batch=1, heads=None, q_len=64, kv_len=64,
      block_q=16, block_kv=16)
  kinds = np.asarray(bm.kinds())
  dense = np.asarray(ids)[:, None, :, None] == np.asarray(ids)[:, None,
                                                               None, :]
  np.testing.assert_array_equal(kinds, _brute_force_kinds(dense, 16, 16))
  partial = np.argwhere(kinds == masking.PARTIAL)
  assert len(partial)
  mutated = kinds.copy()
  mutated[tuple(partial[0])] = masking.FULL
  assert not np.array_equal(mutated, _brute_force_kinds(dense, 16, 16))
  bad = block_mask_lib.from_kinds(
      mutated, block_q=16, block_kv=16, q_len=64, kv_len=64,
      mask_mod=flex.document, mask_mod_args=(ids,))
  want = pallas_fa.flash_attention(q, k, v, mask_mod=flex.document,
                                   mask_mod_args=(ids,), implementation="xla")
  got = pallas_fa.flash_attention(
      q, k, v, block_mask=bad, implementation="chunked",
      block_sizes=chunked.ChunkedBlockSizes(
          block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=16))
  with pytest.raises(testing.Mismatch):
    assert_close("out", got, want)


def test_chunked_visits_only_the_block_masks_tiles(monkeypatch):
  """Count the tiles the chunked passes compute (a callback in the logit
  tile) and those they evaluate the mask_mod on: exactly the non-empty
  and the partial tiles of the block mask, forward and backward."""
  gen = rng("skipping")
  t = 64
  q, k, v, ids = _document_problem(gen, t=t)
  config = chunked.ChunkedBlockSizes(block_q=16, block_kv=32,
                                     block_q_bwd=32, block_kv_bwd=16)
  bm = pallas_fa.create_block_mask(
      flex.document, (ids,), batch=1, heads=None, q_len=t, kv_len=t,
      block_q=16, block_kv=16)
  visits = {"logits": [], "mask_mod": []}

  def record(kind, i, j, bq, bk):
    visits[kind].append((int(i), int(j), bq, bk))

  logits, visibility = chunked._Layout.logits, chunked._Layout.visibility

  def counted_logits(self, qi, kj, part, *args, **kw):
    jax.debug.callback(functools.partial(
        record, "logits", bq=self.bq, bk=self.bk),
        part.q0 // self.bq, part.k0 // self.bk)
    return logits(self, qi, kj, part, *args, **kw)

  def counted_visibility(self, part, visit):
    if visit.mod:
      jax.debug.callback(functools.partial(
          record, "mask_mod", bq=self.bq, bk=self.bk),
          part.q0 // self.bq, part.k0 // self.bk)
    return visibility(self, part, visit)

  monkeypatch.setattr(chunked._Layout, "logits", counted_logits)
  monkeypatch.setattr(chunked._Layout, "visibility", counted_visibility)
  api.clear_cache()
  try:
    jax.grad(lambda q: pallas_fa.flash_attention(
        q, k, v, block_mask=bm, implementation="chunked",
        block_sizes=config).sum())(q)
  finally:
    api.clear_cache()
  kinds = np.asarray(bm.kinds())[0, 0]  # [4, 4] tiles of 16 x 16.
  for tiles in ((16, 32), (32, 16)):  # The forward's, the backward's.
    want = np.asarray(block_mask_lib.retile(
        jnp.asarray(kinds), old=(16, 16), new=tiles, q_len=t, kv_len=t))
    got_logits = {(i, j) for i, j, bq, bk in visits["logits"]
                  if (bq, bk) == tiles}
    got_mod = {(i, j) for i, j, bq, bk in visits["mask_mod"]
               if (bq, bk) == tiles}
    assert got_logits == {tuple(x) for x in np.argwhere(
        want != masking.EMPTY)}, tiles
    assert got_mod == {tuple(x) for x in np.argwhere(
        want == masking.PARTIAL)}, tiles
    # Each visited tile once per pass.
    assert len([1 for *_, bq, bk in visits["logits"]
                if (bq, bk) == tiles]) == len(got_logits)
  assert (kinds == masking.EMPTY).any() and (kinds == masking.FULL).any()


@pytest.mark.skipif("triton" not in FLEX_IMPLEMENTATIONS,
                    reason="the triton backend does not import here")
def test_triton_visits_only_the_block_masks_tiles(monkeypatch):
  """The triton kernels (interpreted) compute exactly the non-empty tiles
  of the block mask intersected with causal masking, and evaluate the
  mask_mod on exactly the partial ones, in each of the three kernels."""
  from pallas_fa import triton  # noqa: PLC0415
  from pallas_fa.triton import kernel  # noqa: PLC0415

  gen = rng("triton-skipping")
  t = 64
  q, k, v, _ = _document_problem(gen, t=t)
  # Two documents: EMPTY, PARTIAL and FULL tiles under causal masking.
  ids = jnp.asarray([[0] * 40 + [1] * 24], jnp.int32)
  config = triton.TritonBlockSizes(
      block_q=16, block_kv=32, block_q_dkv=32, block_kv_dkv=16,
      block_q_dq=16, block_kv_dq=16)
  bm = pallas_fa.create_block_mask(
      flex.document, (ids,), batch=1, heads=None, q_len=t, kv_len=t,
      block_q=16, block_kv=16)
  visits = {"logits": [], "mask_mod": []}

  def record(kind, tile):
    # The tile's first query and key, and its shape (the kernel's tiles).
    rows, cols = (tile.q_idx.size, tile.kv_idx.size)
    jax.debug.callback(
        lambda i, j: visits[kind].append((int(i), int(j), rows, cols)),
        tile.q_idx.min(), tile.kv_idx.min())

  logits, with_mod = kernel._tile_scores, kernel._with_mask_mod

  def counted_logits(refs, feat, qk, bias, tile, grad, **kw):
    record("logits", tile)
    return logits(refs, feat, qk, bias, tile, grad, **kw)

  def counted_mod(refs, feat, visible, tile):
    record("mask_mod", tile)
    return with_mod(refs, feat, visible, tile)

  # Interpreted on a GPU too (no GPU target: no inline PTX either):
  # compiled Triton kernels cannot call back.
  monkeypatch.setattr(gpu_target, "current", lambda: None)
  monkeypatch.setattr(kernel, "_tile_scores", counted_logits)
  monkeypatch.setattr(kernel, "_with_mask_mod", counted_mod)
  api.clear_cache()
  try:
    # All three gradients, so that no kernel's outputs go unused (jax 0.12
    # drops an unused pallas_call, with its callbacks).
    jax.grad(lambda q, k, v: pallas_fa.flash_attention(
        q, k, v, block_mask=bm, is_causal=True, implementation="triton",
        block_sizes=config).sum(), argnums=(0, 1, 2))(q, k, v)
  finally:
    api.clear_cache()
  n = q.shape[2]
  causal = _brute_force_kinds(np.tril(np.ones((1, 1, t, t), bool)),
                              16, 16)[0, 0]
  kinds = np.minimum(np.asarray(bm.kinds())[0, 0], causal)
  for tiles in ((16, 32), (32, 16), (16, 16)):  # fwd, dK/dV, dQ.
    want = np.asarray(block_mask_lib.retile(
        jnp.asarray(kinds), old=(16, 16), new=tiles, q_len=t, kv_len=t))
    got = {kind: [(i // tiles[0], j // tiles[1])
                  for i, j, rows, cols in visits[kind]
                  if (rows, cols) == tiles] for kind in visits}
    nonempty = [tuple(x) for x in np.argwhere(want != masking.EMPTY)]
    partial = [tuple(x) for x in np.argwhere(want == masking.PARTIAL)]
    # Each tile once per query head and kernel.
    assert sorted(got["logits"]) == sorted(nonempty * n), tiles
    assert sorted(got["mask_mod"]) == sorted(partial * n), tiles
  assert (kinds == masking.EMPTY).any() and (kinds == masking.FULL).any()


# --------------------------------------------------------------------------
# Decode, the Pallas backends, argument checks.
# --------------------------------------------------------------------------


_DECODE_FLEX = [name for name in ("chunked", "triton", "mosaic_tpu")
                if name == "chunked" or name in pallas_fa.implementations()]


def _decode_problem(gen, s=90):
  b, t, n, kh, h = 2, 3, 4, 2, 16
  q = _normal(gen, (b, t, n, h))
  k, v = (_normal(gen, (b, s, kh, h)) for _ in range(2))
  return q, k, v, jnp.array([50, 87])


@pytest.mark.parametrize("implementation", _DECODE_FLEX)
def test_decode_attention(implementation):
  """q_idx is the new token's position: decode equals jax.nn's attention
  on the cache with the dense bias and mask of those positions (ALiBi, a
  sliding window with sink tokens: per-head, per-query and per-key values
  of the fused triton kernel)."""
  gen = rng("flex-decode")
  q, k, v, lengths = _decode_problem(gen)
  t, n, s = q.shape[1], q.shape[2], k.shape[1]
  slopes = flex.alibi_slopes(n)
  window, sinks = jnp.int32(20), jnp.int32(3)
  out = pallas_fa.decode_attention(
      q, k, v, lengths, score_mod=flex.alibi, score_mod_args=(slopes,),
      mask_mod=flex.sliding_window_with_sinks,
      mask_mod_args=(window, sinks), block_kv=16, num_splits=2,
      implementation=implementation)
  positions = lengths[:, None] - t + jnp.arange(t)[None, :]
  qi = positions[:, None, :, None]
  ki = jnp.arange(s)[None, None, None, :]
  dense_bias = -slopes[None, :, None, None] * jnp.abs(qi - ki)
  dense_mask = (ki <= qi) & ((qi - ki < window) | (ki < sinks))
  want = jax.nn.dot_product_attention(
      q, k, v, bias=dense_bias, mask=dense_mask,
      key_value_seq_lengths=lengths)
  assert_close("out", out, want)


def _window_by_head(batch, head, q_idx, kv_idx, windows):
  """A sliding window of `windows[head]` keys: the blocks a query sees
  differ between heads."""
  del batch
  return q_idx - kv_idx < windows[head]


# 10 s on the TPU interpreter: the slow leg (its listed blocks run by
# default in test_decode_quantized_mosaic_tpu).
@pytest.mark.parametrize("implementation", _DECODE_FLEX)
@pytest.mark.slow_for("mosaic_tpu")
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("mask_mod, mask_mod_args", [
    (flex.sliding_window_with_sinks, (jnp.int32(64), jnp.int32(3))),
    (flex.chunked_causal, (jnp.int32(64),)),
    (_window_by_head, (jnp.array([16, 40, 100, 120]),)),
])
def test_decode_never_reads_what_the_mask_mod_hides(
    mask_mod, mask_mod_args, splits, implementation):
  """Keys that no new token sees under the mask_mod (a StreamingLLM
  window's middle, the chunks before the current one) are never read: the
  cache there is poisoned with NaN and the result is still the
  reference's; the blocks every token sees whole (inside both windows)
  skip the masking. `chunked` skips a step (`splits` blocks) that no
  sequence sees, the kernels the blocks a sequence's K/V head does not see
  (with per-head windows, a different set for each K/V head)."""
  gen = rng(f"flex-decode-skip-{splits}")
  b, t, n, kh, h, s, block = 2, 2, 4, 2, 16, 256, 16
  q = _normal(gen, (b, t, n, h))
  k, v = (_normal(gen, (b, s, kh, h)) for _ in range(2))
  lengths = jnp.array([256, 230])
  positions = lengths[:, None] - t + jnp.arange(t)[None, :]
  qi = positions[:, None, :, None]
  ki = jnp.arange(s)[None, None, None, :]
  heads = jnp.arange(n)[None, :, None, None]
  dense_mask = mask_mod(None, heads, qi, ki, *mask_mod_args) & (ki <= qi)
  want = jax.nn.dot_product_attention(
      q, k, v, mask=dense_mask, key_value_seq_lengths=lengths)
  seen = np.broadcast_to(dense_mask & (ki < lengths[:, None, None, None]),
                         (b, n, t, s)).reshape(b, kh, n // kh, t, s)
  if implementation == "chunked":  # A step reads `splits` blocks.
    span = splits * block
    hidden = ~seen.reshape(b, kh, -1, s // span, span).any(axis=(0, 1, 2, 4))
    hidden = np.broadcast_to(hidden[None, :, None], (b, s // span, kh))
  else:
    span = block
    hidden = ~seen.reshape(b, kh, -1, s // span, span).any(axis=(2, 4))
    hidden = hidden.transpose(0, 2, 1)  # [B, blocks, K]
  assert hidden.sum() >= 3 * b * kh, hidden
  poison = jnp.repeat(jnp.asarray(hidden), span, axis=1)[..., None]
  k_bad, v_bad = (jnp.where(poison, jnp.nan, x) for x in (k, v))
  got = pallas_fa.decode_attention(
      q, k_bad, v_bad, lengths, mask_mod=mask_mod,
      mask_mod_args=mask_mod_args, block_kv=block, num_splits=splits,
      implementation=implementation)
  assert_close("out", got, want)


_DECODE_KERNELS = [name for name in _DECODE_FLEX if name != "chunked"]


@pytest.mark.parametrize("implementation", _DECODE_KERNELS)
def test_decode_attention_paged_and_declines(implementation):
  """A paged cache (shuffled pages): the kernels read the per-key values
  at the logical positions; prefix-LM (a per-batch-row value per key) with
  a learned soft cap. A per-key value that depends on the head cannot be
  fused (one column serves every head of a row tile): declined."""
  gen = rng("flex-decode-paged")
  q, k, v, lengths = _decode_problem(gen, s=96)
  page, b = 16, q.shape[0]
  per_row = k.shape[1] // page
  table = jnp.asarray(gen.permutation(b * per_row).reshape(b, per_row),
                      jnp.int32)
  # Page table[row, j] holds keys [j * page, (j + 1) * page) of the row.
  order = np.argsort(np.asarray(table).reshape(-1))
  pool = [x.reshape((b * per_row, page) + x.shape[2:])[order]
          for x in (k, v)]
  kw = dict(score_mod=flex.tanh_soft_cap, score_mod_args=(jnp.float32(2.5),),
            mask_mod=flex.prefix_lm, mask_mod_args=(jnp.array([10, 30]),))
  got = pallas_fa.decode_attention(q, *pool, lengths, block_table=table,
                                   implementation=implementation, **kw)
  want = pallas_fa.decode_attention(q, k, v, lengths, **kw)
  assert_close("out", got, want)
  with pytest.raises(NotImplementedError, match="depends on the head"):
    pallas_fa.decode_attention(q, k, v, lengths, mask_mod=_striped,
                               implementation=implementation)


_PALLAS = [name for name in ("triton", "mosaic_gpu", "mosaic_tpu")
           if name in pallas_fa.implementations()]



def _per_head_window(batch, head, q_idx, kv_idx, widths):
  """Causal within a window whose width is the head's own: its tiles differ
  between heads (per-head tile lists in the triton kernels)."""
  del batch
  return (kv_idx <= q_idx) & (q_idx - kv_idx < widths[head])


def _whole_rows(batch, head, q_idx, kv_idx, keep):
  """A per-batch-row value only: row 1's queries see nothing (zeros, lse
  -inf, zero gradients)."""
  del head, q_idx, kv_idx
  return keep[batch] > 0


_MASK_CASES = {
    "per_head_window": dict(mask_mod=_per_head_window,
                            mask_mod_args=(jnp.array([3, 60, 9, 17]),)),
    "whole_rows": dict(mask_mod=_whole_rows,
                       mask_mod_args=(jnp.array([1, 0]),)),
}
_MASK_RUNS = [
    pytest.param(impl, name, id=f"{name}-{impl}",
                 marks=() if (impl, name) == ("triton", "per_head_window")
                 else pytest.mark.slow)
    for impl in _PALLAS for name in _MASK_CASES]


@pytest.mark.parametrize("implementation,name", _MASK_RUNS)
def test_mask_mods_by_head_and_by_batch_row(implementation, name):
  """Tiles that differ between the heads of a GQA group, and a mask_mod
  that is one value per (batch, head): forward, lse and gradients against
  xla (mosaic_gpu in bfloat16, by the FlashAttention rule)."""
  gen = rng("flex-mask-cases", implementation, name)
  q = _normal(gen, (2, 50, 4, 16))
  k, v = (_normal(gen, (2, 50, 2, 16)) for _ in range(2))
  dout = _normal(gen, q.shape)

  def run(impl, dtype=jnp.float32):
    def f(q, k, v):
      return pallas_fa.flash_attention(
          q, k, v, implementation=impl, block_sizes=block_sizes_for(impl),
          return_residual=True, **_MASK_CASES[name])
    (out, lse), pullback = jax.vjp(
        f, *(x.astype(dtype) for x in (q, k, v)))
    return out, lse, pullback((dout.astype(dtype), jnp.zeros_like(lse)))

  if implementation == "mosaic_gpu":  # bfloat16/float16 kernels only.
    _compare(run(implementation, jnp.bfloat16), run("xla"),
             run("xla", jnp.bfloat16), jnp.bfloat16)
  else:
    _compare(run(implementation), run("xla"))


def _striped(batch, head, q_idx, kv_idx):
  """A mask_mod whose per-key value depends on the head."""
  del batch, q_idx
  return (kv_idx + head) % 3 != 0


def _query_shift(score, batch, head, q_idx, kv_idx, offsets):
  """A score_mod that reads a value per query (q_idx + offsets[batch])."""
  del head, kv_idx
  return score + 0.01 * (q_idx + offsets[batch]).astype(score.dtype)


def test_pallas_backends_decline_and_automatic_choice_falls_back(
    monkeypatch):
  gen = rng("flex-decline")
  # bfloat16: a dtype every backend computes in, so flex is what declines.
  q, k, v, ids = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x
                  for x in _document_problem(gen, t=32))
  slopes = flex.alibi_slopes(2)
  table = jnp.asarray(gen.normal(size=(2, 8)), jnp.float32)
  calls = (dict(score_mod=flex.alibi, score_mod_args=(slopes,)),
           dict(mask_mod=flex.document, mask_mod_args=(ids,)))
  t5 = dict(score_mod=flex.t5_relative_bias, score_mod_args=(table,))
  per_query = dict(score_mod=_query_shift,
                   score_mod_args=(jnp.arange(q.shape[0], dtype=jnp.int32),))
  # (implementation, call, the reason it declines).
  striped = dict(mask_mod=_striped)
  # Causal and padding lengths: both metadata slots are taken.
  both_slots = dict(calls[1], is_causal=True, key_value_seq_lengths=jnp.full(
      (q.shape[0],), q.shape[1] - 3, jnp.int32))
  # More table entries per program than the Mosaic TPU kernels select.
  wide = jnp.asarray(gen.normal(size=(2, 300)), jnp.float32)
  t5_wide = dict(score_mod=flex.t5_relative_bias, score_mod_args=(wide,))
  declined = [
      ("mosaic_tpu", t5_wide, "score_mod.* 300 entries.* 256"),
      ("mosaic_tpu", striped, "depends on the head"),
      ("mosaic_gpu", both_slots, "needs both"),
      ("mosaic_gpu", per_query, "per query or key"),
      # A gather at q_idx - kv_idx cannot run in a kernel: named, declined.
      ("mosaic_gpu", t5, "cannot fuse this score_mod.*dynamic_slice"),
  ]
  for implementation, kw, reason in declined:
    if implementation in _PALLAS:
      with pytest.raises(NotImplementedError, match=reason):
        pallas_fa.flash_attention(q, k, v, implementation=implementation,
                                  **kw)
  if not _PALLAS:
    pytest.skip("no Pallas backend imports here")
  monkeypatch.setitem(api.AUTO_ORDER, api.platform(),
                      tuple(_PALLAS) + ("chunked",))
  api.clear_cache()
  try:
    for kw in (*calls, t5):
      first = "triton" if "triton" in _PALLAS else "chunked"
      np.testing.assert_array_equal(
          pallas_fa.flash_attention(q, k, v, **kw),
          pallas_fa.flash_attention(q, k, v, implementation=first, **kw))
  finally:
    api.clear_cache()


def _relative_bias(score, batch, head, q_idx, kv_idx, table):
  """A learned relative bias per head over clipped distances: a wider
  table than T5's, read at kv_idx - q_idx directly."""
  del batch
  span = (table.shape[1] - 1) // 2
  return score + table[head, jnp.clip(kv_idx - q_idx, -span, span) + span]


def _shared_buckets(score, batch, head, q_idx, kv_idx, table):
  """T5's buckets in one table shared by every head (its reads do not
  depend on the head), scaled by a per-batch-row factor."""
  bucket = flex.t5_bucket(kv_idx - q_idx, table.shape[0])
  return score + table[bucket] * (1.0 + batch).astype(score.dtype)


# name: (score_mod, the table's heads (None: one for all), its width,
# is_causal).
_TABLE_CASES = {
    "relative_bias": (_relative_bias, 4, 41, True),
    "relative_bias_bidirectional": (_relative_bias, 4, 41, False),
    "shared_buckets": (_shared_buckets, None, 16, True),
}
# The backends that fuse a table read into their kernels.
# On the TPU interpreter in the slow leg (14 s): test_mosaic_tpu's table
# tests run its table reads by default.
_TABLE_RUNS = [pytest.param(i, name, id=f"{name}-{i}",
                            marks=pytest.mark.slow if i == "mosaic_tpu" else ())
               for i in ("triton", "mosaic_tpu") if i in FLEX_IMPLEMENTATIONS
               for name in sorted(_TABLE_CASES)]


@pytest.mark.parametrize("implementation,name", _TABLE_RUNS)
def test_table_score_mods(implementation, name):
  """Tables read at computed offsets (per head, or one for every head)
  with GQA and ragged lengths, causal or not: out, lse and every gradient,
  the table's included, against xla in float32; and the table's gradient
  (per-program partial tables summed after the kernel) bitwise the same on
  a second run."""
  fn, heads, width, causal = _TABLE_CASES[name]
  gen = rng("flex-tables", name)
  b, t, n, kh, h = 2, 37, 4, 2, 16
  q = _normal(gen, (b, t, n, h))
  k, v = (_normal(gen, (b, t, kh, h)) for _ in range(2))
  table = _normal(gen, (width,) if heads is None else (heads, width))
  dout, dlse = _normal(gen, q.shape), _normal(gen, (b, t, n))

  def run(impl):
    def f(q, k, v, table):
      return pallas_fa.flash_attention(
          q, k, v, is_causal=causal, score_mod=fn, score_mod_args=(table,),
          implementation=impl, block_sizes=block_sizes_for(impl),
          return_residual=True)
    (out, lse), pullback = jax.vjp(f, q, k, v, table)
    return out, lse, pullback((dout, dlse))

  got = run(implementation)
  _compare(got, run("xla"))
  again = run(implementation)
  np.testing.assert_array_equal(got[2][3], again[2][3])


def _bfloat16_ulps(x, ref):
  """|x - ref| in bfloat16 steps, elementwise (both rounded to bfloat16)."""
  def ordered(a):  # Bit patterns as integers in the order of the values.
    bits = np.asarray(a).astype(jnp.bfloat16).view(np.int16).astype(np.int32)
    return np.where(bits < 0, -(bits & 0x7FFF), bits)
  return np.abs(ordered(x) - ordered(ref))


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_bfloat16_table_gradient_is_summed_in_float32(implementation):
  """A bfloat16 table's gradient sums one cotangent per logit that reads
  an entry (hundreds for the clipped distances): summed in float32 and
  rounded once, it is the float64 gradient rounded to bfloat16, give or
  take a rounding (summed in bfloat16, it is tens of ulps off)."""
  gen = rng("flex-bf16-table-grad", implementation)
  b, t, n, kh, h = 2, 64, 4, 2, 16
  q = _normal(gen, (b, t, n, h))
  k, v = (_normal(gen, (b, t, kh, h)) for _ in range(2))
  table = _normal(gen, (n, 41), jnp.bfloat16)
  dout = _normal(gen, q.shape)

  def f(table):
    return pallas_fa.flash_attention(
        q, k, v, score_mod=_relative_bias, score_mod_args=(table,),
        implementation=implementation,
        block_sizes=block_sizes_for(implementation))

  _, pullback = jax.vjp(f, table)
  (got,) = pullback(dout)
  assert got.dtype == jnp.bfloat16
  example = Example(
      "relative_bias", _relative_bias, None, None,
      dense_logits=lambda x, table: _relative_bias(
          x, 0, jnp.arange(n)[None, :, None, None],
          *(i[None, None] for i in _grid(t, t)), table))
  with jax.enable_x64(True):
    f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, table)]
    dense = functools.partial(_dense, example=example, mask=True,
                              scale=1 / np.sqrt(h))
    _, pullback = jax.vjp(lambda *args: dense(*args)[0], *f64)
    want = np.asarray(pullback(jnp.asarray(dout, jnp.float64))[3])
  ulps = _bfloat16_ulps(got, want)
  assert ulps.max() <= 1, (
      f"d(table) is up to {ulps.max()} bfloat16 ulps from the float64 "
      f"gradient rounded once ({np.sum(ulps > 1)} of {ulps.size} entries "
      f"off by more than 1)")


def test_argument_errors():
  gen = rng("flex-errors")
  q, k, v, ids = _document_problem(gen, t=16)
  slopes = jnp.ones(2)
  fa = functools.partial(pallas_fa.flash_attention, q, k, v)
  with pytest.raises(TypeError, match="score_mod must be callable"):
    fa(score_mod=3)
  with pytest.raises(TypeError, match="mask_mod must take 4 positional"):
    fa(mask_mod=flex.document)  # Its document ids are missing.
  with pytest.raises(TypeError, match="score_mod_args must be a tuple"):
    fa(score_mod=flex.alibi, score_mod_args=slopes)
  with pytest.raises(ValueError, match="mask_mod_args given without"):
    fa(mask_mod_args=(ids,))
  with pytest.raises(TypeError, match="mask_mod must return bool"):
    fa(mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx)
  with pytest.raises(ValueError, match="broadcasts against the tile"):
    fa(score_mod=lambda s, b, h, q_idx, kv_idx: jnp.zeros(5))
  # Closures: a float array (no gradient would reach it), a traced value.
  with pytest.raises(ValueError, match="pass it through score_mod_args"):
    fa(score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h])
  with pytest.raises(ValueError, match="pass it through score_mod_args"):
    jax.grad(lambda sl: fa(
        score_mod=lambda s, b, h, q_idx, kv_idx: s + sl[h]).sum())(slopes)
  with pytest.raises(ValueError, match="pass it through mask_mod_args"):
    jax.jit(lambda ids: fa(
        mask_mod=lambda b, h, q_idx, kv_idx: ids[b, q_idx] >= 0))(ids)
  # Constants the function makes itself and Python numbers are fine.
  fa(score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.5 + jnp.array(
      [1.0, 2.0])[h])
  bm = pallas_fa.create_block_mask(flex.document, (ids,), batch=1,
                                   heads=None, q_len=16, kv_len=16)
  with pytest.raises(ValueError, match="block_mask was made for q_len=16"):
    pallas_fa.flash_attention(q[:, :8], k, v, block_mask=bm)
  with pytest.raises(ValueError, match="block_mask covers batch=1, but"):
    pallas_fa.flash_attention(*(jnp.concatenate([x] * 3) for x in (q, k, v)),
                              block_mask=bm)
  with pytest.raises(ValueError, match="block_mask was made from mask_mod"):
    fa(block_mask=bm, mask_mod=flex.prefix_lm,
       mask_mod_args=(jnp.ones(1, jnp.int32),))
  with pytest.raises(TypeError, match="block_mask must be a pallas_fa"):
    fa(block_mask=np.ones((1, 1, 1, 1)))
  with pytest.raises(ValueError, match="block_q must be a positive int"):
    pallas_fa.create_block_mask(flex.document, (ids,), batch=1, heads=1,
                                q_len=16, kv_len=16, block_q=0)
  with pytest.raises(TypeError, match="score_mod_args\\[0\\] must be an array"):
    fa(score_mod=flex.alibi, score_mod_args=(None,))


def test_results_shaped_by_neither_index_are_refused():
  """A result that broadcasts against the (2, 3) probe tile by accident (a
  (3,) array) fails on a (5, 7) one: a ValueError naming the function,
  not jnp's broadcasting error on the call's own tiles."""
  q, k, v, _ = _document_problem(rng("flex-probe"), t=8)
  for implementation in ("xla", "chunked"):
    fa = functools.partial(pallas_fa.flash_attention, q, k, v,
                           implementation=implementation)
    with pytest.raises(ValueError, match=r"score_mod .*\(5, 7\) tile"):
      fa(score_mod=lambda s, b, h, q_idx, kv_idx: jnp.zeros(3))
    with pytest.raises(ValueError, match=r"mask_mod .*\(5, 7\) tile"):
      fa(mask_mod=lambda b, h, q_idx, kv_idx: jnp.ones((2, 1), bool))


def test_examples_check_the_shapes_of_the_arrays_they_index():
  """An index past an array's end would read its last entry (the gather
  clamps): the examples' arrays are checked against the call's sizes."""
  q, k, v, ids = _document_problem(rng("flex-reads"), t=16)
  fa = functools.partial(pallas_fa.flash_attention, q, k, v)
  n = q.shape[2]
  with pytest.raises(ValueError, match=rf"score_mod_args\[0\] of alibi must "
                     rf"be shaped \[N={n}\].*\(1,\)"):
    fa(score_mod=flex.alibi, score_mod_args=(jnp.ones(1),))
  with pytest.raises(ValueError, match=r"document must be shaped \[B=1, "
                     r"T=S=16\].*\(1, 8\)"):
    fa(mask_mod=flex.document, mask_mod_args=(ids[:, :8],))
  with pytest.raises(ValueError, match=r"prefix_lm must be shaped \[B=1\]"):
    fa(mask_mod=flex.prefix_lm, mask_mod_args=(jnp.array([3, 4]),))
  with pytest.raises(ValueError, match=r"document must be shaped \[B=3,"):
    pallas_fa.create_block_mask(flex.document, (ids,), batch=3, heads=None,
                                q_len=16, kv_len=16)
  # A user's function declares its own; undeclared ones are not checked.
  @flex.reads(("N", None))
  def table_bias(score, batch, head, q_idx, kv_idx, table):
    return score + table[head, 0]
  with pytest.raises(ValueError, match=rf"table_bias must be shaped \[N={n}, "
                     r"any\]"):
    fa(score_mod=table_bias, score_mod_args=(jnp.ones((n + 1, 2)),))
  want = fa(score_mod=lambda s, b, h, qi, ki, t: s + t[h, 0],
            score_mod_args=(jnp.arange(2.0 * n).reshape(n, 2),))
  np.testing.assert_array_equal(
      fa(score_mod=table_bias,
         score_mod_args=(jnp.arange(2.0 * n).reshape(n, 2),)), want)


def test_a_block_mask_of_other_arrays_is_refused_where_they_are_known():
  """The kernels skip a block mask's empty tiles: one made from other
  document ids would drop keys the call's mask keeps. Concrete arrays are
  compared before the jit; the same objects, or none given, pass."""
  q, k, v, ids = _document_problem(rng("flex-made-from"), t=16)
  other = jnp.zeros_like(ids)
  bm = pallas_fa.create_block_mask(flex.document, (ids,), batch=1,
                                   heads=None, q_len=16, kv_len=16)
  fa = functools.partial(pallas_fa.flash_attention, q, k, v, block_mask=bm,
                         implementation="chunked")
  with pytest.raises(ValueError, match="block_mask was made from other "
                     "mask_mod_args"):
    fa(mask_mod=flex.document, mask_mod_args=(other,))
  want = fa()
  np.testing.assert_array_equal(
      fa(mask_mod=flex.document, mask_mod_args=(ids,)), want)
  np.testing.assert_array_equal(
      fa(mask_mod=flex.document, mask_mod_args=(jnp.array(ids),)), want)


def test_structured_arguments_are_named_before_the_jit():
  """Types that the jit would report as its own argument errors (or as a
  tracer's type) are named as the caller passed them."""
  q, k, v, ids = _document_problem(rng("flex-types"), t=8)
  fa = functools.partial(pallas_fa.flash_attention, q, k, v)
  with pytest.raises(TypeError, match="dropout_rng must be a JAX PRNG key "
                     "or an integer seed, got str"):
    fa(dropout_rate=0.1, dropout_rng="abc")
  with pytest.raises(TypeError, match="block_mask must be a pallas_fa."
                     "BlockMask.*got str"):
    fa(block_mask="x")
  with pytest.raises(TypeError, match=r"segment_ids must be pallas_fa\."
                     r"SegmentIds.*got ArrayImpl"):
    fa(segment_ids=ids)


def test_alibi_slopes():
  np.testing.assert_allclose(flex.alibi_slopes(8),
                             [2.0 ** -(i + 1) for i in range(8)])
  assert flex.alibi_slopes(12).shape == (12,)


@pytest.mark.slow
def test_flex_benchmark_script_runs():
  with script_module("flex_benchmark") as script:
    report = script.run(seq_len=64, batch=1, heads=2, head_dim=8,
                        documents=3, repeats=1, modes=["fwd", "fwd_bwd"])
    assert {r["candidate"] for r in report["results"]} >= {
        "segment_ids", "jax.nn dense mask", "plain causal",
        "jax.nn dense ALiBi bias"}
    assert "| alibi | fwd_bwd |" in script.markdown(report)
    # Every candidate is checked, values and gradients, before timing: a
    # wrong ALiBi (it used to be compared with nothing) is caught.
    wrong = lambda score, batch, head, q_idx, kv_idx, slopes: (  # noqa: E731
        score + 0.0 * slopes[head])
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(script.flex, "alibi", wrong)
      with pytest.raises(AssertionError, match="alibi: flex score_mod"):
        script.run(seq_len=64, batch=1, heads=2, head_dim=8, documents=3,
                   repeats=1, modes=["fwd"])
  if "triton" in pallas_fa.implementations():  # The fused kernels, timed.
    with script_module("flex_benchmark") as script:
      report = script.run(seq_len=64, batch=1, heads=2, head_dim=16,
                          documents=3, repeats=1, modes=["fwd"],
                          implementation="triton", dtype="bfloat16")
    assert report["meta"]["implementation"] == "triton"
