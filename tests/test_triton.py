"""Tests of the `triton` backend beyond the shared conformance suite.

TritonBlockSizes validation, the tuning heuristics and persisted-result lookup,
the block-skipping loop bounds (visited tiles against the ideal count, and
proof by poisoning that skipped tiles are never read), and features the
conformance suite does not reach (broadcast bias gradients, default tiles).
The kernels run in Pallas interpret mode on CPU.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import assert_close
from attention_testing import gpu_jax_only_on_cpu
from attention_testing import reference_fn
from attention_testing import rng
from attention_testing import run

import pallas_fa
from pallas_fa import chunked
from pallas_fa import gpu_target
from pallas_fa import masking
from pallas_fa import triton
from pallas_fa import tuning
from pallas_fa.triton import exp2 as exp2_lib

SMALL = triton.TritonBlockSizes(
    block_q=16, block_kv=16, block_q_dkv=16, block_kv_dkv=16, block_q_dq=16,
    block_kv_dq=16, num_warps=4, num_stages=1)


def _flash(**kw):
  def fn(q, k, v, **call_kw):
    return pallas_fa.flash_attention(
        q, k, v, implementation="triton", return_residual=True,
        **{"block_sizes": SMALL, **kw, **call_kw})
  return fn


def _normal(gen, *shape):
  return jnp.asarray(gen.standard_normal(shape, np.float32))


# --- TritonBlockSizes ---------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("block_q", 24), ("block_kv", 8), ("block_q_dkv", 1024),
    ("block_kv_dq", 0), ("block_kv_dkv", 32.0), ("block_q_dq", True),
    ("num_warps", 3), ("num_stages", 0), ("num_warps_bwd", 32),
    ("num_stages_bwd", 9), ("widen_float8", 1),
])
def test_block_sizes_validation(field, value):
  with pytest.raises(ValueError, match=field):
    triton.TritonBlockSizes(**{field: value})


def test_block_sizes_frozen_hashable_kw_only():
  a = triton.TritonBlockSizes(block_q=64)
  assert a == triton.TritonBlockSizes(block_q=64) and hash(a) == hash(
      triton.TritonBlockSizes(block_q=64))
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.block_q = 32
  assert not hasattr(a, "__dict__")  # slotted
  with pytest.raises(TypeError):
    triton.TritonBlockSizes(64)
  assert a.backward_warps == a.num_warps
  assert triton.TritonBlockSizes(num_stages_bwd=1).backward_stages == 1


def test_wrong_block_sizes_type_is_rejected():
  gen = rng("wrong-type")
  q = _normal(gen, 1, 8, 1, 16)
  with pytest.raises(TypeError, match="block_sizes"):
    pallas_fa.flash_attention(
        q, q, q, implementation="triton",
        block_sizes=chunked.ChunkedBlockSizes())


# --- Heuristics and tuned results --------------------------------------------

_KINDS = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
          "NVIDIA GeForce RTX 4090", "cpu"]


def _assert_fits(bs, kind, dtype, head_dim, value_head_dim=None):
  budget = triton.shared_memory_budget(kind)
  smem = triton.shared_memory_bytes(bs, head_dim, jnp.dtype(dtype).itemsize,
                                    value_head_dim=value_head_dim)
  fwd, bwd = smem["forward"], max(smem["dq"], smem["dkv"])
  # Fits the device, or is already at the smallest tiles and one stage.
  assert fwd <= budget or (bs.num_stages == 1 and bs.block_q == 32)
  assert bwd <= budget or (
      bs.backward_stages == 1 and bs.block_kv_dkv == bs.block_q_dq == 32)


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_heuristic_is_valid_and_fits(kind, head_dim, dtype):
  bs = triton.default_block_sizes(
      head_dim=head_dim, dtype=dtype, q_len=4096, kv_len=4096,
      device_kind=kind)
  assert isinstance(bs, triton.TritonBlockSizes)
  if kind == "cpu":
    return
  _assert_fits(bs, kind, dtype, head_dim)
  # Bigger head dims never get bigger forward tiles.
  if head_dim == 256:
    small = triton.default_block_sizes(
        head_dim=64, dtype=dtype, q_len=4096, kv_len=4096, device_kind=kind)
    assert bs.block_q * bs.block_kv <= small.block_q * small.block_kv


@pytest.mark.parametrize("kind", _KINDS[:3])
@pytest.mark.parametrize("head_dim, value_head_dim", [
    (192, 128), (256, 64), (64, 256), (72, 36)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_heuristic_with_value_head_dim_fits(kind, head_dim, value_head_dim,
                                            dtype):
  kw = dict(dtype=dtype, q_len=4096, kv_len=4096, device_kind=kind)
  bs = triton.default_block_sizes(
      head_dim=head_dim, value_head_dim=value_head_dim, **kw)
  _assert_fits(bs, kind, dtype, head_dim, value_head_dim)
  if "H100" in kind:
    # Registers are budgeted for the wider head dim: the tiles it gets
    # alone (where shared memory does not shrink them).
    wide = triton.default_block_sizes(
        head_dim=max(head_dim, value_head_dim), **kw)
    fields = ("block_q", "block_kv", "block_q_dkv", "block_q_dq", "num_warps")
    assert [getattr(bs, f) for f in fields] == [
        getattr(wide, f) for f in fields]
  # value_head_dim = H is the default.
  assert triton.default_block_sizes(
      head_dim=head_dim, value_head_dim=head_dim, **kw) == (
          triton.default_block_sizes(head_dim=head_dim, **kw))


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("dense", [1, 4, 5])  # mask, f32 bias, both
def test_dense_mask_and_bias_tiles_fit_shared_memory(kind, head_dim, dtype,
                                                     dense):
  """A dense mask or bias tile is pipelined beside K and V: the default
  tiles of such a call fit the device with it (H100, H = 64, a float32
  bias: three 128 x 128 stages asked 246784 B of 232448), with eight
  warps; interpreted (cpu) they are left alone."""
  itemsize = jnp.dtype(dtype).itemsize
  bs = triton.default_block_sizes(head_dim=head_dim, dtype=dtype,
                                  q_len=4096, kv_len=4096, device_kind=kind)
  got = triton.tiles.for_dense_tiles(
      bs, head_dim=head_dim, value_head_dim=head_dim, itemsize=itemsize,
      dense_itemsize=dense, kind=kind)
  if kind == "cpu":
    assert got == bs
    return
  smem = triton.shared_memory_bytes(got, head_dim, itemsize,
                                    dense_itemsize=dense)
  budget = triton.shared_memory_budget(kind)
  assert max(smem.values()) <= budget, (got, smem)
  assert got.num_warps == 8 and got.block_q == bs.block_q
  # Only what does not fit shrinks: without a dense input nothing changes.
  assert triton.tiles.for_dense_tiles(
      bs, head_dim=head_dim, value_head_dim=head_dim, itemsize=itemsize,
      dense_itemsize=0, kind=kind) == bs
  # A tiling whose backward follows the forward's stages (a tuned record's
  # num_stages_bwd=None) keeps them when only the forward shrinks.
  inherited = dataclasses.replace(bs, num_stages_bwd=None)
  shrunk = triton.tiles.for_dense_tiles(
      inherited, head_dim=head_dim, value_head_dim=head_dim,
      itemsize=itemsize, dense_itemsize=dense, kind=kind)
  assert shrunk.backward_stages <= bs.num_stages
  assert max(triton.shared_memory_bytes(
      shrunk, head_dim, itemsize, dense_itemsize=dense).values()) <= budget
  if (kind.startswith("NVIDIA H100") and head_dim == 64 and dense == 4
      and dtype == jnp.bfloat16):
    assert shrunk.backward_stages == bs.num_stages > shrunk.num_stages
    assert triton.shared_memory_bytes(
        bs, head_dim, itemsize, dense_itemsize=dense)["forward"] > budget


def test_a_bias_call_gets_its_dense_tiles(monkeypatch):
  """The tiles a call without block_sizes runs are adapted to its bias and
  mask (`tiles.for_dense_tiles`, given their bytes a logit), on the GPU
  the kernels are built for."""
  seen = []
  adapt = triton.tiles.for_dense_tiles

  def spy(bs, **kw):
    seen.append(kw)
    return adapt(bs, **kw)

  monkeypatch.setattr(triton.tiles, "for_dense_tiles", spy)
  gen = rng("triton", "dense tiles")
  q = _normal(gen, 1, 64, 2, 64).astype(jnp.bfloat16)
  bias = jnp.asarray(gen.standard_normal((1, 2, 64, 64)), jnp.float32)
  mask = jnp.asarray(gen.random((1, 1, 64, 64)) < 0.8)
  with gpu_target.compile_for(gpu_target.H100):
    jax.jit(lambda q, b, m: pallas_fa.flash_attention(
        q, q, q, b, m, implementation="triton")).trace(
            q, bias, mask).lower(lowering_platforms=("cuda",))
  assert seen and seen[0]["dense_itemsize"] == 5, seen
  assert "H100" in seen[0]["kind"] and seen[0]["head_dim"] == 64


def test_dropout_gets_eight_warps():
  kw = dict(head_dim=64, dtype=jnp.bfloat16, q_len=4096, kv_len=4096,
            device_kind="NVIDIA H100 80GB HBM3")
  assert triton.default_block_sizes(**kw).num_warps == 4
  assert triton.default_block_sizes(**kw, dropout=True).num_warps == 8


def test_device_file_name():
  assert (tuning.device_file_name("NVIDIA H100 80GB HBM3")
          == "nvidia_h100_80gb_hbm3")
  assert tuning.load_tuned("no such device kind") == {}


def test_tuned_records_win_over_heuristic(monkeypatch):
  tuned = dict(block_q=64, block_kv=32, block_q_dkv=16, block_kv_dkv=64,
               block_q_dq=64, block_kv_dq=16, num_warps=8, num_stages=4)
  key = tuning.tuning_key(head_dim=128, dtype=jnp.bfloat16, q_len=4096,
                          kv_len=4096, is_causal=True)
  other = dict(tuned, block_q=128)
  records = {"triton": [
      {"key": key, "block_sizes": tuned},
      {"key": dict(key, q_len=512, kv_len=512), "block_sizes": other},
      {"key": dict(key, dtype="float16"), "block_sizes": other},
  ]}
  # Round-trips through JSON exactly as scripts/tune.py writes it.
  records = json.loads(json.dumps(records))
  monkeypatch.setattr(tuning, "load_tuned", lambda kind: records)
  h100 = "NVIDIA H100 80GB HBM3"
  got = triton.default_block_sizes(
      head_dim=128, dtype=jnp.bfloat16, q_len=3000, kv_len=5000,
      is_causal=True, device_kind=h100)
  assert got == triton.TritonBlockSizes(**tuned)
  # No record for this head dim: the heuristic.
  kw = dict(head_dim=64, dtype=jnp.bfloat16, q_len=4096, kv_len=4096,
            device_kind=h100)
  assert triton.default_block_sizes(**kw) == (
      triton.heuristic_block_sizes(**kw))
  # Hv != H: the record of the wider head dim, else the heuristic.
  assert triton.default_block_sizes(**kw, value_head_dim=128) == (
      triton.TritonBlockSizes(**tuned))
  wider = dict(kw, head_dim=128, value_head_dim=256)
  assert triton.default_block_sizes(**wider) == (
      triton.heuristic_block_sizes(**wider))
  # A record this config no longer accepts (an old field name): ignored.
  records["triton"][0]["block_sizes"] = dict(tuned, block_k=32)
  kw = dict(kw, head_dim=128, is_causal=True)
  assert triton.default_block_sizes(**kw) == (
      triton.heuristic_block_sizes(**kw))


# --- Block skipping -----------------------------------------------------------


def _ideal_tiles(info, bq, bk):
  """(non-empty, full) tile counts from the element predicate itself."""
  vis = masking.tile_visibility(info, 1)[:, 0, 0]  # [B, T, S]
  b, t, s = vis.shape
  tiles = np.asarray(vis).reshape(b, t // bq, bq, s // bk, bk)
  return int(tiles.any(axis=(2, 4)).sum()), int(tiles.all(axis=(2, 4)).sum())


@pytest.mark.parametrize("causal, window", [
    (True, None), (False, (40, 0)), (False, (17, 33)), (True, (70, None)),
])
def test_loop_bounds_visit_only_needed_tiles(causal, window):
  t = s = 256
  bq, bk = 32, 16
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  info = masking.MaskInfo(q_positions=pos, kv_positions=pos,
                          is_causal=causal, window=window)
  bounds = np.asarray(triton.tile_bounds(
      masking.classify_blocks(info, bq, bk)))  # [B, nq, 4]
  lo, full_lo, full_hi, hi = np.moveaxis(bounds, -1, 0)
  ideal_visited, ideal_full = _ideal_tiles(info, bq, bk)
  assert int((hi - lo).sum()) == ideal_visited
  assert int((full_hi - full_lo).sum()) == ideal_full
  assert np.all((lo <= full_lo) & (full_lo <= full_hi) & (full_hi <= hi))
  # Exactly the partial tiles run the masking arithmetic.
  masked = int(((full_lo - lo) + (hi - full_hi)).sum())
  assert masked == ideal_visited - ideal_full
  if causal and window is None:
    nq, nk = t // bq, s // bk
    # Causal visits about half the tiles; only the diagonal ones are masked.
    assert ideal_visited < nq * nk * 0.6
    assert masked == nq * (bq // bk)


def test_non_contiguous_full_tiles_are_all_masked():
  kinds = jnp.array([[[0, 2, 1, 2, 0], [1, 2, 2, 1, 0], [0, 0, 0, 0, 0]]])
  bounds = np.asarray(triton.tile_bounds(kinds))[0]
  np.testing.assert_array_equal(bounds[0], [1, 4, 4, 4])  # FULL not a run
  np.testing.assert_array_equal(bounds[1], [0, 1, 3, 4])
  np.testing.assert_array_equal(bounds[2][[0, 3]], [5, 5])  # nothing visible


def _poisoned_run(kw, poison_q, poison_kv, gen, shape, bs=SMALL):
  """(clean, dirty) results with NaN in q / k / v where the masks say."""
  b, t, s, n, k, h = shape
  q, kk, v = (_normal(gen, b, t, n, h), _normal(gen, b, s, k, h),
              _normal(gen, b, s, k, h))
  dout = _normal(gen, b, t, n, h)
  dlse = _normal(gen, b, t, n)
  fn = _flash(block_sizes=bs)
  clean = run(fn, q, kk, v, kw, dout, dlse)
  pq = poison_q[:, :, None, None]
  pkv = poison_kv[:, :, None, None]
  dirty = run(fn, jnp.where(pq, jnp.nan, q), jnp.where(pkv, jnp.nan, kk),
              jnp.where(pkv, jnp.nan, v), kw, dout, dlse)
  return clean, dirty


@gpu_jax_only_on_cpu
def test_skipped_tiles_are_never_read():
  """Sorted segments: a program must never touch the other segment's tiles.

  NaN in segment 1's q/k/v would reach segment 0's results (0 * NaN) if any
  kernel visited a tile mixing the two, even fully masked.
  """
  gen = rng("skip-poison")
  t = s = 64
  seg = jnp.where(jnp.arange(t) < 32, 0, 1)[None].astype(jnp.int32)
  kw = dict(segment_ids=pallas_fa.SegmentIds(q=seg, kv=seg))
  clean, dirty = _poisoned_run(kw, seg == 1, seg == 1, gen,
                               (1, t, s, 2, 1, 16))
  out_c, lse_c, (dq_c, dk_c, dv_c) = clean
  out_d, lse_d, (dq_d, dk_d, dv_d) = dirty
  for a, b in ((out_c, out_d), (lse_c, lse_d), (dq_c, dq_d), (dk_c, dk_d),
               (dv_c, dv_d)):
    np.testing.assert_array_equal(np.asarray(a[:, :32]), np.asarray(b[:, :32]))


@gpu_jax_only_on_cpu
def test_causal_and_window_skip_tiles():
  """Causal + window (16, 0): query rows 32..47 read only keys 16..47.

  Keys outside that range hold NaN; the forward and dQ programs of that
  query block must skip the tile before (window) and after (causal).
  """
  gen = rng("causal-window-poison")
  t = s = 64
  keys = jnp.arange(s)[None]
  clean, dirty = _poisoned_run(
      dict(is_causal=True, local_window_size=(16, 0)),
      jnp.zeros((1, t), bool), (keys < 16) | (keys >= 48), gen,
      (1, t, s, 2, 1, 16))
  for a, b in zip([clean[0], clean[1], clean[2][0]],
                  [dirty[0], dirty[1], dirty[2][0]], strict=True):
    np.testing.assert_array_equal(
        np.asarray(a[:, 32:48]), np.asarray(b[:, 32:48]))
    assert np.all(np.isfinite(np.asarray(b[:, 32:48])))


# --- Features against the reference ------------------------------------------


def _check(kw, shape, name, bias=None, dtype=jnp.float32, fn=None, hv=None):
  gen = rng("triton", name)
  b, t, s, n, k, h = shape
  hv = h if hv is None else hv
  q = _normal(gen, b, t, n, h).astype(dtype)
  kk = _normal(gen, b, s, k, h).astype(dtype)
  v = _normal(gen, b, s, k, hv).astype(dtype)
  if bias is not None:
    kw = dict(kw, bias=_normal(gen, *bias))
  dout = _normal(gen, b, t, n, hv)
  dlse = _normal(gen, b, t, n)
  got = run(fn or _flash(), q, kk, v, kw, dout, dlse)
  want = run(reference_fn(jnp.float32), q, kk, v, kw, dout, dlse)
  got = [got[0], got[1], *got[2]]
  want = [want[0], want[1], *want[2]]
  names = ["out", "lse", "dq", "dk", "dv", "dbias"][: len(got)]
  for nm, x, r in zip(names, got, want, strict=True):
    assert x.shape == r.shape, (nm, x.shape, r.shape)
    assert_close(nm, x, r)


@gpu_jax_only_on_cpu
@pytest.mark.parametrize("bias_shape", [
    (2, 1, 1, 37),  # per-key (padding-style) bias
    (1, 4, 20, 1),  # per-query bias
])
def test_broadcast_bias_gradients(bias_shape):
  _check(dict(is_causal=True, logits_soft_cap=4.0), (2, 20, 37, 4, 2, 24),
         f"bias{bias_shape}", bias=bias_shape)


@gpu_jax_only_on_cpu
def test_gqa_window_positions_mask_shared_bias():
  """Mask broadcast over queries; bias shared by batch and heads."""
  gen = rng("triton", "mask-kv")
  mask = jnp.asarray(gen.random((2, 1, 1, 50)) < 0.7)
  _check(dict(local_window_size=(9, 4), mask=mask,
              query_positions=jnp.broadcast_to(
                  jnp.arange(30, dtype=jnp.int32) + 20, (2, 30))),
         (2, 30, 50, 8, 2, 16), "gqa-window-positions-mask",
         bias=(1, 1, 30, 50))


@gpu_jax_only_on_cpu
@pytest.mark.parametrize("h, hv, kw", [
    # Narrower values, GQA 2:1, causal over ragged keys.
    (32, 16, dict(is_causal=True,
                  key_value_seq_lengths=jnp.asarray([29, 17]))),
    # Wider values padded 40 -> 64, a window and attention dropout.
    (16, 40, dict(local_window_size=(7, 3), dropout_rate=0.25,
                  dropout_rng=5)),
], ids=["hv<h-causal-gqa", "hv>h-window-dropout"])
def test_value_head_dim(h, hv, kw):
  """Hv != H: out [.., Hv], lse and every gradient against the reference."""
  _check(kw, (2, 21, 29, 4, 2, h), f"value-head-dim-{h}-{hv}", hv=hv)


@gpu_jax_only_on_cpu
def test_default_block_sizes_on_cpu():
  """block_sizes=None: the heuristic tiles, clipped to short sequences."""
  _check(dict(is_causal=True), (1, 70, 70, 2, 1, 40), "defaults",
         fn=_flash(block_sizes=None))


def test_declines_tpu(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  with pytest.raises(NotImplementedError, match="triton"):
    triton.BACKEND.check(None, None, None, None, None, None)


# --- Lowering to Triton ------------------------------------------------------


def test_logit_tiles_take_one_mufu_per_exponential(monkeypatch):
  """Built for CUDA, every kernel's tile exponentials are
  `ex2.approx.ftz.f32` (`triton.exp2`: libdevice's exp2f would wrap each
  MUFU.EX2 in subnormal rescaling), the forward's with the logit scale in
  an FMA before it; interpreted on CPU, jnp.exp2."""
  asm = []
  real = exp2_lib.pltriton.elementwise_inline_asm

  def spy(code, **kwargs):
    asm.append(code)
    return real(code, **kwargs)

  monkeypatch.setattr(exp2_lib.pltriton, "elementwise_inline_asm", spy)
  spec = jax.ShapeDtypeStruct
  q = spec((1, 100, 4, 64), jnp.bfloat16)
  kv = spec((1, 77, 2, 64), jnp.bfloat16)

  def loss(q, k, v):
    out = pallas_fa.flash_attention(q, k, v, is_causal=True,
                                    implementation="triton")
    return out.astype(jnp.float32).sum()

  def decode(q, k, v):
    return pallas_fa.decode_attention(
        q, k, v, jnp.full((1,), 60, jnp.int32), implementation="triton")

  with gpu_target.compile_for(gpu_target.H100):
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",))
    # The forward, dK/dV and dQ kernels, each traced for its masked and
    # its unmasked tiles.
    training = len(asm)
    assert training >= 6, asm
    jax.jit(decode).trace(spec((1, 1, 4, 64), jnp.bfloat16), kv, kv).lower(
        lowering_platforms=("cuda",))
    assert len(asm) > training, asm
  assert all("ex2.approx.ftz.f32" in code for code in asm), asm
  # The forward leaves the logit scale to one FMA with the exponential.
  assert any("fma.rn.f32" in code for code in asm[:training]), asm
  built = len(asm)
  # Interpreted (on a GPU too, with no GPU target): jnp.exp2.
  monkeypatch.setattr(gpu_target, "current", lambda: None)
  gen = rng("triton", "exp2-interpreted")
  x = jnp.asarray(gen.standard_normal((1, 64, 2, 32)), jnp.bfloat16)
  pallas_fa.flash_attention(x, x, x, implementation="triton")
  assert len(asm) == built, asm



def test_kernels_lower_inside_a_user_shard_map_that_checks_varying_axes():
  """Compiled, the kernels run inside `jax.shard_map(check_vma=True)`:
  their outputs are declared varying (`manual_axes.out_structs`), and the
  training kernels and decode's lower for CUDA there. (Interpreted, they
  decline: `tests/_parallel_worker.py user_shard_map`.)"""
  with gpu_target.compile_for(gpu_target.H100):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      pytest.skip("this jax sets no abstract mesh for a GPU target")
    axis = mesh.axis_names[0]
    split = jax.sharding.PartitionSpec(axis)

    def spec(shape, dtype=jnp.bfloat16):
      return jax.ShapeDtypeStruct(
          shape, dtype, sharding=jax.sharding.NamedSharding(mesh, split))

    def loss(q, k, v):
      out = pallas_fa.flash_attention(q, k, v, is_causal=True,
                                      implementation="triton")
      return jax.lax.psum(jnp.sum(out.astype(jnp.float32)), axis)

    def decode(q, k, v):
      return pallas_fa.decode_attention(
          q, k, v, jnp.full((1,), 60, jnp.int32), implementation="triton")

    user_map = functools.partial(jax.shard_map, mesh=mesh, in_specs=split)
    kv = spec((1, 77, 2, 64))
    grad = jax.grad(user_map(loss, out_specs=jax.sharding.PartitionSpec()),
                    argnums=(0, 1, 2))
    text = jax.jit(grad).trace(spec((1, 100, 4, 64)), kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()
    for name in ("flash_fwd", "flash_bwd_dkv", "flash_bwd_dq"):
      assert name in text, name
    text = jax.jit(user_map(decode, out_specs=split)).trace(
        spec((1, 1, 4, 64)), kv, kv).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


@pytest.mark.skipif(gpu_target.current() is None,
                    reason="compiled triton kernels need a GPU")
def test_compiled_kernels_run_inside_a_user_shard_map():
  """On a GPU, inside `jax.shard_map(check_vma=True)` over one device:
  triton's training and decode kernels give the unsharded call's values
  and gradients (a replicated bias's summed), and the automatic choice
  (mosaic_gpu declines there) does too."""
  gen = rng("triton", "user shard_map")
  q, k, v = (jnp.asarray(gen.standard_normal((2, 128, 4, 64)), jnp.bfloat16)
             for _ in range(3))
  bias = jnp.asarray(gen.standard_normal((1, 4, 128, 128)), jnp.float32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
  split, whole = jax.sharding.PartitionSpec("d"), jax.sharding.PartitionSpec()

  for implementation in ("triton", None):
    def loss(q, k, v, bias, implementation=implementation):
      out = pallas_fa.flash_attention(q, k, v, bias, is_causal=True,
                                      implementation=implementation)
      return jnp.sum(out.astype(jnp.float32) * jnp.cos(
          out.astype(jnp.float32)))

    def mapped(q, k, v, bias, loss=loss):
      return jax.lax.psum(loss(q, k, v, bias), "d")

    user = jax.shard_map(mapped, mesh=mesh, in_specs=(split,) * 3 + (whole,),
                         out_specs=whole)
    grads = jax.jit(jax.grad(user, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    # The same kernels on the same values: equal but for XLA's fusion of
    # the code around them (bfloat16 gradients).
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads, want):
      np.testing.assert_allclose(np.asarray(a, np.float32),
                                 np.asarray(b, np.float32), rtol=1e-2,
                                 atol=1e-2, err_msg=name)

  def decode(q, k, v):
    return pallas_fa.decode_attention(
        q, k, v, jnp.full((q.shape[0],), 100, jnp.int32),
        implementation="triton")

  got = jax.jit(jax.shard_map(decode, mesh=mesh, in_specs=split,
                              out_specs=split))(q[:, :1], k, v)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(
      decode(q[:, :1], k, v), np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype, h, features", [
    (jnp.bfloat16, 128, dict(is_causal=True)),
    (jnp.float16, 72, dict(is_causal=True, local_window_size=(40, 8),
                           logits_soft_cap=20.0, segments=True,
                           bias=(1, 1, 1, 77), mask=(1, 4, 100, 77))),
    (jnp.float32, 256, dict(bias=(1, 4, 100, 1))),
])
def test_kernels_lower_to_triton_for_cuda(dtype, h, features):
  """Forward and both backward kernels lower to Triton IR without a GPU.

  Cross-platform lowering runs the Pallas -> Triton lowering itself (shape
  and primitive support); only the Triton compiler (IR -> PTX) needs a GPU.
  """
  b, t, s, n, k = 1, 100, 77, 4, 2
  spec = jax.ShapeDtypeStruct
  kw = dict(features)
  arrays = {}
  if kw.pop("segments", False):
    arrays["segment_ids"] = pallas_fa.SegmentIds(
        q=spec((b, t), jnp.int32), kv=spec((b, s), jnp.int32))
  if "bias" in kw:
    arrays["bias"] = spec(kw.pop("bias"), jnp.float32)
  if "mask" in kw:
    arrays["mask"] = spec(kw.pop("mask"), jnp.bool_)

  def loss(q, kk, v, arrays):
    out = pallas_fa.flash_attention(
        q, kk, v, implementation="triton", **arrays, **kw)
    return out.astype(jnp.float32).sum()

  grad = jax.grad(loss, argnums=(0, 1, 2, 3), allow_int=True)
  with gpu_target.compile_for(gpu_target.H100):
    lowered = jax.jit(grad).trace(
        spec((b, t, n, h), dtype), spec((b, s, k, h), dtype),
        spec((b, s, k, h), dtype), arrays,
    ).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  for name in ("flash_fwd", "flash_bwd_dkv", "flash_bwd_dq"):
    assert name in text, name
