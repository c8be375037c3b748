"""Inputs, references and the FlashAttention error rule shared by the tests."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa
from pallas_fa import api
from pallas_fa import reference

# float32 results are compared with fixed tolerances, relative to the size of
# the reference: atol = TOL * max(1, max|ref|).
F32_TOL = {"out": 2e-5, "lse": 2e-5, "grad": 1e-4}
# Low-precision results: |x - ref32| <= 2 |x_same_dtype_ref - ref32| + floor,
# the floor being a few ulps of the reference's magnitude.
LOW_PRECISION_FLOOR_ULPS = 4

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}


def rng(*names) -> np.random.Generator:
  """A generator seeded by the test's own names: fresh inputs per check."""
  return np.random.default_rng(zlib.crc32(repr(names).encode()))


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: shapes plus mask/feature arguments."""

  b: int = 2
  t: int = 48
  s: int = 48
  n: int = 2
  k: int = 2
  h: int = 32
  causal: bool = False
  window: Any = None
  lengths: bool = False  # random query and key/value padding lengths
  segments: bool = False  # random sorted segment ids
  positions: bool = False  # bottom-right aligned (decode-like) positions
  soft_cap: float | None = None
  bias: str | None = None  # None | "full" | "heads" (broadcast over B)
  mask: str | None = None  # None | "full" | "broadcast"

  def __str__(self):
    base = f"B{self.b}T{self.t}S{self.s}N{self.n}K{self.k}H{self.h}"
    extras = [
        name for name in ("causal", "lengths", "segments", "positions")
        if getattr(self, name)
    ]
    if self.window is not None:
      extras.append(f"window{self.window}")
    if self.soft_cap:
      extras.append(f"cap{self.soft_cap}")
    if self.bias:
      extras.append(f"bias-{self.bias}")
    if self.mask:
      extras.append(f"mask-{self.mask}")
    return "-".join([base] + extras)


def make_inputs(case: Case, dtype, gen: np.random.Generator):
  """Random q, k, v (in `dtype`) and the keyword arguments of `case`."""
  def normal(*shape):
    return jnp.asarray(gen.standard_normal(shape, np.float32))

  q = normal(case.b, case.t, case.n, case.h).astype(dtype)
  k = normal(case.b, case.s, case.k, case.h).astype(dtype)
  v = normal(case.b, case.s, case.k, case.h).astype(dtype)
  kw: dict[str, Any] = {"is_causal": case.causal}
  if case.window is not None:
    kw["local_window_size"] = case.window
  if case.lengths:
    kw["query_seq_lengths"] = jnp.asarray(
        gen.integers(1, case.t + 1, case.b), jnp.int32)
    kw["key_value_seq_lengths"] = jnp.asarray(
        gen.integers(1, case.s + 1, case.b), jnp.int32)
  if case.segments:
    nseg = 3
    kw["segment_ids"] = pallas_fa.SegmentIds(
        q=jnp.asarray(np.sort(gen.integers(0, nseg, (case.b, case.t))),
                      jnp.int32),
        kv=jnp.asarray(np.sort(gen.integers(0, nseg, (case.b, case.s))),
                       jnp.int32),
    )
  if case.positions:
    offset = case.s - case.t
    kw["query_positions"] = jnp.broadcast_to(
        jnp.arange(case.t, dtype=jnp.int32) + offset, (case.b, case.t))
    kw["key_positions"] = jnp.broadcast_to(
        jnp.arange(case.s, dtype=jnp.int32), (case.b, case.s))
  if case.soft_cap:
    kw["logits_soft_cap"] = case.soft_cap
  if case.bias == "full":
    kw["bias"] = normal(case.b, case.n, case.t, case.s)
  elif case.bias == "heads":
    kw["bias"] = normal(1, case.n, case.t, case.s)
  if case.mask == "full":
    kw["mask"] = jnp.asarray(gen.random((case.b, case.n, case.t, case.s)) < .8)
  elif case.mask == "broadcast":
    kw["mask"] = jnp.asarray(gen.random((case.b, 1, case.t, case.s)) < .8)
  return q, k, v, kw


def run(fn, q, k, v, kw, dout, dlse):
  """(out, lse, grads) of fn(q, k, v, **kw); grads include bias if given."""
  bias = kw.get("bias")
  rest = {name: x for name, x in kw.items() if name != "bias"}

  def f(q, k, v, bias):
    return fn(q, k, v, bias=bias, **rest)

  (out, lse), pullback = jax.vjp(f, q, k, v, bias)
  grads = pullback((dout.astype(out.dtype), dlse.astype(lse.dtype)))
  if bias is None:
    grads = grads[:3]
  return out, lse, grads


def flash(implementation, block_sizes=None):
  def fn(q, k, v, **kw):
    return pallas_fa.flash_attention(
        q, k, v, implementation=implementation, block_sizes=block_sizes,
        return_residual=True, **kw)
  return fn


_STATIC = ("scale", "is_causal", "local_window_size", "logits_soft_cap")


def reference_fn(compute_dtype):
  """The materialised reference through the public canonicalisation."""
  def fn(q, k, v, bias=None, mask=None, **kw):
    static = {name: kw.pop(name) for name in _STATIC if name in kw}
    if "local_window_size" in static:
      static["local_window_size"] = api.check_window(
          static["local_window_size"])

    @jax.jit
    def reference_call(q, k, v, bias, mask, arrays):
      call = api.canonicalize(q, k, v, bias, mask, **static, **arrays)
      return reference.attention(
          call.q, call.k, call.v, call.bias, call.info,
          scale=call.params.scale, soft_cap=call.params.soft_cap,
          compute_dtype=compute_dtype)

    return reference_call(q, k, v, bias, mask, kw)
  return fn


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


def _max_err(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32))
  ref = np.asarray(jnp.asarray(ref, jnp.float32))
  both_inf = np.isneginf(x) & np.isneginf(ref)
  with np.errstate(invalid="ignore"):  # -inf - -inf, replaced just below
    diff = np.where(both_inf, 0.0, np.abs(x - ref))
  return float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0))


def _finite_max(ref):
  ref = np.asarray(jnp.asarray(ref, jnp.float32))
  return float(np.abs(ref[np.isfinite(ref)]).max(initial=0.0))


def assert_close(name, x, ref32, ref_same=None, dtype=jnp.float32):
  """The FlashAttention rule (low precision) or the float32 table."""
  x_f = np.asarray(jnp.asarray(x, jnp.float32))
  r_f = np.asarray(jnp.asarray(ref32, jnp.float32))
  assert x_f.shape == r_f.shape, (name, x_f.shape, r_f.shape)
  # -inf (fully-masked rows' lse) must match exactly; nothing else may be
  # non-finite.
  np.testing.assert_array_equal(
      np.isneginf(x_f), np.isneginf(r_f), err_msg=f"{name}: -inf pattern")
  assert not np.any(np.isnan(x_f) | np.isposinf(x_f)), f"{name}: NaN/inf"
  err = _max_err(x, ref32)
  scale = max(1.0, _finite_max(ref32))
  kind = "out" if name == "out" else "lse" if name == "lse" else "grad"
  if dtype == jnp.float32 or ref_same is None:
    tol = F32_TOL[kind] * scale
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"
  else:
    eps = float(jnp.finfo(dtype).eps)
    floor = LOW_PRECISION_FLOOR_ULPS * eps * scale
    same_err = _max_err(ref_same, ref32)
    tol = 2 * same_err + floor
    assert err <= tol, (
        f"{name}: max error {err:.3g} > 2 * {same_err:.3g} (same-dtype "
        f"reference error) + {floor:.3g}")


def check_against_reference(fn, case: Case, dtype, gen):
  """Runs fn and the references on fresh inputs; asserts every result."""
  q, k, v, kw = make_inputs(case, dtype, gen)
  dout = jnp.asarray(gen.standard_normal(q.shape, np.float32))
  dlse = jnp.asarray(gen.standard_normal(q.shape[:-1], np.float32))
  out, lse, grads = run(fn, q, k, v, kw, dout, dlse)
  assert out.dtype == q.dtype and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == q.shape[:-1]
  ref = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  same = None
  if dtype != jnp.float32:
    same = run(reference_fn(dtype), q, k, v, kw, dout, dlse)
  names = ["out", "lse", "dq", "dk", "dv", "dbias"]
  got = [out, lse, *grads]
  want = [ref[0], ref[1], *ref[2]]
  want_same = [None] * len(got) if same is None else [
      same[0], same[1], *same[2]]
  for name, x, r, rs in zip(names, got, want, want_same):
    assert x.shape == r.shape, (name, x.shape, r.shape)
    if name.startswith("d"):
      assert x.dtype == r.dtype, (name, x.dtype, r.dtype)
    assert_close(name, x, r, rs, dtype)
