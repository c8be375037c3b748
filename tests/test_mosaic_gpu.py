"""Tests of the `mosaic_gpu` backend that run without a GPU.

* The Hopper kernels are lowered ahead of time for CUDA (Pallas -> Mosaic GPU
  IR, wgmma / TMA / layout checks and the shared-memory budget included) for
  head dims 64..256, both dtypes and every mask feature.
* The same kernel bodies run in the Mosaic GPU interpreter on CPU (warp
  specialisation, barriers, TMA ring, ping-pong, tile schedule and math) and
  are compared with the float32 reference under the FlashAttention rule,
  also under the interpreter's race detector.
* Config validation, the heuristic, the tile schedule and `check` decisions
  are checked directly.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import Case
from attention_testing import assert_close
from attention_testing import check_against_reference
from attention_testing import flash
from attention_testing import gpu_jax_only
from attention_testing import make_inputs
from attention_testing import needs_hopper
from attention_testing import race_verdicts
from attention_testing import reference_fn
from attention_testing import rng
from attention_testing import run

import pallas_fa
from pallas_fa import gpu_target
from pallas_fa import layout
from pallas_fa import masking
from pallas_fa import mosaic_gpu
from pallas_fa import testing
from pallas_fa import tuning
from pallas_fa import vjp
from pallas_fa.mosaic_gpu import dkv
from pallas_fa.mosaic_gpu import exp2
from pallas_fa.mosaic_gpu import kernel
from pallas_fa.mosaic_gpu import ops as gpu_ops
from pallas_fa.mosaic_gpu import tiles

_SMALL = dict(
    block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64, block_q_dkv=64,
    block_kv_dkv=64)


needs_interpreter = pytest.mark.skipif(
    kernel.interpret_params() is None or jax.default_backend() != "cpu",
    reason="the Mosaic GPU interpreter runs on CPU only")


# --------------------------------------------------------------------------
# Config and heuristic.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("block_q", 32), ("block_kv", 48), ("block_q_dkv", 16),
    ("block_kv", 96), ("block_q_dkv", 160),
    ("block_kv_dkv", 320), ("block_kv_dq", 288),
    ("num_stages", 0), ("num_stages_bwd", 9), ("num_consumers_dq", 3),
    ("split_dkv", 1), ("num_ctas", 0), ("interpret", "yes"),
    ("lowering_semantics", "Lane"), ("backward", "fast"),
    ("head_section", 0), ("head_section", 2.0), ("dq_split", "rows"),
    ("poly_exp2", 17), ("poly_exp2", -1), ("dq_swizzle", 16),
    ("dq_swizzle", 128.0), ("fused_overlap", 1), ("fused_pipeline", 1),
    ("fused_softmax_overlap", 1),
])
def test_block_sizes_rejects_bad_fields(field, value):
  with pytest.raises(ValueError, match=field):
    mosaic_gpu.MosaicGpuBlockSizes(**{field: value})


def test_block_sizes_pingpong_needs_two_consumers():
  with pytest.raises(ValueError, match="pingpong"):
    mosaic_gpu.MosaicGpuBlockSizes(num_consumers=1)
  mosaic_gpu.MosaicGpuBlockSizes(num_consumers=1, pingpong=False)


def test_block_sizes_intra_overlap_is_a_bool():
  with pytest.raises(ValueError, match="intra_overlap"):
    mosaic_gpu.MosaicGpuBlockSizes(intra_overlap=1)
  assert not mosaic_gpu.MosaicGpuBlockSizes().intra_overlap


def test_block_sizes_float8_two_level_is_a_bool_without_intra_overlap():
  with pytest.raises(ValueError, match="float8_two_level"):
    mosaic_gpu.MosaicGpuBlockSizes(float8_two_level=1)
  with pytest.raises(ValueError, match="float8_two_level.*intra_overlap"):
    mosaic_gpu.MosaicGpuBlockSizes(float8_two_level=True, intra_overlap=True)
  assert not mosaic_gpu.MosaicGpuBlockSizes().float8_two_level


def test_block_sizes_fused_step_orders_that_combine():
  """`fused_overlap` and `fused_pipeline` are alternatives (both stage
  dS^T under dK's product); `fused_softmax_overlap` combines with
  either."""
  with pytest.raises(ValueError, match="fused_overlap.*fused_pipeline"):
    mosaic_gpu.MosaicGpuBlockSizes(fused_overlap=True, fused_pipeline=True)
  for other in ("fused_overlap", "fused_pipeline"):
    bs = mosaic_gpu.MosaicGpuBlockSizes(fused_softmax_overlap=True,
                                        **{other: True})
    assert bs.fused_softmax_overlap and getattr(bs, other)
  assert not mosaic_gpu.MosaicGpuBlockSizes().fused_pipeline


def test_block_sizes_frozen_and_hashable():
  bs = mosaic_gpu.MosaicGpuBlockSizes(**_SMALL)
  assert hash(bs) == hash(mosaic_gpu.MosaicGpuBlockSizes(**_SMALL))
  with pytest.raises(AttributeError):
    bs.block_q = 128


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [1, 32, 64, 72, 128, 160, 256])
def test_heuristic_fits_shared_memory(head_dim, dtype):
  bs = mosaic_gpu.heuristic_block_sizes(
      q_len=4096, kv_len=4096, head_dim=head_dim, dtype=dtype)
  smem = mosaic_gpu.shared_memory_bytes(bs, head_dim)
  assert max(smem.values()) <= mosaic_gpu.SHARED_MEMORY_BYTES, smem
  assert bs.num_stages >= 2
  # Past head dim 128 two float32 [64, H] accumulators would not fit the
  # registers of a consumer thread: split passes, one consumer.
  wide = layout.padded_head_dim(head_dim, mosaic_gpu.ALIGN) > 128
  assert bs.split_dkv == wide
  candidates = mosaic_gpu.candidate_block_sizes(
      bs, head_dim=head_dim, dtype=dtype)
  assert candidates[0] == bs and len(set(candidates)) == len(candidates) > 1
  for candidate in candidates:
    smem = mosaic_gpu.shared_memory_bytes(candidate, head_dim)
    assert max(smem.values()) <= mosaic_gpu.SHARED_MEMORY_BYTES
  forward = mosaic_gpu.candidate_block_sizes(
      bs, head_dim=head_dim, dtype=dtype, passes=("forward",))
  assert all(c.block_q_dkv == bs.block_q_dkv and c.split_dkv == bs.split_dkv
             for c in forward)
  # The pipelined key loop is searched too, never past 128 keys.
  assert any(c.intra_overlap for c in forward)
  assert all(c.block_kv <= 128 for c in forward if c.intra_overlap)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_heuristic_takes_the_measured_winners(head_dim):
  """The tilings an H200 window measured faster are the defaults where they
  were measured (07213ac): a full call's fused backward pipelines its dQ
  (`fused_pipeline`), a causal one keeps the in-step order; a full float8
  forward streams 256-key tiles in two stages at head dims <= 128 where
  the keys fill whole tiles, and 128-key ones elsewhere."""
  kw = dict(q_len=4096, head_dim=head_dim)
  full = mosaic_gpu.heuristic_block_sizes(kv_len=4096, dtype=jnp.bfloat16,
                                          **kw)
  causal = mosaic_gpu.heuristic_block_sizes(
      kv_len=4096, dtype=jnp.bfloat16, is_causal=True, **kw)
  assert full.fused_pipeline and not causal.fused_pipeline
  assert dataclasses.replace(full, fused_pipeline=False) == causal
  e4m3 = jnp.float8_e4m3fn
  wide = head_dim > 128
  for kv_len, causal, want in ((4096, False, 64 if wide else 256),
                               (4096 + 128, False, 64 if wide else 128),
                               (4096, True, 64 if wide else 128)):
    bs = mosaic_gpu.heuristic_block_sizes(kv_len=kv_len, dtype=e4m3,
                                          is_causal=causal, **kw)
    assert bs.block_kv == want, (kv_len, causal, bs)
    assert mosaic_gpu.tiles.fp8_forward_bytes(bs, head_dim, head_dim) <= (
        mosaic_gpu.SHARED_MEMORY_BYTES)
    if want == 256:
      assert bs.num_stages == 2


def test_tuned_records_win_over_heuristic(monkeypatch):
  tuned = dict(block_q=128, block_kv=64, num_stages=3, pingpong=False)
  key = tuning.tuning_key(head_dim=128, dtype=jnp.bfloat16, q_len=4096,
                          kv_len=4096, is_causal=False)
  records = {"mosaic_gpu": [{"key": key, "block_sizes": tuned}]}
  monkeypatch.setattr(tuning, "load_tuned", lambda kind: records)
  kw = dict(q_len=2048, kv_len=4096, head_dim=128, dtype=jnp.bfloat16,
            device_kind="NVIDIA H100 80GB HBM3")
  assert mosaic_gpu.default_block_sizes(**kw) == (
      mosaic_gpu.MosaicGpuBlockSizes(**tuned))
  assert mosaic_gpu.default_block_sizes(**dict(kw, head_dim=64)) == (
      mosaic_gpu.heuristic_block_sizes(**dict(kw, head_dim=64)))


# --------------------------------------------------------------------------
# check(): what is refused, so that the automatic choice falls back.
# --------------------------------------------------------------------------


def _canonical(dtype=jnp.bfloat16, h=32, mask=None, bias=None, **kw):
  gen = rng("check", str(dtype), h)
  q, k, v, _ = make_inputs(Case(b=1, t=8, s=8, n=2, k=1, h=h), dtype, gen)
  call = pallas_fa.api.canonicalize(q, k, v, bias, mask)
  return (*call.arrays[:5], vjp.Params(scale=call.params.scale, **kw))


@pytest.mark.parametrize("change, reason", [
    (dict(dtype=jnp.float32), "bfloat16/float16"),
    (dict(bias=jnp.ones((1, 2, 8, 8))), "bias"),
    (dict(mask=jnp.ones((1, 1, 8, 8), bool)), "dense mask"),
    (dict(block_sizes=mosaic_gpu.MosaicGpuBlockSizes(interpret=False)), "sm90"),
])
def test_check_refuses(change, reason):
  if "sm90" in reason and jax.default_backend() != "cpu":
    pytest.skip("only meaningful without a GPU")
  args = _canonical(**change)
  with pytest.raises(NotImplementedError, match=reason):
    mosaic_gpu.BACKEND.check(*args)


def test_check_mixed_dtypes_and_wide_heads():
  q, k, v, bias, info, params = _canonical()
  with pytest.raises(NotImplementedError, match="one dtype"):
    mosaic_gpu.BACKEND.check(q, k.astype(jnp.float16), v, bias, info, params)
  wide = [jnp.pad(x, ((0, 0),) * 3 + ((0, 288),)) for x in (q, k, v)]
  with pytest.raises(NotImplementedError, match="head dims"):
    mosaic_gpu.BACKEND.check(*wide, bias, info, params)


@needs_interpreter
def test_check_accepts_interpreter_on_cpu(monkeypatch):
  mosaic_gpu.BACKEND.check(*_canonical())
  mosaic_gpu.BACKEND.check(*_canonical(dtype=jnp.float16, h=256))
  # Without an interpreter there is nothing to run on.
  monkeypatch.setattr(kernel, "interpret_params", lambda: None)
  with pytest.raises(NotImplementedError, match="interpreter"):
    mosaic_gpu.BACKEND.check(*_canonical())
  monkeypatch.undo()
  # Nor with fewer CPU client threads than warpgroups (a deadlock).
  monkeypatch.setenv("NPROC", "2")
  with pytest.raises(NotImplementedError, match="NPROC=3"):
    mosaic_gpu.BACKEND.check(*_canonical())


def test_check_refuses_masked_kernels_on_miscompiling_cuda(monkeypatch):
  monkeypatch.setattr(mosaic_gpu, "runs_interpreted", lambda bs: False)
  monkeypatch.setattr(mosaic_gpu, "cuda_runtime_version", lambda: 12085)
  gen = rng("cuda-version")
  bs = mosaic_gpu.MosaicGpuBlockSizes(**_SMALL)
  for case, refused in [
      (Case(b=1, t=128, s=128, n=2, k=2, h=64), False),
      (Case(b=1, t=128, s=128, n=2, k=2, h=64, causal=True), True),
      (Case(b=1, t=100, s=128, n=2, k=2, h=64), True),  # ragged tail
  ]:
    q, k, v, _ = make_inputs(case, jnp.bfloat16, gen)
    call = pallas_fa.api.canonicalize(q, k, v, is_causal=case.causal)
    q, k, v, bias, info, _ = call.arrays
    params = vjp.Params(scale=call.params.scale, block_sizes=bs)
    if refused:
      with pytest.raises(NotImplementedError, match="ptxas"):
        mosaic_gpu.BACKEND.check(q, k, v, bias, info, params)
    else:
      mosaic_gpu.BACKEND.check(q, k, v, bias, info, params)
  monkeypatch.setattr(mosaic_gpu, "cuda_runtime_version", lambda: 12091)
  mosaic_gpu.BACKEND.check(q, k, v, bias, info, params)


def test_builds_for_hopper_targets_only():
  """An ahead-of-time sm90 target builds compiled kernels; sm80 declines."""
  with gpu_target.compile_for(gpu_target.H100):
    assert not mosaic_gpu.runs_interpreted(None)
    assert pallas_fa.api.platform() == "gpu"
  with gpu_target.compile_for(gpu_target.A100):
    with pytest.raises(NotImplementedError, match="sm90"):
      mosaic_gpu.runs_interpreted(
          mosaic_gpu.MosaicGpuBlockSizes(interpret=False))


def test_automatic_choice_never_interprets_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU order")
  assert "mosaic_gpu" not in pallas_fa.api.AUTO_ORDER["cpu"]
  assert pallas_fa.api.AUTO_ORDER["gpu"][0] == "mosaic_gpu"


# --------------------------------------------------------------------------
# The tile schedule.
# --------------------------------------------------------------------------


def _random_info(gen, b, t, s, causal, window, segments):
  info = masking.MaskInfo(
      q_positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
      kv_positions=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
      is_causal=causal, window=window)
  # Long enough that some tiles are free of padding (FULL).
  q_len = jnp.asarray(gen.integers(t // 2, t + 1, b), jnp.int32)
  kv_len = jnp.asarray(gen.integers(s // 2, s + 1, b), jnp.int32)
  q_seg = kv_seg = None
  if segments:
    q_seg = jnp.asarray(np.sort(gen.integers(0, 3, (b, t))), jnp.int32)
    kv_seg = jnp.asarray(np.sort(gen.integers(0, 3, (b, s))), jnp.int32)
  return info.replace(
      q_segment_ids=masking.padding_segments(
          q_seg, q_len, t, masking.Q_PAD_SEGMENT),
      kv_segment_ids=masking.padding_segments(
          kv_seg, kv_len, s, masking.KV_PAD_SEGMENT))


@pytest.mark.parametrize("t, bk", [(1024, 192), (16384, 192), (4000, 128)])
def test_causal_schedule_stops_at_the_diagonal_with_padded_keys(t, bk):
  """A causal call whose keys are padded to whole tiles streams, per unit,
  only the key tiles up to its last real row's: the padding's positions
  (0) do not make the last tile visible to every unit (H200, T = 16384,
  192-key tiles: every unit streamed all 86 tiles, 0.51x the rate)."""
  bq, consumers = 64, 2
  rows = bq * consumers
  tp, sp = layout.padded_length(t, rows), layout.padded_length(t, bk)
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  info = masking.MaskInfo(q_positions=pos, kv_positions=pos, is_causal=True,
                          positions_are_indices=True)
  info = masking.pad_sequence(info, tp, sp)
  sched = np.asarray(mosaic_gpu.schedule(
      masking.classify_blocks(info, bq, bk), consumers))
  units = tp // rows
  last_real_row = np.minimum((np.arange(units) + 1) * rows, t) - 1
  np.testing.assert_array_equal(sched[0, :, 0], 0)
  np.testing.assert_array_equal(sched[0, :, 1], last_real_row // bk + 1)


@pytest.mark.parametrize("causal, window, segments, transpose", [
    (True, None, False, False),
    (False, (150, 80), True, False),
    (True, (None, 0), True, True),
    (False, None, True, True),
])
def test_schedule_covers_visible_and_full_runs_are_unmasked(
    causal, window, segments, transpose):
  gen = rng("schedule", causal, window, segments, transpose)
  b, t, s, bq, bk, consumers = 2, 256, 320, 32, 64, 2
  if transpose:
    t, s, bq, bk = s, t, bk, bq
  info = _random_info(gen, b, t - 20, s - 30, causal, window, segments)

  @jax.jit
  def prepare(info):
    info = masking.pad_sequence(info, t, s)
    kinds = masking.classify_blocks(info, bq, bk)
    vis = masking.tile_visibility(info, 1)[:, 0, 0]  # [B, T, S]
    if transpose:
      kinds = jnp.swapaxes(kinds, 1, 2)
      vis = jnp.swapaxes(vis, 1, 2)
    return mosaic_gpu.schedule(kinds, consumers), vis

  row_block, col_block = (bk, bq) if transpose else (bq, bk)
  sched, vis = map(np.asarray, prepare(info))
  rows_per_unit = consumers * row_block
  assert sched.shape == (b, vis.shape[1] // rows_per_unit, 2 + 2 * consumers)
  saw_full_run = False
  for bi in range(b):
    for u in range(sched.shape[1]):
      ulo, uhi = sched[bi, u, :2]
      unit_vis = vis[bi, u * rows_per_unit:(u + 1) * rows_per_unit]
      cols = np.nonzero(unit_vis.any(axis=0))[0] // col_block
      assert np.all((cols >= ulo) & (cols < uhi)), (bi, u, ulo, uhi)
      for c in range(consumers):
        flo, fhi = sched[bi, u, 2 + 2 * c: 4 + 2 * c]
        assert ulo <= flo <= fhi <= uhi
        rows = unit_vis[c * row_block:(c + 1) * row_block]
        run = rows[:, flo * col_block:fhi * col_block]
        assert run.all(), (bi, u, c, flo, fhi)
        saw_full_run |= fhi > flo
  # Random segments under a causal mask may leave no FULL tile at all.
  assert saw_full_run or (causal and segments)


# --------------------------------------------------------------------------
# The compiled Hopper kernels lower (ahead of time, for CUDA).
# --------------------------------------------------------------------------


def _lower_for_hopper(case: Case, dtype, block_sizes=None):
  """Lowers forward + backward for an H100 (no GPU needed); returns the text."""
  gen = rng("lower", str(case))
  q, k, v, kw = make_inputs(case, dtype, gen)

  def loss(q, k, v):
    out = pallas_fa.flash_attention(
        q, k, v, implementation="mosaic_gpu", block_sizes=block_sizes, **kw)
    return out.astype(jnp.float32).sum()

  with gpu_target.compile_for(gpu_target.H100):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        q, k, v).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


@pytest.mark.parametrize("case, dtype, block_sizes, kernels", [
    # The default fused backward: one kernel for dQ, dK and dV.
    (Case(b=1, t=256, s=384, n=4, k=2, h=128, causal=True), jnp.bfloat16,
     None, 2),
    (Case(b=2, t=130, s=300, n=2, k=1, h=256, window=(64, 8), segments=True,
          lengths=True, soft_cap=20.0), jnp.float16, None, 4),
    (Case(b=1, t=200, s=200, n=2, k=2, h=72), jnp.bfloat16,
     mosaic_gpu.MosaicGpuBlockSizes(
         block_q=128, block_kv=64, num_stages=3, pingpong=False,
         block_kv_dq=128, block_q_dkv=32, num_consumers_dkv=1,
         num_ctas=3), 3),
    # 192-key forward tiles, padded keys masked by index.
    (Case(b=1, t=256, s=400, n=2, k=1, h=128), jnp.bfloat16,
     mosaic_gpu.MosaicGpuBlockSizes(block_kv=192), 2),
], ids=["h128-causal-gqa", "h256-window-segments-cap-f16", "h72-custom",
        "h128-wide-keys"])
def test_compiled_kernels_lower_for_hopper(case, dtype, block_sizes, kernels):
  text = _lower_for_hopper(case, dtype, block_sizes)
  assert text.count("custom_call @mosaic_gpu") == kernels


@pytest.mark.parametrize("h, causal", [(128, True), (64, False)])
def test_split_backward_lowers_for_hopper(h, causal):
  """backward="split" (what a reproducible backward runs): the forward and
  two backward kernels, dQ's and dK/dV's. The default fused one (dK, dV
  and dQ by TMA reduce-adds into an aliased float32 buffer) is lowered
  above."""
  bs = mosaic_gpu.MosaicGpuBlockSizes(backward="split")
  text = _lower_for_hopper(
      Case(b=1, t=256, s=384, n=4, k=2, h=h, causal=causal), jnp.bfloat16,
      bs)
  assert text.count("custom_call @mosaic_gpu") == 3


@pytest.mark.parametrize("semantics", ["lane", "warpgroup"])
def test_both_lowering_semantics_lower(semantics):
  """jax 0.10 lowers per lane by default, 0.11 per warpgroup: both work."""
  bs = mosaic_gpu.MosaicGpuBlockSizes(lowering_semantics=semantics)
  text = _lower_for_hopper(
      Case(b=1, t=128, s=192, n=2, k=1, h=64, causal=True, segments=True),
      jnp.bfloat16, bs)
  assert text.count("custom_call @mosaic_gpu") == 2  # The fused backward.


def _dealt(units):
  """(cta, b, head, row) of every unit the CTAs of `units` visit."""
  n = units.num_ctas
  cta = np.arange(n)[:, None]
  counts = np.asarray(units.count(cta))[:, 0]
  t = np.arange(counts.max())[None, :]
  b, head, row = (np.asarray(x) for x in units.decode(cta, t))
  visited = t < counts[:, None]
  ctas = np.broadcast_to(cta, visited.shape)
  return ctas[visited], b[visited], head[visited], row[visited]


@pytest.mark.parametrize("balance,reverse,table", [
    (False, False, True), (False, True, True), (True, True, True),
    (True, False, True), (True, True, False), (True, False, False)])
@pytest.mark.parametrize("batch,heads,rows,ctas", [
    (1, 16, 128, 132), (4, 16, 32, 132), (3, 5, 7, 11), (2, 40, 3, 132),
    (1, 1, 5, 5), (2, 3, 4, 24)])
def test_units_visit_each_unit_once(balance, reverse, table, batch, heads,
                                    rows, ctas):
  units = kernel.Units(batch, heads, rows, ctas, balance=balance,
                       reverse=reverse, table=table)
  _, b, head, row = _dealt(units)
  got = sorted(zip(b.tolist(), head.tolist(), row.tolist(), strict=True))
  assert got == [(i, j, r) for i in range(batch) for j in range(heads)
                 for r in range(rows)]


@pytest.mark.parametrize("batch,heads,rows", [(1, 16, 128), (4, 16, 32),
                                              (8, 32, 32), (2, 8, 64)])
def test_balanced_schedule(batch, heads, rows):
  """Causal units (forward/dQ: row tile i has i + 1 key tiles; dK/dV: the
  reverse) dealt to 132 persistent CTAs: the busiest CTA's work is within
  6% of the mean, where the plain (batch, head)-major order left it up to
  1.6x (T = 16384: 128 row tiles, a stride of 132 CTAs)."""

  def busiest_over_mean(units, work):
    cta, _, _, row = _dealt(units)
    per_cta = np.bincount(cta, weights=work(row), minlength=132)
    return per_cta.max() / per_cta.mean()

  growing = lambda row: row + 1  # noqa: E731
  shrinking = lambda row: rows - row  # noqa: E731
  for section in (None, 2, 4, 8):  # Dealt from a table (forward, dQ).
    forward = kernel.Units(batch, heads, rows, 132, balance=True,
                           reverse=True, section=section)
    dkv = kernel.Units(batch, heads, rows, 132, balance=True,
                       section=section)
    assert busiest_over_mean(forward, growing) < 1.06, section
    assert busiest_over_mean(dkv, shrinking) < 1.06, section
  # In waves, with the section the dealing balances best (dK/dV).
  for reverse, work in ((True, growing), (False, shrinking)):
    waves = kernel.Units(batch, heads, rows, 132, balance=True,
                         reverse=reverse, table=False)
    assert waves.table is None
    assert busiest_over_mean(waves, work) < 1.06
  if (batch, heads, rows) == (1, 16, 128):
    plain = kernel.Units(batch, heads, rows, 132, reverse=True)
    assert busiest_over_mean(plain, growing) > 1.5


@pytest.mark.parametrize("section", [1, 3, 4, 16])
def test_head_sections_are_dealt_in_order(section):
  """Every CTA finishes its units of one head section before it starts the
  next (so the CTAs running at once stream about one section's K/V), and
  within a section takes the longest first."""
  batch, heads, rows = 2, 8, 16
  units = kernel.Units(batch, heads, rows, 24, balance=True, reverse=True,
                       section=section)
  cta, b, head, row = _dealt(units)
  sections = (b * heads + head) // section
  for c in range(24):
    mine = cta == c
    assert np.all(np.diff(sections[mine]) >= 0)
    for s_ in np.unique(sections[mine]):
      rows_in = row[mine][sections[mine] == s_]
      assert np.all(np.diff(rows_in) <= 0)  # Longest (last row) first.


def test_default_head_section_fits_l2():
  """The default section streams at most 32 MiB (FlashAttention-3's L2
  budget): 4 heads' K/V at T = 16k, H = 128 in bfloat16, 16 at 4k."""
  per_head = lambda t: t * (128 + 128) * 2  # noqa: E731
  assert kernel.default_head_section(per_head(16384)) == 4
  assert kernel.default_head_section(per_head(4096)) == 16
  assert kernel.default_head_section(per_head(1 << 22)) == 1


def test_lowering_enforces_shared_memory_budget():
  too_big = mosaic_gpu.MosaicGpuBlockSizes(block_kv=256, num_stages=4)
  with pytest.raises(ValueError, match="shared memory"):
    _lower_for_hopper(Case(b=1, t=128, s=256, n=1, k=1, h=256),
                      jnp.bfloat16, too_big)


def test_wide_key_tiles_fit_without_metadata():
  """192-key forward tiles in two stages at H = 128 fit shared memory
  (230,400 B of buffers, 230,488 B compiled with the barriers) only where
  no positions or segment ids travel with them (`kernel.meta_smem`): a
  causal call with the default positions makes them from indices and
  fits; with positions of its own they do not, and the call says so,
  naming block_sizes, before Mosaic does."""
  bs = mosaic_gpu.MosaicGpuBlockSizes(block_kv=192)
  assert mosaic_gpu.shared_memory_bytes(bs, 128, meta=0)["forward"] == (
      230_400)
  assert mosaic_gpu.shared_memory_bytes(bs, 128, meta=1)["forward"] > (
      227 * 1024)
  causal = Case(b=1, t=128, s=384, n=1, k=1, h=128, causal=True)
  text = _lower_for_hopper(causal, jnp.bfloat16, bs)
  assert text.count("custom_call @mosaic_gpu") == 2
  with pytest.raises(ValueError, match=r"block_sizes=.* forward kernel.*"
                     r"leaving query_positions and key_positions unset"):
    _lower_for_hopper(dataclasses.replace(causal, positions=True),
                      jnp.bfloat16, bs)


def test_backward_tiles_past_shared_memory_name_block_sizes():
  """Two consumers with three backward stages at H = 128: the fused kernel
  misses the defaults' margin, so the call takes the split path, whose dQ
  kernel (267 KB of buffers) can never fit. The call says so, naming
  block_sizes, before Mosaic does."""
  bs = dataclasses.replace(
      mosaic_gpu.heuristic_block_sizes(
          q_len=256, kv_len=384, head_dim=128, dtype=jnp.bfloat16),
      num_stages_bwd=3)
  assert bs.num_consumers_dkv == bs.num_consumers_dq == 2
  assert mosaic_gpu.shared_memory_bytes(bs, 128)["dq"] > 227 * 1024
  with pytest.raises(ValueError, match=r"block_sizes=.* dQ kernel"):
    _lower_for_hopper(Case(b=1, t=256, s=384, n=2, k=2, h=128),
                      jnp.bfloat16, bs)


@pytest.mark.parametrize("fields, call, applies", [
    (dict(), dict(head_dim=128), True),  # "fused" is the default
    (dict(backward="fused"), dict(head_dim=64, dropout=True), True),
    (dict(backward="split"), dict(head_dim=128), False),
    (dict(backward="fused"), dict(head_dim=256), False),
    (dict(backward="fused"), dict(head_dim=64, value_head_dim=192), False),
    (dict(backward="fused", split_dkv=True), dict(head_dim=128), False),
    (dict(backward="fused"), dict(head_dim=128, dropout=True), False),
    (dict(backward="fused", block_q_dkv=32), dict(head_dim=64), False),
    (dict(dq_split="keys"), dict(head_dim=128), True),
], ids=["default-h128", "h64-dropout", "split", "h256", "wide-values",
        "split-dkv", "h128-dropout", "32-query-tiles", "dq-split-keys"])
def test_fused_backward_applies_where_it_fits(fields, call, applies):
  """The fused backward runs where its kernel fits (registers, shared
  memory, a 64-row dQ wgmma); elsewhere "fused" takes the split path
  instead of refusing the call."""
  bs = mosaic_gpu.MosaicGpuBlockSizes(**fields)
  call.setdefault("value_head_dim", call["head_dim"])
  assert mosaic_gpu.fused_backward_applies(
      bs, interpret=True, **call) == applies
  if applies:
    smem = mosaic_gpu.fused_backward_bytes(
        bs, call["head_dim"], value_head_dim=call["value_head_dim"])
    assert smem <= mosaic_gpu.SHARED_MEMORY_BYTES


@pytest.mark.parametrize("split, columns, slots, nbytes", [
    # K, V and the Q/dO rings with their vectors (137,216 B, each buffer
    # 1 KiB-aligned), two dS^T tiles per consumer, half of dQ's columns
    # staged per consumer.
    ("columns", 64, 2, 137_216 + 2 * (2 * 8_192 + 16_384)),
    # One dS^T tile per consumer (its only reader wrote it), a whole dQ
    # row of tiles staged per consumer.
    ("keys", 128, 1, 137_216 + 2 * (8_192 + 32_768)),
])
def test_fused_backward_dq_split(split, columns, slots, nbytes):
  """How the fused backward's two consumers divide dQ at H = 128, and the
  shared memory each way takes; at H = 64 (whose halves are not whole
  swizzle tiles) and with one consumer both are split by keys."""
  assert tiles.dq_columns(128, 2, split) == columns
  assert tiles.ds_slots(128, 2, split) == slots
  assert tiles.dq_columns(64, 2, split) == 64
  assert tiles.dq_columns(128, 1, split) == 128
  assert tiles.ds_slots(64, 2, split) == 1
  bs = mosaic_gpu.MosaicGpuBlockSizes(dq_split=split)
  assert mosaic_gpu.fused_backward_bytes(bs, 128) == nbytes
  assert nbytes <= mosaic_gpu.SHARED_MEMORY_BYTES


def test_fused_backward_declines_score_mod_gradients():
  """A score_mod whose values are differentiated keeps the split path (the
  dQ kernel sums their cotangents per query)."""
  gen = rng("fused", "score-mod")
  case = Case(b=1, t=64, s=64, n=2, k=1, h=64, causal=True)
  q, k, v, _ = make_inputs(case, jnp.bfloat16, gen)
  slopes = jnp.asarray(gen.uniform(0.1, 1.0, (case.n,)), jnp.float32)
  call = pallas_fa.api.canonicalize(
      q, k, v, None, None, score_mod=pallas_fa.flex.alibi,
      score_mod_args=(slopes,))
  score_mod, _ = mosaic_gpu._mods(call.info)
  bs = mosaic_gpu.MosaicGpuBlockSizes(backward="fused")
  assert not mosaic_gpu.fused_backward_applies(
      bs, 64, 64, score_mod, interpret=True)


# --------------------------------------------------------------------------
# The kernels, executed by the Mosaic GPU interpreter.
# --------------------------------------------------------------------------


@needs_interpreter
def test_interpreted_forward_and_backward():
  # Ragged T and S with padding lengths, causal, GQA, soft cap, head dim 32
  # (padded to 64): masked, unmasked and skipped tiles in every kernel, with
  # 32-row streamed tiles (the other interpreted tests stream 64 rows).
  case = Case(b=1, t=100, s=150, n=2, k=1, h=32, causal=True, lengths=True,
              soft_cap=3.0)
  bs = mosaic_gpu.MosaicGpuBlockSizes(
      **dict(_SMALL, block_kv=32, block_kv_dq=32, block_q_dkv=32))
  check_against_reference(
      flash("mosaic_gpu", bs), case, jnp.bfloat16,
      rng("mosaic_gpu", "fwd-bwd"))


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
def test_interpreted_forward_window_segments():
  case = Case(b=1, t=120, s=200, n=4, k=2, h=64, window=(48, 16),
              segments=True)
  gen = rng("mosaic_gpu", "window-segments")
  q, k, v, kw = make_inputs(case, jnp.float16, gen)
  fn = flash("mosaic_gpu", mosaic_gpu.MosaicGpuBlockSizes(**_SMALL))
  out, lse = fn(q, k, v, **kw)
  ref_out, ref_lse = flash("xla")(
      *(x.astype(jnp.float32) for x in (q, k, v)), **kw)
  same_out, _ = flash("xla")(q, k, v, **kw)
  err = float(jnp.abs(out.astype(jnp.float32) - ref_out).max())
  same = float(jnp.abs(same_out.astype(jnp.float32) - ref_out).max())
  assert err <= 2 * same + 1e-3, (err, same)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  finite = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_allclose(
      np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=1e-3)


def _check_interpreted(q, k, v, kw, gen, **block_sizes):
  """The interpreted kernels' out, lse, dq, dk, dv (small tiles, updated by
  `block_sizes`) against the float32 reference under the FlashAttention
  rule (bfloat16 inputs)."""
  dout = testing.normal(gen, q.shape[:-1] + v.shape[-1:])
  dlse = testing.normal(gen, q.shape[:-1])
  fn = flash("mosaic_gpu", mosaic_gpu.MosaicGpuBlockSizes(
      **{**_SMALL, **block_sizes}))
  got = run(fn, q, k, v, kw, dout, dlse)
  want = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  same = run(reference_fn(jnp.bfloat16), q, k, v, kw, dout, dlse)
  assert got[0].shape == q.shape[:-1] + v.shape[-1:]
  for name, x, r, rs in zip(
      ("out", "lse", "dq", "dk", "dv"), (*got[:2], *got[2]),
      (*want[:2], *want[2]), (*same[:2], *same[2])):
    assert x.shape == r.shape, (name, x.shape, r.shape)
    assert_close(name, x, r, rs, jnp.bfloat16)
  return got


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("h, hv", [(64, 128), (72, 32)], ids=["hv>h", "hv<h"])
def test_interpreted_value_head_dim(h, hv):
  """Hv != H: the output and dV have V's head dim (each padded to 64 on its
  own), dP contracts over Hv; causal with GQA and padding."""
  case = Case(b=1, t=70, s=100, n=2, k=1, h=h, causal=True, lengths=True)
  gen = rng("mosaic_gpu", "value-head-dim", h, hv)
  q, k, _, kw = make_inputs(case, jnp.bfloat16, gen)
  v = testing.normal(gen, k.shape[:-1] + (hv,), jnp.bfloat16)
  _check_interpreted(q, k, v, kw, gen)


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
def test_interpreted_dropout():
  """Dropout draws the mask of `pallas_fa.dropout` (the reference's) in all
  three kernels, the dK/dV kernel in its transposed orientation included:
  GQA (the query head, not the key/value head, is hashed), segments,
  padding; and the result differs from no dropout. V is wider than Q/K
  (Hv = 96 pads to 128, H = 32 to 64), so Hv != H runs too."""
  case = Case(b=2, t=70, s=90, n=4, k=2, h=32, causal=True, segments=True,
              lengths=True)
  gen = rng("mosaic_gpu", "dropout")
  q, k, _, kw = make_inputs(case, jnp.bfloat16, gen)
  v = testing.normal(gen, k.shape[:-1] + (96,), jnp.bfloat16)
  kw.update(dropout_rate=0.3, dropout_rng=int(gen.integers(1 << 30)))
  out = _check_interpreted(q, k, v, kw, gen)[0]
  plain = flash("xla")(q, k, v, **{
      n: x for n, x in kw.items() if not n.startswith("dropout")})[0]
  assert float(jnp.abs(out.astype(jnp.float32) - plain).max()) > 0.1


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
def test_interpreted_split_dkv_single_consumer_round_robin():
  case = Case(b=2, t=70, s=90, n=4, k=2, h=16, window=(30, None),
              segments=True, lengths=True)
  bs = mosaic_gpu.MosaicGpuBlockSizes(
      **_SMALL, num_consumers=1, pingpong=False, num_consumers_dq=1,
      num_consumers_dkv=1, split_dkv=True, num_ctas=2, num_stages=1)
  check_against_reference(
      flash("mosaic_gpu", bs), case, jnp.bfloat16,
      rng("mosaic_gpu", "split"))


def _fused_against_split(case, gen, dtype=jnp.bfloat16, fields=None,
                         **kw_extra):
  """The fused backward's gradients (with block-size `fields`) against the
  float32 reference under the FlashAttention rule, and against the split
  backward's (each within the rule's bound of the other: only dQ's
  summation order differs)."""
  q, k, v, kw = make_inputs(case, dtype, gen)
  kw.update(kw_extra)
  dout = testing.normal(gen, q.shape[:-1] + v.shape[-1:])
  dlse = testing.normal(gen, q.shape[:-1])
  fused = run(flash("mosaic_gpu", mosaic_gpu.MosaicGpuBlockSizes(
      **_SMALL, backward="fused", **(fields or {}))), q, k, v, kw, dout,
      dlse)
  split = run(flash("mosaic_gpu", mosaic_gpu.MosaicGpuBlockSizes(
      **_SMALL, backward="split")), q, k, v, kw, dout, dlse)
  want = run(reference_fn(jnp.float32), q, k, v, kw, dout, dlse)
  same = run(reference_fn(dtype), q, k, v, kw, dout, dlse)
  for name, x, y, r, rs in zip(("dq", "dk", "dv"), fused[2], split[2],
                               want[2], same[2]):
    assert_close(name, x, r, rs, dtype)
    assert_close(name + " (fused vs split)", x, y, rs, dtype)
  np.testing.assert_array_equal(np.asarray(fused[0]), np.asarray(split[0]))


def _fused_launches(monkeypatch):
  """Records the names of the kernels launched from now on."""
  names, real = [], kernel.launch

  def launch(spec, *, name, **kwargs):
    names.append(name)
    return real(spec, name=name, **kwargs)

  monkeypatch.setattr(kernel, "launch", launch)
  return names


def _spy(monkeypatch, module, name):
  """Records what `module.name` returns from now on."""
  seen, real = [], getattr(module, name)
  monkeypatch.setattr(module, name,
                      lambda *a: seen.append(real(*a)) or seen[-1])
  return seen


def _fused_order_against_split(monkeypatch, case, fields, applies, tag):
  """`_fused_against_split` with the step-order fields `fields` (names)
  set, checking that the one fused kernel took each (the predicates
  `dkv.<applies>`); dropout at H = 32."""
  names = _fused_launches(monkeypatch)
  seen = {name: _spy(monkeypatch, dkv, name) for name in applies}
  gen = rng("mosaic_gpu", tag, str(case))
  extra = {}
  if case.h == 32:
    extra = dict(dropout_rate=0.25, dropout_rng=int(gen.integers(1 << 30)))
  _fused_against_split(case, gen, fields=dict.fromkeys(fields, True),
                       **extra)
  assert names.count("pfa_mgpu_dk_dv_dq") == 1, names
  assert all(specs == [True] for specs in seen.values()), seen


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
def test_interpreted_fused_backward_shared_columns(monkeypatch):
  """H = 128 with two consumers: each consumer computes half of dQ's
  columns from both consumers' dS^T (exchanged through shared memory);
  causal with GQA, ragged lengths and a soft cap: masked, unmasked and
  skipped tiles, several query heads per unit."""
  names = _fused_launches(monkeypatch)
  case = Case(b=1, t=100, s=150, n=4, k=2, h=128, causal=True, lengths=True,
              soft_cap=3.0)
  _fused_against_split(case, rng("mosaic_gpu", "fused-shared"))
  assert "pfa_mgpu_dk_dv_dq" in names and "pfa_mgpu_dq" in names


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
def test_interpreted_fused_backward_own_keys_dropout(monkeypatch):
  """H = 32 (padded to 64, whose halves are not whole swizzle tiles): each
  consumer adds its own keys' dQ over every column; window, segments,
  padding and dropout (the mask hashed in the transposed tile feeds dQ
  too), two batch rows."""
  names = _fused_launches(monkeypatch)
  case = Case(b=2, t=70, s=90, n=4, k=2, h=32, window=(30, 10),
              segments=True, lengths=True)
  gen = rng("mosaic_gpu", "fused-own")
  _fused_against_split(case, gen, dropout_rate=0.25,
                       dropout_rng=int(gen.integers(1 << 30)))
  assert names.count("pfa_mgpu_dk_dv_dq") == 1


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("case", [
    # dQ by columns from both consumers' dS^T; GQA, masked and unmasked
    # steps, units of different lengths.
    Case(b=1, t=128, s=256, n=4, k=2, h=128, causal=True, soft_cap=3.0),
    # Each consumer its own keys' dQ (H = 32, padded to 64), dropout.
    Case(b=2, t=128, s=128, n=2, k=1, h=32, window=(40, 8)),
], ids=["shared-columns", "own-keys"])
def test_interpreted_fused_backward_pipeline(monkeypatch, case):
  """`fused_pipeline`: each step's dQ issued by the next step, the unit's
  last after its last step, on calls it applies to (no segment ids, no
  mask_mod: `dkv.pipelines_dq`; lengths whole units, 128 rows, since
  padding takes segment ids)."""
  _fused_order_against_split(monkeypatch, case, ("fused_pipeline",),
                             ("pipelines_dq",), "fused-pipeline")


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("case", [
    # dQ by columns, in the step; causal with GQA, ragged lengths and
    # segments: masked, unmasked and skipped tiles.
    Case(b=1, t=100, s=150, n=4, k=2, h=128, causal=True, lengths=True,
         segments=True),
    # A window, no masks beyond it.
    Case(b=1, t=128, s=256, n=4, k=2, h=128, window=(40, 8)),
    # Each consumer its own keys' dQ (H = 32, padded to 64), dropout.
    Case(b=2, t=70, s=90, n=2, k=1, h=32, causal=True),
], ids=["columns-causal", "columns-window", "own-keys-dropout"])
def test_interpreted_fused_backward_softmax_overlap(monkeypatch, case):
  """`fused_softmax_overlap`: P^T computed while dP^T's product runs and
  dS^T while dV's does, dS^T stored for dQ there (after P^T, as scratch,
  in the same slot); interpreted, the products run in turn, so this
  checks the step's data flow, the race test its ordering."""
  _fused_order_against_split(monkeypatch, case, ("fused_softmax_overlap",),
                             ("softmax_overlaps",), "fused-softmax-overlap")


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("case", [
    # dQ by columns from both consumers' dS^T; GQA, masked and unmasked
    # steps, units of different lengths (lengths whole units: padding
    # takes segment ids, which keep dQ in the step).
    Case(b=1, t=128, s=256, n=4, k=2, h=128, causal=True),
    # Each consumer its own keys' dQ in one dS^T slot (H = 32, padded to
    # 64), dropout.
    Case(b=2, t=128, s=128, n=2, k=1, h=32, window=(40, 8)),
], ids=["shared-columns", "own-keys"])
def test_interpreted_fused_backward_softmax_overlap_pipelined(monkeypatch,
                                                              case):
  """`fused_softmax_overlap` with `fused_pipeline` (a full call's default):
  the step before's dQ issued ahead of S^T, then P^T under dP^T's product
  and dS^T under dV's, stored to the step's slot; the unit's last dQ
  after its last step."""
  _fused_order_against_split(
      monkeypatch, case, ("fused_softmax_overlap", "fused_pipeline"),
      ("softmax_overlaps", "pipelines_dq"), "fused-softmax-pipelined")


def test_softmax_overlap_keeps_the_default_order_where_it_does_not_apply():
  """A soft cap or a score_mod keeps the default order (their capped
  logits and pullback would stay live across dP^T's product), and so
  does a kernel compiled by jax 0.10 (no stores under a wgmma)."""
  spec = kernel.Spec(batch=1, q_len=128, kv_len=128, num_heads=2,
                     num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16,
                     block_q=64, block_kv=64, stages=2, interpret=True,
                     fused_softmax_overlap=True)
  assert dkv.softmax_overlaps(spec)
  assert not dkv.softmax_overlaps(dataclasses.replace(spec, soft_cap=3.0))
  assert not dkv.softmax_overlaps(
      dataclasses.replace(spec, fused_softmax_overlap=False))
  compiled = dataclasses.replace(spec, interpret=False)
  assert dkv.softmax_overlaps(compiled) == gpu_ops.STORES_UNDER_WGMMA


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
def test_interpreted_fused_backward_flex(monkeypatch):
  """A mask_mod (document ids, in the segment-id slots) and a score_mod
  without differentiated values run in the fused kernel."""
  names = _fused_launches(monkeypatch)
  case = Case(b=1, t=128, s=128, n=2, k=2, h=64, causal=True)
  gen = rng("mosaic_gpu", "fused-flex")
  docs = jnp.asarray(np.sort(gen.integers(0, 3, (1, case.s))), jnp.int32)
  _fused_against_split(
      case, gen, mask_mod=pallas_fa.flex.document, mask_mod_args=(docs,),
      score_mod=lambda score, b, h, q, kv: 4.0 * jnp.tanh(score / 4.0))
  assert names.count("pfa_mgpu_dk_dv_dq") == 1


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("config, kernels", [
    # Three persistent CTAs: the causal units are dealt by the balanced
    # schedule (`kernel.Units`), partial last waves included.
    (dict(num_ctas=3, backward="split"),
     {"pfa_mgpu_forward", "pfa_mgpu_dq", "pfa_mgpu_dk_dv"}),
    (dict(num_consumers=1, pingpong=False, num_consumers_dq=1,
          num_consumers_dkv=1, split_dkv=True, num_stages=3,
          num_stages_bwd=3, dropout=True),
     {"pfa_mgpu_forward", "pfa_mgpu_dq", "pfa_mgpu_dk", "pfa_mgpu_dv"}),
    # The fused backward: dS^T exchanged between the consumers (H = 128),
    # the dQ staging tile reused every step, K overwritten by dK at the
    # end of each unit while the other consumer may still read it.
    (dict(num_ctas=2, backward="fused", h=128),
     {"pfa_mgpu_forward", "pfa_mgpu_dk_dv_dq"}),
    # Each consumer its own keys' dQ over every column (`dq_split`): one
    # dS^T tile per consumer rewritten every step, two staged chunks.
    (dict(num_ctas=2, backward="fused", h=128, dq_split="keys"),
     {"pfa_mgpu_forward", "pfa_mgpu_dk_dv_dq"}),
    # The Q slot released after dK's and dQ's products both complete
    # (`fused_overlap`; interpreted, the products run in turn).
    (dict(num_ctas=2, backward="fused", h=128, fused_overlap=True),
     {"pfa_mgpu_forward", "pfa_mgpu_dk_dv_dq"}),
    # `fused_pipeline`: a consumer reads the other's dS^T a step after it
    # was stored (the exchange awaited then), and the unit's last dQ
    # after its last step; by keys, the deferred dQ's second chunk.
    # (Lengths whole tiles and no segment ids: `dkv.pipelines_dq`.)
    (dict(num_ctas=2, backward="fused", h=128, fused_pipeline=True,
          segments=False),
     {"pfa_mgpu_forward", "pfa_mgpu_dk_dv_dq"}),
    (dict(num_ctas=2, backward="fused", h=128, dq_split="keys",
          fused_pipeline=True, segments=False),
     {"pfa_mgpu_forward", "pfa_mgpu_dk_dv_dq"}),
    # `fused_softmax_overlap`: P^T, then dS^T stored to the step's dS^T
    # slot, which the other consumer read two steps back (by columns);
    # by keys, each consumer's own slot.
    (dict(num_ctas=2, backward="fused", h=128, fused_softmax_overlap=True),
     {"pfa_mgpu_forward", "pfa_mgpu_dk_dv_dq"}),
    (dict(num_ctas=2, backward="fused", h=128, dq_split="keys",
          fused_softmax_overlap=True),
     {"pfa_mgpu_forward", "pfa_mgpu_dk_dv_dq"}),
    # Both: P^T stored to the step's slot while the other consumer's
    # deferred dQ of the step before reads the other slot.
    (dict(num_ctas=2, backward="fused", h=128, fused_softmax_overlap=True,
          fused_pipeline=True, segments=False),
     {"pfa_mgpu_forward", "pfa_mgpu_dk_dv_dq"}),
], ids=["two-consumers", "one-consumer-split-dropout", "fused",
        "fused-dq-by-keys", "fused-overlap", "fused-pipeline",
        "fused-pipeline-by-keys", "fused-softmax", "fused-softmax-by-keys",
        "fused-softmax-pipeline"])
def test_interpreted_kernels_are_race_free(monkeypatch, config, kernels):
  """Every kernel under the interpreter's happens-before race detector: the
  producer refills ring slots (more steps than stages, several units and
  CTAs, GQA repeats) that the consumers read both as matmul operands and as
  plain vectors (positions, segment ids, lse, delta). A refill not ordered
  after every consumer's reads of the slot, a read not ordered after its
  TMA load, or (jax >= 0.11, which models the two memory proxies) a TMA
  write not fenced after plain shared-memory reads is a race. The detector
  keeps one kernel's verdict, so the kernels run eagerly and each verdict
  is read after its launch; the results are checked against the reference
  too."""
  config = dict(config)
  dropout = config.pop("dropout", False)
  h = config.pop("h", 32)
  segments = config.pop("segments", True)
  verdicts, reset = race_verdicts(
      monkeypatch, lambda spec, name, races: (
          name, races, spec.dq_split, dkv.pipelines_dq(spec)))
  case = Case(b=1, t=160 if segments else 256, s=256, n=4, k=2, h=h,
              causal=True, segments=segments, lengths=segments)
  gen = rng("mosaic_gpu", "races", *sorted(config))
  q, k, v, kw = make_inputs(case, jnp.bfloat16, gen)
  if dropout:
    kw.update(dropout_rate=0.2, dropout_rng=int(gen.integers(1 << 30)))
  try:
    with jax.disable_jit():
      _check_interpreted(q, k, v, kw, gen, **config)
  finally:
    reset()
  assert {name for name, *_ in verdicts} == kernels, verdicts
  split = config.get("dq_split", "columns")
  assert all(s == split for _, _, s, _ in verdicts), verdicts
  pipelined = config.get("fused_pipeline", False)
  assert all(p == pipelined for name, _, _, p in verdicts
             if name == "pfa_mgpu_dk_dv_dq"), verdicts
  raced = [name for name, found, *_ in verdicts if found]
  assert not raced, f"races reported (printed above) in {raced}"


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
def test_interpreted_deterministic():
  case = Case(b=1, t=64, s=100, n=2, k=2, h=64, causal=True, segments=True)
  gen = rng("mosaic_gpu", "determinism")
  q, k, v, kw = make_inputs(case, jnp.bfloat16, gen)
  dout = jnp.asarray(gen.standard_normal(q.shape, np.float32))
  dlse = jnp.zeros(q.shape[:-1])
  fn = flash("mosaic_gpu", mosaic_gpu.MosaicGpuBlockSizes(**_SMALL))
  a = run(fn, q, k, v, kw, dout, dlse)
  b = run(fn, q, k, v, kw, dout, dlse)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
def test_interpreted_padding_never_leaks():
  case = Case(b=2, t=40, s=56, n=4, k=2, h=16, causal=True)
  gen = rng("mosaic_gpu", "leak")
  q, k, v, kw = make_inputs(case, jnp.bfloat16, gen)
  q_len = jnp.array([33, 40], jnp.int32)
  kv_len = jnp.array([20, 49], jnp.int32)
  kw.update(query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
  q_pad = (jnp.arange(case.t)[None, :] >= q_len[:, None])[..., None, None]
  kv_pad = (jnp.arange(case.s)[None, :] >= kv_len[:, None])[..., None, None]
  dout = jnp.asarray(gen.standard_normal(q.shape, np.float32))
  dout = jnp.where(q_pad, jnp.nan, dout)
  dlse = jnp.zeros(q.shape[:-1])
  fn = flash("mosaic_gpu", mosaic_gpu.MosaicGpuBlockSizes(**_SMALL))
  clean = run(fn, q, k, v, kw, jnp.where(q_pad, 0.0, dout), dlse)
  dirty = run(fn, jnp.where(q_pad, jnp.nan, q), jnp.where(kv_pad, jnp.inf, k),
              jnp.where(kv_pad, jnp.nan, v), kw, dout, dlse)
  for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty),
                  strict=True):
    assert not np.any(np.isnan(np.asarray(b, np.float32)))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("case, meta", [
    (Case(b=1, t=200, s=300, n=2, k=1, h=64), 0),
    (Case(b=1, t=260, s=250, n=2, k=1, h=64, causal=True), 0),
    (Case(b=1, t=130, s=250, n=2, k=1, h=64, causal=True, segments=True,
          lengths=True), 1),
    (Case(b=1, t=130, s=250, n=2, k=1, h=64, causal=True, segments=True,
          lengths=True, positions=True), 2),
], ids=["padding", "causal", "causal-segments", "causal-positions"])
def test_interpreted_forward_wide_key_tiles(monkeypatch, case, meta):
  """192-key forward tiles (`block_kv=192`) over lengths that are not
  multiples of them, and ragged query units: without segment ids of the
  call's own the padded keys are masked by index
  (`kernel.Spec.masks_padding_by_index`), by the causal bound itself in a
  causal call (`masks_padding_causally`, here with queries past the last
  key); default positions are made from indices
  (`kernel.Spec.positions_by_index`). Only the call's own segment ids and
  positions travel with the tiles."""
  specs, real = [], kernel.launch

  def launch(spec, *, name, **kwargs):
    if name == "pfa_mgpu_forward":
      specs.append(spec)
    return real(spec, name=name, **kwargs)

  monkeypatch.setattr(kernel, "launch", launch)
  fn = flash("mosaic_gpu", mosaic_gpu.MosaicGpuBlockSizes(
      **{**_SMALL, "block_kv": 192}))
  _check_forward(fn, case, rng("mosaic_gpu", "wide-keys", str(case)))
  [spec] = specs
  assert (spec.block_kv, spec.num_meta) == (192, meta)
  assert spec.masks_padding_by_index == (not case.segments)
  assert spec.positions_by_index == (not case.positions)
  # Causal without segment ids: the causal bound masks the padded keys.
  assert spec.masks_padding_causally == (case.causal and not case.segments)


def _check_forward(fn, case, gen, **extra):
  """fn's (out, lse) on fresh bfloat16 inputs of `case` (kwargs updated by
  `extra`) against the float32 reference under the FlashAttention rule;
  rows without a visible key: lse -inf on both."""
  q, k, v, kw = make_inputs(case, jnp.bfloat16, gen)
  kw.update(extra)
  _assert_forward(fn(q, k, v, **kw), q, k, v, kw)


def _assert_forward(got, q, k, v, kw):
  """`_check_forward`'s assertions on got = (out, lse)."""
  out, lse = got
  ref_out, ref_lse = flash("xla")(
      *(x.astype(jnp.float32) for x in (q, k, v)), **kw)
  same_out, same_lse = flash("xla")(q, k, v, **kw)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert_close("out", out, ref_out, same_out, jnp.bfloat16)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  finite = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_allclose(
      np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=2e-3)


# The software-pipelined forward (`intra_overlap`): several key tiles per
# unit so that its prologue, steady state and epilogue all run; causal
# masks put the first tile, the masked prefix and suffix and the unmasked
# middle in different phases; padding and segments leave units with no
# key tile (the zero-trip prologue and epilogue).
# The padding lengths are fixed (random ones may leave a single key tile).
_OVERLAP_CASES = {
    "plain-ragged-gqa": (
        Case(b=2, t=100, s=300, n=4, k=2, h=64), {},
        dict(query_seq_lengths=[100, 61], key_value_seq_lengths=[300, 187])),
    "causal-softcap": (
        Case(b=1, t=200, s=330, n=2, k=1, h=32, causal=True, soft_cap=5.0),
        dict(block_kv=32),
        dict(query_seq_lengths=[170], key_value_seq_lengths=[301])),
    "window-segments-one-consumer": (
        Case(b=1, t=150, s=260, n=2, k=2, h=64, window=(60, 20),
             segments=True),
        dict(num_consumers=1, pingpong=False, num_stages=1, num_ctas=2), {}),
    "dropout-two-ctas": (
        Case(b=1, t=130, s=200, n=2, k=1, h=32, causal=True), dict(num_ctas=2),
        dict(dropout_rate=0.25)),
}


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("name", sorted(_OVERLAP_CASES))
def test_interpreted_forward_intra_overlap(name):
  case, fields, extra = _OVERLAP_CASES[name]
  gen = rng("mosaic_gpu", "intra-overlap", name)
  bs = mosaic_gpu.MosaicGpuBlockSizes(
      **{**_SMALL, **fields, "intra_overlap": True})
  extra = {n: jnp.asarray(x, jnp.int32) if isinstance(x, list) else x
           for n, x in extra.items()}
  if "dropout_rate" in extra:
    extra["dropout_rng"] = int(gen.integers(1 << 30))
  _check_forward(flash("mosaic_gpu", bs), case, gen, **extra)


def test_poly_exp2_matches_exp2():
  """The cubic's 2^x (`exp2.poly_exp2`, the compiled kernels' arithmetic)
  against float64 over the softmax's range and past it: relative error
  below 9e-5 wherever 2^x is a normal float32, 0 below 2^-127 and for
  -inf (masked logits), never negative or NaN."""
  gen = rng("mosaic_gpu", "poly-exp2")
  x = np.concatenate([
      gen.uniform(-140.0, 9.0, 100_000), np.linspace(-3.0, 0.0, 30_001),
      [-np.inf, -1e30, -127.0, -126.0, 0.0, 8.0]]).astype(np.float32)
  got = np.asarray(exp2.poly_exp2(jnp.asarray(x)), np.float64)
  want = np.exp2(x.astype(np.float64))
  normal = x >= -126.0
  assert np.max(np.abs(got[normal] / want[normal] - 1.0)) < 9e-5
  assert np.all(got[x <= -127.0] == 0.0)
  assert np.all(got >= 0.0) and not np.any(np.isnan(got))
  assert got[-2] == 1.0 and got[-1] == 256.0
  # One 8-key group in `every` on the FMA pipe: the last of each run.
  cols = np.flatnonzero(np.asarray(exp2.on_fma((1, 64), 4))[0])
  np.testing.assert_array_equal(cols, np.r_[24:32, 56:64])


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("every, overlap", [(4, False), (1, True)])
def test_interpreted_forward_poly_exp2(monkeypatch, every, overlap):
  """Part (every = 4) or all (1) of each logit tile's exponentials by the
  cubic (`poly_exp2`), in the plain and the pipelined key loop: causal
  with GQA and ragged lengths, against the reference under the
  FlashAttention rule; every key tile went through the split."""
  calls, real = [], exp2.split_exp2

  def split(x, every, *, interpret):
    calls.append(every)
    return real(x, every, interpret=interpret)

  monkeypatch.setattr(exp2, "split_exp2", split)
  case = Case(b=1, t=150, s=260, n=4, k=2, h=64, causal=True, lengths=True)
  gen = rng("mosaic_gpu", "poly-exp2", every, overlap)
  bs = mosaic_gpu.MosaicGpuBlockSizes(
      **_SMALL, poly_exp2=every, intra_overlap=overlap)
  _check_forward(flash("mosaic_gpu", bs), case, gen)
  assert calls and set(calls) == {every}


@gpu_jax_only  # the Mosaic GPU interpreter
@needs_interpreter
@pytest.mark.parametrize("stages", [1, 2])
def test_interpreted_intra_overlap_race_free(monkeypatch, stages):
  """The pipelined forward under the race detector: a V slot is released
  a step later than the K slot of the same tile, and each step reads the
  previous step's V slot while the producer refills the ring (one slot:
  every step refills the slot just read; two: K and V of one step in
  different slots), 2 to 5 key tiles per unit, two consumers, two CTAs.
  The default loop runs beside it, under the detector too."""
  verdicts, reset = race_verdicts(
      monkeypatch,
      lambda spec, name, races: (name, spec.intra_overlap, races))
  case = Case(b=1, t=256, s=320, n=2, k=1, h=32, causal=True)
  gen = rng("mosaic_gpu", "intra-overlap-races", stages)
  q, k, v, kw = make_inputs(case, jnp.bfloat16, gen)
  kw.update(query_seq_lengths=jnp.asarray([250], jnp.int32),
            key_value_seq_lengths=jnp.asarray([290], jnp.int32))
  results = []
  try:
    with jax.disable_jit():
      for overlap in (True, False):
        bs = mosaic_gpu.MosaicGpuBlockSizes(
            **_SMALL, num_stages=stages, num_ctas=2, intra_overlap=overlap)
        results.append(flash("mosaic_gpu", bs)(q, k, v, **kw))
  finally:
    reset()
  assert [(n, o) for n, o, _ in verdicts] == [
      ("pfa_mgpu_forward", True), ("pfa_mgpu_forward", False)], verdicts
  assert not any(found for _, _, found in verdicts), verdicts
  for got in results:
    _assert_forward(got, q, k, v, kw)


# --------------------------------------------------------------------------
# Compiled, on a Hopper GPU.
# --------------------------------------------------------------------------

_GPU_CASES = [
    (Case(b=2, t=512, s=512, n=4, k=4, h=64), jnp.bfloat16),
    (Case(b=2, t=512, s=512, n=4, k=2, h=128, causal=True), jnp.bfloat16),
    (Case(b=1, t=384, s=640, n=4, k=1, h=256, causal=True), jnp.float16),
    (Case(b=1, t=300, s=700, n=8, k=2, h=256), jnp.bfloat16),
    (Case(b=2, t=333, s=517, n=4, k=2, h=96, window=(100, 20),
          segments=True, lengths=True, soft_cap=20.0), jnp.bfloat16),
    (Case(b=2, t=129, s=1000, n=2, k=1, h=128, causal=True, positions=True),
     jnp.float16),
    (Case(b=1, t=1, s=77, n=2, k=1, h=40), jnp.bfloat16),
    (Case(b=1, t=90, s=1, n=2, k=2, h=8, lengths=True), jnp.bfloat16),
]


def _small_tiles_that_fit(case, dtype):
  """64-row tiles and a persistent grid of 5 CTAs, with 3 ring stages, two
  consumers a kernel and a fused dK/dV pass where they fit the shared
  memory; at H = 256 they take 2 stages, one dQ and one dK/dV consumer,
  and split dK/dV passes, as the defaults there do."""
  bs = mosaic_gpu.MosaicGpuBlockSizes(**_SMALL, num_stages=3, num_ctas=5)
  for smaller in (dict(num_stages=2), dict(num_consumers_dq=1),
                  dict(num_consumers_dkv=1, split_dkv=True)):
    smem = mosaic_gpu.shared_memory_bytes(bs, case.h,
                                          jnp.dtype(dtype).itemsize)
    if max(smem.values()) <= mosaic_gpu.SHARED_MEMORY_BYTES:
      break
    bs = dataclasses.replace(bs, **smaller)
  return bs


@needs_hopper
@pytest.mark.parametrize("case, dtype", _GPU_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("tiles", ["default", "small", "split"])
def test_compiled_matches_reference(case, dtype, tiles):
  """"default" (and "small") run the fused backward where it applies;
  "split": the default tiles with the split backward, the reproducible
  one."""
  bs = None if tiles == "default" else _small_tiles_that_fit(case, dtype)
  if tiles == "split":
    bs = dataclasses.replace(
        mosaic_gpu.default_block_sizes(
            q_len=case.t, kv_len=case.s, head_dim=case.h, dtype=dtype,
            is_causal=case.causal),
        backward="split")
  check_against_reference(
      flash("mosaic_gpu", bs), case, dtype,
      rng("mosaic_gpu", "compiled", str(case), tiles))


@needs_hopper
@pytest.mark.parametrize("dq_swizzle, step_order", [
    (32, None), (64, None), (128, "fused_overlap"), (32, "fused_overlap"),
    (128, "fused_softmax_overlap")])
@pytest.mark.parametrize("case", [
    # The two consumers split dQ by columns: one 64-column chunk each.
    Case(b=2, t=512, s=640, n=4, k=2, h=128, causal=True, segments=True),
    # By keys: each consumer's partial over every column, one chunk.
    Case(b=2, t=384, s=512, n=4, k=4, h=64),
], ids=lambda x: str(x))
def test_compiled_fused_backward_variants(case, dq_swizzle, step_order):
  """The fused backward's dQ staged at a narrower swizzle
  (`MosaicGpuBlockSizes.dq_swizzle`: the register layout's store and the
  TMA reduce-add's read must agree on it), its dS^T staged while dK's
  product runs (`fused_overlap`: the product's register operand and the
  stores share registers), which the interpreter (no swizzles, products
  in order) cannot check. `fused_overlap` replaces a full call's
  default `fused_pipeline` (they are alternatives); the softmax order
  runs on top of it."""
  order = {}
  if step_order == "fused_overlap":
    order = dict(fused_overlap=True, fused_pipeline=False)
  elif step_order is not None:
    order = {step_order: True}
  bs = dataclasses.replace(
      mosaic_gpu.default_block_sizes(
          q_len=case.t, kv_len=case.s, head_dim=case.h, dtype=jnp.bfloat16,
          is_causal=case.causal),
      backward="fused", dq_swizzle=dq_swizzle, **order)
  check_against_reference(
      flash("mosaic_gpu", bs), case, jnp.bfloat16,
      rng("mosaic_gpu", "fused-variants", str(case), str(dq_swizzle),
          str(step_order)))


@needs_hopper
def test_compiled_fused_backward_softmax_order_with_the_pipeline():
  """A full call at H = 128 with `fused_softmax_overlap` on its default,
  pipelined tiles: both consumers' dS^T exchanged by columns, the step
  before's dQ issued ahead of S^T, P^T and dS^T stored to the step's slot
  under dP^T's and dV's products (the would-be default)."""
  case = Case(b=1, t=512, s=768, n=4, k=2, h=128)
  bs = dataclasses.replace(
      mosaic_gpu.default_block_sizes(
          q_len=case.t, kv_len=case.s, head_dim=case.h, dtype=jnp.bfloat16,
          is_causal=False),
      fused_softmax_overlap=True)
  assert bs.backward == "fused" and bs.fused_pipeline
  check_against_reference(
      flash("mosaic_gpu", bs), case, jnp.bfloat16,
      rng("mosaic_gpu", "fused-softmax-pipeline"))


@needs_hopper
@pytest.mark.parametrize("case, dq_swizzle", [
    # dQ by columns; causal, GQA (no segment ids, no padding: the calls
    # `dkv.pipelines_dq` takes).
    (Case(b=1, t=512, s=768, n=4, k=2, h=128, causal=True), 32),
    (Case(b=1, t=512, s=768, n=4, k=2, h=128, causal=True), 128),
    # By keys.
    (Case(b=2, t=384, s=512, n=4, k=4, h=64), 128),
], ids=lambda x: str(x))
def test_compiled_fused_backward_pipeline(monkeypatch, case, dq_swizzle):
  """`fused_pipeline`: each step's dQ chain issued ahead of the next
  step's S^T and staged and reduce-added while S^T runs, which the
  interpreter (products in order) cannot check."""
  specs = _spy(monkeypatch, dkv, "pipelines_dq")
  bs = dataclasses.replace(
      mosaic_gpu.default_block_sizes(
          q_len=case.t, kv_len=case.s, head_dim=case.h, dtype=jnp.bfloat16,
          is_causal=case.causal),
      backward="fused", dq_swizzle=dq_swizzle, fused_pipeline=True)
  check_against_reference(
      flash("mosaic_gpu", bs), case, jnp.bfloat16,
      rng("mosaic_gpu", "fused-pipeline", str(case), str(dq_swizzle)))
  assert specs and all(specs), specs


@needs_hopper
def test_compiled_deterministic_and_chosen_automatically():
  """The default tiles with a reproducible backward requested (the split
  one; tests/test_determinism.py checks the request on every backend)."""
  case = Case(b=2, t=700, s=700, n=8, k=2, h=128, causal=True, segments=True)
  gen = rng("mosaic_gpu", "compiled-determinism")
  q, k, v, kw = make_inputs(case, jnp.bfloat16, gen)
  kw["deterministic_backward"] = True
  dout = jnp.asarray(gen.standard_normal(q.shape, np.float32))
  dlse = jnp.zeros(q.shape[:-1])
  fn = flash("mosaic_gpu")
  a = run(fn, q, k, v, kw, dout, dlse)
  b = run(fn, q, k, v, kw, dout, dlse)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  q, k, v, bias, info, _ = _canonical()
  auto = pallas_fa.api.choose_backend(None, pallas_fa.api.Call(
      q=q, k=k, v=v, bias=bias, info=info, params=vjp.Params(scale=1.0),
      batch_shape=q.shape[:1]))
  assert auto.name == "mosaic_gpu"
