"""TPU-specific tests of `mosaic_tpu`: tiling, layouts, skipping, lowering.

Everything runs without a TPU: the kernels execute in Pallas's TPU interpret
mode (which simulates the TPU's memories and the pipeline's DMAs), and the
Mosaic lowering is checked by exporting for the "tpu" platform. The shared
numerical suite is tests/test_conformance.py; the cases here cross several
128-row tiles in every direction.
"""

import dataclasses
import re

import attention_testing
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import DTYPES
from attention_testing import Case
from attention_testing import assert_close
from attention_testing import check_against_reference
from attention_testing import flash
from attention_testing import make_inputs
from attention_testing import reference_fn
from attention_testing import rng
from attention_testing import run
from conftest import block_sizes_for
from jax.experimental.pallas import tpu as pltpu

import pallas_fa
from pallas_fa import api
from pallas_fa import chunked
from pallas_fa import flex
from pallas_fa import layout
from pallas_fa import masking
from pallas_fa import mosaic_tpu
from pallas_fa import testing
from pallas_fa.mosaic_tpu import kernel

TILES = block_sizes_for("mosaic_tpu")
TILE = 128


@pytest.fixture
def fresh_caches():
  """Traced jaxprs are cached by shape; these tests change how they trace."""
  jax.clear_caches()
  yield
  jax.clear_caches()


# --- MosaicTpuBlockSizes ------------------------------------------------------


def test_block_sizes_defaults_are_valid_and_frozen():
  bs = mosaic_tpu.MosaicTpuBlockSizes()
  assert all(getattr(bs, f.name) % TILE == 0
             for f in dataclasses.fields(bs))
  with pytest.raises(dataclasses.FrozenInstanceError):
    bs.block_q = 256
  assert not hasattr(bs, "__dict__")  # slotted
  assert hash(bs) == hash(mosaic_tpu.MosaicTpuBlockSizes())
  assert {bs: 1}[mosaic_tpu.MosaicTpuBlockSizes()] == 1


@pytest.mark.parametrize("field", ["block_q", "block_kv", "block_q_bwd",
                                   "block_kv_bwd"])
@pytest.mark.parametrize("value", [0, -128, 64, 200, 130, 128.0, True, "128"])
def test_block_sizes_validation(field, value):
  with pytest.raises(ValueError, match=field):
    mosaic_tpu.MosaicTpuBlockSizes(**{field: value})


def test_block_sizes_accepts_multiples_of_128():
  bs = mosaic_tpu.MosaicTpuBlockSizes(
      block_q=128, block_kv=384, block_q_bwd=1024, block_kv_bwd=256)
  assert bs.block_kv == 384


def test_default_block_sizes_heuristic():
  bf16 = mosaic_tpu.default_block_sizes(
      q_len=4096, kv_len=4096, head_dim=128, dtype=jnp.bfloat16)
  assert (bf16.block_q, bf16.block_kv) == (512, 512)
  assert (bf16.block_q_bwd, bf16.block_kv_bwd) == (512, 512)
  # A float32 (or float16, computed in float32) head of 256 is 1 KiB a row:
  # the backward halves its tiles to stay inside VMEM.
  for dtype in (jnp.float32, jnp.float16):
    big = mosaic_tpu.default_block_sizes(
        q_len=4096, kv_len=4096, head_dim=256, dtype=dtype)
    assert (big.block_q_bwd, big.block_kv_bwd) == (256, 256)
  # The wider of H and Hv decides.
  for hv, want in ((128, 512), (256, 256)):
    bs = mosaic_tpu.default_block_sizes(
        q_len=4096, kv_len=4096, head_dim=64, value_head_dim=hv,
        dtype=jnp.bfloat16)
    assert (bs.block_q_bwd, bs.block_kv_bwd) == (want, want), hv


def test_wrong_block_sizes_type_is_rejected():
  q = jnp.ones((1, 8, 1, 8))
  with pytest.raises(TypeError, match="BlockSizes"):
    pallas_fa.flash_attention(
        q, q, q, implementation="mosaic_tpu",
        block_sizes=chunked.ChunkedBlockSizes())


def test_check_declines_metadata_beyond_scalar_memory(monkeypatch,
                                                       fresh_caches):
  monkeypatch.setattr(kernel, "interpret_params", lambda: False)
  monkeypatch.setattr(kernel, "metadata_capacity", lambda: 8)
  q = jnp.ones((2, 512, 1, 8))
  # B * T/128 * S/128 = 32 words > 8.
  with pytest.raises(NotImplementedError, match="scalar memory"):
    pallas_fa.flash_attention(q, q, q, implementation="mosaic_tpu",
                              block_sizes=TILES)
  # 512-row tiles: 2 words.
  _, _, _, _, info, params = _canonicalise(q, q, q, {})
  params = dataclasses.replace(
      params, block_sizes=mosaic_tpu.MosaicTpuBlockSizes())
  mosaic_tpu.BACKEND.check(q, q, q, None, info, params)
  # A float8 call's value scales per (batch row, head) share it: 2 * 4
  # words beside B * T/128 * S/128 = 2.
  q8 = jnp.ones((2, 128, 4, 8), jnp.float8_e4m3fn)
  call = api.canonicalize(q8, q8, q8, block_sizes=TILES, float8=True)
  monkeypatch.setattr(kernel, "metadata_capacity", lambda: 9)
  with pytest.raises(NotImplementedError, match="value scales"):
    mosaic_tpu.BACKEND.check(*call.arrays)
  monkeypatch.setattr(kernel, "metadata_capacity", lambda: 10)
  mosaic_tpu.BACKEND.check(*call.arrays)


@pytest.mark.parametrize(
    "block, length, want",
    [(128, 1, (128, 128)), (128, 128, (128, 128)), (128, 129, (128, 256)),
     (512, 300, (384, 384)), (256, 1000, (256, 1024))])
def test_tile(block, length, want):
  assert layout.tile(block, length, mosaic_tpu.ALIGN) == want


# --- HBM layouts --------------------------------------------------------------


def _canonicalise(q, k, v, kw):
  """The backend's view of a public call: (q, k, v, bias, info, params)."""
  return api.canonicalize(q, k, v, **kw).arrays


def _canonical(case):
  q, k, v, kw = make_inputs(case, jnp.float32, rng("layout", str(case)))
  return _canonicalise(q, k, v, kw)


def test_layouts():
  case = Case(b=2, t=200, s=300, n=4, k=2, h=72, causal=True, lengths=True,
              bias="heads", mask="broadcast")
  q, k, v, bias, info, params = _canonical(case)

  def layout(q, k, v, bias, info):
    lay = mosaic_tpu.Layout(q, k, v, bias, info, params, 128, 128)
    return dict(zip(lay.names, lay.operands, strict=True)), lay.kinds

  ops, kinds = jax.jit(layout)(q, k, v, bias, info)
  tp, sp, hp = 256, 384, 128
  # q/k/v: [B, L, heads * Hp], head dim zero-padded to the lane width.
  assert ops["q"].shape == (2, tp, 4 * hp)
  assert ops["k"].shape == ops["v"].shape == (2, sp, 2 * hp)
  q4 = ops["q"].reshape(2, tp, 4, hp)
  assert np.all(np.asarray(q4[..., 72:]) == 0)
  assert np.all(np.asarray(q4[:, 200:]) == 0)
  np.testing.assert_array_equal(
      np.asarray(q4[:, :200, :, :72]),
      np.asarray(masking.zero_padding(
          q, info.q_segment_ids, masking.Q_PAD_SEGMENT)))
  # Query-side metadata lane-replicated, key-side sublane-replicated, tails
  # marked as padding.
  for name in ("q_pos", "q_seg"):
    x = np.asarray(ops[name])
    assert x.shape == (2, tp, TILE) and x.dtype == np.int32
    assert np.all(x == x[:, :, :1])
  for name in ("kv_pos", "kv_seg"):
    x = np.asarray(ops[name])
    assert x.shape == (2, kernel.NUM_SUBLANES, sp)
    assert np.all(x == x[:, :1, :])
  assert np.all(np.asarray(ops["q_seg"])[:, 200:] == masking.Q_PAD_SEGMENT)
  assert np.all(np.asarray(ops["kv_seg"])[:, :, 300:]
                == masking.KV_PAD_SEGMENT)
  np.testing.assert_array_equal(np.asarray(ops["q_pos"])[:, :200, 0],
                                np.asarray(info.q_positions))
  # Dense operands keep their broadcast axes; the mask travels as int8.
  assert ops["bias"].shape == (1, 4, tp, sp)
  assert ops["mask"].shape == (2, 1, tp, sp) and ops["mask"].dtype == jnp.int8
  assert kinds.shape == (2, 2, 3)  # [B, nq, nk]


def test_aligned_inputs_are_not_copied():
  """H % 128 == 0 and whole tiles: the kernel layout is a free reshape."""
  case = Case(b=1, t=256, s=384, n=2, k=1, h=128)
  q, k, v, bias, info, params = _canonical(case)
  lay = mosaic_tpu.Layout(q, k, v, bias, info, params, 128, 128)
  assert lay.names == ["q", "k", "v"]  # No masking inputs at all.
  jaxpr = str(jax.make_jaxpr(lay.queries)(q))
  assert "pad" not in jaxpr and "transpose" not in jaxpr
  assert bool(jnp.all(lay.kinds == masking.FULL))


# --- the per-step metadata ----------------------------------------------------

E, P, F = masking.EMPTY, masking.PARTIAL, masking.FULL


_schedule = jax.jit(mosaic_tpu.fetch_schedule)


def _decode(words, shape):
  words = np.asarray(words).reshape(shape)
  return words >> kernel.KIND_BITS, words & kernel.KIND_MASK


def test_fetch_schedule_example():
  kinds = jnp.array([[[E, F, E, P, E],
                      [E, E, E, E, E],
                      [P, E, E, E, F],
                      [E, E, E, E, E]]], jnp.int32)
  fetch, got_kinds = _decode(_schedule(kinds), kinds.shape)
  np.testing.assert_array_equal(got_kinds, kinds)
  np.testing.assert_array_equal(fetch[0], [[1, 1, 3, 3, 3],
                                           [3, 3, 3, 3, 3],
                                           [0, 4, 4, 4, 4],
                                           [4, 4, 4, 4, 4]])
  # A sweep whose first rows are empty prefetches its first needed block.
  kinds = jnp.array([[[E, E], [E, P]]], jnp.int32)
  fetch, _ = _decode(_schedule(kinds), kinds.shape)
  np.testing.assert_array_equal(fetch[0], [[1, 1], [1, 1]])


def test_fetch_schedule_never_fetches_an_unneeded_block():
  gen = rng("schedule")
  kinds = jnp.asarray(gen.choice([E, P, F], (3, 6, 7), p=[.6, .2, .2]),
                      jnp.int32)
  fetch, _ = _decode(_schedule(kinds), kinds.shape)
  kinds = np.asarray(kinds)
  for b in range(kinds.shape[0]):
    seq = fetch[b].reshape(-1)
    flat = kinds[b].reshape(-1)
    needed = [(f // 7, f % 7) for f in np.flatnonzero(flat != E)]
    for f, (block, kind) in enumerate(zip(seq, flat, strict=True)):
      row, col = divmod(f, 7)
      if kind != E:
        assert block == col
      elif f and block != seq[f - 1]:
        # A changed index on an empty step is a prefetch of the next block
        # the sweep needs.
        nxt = next((r, c) for r, c in needed if (r, c) > (row, col))
        assert nxt == (row, block)


# --- skipping: visited tiles and DMAs, counted in the TPU interpreter ---------


def _ideal_tiles(info, num_kv, tp, sp):
  """[B, nq, nk]: tiles with at least one visible element (brute force)."""
  padded = masking.pad_sequence(info, tp, sp)
  vis = masking.tile_visibility(padded, num_kv)  # [B, K|1, G|1, Tp, Sp]
  vis = np.asarray(vis).any(axis=(1, 2))
  b = vis.shape[0]
  return vis.reshape(b, tp // TILE, TILE, sp // TILE, TILE).any(axis=(2, 4))


def _runs(keys):
  """DMAs a pipeline needs to fetch `keys` in order: the changes of key."""
  return sum(1 for i, key in enumerate(keys) if i == 0 or key != keys[i - 1])


class _DmaLog:
  """Records the input blocks the TPU interpreter copies into VMEM.

  The interpreter copies a block at a grid step only if the block index of
  that input changed since the previous step: each record is one DMA.
  """

  def __init__(self, monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    # Interpret even on a TPU: the interpreter is what reports the DMAs.
    monkeypatch.setattr(kernel, "interpret_params", pltpu.InterpretParams)
    get = getattr(ipc, "get", None)
    if get is None:
      pytest.fail("The TPU interpreter's `get` moved; update this test.")
    self.records = []

    def logged(*args, input_name=None, **kwargs):
      if input_name is not None:
        match = re.fullmatch(r"refs\[(\d+)\]", input_name)
        if match is None:
          raise AssertionError(f"unexpected kernel input {input_name=}")
        grid = tuple(int(x) for x in kwargs.get("grid_loop_idx", args[7]))
        self.records.append((int(match.group(1)), len(grid)))
      return get(*args, input_name=input_name, **kwargs)

    monkeypatch.setattr(ipc, "get", logged)

  def count(self, operand, grid_rank):
    return sum(1 for r in self.records if r == (operand, grid_rank))


SKIP_CASES = {
    "causal": (Case(b=1, t=512, s=512, n=2, k=1, h=8, causal=True), {}),
    "window": (Case(b=1, t=640, s=640, n=1, k=1, h=8, window=(100, 0)), {}),
    "segments": (Case(b=2, t=512, s=512, n=4, k=2, h=8),
                 {"segments": [100, 200, 150, 62]}),
}


def _segment_kw(case, lengths):
  ids = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths), jnp.int32)
  ids = jnp.broadcast_to(ids, (case.b, case.t))
  return {"segment_ids": pallas_fa.SegmentIds(q=ids, kv=ids)}


def _skip_inputs(name):
  case, extra = SKIP_CASES[name]
  q, k, v, kw = make_inputs(case, jnp.float32, rng("skip", name))
  if "segments" in extra:
    kw.update(_segment_kw(case, extra["segments"]))
  return case, q, k, v, kw


@pytest.mark.parametrize("name", list(SKIP_CASES))
def test_forward_visits_only_needed_tiles(name, monkeypatch, fresh_caches):
  case, q, k, v, kw = _skip_inputs(name)
  _, _, _, _, info, params = _canonicalise(q, k, v, kw)
  lay = mosaic_tpu.Layout(q, k, v, None, info, params, TILE, TILE)
  ideal = _ideal_tiles(info, case.k, lay.tp, lay.sp)
  # Compute: exactly the tiles with a visible element run the kernel body.
  visited = np.asarray(lay.kinds) != masking.EMPTY
  np.testing.assert_array_equal(visited, ideal)
  assert visited.sum() < visited.size  # the case does skip something

  log = _DmaLog(monkeypatch)
  out = pallas_fa.flash_attention(
      q, k, v, implementation="mosaic_tpu", block_sizes=TILES, **kw)
  jax.block_until_ready(out)
  # DMAs: the fewest a pipeline can issue for the grid (B, N, nq, nk): one
  # per change of the needed (batch, kv head, key tile).
  g = case.n // case.k
  needed = [(b, n // g, j)
            for b in range(case.b) for n in range(case.n)
            for i in range(ideal.shape[1]) for j in range(ideal.shape[2])
            if ideal[b, i, j]]
  k_index, v_index = lay.names.index("k"), lay.names.index("v")
  assert log.count(k_index, 4) == _runs(needed)
  assert log.count(v_index, 4) == _runs(needed)
  dense = case.b * case.n * ideal.shape[1] * ideal.shape[2]
  assert _runs(needed) < dense


def test_backward_visits_only_needed_tiles(monkeypatch, fresh_caches):
  case = Case(b=1, t=384, s=384, n=2, k=1, h=8, causal=True)
  q, k, v, kw = make_inputs(case, jnp.float32, rng("skip-bwd"))
  kw.update(_segment_kw(case, [150, 234]))
  _, _, _, _, info, params = _canonicalise(q, k, v, kw)
  ideal = _ideal_tiles(info, case.k, 384, 384)  # [1, 3, 3]
  names = mosaic_tpu.Layout(q, k, v, None, info, params, TILE, TILE).names
  names = names + ["do", "lse", "delta"]

  log = _DmaLog(monkeypatch)

  def attention(q, k, v):
    return pallas_fa.flash_attention(
        q, k, v, implementation="mosaic_tpu", block_sizes=TILES, **kw)

  out, pullback = jax.vjp(attention, q, k, v)
  jax.block_until_ready(out)
  log.records.clear()  # Count the backward kernels only.
  jax.block_until_ready(pullback(jnp.ones_like(out)))
  nq, nk = ideal.shape[1:]
  # dQ kernel, grid (B, N, nq, nk): key tiles streamed per query tile.
  needed_k = [(n, j) for n in range(case.n) for i in range(nq)
              for j in range(nk) if ideal[0, i, j]]
  assert log.count(names.index("k"), 4) == _runs(needed_k)
  # dK/dV kernel, grid (B, K, nk, G, nq): query tiles streamed per key tile.
  needed_q = [(n, i) for j in range(nk) for n in range(case.n)
              for i in range(nq) if ideal[0, i, j]]
  for name in ("q", "do", "lse", "delta"):
    assert log.count(names.index(name), 5) == _runs(needed_q), name


# --- grid semantics, scalar prefetch and lowering -----------------------------


def _pallas_calls(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(sub, "jaxpr", sub)
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          yield from _pallas_calls(inner)


def test_grid_semantics_and_scalar_prefetch(monkeypatch, fresh_caches):
  monkeypatch.setattr(kernel, "parallel_grid", lambda interpret: True)
  case = Case(b=1, t=200, s=300, n=4, k=2, h=8, causal=True)
  q, k, v, kw = make_inputs(case, jnp.float32, rng("semantics"))

  def loss(q, k, v):
    return jnp.sum(pallas_fa.flash_attention(
        q, k, v, implementation="mosaic_tpu", block_sizes=TILES, **kw))

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  calls = list(_pallas_calls(jaxpr.jaxpr))
  grids = {e.params["grid_mapping"].grid: e for e in calls}
  par, arb = "parallel", "arbitrary"
  want = {
      (1, 4, 2, 3): (par, par, par, arb),  # forward and dQ: (B, N, nq, nk)
      (1, 2, 3, 2, 2): (par, par, par, arb, arb),  # dK/dV: (B, K, nk, G, nq)
  }
  assert set(grids) == set(want)
  assert len(calls) == 3
  for e in calls:
    gm = e.params["grid_mapping"]
    assert gm.num_index_operands == 1  # the per-step metadata, in SMEM
    params = e.params["compiler_params"]
    if isinstance(params, dict):  # older Pallas: keyed by backend
      params = params.get("mosaic_tpu", params.get("mosaic"))
    assert tuple(params.dimension_semantics) == want[gm.grid]
    for bm in gm.block_mappings:
      shape = [getattr(d, "block_size", 1) for d in bm.block_shape]
      # Lanes are multiples of 128 and sublanes of 8 (or 1: a row).
      assert shape[-1] % TILE == 0, shape
      assert shape[-2] % kernel.NUM_SUBLANES == 0 or shape[-2] == 1, shape


# Slow (the TPU interpreter, twice): CI runs it in its slow-test leg.
@pytest.mark.slow
def test_parallel_semantics_interpreted(monkeypatch, fresh_caches):
  """The TPU's own grid semantics: the interpreter randomises the order of
  the parallel axes, so this checks the kernels do not depend on it."""
  monkeypatch.setattr(kernel, "parallel_grid", lambda interpret: True)
  case = Case(b=2, t=200, s=300, n=4, k=2, h=16, causal=True, lengths=True)
  check_against_reference(flash("mosaic_tpu", TILES), case, jnp.float32,
                          rng("parallel", str(case)))


LOWERING_CASES = [
    ("float32", Case(b=2, t=200, s=300, n=4, k=2, h=64, causal=True,
                     window=(30, 5), segments=True, soft_cap=3.0)),
    ("bfloat16", Case(b=2, t=200, s=300, n=4, k=2, h=256, bias="full",
                      mask="full")),
    ("float16", Case(b=1, t=1, s=300, n=8, k=1, h=80, bias="heads",
                     mask="broadcast", positions=True)),
]


def _assert_lowers_to_mosaic(q, k, v, kw):
  """Forward, dK/dV and dQ of the call lower to Mosaic TPU custom calls."""
  bias = kw.pop("bias", None)

  def loss(q, k, v, bias):
    out = pallas_fa.flash_attention(
        q, k, v, bias=bias, implementation="mosaic_tpu", block_sizes=TILES,
        **kw)
    return jnp.sum(out.astype(jnp.float32))

  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  exported = jax.export.export(
      jax.jit(jax.grad(loss, argnums=argnums)), platforms=["tpu"])(
          q, k, v, bias)
  module = exported.mlir_module()
  assert module.count("tpu_custom_call") == 3
  assert "callback" not in module  # compiled kernels, not the interpreter


@pytest.mark.parametrize("dtype, case", LOWERING_CASES, ids=str)
def test_lowers_to_mosaic_for_tpu(dtype, case, monkeypatch, fresh_caches):
  """Every masking feature lowers for the TPU (no TPU needed)."""
  monkeypatch.setattr(kernel, "interpret_params", lambda: False)
  q, k, v, kw = make_inputs(case, DTYPES[dtype], rng("lower", str(case)))
  _assert_lowers_to_mosaic(q, k, v, kw)


def test_dropout_and_value_head_dim_lower_to_mosaic(monkeypatch,
                                                     fresh_caches):
  """The dropout hash (uint32 arithmetic on the seed in scalar memory and
  on the tile's indices) and padded widths H != Hv lower for the TPU."""
  monkeypatch.setattr(kernel, "interpret_params", lambda: False)
  case = Case(b=2, t=200, s=300, n=4, k=2, h=32, causal=True, bias="heads")
  gen = rng("lower-dropout")
  q, k, _, kw = make_inputs(case, jnp.bfloat16, gen)
  v = testing.normal(gen, (case.b, case.s, case.k, 160), jnp.bfloat16)
  kw.update(dropout_rate=0.2, dropout_rng=jax.random.key(0))
  _assert_lowers_to_mosaic(q, k, v, kw)


def test_float8_lowers_to_mosaic_for_tpu(monkeypatch, fresh_caches):
  """A float8 call (quantized in the call, so that it differentiates): the
  float8 forward (1-byte tiles widened in the kernel, the scale rows) and
  the float32 dK/dV and dQ kernels of its backward lower for the TPU."""
  monkeypatch.setattr(kernel, "interpret_params", lambda: False)
  case = Case(b=2, t=200, s=300, n=4, k=2, h=64, causal=True,
              segments=True, soft_cap=3.0)
  q, k, v, kw = make_inputs(case, jnp.bfloat16, rng("lower-float8"))
  for granularity in ("token", "head"):
    _assert_lowers_to_mosaic(q, k, v, dict(kw, quantize=granularity))


@pytest.mark.parametrize("granularity", ["token", "head"])
def test_float8_operands_stay_one_byte(granularity):
  """The float8 forward reads q, k and v as stored (no widened copy in
  HBM), beside float32 scale rows of one value per row and head: the
  query's, and per-token key and value scales'; a key's scale per head
  is folded into the query's rows, a value's per head is one SMEM scalar
  per (batch row, query head)."""
  gen = rng("float8 operands", granularity)
  b, t, s, n, num_kv, h = 1, 256, 384, 4, 2, 128
  wide = (testing.normal(gen, (b, t, n, h)),
          testing.normal(gen, (b, s, num_kv, h)),
          testing.normal(gen, (b, s, num_kv, h)))
  pairs = [pallas_fa.quantize_fp8(x, granularity) for x in wide]

  def call(*args):
    return pallas_fa.flash_attention(
        *args[:3], query_scale=args[3], key_scale=args[4],
        value_scale=args[5], implementation="mosaic_tpu", block_sizes=TILES)

  (operands,) = attention_testing.pallas_call_operands(
      call, *(p[0] for p in pairs), *(p[1] for p in pairs))
  narrow = [x.shape for x in operands if x.dtype == jnp.float8_e4m3fn]
  assert narrow == [(b, t, n * h), (b, s, num_kv * h), (b, s, num_kv * h)]
  scales = [x.shape for x in operands if x.dtype == jnp.float32]
  if granularity == "token":
    assert scales == [(b, n, 1, t), (b, num_kv, 1, s), (b, num_kv, 1, s)]
  else:
    assert scales == [(b, n, 1, t), (b * n,)]


# --- flex attention: tables read at computed offsets -------------------------


def _relative_bias(score, batch, head, q_idx, kv_idx, table):
  """A learned relative bias per head over clipped distances (a table of
  2 * span + 1 entries per head, read at kv_idx - q_idx directly)."""
  del batch
  span = (table.shape[1] - 1) // 2
  return score + table[head, jnp.clip(kv_idx - q_idx, -span, span) + span]


# (name, score_mod, case, table shape): several query and key tiles each
# way, so the table's gradient is summed over partial tables of several
# programs and query tiles.
TABLE_CASES = [
    ("t5", flex.t5_relative_bias,
     Case(b=2, t=200, s=300, n=4, k=2, h=16, causal=True), (4, 32)),
    ("relative_bias", _relative_bias,
     Case(b=1, t=260, s=140, n=2, k=1, h=8, lengths=True), (2, 201)),
]


def _table_run(implementation, fn, q, k, v, table, kw, dout, dlse):
  """(out, lse, (dq, dk, dv, dtable)) of a table score_mod."""
  def f(q, k, v, table):
    return pallas_fa.flash_attention(
        q, k, v, score_mod=fn, score_mod_args=(table,),
        implementation=implementation,
        block_sizes=block_sizes_for(implementation), return_residual=True,
        **kw)

  (out, lse), pullback = jax.vjp(f, q, k, v, table)
  return out, lse, pullback((dout, dlse))


@pytest.mark.slow  # 20 s: Mosaic TPU's interpreter over several tiles
@pytest.mark.parametrize("name, fn, case, shape", TABLE_CASES,
                         ids=[c[0] for c in TABLE_CASES])
def test_table_score_mod_multi_tile(name, fn, case, shape):
  """A table read at offsets computed per element (selected one-hot from
  scalar memory), across several 128-row tiles: out, lse, dq, dk, dv and
  the table's gradient against xla in float32."""
  gen = rng("tables-multi-tile", name)
  q, k, v, kw = make_inputs(case, jnp.float32, gen)
  table = testing.normal(gen, shape)
  dout = testing.normal(gen, q.shape)
  dlse = testing.normal(gen, q.shape[:-1])
  got = _table_run("mosaic_tpu", fn, q, k, v, table, kw, dout, dlse)
  want = _table_run("xla", fn, q, k, v, table, kw, dout, dlse)
  for result, x, r in zip(("out", "lse", "dq", "dk", "dv", "dtable"),
                          (got[0], got[1], *got[2]),
                          (want[0], want[1], *want[2])):
    assert x.shape == r.shape, result
    assert_close(result, x, r)


def _allowed_distances(batch, head, q_idx, kv_idx, allowed):
  """A mask_mod reading a bool table per head at the clipped distance."""
  del batch
  span = (allowed.shape[1] - 1) // 2
  distance = jnp.clip(kv_idx - q_idx, -span, span) + span
  return allowed[head, distance] | (kv_idx == q_idx)


def test_table_mask_mod():
  """A mask_mod's table (bool, int32 in scalar memory) is selected the
  same way, in every kernel: out, lse, dq, dk, dv against xla."""
  gen = rng("tables-mask-mod")
  q, k, v, kw = make_inputs(Case(b=2, t=150, s=150, n=2, k=1, h=16),
                            jnp.float32, gen)
  kw.update(mask_mod=_allowed_distances, mask_mod_args=(
      jnp.asarray(gen.random((2, 21)) < 0.7),))
  dout = testing.normal(gen, q.shape)
  dlse = testing.normal(gen, q.shape[:-1])
  got = run(flash("mosaic_tpu", TILES), q, k, v, kw, dout, dlse)
  want = run(flash("xla"), q, k, v, kw, dout, dlse)
  for result, x, r in zip(("out", "lse", "dq", "dk", "dv"),
                          (got[0], got[1], *got[2]),
                          (want[0], want[1], *want[2])):
    assert_close(result, x, r)


def _primitive_names(jaxpr):
  """The names of every primitive in `jaxpr` and its sub-jaxprs."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(sub, "jaxpr", sub)
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          yield from _primitive_names(inner)


@pytest.mark.parametrize("name, fn, shape", [
    ("t5", flex.t5_relative_bias, (4, 32)),
    ("relative_bias", _relative_bias, (4, 201))],
                         ids=["t5", "relative_bias"])
def test_table_score_mod_lowers_to_mosaic(name, fn, shape, monkeypatch,
                                          fresh_caches):
  """A table score_mod's forward, dK/dV and dQ kernels lower for the TPU
  (no TPU needed), and no kernel gathers: the table is read as scalars
  and selected with compares and selects."""
  monkeypatch.setattr(kernel, "interpret_params", lambda: False)
  case = Case(b=2, t=200, s=300, n=4, k=2, h=64, causal=True)
  gen = rng("lower-tables", name)
  q, k, v, kw = make_inputs(case, jnp.bfloat16, gen)
  table = testing.normal(gen, shape)

  def loss(q, k, v, table):
    out = pallas_fa.flash_attention(
        q, k, v, score_mod=fn, score_mod_args=(table,),
        implementation="mosaic_tpu", block_sizes=TILES, **kw)
    return jnp.sum(out.astype(jnp.float32))

  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  calls = list(_pallas_calls(jax.make_jaxpr(grad)(q, k, v, table).jaxpr))
  assert len(calls) == 3
  for eqn in calls:
    names = set(_primitive_names(eqn.params["jaxpr"]))
    assert not names & {"gather", "dynamic_slice", "scatter-add",
                        "scatter_add"}, names
  module = jax.export.export(jax.jit(grad), platforms=["tpu"])(
      q, k, v, table).mlir_module()
  assert module.count("tpu_custom_call") == 3
  assert "callback" not in module


def test_tables_beyond_the_limit_are_declined(monkeypatch, fresh_caches):
  """More entries per program than `kernel.MAX_TABLE_ENTRIES` is declined
  naming score_mod, the size and the limit, and so is a table that would
  not fit in scalar memory beside the metadata; the automatic choice then
  runs chunked, and implementation=None on a CPU runs the table."""
  gen = rng("tables-declined")
  q, k, v, _ = make_inputs(Case(b=1, t=40, s=40, n=2, k=1, h=8),
                           jnp.float32, gen)
  limit = kernel.MAX_TABLE_ENTRIES
  tables = {width: testing.normal(gen, (2, width))
            for width in (9, limit + 1 + (limit % 2))}

  def call(width, implementation):  # Default tiles: None picks those.
    return pallas_fa.flash_attention(
        q, k, v, score_mod=_relative_bias, score_mod_args=(tables[width],),
        is_causal=True, implementation=implementation)

  width = limit + 1 + (limit % 2)  # Odd: 2 * span + 1 entries.
  with pytest.raises(NotImplementedError,
                     match=f"score_mod.* {width} entries.* {limit}"):
    call(width, "mosaic_tpu")
  small = call(9, "mosaic_tpu")
  np.testing.assert_array_equal(call(9, None), call(9, "chunked"))
  monkeypatch.setitem(api.AUTO_ORDER, api.platform(),
                      ("mosaic_tpu", "chunked"))
  api.clear_cache()
  try:
    np.testing.assert_array_equal(call(width, None), call(width, "chunked"))
    np.testing.assert_array_equal(call(9, None), small)
  finally:
    api.clear_cache()
  # On a TPU, the tables (Bm * Hm * size words) and the other per-program
  # values share scalar memory with the per-step metadata: here 2 * 9
  # words of table, the clip's two bounds and one metadata word a pass.
  monkeypatch.setattr(kernel, "interpret_params", lambda: False)
  monkeypatch.setattr(kernel, "metadata_capacity", lambda: 20)
  with pytest.raises(NotImplementedError,
                     match=r"tables \(20 words: .*\) and 1 per-step"):
    call(9, "mosaic_tpu")
  monkeypatch.setattr(kernel, "metadata_capacity", lambda: 21)
  _, _, _, _, info, params = _canonicalise(q, k, v, dict(
      score_mod=_relative_bias, score_mod_args=(tables[9],)))
  mosaic_tpu.BACKEND.check(q, k, v, None, info, params)


# --- the decode kernel (`mosaic_tpu.decode`): DMAs and lowering --------------


def _decode_inputs(gen, *, b, t, n, num_kv, h, lengths, page_size, dtype):
  """q, a cache of shuffled pages, its block table and the lengths."""
  max_pages = -(-max(lengths) // page_size)
  pages = gen.permutation(b * max_pages).reshape(b, max_pages)
  q = testing.normal(gen, (b, t, n, h), dtype)
  k = testing.normal(gen, (b * max_pages, page_size, num_kv, h), dtype)
  v = testing.normal(gen, (b * max_pages, page_size, num_kv, h), dtype)
  return (q, k, v, jnp.asarray(pages, jnp.int32),
          jnp.asarray(lengths, jnp.int32))


def test_decode_fetches_each_visible_page_once(monkeypatch, fresh_caches):
  """Grid (B, K, splits, steps): the pipeline copies each page of a split's
  run once, and the steps past a run (re-naming its last page) none."""
  lengths, page_size, splits = [70, 37], 16, 2
  q, k, v, table, lens = _decode_inputs(
      rng("decode-dma"), b=2, t=1, n=2, num_kv=1, h=32, lengths=lengths,
      page_size=page_size, dtype=jnp.float32)
  log = _DmaLog(monkeypatch)
  out = pallas_fa.decode_attention(
      q, k, v, lens, block_table=table, num_splits=splits,
      implementation="mosaic_tpu")
  jax.block_until_ready(out)
  # Runs of ceil(blocks / splits) pages: [0, 3) [3, 5) and [0, 2) [2, 3).
  table = np.asarray(table)
  needed = [(row, table[row, i]) for row, length in enumerate(lengths)
            for i in range(-(-length // page_size))]
  steps = -(-table.shape[1] // splits)
  # The kernel's `*refs` after the lengths and split runs: the block table,
  # q, the row positions, k, v.
  for operand in (3, 4):
    assert log.count(operand, 4) == _runs(needed) == len(needed)
  assert len(needed) < len(lengths) * splits * steps  # some steps skip


DECODE_LOWERING_CASES = [
    # (dtype, G, T_new, H, page size or None for a contiguous cache, extra)
    ("bfloat16", 4, 4, 128, 16, {}),
    ("float32", 1, 2, 192, None,
     {"local_window_size": (40, 0), "logits_soft_cap": 5.0}),
    ("float16", 2, 1, 8192, None, {}),  # blocks of fewer than 128 keys
]


@pytest.mark.parametrize("dtype, group, t, h, page_size, kw",
                         DECODE_LOWERING_CASES, ids=str)
def test_decode_lowers_to_mosaic_for_tpu(dtype, group, t, h, page_size, kw,
                                         monkeypatch, fresh_caches):
  monkeypatch.setattr(kernel, "interpret_params", lambda: False)
  q, k, v, table, lengths = _decode_inputs(
      rng("decode-lower", dtype, h), b=2, t=t, n=2 * group, num_kv=2, h=h,
      lengths=[300, 77], page_size=page_size or 16, dtype=DTYPES[dtype])
  if page_size is None:  # The same keys as one contiguous cache.
    k, v = (x[table].reshape(2, -1, *x.shape[2:]) for x in (k, v))
    table = None

  def decode(q, k, v, lengths, table):
    return pallas_fa.decode_attention(
        q, k, v, lengths, block_table=table, implementation="mosaic_tpu",
        num_splits=2, **kw)

  exported = jax.export.export(jax.jit(decode), platforms=["tpu"])(
      q, k, v, lengths, table)
  module = exported.mlir_module()
  assert module.count("tpu_custom_call") == 1
  assert "callback" not in module  # a compiled kernel, not the interpreter


# --- numerics across many tiles -----------------------------------------------

# The float32 ones in the slow leg (README's run keeps the padded head dim
# with ragged lengths and positions).
MULTI_TILE_CASES = [
    pytest.param("float32", Case(b=2, t=200, s=300, n=4, k=2, h=32,
                                 causal=True, segments=True,
                                 window=(100, 20)), marks=pytest.mark.slow),
    pytest.param("float32", Case(b=1, t=130, s=260, n=2, k=1, h=8,
                                 bias="heads", mask="broadcast",
                                 soft_cap=3.0), marks=pytest.mark.slow),
    ("bfloat16", Case(b=2, t=257, s=129, n=2, k=1, h=72, lengths=True,
                      positions=True, causal=True)),
]


@pytest.mark.parametrize("dtype, case", MULTI_TILE_CASES, ids=str)
def test_multi_tile(dtype, case):
  check_against_reference(flash("mosaic_tpu", TILES), case, DTYPES[dtype],
                          rng("multi-tile", str(case), dtype))


# Value head dims whose padded width differs from the query/key one (128 vs
# 256 lanes), with dropout: GQA, causal and segment ids in one, a bias (and
# its gradient) in the other.
VALUE_DIM_DROPOUT_CASES = [
    (Case(b=1, t=200, s=260, n=4, k=2, h=32, causal=True, segments=True),
     160, 0.3),
    (Case(b=1, t=130, s=140, n=2, k=1, h=136, bias="heads"), 16, 0.5),
]


@pytest.mark.parametrize("case, hv, rate", VALUE_DIM_DROPOUT_CASES, ids=str)
def test_value_head_dim_and_dropout_multi_tile(case, hv, rate):
  """Against the reference drawing the same dropout mask: out, lse and
  every gradient, across several tiles."""
  gen = rng("value-dim-dropout", str(case), hv)
  q, k, _, kw = make_inputs(case, jnp.float32, gen)
  v = testing.normal(gen, (case.b, case.s, case.k, hv))
  kw.update(dropout_rate=rate, dropout_rng=int(gen.integers(1 << 31)))
  dout = testing.normal(gen, (case.b, case.t, case.n, hv))
  dlse = testing.normal(gen, q.shape[:-1])
  out, lse, grads = run(flash("mosaic_tpu", TILES), q, k, v, kw, dout, dlse)
  ref_out, ref_lse, ref_grads = run(
      reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  assert out.shape == ref_out.shape == (case.b, case.t, case.n, hv)
  for name, x, r in zip(["out", "lse", "dq", "dk", "dv", "dbias"],
                        [out, lse, *grads], [ref_out, ref_lse, *ref_grads]):
    assert x.shape == r.shape, name
    assert_close(name, x, r)


@pytest.mark.slow  # Default tiles at T = 1; test_multi_tile runs the kernels.
def test_decode_with_default_block_sizes():
  """T = 1 (MQA decode, bottom-right aligned) with the heuristic tiling."""
  case = Case(b=2, t=1, s=700, n=8, k=1, h=128, causal=True, positions=True)
  check_against_reference(flash("mosaic_tpu", None), case, jnp.float32,
                          rng("decode"))


SLOW_CASES = [
    ("float32", Case(b=1, t=600, s=700, n=4, k=1, h=256, causal=True,
                     lengths=True)),
    ("bfloat16", Case(b=2, t=384, s=520, n=4, k=2, h=64, bias="full",
                      mask="full", segments=True, soft_cap=10.0)),
    ("float16", Case(b=1, t=300, s=300, n=8, k=8, h=128, window=(0, 130))),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, case", SLOW_CASES, ids=str)
def test_multi_tile_slow(dtype, case):
  # Unequal tiles: the forward and backward sweeps tile differently.
  bs = mosaic_tpu.MosaicTpuBlockSizes(
      block_q=128, block_kv=256, block_q_bwd=256, block_kv_bwd=128)
  check_against_reference(flash("mosaic_tpu", bs), case, DTYPES[dtype],
                          rng("multi-tile-slow", str(case), dtype))


def test_lowers_inside_a_user_shard_map_that_checks_varying_axes(
    monkeypatch):
  """Compiled, the kernels run inside `jax.shard_map(check_vma=True)`:
  their outputs are declared varying (`manual_axes.out_structs`), and
  forward, dK/dV and dQ lower to Mosaic TPU custom calls. (Interpreted,
  they decline: `tests/_parallel_worker.py user_shard_map`.)"""
  monkeypatch.setattr(kernel, "interpret_params", lambda: False)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
  spec = jax.sharding.PartitionSpec

  def loss(q, k, v):
    out = pallas_fa.flash_attention(q, k, v, is_causal=True,
                                    implementation="mosaic_tpu")
    return jax.lax.psum(jnp.sum(out.astype(jnp.float32)), "d")

  grad = jax.grad(jax.shard_map(loss, mesh=mesh, in_specs=spec("d"),
                                out_specs=spec()), argnums=(0, 1, 2))
  q = jnp.ones((1, 256, 2, 128), jnp.bfloat16)
  module = jax.export.export(jax.jit(grad), platforms=["tpu"])(
      q, q, q).mlir_module()
  assert module.count("tpu_custom_call") == 3
  assert "callback" not in module
