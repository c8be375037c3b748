"""The tests' helpers over `pallas_fa.testing` (inputs, references, rule)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os

import chex
import hypothesis
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


def gpu_jax_only_on_cpu_module() -> list:
  """A module's `pytestmark` for a file of GPU-kernel tests alone: the
  marks of `gpu_jax_only_on_cpu` on every test in it."""
  return list(GPU_JAX_ONLY) if jax.default_backend() == "cpu" else []


def grad_names(kw) -> list[str]:
  """Names of `run`'s gradients for keyword arguments `kw`."""
  return ["dq", "dk", "dv"] + [
      "d" + name for name in _DIFFERENTIATED if kw.get(name) is not None]


# Keyword arguments `run` differentiates besides q, k and v.
_DIFFERENTIATED = ("bias", "sinks", "score_mod_args")


def run(fn, q, k, v, kw, dout, dlse):
  """(out, lse, grads) of fn(q, k, v, **kw); grads include bias, sinks and
  score_mod_args if given (`grad_names`; score_mod_args' as one tuple)."""
  given = {name: kw[name] for name in _DIFFERENTIATED
           if kw.get(name) is not None}
  rest = {name: x for name, x in kw.items() if name not in given}

  def f(q, k, v, given):
    return fn(q, k, v, **given, **rest)

  (out, lse), pullback = jax.vjp(f, q, k, v, given)
  dq, dk, dv, dgiven = pullback((dout.astype(out.dtype),
                                 dlse.astype(lse.dtype)))
  return out, lse, (dq, dk, dv) + tuple(
      dgiven[name] for name in _DIFFERENTIATED if name in given)


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
  dout = testing.normal(gen, q.shape[:-1] + v.shape[-1:])
  dlse = testing.normal(gen, q.shape[:-1])
  out, lse, grads = run(fn, q, k, v, kw, dout, dlse)
  chex.assert_shape(out, q.shape[:-1] + v.shape[-1:])
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


# PALLAS_FA_PROPERTY_EXAMPLES=N: the property tests run N examples per
# implementation, drawn afresh each run (a long randomized campaign,
# BUILD.md); unset, CI's few reproducible ones.
PROPERTY_CAMPAIGN = int(os.environ.get("PALLAS_FA_PROPERTY_EXAMPLES", "0"))


def check_property(strategy, check, examples: int) -> None:
  """Runs `check(case)` on cases drawn from `strategy`: `examples`
  reproducible ones (derandomized), or `PROPERTY_CAMPAIGN` fresh ones."""
  @hypothesis.settings(max_examples=PROPERTY_CAMPAIGN or examples,
                       deadline=None, derandomize=not PROPERTY_CAMPAIGN,
                       database=None,
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(strategy)
  def prop(case):
    check(case)

  prop()


def page_table(gen, b: int, pages_per_row: int, spare: int = 2):
  """A shuffled block table, int32 [B, pages_per_row], into a pool of B *
  pages_per_row + `spare` pages (`paged`); no row names the spare ones."""
  used = b * pages_per_row
  return gen.permutation(used + spare)[:used].reshape(
      b, pages_per_row).astype(np.int32)


def paged(x, table, page_size: int, fill, spare: int = 2):
  """A contiguous cache [B, S, ...] as the pool of pages [P, page_size,
  ...] that `table` (`page_table`) indexes: row b's block i is page
  table[b, i]. The rest of a row's last page past S, and the `spare`
  pages no row names (P = table.size + spare), hold `fill`: garbage that
  must never reach a result."""
  x = np.asarray(x)
  b, s = x.shape[:2]
  rows = np.full((b, table.shape[1] * page_size) + x.shape[2:], fill,
                 x.dtype)
  rows[:, :s] = x
  pool = np.full((table.size + spare, page_size) + x.shape[2:], fill,
                 x.dtype)
  pool[table.reshape(-1)] = rows.reshape((table.size, page_size)
                                         + x.shape[2:])
  return pool


def decode_reference(q, k, v, lengths, q_pos, group, *, scale=None,
                     is_causal=True, window=None, soft_cap=None, sinks=None,
                     score_mod=None, mask_mod=None):
  """Decoding attention over each row's valid cache [B, S, K, H] in float64
  numpy: (out [B, T, N, Hv], lse [B, T, N]), float32.

  Keys are visible where their index is below the row's length and the
  masks allow; the logits are `soft_cap(scale * q.k)`, then `score_mod`.
  `score_mod(s, q_pos, kv_pos)` and `mask_mod(q_pos, kv_pos)` take the
  logits [B, N, T, S] and the positions as [B, 1, T, 1] and [1, 1, 1, S]
  (numpy); sinks [N] join each row's denominator. A row with no visible key
  is zero with lse -inf."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  k, v = (np.repeat(x, group, axis=2) for x in (k, v))
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  s = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if soft_cap is not None:
    s = soft_cap * np.tanh(s / soft_cap)
  q_at = np.asarray(q_pos)[:, None, :, None]
  kv_at = np.arange(k.shape[1])[None, None, None, :]
  if score_mod is not None:
    s = score_mod(s, q_at, kv_at)
  visible = kv_at < np.asarray(lengths)[:, None, None, None]
  if is_causal:
    visible = visible & (kv_at <= q_at)
  left, right = window if window is not None else (None, None)
  if left is not None:
    visible = visible & (q_at - kv_at <= left)
  if right is not None:
    visible = visible & (kv_at - q_at <= right)
  if mask_mod is not None:
    visible = visible & mask_mod(q_at, kv_at)
  s = np.where(visible, s, -np.inf)
  if sinks is not None:  # One more column, with no value.
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                           s.shape[:-1] + (1,))
    s = np.concatenate([s, sink], axis=-1)
    v = np.concatenate([v, np.zeros_like(v[:, :1])], axis=1)
  seen = np.isfinite(s[..., :k.shape[1]]).any(-1)  # [B, N, T]
  top = np.where(seen, s.max(-1), 0.0)
  with np.errstate(divide="ignore"):
    lse = np.where(seen, np.log(np.exp(s - top[..., None]).sum(-1)) + top,
                   -np.inf)
  p = np.where(seen[..., None], np.exp(s - np.where(seen, lse, 0)[..., None]),
               0.0)
  out = np.einsum("bnts,bsnh->btnh", p, v)
  return jnp.asarray(out, jnp.float32), jnp.asarray(
      lse.transpose(0, 2, 1), jnp.float32)


def _race_detector():
  """(get_races, reset) of the Mosaic GPU interpreter's happens-before race
  detector, or a skip where this jax has none."""
  try:
    interpreter = importlib.import_module(
        "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    get_races = interpreter.get_races
    reset = interpreter.reset_gpu_interpret_mode_state
  except (ImportError, AttributeError) as e:
    pytest.skip(f"this jax has no Mosaic GPU race detector ({e})")
  from pallas_fa.mosaic_gpu import kernel  # noqa: PLC0415 - Mosaic GPU.

  if "detect_races" not in {
      f.name for f in dataclasses.fields(kernel.interpret_params())}:
    pytest.skip("this jax's Mosaic GPU interpreter cannot detect races")
  return get_races, reset


def race_verdicts(monkeypatch, describe):
  """Makes every kernel launch run eagerly under the race detector (which
  keeps one kernel's verdict) and returns the list that collects
  `describe(spec, name, races_found)` of each launch, and the detector's
  reset (for the test's end)."""
  get_races, reset = _race_detector()
  from pallas_fa.mosaic_gpu import kernel  # noqa: PLC0415 - Mosaic GPU.

  real_params, real_launch = kernel.interpret_params, kernel.launch
  monkeypatch.setattr(
      kernel, "interpret_params",
      lambda: dataclasses.replace(real_params(), detect_races=True))
  verdicts = []

  def launch(spec, *, name, **kwargs):
    reset()
    outputs = jax.block_until_ready(real_launch(spec, name=name, **kwargs))
    verdicts.append(describe(spec, name, get_races().races_found))
    return outputs

  monkeypatch.setattr(kernel, "launch", launch)
  return verdicts, reset
