"""Shape polymorphism: `jax.export` with symbolic dims.

A model exported once for every batch size serves each with one artifact.
`chunked` (and `xla`) take a symbolic batch; a symbolic sequence length or
head dim runs on `xla`, which the automatic choice picks for it; the Pallas
kernels need every dim concrete and say so. Each exported call runs at two
batch sizes against the same call made with concrete shapes on `xla`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa
from pallas_fa import kv_cache

_N, _K, _H = 4, 2, 16


def _normal(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _specs(dims: str, *shapes):
  """ShapeDtypeStructs for `shapes`, whose str entries name symbolic dims
  of the one scope `dims` declares ("b", "b, t")."""
  symbols = dict(zip([d.strip() for d in dims.split(",")],
                     export.symbolic_shape(dims)))
  return [jax.ShapeDtypeStruct(
      tuple(symbols.get(d, d) for d in shape), dtype)
          for shape, dtype in shapes]


def _check_exported(fn, reference, specs, args_at, sizes):
  """Exports `fn` on `specs` and checks its results at each of `sizes`
  (inputs `args_at(size)`) against `reference`'s on concrete shapes."""
  exported = export.export(jax.jit(fn))(*specs)
  for size in sizes:
    args = args_at(size)
    got, want = exported.call(*args), jax.jit(reference)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                    strict=True):
      assert g.shape == w.shape
      np.testing.assert_allclose(np.asarray(g, np.float32),
                                 np.asarray(w, np.float32),
                                 rtol=2e-5, atol=2e-5)


def _attention_inputs(b, t, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = _normal(ks[0], (b, t, _N, _H))
  k = _normal(ks[1], (b, t, _K, _H))
  v = _normal(ks[2], (b, t, _K, _H))
  lengths = jax.random.randint(ks[3], (b,), t // 2, t + 1)
  return q, k, v, lengths


def _loss_and_grads(implementation, **kwargs):
  """The attention and the gradients of a random projection of it."""

  def f(q, k, v, lengths):
    def loss(q, k, v):
      out = pallas_fa.flash_attention(
          q, k, v, key_value_seq_lengths=lengths,
          implementation=implementation, **kwargs)
      return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))
                     ), out
    (_, out), grads = jax.value_and_grad(
        loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads

  return f


_FLASH_CASES = {
    "causal_gqa_sinks": dict(is_causal=True, sinks=jnp.linspace(-1, 1, _N)),
    "window_soft_cap": dict(local_window_size=(5, 3), logits_soft_cap=4.0),
}


@pytest.mark.parametrize("case", sorted(_FLASH_CASES))
def test_symbolic_batch_runs_on_chunked(case):
  kwargs = _FLASH_CASES[case]
  t = 40
  specs = _specs("b", *[((("b", t) + tail), jnp.float32)
                        for tail in ((_N, _H), (_K, _H), (_K, _H))],
                 (("b",), jnp.int32))
  _check_exported(_loss_and_grads("chunked", **kwargs),
                  _loss_and_grads("xla", **kwargs), specs,
                  lambda b: _attention_inputs(b, t), sizes=(1, 3))


def test_symbolic_length_runs_on_xla_automatically():
  specs = _specs("b, t", *[((("b", "t") + tail), jnp.float32)
                           for tail in ((_N, _H), (_K, _H), (_K, _H))],
                 (("b",), jnp.int32))
  kwargs = dict(is_causal=True)
  _check_exported(_loss_and_grads(None, **kwargs),
                  _loss_and_grads("xla", **kwargs), specs,
                  lambda t: _attention_inputs(2, t), sizes=(24, 37))


@pytest.mark.parametrize("scale", [None, 0.3])
def test_symbolic_head_dims_run_on_xla_automatically(scale):
  """A symbolic head dim (one artifact for several model widths): its
  default scale 1/sqrt(H) is computed from the dim, and the 256 bound is
  left to the export's constraints; values and gradients as on xla."""
  specs = _specs("h, hv", ((2, 8, _N, "h"), jnp.float32),
                 ((2, 8, _K, "h"), jnp.float32),
                 ((2, 8, _K, "hv"), jnp.float32), ((2,), jnp.int32))
  kwargs = dict(is_causal=True, scale=scale)

  def args_at(h):
    ks = jax.random.split(jax.random.key(h), 4)
    return (_normal(ks[0], (2, 8, _N, h)), _normal(ks[1], (2, 8, _K, h)),
            _normal(ks[2], (2, 8, _K, h + 3)),
            jax.random.randint(ks[3], (2,), 4, 9))
  _check_exported(_loss_and_grads(None, **kwargs),
                  _loss_and_grads("xla", **kwargs), specs, args_at,
                  sizes=(8, 13))


def test_symbolic_batch_with_segments_bias_and_leading_dims():
  """Two leading batch dims, one symbolic; segment ids and a bias."""
  t = 24

  def make(implementation):
    def f(q, k, v, bias, seg):
      return pallas_fa.flash_attention(
          q, k, v, bias, segment_ids=pallas_fa.SegmentIds(seg, seg),
          implementation=implementation)
    return f

  specs = _specs("b", (("b", 2, t, _N, _H), jnp.float32),
                 (("b", 2, t, _K, _H), jnp.float32),
                 (("b", 2, t, _K, _H), jnp.float32),
                 ((1, 1, _N, t, t), jnp.float32),
                 (("b", 2, t), jnp.int32))

  def args_at(b):
    ks = jax.random.split(jax.random.key(b), 5)
    q = _normal(ks[0], (b, 2, t, _N, _H))
    k, v = (_normal(x, (b, 2, t, _K, _H)) for x in ks[1:3])
    bias = _normal(ks[3], (1, 1, _N, t, t))
    seg = jnp.sort(jax.random.randint(ks[4], (b, 2, t), 0, 3), axis=-1)
    return q, k, v, bias, seg

  _check_exported(make("chunked"), make("xla"), specs, args_at, sizes=(1, 2))


@pytest.mark.parametrize("implementation", ["chunked", "triton"])
def test_symbolic_length_on_a_tiled_backend_is_refused(implementation):
  q = jax.ShapeDtypeStruct(export.symbolic_shape(f"1, t, {_N}, {_H}"),
                           jnp.float32)
  call = jax.jit(functools.partial(pallas_fa.flash_attention,
                                   implementation=implementation))
  with pytest.raises(NotImplementedError, match="concrete sequence lengths"):
    export.export(call)(q, q, q)


def test_symbolic_batch_on_a_kernel_is_refused():
  q = jax.ShapeDtypeStruct(export.symbolic_shape(f"b, 32, {_N}, {_H}"),
                           jnp.float32)
  call = jax.jit(functools.partial(pallas_fa.flash_attention,
                                   implementation="triton"))
  with pytest.raises(NotImplementedError, match="concrete batch size"):
    export.export(call)(q, q, q)


def _decode_inputs(b, s, t_new, seed):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = _normal(ks[0], (b, t_new, _N, _H))
  k = _normal(ks[1], (b, s, _K, _H))
  v = _normal(ks[2], (b, s, _K, _H))
  lengths = jax.random.randint(ks[3], (b,), t_new, s + 1)
  return q, k, v, lengths


def _decode_against_flash(quantized, implementation="chunked"):
  """decode_attention over an (optionally int8) cache, and the reference:
  flash_attention on the dequantized cache, the new tokens last."""

  def cache(k, v):
    if not quantized:
      return k, v, {}
    (kq, ks), (vq, vs) = kv_cache.quantize(k), kv_cache.quantize(v)
    return kq, vq, dict(key_scale=ks, value_scale=vs)

  def decode(q, k, v, lengths):
    kc, vc, scales = cache(k, v)
    return pallas_fa.decode_attention(
        q, kc, vc, lengths, sinks=jnp.linspace(-1, 1, _N),
        implementation=implementation, **scales)

  def reference(q, k, v, lengths):
    kc, vc, scales = cache(k, v)
    if scales:
      kc = kc.astype(jnp.float32) * scales["key_scale"][..., None]
      vc = vc.astype(jnp.float32) * scales["value_scale"][..., None]
    t_new = q.shape[1]
    positions = lengths[:, None] - t_new + jnp.arange(t_new)[None]
    return pallas_fa.flash_attention(
        q, kc, vc, key_value_seq_lengths=lengths, is_causal=True,
        query_positions=positions,
        key_positions=jnp.broadcast_to(jnp.arange(k.shape[1]), k.shape[:2]),
        sinks=jnp.linspace(-1, 1, _N), implementation="xla")

  return decode, reference


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_decode_with_a_symbolic_batch(quantized):
  s, t_new = 80, 2
  specs = _specs("b", (("b", t_new, _N, _H), jnp.float32),
                 (("b", s, _K, _H), jnp.float32),
                 (("b", s, _K, _H), jnp.float32), (("b",), jnp.int32))
  decode, reference = _decode_against_flash(quantized)
  _check_exported(decode, reference, specs,
                  lambda b: _decode_inputs(b, s, t_new, seed=b), sizes=(1, 3))


def test_decode_refuses_symbolic_cache_lengths_and_kernels():
  q, k = _specs("b, s", (("b", 1, _N, _H), jnp.float32),
                (("b", "s", _K, _H), jnp.float32))
  lengths = jax.ShapeDtypeStruct(q.shape[:1], jnp.int32)
  decode, _ = _decode_against_flash(False)
  with pytest.raises(NotImplementedError, match="only the batch"):
    export.export(jax.jit(decode))(q, k, k, lengths)
  q, k, lengths = _specs("b", (("b", 1, _N, _H), jnp.float32),
                         (("b", 64, _K, _H), jnp.float32),
                         (("b",), jnp.int32))
  decode, _ = _decode_against_flash(False, implementation="triton")
  with pytest.raises(NotImplementedError, match="concrete batch size"):
    export.export(jax.jit(decode))(q, k, k, lengths)
