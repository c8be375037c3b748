"""The tests' helpers over `pallas_fa.testing` (inputs, references, rule)."""

from __future__ import annotations

import contextlib
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from pallas_fa import api
from pallas_fa import gpu_target
from pallas_fa import testing

# Re-exported so that a test imports its whole toolkit from one place.
DTYPES = testing.DTYPES
Case = testing.Case
make_inputs = testing.make_inputs
rng = testing.rng


# CI runs the tests marked `gpu_jax` with the GPU machines' jax too (its
# leg 2), and those marked slow as well with that jax only: interpreted GPU
# kernels (their jax is also the faster interpreter) and multi-device checks.
GPU_JAX_ONLY = (pytest.mark.slow, pytest.mark.gpu_jax)


@contextlib.contextmanager
def positions_flags_seen():
  """Yields a list of the `MaskInfo.positions_are_indices` that every
  backend's forward and backward pass receives while the context is open
  (`api.choose_backend` wrapped)."""
  seen, choose = [], api.choose_backend

  def recorded(fn):
    if fn is None:  # "Differentiate the forward": stays so.
      return None

    def run(q, k, v, bias, info, *args, **kwargs):
      seen.append(info.positions_are_indices)
      return fn(q, k, v, bias, info, *args, **kwargs)

    return run

  def recording(implementation, call):
    backend = choose(implementation, call)
    return dataclasses.replace(backend, forward=recorded(backend.forward),
                               backward=recorded(backend.backward))

  api.choose_backend = recording
  try:
    yield seen
  finally:
    api.choose_backend = choose


def gpu_jax_only(fn):
  """Marks a test that CI runs with the GPU machines' jax only."""
  for mark in GPU_JAX_ONLY:
    fn = mark(fn)
  return fn


def _on_hopper() -> bool:
  target = gpu_target.current()
  return target is not None and target.major == 9


# The compiled Mosaic GPU kernels' tests.
needs_hopper = pytest.mark.skipif(
    not _on_hopper(), reason="the compiled kernels need an sm90 GPU")


def gpu_jax_only_on_cpu(fn):
  """`gpu_jax_only` for a test of GPU kernels where a CPU interprets them;
  unmarked on a GPU, which runs them compiled (conftest applies the same
  rule to every test parametrized with implementation="triton")."""
  return gpu_jax_only(fn) if jax.default_backend() == "cpu" else fn


def grad_names(kw) -> list[str]:
  """Names of `run`'s gradients for keyword arguments `kw`."""
  return ["dq", "dk", "dv"] + [
      "d" + name for name in ("bias", "sinks") if kw.get(name) is not None]


def run(fn, q, k, v, kw, dout, dlse):
  """(out, lse, grads) of fn(q, k, v, **kw); grads include bias and sinks
  if given (`grad_names`)."""
  bias, sinks = kw.get("bias"), kw.get("sinks")
  rest = {name: x for name, x in kw.items() if name not in ("bias", "sinks")}

  def f(q, k, v, bias, sinks):
    if sinks is not None:  # Not passed otherwise: sinks=None is the default.
      return fn(q, k, v, bias=bias, sinks=sinks, **rest)
    return fn(q, k, v, bias=bias, **rest)

  (out, lse), pullback = jax.vjp(f, q, k, v, bias, sinks)
  grads = pullback((dout.astype(out.dtype), dlse.astype(lse.dtype)))
  return out, lse, tuple(g for g in grads if g is not None)


def named(results):
  """`run`'s (out, lse, grads) as a dict: {"out", "lse", "dq", "dk", "dv"
  and "dbias" if bias was given}, so that a failed tree assertion names the
  result."""
  out, lse, grads = results
  return dict(zip(("out", "lse", "dq", "dk", "dv", "dbias"),
                  (out, lse, *grads)))


def flash(implementation, block_sizes=None):
  """flash_attention with a fixed implementation, returning (out, lse)."""
  def fn(q, k, v, **kw):
    return pallas_fa.flash_attention(
        q, k, v, implementation=implementation, block_sizes=block_sizes,
        return_residual=True, **kw)
  return fn


def reference_fn(compute_dtype):
  """`testing.reference` in `compute_dtype`, shaped like `flash(...)`."""
  def fn(q, k, v, **kw):
    return testing.reference(q, k, v, compute_dtype=compute_dtype, **kw)
  return fn


def assert_close(name, x, ref32, ref_same=None, dtype=jnp.float32):
  """The FlashAttention rule (low precision) or the float32 table."""
  testing.assert_close(name, x, ref32, ref_same, dtype)


def dot_precisions(jaxpr) -> list:
  """The `precision` of every dot_general in `jaxpr`, sub-jaxprs included.

  Descends into every jaxpr an equation carries (pallas_call kernels, scan
  and while bodies, cond branches, custom_vjp/jvp calls, pjit, shard_map),
  so a matmul hidden anywhere in a trace is found. A precision is what the
  primitive stores: None (unset) or a pair such as (HIGHEST, HIGHEST).

  Args:
    jaxpr: a `jax.make_jaxpr` result (ClosedJaxpr) or a Jaxpr.

  Returns:
    One entry per dot_general, in trace order.
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # ClosedJaxpr -> Jaxpr
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn.params["precision"])
    for param in eqn.params.values():
      for sub in _sub_jaxprs(param):
        found.extend(dot_precisions(sub))
  return found


def _sub_jaxprs(param):
  if isinstance(param, (tuple, list)):  # e.g. cond's branches
    for item in param:
      yield from _sub_jaxprs(item)
  elif hasattr(getattr(param, "jaxpr", param), "eqns"):
    yield param


def _equations(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs its equations carry (as
  `dot_precisions` walks them), in trace order."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in _sub_jaxprs(param):
        yield from _equations(sub)


def pallas_call_operands(fn, *args) -> list[list]:
  """The operand avals of every pallas_call in `fn`'s jaxpr (sub-jaxprs
  included), in trace order."""
  return [[v.aval for v in eqn.invars]
          for eqn in _equations(jax.make_jaxpr(fn)(*args))
          if eqn.primitive.name == "pallas_call"]


def kernel_names(fn, *args, prefix: str = "pfa_") -> set[str]:
  """The names starting with `prefix` of the kernels in `fn`'s jaxpr
  (traced, never run): a Mosaic GPU kernel's `name` parameter, or a
  pallas_call's `name_and_src_info`, whichever this jax records."""
  names = set()
  for eqn in _equations(jax.make_jaxpr(fn)(*args)):
    info = eqn.params.get("name_and_src_info")
    name = eqn.params.get("name", getattr(info, "name", None))
    if isinstance(name, str) and name.startswith(prefix):
      names.add(name)
  return names


def check_against_reference(fn, case: Case, dtype, gen):
  """Runs fn and the references on fresh inputs; asserts every result."""
  q, k, v, kw = make_inputs(case, dtype, gen)
  dout = testing.normal(gen, q.shape)
  dlse = testing.normal(gen, q.shape[:-1])
  out, lse, grads = run(fn, q, k, v, kw, dout, dlse)
  chex.assert_shape(out, q.shape)
  chex.assert_type(out, q.dtype)
  chex.assert_shape(lse, q.shape[:-1])
  chex.assert_type(lse, jnp.float32)
  ref = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  same = None
  if dtype != jnp.float32:
    same = run(reference_fn(dtype), q, k, v, kw, dout, dlse)
  names = ["out", "lse", *grad_names(kw)]
  got = [out, lse, *grads]
  want = [ref[0], ref[1], *ref[2]]
  want_same = [None] * len(got) if same is None else [
      same[0], same[1], *same[2]]
  chex.assert_trees_all_equal_shapes(got, want)
  # Gradients are typed like their primals (the lse is float32 throughout).
  chex.assert_trees_all_equal_dtypes(got[2:], want[2:])
  for name, x, r, rs in zip(names, got, want, want_same):
    assert_close(name, x, r, rs, dtype)


def decode_reference(q, k, v, lengths, q_pos, group):
  """Causal decoding attention over each row's valid cache [B, S, K, H]
  in float64 numpy: (out [B, T, N, Hv], lse [B, T, N]), float32."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  k, v = (np.repeat(x, group, axis=2) for x in (k, v))
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  kv_pos = np.arange(k.shape[1])
  visible = ((kv_pos[None, None, :] <= q_pos[:, :, None])
             & (kv_pos[None, None, :] < lengths[:, None, None]))
  s = np.where(visible[:, None], s, -np.inf)
  lse = np.logaddexp.reduce(s, axis=-1)
  out = np.einsum("bnts,bsnh->btnh", np.exp(s - lse[..., None]), v)
  return jnp.asarray(out, jnp.float32), jnp.asarray(
      lse.transpose(0, 2, 1), jnp.float32)
