"""`mosaic_gpu`: FlashAttention-3-style Hopper kernels in Pallas Mosaic GPU.

The kernels live in this folder's `forward`, `dq` and `dkv`, on the
skeleton of `kernel` (warp-specialised, TMA-fed, wgmma, ping-pong softmax);
this module is everything around them:

* `MosaicGpuBlockSizes`, the frozen tiling config (from
  `tiles`, with the shared-memory model and the heuristic), and
  `default_block_sizes`: a tuned record (`scripts/tune.py`), else
  `heuristic_block_sizes`, which fits the tiles into the 227 KiB of shared
  memory of an H100/H200;
* `check`: bfloat16/float16, or float8_e4m3fn q/k/v with scales (the
  forward of `forward_fp8`, 8-bit wgmma for both products; no dropout,
  score_mod or mask_mod, a bfloat16/float16 result; its backward runs the
  bfloat16 kernels on the dequantized inputs), head dim <= 256, no bias or
  dense mask, a
  score_mod only if it reads its arrays per (batch, head) (`fused_mods`:
  the kernels take those values, one per program, and run the rest of the
  function on each tile; `dq` also sums their gradients per query), a
  mask_mod whose values are per (batch, head) or, at most one integer each,
  per query and per key of a batch row (they travel in the segment-id
  slots, or the position ones when the call has segment ids or padding
  lengths, so not when it needs both: `_mod_slot`), and an sm90 GPU -- or,
  without a GPU, the Mosaic GPU interpreter.
  Anything else raises NotImplementedError so the automatic choice moves on
  to "triton";
* the layout work: padding T and S to whole tiles and the head dim to a
  multiple of 64 (`pallas_fa.layout`, which also zeroes padded rows so NaN
  cannot leak); and the per-tile schedule, derived from
  `masking.classify_blocks`, that tells the kernels which key (query) tiles
  to stream and which of them need no masking arithmetic (a mask_mod's
  tiles intersected in: `block_mask.tile_kinds`, shared by the heads).

The public layout BTNH is kept in memory; TMA reads [tile, H] slabs of one
head directly. GQA is never materialised: query head n reads K/V head
n // (N / K), and dK/dV are summed over each group inside the kernel.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa import gpu_target
from pallas_fa import layout
from pallas_fa import manual_axes
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import quantize
from pallas_fa import tuning
from pallas_fa import vjp
from pallas_fa.flex import block_mask
from pallas_fa.flex import fused_mods
from pallas_fa.mosaic_gpu import dkv as dkv_kernel
from pallas_fa.mosaic_gpu import dq as dq_kernel
from pallas_fa.mosaic_gpu import forward as forward_kernel
from pallas_fa.mosaic_gpu import forward_fp8
from pallas_fa.mosaic_gpu import kernel
from pallas_fa.mosaic_gpu import tiles

Array = Any

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
# Float8 calls (`forward_fp8`: 8-bit wgmma for both products): e4m3 only, the
# format of P in the P V product (jax 0.10's wgmma takes one format for
# both operands).
FLOAT8_DTYPES = (jnp.float8_e4m3fn,)
FLOAT8_OUT_DTYPES = (jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
ALIGN = tiles.ALIGN
SHARED_MEMORY_BYTES = tiles.SHARED_MEMORY_BYTES
LOWERING_SEMANTICS = tiles.LOWERING_SEMANTICS
MosaicGpuBlockSizes = tiles.MosaicGpuBlockSizes
shared_memory_bytes = tiles.shared_memory_bytes
fused_backward_bytes = tiles.fused_backward_bytes
heuristic_block_sizes = tiles.heuristic_block_sizes
candidate_block_sizes = tiles.candidate_block_sizes

# Streaming multiprocessors of an H100 SXM, when the device does not say.
_DEFAULT_SM_COUNT = 132


def default_block_sizes(
    *, q_len: int, kv_len: int, head_dim: int, dtype, is_causal: bool = False,
    dropout: bool = False, device_kind: str | None = None,
    value_head_dim: int | None = None,
) -> MosaicGpuBlockSizes:
  """The tiling of a call made without `block_sizes=`: the tuned record
  nearest to the call (`pallas_fa.tuning`), else `heuristic_block_sizes`,
  whose arguments these are. Returns a `MosaicGpuBlockSizes`."""
  if value_head_dim not in (None, head_dim) or quantize.is_fp8(dtype):
    # Records are tuned with Hv = H, in bfloat16/float16.
    return heuristic_block_sizes(
        q_len=q_len, kv_len=kv_len, head_dim=head_dim, dtype=dtype,
        is_causal=is_causal, dropout=dropout, device_kind=device_kind,
        value_head_dim=value_head_dim)
  return tuning.tuned_or_heuristic(
      "mosaic_gpu", MosaicGpuBlockSizes, heuristic_block_sizes, q_len=q_len,
      kv_len=kv_len, head_dim=head_dim, dtype=dtype, is_causal=is_causal,
      dropout=dropout, device_kind=device_kind)


# --------------------------------------------------------------------------
# Where the kernels can run.
# --------------------------------------------------------------------------


def runs_interpreted(bs: MosaicGpuBlockSizes | None) -> bool:
  """Whether a call with block sizes `bs` runs in the Mosaic GPU interpreter
  (True) or as compiled Hopper kernels (False), on this machine or the
  current `gpu_target.compile_for` target.

  Raises:
    NotImplementedError: neither way works here (no interpreter in this jax
      or too few CPU threads for it, or compiled kernels asked for without
      an sm90 target).
  """
  wanted = None if bs is None else bs.interpret
  target = gpu_target.current()
  if wanted is None:
    wanted = target is None
  if wanted:
    if kernel.interpret_params() is None:
      raise NotImplementedError(
          "mosaic_gpu: this jax has no Mosaic GPU interpreter "
          f"({jax.__version__=}).")
    threads = kernel.cpu_client_threads()
    if threads < kernel.MAX_WARPGROUPS:
      raise NotImplementedError(
          "mosaic_gpu: the Mosaic GPU interpreter needs "
          f"{kernel.MAX_WARPGROUPS} CPU client threads at once and this "
          f"process has {threads}; set the environment "
          f"variable NPROC={kernel.MAX_WARPGROUPS} or more before jax starts.")
    return True
  if target is None or target.major != 9:
    raise NotImplementedError(
        f"mosaic_gpu needs an sm90 (Hopper) GPU, got {target=} on platform "
        f"{jax.default_backend()!r}.")
  return False


def _num_ctas(bs: MosaicGpuBlockSizes, interpret: bool, units: int) -> int:
  if bs.num_ctas is not None:
    return max(1, min(bs.num_ctas, units))
  target = gpu_target.current()
  if interpret or target is None:
    return 1
  sms = target.core_count or _DEFAULT_SM_COUNT
  return max(1, min(int(sms), units))


def cuda_runtime_version() -> int | None:
  """The CUDA runtime version (e.g. 12090), or None when unknown; `check`
  refuses masked compiled kernels on runtimes whose ptxas miscompiles them."""
  try:
    versions = importlib.import_module("jax._src.lib").cuda_versions
    return int(versions.cuda_runtime_get_version())
  except Exception:  # noqa: BLE001 - any failure means "unknown".
    return None


# CUDA runtimes whose ptxas miscompiles masked Mosaic GPU attention kernels
# (the range JAX's own attention_mgpu refuses causal masking for).
_MISCOMPILING_CUDA = (12080, 12091)


def refuses_masked_kernels() -> bool:
  """Whether this process's CUDA runtime (`cuda_runtime_version`) is one
  whose ptxas miscompiles masked kernels, so that compiled calls that
  mask are refused (`NotImplementedError`)."""
  version = cuda_runtime_version()
  lo, hi = _MISCOMPILING_CUDA
  return version is not None and lo <= version < hi


def _needs_masking(q, k, info, bs: MosaicGpuBlockSizes) -> bool:
  """Whether any kernel of the call runs its masked (jnp.where) path."""
  if (info.restricts_positions or info.has_segments
      or info.mask_mod is not None):
    return True
  t, s = q.shape[1], k.shape[1]
  q_tiles = (bs.num_consumers * bs.block_q,
             bs.num_consumers_dq * bs.block_q_dq, bs.block_q_dkv)
  kv_tiles = (bs.block_kv, bs.block_kv_dq,
              bs.num_consumers_dkv * bs.block_kv_dkv)
  return any(t % x for x in q_tiles) or any(s % x for x in kv_tiles)


def _check(q, k, v, bias, info, params):
  """Raises NotImplementedError for calls these kernels cannot honour."""
  manual_axes.check_kernels(
      "mosaic_gpu", q, k, v, bias, info,
      interpreted=lambda: runs_interpreted(params.block_sizes))
  mask = info.mask  # Every other part of the mask description is supported.
  _mods(info)  # Declines what it cannot fuse.
  if quantize.is_fp8(q.dtype):
    _check_fp8(q, k, v, info, params)
  elif q.dtype not in SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"mosaic_gpu runs bfloat16/float16 (wgmma) only, got {q.dtype=}.")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise NotImplementedError(
        f"mosaic_gpu needs q, k, v of one dtype, got {q.dtype=} "
        f"{k.dtype=} {v.dtype=}.")
  if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
    raise NotImplementedError(
        f"mosaic_gpu supports head dims up to {MAX_HEAD_DIM}, got "
        f"{q.shape[-1]=} and {v.shape[-1]=}.")
  if bias is not None:
    raise NotImplementedError("mosaic_gpu does not take a bias.")
  if mask is not None:
    raise NotImplementedError("mosaic_gpu does not take a dense mask.")
  if not runs_interpreted(params.block_sizes) and refuses_masked_kernels():
    if _needs_masking(q, k, info, _block_sizes(params, q, k, v, info)):
      raise NotImplementedError(
          f"mosaic_gpu: masked kernels are miscompiled by ptxas of CUDA "
          f"{cuda_runtime_version()} (12.8.0 <= version < 12.9.1).")


def _check_fp8(q, k, v, info, params):
  """Raises NotImplementedError for float8 calls `forward_fp8` cannot run."""
  if any(x.dtype not in FLOAT8_DTYPES for x in (q, k, v)):
    raise NotImplementedError(
        "mosaic_gpu's float8 kernel takes float8_e4m3fn q, k and v, got "
        f"{q.dtype=} {k.dtype=} {v.dtype=}; " + _OTHERS)
  out_dtype = params.out_dtype or jnp.bfloat16
  if out_dtype not in FLOAT8_OUT_DTYPES:
    raise NotImplementedError(
        "mosaic_gpu's float8 kernel writes bfloat16 or float16, got "
        f"out_dtype={jnp.dtype(out_dtype).name}; " + _OTHERS)
  if info.has_dropout:
    raise NotImplementedError(
        "mosaic_gpu's float8 kernel has no attention dropout; " + _OTHERS)
  if info.score_mod is not None or info.mask_mod is not None:
    raise NotImplementedError(
        "mosaic_gpu's float8 kernel takes no score_mod or mask_mod; "
        + _OTHERS)
  bs = _block_sizes(params, q, k, v, info)
  if bs.block_kv % 64:
    raise NotImplementedError(
        "mosaic_gpu's float8 kernel streams key tiles of a multiple of 64 "
        f"(the 64-byte swizzle of V^T), got {bs.block_kv=}; " + _OTHERS)


# --------------------------------------------------------------------------
# Layout: padding, metadata, per-tile schedule.
# --------------------------------------------------------------------------


def _meta(x: layout.Padded, mask_mod=None, slot=None) -> tuple[
    Array, Array, Array, Array]:
  """q positions, q segment ids, kv positions, kv segment ids: int32
  [B, Tp] / [B, Sp], zeros where the call has none (the kernels always
  take all four). The `slot` pair (`_mod_slot`) holds the mask_mod's
  per-query and per-key values instead (zeros for an absent one)."""
  info = x.info
  slots = {"positions": [info.q_positions, info.kv_positions],
           "segments": [info.q_segment_ids, info.kv_segment_ids]}

  def ids(values, length):
    if values is None:
      return jnp.zeros((x.b, length), jnp.int32)
    return jnp.broadcast_to(values.astype(jnp.int32), (x.b, length))

  if slot is not None:
    slots[slot] = [None, None]
    levels = (fused_mods.Level.ROW, fused_mods.Level.COLUMN)
    arrays = mask_mod.residual_arrays(
        info.mask_mod_args, batch=x.b, heads=x.n, q_len=x.t, kv_len=x.s,
        q_padded=x.tp, kv_padded=x.sp, levels=levels)
    chosen = [r for r in mask_mod.residuals if r.level in levels]
    for res, values in zip(chosen, arrays, strict=True):
      # [Bm, Hm = 1, L] (`_mods`).
      slots[slot][int(res.level == fused_mods.Level.COLUMN)] = values[:, 0]
  (q_pos, kv_pos), (q_seg, kv_seg) = slots["positions"], slots["segments"]
  return (ids(q_pos, x.tp), ids(q_seg, x.tp), ids(kv_pos, x.sp),
          ids(kv_seg, x.sp))


def _mod_slot(info, mask_mod) -> str | None:
  """The metadata slot that carries the mask_mod's per-query and per-key
  values (`kernel.Spec.mod_slot`): segment ids unless the call has some
  (padding lengths are segment ids too), else positions unless it needs
  them (causal, window); None when it has no such values.

  Raises:
    NotImplementedError: the call needs both slots.
  """
  if mask_mod is None or all(r.level == fused_mods.Level.PROGRAM
                             for r in mask_mod.residuals):
    return None
  if not info.has_segments:
    return "segments"
  if not info.restricts_positions:
    return "positions"
  raise NotImplementedError(
      "mosaic_gpu carries a mask_mod's per-query and per-key values in the "
      "segment-id or position slots; this call needs both (segment ids or "
      "padding lengths, and causal or window masking); " + _OTHERS)


def _kinds(x: layout.Padded, mask_mod, block_q, block_kv) -> Array:
  """Tile kinds [B, nq, nk] of the call's masks, a mask_mod's included
  (EMPTY or FULL only where it is so for every head: the schedule has one
  row per batch row)."""
  kinds = masking.classify_blocks(x.info, block_q, block_kv)
  if mask_mod is None:
    return kinds
  mod = block_mask.tile_kinds(
      x.info, batch=x.b, heads=x.n, q_len=x.t, kv_len=x.s, block_q=block_q,
      block_kv=block_kv, num_blocks=kinds.shape[1:])
  return masking.intersect_kinds(kinds, masking.shared_kinds(mod, axis=1))


def schedule(kinds: Array, consumers: int) -> Array:
  """The per-unit tile schedule the kernels read.

  Args:
    kinds: int32 [B, rows, cols] tile kinds (`masking.classify_blocks`,
      transposed for the dK/dV kernel); `rows` is a multiple of `consumers`.
    consumers: row tiles per unit of work.

  Returns:
    int32 [B, rows / consumers, 2 + 2 * consumers]: per unit, [ulo, uhi),
    the union of the consumers' non-empty column ranges (what the producer
    streams), then per consumer [flo, fhi), a run of FULL tiles inside it
    that needs no masking (empty when the FULL tiles are not contiguous).
  """
  b, rows, cols = kinds.shape
  units = rows // consumers
  lo, hi = masking.block_range(kinds)  # [B, rows]
  nonempty = lo < hi
  lo_u = jnp.where(nonempty, lo, cols).reshape(b, units, consumers).min(-1)
  hi_u = jnp.where(nonempty, hi, 0).reshape(b, units, consumers).max(-1)
  any_u = lo_u < hi_u
  ulo = jnp.where(any_u, lo_u, 0)
  uhi = jnp.where(any_u, hi_u, 0)
  f_lo, f_hi = masking.full_run(kinds, jnp.repeat(ulo, consumers, axis=1))
  f_lo = f_lo.reshape(b, units, consumers)
  f_hi = f_hi.reshape(b, units, consumers)
  runs = jnp.stack([f_lo, f_hi], axis=-1).reshape(b, units, 2 * consumers)
  out = jnp.concatenate([ulo[..., None], uhi[..., None], runs], axis=-1)
  return out.astype(jnp.int32)


def _head_section(x: layout.Padded, bs, forward: bool) -> int | None:
  """The head section of a causal schedule (`kernel.Units`): the tiling's
  `head_section`, else for the forward kernel as many (batch, query head)
  pairs as stream `kernel.L2_SECTION_BYTES` of K/V (a query head's share
  of its K/V head's); the backward kernels, dealt in waves, then keep the
  section their dealing balances best (None)."""
  if bs.head_section is not None or not forward:
    return bs.head_section
  per_pair = x.sp * (x.q.shape[-1] + x.v.shape[-1]) * x.q.dtype.itemsize
  return kernel.default_head_section(per_pair // x.g)


def _spec(x: layout.Padded, params, bs, interpret, *, block_q, block_kv, stages,
          consumers, pingpong, units_per_head, heads, num_heads,
          score_mod=None, mask_mod=None, mod_slot=None, forward=False,
          intra_overlap=False):
  q_len, kv_len = x.q.shape[1], x.k.shape[1]
  units = x.q.shape[0] * heads * units_per_head
  return kernel.Spec(
      batch=x.q.shape[0],
      q_len=q_len,
      kv_len=kv_len,
      num_heads=num_heads,
      num_kv_heads=x.k.shape[2],
      head_dim=x.q.shape[-1],
      value_head_dim=x.v.shape[-1],
      dtype=x.q.dtype,
      block_q=block_q,
      block_kv=block_kv,
      stages=stages,
      consumers=consumers,
      num_ctas=_num_ctas(bs, interpret, units),
      pingpong=pingpong,
      intra_overlap=intra_overlap,
      poly_exp2=bs.poly_exp2 if forward else 0,
      two_level=bs.float8_two_level and forward,
      dq_split=bs.dq_split,
      dq_swizzle=bs.dq_swizzle,
      fused_overlap=bs.fused_overlap,
      fused_pipeline=bs.fused_pipeline,
      fused_softmax_overlap=bs.fused_softmax_overlap,
      is_causal=x.info.is_causal,
      window=x.info.window,
      # The forwards' (the backward kernels spill 8-32 B at H = 128 with
      # the index vectors live where loaded ones were).
      positions_by_index=forward and x.info.positions_are_indices,
      # A forward masks padded keys by index, not by the padding's segment
      # ids (its padded query rows are sliced off, not masked), so that
      # none travel without the call's own; the backward's zero its
      # padded query rows' probabilities. A mask_mod's values may take
      # the segment ids' slots (`valid_kv_len` then masks the keys too).
      has_segments=(x.own_segments if forward else x.info.has_segments)
      and mod_slot != "segments",
      scale=params.scale,
      soft_cap=params.soft_cap,
      interpret=interpret,
      lowering_semantics=bs.lowering_semantics if bs is not None else None,
      dropout_rate=x.info.dropout_rate,
      score_mod=score_mod,
      mask_mod=mask_mod,
      mod_slot=mod_slot,
      valid_kv_len=x.s,
      head_section=_head_section(x, bs, forward),
  )


def _block_sizes(params, q, k, v, info) -> MosaicGpuBlockSizes:
  """The call's tiling (`vjp.Backend.block_sizes`); a default one adapted
  to a score_mod (`tiles.for_score_mod`)."""
  bs = BACKEND.block_sizes(params, q, k, info, v=v)
  if params.block_sizes is None:
    bs = tiles.for_score_mod(bs, _mods(info)[0])
  return bs


_OTHERS = "\"triton\", \"chunked\" and \"xla\" run it."


def _mods(info):
  """(score_mod, mask_mod) of the call split for the kernels
  (`fused_mods`), None for an absent one.

  Raises:
    NotImplementedError: one cannot be fused here: a tile part a kernel
      cannot run; a score_mod reading values per query or key; a mask_mod
      reading more than one value per query or per key, a float one, one
      that differs by head, or one whose values find no free metadata slot
      (`_mod_slot`).
  """
  score_mod, mask_mod = fused_mods.split_call(info, "mosaic_gpu")
  if score_mod is not None and any(
      r.level != fused_mods.Level.PROGRAM for r in score_mod.residuals):
    raise NotImplementedError(
        "mosaic_gpu fuses a score_mod whose arrays it reads per (batch, "
        "head) only (e.g. slopes[head]); this one reads values per query "
        "or key; " + _OTHERS)
  if mask_mod is None:
    return score_mod, mask_mod
  per_token = [r for r in mask_mod.residuals
               if r.level != fused_mods.Level.PROGRAM]
  if not per_token:
    return score_mod, mask_mod
  for level in (fused_mods.Level.ROW, fused_mods.Level.COLUMN):
    if sum(r.level == level for r in per_token) > 1:
      raise NotImplementedError(
          "mosaic_gpu fuses a mask_mod with at most one value per query "
          "and one per key; this one has more; " + _OTHERS)
  if any(r.head for r in per_token):
    raise NotImplementedError(
        "mosaic_gpu fuses a mask_mod whose per-query or per-key values are "
        "the same for every head; this one's differ by head; " + _OTHERS)
  if any(not (jnp.issubdtype(r.dtype, jnp.integer) or r.dtype == jnp.bool_)
         for r in per_token):
    raise NotImplementedError(
        "mosaic_gpu fuses a mask_mod whose per-query or per-key values are "
        "integers or booleans; this one's are not; " + _OTHERS)
  _mod_slot(info, mask_mod)  # Raises when there is none.
  return score_mod, mask_mod


def _residuals(x: layout.Padded, score_mod, mask_mod) -> tuple:
  """The per-(batch, head) values of the score_mod, then of the mask_mod,
  [Bm, Hm] each (booleans as int32)."""
  out = []
  for mod, args in ((score_mod, x.info.score_mod_args),
                    (mask_mod, x.info.mask_mod_args)):
    if mod is None:
      continue
    out += [a.astype(jnp.int32) if a.dtype == jnp.bool_ else a
            for a in mod.residual_arrays(
                args, batch=x.b, heads=x.n, q_len=x.t, kv_len=x.s,
                q_padded=x.tp, kv_padded=x.sp,
                levels=(fused_mods.Level.PROGRAM,))]
  return tuple(out)


def _seed(x: layout.Padded) -> Array | None:
  """The kernels' uint32 [1] dropout seed operand; None without dropout."""
  if not x.info.has_dropout:
    return None
  return jnp.asarray(x.info.dropout_seed, jnp.uint32).reshape(1)


# --------------------------------------------------------------------------
# Forward and backward.
# --------------------------------------------------------------------------


def _forward(q, k, v, bias, info, params, scales=None):
  del bias  # Refused by _check.
  bs = _block_sizes(params, q, k, v, info)
  if scales is not None:
    return forward_fp8_impl(q, k, v, info, params, scales,
                            interpret=runs_interpreted(bs))
  return forward_impl(q, k, v, info, params, interpret=runs_interpreted(bs))


def _fp8_scales(x: layout.Padded, params, scales):
  """The scale operands of `forward_fp8.forward` from a float8 call's
  (q_scale [B|1, T|1, N|1], k_scale, v_scale [B|1, S|1, K|1]):
  (q_row, k_col, v_col, out_mult, key_scales, value_scales)."""
  qs, ks, vs = (jnp.asarray(s, jnp.float32) for s in scales)
  b, t, n, s, kh = x.b, x.t, x.n, x.s, x.num_kv
  key_scales, value_scales = ks.shape[1] > 1, vs.shape[1] > 1
  per_head = lambda a: jnp.repeat(  # noqa: E731 - [B, K] -> [B, N].
      a, x.g, axis=1)
  # Without a soft cap the kernel's logits are base 2: log2(e) rides here.
  base = online_softmax.LOG2_E if params.soft_cap is None else 1.0
  q_row = jnp.broadcast_to(qs, (b, t, n)) * (params.scale * base)
  tiny = jnp.zeros((1, 1, 1), jnp.float32)  # An operand never read.
  if key_scales:
    k_col = jnp.swapaxes(jnp.pad(jnp.broadcast_to(ks, (b, s, kh)),
                                 ((0, 0), (0, x.sp - s), (0, 0))), 1, 2)
  else:
    q_row = q_row * per_head(jnp.broadcast_to(ks, (b, 1, kh))[:, 0])[:, None]
    k_col = tiny
  q_row = jnp.swapaxes(jnp.pad(q_row, ((0, 0), (0, x.tp - t), (0, 0))), 1, 2)
  if value_scales:
    full = jnp.broadcast_to(vs, (b, s, kh))
    top = jnp.max(jnp.abs(full), axis=1)  # [B, K]
    ratio = jnp.where(top[:, None] > 0, full / jnp.where(
        top[:, None] > 0, top[:, None], 1.0), 0.0)
    v_col = jnp.swapaxes(jnp.pad(ratio * forward_fp8.P_SCALE,
                                 ((0, 0), (0, x.sp - s), (0, 0))), 1, 2)
  else:
    top = jnp.broadcast_to(vs, (b, 1, kh))[:, 0]
    v_col = tiny
  # P_SCALE: in v_col with value scales, else in P and l alike (it cancels).
  out_mult = per_head(top) / (forward_fp8.P_SCALE if value_scales else 1.0)
  return q_row, k_col, v_col, out_mult, key_scales, value_scales


def _forward_plan(q, k, v, info, params, interpret, *, kernel_name,
                  smem_bytes, score_mod=None, mask_mod=None, slot=None):
  """What a forward kernel (bf16/f16 or float8) launches with: the inputs
  padded to its tiles, its schedule and its `kernel.Spec`. Compiled, a
  tiling whose buffers (`smem_bytes(block_sizes, the metadata arrays that
  travel)`) exceed shared memory is a ValueError naming `kernel_name` (the
  interpreter has none to run out of).

  Returns:
    (layout.Padded, schedule, kernel.Spec).
  """
  n = q.shape[2]
  bs = _block_sizes(params, q, k, v, info)
  rows = bs.num_consumers * bs.block_q
  x = layout.Padded(
      q, k, v, None, info, q_len=layout.padded_length(q.shape[1], rows),
      kv_len=layout.padded_length(k.shape[1], bs.block_kv), align=ALIGN)
  sched = schedule(_kinds(x, mask_mod, bs.block_q, bs.block_kv),
                   bs.num_consumers)
  spec = _spec(
      x, params, bs, interpret, block_q=bs.block_q, block_kv=bs.block_kv,
      stages=bs.num_stages, consumers=bs.num_consumers, pingpong=bs.pingpong,
      units_per_head=x.tp // rows, heads=n, num_heads=n, score_mod=score_mod,
      mask_mod=mask_mod, mod_slot=slot, forward=True,
      intra_overlap=bs.intra_overlap)
  if not interpret:
    hint = ("; the call's positions travel with its tiles, in buffers of "
            "their own that leaving query_positions and key_positions "
            "unset (when they are the defaults) would free"
            if spec.need_positions and spec.carries_pos else "")
    tiles.check_fits(bs, kernel_name, smem_bytes(bs, spec.num_meta), hint)
  return x, sched, spec


def forward_fp8_impl(q, k, v, info, params, scales, *, interpret: bool):
  """The float8 (e4m3) forward with the execution mode given (see
  `forward_impl`).

  Returns:
    (out [B, T, N, Hv] in params.out_dtype (bfloat16 by default), lse
    float32 [B, T, N]).
  """
  t = q.shape[1]
  x, sched, spec = _forward_plan(
      q, k, v, info, params, interpret, kernel_name="float8 forward",
      smem_bytes=lambda bs, meta: tiles.fp8_forward_bytes(
          bs, q.shape[-1], v.shape[-1], meta=meta))
  q_row, k_col, v_col, out_mult, key_scales, value_scales = _fp8_scales(
      x, params, scales)
  q_row, q_mixed = forward_fp8.row_factors(q_row, spec.block_q)
  # The logit scale is in q_row.
  spec = dataclasses.replace(spec, scale=1.0)
  out, lse = forward_fp8.forward(
      spec, x.q, x.k, forward_fp8.layout_v(x.v, interpret=interpret),
      *_meta(x), q_row, k_col, v_col, out_mult, q_mixed, sched,
      out_dtype=jnp.dtype(params.out_dtype or jnp.bfloat16),
      key_scales=key_scales, value_scales=value_scales)
  return out[:, :t, :, :x.hv], jnp.swapaxes(lse[:, :, :t], 1, 2)


def forward_impl(q, k, v, info, params, *, interpret: bool):
  """The forward pass with the execution mode given (no platform check).

  `interpret=False` builds the compiled Hopper kernels whatever the default
  backend is, so that they can be lowered for CUDA ahead of time.

  Returns:
    (out [B, T, N, Hv], lse float32 [B, T, N]).
  """
  t = q.shape[1]
  score_mod, mask_mod = _mods(info)
  slot = _mod_slot(info, mask_mod)
  x, sched, spec = _forward_plan(
      q, k, v, info, params, interpret, kernel_name="forward",
      smem_bytes=lambda bs, meta: shared_memory_bytes(
          bs, q.shape[-1], q.dtype.itemsize, v.shape[-1],
          meta=meta)["forward"],
      score_mod=score_mod, mask_mod=mask_mod, slot=slot)
  out, lse = forward_kernel.forward(
      spec, x.q, x.k, x.v, *_meta(x, mask_mod, slot), sched, _seed(x),
      _residuals(x, score_mod, mask_mod))
  return out[:, :t, :, :x.hv], jnp.swapaxes(lse[:, :, :t], 1, 2)


def _backward(q, k, v, bias, info, params, lse, dout, delta):
  del bias  # Refused by _check.
  if q.dtype == jnp.float32:
    # Only a float8 call gets here with float32 (`vjp`: its backward runs on
    # the dequantized inputs); the kernels compute it in bfloat16.
    wide = (q, k, v)
    q, k, v, dout = (a.astype(jnp.bfloat16) for a in (q, k, v, dout))
    grads = _backward(q, k, v, None, info, params, lse, dout, delta)
    return (*(g.astype(a.dtype) for g, a in zip(grads[:3], wide)),
            *grads[3:])
  bs = _block_sizes(params, q, k, v, info)
  return backward_impl(
      q, k, v, info, params, lse, dout, delta, interpret=runs_interpreted(bs))


def fused_backward_applies(bs: MosaicGpuBlockSizes, head_dim: int,
                           value_head_dim: int, score_mod=None, *,
                           dropout: bool = False, interpret: bool = False,
                           deterministic: bool = False) -> bool:
  """Whether a call with tiling `bs` runs the fused backward
  (`MosaicGpuBlockSizes.backward`, the default), else the split one. It
  needs:

  * `backward="fused"` and no split dK/dV passes;
  * no reproducible backward asked for (`deterministic`, the call's
    `flash_attention(deterministic_backward=...)` resolved): the fused
    kernel's dQ reduce-adds land in no fixed order, so it wins over
    `backward="fused"`;
  * query tiles of the dK/dV kernel a multiple of 64 (the M of the dQ
    wgmma; the heuristic's 32 with dropout at H > 64 keeps the split path);
  * padded head dims <= 128, <= 64 with dropout (wider ones leave no
    registers for a third accumulator, nor shared memory for the dS^T and
    dQ staging tiles, `tiles.fused_backward_bytes`; dropout's hashing
    beside it spills 148 bytes at 128);
  * no score_mod whose values are differentiated (their per-query
    cotangents are the dQ kernel's);
  * compiled, a jax that builds kernels with aliased outputs
    (`kernel.can_accumulate`).
  """
  if deterministic or bs.backward != "fused" or bs.split_dkv or (
      bs.block_q_dkv % 64):
    return False
  if not interpret and not kernel.can_accumulate():
    return False
  widest = layout.padded_head_dim(max(head_dim, value_head_dim), ALIGN)
  if widest > (64 if dropout else 128):
    return False
  if score_mod is not None and any(
      res.differentiable for res in score_mod.residuals):
    return False
  return tiles.fused_backward_bytes(
      bs, head_dim, value_head_dim=value_head_dim) <= SHARED_MEMORY_BYTES


def _check_backward_fits(bs, head_dim, value_head_dim, itemsize, fused):
  """`tiles.check_fits` for the kernels the backward launches: the fused
  one, else the dQ and dK/dV ones (a fused tiling past the defaults'
  margin lands here too, and its split kernels may not fit either)."""
  if fused:
    tiles.check_fits(bs, "fused backward", fused_backward_bytes(
        bs, head_dim, itemsize, value_head_dim))
    return
  smem = shared_memory_bytes(bs, head_dim, itemsize, value_head_dim)
  tiles.check_fits(bs, "dQ", smem["dq"])
  tiles.check_fits(bs, "dK/dV", smem["dkv"])


def backward_impl(q, k, v, info, params, lse, dout, delta, *,
                  interpret: bool):
  """The backward pass with the execution mode given (see `forward_impl`).

  Returns:
    (dq, dk, dv, None): no bias gradient, a bias is refused by the check.
  """
  b, t, n, h = q.shape
  s, num_kv = k.shape[1], k.shape[2]
  bs = _block_sizes(params, q, k, v, info)
  q_rows = bs.num_consumers_dq * bs.block_q_dq
  kv_rows = bs.num_consumers_dkv * bs.block_kv_dkv
  q_len = layout.padded_length(t, q_rows, bs.block_q_dkv)
  kv_len = layout.padded_length(s, kv_rows, bs.block_kv_dq)
  x = layout.Padded(q, k, v, None, info, q_len=q_len, kv_len=kv_len,
                    align=ALIGN)
  do = x.queries(dout.astype(q.dtype))
  # [B, N, Tp] float32; `vjp` zeroed delta on padded rows already.
  lse2 = x.rows(kernel.lse_for_kernel(lse).astype(jnp.float32), jnp.inf)
  delta = x.rows(delta.astype(jnp.float32), 0.0)
  score_mod, mask_mod = _mods(info)
  slot = _mod_slot(info, mask_mod)
  operands = (x.q, x.k, x.v, do, lse2, delta, *_meta(x, mask_mod, slot))
  residuals = _residuals(x, score_mod, mask_mod)

  fused = fused_backward_applies(
      bs, h, v.shape[-1], score_mod, dropout=info.has_dropout,
      interpret=interpret, deterministic=params.deterministic_backward)
  if not interpret:  # The interpreter has no shared memory to run out of.
    _check_backward_fits(bs, h, v.shape[-1], q.dtype.itemsize, fused)
  if not fused:
    sched = schedule(_kinds(x, mask_mod, bs.block_q_dq, bs.block_kv_dq),
                     bs.num_consumers_dq)
    spec = _spec(
        x, params, bs, interpret, block_q=bs.block_q_dq,
        block_kv=bs.block_kv_dq, stages=bs.num_stages_bwd,
        consumers=bs.num_consumers_dq, pingpong=False,
        units_per_head=q_len // q_rows, heads=n, num_heads=n,
        score_mod=score_mod, mask_mod=mask_mod, mod_slot=slot)
    dq, *dmod = dq_kernel.backward_dq(spec, *operands, sched, _seed(x),
                                      residuals)

  kinds = _kinds(x, mask_mod, bs.block_q_dkv, bs.block_kv_dkv)
  sched = schedule(jnp.swapaxes(kinds, 1, 2), bs.num_consumers_dkv)
  spec = _spec(
      x, params, bs, interpret, block_q=bs.block_q_dkv,
      block_kv=bs.block_kv_dkv, stages=bs.num_stages_bwd,
      consumers=bs.num_consumers_dkv, pingpong=False,
      units_per_head=kv_len // kv_rows, heads=num_kv, num_heads=n,
      score_mod=score_mod, mask_mod=mask_mod, mod_slot=slot)
  seed = _seed(x)
  if fused:
    dk, dv, dq = dkv_kernel.backward_dkv(
        spec, *operands, sched, seed, residuals, outputs=("dk", "dv", "dq"))
    dq, dmod = kernel.scale_grad(spec, dq).astype(q.dtype), ()
  elif bs.split_dkv:
    (dv,) = dkv_kernel.backward_dkv(
        spec, *operands, sched, seed, residuals, outputs=("dv",))
    (dk,) = dkv_kernel.backward_dkv(
        spec, *operands, sched, seed, residuals, outputs=("dk",))
  else:
    dk, dv = dkv_kernel.backward_dkv(spec, *operands, sched, seed,
                                     residuals)
  grads = (
      dq[:, :t, :, :h],
      dk[:, :s, :, :h].astype(k.dtype),
      dv[:, :s, :, :x.hv].astype(v.dtype),
      None,
  )
  if score_mod is None:
    return grads
  # Per query, [B, N, Tp] (padded rows have zero cotangent).
  return (*grads, score_mod.args_grad_from_partials(
      info.score_mod_args, dmod, batch=b, heads=n))


BACKEND = vjp.Backend(
    name="mosaic_gpu",
    forward=_forward,
    backward=_backward,
    check=_check,
    block_sizes_type=MosaicGpuBlockSizes,
    default_block_sizes=default_block_sizes,
    dtypes=SUPPORTED_DTYPES + FLOAT8_DTYPES,
    value_head_dim=True,
    dropout=True,
)
