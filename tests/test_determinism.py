"""A bitwise-reproducible backward on request, on every implementation.

`flash_attention(deterministic_backward=True)`, or XLA's
`--xla_gpu_deterministic_ops` / `--xla_gpu_exclude_nondeterministic_ops` in
`XLA_FLAGS` with the default None, gives gradients that rerun bitwise-equal
and still meet the error rule. Only mosaic_gpu changes path for it: its
default fused backward adds dQ partials in float32 in no fixed order, so
the request takes its split backward (checked on the kernels a gradient
traces). On a GPU the same file runs the Pallas backends compiled.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import Case
from attention_testing import assert_close
from attention_testing import kernel_names
from attention_testing import make_inputs
from attention_testing import reference_fn
from attention_testing import rng
from attention_testing import run
from conftest import block_sizes_for
from flax import nnx

import pallas_fa
from pallas_fa import api
from pallas_fa import checks
from pallas_fa import modules
from pallas_fa import mosaic_gpu

_SPLIT = {"pfa_mgpu_forward", "pfa_mgpu_dq", "pfa_mgpu_dk_dv"}
_FUSED = {"pfa_mgpu_forward", "pfa_mgpu_dk_dv_dq"}
_FLAG = "--xla_gpu_deterministic_ops=true"


def _runs_mosaic_gpu() -> bool:
  """Whether mosaic_gpu can trace here: compiled on a Hopper GPU, else in
  the Mosaic GPU interpreter (which this jax may lack)."""
  try:
    api.get_backend("mosaic_gpu")
    mosaic_gpu.runs_interpreted(None)
  except NotImplementedError:
    return False
  return True


needs_mosaic_gpu = pytest.mark.skipif(
    not _runs_mosaic_gpu(), reason="mosaic_gpu cannot run here")


@pytest.mark.parametrize("flags, expected", [
    ("", False),
    (_FLAG, True),
    ("--xla_gpu_deterministic_ops=1", True),
    ("--xla_gpu_deterministic_ops", True),
    ("--xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_exclude_nondeterministic_ops=true", True),
    ("--xla_backend_optimization_level=0 --xla_gpu_deterministic_ops=TRUE",
     True),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=0", False),
    ("--xla_gpu_deterministic_ops=0 --xla_gpu_deterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops=false "
     "--xla_gpu_exclude_nondeterministic_ops=1", True),
    ("--xla_gpu_deterministic_ops_extra=true", False),
])
def test_xla_flags_ask_for_determinism(flags, expected):
  """Either flag set true (the bare flag, "true" or "1"); the last
  occurrence of each wins, and the exclusion flag alone suffices."""
  assert checks.xla_flags_deterministic(flags) == expected


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_non_bool_is_rejected(value):
  q = jnp.ones((1, 4, 1, 8))
  with pytest.raises(TypeError, match="deterministic_backward"):
    pallas_fa.flash_attention(q, q, q, deterministic_backward=value)
  with pytest.raises(TypeError, match="deterministic_backward"):
    modules.make_attention_fn(deterministic_backward=value)
  with pytest.raises(TypeError, match="deterministic_backward"):
    pallas_fa.MultiHeadAttention(
        1, 8, deterministic_backward=value, rngs=nnx.Rngs(0))


def _reproducible(implementation, block_sizes=None):
  """flash_attention (out, lse) asking for a reproducible backward."""
  def fn(q, k, v, **kw):
    return pallas_fa.flash_attention(
        q, k, v, implementation=implementation, block_sizes=block_sizes,
        deterministic_backward=True, return_residual=True, **kw)
  return fn


@pytest.mark.slow_for("mosaic_tpu")
def test_requested_backward_reruns_bitwise_equal(implementation):
  """Two separate gradient calls on the same fresh inputs give equal bits,
  and each meets the error rule. mosaic_gpu's tiles are those whose
  backward would otherwise be the fused one."""
  case = Case(b=2, t=72, s=100, n=4, k=2, h=64, causal=True, segments=True)
  dtype = jnp.bfloat16
  gen = rng(implementation, "requested-determinism")
  q, k, v, kw = make_inputs(case, dtype, gen)
  dout = jnp.asarray(gen.standard_normal(q.shape, np.float32))
  dlse = jnp.asarray(gen.standard_normal(q.shape[:-1], np.float32))
  fn = _reproducible(implementation, block_sizes_for(implementation))
  first = run(fn, q, k, v, kw, dout, dlse)
  second = run(fn, q, k, v, kw, dout, dlse)
  for name, a, b in zip(("dq", "dk", "dv"), first[2], second[2],
                        strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b)), name
  ref = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  same = run(reference_fn(dtype), q, k, v, kw, dout, dlse)
  for name, x, r, rs in zip(("dq", "dk", "dv"), first[2], ref[2], same[2],
                            strict=True):
    assert_close(name, x, r, rs, dtype)


@pytest.mark.parametrize("head_dim, dropout, fused", [
    (64, False, True), (128, False, True), (64, True, True),
    (128, True, False), (256, False, False)])
def test_default_config_is_fused_where_it_applies(head_dim, dropout, fused):
  """A call without block_sizes gets backward="fused"; it runs where the
  fused kernel fits (wider heads and 32-query dropout tiles keep the split
  one), and never when determinism is asked for."""
  bs = mosaic_gpu.default_block_sizes(
      q_len=4096, kv_len=4096, head_dim=head_dim, dtype=jnp.bfloat16,
      dropout=dropout)
  assert bs.backward == "fused" == mosaic_gpu.MosaicGpuBlockSizes().backward
  applies = functools.partial(
      mosaic_gpu.fused_backward_applies, bs, head_dim, head_dim,
      dropout=dropout, interpret=True)
  assert applies() == fused
  assert not applies(deterministic=True)


def _loss(implementation="mosaic_gpu", **kw):
  """A fresh scalar loss of flash_attention (a new function, so no trace
  of an earlier test is reused)."""
  def loss(q, k, v):
    out = pallas_fa.flash_attention(
        q, k, v, implementation=implementation, is_causal=True, **kw)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return loss


def _inputs(gen, b=1, t=64, n=2, h=64):
  return [jnp.asarray(gen.standard_normal((b, t, n, h), np.float32),
                      jnp.bfloat16) for _ in range(3)]


def _gradient_kernels(loss, *args):
  return kernel_names(jax.grad(loss, argnums=(0, 1, 2)), *args)


@needs_mosaic_gpu
@pytest.mark.parametrize("xla_flags, kw, kernels", [
    (None, {}, _FUSED),
    (None, dict(deterministic_backward=False), _FUSED),
    (None, dict(deterministic_backward=True), _SPLIT),
    (None, dict(deterministic_backward=True,
                block_sizes=mosaic_gpu.MosaicGpuBlockSizes(
                    backward="fused")), _SPLIT),
    (None, dict(block_sizes=mosaic_gpu.MosaicGpuBlockSizes(
        backward="split")), _SPLIT),
    (_FLAG, {}, _SPLIT),
    ("--xla_gpu_exclude_nondeterministic_ops=1", {}, _SPLIT),
    ("--xla_gpu_deterministic_ops=false", {}, _FUSED),
    (_FLAG, dict(deterministic_backward=False), _FUSED),
], ids=["default", "fastest", "requested", "requested-over-fused-tiles",
        "split-tiles", "xla-flag", "xla-exclusion-flag", "xla-flag-false",
        "fastest-over-xla-flag"])
def test_mosaic_gpu_backward_path(monkeypatch, xla_flags, kw, kernels):
  """The kernels a gradient runs: the fused backward by default, the split
  one when the keyword or XLA_FLAGS asks for determinism (the keyword wins
  both ways; a request wins over backward="fused" tiles)."""
  if xla_flags is not None:
    monkeypatch.setenv(
        "XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}")
  args = _inputs(rng("mosaic_gpu", "path", xla_flags, str(kw)))
  assert _gradient_kernels(_loss(**kw), *args) == kernels


@needs_mosaic_gpu
def test_xla_flags_are_read_at_each_trace(monkeypatch):
  """One loss function traced before and after XLA_FLAGS changes: the
  flag is read when flash_attention is called, outside its own trace
  cache, so the second trace takes the split path."""
  loss = _loss()
  args = _inputs(rng("mosaic_gpu", "flags-per-trace"))
  assert _gradient_kernels(loss, *args) == _FUSED
  monkeypatch.setenv(
      "XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}")
  assert _gradient_kernels(loss, *args) == _SPLIT


@needs_mosaic_gpu
@pytest.mark.parametrize("requested", [True, False])
def test_request_composes_with_jit_and_vmap(requested):
  """Under jit(vmap(grad)) the keyword still picks the backward."""
  grad = jax.grad(_loss(deterministic_backward=requested), argnums=(0, 1, 2))
  args = [x[None] for x in _inputs(rng("mosaic_gpu", "vmap"))]
  names = kernel_names(jax.jit(jax.vmap(grad)), *args)
  assert names == (_SPLIT if requested else _FUSED)


@needs_mosaic_gpu
@pytest.mark.parametrize("axis", ["batch_axes", "sequence_axis"])
@pytest.mark.parametrize("requested", [True, False])
def test_request_reaches_sharded_and_ring_attention(axis, requested):
  """sharded_flash_attention passes the keyword to every device's backward,
  a ring's (sequence_axis) included."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))

  def loss(q, k, v):
    out = pallas_fa.sharded_flash_attention(
        q, k, v, mesh=mesh, is_causal=True, implementation="mosaic_gpu",
        deterministic_backward=requested, **{axis: "x"})
    return jnp.sum(out.astype(jnp.float32) ** 2)

  args = _inputs(rng("mosaic_gpu", "sharded", axis))
  names = _gradient_kernels(loss, *args)
  assert names == (_SPLIT if requested else _FUSED)


class _Recorder:
  """An attention_fn (or flash_attention stand-in) keeping its keywords."""

  def __init__(self):
    self.calls = []

  def __call__(self, q, k, v, *args, **kwargs):
    del k, args
    self.calls.append(kwargs)
    return jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)


@pytest.mark.parametrize("requested", [None, True, False])
def test_layer_passes_its_request_to_every_call(requested):
  """MultiHeadAttention(deterministic_backward=...) reaches the attention
  function of every call; None is not passed (a custom attention_fn need
  not know the keyword, and flash_attention's None follows XLA_FLAGS)."""
  recorder = _Recorder()
  layer = pallas_fa.MultiHeadAttention(
      2, 16, deterministic_backward=requested, attention_fn=recorder,
      rngs=nnx.Rngs(0))
  x = jnp.ones((1, 5, 16))
  layer(x)
  layer(x, deterministic=True)  # Flax's "no dropout": another setting.
  assert len(recorder.calls) == 2
  for kwargs in recorder.calls:
    assert kwargs.get("deterministic_backward", None) is requested


@pytest.mark.parametrize("requested", [None, True, False])
def test_attention_fn_passes_its_request(monkeypatch, requested):
  """make_attention_fn(deterministic_backward=...) for Flax's own modules."""
  recorder = _Recorder()
  monkeypatch.setattr(api, "flash_attention", recorder)
  attention_fn = modules.make_attention_fn(deterministic_backward=requested)
  x = jnp.ones((1, 5, 2, 8))
  attention_fn(x, x, x, deterministic=True)
  assert recorder.calls[0]["deterministic_backward"] is requested
