"""`triton`: flash attention kernels in Pallas, lowered to Triton.

Three kernels (their bodies are in `kernel`), none using atomics, so
every result is deterministic:

* forward: grid (query blocks, query heads, batch); each program keeps one
  [block_q, H] tile of queries and runs the online softmax over the key/value
  tiles (FlashAttention-2, Algorithm 1) in base 2, with log2(e) folded into
  the logit scale, accumulating [block_q, Hv]; it writes the output and the
  natural-log logsumexp;
* dK/dV: grid (key blocks, key/value heads, batch); each program keeps one
  [block_kv, H] tile of K and one [block_kv, Hv] tile of V (Hv, the value
  head dim, may differ from H) and streams the query tiles of *every* query
  head of its GQA group, so dK and dV come out summed over the group without
  ever being materialised per query head (FlashAttention-2 §3.2);
* dQ: grid (query blocks, query heads, batch); each program keeps one query
  tile and streams the key/value tiles; it also produces dbias when a bias is
  given. delta = rowsum(out * dout) - dlse arrives precomputed from `vjp`.

Every loop runs over the tiles `masking.classify_blocks` marks non-empty, its
bounds computed outside the kernel from per-block min/max of positions and
segment ids (so causal, windows, padding and sorted segments shrink the
loops), and is split into a masked head, an unmasked middle of FULL tiles and
a masked tail, so the masking arithmetic runs only on PARTIAL tiles.

Flex attention (`score_mod`, `mask_mod`) is fused: `fused_mods` splits the
functions, the kernels read the per-program, per-query and per-key values
they need as inputs, and a mask_mod call walks per-program lists of its
FULL and PARTIAL tiles (`tile_lists`) instead of a range. A table read at
offsets computed per element (T5's relative-position buckets,
`flex.t5_relative_bias`, any learned relative bias) is fused too: each
program's table (`table[head]`) is an input, the read a load at computed
offsets, and the table's gradient a scatter-add into per-program partial
tables ([B, N, query blocks, table size], float32) written by the dQ
kernel and summed here after it -- no atomics, so deterministic like the
rest (`kernel._scatter_add`).

Any T and S are padded to whole tiles and each head dim (H of q/k, Hv of
v, the output and dO) to a power of two of at least 16 (`ALIGN`,
`pallas_fa.layout`). A call without `block_sizes=` gets a tuned record
(`scripts/tune.py`) or else the heuristic of `heuristic_block_sizes`
(`tiles`). On CPU the kernels run in Pallas interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_fa import gpu_target
from pallas_fa import layout
from pallas_fa import manual_axes
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import quantize
from pallas_fa import tuning
from pallas_fa import vjp
from pallas_fa.flex import block_mask as block_mask_lib
from pallas_fa.flex import fused_mods
from pallas_fa.flex import mods
from pallas_fa.triton import kernel
from pallas_fa.triton import tiles

try:  # The Triton-specific Pallas API (`jax.experimental.pallas.gpu` once).
  from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - depends on the installed jax.
  from jax.experimental.pallas import gpu as _plgpu

Array = Any
_F32 = jnp.float32
_LOG2_E = online_softmax.LOG2_E
_WARPS = (1, 2, 4, 8, 16)
_SQUEEZED = getattr(pl, "squeezed", None)
# Older jax releases call it TritonCompilerParams.
_CompilerParams = (
    _plgpu.CompilerParams if hasattr(_plgpu, "CompilerParams")
    else _plgpu.TritonCompilerParams
)


MIN_BLOCK, MAX_BLOCK = tiles.MIN_BLOCK, tiles.MAX_BLOCK
ALIGN = tiles.ALIGN
# The shared-memory model, for `scripts/tune.py` and the tests.
HOPPER_KINDS = tiles.HOPPER_KINDS
shared_memory_budget = tiles.shared_memory_budget
shared_memory_bytes = tiles.shared_memory_bytes


def _is_power_of_2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TritonBlockSizes:
  """Tiling of the `triton` kernels.

  Tiles are clipped to the (power-of-two rounded) sequence lengths, so large
  tiles are safe on short sequences.

  Attributes:
    block_q: forward query rows per program.
    block_kv: forward key rows per loop step.
    block_q_dkv: dK/dV kernel, query rows per loop step.
    block_kv_dkv: dK/dV kernel, key rows per program.
    block_q_dq: dQ kernel, query rows per program.
    block_kv_dq: dQ kernel, key rows per loop step.
    num_warps: warps per program of the forward kernel.
    num_stages: software-pipelining stages of the forward kernel.
    num_warps_bwd: warps of the backward kernels (None: num_warps).
    num_stages_bwd: stages of the backward kernels (None: num_stages).
    widen_float8: how a float8 forward reads its tiles. True: query, key
      and value are widened to float16 (exact) in XLA before the kernel,
      which then streams 2-byte tiles straight into its products, with the
      tiles of a 16-bit call; False: the kernel reads the 1-byte tiles and
      converts each in registers. None: `widens_float8` decides.
  """

  block_q: int = 128
  block_kv: int = 64
  block_q_dkv: int = 32
  block_kv_dkv: int = 128
  block_q_dq: int = 128
  block_kv_dq: int = 32
  num_warps: int = 4
  num_stages: int = 2
  num_warps_bwd: int | None = None
  num_stages_bwd: int | None = None
  widen_float8: bool | None = None

  def __post_init__(self):
    name = type(self).__name__
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.name == "widen_float8":
        if value is not None and not isinstance(value, bool):
          raise ValueError(
              f"{name}.{f.name} must be True, False or None, got {value!r}.")
        continue
      if value is None and f.name.endswith("_bwd"):
        continue
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(
            f"{name}.{f.name} must be an int, got {value!r}.")
      if f.name.startswith("block_") and not (
          _is_power_of_2(value) and MIN_BLOCK <= value <= MAX_BLOCK
      ):
        raise ValueError(
            f"{name}.{f.name} must be a power of two in "
            f"[{MIN_BLOCK}, {MAX_BLOCK}], got {value!r}."
        )
      if f.name.startswith("num_warps") and value not in _WARPS:
        raise ValueError(
            f"{name}.{f.name} must be one of {_WARPS}, got {value!r}.")
      if f.name.startswith("num_stages") and not 1 <= value <= 8:
        raise ValueError(
            f"{name}.{f.name} must be in [1, 8], got {value!r}.")

  @property
  def backward_warps(self) -> int:
    return self.num_warps_bwd or self.num_warps

  @property
  def backward_stages(self) -> int:
    return self.num_stages_bwd or self.num_stages


def heuristic_block_sizes(
    *, q_len: int, kv_len: int, head_dim: int, dtype, is_causal: bool = False,
    dropout: bool = False, device_kind: str | None = None,
    value_head_dim: int | None = None,
) -> TritonBlockSizes:
  """The heuristic tiling of a call, ignoring tuned records.

  FlashAttention-2 tiles per head dim, dtype and GPU (read off ptxas so that
  none spills), shrunk until the software pipeline fits shared memory.

  Args:
    q_len: T (tiles are clipped to it when the kernels run).
    kv_len: S (likewise).
    head_dim: H, unpadded.
    dtype: the input dtype.
    is_causal: whether the call is causal (the heuristic does not care).
    dropout: whether the call has attention dropout.
    device_kind: a `jax.Device.device_kind`; None: the GPU the kernels are
      built for (`pallas_fa.gpu_target`), else "cpu".
    value_head_dim: Hv, unpadded; None: H.

  Returns:
    A `TritonBlockSizes`.
  """
  del q_len, kv_len, is_causal
  kind = tuning.device_kind() if device_kind is None else device_kind
  hp = layout.padded_head_dim(head_dim, ALIGN)
  hvp = layout.padded_head_dim(value_head_dim or head_dim, ALIGN)
  bs = TritonBlockSizes(
      **tiles.heuristic(hp, hvp, jnp.dtype(dtype).itemsize, kind))
  return tiles.for_dropout(bs, dropout)


def default_block_sizes(
    *, q_len: int, kv_len: int, head_dim: int, dtype, is_causal: bool = False,
    dropout: bool = False, device_kind: str | None = None,
    value_head_dim: int | None = None,
) -> TritonBlockSizes:
  """The tiling of a call made without `block_sizes=`.

  The tuned record nearest to the call (`pallas_fa.tuning`), else
  `heuristic_block_sizes`, whose arguments these are.

  Returns:
    A `TritonBlockSizes`.
  """
  bs = tuning.tuned_or_heuristic(
      "triton", TritonBlockSizes, heuristic_block_sizes, q_len=q_len,
      kv_len=kv_len, head_dim=head_dim, dtype=dtype, is_causal=is_causal,
      dropout=dropout, device_kind=device_kind, value_head_dim=value_head_dim)
  # Records are tuned without dropout.
  return tiles.for_dropout(bs, dropout)


def _interpret() -> bool:
  """Interpret on CPU, unless building for a GPU (`gpu_target`)."""
  return gpu_target.current() is None


# ----------------------------------------------------------------------------
# Static description of a call, shared by the three kernels.


# The kernels' static parameters (`_Padded` builds them).
_Features = kernel.Features


def _full_axes(x) -> tuple[bool, bool, bool, bool] | None:
  return None if x is None else tuple(d > 1 for d in x.shape)


def tile_bounds(kinds: Array) -> Array:
  """Loop bounds from tile kinds [..., n] -> int32 [..., 4].

  (lo, full_lo, full_hi, hi): [lo, hi) spans the non-empty tiles and
  [full_lo, full_hi) is the run of FULL tiles inside it when those are
  contiguous (otherwise it is empty and every tile is masked).
  """
  lo, hi = masking.block_range(kinds)
  full_lo, full_hi = masking.full_run(kinds, hi)
  return jnp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(jnp.int32)


def tile_lists(kinds: Array) -> Array:
  """Per row of tile kinds [..., n], the tiles a program visits, int32
  [..., w] (w the power of two >= 2 + n, for Triton's block shapes):
  (number FULL, number PARTIAL, then `masking.visit_order`'s list: the FULL
  tiles ascending, the PARTIAL ones ascending, the rest, padding)."""
  n = kinds.shape[-1]
  width = 1 << (2 + n - 1).bit_length()
  order, n_full, n_part = masking.visit_order(kinds)
  out = jnp.concatenate([n_full, n_part, order], axis=-1)
  pad = [(0, 0)] * (kinds.ndim - 1) + [(0, width - out.shape[-1])]
  return jnp.pad(out, pad)


def _mask_reads_head(info) -> bool:
  """Whether a mask_mod's tiles can differ between query heads."""
  if info.block_mask is not None:
    return info.block_mask.heads > 1
  return mods.uses_batch_and_head(
      mods.MASK_MOD, info.mask_mod, info.mask_mod_args)[1]


# ----------------------------------------------------------------------------
# Inputs padded to whole tiles.


class _Padded(layout.Padded):
  """q/k/v, bias, mask and MaskInfo padded to [Tp, Sp] and head dim Hp."""

  def __init__(self, q, k, v, bias, info, params, tp, sp):
    super().__init__(q, k, v, bias, info, q_len=tp, kv_len=sp, align=ALIGN)
    self.mask = None
    if self.info.mask is not None:
      # Triton loads bytes, not i1: keep the mask as int8 in memory.
      self.mask = self.info.mask.astype(jnp.int8)
    score_mod, mask_mod = fused_mods.split_call(info, "triton", tables=True)
    self.mod_kinds = None
    if mask_mod is not None:
      self.mod_kinds = functools.partial(
          block_mask_lib.tile_kinds, info, batch=self.b, heads=self.n,
          q_len=self.t, kv_len=self.s)
    self.feat = _Features(
        scale=float(params.scale),
        soft_cap=params.soft_cap,
        is_causal=self.info.is_causal,
        window=self.info.window,
        segments=self.info.has_segments,
        mask=_full_axes(self.mask),
        bias=_full_axes(self.bias),
        groups=self.g,
        precision=params.precision,
        dropout_rate=self.info.dropout_rate,
        score_mod=score_mod,
        mask_mod=mask_mod,
        lists_per_head=mask_mod is not None and _mask_reads_head(info),
    )

  def kinds(self, block_q, block_kv):
    """Tile kinds [B, nq, nk] of the built-in masks; with a mask_mod,
    [B, N|1, nq, nk] of their intersection with it."""
    kinds = masking.classify_blocks(self.info, block_q, block_kv)
    if self.mod_kinds is None:
      return kinds
    mod = self.mod_kinds(block_q=block_q, block_kv=block_kv,
                         num_blocks=kinds.shape[1:])
    if not self.feat.builtin_mask:
      return mod
    return masking.intersect_kinds(kinds[:, None], mod)

  def lists(self, block_q, block_kv, *, transpose=False):
    """`tile_lists` of a mask_mod call, [B, N|1, rows, width]."""
    kinds = self.kinds(block_q, block_kv)
    if transpose:
      kinds = jnp.swapaxes(kinds, -1, -2)
    return tile_lists(jnp.broadcast_to(
        kinds, (self.b,) + kinds.shape[1:]))


def _grouped(x, num_kv):
  """[B|1, N|1, T|1, S|1] -> [B|1, K|1, G|1, T|1, S|1]."""
  return masking.group_heads(x, num_kv)


def pallas_call(kernel_fn, inputs, outputs, grid, warps, stages, name):
  """pallas_call over named (array, BlockSpec) inputs and outputs, with
  the Triton compiler parameters and interpret mode of this backend (the
  decode kernel, `decode`, launches through it too).

  The kernel receives one dict of refs, so optional inputs (positions,
  segment ids, mask, bias) are simply absent rather than positional Nones.
  """
  in_names = [key for key, val in inputs.items() if val is not None]
  out_names = list(outputs)

  def body(*refs):
    kernel_fn(dict(zip(in_names + out_names, refs, strict=True)))

  return pl.pallas_call(
      body,
      grid=grid,
      in_specs=[inputs[key][1] for key in in_names],
      out_specs=[outputs[key][1] for key in out_names],
      out_shape=manual_axes.out_structs(
          [outputs[key][0] for key in out_names],
          [inputs[key][0] for key in in_names]),
      compiler_params=_CompilerParams(num_warps=warps, num_stages=stages),
      interpret=_interpret(),
      name=name,
  )(*[inputs[key][0] for key in in_names])


def block_spec(block_shape, index_map):
  """A BlockSpec whose None dims are squeezed (the kernel sees no axis)."""
  block_shape = tuple(_SQUEEZED if d is None else d for d in block_shape)
  return pl.BlockSpec(block_shape, index_map)


def _dense_block(x, full, rows: int, cols: int):
  """Block shape of a [B|1, N|1, T|1, S|1] array for a (row, col) tile."""
  return (None, None, rows if full[2] else 1, cols if full[3] else 1)


def _dense_index(full, b, n, i, j):
  return (b if full[0] else 0, n if full[1] else 0,
          i if full[2] else 0, j if full[3] else 0)


def _block_sizes(params, q, k, v, bias, info) -> TritonBlockSizes:
  """The call's tiling (`vjp.Backend.block_sizes`); a default one adapted
  to flex attention (`tiles.for_flex`) and to a dense bias or mask's tiles
  (`tiles.for_dense_tiles`)."""
  bs = BACKEND.block_sizes(params, q, k, info, v=v)
  if params.block_sizes is None:
    score_mod = None
    if info.score_mod is not None:
      score_mod = fused_mods.split(mods.SCORE_MOD, info.score_mod,
                                   info.score_mod_args, "triton", tables=True)
    bs = tiles.for_flex(
        bs, info.has_flex, head_dim=max(q.shape[-1], v.shape[-1]),
        tables=score_mod is not None and score_mod.has_tables)
    dense = (0 if bias is None else jnp.dtype(bias.dtype).itemsize) + (
        0 if info.mask is None else 1)  # The mask loads as int8.
    bs = tiles.for_dense_tiles(
        bs, head_dim=q.shape[-1], value_head_dim=v.shape[-1],
        itemsize=jnp.dtype(q.dtype).itemsize, dense_itemsize=dense,
        kind=tuning.device_kind())
  return bs


# ----------------------------------------------------------------------------
# Forward.


def widens_float8(q_len: int, block_sizes=None, target=None) -> bool:
  """Whether a float8 forward widens its inputs to float16 in XLA
  (`TritonBlockSizes.widen_float8`, where set).

  Where the products read their right operand from shared memory (wgmma,
  compute capability 9.0 on), a tile converted in registers must be
  stored back there before each product, outside the software pipeline:
  the H200 ran that kernel at 0.64x the bfloat16 one (293.6 TFLOP/s at
  T = 16384). Widening once costs 3 bytes an element of q, k and v (one
  read, one write) and doubles the kernel's reads of K and V, which a
  compute-bound kernel does not notice: per head it is about 190 / T of
  the kernel's time at the H200's rates, so from `WIDEN_FLOAT8_MIN_QUERIES`
  on. Older GPUs (mma.sync) hold both operands in registers and keep the
  1-byte reads.
  """
  if block_sizes is not None and block_sizes.widen_float8 is not None:
    return block_sizes.widen_float8
  capability = _capability(gpu_target.current() if target is None
                           else target)
  return (capability is not None and capability >= (9, 0)
          and q_len >= WIDEN_FLOAT8_MIN_QUERIES)


# `widens_float8`: from here on the widening costs under a fifth of the
# kernel's time.
WIDEN_FLOAT8_MIN_QUERIES = 1024


def _forward(q, k, v, bias, info, params, scales=None):
  if scales is not None and widens_float8(q.shape[1], params.block_sizes):
    # float16 holds every float8 value: the kernel's conversions become
    # no-ops and its tiles those of a 16-bit call (`_block_sizes`).
    q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
  bs = _block_sizes(params, q, k, v, bias, info)
  b, t, n, h = q.shape
  s = k.shape[1]
  bq, tp = layout.tile(bs.block_q, t, ALIGN)
  bk, sp = layout.tile(bs.block_kv, s, ALIGN)
  x = _Padded(q, k, v, bias, info, params, tp, sp)
  feat, hp, hvp, g = x.feat, x.hp, x.hvp, x.g
  fp8_inputs = {}
  if scales is not None:
    fp8, fp8_inputs = _fp8_inputs(x, scales, params)
    feat = x.feat = dataclasses.replace(feat, fp8=fp8)
  nq, nk = x.tp // bq, x.sp // bk
  # Heavier (later, for causal) query blocks first: less tail imbalance.
  if info.is_causal:
    def row(i):
      return nq - 1 - i
  else:
    def row(i):
      return i

  inputs = {
      "q": (x.q, block_spec((None, bq, None, hp),
                            lambda i, h, b: (b, row(i), h, 0))),
      "k": (x.k, block_spec((None, x.sp, None, hp),
                            lambda i, h, b: (b, 0, h // g, 0))),
      "v": (x.v, block_spec((None, x.sp, None, hvp),
                            lambda i, h, b: (b, 0, h // g, 0))),
      "bounds": None,
      "q_pos": None, "kv_pos": None, "q_seg": None, "kv_seg": None,
      "mask": None, "bias": None,
  }
  _add_tile_inputs(inputs, x, feat, bq, bk, row)
  _add_row_col_inputs(inputs, x, feat, bq, x.sp, row, lambda i: 0)
  _add_dense_inputs(inputs, x, feat, bq, x.sp, row, lambda i: 0)
  _add_mod_inputs(inputs, x, feat, bq, row)
  _add_fp8_inputs(inputs, fp8_inputs, x, bq, row)
  outputs = {
      "out": (jax.ShapeDtypeStruct((b, x.tp, n, hvp),
                                   params.out_dtype or q.dtype),
              block_spec((None, bq, None, hvp),
                         lambda i, h, b: (b, row(i), h, 0))),
      "lse": (jax.ShapeDtypeStruct((b, n, x.tp), _F32),
              block_spec((None, None, bq), lambda i, h, b: (b, h, row(i)))),
  }
  _add_dropout_seed(inputs, x)
  body = functools.partial(
      kernel.forward, feat=feat, block_k=bk, num_tiles=nk,
      reverse_rows=info.is_causal)
  out, lse = pallas_call(body, inputs, outputs, (nq, n, b),
                         bs.num_warps, bs.num_stages, "flash_fwd")
  return out[:, :t, :, :x.hv], lse[:, :, :t].transpose(0, 2, 1)


def _per_query_head(scale, x):
  """A per-program scale of the K/V heads [B|1, 1, K|1] -> [B, N, 1]."""
  return x.per_query_head(scale).transpose(0, 2, 1)


def _fp8_inputs(x, scales, params):
  """(`kernel.Fp8`, the kernel's scale inputs) of a float8 call.

  `q_scale` [B, N, Tp | 1]: the query's scale (per row, or one per
  program), times the key's when that is one per program, times the
  logit scale and log2(e) when nothing acts between them and the
  softmax (then positive, its sign folded into `x.q`:
  `kernel.Fp8.exponent_scale`); `k_scale` [B, K, Sp] the key's per key;
  `v_scale` [B, K, Sp] the value's per key over their largest magnitude
  (per batch row and K/V head), that magnitude or the value's one scale
  then `o_scale` [B, N, 1].
  """
  q_scale, k_scale, v_scale = scales
  feat = x.feat
  q_rows, k_cols, v_cols = (sc.shape[1] > 1 for sc in scales)
  folded = (feat.soft_cap is None and feat.bias is None
            and feat.score_mod is None)
  factor = params.scale * _LOG2_E if folded else 1.0
  q_factor = q_scale * factor
  if not k_cols:  # One per program: into the query's.
    q_factor = q_factor * x.per_query_head(k_scale)
  inputs = {}
  if q_rows:
    inputs["q_scale"] = x.scale_rows(q_factor, queries=True)
  else:
    inputs["q_scale"] = jnp.broadcast_to(
        q_factor, (x.b, 1, x.n)).astype(_F32).transpose(0, 2, 1)
  if folded and not k_cols:
    inputs["q_scale"] = _positive_factors(x, inputs["q_scale"])
  if k_cols:
    inputs["k_scale"] = x.scale_rows(k_scale, queries=False)
  if v_cols:
    v_scale = x.scale_rows(v_scale, queries=False)
    # The largest magnitude: each ratio then lies in [-1, 1], so P times
    # it stays within float16 whatever the scales' signs.
    largest = jnp.abs(v_scale).max(axis=2, keepdims=True)  # [B, K, 1]
    largest = jnp.where(largest > 0, largest, 1.0)
    inputs["v_scale"] = v_scale / largest
    inputs["o_scale"] = _per_query_head(largest.transpose(0, 2, 1), x)
  else:
    inputs["o_scale"] = _per_query_head(v_scale.astype(_F32), x)
  dtypes = (x.q.dtype, x.k.dtype, x.v.dtype)
  f16, e4m3 = jnp.dtype(jnp.float16), jnp.dtype(jnp.float8_e4m3fn)
  qk_dtype = pv_dtype = f16  # Holds every float8 value (`kernel`).
  if kernel.FLOAT8_OPERANDS:
    if dtypes[0] == dtypes[1]:
      qk_dtype = dtypes[0]
    if dtypes[2] == e4m3 and not v_cols:
      pv_dtype = e4m3
  fp8 = kernel.Fp8(
      qk_dtype=qk_dtype, pv_dtype=pv_dtype, q_rows=q_rows, k_cols=k_cols,
      v_cols=v_cols, folded=folded,
      offset=kernel.p_offset(pv_dtype, feat.dropout_rate))
  return fp8, inputs


def _positive_factors(x, factors):
  """A float8 call's row factors [B, N, Tp | 1] -> their magnitudes, the
  signs multiplied into the queries `x.q` (exact in float8 and float16),
  so that the factor can ride in the exponent (`kernel.Fp8.
  exponent_scale`). A zero factor (all its logits 0) zeroes its queries'
  rows and becomes 1: the logits stay 0 and a masked one -inf (0 * -inf
  in the exponent would be NaN)."""
  sign = jnp.sign(factors).transpose(0, 2, 1)[..., None]  # [B, Tp|1, N, 1]
  x.q = (x.q.astype(_F32) * sign).astype(x.q.dtype)
  return jnp.where(factors == 0, 1.0, jnp.abs(factors))


def _add_fp8_inputs(inputs, fp8_inputs, x, bq, row):
  """A float8 call's scales (`_fp8_inputs`) for the forward's grid."""
  g = x.g
  for name, arr in fp8_inputs.items():
    if name in ("k_scale", "v_scale"):  # [B, K, Sp], sliced per tile.
      spec = block_spec((None, None, x.sp), lambda i, h, b: (b, h // g, 0))
    elif arr.shape[-1] > 1:  # Per query row: the program's rows.
      spec = block_spec((None, None, bq), lambda i, h, b: (b, h, row(i)))
    else:
      spec = block_spec((None, None, 1), lambda i, h, b: (b, h, 0))
    inputs[name] = (arr, spec)


def _add_row_col_inputs(inputs, x, feat, rows, cols, row, col):
  """Positions / segment ids, blocked per program for grids (r, head, b)."""
  pairs = []
  if feat.positions:
    pairs.append(("pos", x.info.q_positions, x.info.kv_positions))
  if feat.segments:
    pairs.append(("seg", x.info.q_segment_ids, x.info.kv_segment_ids))
  for name, q_arr, kv_arr in pairs:
    inputs["q_" + name] = (
        q_arr, block_spec((None, rows), lambda r, h, b: (b, row(r))))
    inputs["kv_" + name] = (
        kv_arr, block_spec((None, cols), lambda r, h, b: (b, col(r))))


def _add_dropout_seed(inputs, x):
  if x.info.has_dropout:
    seed = jnp.asarray(x.info.dropout_seed, jnp.uint32).reshape(1)
    inputs["seed"] = (seed, block_spec((1,), lambda *_: (0,)))


def _add_dense_inputs(inputs, x, feat, rows, cols, row, col):
  """Mask / bias for the query-head grids (forward, dQ)."""
  for name, arr, full in (("mask", x.mask, feat.mask),
                          ("bias", x.bias, feat.bias)):
    if arr is None:
      continue
    inputs[name] = (arr, block_spec(
        _dense_block(arr, full, rows, cols),
        lambda r, h, b, full=full: _dense_index(full, b, h, row(r), col(r))))


def _residuals(x, mod):
  """The residuals of a split score_mod/mask_mod (`fused_mods`) for the
  padded call, in order; bool ones as int8 (Triton loads bytes), tables
  [Bm, Hm, size] padded to `kernel.table_width`."""
  args = (x.info.score_mod_args if mod.is_score_mod
          else x.info.mask_mod_args)
  arrays = mod.residual_arrays(
      args, batch=x.b, heads=x.n, q_len=x.t, kv_len=x.s, q_padded=x.tp,
      kv_padded=x.sp)
  out = []
  for r, a in zip(mod.residuals, arrays):
    if r.size is not None:
      pad = kernel.table_width(r.size) - r.size
      a = jnp.pad(a, ((0, 0), (0, 0), (0, pad)))
    out.append(a.astype(jnp.int8) if a.dtype == jnp.bool_ else a)
  return out


def _mods(feat):
  return [m for m in (feat.score_mod, feat.mask_mod) if m is not None]


def _add_mod_inputs(inputs, x, feat, rows, row):
  """Flex residuals for the query-major grids (row block, head, batch):
  per program [1] (a table: its [width]), per query the program's [rows],
  per key all of them."""
  level = fused_mods.Level
  for mod in _mods(feat):
    for i, (r, arr) in enumerate(zip(mod.residuals, _residuals(x, mod))):
      if r.size is not None:
        block, at = arr.shape[-1], lambda q: 0
      elif r.level == level.PROGRAM:
        arr, block, at = arr[..., None], 1, lambda q: 0
      elif r.level == level.ROW:
        block, at = rows, row
      else:
        block, at = x.sp, lambda q: 0
      inputs[kernel.residual_name(mod, i)] = (arr, block_spec(
          (None, None, block), lambda q, h, b, r=r, at=at: (
              b if r.batch else 0, h if r.head else 0, at(q))))


def _add_mod_inputs_dkv(inputs, x, feat, cols):
  """Flex residuals for the dK/dV grid (key block, kv head, batch), for
  every query head of the group: [G|1, 1] (a table: [G|1, width]),
  [G|1, Tp] or [G|1, cols]."""
  level = fused_mods.Level
  for mod in _mods(feat):
    for i, (r, arr) in enumerate(zip(mod.residuals, _residuals(x, mod))):
      if r.level == level.PROGRAM and r.size is None:
        arr = arr[..., None]
      # [Bm, Hm, L] -> [Bm, K|1, G|1, L]
      arr = arr.reshape(arr.shape[:1] + ((x.num_kv, x.g) if r.head
                                         else (1, 1)) + arr.shape[2:])
      width = {level.PROGRAM: arr.shape[-1], level.ROW: x.tp,
               level.COLUMN: cols}[r.level]
      column = r.level == level.COLUMN
      inputs[kernel.residual_name(mod, i)] = (arr, block_spec(
          (None, None, arr.shape[2], width),
          lambda j, h, b, r=r, column=column: (
              b if r.batch else 0, h if r.head else 0, 0,
              j if column else 0)))


def _add_tile_inputs(inputs, x, feat, bq, bk, row):
  """The tiles a query-major program visits: "lists" with a mask_mod
  (`tile_lists`), else "bounds" when anything is masked."""
  if feat.mask_mod is not None:
    lists = x.lists(bq, bk)  # [B, N|1, nq, w]
    inputs["lists"] = (lists, block_spec(
        (None, None, None, lists.shape[-1]),
        lambda i, h, b, per_head=lists.shape[1] > 1: (
            b, h if per_head else 0, row(i), 0)))
  elif feat.masked:
    inputs["bounds"] = (
        tile_bounds(x.kinds(bq, bk)),
        block_spec((None, None, 4), lambda i, h, b: (b, row(i), 0)))


# ----------------------------------------------------------------------------
# Backward.


def _backward(q, k, v, bias, info, params, lse, dout, delta):
  bs = _block_sizes(params, q, k, v, bias, info)
  b, t, n, h = q.shape
  s, num_kv = k.shape[1], k.shape[2]
  bq_kv, _ = layout.tile(bs.block_q_dkv, t, ALIGN)
  bk_kv, _ = layout.tile(bs.block_kv_dkv, s, ALIGN)
  bq_q, _ = layout.tile(bs.block_q_dq, t, ALIGN)
  bk_q, _ = layout.tile(bs.block_kv_dq, s, ALIGN)
  x = _Padded(q, k, v, bias, info, params, layout.padded_length(t, bq_kv, bq_q),
              layout.padded_length(s, bk_kv, bk_q))
  feat, hp, hvp, g = x.feat, x.hp, x.hvp, x.g
  do = x.queries(dout.astype(q.dtype))  # [B, Tp, N, Hvp]
  # lse in base 2 for exp2; padded rows -inf (probability 0).
  lse2 = x.rows(lse * _LOG2_E, online_softmax.MASK_VALUE)  # [B, N, Tp]
  delta = x.rows(delta.astype(_F32), 0.0)
  warps, stages = bs.backward_warps, bs.backward_stages

  # dK/dV: grid (key blocks, kv heads, batch), loop over group x query tiles.
  nq, nk = x.tp // bq_kv, x.sp // bk_kv
  inputs = {
      "k": (x.k, block_spec((None, bk_kv, None, hp),
                            lambda j, h, b: (b, j, h, 0))),
      "v": (x.v, block_spec((None, bk_kv, None, hvp),
                            lambda j, h, b: (b, j, h, 0))),
      "q": (x.q, block_spec((None, x.tp, g, hp), lambda j, h, b: (b, 0, h, 0))),
      "do": (do, block_spec((None, x.tp, g, hvp),
                            lambda j, h, b: (b, 0, h, 0))),
      "lse": (lse2, block_spec((None, g, x.tp), lambda j, h, b: (b, h, 0))),
      "delta": (delta, block_spec((None, g, x.tp), lambda j, h, b: (b, h, 0))),
      "bounds": None,
  }
  if feat.mask_mod is not None:
    lists = x.lists(bq_kv, bk_kv, transpose=True)  # [B, N|1, nk, w]
    lists = lists.reshape(lists.shape[:1] + (
        (num_kv, g) if lists.shape[1] > 1 else (1, 1)) + lists.shape[2:])
    inputs["lists"] = (lists, block_spec(
        (None, None, lists.shape[2], None, lists.shape[-1]),
        lambda j, h, b, per_head=lists.shape[1] > 1: (
            b, h if per_head else 0, 0, j, 0)))
  elif feat.masked:
    kinds = jnp.swapaxes(x.kinds(bq_kv, bk_kv), 1, 2)  # [B, nk, nq]
    inputs["bounds"] = (
        tile_bounds(kinds),
        block_spec((None, None, 4), lambda j, h, b: (b, j, 0)))
  _add_row_col_inputs(inputs, x, feat, x.tp, bk_kv, lambda j: 0,
                      lambda j: j)
  _add_mod_inputs_dkv(inputs, x, feat, bk_kv)
  for name, arr, full in (("mask", x.mask, feat.mask),
                          ("bias", x.bias, feat.bias)):
    if arr is None:
      continue
    arr = _grouped(arr, num_kv)  # [B|1, K|1, G|1, Tp|1, Sp|1]
    block = (None, None, g if full[1] else 1,
             x.tp if full[2] else 1, bk_kv if full[3] else 1)
    inputs[name] = (arr, block_spec(
        block,
        lambda j, h, b, full=full: (b if full[0] else 0, h if full[1] else 0,
                                    0, 0, j if full[3] else 0)))
  outputs = {
      "dk": (jax.ShapeDtypeStruct((b, x.sp, num_kv, hp), k.dtype),
             block_spec((None, bk_kv, None, hp), lambda j, h, b: (b, j, h, 0))),
      "dv": (jax.ShapeDtypeStruct((b, x.sp, num_kv, hvp), v.dtype),
             block_spec((None, bk_kv, None, hvp),
                        lambda j, h, b: (b, j, h, 0))),
  }
  _add_dropout_seed(inputs, x)
  body = functools.partial(
      kernel.backward_dkv, feat=feat, block_q=bq_kv, num_tiles=nq)
  dk, dv = pallas_call(body, inputs, outputs, (nk, num_kv, b), warps,
                       stages, "flash_bwd_dkv")

  # dQ (and dbias): grid (query blocks, query heads, batch).
  nq, nk = x.tp // bq_q, x.sp // bk_q
  inputs = {
      "q": (x.q, block_spec((None, bq_q, None, hp),
                            lambda i, h, b: (b, i, h, 0))),
      "do": (do, block_spec((None, bq_q, None, hvp),
                            lambda i, h, b: (b, i, h, 0))),
      "lse": (lse2, block_spec((None, None, bq_q), lambda i, h, b: (b, h, i))),
      "delta": (delta, block_spec((None, None, bq_q),
                                  lambda i, h, b: (b, h, i))),
      "k": (x.k, block_spec((None, x.sp, None, hp),
                            lambda i, h, b: (b, 0, h // g, 0))),
      "v": (x.v, block_spec((None, x.sp, None, hvp),
                            lambda i, h, b: (b, 0, h // g, 0))),
      "bounds": None,
  }
  _add_tile_inputs(inputs, x, feat, bq_q, bk_q, lambda i: i)
  _add_row_col_inputs(inputs, x, feat, bq_q, x.sp, lambda i: i,
                      lambda i: 0)
  _add_dense_inputs(inputs, x, feat, bq_q, x.sp, lambda i: i, lambda i: 0)
  _add_mod_inputs(inputs, x, feat, bq_q, lambda i: i)
  outputs = {
      "dq": (jax.ShapeDtypeStruct((b, x.tp, n, hp), q.dtype),
             block_spec((None, bq_q, None, hp), lambda i, h, b: (b, i, h, 0))),
  }
  db = feat.bias
  if db is not None:
    # [B, N, Tp | query blocks, Sp | 1]: reduced outside over what the
    # kernel cannot (batch, heads, query blocks) -- no atomics.
    db_shape = (b, n, x.tp if db[2] else nq, x.sp if db[3] else 1)
    db_block = (None, None, bq_q if db[2] else 1, x.sp if db[3] else 1)
    outputs["dbias"] = (jax.ShapeDtypeStruct(db_shape, _F32),
                        block_spec(db_block, lambda i, h, b: (b, h, i, 0)))
  score_mod = feat.score_mod
  differentiable = [] if score_mod is None else [
      r for r in score_mod.residuals if r.differentiable]
  for i, r in enumerate(differentiable):
    # Per program, one partial sum (a table's: a partial table): reduced
    # outside, no atomics.
    width = 1 if r.size is None else kernel.table_width(r.size)
    outputs[f"d{score_mod.name}.{i}"] = (
        jax.ShapeDtypeStruct((b, n, nq, width), _F32),
        block_spec((None, None, None, width),
                   lambda i, h, b: (b, h, i, 0)))
  _add_dropout_seed(inputs, x)
  body = functools.partial(
      kernel.backward_dq, feat=feat, block_k=bk_q, num_tiles=nk)
  results = pallas_call(body, inputs, outputs, (nq, n, b), warps, stages,
                        "flash_bwd_dq")
  dargs = None
  if score_mod is not None:  # Per program, [B, N, nq, 1 | width].
    partials = results[len(results) - len(differentiable):]
    dargs = score_mod.args_grad_from_partials(
        x.info.score_mod_args,
        [d[..., 0] if r.size is None else d[..., :r.size]
         for d, r in zip(partials, differentiable)], batch=b, heads=n)
  dq = results[0][:, :t, :, :h]
  dk, dv = dk[:, :s, :, :h], dv[:, :s, :, :x.hv]
  dbias = None
  if db is not None:
    dbias = results[1]
    dbias = dbias[:, :, :t] if db[2] else dbias.sum(axis=2, keepdims=True)
    dbias = dbias[:, :, :, :s] if db[3] else dbias
    if not db[0]:
      dbias = dbias.sum(axis=0, keepdims=True)
    if not db[1]:
      dbias = dbias.sum(axis=1, keepdims=True)
    dbias = dbias.astype(bias.dtype)
  if score_mod is not None:
    return dq, dk, dv, dbias, dargs
  return dq, dk, dv, dbias


def _check(q, k, v, bias, info, params):
  """Declines calls the Triton lowering cannot run here."""
  del params
  manual_axes.check_kernels("triton", q, k, v, bias, info,
                            interpreted=_interpret)
  platform = jax.default_backend()
  if platform not in ("cpu", "gpu", "cuda", "rocm"):
    raise NotImplementedError(
        f"the triton implementation needs a GPU (or CPU interpret mode), "
        f"not {platform=}.")
  if any(quantize.is_fp8(x.dtype) for x in (q, k, v)):
    target = gpu_target.current()
    capability = _capability(target)
    if capability is not None and capability < FP8_MIN_CAPABILITY:
      raise NotImplementedError(
          "the triton implementation's float8 forward needs compute "
          f"capability {'.'.join(map(str, FP8_MIN_CAPABILITY))} or above "
          "(Triton converts float8_e4m3fn from there on), got "
          f"{target.compute_capability} ({target.device_kind}).")
  # Declines what it cannot fuse.
  fused_mods.split_call(info, "triton", tables=True)


# Triton converts float8_e4m3fn (and runs float8 products) from compute
# capability 8.9 on.
FP8_MIN_CAPABILITY = (8, 9)


def _capability(target) -> tuple[int, int] | None:
  """(major, minor) of a CUDA target, None on CPU or when unknown."""
  if target is None:
    return None
  try:
    major, minor = target.compute_capability.split(".")
    return int(major), int(minor)
  except ValueError:
    return None


BACKEND = vjp.Backend(
    name="triton",
    forward=_forward,
    backward=_backward,
    check=_check,
    block_sizes_type=TritonBlockSizes,
    default_block_sizes=default_block_sizes,
    dtypes=(jnp.float32, jnp.bfloat16, jnp.float16) + quantize.FP8_DTYPES,
    value_head_dim=True,
    dropout=True,
)
