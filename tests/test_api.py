"""Argument validation and implementation dispatch of flash_attention."""

import dataclasses
import functools
import inspect
import subprocess
import sys

import chex
import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from pallas_fa import api
from pallas_fa import chunked
from pallas_fa import vjp

B, T, S, N, K, H = 2, 8, 12, 4, 2, 16


def _qkv(dtype=jnp.float32):
  gen = np.random.default_rng(0)
  q = jnp.asarray(gen.standard_normal((B, T, N, H)), dtype)
  k = jnp.asarray(gen.standard_normal((B, S, K, H)), dtype)
  v = jnp.asarray(gen.standard_normal((B, S, K, H)), dtype)
  return q, k, v


def _call(**overrides):
  q, k, v = _qkv()
  args = dict(query=q, key=k, value=v)
  args.update(overrides)
  return pallas_fa.flash_attention(**args)


BAD = [
    # (overrides, exception, text that must appear in the message)
    (dict(query=jnp.zeros((T, N))), ValueError, "query"),
    (dict(key=jnp.zeros((S, K, H))), ValueError, "key"),
    (dict(value=jnp.zeros((B, S + 1, K, H))), ValueError, "value"),
    (dict(key=jnp.zeros((B, S, K, H + 1)), value=jnp.zeros((B, S, K, H + 1))),
     ValueError, "key"),
    (dict(key=jnp.zeros((B, S, 3, H)), value=jnp.zeros((B, S, 3, H))),
     ValueError, "multiple of key/value heads"),
    (dict(key=jnp.zeros((B + 1, S, K, H)), value=jnp.zeros((B + 1, S, K, H))),
     ValueError, "key"),
    (dict(query=jnp.zeros((B, T, N, H), jnp.int32)), TypeError, "query"),
    (dict(query=jnp.zeros((B, T, N, H), jnp.bfloat16)), TypeError,
     "share a dtype"),
    (dict(query=jnp.zeros((B, T, N, 300)), key=jnp.zeros((B, S, K, 300)),
          value=jnp.zeros((B, S, K, 300))), ValueError, "head dim"),
    (dict(bias=jnp.zeros((B, N, T, S + 1))), ValueError, "bias"),
    (dict(bias=jnp.zeros((1, B, N, T, S))), ValueError, "bias"),
    (dict(bias=jnp.zeros((B, N, T, S), jnp.int32)), TypeError, "bias"),
    (dict(mask=jnp.ones((B, N, T, S))), TypeError, "mask"),
    (dict(mask=jnp.ones((B, 3, T, S), bool)), ValueError, "mask"),
    (dict(scale="big"), TypeError, "scale"),
    # float() takes these; a number was meant.
    (dict(scale="0.5"), TypeError, "scale"),
    (dict(scale=True), TypeError, "scale"),
    (dict(logits_soft_cap=True), TypeError, "logits_soft_cap"),
    (dict(dropout_rate="0.1", dropout_rng=0), TypeError, "dropout_rate"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.split(
        jax.random.key(0), 3)), TypeError,
     r"dropout_rng must be one JAX PRNG key .* got key<fry> \(3,\)"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(is_causal=1), TypeError, "is_causal"),
    (dict(return_residual="no"), TypeError, "return_residual must be a bool"),
    (dict(query_seq_lengths=jnp.array([3, 4, 5])), ValueError,
     "query_seq_lengths"),
    (dict(query_seq_lengths=jnp.array([3.0, 4.0])), TypeError,
     "query_seq_lengths"),
    (dict(query_seq_lengths=jnp.array([-1, 4])), ValueError,
     "query_seq_lengths"),
    (dict(key_value_seq_lengths=jnp.array([2, -3])), ValueError,
     "key_value_seq_lengths"),
    (dict(local_window_size=-1), ValueError, "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size"),
    (dict(local_window_size=(1.5, 2)), ValueError, "local_window_size"),
    (dict(segment_ids=(jnp.zeros((B, T), int), jnp.zeros((B, S), int))),
     TypeError, "segment_ids"),
    (dict(segment_ids=pallas_fa.SegmentIds(q=jnp.zeros((B, T + 1), int),
                                           kv=jnp.zeros((B, S), int))),
     ValueError, "segment_ids.q"),
    (dict(segment_ids=pallas_fa.SegmentIds(q=jnp.zeros((B, T), int),
                                           kv=jnp.zeros((B, S)))),
     TypeError, "segment_ids.kv"),
    (dict(query_positions=jnp.zeros((B, S), int)), ValueError,
     "query_positions"),
    (dict(key_positions=jnp.zeros((B, S))), TypeError, "key_positions"),
    # Known values past int32 would wrap in the kernels; the two lowest ids
    # are padding's, and a real one there would see padded keys.
    (dict(query_positions=np.arange(T, dtype=np.int64)[None].repeat(B, 0)
          + 2**31), ValueError, r"query_positions must lie in"),
    (dict(key_positions=np.full((B, S), -2**31 - 1, np.int64)), ValueError,
     r"key_positions must lie in \[-2147483648, 2147483647\]"),
    (dict(segment_ids=pallas_fa.SegmentIds(
        q=np.full((B, T), -2**31 + 1, np.int32),
        kv=np.full((B, S), -2**31 + 1, np.int32))), ValueError,
     r"segment_ids.q must lie in \[-2147483646,"),
    (dict(segment_ids=pallas_fa.SegmentIds(
        q=np.zeros((B, T), np.int64), kv=np.full((B, S), 2**31, np.int64))),
     ValueError, "segment_ids.kv must lie in"),
    (dict(key_value_seq_lengths=np.array([2**32 + 3, 4])), ValueError,
     r"key_value_seq_lengths must lie in \[0,"),
    # Positions plus or minus a window side must fit int32.
    (dict(query_positions=np.full((B, T), 2**31 - 4, np.int32),
          key_positions=np.full((B, S), 2**31 - 4, np.int32),
          local_window_size=(0, 10)), ValueError,
     r"query_positions must lie in \[-536870912, 536870911\] \(with a "
     "local_window_size"),
    (dict(key_positions=np.full((B, S), -2**30, np.int32),
          local_window_size=3), ValueError, "key_positions must lie in"),
    # float32 cannot hold these: inf, or 0, in the kernels.
    (dict(scale=1e39), ValueError, "scale must be 0 or of a magnitude"),
    (dict(scale=1e-46), ValueError, "scale must be 0 or of a magnitude"),
    (dict(logits_soft_cap=1e39), ValueError, "logits_soft_cap must be 0 or"),
    # jnp.asarray's messages named neither the argument nor the call.
    (dict(query=None), TypeError, "query must be an array, got None"),
    (dict(value=[[None]]), TypeError, "value must be an array, got list"),
    (dict(key_value_seq_lengths=[None, 3]), TypeError,
     "key_value_seq_lengths must be an array"),
    (dict(segment_ids=pallas_fa.SegmentIds(q=jnp.zeros((B, T), int),
                                           kv=None)),
     TypeError, "segment_ids.kv must be an array, got None"),
    (dict(sinks=[None] * N), TypeError, "sinks must be an array"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=-2.0), ValueError, "logits_soft_cap"),
    (dict(implementation="flash9000"), ValueError, "implementation"),
    (dict(implementation=3), TypeError, "implementation"),
    (dict(implementation="chunked", block_sizes=(64, 64)), TypeError,
     "block_sizes"),
    (dict(implementation=["chunked"]), TypeError, "implementation"),
    (dict(key=jnp.zeros((B, S, 0, H)), value=jnp.zeros((B, S, 0, H))),
     ValueError, "heads and head dims must be non-empty"),
    (dict(query=jnp.zeros((B, 0, N, H)), implementation="flash9000"),
     ValueError, "implementation"),
    # Unhashable: checked before it keys jit's cache, naming the class.
    (dict(implementation="chunked", block_sizes={"block_q": 7}), TypeError,
     "pallas_fa.ChunkedBlockSizes.*got block_sizes="),
    (dict(implementation="triton", block_sizes=chunked.ChunkedBlockSizes()),
     TypeError, "pallas_fa.TritonBlockSizes.*got block_sizes="),
    (dict(implementation="xla", block_sizes=chunked.ChunkedBlockSizes()),
     TypeError, "takes no tiling config.*got block_sizes="),
    (dict(block_sizes={"block_q": 7}), TypeError,
     "pallas_fa.ChunkedBlockSizes.*got block_sizes="),
]


@pytest.mark.parametrize(
    "overrides, error, text", BAD,
    ids=[f"{i}-{'-'.join(o)}" for i, (o, _, _) in enumerate(BAD)])
def test_bad_input(overrides, error, text):
  with pytest.raises(error, match=text):
    _call(**overrides)


@pytest.mark.parametrize("implementation, dtype", [
    ("xla", jnp.float32), ("xla", jnp.bfloat16), ("chunked", jnp.float32)])
def test_huge_logits_give_no_nan(implementation, dtype):
  """Logits of about 1e10, past any model's: XLA:CPU contracted the logit
  scale's multiply with the subtraction of the row max into one fused
  multiply-add, and a row's largest exponent came out past exp's range
  (NaN rows on xla). xla now folds the scale into q, as chunked does in
  float32, and both give the float64 attention of the rounded inputs
  (each row the value of its largest logit), gradients finite. chunked's
  16-bit calls still multiply each logit (README: known limits)."""
  ks = jax.random.split(jax.random.PRNGKey(3), 3)
  shape = (1, 64, 2, 32)
  q = (1e6 * jax.random.normal(ks[0], shape)).astype(dtype)
  k = (1e4 * jax.random.normal(ks[1], shape)).astype(dtype)
  v = jax.random.normal(ks[2], shape).astype(dtype)
  attend = functools.partial(
      pallas_fa.flash_attention, implementation=implementation,
      block_sizes=conftest.block_sizes_for(implementation))

  def value_and_grads(q, k, v):
    return jax.value_and_grad(
        lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v).astype(jnp.float32))),
        argnums=(0, 1, 2))(q, k, v)

  def optimised(fn):
    # The suite compiles at XLA's level 0 (conftest), where XLA contracts
    # nothing: a user's program is optimised.
    return jax.jit(fn).lower(q, k, v).compile(compiler_options={
        "xla_backend_optimization_level": 3})(q, k, v)

  got = np.asarray(optimised(attend), np.float64)
  for x in (got, *optimised(value_and_grads)[1]):
    assert np.all(np.isfinite(np.asarray(x, np.float32)))
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = np.einsum("tnh,snh->nts", q64[0], k64[0]) / np.sqrt(32)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  want = np.einsum("nts,snh->tnh", p / p.sum(-1, keepdims=True), v64[0])
  np.testing.assert_allclose(got[0], want, atol=1e-2)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
@pytest.mark.parametrize("window, same_as", [
    (2**31, None), (2**63 - 1, None), (np.int64(2**40), None),
    ((None, 2**31), None), ((2**30, 3), (None, 3)),
    ((5, 2**30 - 1), (5, None))])
def test_window_sides_past_int32_are_unbounded(implementation, window,
                                                same_as):
  """A side of 2**30 or more ("everything", as a large number) is
  unbounded: it was an OverflowError in jit's int32 cast. One below is a
  bound, and with arange positions covers every key."""
  gen = np.random.default_rng(14)
  q = jnp.asarray(gen.standard_normal((2, 24, 2, 8)), jnp.float32)
  k, v = (jnp.asarray(gen.standard_normal((2, 40, 2, 8)), jnp.float32)
          for _ in range(2))

  def call(w):
    return pallas_fa.flash_attention(q, k, v, is_causal=False,
                                     local_window_size=w,
                                     implementation=implementation)

  np.testing.assert_array_equal(call(window), call(same_as))
  if same_as is None:  # A bounded side would change the result.
    assert not np.array_equal(call(window), call(3))
  out = pallas_fa.decode_attention(q[:, :1], k, v, jnp.asarray([40, 17]),
                                   local_window_size=window)
  np.testing.assert_array_equal(out, pallas_fa.decode_attention(
      q[:, :1], k, v, jnp.asarray([40, 17]), local_window_size=same_as))


def test_extreme_int32_ids_and_positions_are_exact():
  """The lowest real segment id (above padding's two) and positions near
  int32's ends give the same attention as small ones (a shift of every
  position changes nothing causal; ids only compare)."""
  gen = np.random.default_rng(13)
  q, k, v = (jnp.asarray(gen.standard_normal((B, T, n, H)), jnp.float32)
             for n in (N, K, K))
  half = (np.arange(T) >= T // 2)[None].repeat(B, 0)

  def call(low, shift):
    ids = np.where(half, 7, low).astype(np.int32)
    pos = (np.arange(T)[None].repeat(B, 0) + shift).astype(np.int32)
    return pallas_fa.flash_attention(
        q, k, v, is_causal=True, implementation="chunked",
        segment_ids=pallas_fa.SegmentIds(q=ids, kv=ids),
        query_positions=pos, key_positions=pos)

  np.testing.assert_array_equal(call(-2**31 + 2, 2**31 - T),
                                call(0, 0))


# A message names the argument as the caller spells it, never the local
# variable that held it (f"{x.shape=}" prints "x.shape=").
NAMED = [
    (dict(key=jnp.zeros((B + 1, S, K, H))), ValueError,
     f"key.shape=({B + 1}, {S}, {K}, {H})"),
    (dict(value=jnp.zeros((3 * B, S, K, H))), ValueError,
     f"value.shape=({3 * B}, {S}, {K}, {H})"),
    (dict(value=jnp.zeros((S, K, H))), ValueError,
     f"value.shape=({S}, {K}, {H})"),
    (dict(key=jnp.zeros((B, S, K, H), jnp.int32)), TypeError,
     "key.dtype=int32"),
    (dict(segment_ids=pallas_fa.SegmentIds(q=jnp.zeros((B, T + 1), int),
                                           kv=jnp.zeros((B, S), int))),
     ValueError, f"segment_ids.q.shape=({B}, {T + 1})"),
    (dict(key_positions=jnp.zeros((B, S))), TypeError,
     "key_positions.dtype=float32"),
    (dict(bias=jnp.zeros((B, N, T, S + 1))), ValueError,
     f"bias.shape=({B}, {N}, {T}, {S + 1})"),
    (dict(mask=jnp.ones((3, N, T, S), bool)), ValueError,
     f"mask.shape=(3, {N}, {T}, {S})"),
]


@pytest.mark.parametrize(
    "overrides, error, text", NAMED,
    ids=[f"{i}-{'-'.join(o)}" for i, (o, _, _) in enumerate(NAMED)])
def test_errors_name_the_argument(overrides, error, text):
  with pytest.raises(error) as e:
    _call(**overrides)
  assert text in str(e.value)
  assert "x.shape" not in str(e.value) and "x.dtype" not in str(e.value)


def test_bad_block_sizes():
  with pytest.raises(ValueError, match="block_q"):
    chunked.ChunkedBlockSizes(block_q=0)
  with pytest.raises(ValueError, match="block_kv_bwd"):
    chunked.ChunkedBlockSizes(block_kv_bwd=True)
  # numpy ints are ints, as every other size check takes them, stored as
  # Python ints (the config keys a jit cache).
  tiles = chunked.ChunkedBlockSizes(block_q=np.int32(16))
  assert tiles == chunked.ChunkedBlockSizes(block_q=16)
  assert type(tiles.block_q) is int


def _declining_backend(name):
  def check(*args):
    raise NotImplementedError(f"{name} cannot do this call")
  return vjp.Backend(name=name, forward=None, check=check)


def _fresh_traces():
  # Dispatch happens at trace time; drop cached traces so it runs again.
  api.clear_cache()


def test_explicit_implementation_never_falls_back(monkeypatch):
  _fresh_traces()
  declining = _declining_backend("declining")
  original = api.get_backend
  monkeypatch.setattr(
      api, "get_backend",
      lambda name: declining if name == "chunked" else original(name))
  with pytest.raises(NotImplementedError, match="cannot do this call"):
    _call(implementation="chunked")


def test_unknown_implementations_are_named_and_cudnn_points_to_jax_nn():
  """jax.nn's implementation='cudnn', which a drop-in caller may pass on,
  is refused with where to find it; other unknown names list the known."""
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="'cudnn' is jax.nn.dot_product_attent"):
    pallas_fa.flash_attention(q, k, v, implementation="cudnn")
  with pytest.raises(ValueError, match=r"'bogus'; expected one of \['chunked'"):
    pallas_fa.flash_attention(q, k, v, implementation="bogus")


def test_automatic_choice_skips_declining_backends(monkeypatch):
  calls = []
  original = api.get_backend

  def get_backend(name):
    calls.append(name)
    if name == "first":
      return _declining_backend("first")
    return original(name)

  monkeypatch.setattr(api, "get_backend", get_backend)
  monkeypatch.setitem(api.AUTO_ORDER, "cpu", ("first", "chunked"))
  _fresh_traces()
  q, k, v = _qkv()
  out = pallas_fa.flash_attention(q, k, v, is_causal=True)
  ref = pallas_fa.flash_attention(q, k, v, is_causal=True,
                                  implementation="xla")
  np.testing.assert_allclose(out, ref, atol=1e-5)
  assert calls[:2] == ["first", "chunked"]


def test_automatic_choice_on_cpu_is_chunked():
  q, k, v = _qkv()
  lowered = jax.jit(pallas_fa.flash_attention).lower(q, k, v).as_text()
  assert "while" in lowered  # the blockwise loop, not a dense softmax


_TILED = {"chunked": "ChunkedBlockSizes", "triton": "TritonBlockSizes",
          "mosaic_gpu": "MosaicGpuBlockSizes",
          "mosaic_tpu": "MosaicTpuBlockSizes"}


def test_import_leaves_the_backends_unloaded():
  code = ("import sys, pallas_fa; print(sorted(m for m in sys.modules "
          "if m.startswith('pallas_fa.')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True).stdout
  for name in list(_TILED) + ["modules", "parallel", "layout", "tuning"]:
    assert f"'pallas_fa.{name}'" not in out, out


@pytest.mark.parametrize("name", list(_TILED))
def test_tiling_configs_share_one_interface(name):
  """Each backend's config is exported under its own name, and every
  `default_block_sizes` takes the same arguments."""
  backend = api.get_backend(name)
  config = getattr(pallas_fa, _TILED[name])
  assert backend.block_sizes_type is config
  signature = inspect.signature(backend.default_block_sizes)
  assert list(signature.parameters) == [
      "q_len", "kv_len", "head_dim", "dtype", "is_causal", "dropout",
      "device_kind", "value_head_dim"]
  assert all(p.kind == p.KEYWORD_ONLY for p in signature.parameters.values())
  dtype = jnp.float32 if name == "triton" else jnp.bfloat16
  bs = backend.default_block_sizes(
      q_len=1000, kv_len=3000, head_dim=64, dtype=dtype, is_causal=True)
  assert isinstance(bs, config)
  names = {f.name for f in dataclasses.fields(config)}
  assert {"block_q", "block_kv"} <= names
  # One vocabulary: no per-backend spellings of the same thing.
  assert not names & {"block_k", "stages", "stages_bwd", "consumers"}


@pytest.mark.parametrize("implementation", ["chunked", "triton"])
def test_nan_cotangent_on_padded_rows_does_not_leak(implementation):
  """`vjp` zeroes delta on padded query rows for every backend: there the
  probabilities are 0, but 0 * NaN would still be NaN."""
  q, k, v = _qkv()
  lengths = jnp.array([5, T], jnp.int32)
  block_sizes = conftest.block_sizes_for(implementation)

  def grads(dout, dlse):
    def f(q, k, v):
      return pallas_fa.flash_attention(
          q, k, v, query_seq_lengths=lengths, return_residual=True,
          implementation=implementation, block_sizes=block_sizes)
    _, pullback = jax.vjp(f, q, k, v)
    return pullback((dout, dlse))

  pad = (jnp.arange(T)[None, :] >= lengths[:, None])[..., None]  # [B, T, 1]
  dout = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape),
                     jnp.float32)
  dlse = jnp.ones((B, T, N))
  clean = grads(jnp.where(pad[..., None], 0.0, dout),
                jnp.where(pad, 0.0, dlse))
  dirty = grads(jnp.where(pad[..., None], jnp.nan, dout),
                jnp.where(pad, jnp.nan, dlse))
  chex.assert_trees_all_equal(clean, dirty)


def test_block_sizes_are_hashable_and_frozen():
  bs = chunked.ChunkedBlockSizes(block_q=64)
  assert hash(bs) == hash(chunked.ChunkedBlockSizes(block_q=64))
  with pytest.raises(dataclasses.FrozenInstanceError):
    bs.block_q = 3


def test_traced_lengths_are_accepted():
  q, k, v = _qkv()

  @jax.jit
  def f(lengths):
    return pallas_fa.flash_attention(q, k, v, key_value_seq_lengths=lengths)

  out = f(jnp.array([5, 12]))
  ref = pallas_fa.flash_attention(
      q, k, v, key_value_seq_lengths=jnp.array([5, 12]),
      implementation="xla")
  np.testing.assert_allclose(out, ref, atol=1e-5)


def _package_imports(toplevel_only: bool) -> dict[str, set[str]]:
  """Module name -> the pallas_fa modules it imports (module-level only, or
  anywhere in it)."""
  import ast  # noqa: PLC0415
  import pathlib  # noqa: PLC0415

  root = pathlib.Path(pallas_fa.__file__).parent
  paths = {}
  for path in root.rglob("*.py"):
    parts = ("pallas_fa",) + path.relative_to(root).with_suffix("").parts
    paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  graph = {}
  for name, path in paths.items():
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body if toplevel_only else ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module in paths:
        for alias in node.names:
          full = f"{node.module}.{alias.name}"
          found.add(full if full in paths else node.module)
      elif isinstance(node, ast.Import):
        found.update(a.name for a in node.names if a.name in paths)
    graph[name] = found
  return graph


@pytest.mark.parametrize("toplevel_only", [True, False])
def test_package_imports_form_no_circle(toplevel_only):
  # The root package imports its parts to export them; any other circle
  # (the block mask importing the front door that imports it) is a defect.
  graph = _package_imports(toplevel_only)
  graph.pop("pallas_fa")
  done, on_path = set(), []

  def visit(name):
    if name in on_path:
      raise AssertionError(
          "import circle: " + " -> ".join(on_path[on_path.index(name):]
                                          + [name]))
    if name in done or name not in graph:
      return
    on_path.append(name)
    for dep in sorted(graph[name]):
      visit(dep)
    on_path.pop()
    done.add(name)

  for name in sorted(graph):
    visit(name)
  assert "pallas_fa.flex.block_mask" in done and "pallas_fa.api" in done


def test_no_message_names_a_local_placeholder():
  # f"{x.shape=}" prints "x.shape=", a name no caller passed: every message
  # names the argument (key.shape=...) or states the shape plainly.
  import pathlib  # noqa: PLC0415
  import re  # noqa: PLC0415

  root = pathlib.Path(pallas_fa.__file__).parent
  found = [f"{path.relative_to(root)}: {m.group(0)}"
           for path in sorted(root.rglob("*.py"))
           for m in re.finditer(r"\{(x|y|a|b|arr|array|t)\.(shape|dtype)=\}",
                                path.read_text())]
  assert not found, found


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_traced_scale_is_a_learnable_temperature(implementation):
  """A traced scale, as jax.nn takes it: the same attention as that scale
  given statically, and its gradient (a learned temperature) that of
  jax.nn's; with a soft cap it still acts inside the cap."""
  gen = np.random.default_rng(7)
  q, k, v = (jnp.asarray(gen.standard_normal((2, 24, 4, 16)), jnp.float32)
             for _ in range(3))

  def loss(scale, fn, **kw):
    return jnp.sum(jnp.sin(fn(q, k, v, scale=scale, is_causal=True, **kw)))

  ours = functools.partial(pallas_fa.flash_attention,
                           implementation=implementation)
  for kw in ({}, {"logits_soft_cap": 3.0}):
    got, dscale = jax.jit(jax.value_and_grad(
        lambda s, kw=kw: loss(s, ours, **kw)))(0.7)
    np.testing.assert_allclose(got, loss(0.7, ours, **kw), rtol=2e-5)
    if not kw:
      want, want_dscale = jax.value_and_grad(
          lambda s: loss(s, jax.nn.dot_product_attention))(0.7)
      np.testing.assert_allclose(got, want, rtol=1e-5)
      np.testing.assert_allclose(dscale, want_dscale, rtol=1e-4)
  # A float8 query carries it in its scale, exactly.
  q8, q_scale = pallas_fa.quantize_fp8(q, "head")
  k8, k_scale = pallas_fa.quantize_fp8(k, "head")
  v8, v_scale = pallas_fa.quantize_fp8(v, "head")
  fp8 = functools.partial(
      pallas_fa.flash_attention, q8, k8, v8, key_scale=k_scale,
      value_scale=v_scale, out_dtype=jnp.float32,
      implementation=implementation)
  traced = jax.jit(lambda s: fp8(query_scale=q_scale, scale=s))(0.7)
  np.testing.assert_array_equal(traced, fp8(query_scale=q_scale * 0.7,
                                            scale=1.0))
  with pytest.raises(TypeError, match="scale must be a float scalar"):
    jax.jit(lambda s: pallas_fa.flash_attention(q, k, v, scale=s))(
        jnp.ones(2))


def test_hessian_vector_products_on_chunked():
  """Forward over reverse (jvp of grad), as README promises for chunked:
  the same Hessian-vector product as xla's."""
  gen = np.random.default_rng(11)
  q, k, v = (jnp.asarray(gen.standard_normal((2, 20, 2, 8)), jnp.float32)
             for _ in range(3))
  tangent = jnp.asarray(gen.standard_normal(q.shape), jnp.float32)

  def hvp(implementation):
    def loss(q):
      return jnp.sum(jnp.sin(pallas_fa.flash_attention(
          q, k, v, is_causal=True, implementation=implementation)))
    return jax.jvp(jax.grad(loss), (q,), (tangent,))[1]

  np.testing.assert_allclose(hvp("chunked"), hvp("xla"), rtol=1e-4,
                             atol=1e-5)


@pytest.mark.parametrize("case", [
    # The two of 13 s each are slow (the default run keeps a mask of each
    # kind: dropout and sinks, a mask_mod).
    pytest.param("causal_bias", marks=pytest.mark.slow),
    pytest.param("segments_window", marks=pytest.mark.slow),
    "dropout_sinks", "mask_mod"])
def test_grad_of_grad_on_chunked(case):
  """Reverse over reverse (the gradient of a gradient's norm, as gradient
  penalties and meta-learning take it) through chunked's tile loops, whose
  bounds are per-row: the same as xla's, over several tiles of each pass,
  with the tiles skipped, halved and masked by each kind of mask."""
  gen = np.random.default_rng(13)
  t, s = 40, 48
  q = jnp.asarray(gen.standard_normal((2, t, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(gen.standard_normal((2, s, 2, 8)), jnp.float32)
          for _ in range(2))
  bias = jnp.asarray(gen.standard_normal((1, 4, t, s)), jnp.float32)
  kwargs = {}
  if case == "causal_bias":
    kwargs = dict(is_causal=True)
  elif case == "segments_window":
    bias = bias[:, :, :1]  # A bias broadcast over the query rows.
    # Unsorted ids leave empty tiles inside a row's range.
    ids = jnp.asarray(gen.integers(0, 2, (2, 6)).repeat(8, axis=1))
    kwargs = dict(segment_ids=pallas_fa.SegmentIds(q=ids[:, :t], kv=ids),
                  local_window_size=(20, 6), key_value_seq_lengths=
                  jnp.asarray([s, 29]))
  elif case == "dropout_sinks":
    kwargs = dict(dropout_rate=0.25, dropout_rng=jax.random.key(3),
                  sinks=jnp.asarray(gen.standard_normal(4), jnp.float32))
  else:
    kwargs = dict(mask_mod=lambda b, h, i, j: (i + j) % 3 != 0)

  def grad_norm(implementation, q, k, v, bias):
    def loss(q, k, v, bias):
      out = pallas_fa.flash_attention(
          q, k, v, bias, implementation=implementation, block_sizes=(
              pallas_fa.ChunkedBlockSizes(
                  block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=16)
              if implementation == "chunked" else None), **kwargs)
      return jnp.sum(jnp.sin(out))
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
    return sum(jnp.sum(g ** 2) for g in grads)

  got, want = (
      jax.jit(jax.grad(functools.partial(grad_norm, implementation),
                       argnums=(0, 1, 2, 3)))(q, k, v, bias)
      for implementation in ("chunked", "xla"))
  for name, g, w in zip("qkvb", got, want):
    assert float(jnp.max(jnp.abs(w))) > 0, name
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(
        jnp.max(jnp.abs(w))), err_msg=name)


@pytest.mark.parametrize("implementation", [
    name for name in conftest.IMPLEMENTATIONS if name not in ("xla",
                                                              "chunked")])
def test_second_derivatives_of_pallas_kernels_are_refused_by_name(
    implementation):
  """grad of grad and jvp of grad through a Pallas backend raise a
  NotImplementedError that names it and the backends that have them (they
  were internal Pallas errors: a safe_zip ValueError, a bare
  NotImplementedError); first derivatives still match xla's."""
  gen = np.random.default_rng(12)
  q, k, v = (jnp.asarray(gen.standard_normal((1, 16, 2, 16)), jnp.float32)
             for _ in range(3))
  tangent = jnp.asarray(gen.standard_normal(q.shape), jnp.float32)

  def loss(q, implementation=implementation):
    return jnp.sum(jnp.sin(pallas_fa.flash_attention(
        q, k, v, implementation=implementation)))

  needle = f"implementation='{implementation}' has no second derivatives"
  with pytest.raises(NotImplementedError, match=needle):
    jax.jvp(jax.grad(loss), (q,), (tangent,))
  with pytest.raises(NotImplementedError, match=needle):
    jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2))(q)
  np.testing.assert_allclose(jax.grad(loss)(q),
                             jax.grad(functools.partial(
                                 loss, implementation="xla"))(q),
                             rtol=1e-4, atol=1e-5)
