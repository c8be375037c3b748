"""`precision=`: canonicalisation and its reach into every matmul."""

import functools

import attention_testing
import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_fa
from pallas_fa import api
from pallas_fa import modules

_P = jax.lax.Precision

# mosaic_gpu computes bfloat16/float16 only: a float32 call is declined, and
# its 16-bit wgmmas have no precision to choose.
_SIXTEEN_BIT_ONLY = ("mosaic_gpu",)
_TRACED = [n for n in conftest.IMPLEMENTATIONS if n not in _SIXTEEN_BIT_ONLY]


@pytest.mark.parametrize(
    "precision, want",
    [
        ("default", _P.DEFAULT),
        ("bfloat16", _P.DEFAULT),
        ("fastest", _P.DEFAULT),
        ("high", _P.HIGH),
        ("tensorfloat32", _P.HIGH),
        ("bfloat16_3x", _P.HIGH),
        ("highest", _P.HIGHEST),
        ("float32", _P.HIGHEST),
        ("HIGHEST", _P.HIGHEST),
        ("High", _P.HIGH),
        (_P.DEFAULT, _P.DEFAULT),
        (_P.HIGH, _P.HIGH),
        (_P.HIGHEST, _P.HIGHEST),
    ],
)
def test_canonical_precision(precision, want):
  assert api.check_precision(precision) is want


@pytest.mark.parametrize(
    "config, want",
    [("bfloat16", _P.DEFAULT), ("tensorfloat32", _P.HIGH),
     ("highest", _P.HIGHEST), (None, _P.DEFAULT)],
)
def test_none_follows_default_matmul_precision(config, want):
  with jax.default_matmul_precision(config):
    assert api.check_precision(None) is want


@pytest.mark.parametrize(
    "precision, error",
    [("float64", ValueError), ("", ValueError), ("F32_F32_F32", ValueError),
     (2, TypeError), (True, TypeError), (("high", "high"), TypeError),
     (_P.HIGHEST.name.encode(), TypeError),
     (jax.lax.DotAlgorithmPreset.F32_F32_F32, TypeError)],
)
def test_bad_precision_raises(precision, error):
  q = jnp.ones((1, 4, 1, 8))
  with pytest.raises(error, match="precision="):
    pallas_fa.flash_attention(q, q, q, precision=precision)


def test_dot_algorithm_default_raises():
  q = jnp.ones((1, 4, 1, 8))
  with jax.default_matmul_precision("F32_F32_F32"):
    with pytest.raises(ValueError, match="precision=None"):
      pallas_fa.flash_attention(q, q, q)


def _grad_jaxpr(fn, case, gen):
  """The jaxpr of the gradient (w.r.t. q, k, v and bias) of a float32 call."""
  q, k, v, kw = attention_testing.make_inputs(case, jnp.float32, gen)
  bias = kw.pop("bias")

  def loss(q, k, v, bias):
    out, lse = fn(q, k, v, bias=bias, **kw)
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(lse > -1e30, lse, 0.0))

  return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)


def _assert_dots(jaxpr, want, at_least=1):
  found = attention_testing.dot_precisions(jaxpr)
  assert len(found) >= at_least, f"only {len(found)} dot_general(s) found"
  assert all(p == (want, want) for p in found), (want, found)


# (precision=, the enclosing jax.default_matmul_precision, expected). An
# explicit precision runs under a different default, so a matmul that ignored
# it would show the default's level instead.
_REQUESTS = [
    ("highest", "bfloat16", _P.HIGHEST),
    ("default", "float32", _P.DEFAULT),
    ("tensorfloat32", "bfloat16", _P.HIGH),
    (None, "float32", _P.HIGHEST),
]


@pytest.mark.parametrize("implementation", _TRACED)
@pytest.mark.parametrize("precision, context, want", _REQUESTS)
def test_every_matmul_runs_at_the_requested_precision(
    implementation, precision, context, want):
  if (implementation == "mosaic_tpu" and want == _P.HIGH
      and jax.__version_info__ < (0, 11, 2)):
    want = _P.HIGHEST  # Mosaic lowers HIGH only from jax 0.11.2 on.
  case = attention_testing.Case(
      b=1, t=40, s=56, n=2, k=1, h=16, causal=True, lengths=True,
      bias="full")
  fn = functools.partial(
      attention_testing.flash(
          implementation, conftest.block_sizes_for(implementation)),
      precision=precision)
  gen = attention_testing.rng(implementation, precision)
  with jax.default_matmul_precision(context):
    jaxpr = _grad_jaxpr(fn, case, gen)
  # At least q.k and p.v forward, and dV, dP, dQ, dK backward.
  _assert_dots(jaxpr, want, at_least=6)


@pytest.mark.parametrize("sequence_axis", [None, "x"])
def test_sharded_attention_forwards_precision(sequence_axis):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  case = attention_testing.Case(b=2, t=24, s=32, causal=True, bias="full")

  def fn(q, k, v, **kw):
    return pallas_fa.sharded_flash_attention(
        q, k, v, mesh=mesh, batch_axes=None if sequence_axis else "x",
        sequence_axis=sequence_axis, implementation="chunked",
        precision="default", return_residual=True, **kw)

  gen = attention_testing.rng("sharded", sequence_axis)
  _assert_dots(_grad_jaxpr(fn, case, gen), _P.DEFAULT, at_least=6)


@pytest.mark.parametrize("implementation", _TRACED)
def test_highest_matches_reference(implementation):
  case = attention_testing.Case(
      b=2, t=40, s=56, n=4, k=2, h=16, causal=True, lengths=True,
      bias="heads")
  fn = functools.partial(
      attention_testing.flash(
          implementation, conftest.block_sizes_for(implementation)),
      precision="highest")
  # Under the fastest default, only the explicit argument keeps float32.
  with jax.default_matmul_precision("bfloat16"):
    attention_testing.check_against_reference(
        fn, case, jnp.float32, attention_testing.rng(implementation))


# --------------------------------------------------------------------------
# Flax.


def _qkv(b=2, t=12, n=2, h=8):
  gen = np.random.default_rng()
  return [jnp.asarray(gen.standard_normal((b, t, n, h)), jnp.float32)
          for _ in range(3)]


@pytest.mark.parametrize(
    "precision, want",
    [(_P.DEFAULT, _P.DEFAULT), ("bfloat16", _P.DEFAULT),
     ((_P.HIGH, "tensorfloat32"), _P.HIGH), (None, _P.HIGHEST)],
)
def test_attention_fn_forwards_flax_precision(precision, want):
  fn = modules.make_attention_fn(implementation="chunked")
  q, k, v = _qkv()
  with jax.default_matmul_precision("float32"):
    jaxpr = jax.make_jaxpr(
        lambda q, k, v: fn(q, k, v, precision=precision, is_causal=True))(
            q, k, v)
  _assert_dots(jaxpr, want, at_least=2)


def test_attention_fn_rejects_mixed_precisions():
  fn = modules.make_attention_fn(implementation="xla")
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match="precision="):
    fn(q, k, v, precision=(_P.DEFAULT, _P.HIGHEST))


def test_flax_module_precision_reaches_attention():
  """nnx.MultiHeadAttention(precision=...) with our attention_fn."""
  layer = nnx.MultiHeadAttention(
      num_heads=2, in_features=16, precision=_P.DEFAULT, decode=False,
      attention_fn=modules.make_attention_fn(implementation="chunked"),
      rngs=nnx.Rngs(0))
  x = jnp.ones((2, 12, 16))
  _assert_dots(jax.make_jaxpr(lambda x: layer(x))(x), _P.DEFAULT, at_least=6)


@pytest.mark.parametrize("precision, want",
                         [("default", _P.DEFAULT), (None, _P.HIGHEST)])
def test_multi_head_attention_precision(precision, want):
  layer = modules.MultiHeadAttention(
      2, 16, is_causal=True, implementation="chunked", precision=precision,
      rngs=nnx.Rngs(0))
  x = jnp.ones((2, 12, 16))
  # Projections (q, k, v, out) and the attention's two products.
  _assert_dots(jax.make_jaxpr(lambda x: layer(x))(x), want, at_least=6)


def test_multi_head_attention_rejects_bad_precision():
  with pytest.raises(ValueError, match="precision="):
    modules.MultiHeadAttention(2, 16, precision="fp8", rngs=nnx.Rngs(0))
