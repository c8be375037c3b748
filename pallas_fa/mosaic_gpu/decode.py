"""The decode kernel of `mosaic_gpu` (Hopper): split-KV over a KV cache.

Two kernels a step, as `triton.decode`: this split kernel and the merge
(`triton.decode_merge`, or with `pdl_merge` `mosaic_gpu.decode_merge`,
launched while this kernel runs). The split kernel runs on the
producer/consumer skeleton of `kernel`:

* units of work are (sequence, K/V head, split), dealt round-robin to at
  most one persistent CTA an SM; each unit finds its key blocks from the
  sequence's raw length and new-token positions in the kernel
  (`_SplitRuns`), so nothing runs before it;
* the producer warpgroup streams the split's key blocks (K, then V) by TMA
  through a `stages`-deep ring, running ahead across unit boundaries, so
  that an SM keeps `stages` x 2 x block x H x 2 bytes in flight (128 KiB at
  the defaults, H = 128) without waiting on the consumer;
* one consumer warpgroup (two with `num_warps=8`, each taking the ring
  slots of its parity and writing a partial of its own, `_walk`) holds
  the K/V head's G x T_new packed query rows (GQA packing,
  `decode.plan.packed`'s order) in a 64-row tile, wgmma's M, and runs
  Q K^T and P V on wgmma with the online softmax in registers, masking
  only the blocks at the split's edges (`kernel.phases`: the keys
  past the length, the causal bound and the window);
* each split's normalised result (float32, the packed rows rounded up to
  whole 8-row tiles) and its logsumexp go out by TMA.

A paged cache's blocks are read page by page through the block table (a
TMA a page where pages are narrower than a block, the block's rows of its
page where they are wider), a 1-byte cache's per-entry scales likewise.
A last block that would run past a contiguous cache reads the cache's
last `block` keys instead (no padded copy of the cache), masking those of
the block before; entries past a sequence's length may hold anything, NaN
included, so a block that reaches past it has those V rows zeroed in
shared memory before P V reads them (a masked P of 0 times NaN would be
NaN).

A 1-byte cache (int8, float8) streams as stored; the consumer widens
each K and V tile unscaled in shared memory to the products' 16-bit dtype
(`_widened`), which the products then read: int8 and float8 values are
exact in bfloat16 and float16. That dtype is the query's (int8 by a byte
permute and a subtraction a value pair), but float16 for a float8 cache
under bfloat16 queries whose scales are constant along it
(`product_dtypes`): float8 widens to float16 with one conversion a value
pair where bfloat16 needs three through float32, and the consumer copies
its query rows once a unit into float16, each row scaled by a power of
two into float16's range (`_float16_rows`, exact), whose inverse joins
the logits' factors. The scales multiply the logits and P instead of the
tiles: per-entry ones stream with the keys as a ring of their rows (every
K/V head's, a [block, K'] tile), and the unit's head's column of each
goes through shared memory once a block to lie along the tile's keys
(`_scale_columns`); scales constant along the cache (per tensor or per
K/V head) are one factor a unit, on the logits and on the result, with no
ring.

With `quantized_query` (`decode_attention(_quantized_query=True)`, an A/B
option while no GPU run has timed it) an int8 or float8_e4m3fn cache skips
the key widening: the consumer quantizes its packed query rows to the
cache's dtype once a unit, one scale a row (`_quantized_rows`:
`quantize`'s rounding, in the kernel, so that a call is still two
kernels), and Q K^T runs on 8-bit wgmma (int8 into int32, e4m3 into
float32) over the K tile as stored (8-bit wgmma wants both operands
K-major, which Q and K both are); the row scales join the logits'
factors, and without per-entry scales e4m3 V tiles widen to float16 (one
conversion a value pair) for a float16 P V. The query's rounding (to 8
bits for int8, 4 for e4m3) is the accuracy this trades, as in 8-bit
attention.

A latent (MLA) cache (`value_head_dim`: the values are the keys' first
Hv columns) streams its key tiles only, [64, H] a block (H = 576: 72 KiB),
two stages deep; the values P V reads are a column slice of the same ring
slot, released after P V. A [64, Hv] float32 accumulator would be 256
registers a thread, so each unit sums `LATENT_VALUE_CHUNK` value columns
(a [64, 256] accumulator): the units are (sequence, K/V head, value chunk,
split), the chunks of a split run on CTAs at once and read its key blocks
from HBM once between them (the second read from L2), each computing Q K^T
and the softmax (the tensor work of a 16-row call is padded to wgmma's 64
rows anyway). The result staging shares the query tile's shared memory
(a `plgpu.RefUnion`: the unit's last Q K^T has run when the staging is
written, and the next unit loads its rows once the staging's store has
read it).

Scope: a contiguous or paged cache of the query's 16-bit dtype or of 1
byte (pages of a multiple of 8 keys that divides or is a multiple of the
block; 1-byte pages of at least 64 keys past head dim 128) at head dims of
64, 128 or 256, a contiguous or paged latent cache of the query's dtype
(key head dim a multiple of 64 up to 576, Hv a multiple of 256 up to it;
its pages as any 16-bit cache's: a TMA a page), and at
least one block of keys; `decode.kernels` refuses the rest by name
(`supports`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa import gpu_target
from pallas_fa import layout
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import quantize
from pallas_fa.mosaic_gpu import decode_merge as mosaic_merge
from pallas_fa.mosaic_gpu import forward
from pallas_fa.mosaic_gpu import kernel
from pallas_fa.mosaic_gpu import ops as gpu_ops

_F32 = jnp.float32
_ROWS = online_softmax.queries_along(0)

# wgmma's M: a warpgroup's products run on 64 rows, so the packed query
# rows are padded to 64 in shared memory (the padding costs tensor-core
# time, which decode has to spare, not memory traffic).
TILE_ROWS = 64
# Keys per block and ring depth: 2 x 64 x H x 2 bytes a stage (32 KiB at
# H = 128) and four stages keep 128 KiB in flight an SM.
DEFAULT_BLOCK = 64
DEFAULT_STAGES = 4
# The rows' partial results are written in whole tiles of 8 rows (the
# shared-memory tiling of a float32 tile).
_ROW_TILE = 8
_SMEM_BYTES = 227 * 1024
# Where the split kernel's shared-memory refs sit (`_launch`): the packed
# rows, the result staging, the logsumexps, the K and V rings, and a 1-byte
# cache's scale rings, the consumers' scale columns and 1-byte query rows
# (placeholders where a call has no use for them).
_RING = 3
_KEY_SCALES = 5
# An H100's SMs, where the target does not say.
_DEFAULT_SMS = 132

# A decode module's interface to `decode.kernels`: 1-byte and latent caches
# (`supports` says which); a shared prefix's rows fold into one tile up to
# its 64 rows.
QUANTIZED_CACHES = True
LATENT_CACHES = True
MAX_FOLDED_ROWS = TILE_ROWS
# A latent unit's value columns (`decode.kernels.run` passes them as
# `max_value_chunk`): a [64, 256] float32 accumulator, 128 registers a
# thread.
LATENT_VALUE_CHUNK = 256
# A latent cache's widest key head dim: a 64-key block of it is 72 KiB, a
# ring of two beside the query tile (which the staging shares) fits shared
# memory.
LATENT_MAX_HEAD_DIM = 576
# Keys per block a caller may pick: wgmma's N of Q K^T, and whole 64-row
# tiles of V (the rows past a length are zeroed in the accumulator layout,
# `_zero_rows_past`).
BLOCKS = (64, 128)
# The head dims it reads, over any cache: P rounded to the products' dtype
# before the V tile is awaited leaves a [64, 256] float32 accumulator room
# without spilling (sm_90a, one consumer), and a 1-byte tile widens in
# [64, 128] parts (`_widened`; whole 256-column rows spilled 40-112 B).
HEAD_DIMS = (64, 128, 256)


def interpreted() -> bool:
  """Whether the kernel runs in the Mosaic GPU interpreter here (no GPU
  target): `decode.kernels`."""
  return gpu_target.current() is None


def stored_rows(rows: int) -> int:
  """Rows of a split's stored result: the packed rows in whole 8-row
  tiles (at most `TILE_ROWS`)."""
  return layout.round_up(rows, _ROW_TILE)


def supports(query, key, value, block_table, static) -> str | None:
  """Why the kernel cannot take a call (a sentence naming the argument),
  or None when it can."""
  _, t, n, h = query.shape
  target = gpu_target.current()
  if target is not None and target.major != 9:
    return (f"the GPU is sm{target.major}{target.minor}; the kernel runs on "
            "Hopper (sm90)")
  if target is None:
    if kernel.interpret_params() is None:
      return f"this jax ({jax.__version__}) has no Mosaic GPU interpreter"
    if kernel.cpu_client_threads() < 2:
      return ("the Mosaic GPU interpreter needs 2 CPU client threads at "
              "once (set NPROC=2 or more before jax starts)")
  if query.dtype not in (jnp.bfloat16, jnp.float16):
    return f"the query is {query.dtype}; it reads bfloat16 or float16"
  one_byte = key.dtype.itemsize == 1 and value.dtype.itemsize == 1
  if not one_byte and (key.dtype != query.dtype
                       or value.dtype != query.dtype):
    return (f"the cache is {key.dtype}/{value.dtype}; it reads a cache of "
            f"the query's dtype ({query.dtype}) or a 1-byte one")
  if static.get("quantized_query") and not (
      key.dtype == value.dtype
      and key.dtype in (jnp.int8, jnp.float8_e4m3fn)):
    return (f"_quantized_query is set and the cache is {key.dtype}/"
            f"{value.dtype}; it reads an int8 or float8_e4m3fn one")
  if block_table is not None:
    page = key.shape[1]
    if page % _ROW_TILE or not (page % DEFAULT_BLOCK == 0
                                or DEFAULT_BLOCK % page == 0):
      return (f"the page size is {page}; it reads pages of a multiple of "
              f"{_ROW_TILE} keys that divides or is a multiple of "
              f"{DEFAULT_BLOCK}")
    if one_byte and page < DEFAULT_BLOCK and max(h, value.shape[3]) > 128:
      # (16-key pages at 256 spilled 4-32 B: sm_90a, both jax versions.)
      return (f"the cache is 1-byte in {page}-key pages at head dim "
              f"{max(h, value.shape[3])}; past head dim 128 it reads "
              f"1-byte pages of at least {DEFAULT_BLOCK} keys")
  for name in ("score_mod", "mask_mod"):
    if static.get(name) is not None:
      return f"{name} is set"
  if static.get("value_head_dim") is not None:
    why = _latent_refusal(key, static)
    if why:
      return why
  else:
    hv = value.shape[3]
    for name, dim in (("head dim", h), ("value head dim", hv)):
      if dim not in HEAD_DIMS:
        return f"the {name} is {dim}; it takes 64, 128 or 256"
  if n // key.shape[2] * t > TILE_ROWS:
    return (f"G x T_new = {n // key.shape[2] * t} packed rows exceed "
            f"{TILE_ROWS}")
  if block_table is None and key.shape[1] < DEFAULT_BLOCK:
    return (f"the contiguous cache (or the shared prefix) holds "
            f"{key.shape[1]} entries, fewer than one {DEFAULT_BLOCK}-key "
            f"block")
  return None


def _latent_refusal(key, static) -> str | None:
  """Why the kernel cannot take a latent cache (`supports`), or None."""
  h, hv = key.shape[3], static["value_head_dim"]
  if key.dtype.itemsize == 1:
    return f"the latent cache is {key.dtype}; it reads 16-bit latent caches"
  if static.get("num_warps") == 8:
    return "num_warps=8 with a latent cache; it reads one with 4"
  if h % 64 or h > LATENT_MAX_HEAD_DIM:
    return (f"the latent cache's head dim is {h}; it takes a multiple of 64 "
            f"up to {LATENT_MAX_HEAD_DIM}")
  if hv % LATENT_VALUE_CHUNK:
    return (f"value_head_dim is {hv}; it takes a multiple of "
            f"{LATENT_VALUE_CHUNK}")
  return None


def latent_chunks(value_head_dim: int | None,
                  max_value_chunk: int | None = None) -> int:
  """Value chunks a split of a call (units of their own): 1 but for a
  latent cache (`value_head_dim`), `LATENT_VALUE_CHUNK` columns each
  unless `max_value_chunk` says."""
  if value_head_dim is None:
    return 1
  return value_head_dim // (max_value_chunk or LATENT_VALUE_CHUNK)


def check_block(block: int, cache_len: int) -> int:
  """A caller's `block_kv` (already clipped to the contiguous cache; a
  paged one takes none), checked."""
  if block not in BLOCKS or block > cache_len:
    raise ValueError(
        f"block_kv={block} is not a block of implementation='mosaic_gpu', "
        f"which reads {BLOCKS} keys a block (at most the cache's "
        f"{cache_len} entries).")
  return block


def product_dtypes(query_dtype, key_dtype, value_dtype, *,
                   quantized_query: bool = False,
                   scale_rings: bool = False, float16: bool = True):
  """(Q K^T's operand dtype, P V's) of a call: the query's, but

  * Q K^T on the 1-byte cache as stored with `quantized_query`;
  * float16 for both under bfloat16 queries over a float8 cache whose
    scales are constant along it (no `scale_rings`): its tiles widen to
    float16 with one conversion a value pair (to bfloat16 they go through
    float32, three), the query rows scaled into float16's range by a
    power of two a row (`_float16_rows`: exact but for entries 2^28 below
    the row's largest), P (at most 1) unscaled with 3 more mantissa bits
    than bfloat16's. P times per-entry value scales (`scale_rings`) could
    fall below float16's range, so those caches keep the query's dtype;
  * with `quantized_query`, float16 P V over an e4m3 value cache with no
    scale rings, as above.

  `float16=False` keeps the query's dtype where float16 would replace it
  (`decode_attention(_float16_products=False)`, the path it replaced).
  """
  query_dtype = jnp.dtype(query_dtype)
  float16_values = (float16 and query_dtype == jnp.bfloat16
                    and not scale_rings and quantize.is_fp8(value_dtype))
  if quantized_query:
    return (jnp.dtype(key_dtype),
            jnp.dtype(jnp.float16) if float16_values else query_dtype)
  if float16_values and quantize.is_fp8(key_dtype):
    return (jnp.dtype(jnp.float16),) * 2
  return query_dtype, query_dtype


def query_copy_itemsize(query_dtype, key_dtype, value_dtype,
                        **options) -> int:
  """Bytes an element of each consumer's copy of its query rows, the one
  Q K^T reads where its operands' dtype is not the query's
  (`product_dtypes`, `options` its keywords); 0 where it reads the rows
  as loaded (`smem_bytes`)."""
  qk_dtype, _ = product_dtypes(query_dtype, key_dtype, value_dtype,
                               **options)
  return 0 if qk_dtype == jnp.dtype(query_dtype) else qk_dtype.itemsize


def stages_for(head_dim: int, value_head_dim: int, block: int,
               cache_itemsize: int = 2, num_kv: int = 8,
               consumers: int = 1, query_copy_itemsize: int = 0,
               scale_rings: bool = True, latent: bool = False) -> int:
  """The deepest ring (at most `DEFAULT_STAGES`, at least 2; even with two
  consumers, which take the ring's slots of their parity) whose launch
  fits shared memory."""
  for stages in range(DEFAULT_STAGES, 2, -consumers):
    if smem_bytes(head_dim, value_head_dim, block, stages, cache_itemsize,
                  num_kv, consumers, query_copy_itemsize,
                  scale_rings, latent) <= _SMEM_BYTES:
      return stages
  return 2


def smem_bytes(head_dim: int, value_head_dim: int, block: int, stages: int,
               cache_itemsize: int = 2, num_kv: int = 8,
               consumers: int = 1, query_copy_itemsize: int = 0,
               scale_rings: bool = True, latent: bool = False) -> int:
  """Shared memory of a launch (`_launch`'s buffers, each aligned to 1 KiB
  by Mosaic GPU): each consumer's query tile, result staging and
  logsumexps, the K/V ring, and for a 1-byte cache the scales' rings
  (every K/V head's, `num_kv` padded to 8) and each consumer's scale
  columns where `scale_rings`, each consumer's copy of its query tile
  that Q K^T reads (`query_copy_itemsize` bytes an element,
  `product_dtypes`; a 1 KiB placeholder at 0), and each consumer's two
  widened tiles; and 1 KiB for the barriers. A `latent` cache
  (`value_head_dim` the unit's value chunk) has a K ring only (a 1 KiB
  placeholder for V's) and the staging in the query tile's memory."""
  def kib(x):
    return layout.round_up(x, 1024)

  staging = kib(consumers * TILE_ROWS * value_head_dim * 4)
  query = kib(consumers * TILE_ROWS * head_dim * 2)
  if latent:
    ring = stages * kib(block * head_dim * cache_itemsize) + 1024
    return (1024 + max(query, staging) + 1024
            + kib(consumers * TILE_ROWS * 4) + ring)
  ring = stages * (kib(block * head_dim * cache_itemsize)
                   + kib(block * value_head_dim * cache_itemsize))
  if cache_itemsize == 1:
    heads = layout.round_up(num_kv, _ROW_TILE)
    ring += (2 * kib(stages * block * heads * 4)
             + kib(consumers * 2 * block * 4)) if scale_rings else 3 * 1024
    query += (kib(consumers * TILE_ROWS * head_dim * query_copy_itemsize)
              if query_copy_itemsize else 1024)
    # Each consumer's union of its staging and its two widened tiles.
    staging = consumers * kib(max(
        TILE_ROWS * value_head_dim * 4,
        2 * block * max(head_dim, value_head_dim) * 2))
  return (1024 + query + staging + kib(consumers * TILE_ROWS * 4) + ring)


class _SplitRuns:
  """The schedule `kernel.produce` and `kernel.phases` read, indexed [b,
  split, i], computed in the kernel from the sequence's raw length and its
  new tokens' positions, as `triton.decode` does: nothing runs before the
  kernel. Entries: the split's key blocks [first, end) (`masking.
  decode_key_blocks`, `masking.split_run`) and the run of them that every
  new token sees whole, [flo, fhi) within it (run unmasked)."""

  def __init__(self, len_ref, qpos_ref, *, cache_len: int, block: int,
               splits: int, new_tokens: int, is_causal: bool, window):
    self.len_ref, self.qpos_ref = len_ref, qpos_ref
    self.cache_len, self.block, self.splits = cache_len, block, splits
    self.new_tokens, self.is_causal, self.window = (new_tokens, is_causal,
                                                    window)

  def length(self, b):
    """The sequence's length, clamped into the cache."""
    return jnp.clip(self.len_ref[b], 0, self.cache_len)

  def positions(self, b, tokens=None):
    """(each row's position (None without `tokens`), the smallest and
    largest new-token position): the `qpos` input's, or by default the
    last T_new positions below the raw length. `tokens`: int32 vector,
    each row's new token."""
    t = self.new_tokens
    if self.qpos_ref is None:
      first = self.len_ref[b] - t
      pos = None if tokens is None else first + tokens
      return pos, first, self.len_ref[b] - 1
    i32 = jnp.iinfo(jnp.int32)
    pos = None if tokens is None else jnp.zeros_like(tokens)
    lo, hi = jnp.int32(i32.max), jnp.int32(i32.min)
    for token in range(t):  # T_new <= 64: unrolled scalar reads.
      p = self.qpos_ref[b, token]
      lo, hi = jnp.minimum(lo, p), jnp.maximum(hi, p)
      if tokens is not None:
        pos = jnp.where(tokens == token, p, pos)
    return pos, lo, hi

  def __getitem__(self, index):
    b, split, i = index
    length = self.length(b)
    _, q_first, q_last = self.positions(b)
    window, causal, bk = self.window, self.is_causal, self.block
    lo, hi = masking.decode_key_blocks(length, q_first, q_last, block=bk,
                                       is_causal=causal, window=window)
    first, end = masking.split_run(lo, hi, self.splits, split)
    if i < 2:
      return (first, end)[i]
    whole_lo, whole_hi = masking.decode_whole_blocks(
        length, q_first, q_last, block=bk, is_causal=causal, window=window)
    flo = jnp.clip(whole_lo, first, end)
    return flo if i == 2 else jnp.clip(whole_hi, flo, end)


def _packed_rows(query, num_kv: int):
  """The queries [B, T_new, N, H] as the kernel reads them, [B * K * R, H]
  with R = G * T_new: row r of K/V head k of sequence b (at (b * K + k) *
  R + r) is new token r % T_new of query head k * G + r // T_new. T_new = 1
  is a reshape; more new tokens take the packing's transpose."""
  b, t, n, h = query.shape
  g = n // num_kv
  if t > 1:
    query = query.reshape(b, t, num_kv, g, h).transpose(0, 2, 3, 1, 4)
  return query.reshape(b * num_kv * g * t, h)


def attention(query, key, value, lengths, block_table, query_positions,
              sinks, *, block: int, splits: int, scale: float,
              is_causal: bool, local_window_size, logits_soft_cap,
              precision, key_scale=None, value_scale=None, num_warps=None,
              stages=None, num_ctas=None, quantized_query=False,
              float16_products=True, pdl_merge=False, value_head_dim=None,
              max_value_chunk=None, **unused):
  """`decode_attention(implementation="mosaic_gpu")`: the split kernel and
  the merge (`triton.decode_merge`, which adds the sinks and writes the
  query's dtype and layout), two kernels at T_new = 1.

  Args:
    query: [B, T_new, N, H], bf16/f16, G * T_new <= 64 (`supports`).
    key, value: the cache of the query's dtype, contiguous [B, S_max, K, H]
      / [.., Hv] or pages [P, page_size, K, H] with `block_table`.
    lengths: int [B] (clamped into the cache in the kernel).
    block_table: None or int [B, max_pages] (entries clamped into the
      pool in the kernel).
    query_positions: None (the last T_new below each length) or int [B,
      T_new].
    sinks: None or float32 [N].
    key_scale, value_scale: a 1-byte cache's float32 scales, rank 3 with
      each dim 1 or the cache's [B, S_max, K] (None: 1; a float8 cache may
      have none).
    block: keys per block; splits: parts of each sequence's visible keys.
    scale, is_causal, local_window_size, logits_soft_cap: the call's.
    precision: ignored (the products are 16-bit wgmma, float32 sums).
    num_warps: the consumer warps of a CTA, 4 (None: one warpgroup) or 8
      (two, each taking the ring's slots of its parity, so every other
      block of a unit, and writing a partial result of its own).
    stages: ring depth (None: `stages_for`); num_ctas: persistent CTAs
      (None: one an SM, at most one a unit).
    quantized_query: Q K^T on 8-bit wgmma over an int8 or float8_e4m3fn
      cache, the query rows quantized to its dtype (module doc).
    float16_products: False keeps the query's dtype for the products
      (`product_dtypes`' `float16`).
    pdl_merge: the merge as a Mosaic GPU kernel that the split kernel
      launches while it runs (`mosaic_gpu.decode_merge`, where it
      `applies` to the call's part count; else the Triton merge).
    value_head_dim: a latent cache's Hv (value is key; module doc), or
      None; max_value_chunk: its value columns a unit (None:
      `LATENT_VALUE_CHUNK`).

  Returns:
    (out [B, T_new, N, Hv] in the query's dtype, lse float32 [B, T_new, N]).
  """
  del precision, unused
  # Triton, lazily.
  from pallas_fa.triton import decode_merge as triton_merge  # noqa: PLC0415
  b, t, n, h = query.shape
  num_kv, hv = key.shape[2], value.shape[3]
  latent = value_head_dim is not None
  chunks = latent_chunks(value_head_dim, max_value_chunk)
  if latent:
    hv = value_head_dim
  s_max = key.shape[1] if block_table is None else (
      block_table.shape[1] * key.shape[1])
  g = n // num_kv
  r = g * t
  rows = stored_rows(r)
  consumers = 2 if num_warps == 8 else 1
  # Scales constant along the cache (per tensor or per K/V head) go to the
  # kernel as they are (`_launch`'s `head_scales`), in place of the
  # per-entry rings.
  # (A paged cache's scales are [P, page_size, K]: constant along it only
  # where both of its leading dims are 1.)
  along = (1,) if block_table is None else (0, 1)
  head_scales = None
  if (key_scale is not None or value_scale is not None) and all(
      x is None or all(x.shape[i] == 1 for i in along)
      for x in (key_scale, value_scale)):
    head_scales = tuple(
        jnp.ones((1, 1, 1), _F32) if x is None else x.astype(_F32)
        for x in (key_scale, value_scale))
    key_scale = value_scale = None
  scale_rings = key_scale is not None or value_scale is not None
  query_copy = query_copy_itemsize(
      query.dtype, key.dtype, value.dtype, quantized_query=quantized_query,
      scale_rings=scale_rings, float16=float16_products)
  # The V tile's columns: a latent unit's value chunk.
  hv_tile = hv // chunks
  stages = stages or stages_for(h, hv_tile, block, key.dtype.itemsize,
                                num_kv, consumers, query_copy, scale_rings,
                                latent)
  interpret = interpreted()
  q_rows = _packed_rows(query, num_kv)
  if interpret and rows > r:
    # The interpreter reads no rows past an array (the GPU's TMA reads
    # them as zeros): the last head's rounding rows, padded.
    q_rows = jnp.pad(q_rows, ((0, rows - r), (0, 0)))
  if num_ctas is None:
    target = gpu_target.current()
    num_ctas = 1 if interpret or target is None else (
        target.core_count or _DEFAULT_SMS)
  units = b * num_kv * chunks * splits
  spec = kernel.Spec(
      batch=b, q_len=TILE_ROWS, kv_len=s_max, num_heads=num_kv,
      num_kv_heads=num_kv, head_dim=h, value_head_dim=hv_tile,
      dtype=query.dtype,
      block_q=TILE_ROWS, block_kv=block, stages=stages, consumers=consumers,
      num_ctas=max(1, min(num_ctas, units)), pingpong=False,
      is_causal=is_causal, window=local_window_size, scale=scale,
      soft_cap=logits_soft_cap, interpret=interpret,
      # Lane semantics: the warpgroup lowering's layout inference finds no
      # layouts for this kernel (jax 0.11.2).
      lowering_semantics="lane")
  if not interpret:
    need = smem_bytes(h, hv_tile, block, stages, key.dtype.itemsize,
                      num_kv, consumers, query_copy, scale_rings, latent)
    if need > _SMEM_BYTES:
      raise ValueError(
          f"mosaic_gpu decode: block_kv={block} keys x {stages} stages at "
          f"head dims {h}/{hv} with num_warps={4 * consumers} need {need} "
          f"B of shared memory, more than {_SMEM_BYTES}; pass a smaller "
          "block_kv" + (" or num_warps=4." if consumers > 1 else "."))
  qpos = None if query_positions is None else query_positions.astype(
      jnp.int32)
  table = None if block_table is None else block_table.astype(jnp.int32)
  scales = None
  if scale_rings:
    # The key's and the value's scales, [B, S, K'] each as the cache's
    # entries are ([P, page_size, K'] for pages; the other's broadcast
    # where only one is per entry, K padded to K' = a multiple of 8, the
    # accumulator layout's columns): a block's [block, K'] rows go by TMA
    # (page by page as the cache's), each K/V head reads its column.
    heads = layout.round_up(num_kv, _ROW_TILE)
    entries = key.shape[:3]
    scales = tuple(
        jnp.pad(jnp.broadcast_to(jnp.ones((), _F32) if x is None else x,
                                 entries).astype(_F32),
                ((0, 0), (0, 0), (0, heads - num_kv)))
        for x in (key_scale, value_scale))
  pdl_merge = pdl_merge and mosaic_merge.applies(consumers * splits)
  out, lse = _launch(spec, q_rows, key, value, lengths.astype(jnp.int32),
                     qpos, table, scales, head_scales,
                     quantized_query=quantized_query,
                     float16_products=float16_products, splits=splits,
                     rows=r, new_tokens=t, pdl=pdl_merge,
                     latent_chunks=chunks if latent else 0)
  if sinks is not None:
    # Packed row r of K/V head k belongs to query head k * G + r // T.
    sinks = jnp.repeat(sinks.astype(_F32).reshape(num_kv, g), t, axis=1)
  if pdl_merge:
    out, lse = mosaic_merge.merge_splits(
        out, lse, sinks, parts=consumers * splits, dtype=query.dtype,
        value_head_dim=hv, real_rows=r, interpret=interpret)
  else:
    out, lse = triton_merge.merge_splits(
        out, lse, sinks, dtype=query.dtype, value_head_dim=hv, real_rows=r)
  if t == 1:
    return out.reshape(b, 1, n, hv), lse.reshape(b, 1, n)
  out = out.reshape(b, num_kv, g, t, hv).transpose(0, 3, 1, 2, 4)
  lse = lse.reshape(b, num_kv, g, t).transpose(0, 3, 1, 2)
  return out.reshape(b, t, n, hv), lse.reshape(b, t, n)


def _launch(spec: kernel.Spec, q_rows, key, value, lengths, qpos, table,
            scales, head_scales, *, quantized_query: bool,
            float16_products: bool, splits: int, rows: int,
            new_tokens: int, pdl: bool = False, latent_chunks: int = 0):
  """The split kernel: (out float32 [B, K, C * splits, stored_rows(rows),
  Hv], lse float32 [B, K, C * splits, stored_rows(rows)]), each split's
  normalised result and logsumexp (-inf: no visible key) from each of the
  C = `spec.consumers` consumers (part c * splits + split). `pdl`: the
  kernel lets its dependent (the PDL merge) launch while it runs
  (`kernel.depend_on_grid`), and the parts' axis is padded to that
  merge's whole tiles (`decode_merge.padded_parts`).

  A 1-byte cache (int8 or float8) streams as stored; the consumer widens
  each K and V tile unscaled to the query's dtype (which holds every such
  value exactly) in a tile of its own, which the products read, and the
  scales multiply the logits and P: per-entry ones (`scales`: the key's
  and the value's float32 [B', S, K'] rings, K' = K padded to 8) as
  vectors along the keys (`_scale_columns`), those constant along the
  cache (`head_scales`: float32 [1 or B, 1, 1 or K] each) as one factor a
  unit on the logits and on the result; a float8 cache may have neither.
  With `quantized_query` the consumer rounds its query rows to the
  cache's dtype and K tiles go to the products as stored. With
  `latent_chunks` (a latent cache, `value` the key) the units are (b, K/V
  head x chunk, split), V is the unit's chunk of the K slot's columns
  (`spec.hv` wide), and its results fill those columns of the output."""
  ops = kernel.ops_for(spec)
  bk, h, hv, stages = spec.block_kv, spec.head_dim, spec.hv, spec.stages
  s_max, num_kv, nc = spec.kv_len, spec.num_heads, spec.consumers
  stored = stored_rows(rows)
  latent = latent_chunks > 0
  chunks = max(1, latent_chunks)
  units = kernel.Units(spec.batch, num_kv * chunks, splits, spec.num_ctas)
  # The PDL merge reads whole 8-part tiles: the parts past the kernel's
  # are never written (and never used).
  parts = (mosaic_merge.padded_parts(nc * splits) if pdl
           else nc * splits)
  one_byte = key.dtype.itemsize == 1
  qk_dtype, pv_dtype = product_dtypes(
      spec.dtype, key.dtype, value.dtype, quantized_query=quantized_query,
      scale_rings=scales is not None, float16=float16_products)
  # Q K^T reads a copy of the query rows in its operands' dtype, made once
  # a unit (`_quantized_rows`, `_float16_rows`), or the rows as loaded.
  query_copy = qk_dtype != spec.dtype
  # A 1-byte cache's staging and widened tiles in a union a consumer (see
  # `smem` below), where the interpreter (if interpreting) takes unions.
  unions = one_byte and (not spec.interpret
                         or kernel.interpreter_takes_ref_unions())
  # A latent call's query rows and staging in a union (module doc), where
  # the interpreter (if interpreting) takes unions.
  latent_unions = latent and (not spec.interpret
                              or kernel.interpreter_takes_ref_unions())
  optional = [(name, x) for name, x in (
      ("qpos", qpos), ("table", table),
      *zip(("key_scale", "value_scale"), scales or ()),
      *zip(("head_key_scale", "head_value_scale"), head_scales or ()))
      if x is not None]
  operands = (q_rows, key, value, lengths) + tuple(x for _, x in optional)
  # Where the optional operands sit.
  at = {name: 4 + i for i, (name, _) in enumerate(optional)}

  def runs(r: kernel.Refs):
    return _SplitRuns(
        r.inputs[3], r.inputs[at["qpos"]] if "qpos" in at else None,
        cache_len=s_max, block=bk, splits=splits, new_tokens=new_tokens,
        is_causal=spec.is_causal, window=spec.window)

  def block_start(j):
    # A block past a contiguous cache's end reads its last `bk` keys
    # instead; a paged cache holds whole blocks (pages of a multiple or
    # divisor of the block; a page past the table is clamped into it, its
    # keys past every length).
    return j * bk if table is not None else jnp.minimum(j * bk, s_max - bk)

  def block_copies(ref, dst, b, n, j, table_ref):
    """[(gmem view, smem view)] of block j's rows of a cache `ref` (K/V
    head n's; every head's where n is None, the scales' rows)."""
    def rows(lead, keys):
      return ref.at[lead, keys] if n is None else ref.at[lead, keys, n]

    if table_ref is None:
      return [(rows(b, pl.ds(block_start(j), bk)), dst)]
    page_size, num_pages = ref.shape[1], ref.shape[0]
    max_pages = table_ref.shape[1]

    def page(i):  # The i-th table entry, both indices clamped.
      entry = table_ref[b, jnp.minimum(i, max_pages - 1)]
      return jnp.clip(entry, 0, num_pages - 1)

    if page_size >= bk:
      first = j * bk
      return [(rows(page(first // page_size),
                    pl.ds(kernel.rem(first, page_size), bk)), dst)]
    per_block = bk // page_size
    return [(rows(page(j * per_block + i), slice(None)),
             dst.at[pl.ds(i * page_size, page_size)])
            for i in range(per_block)]

  # Both scale columns are read at a block's key step (`_scale_columns`:
  # one pass through shared memory), so the value scales land with the
  # keys.
  both_scales_with_keys = scales is not None

  def scale_copies(r, which, b, n, j, slot):
    """The copies of block j's per-key scales, the key's (which = 0) or the
    value's (1), as the cache's (a page's rows at a time where pages are
    narrower than the block); none without scales."""
    if scales is None:
      return []
    del n  # A block's scales of every K/V head: rows of K' * 4 bytes.
    ref = r.inputs[at[("key_scale", "value_scale")[which]]]
    table_ref = r.inputs[at["table"]] if "table" in at else None
    return block_copies(ref, r.smem[_KEY_SCALES + which].at[slot], b, None,
                        j, table_ref)

  def producer_groups(r: kernel.Refs):
    k_ref, v_ref = r.inputs[1:3]
    table_ref = r.inputs[at["table"]] if "table" in at else None
    k_smem, v_smem = r.smem[_RING:_RING + 2]
    k_bar, v_bar, k_free, v_free = r.barriers[1:5]

    def k_copies(b, n, rep, j, slot):
      del rep
      if latent:  # The unit's K/V head.
        n = kernel.div(n, chunks)
      return (block_copies(k_ref, k_smem.at[slot], b, n, j, table_ref)
              + scale_copies(r, 0, b, n, j, slot)
              + (scale_copies(r, 1, b, n, j, slot) if both_scales_with_keys
                 else []))

    def v_copies(b, n, rep, j, slot):
      del rep
      return (block_copies(v_ref, v_smem.at[slot], b, n, j, table_ref)
              + ([] if both_scales_with_keys
                 else scale_copies(r, 1, b, n, j, slot)))

    if latent:  # The values are the K slot's columns.
      return [(k_bar, k_free, k_copies)]
    return [(k_bar, k_free, k_copies), (v_bar, v_free, v_copies)]

  scale = online_softmax.exponent_scale(spec.scale, cap=spec.soft_cap,
                                        has_score_mod=False)

  def unit(r: kernel.Refs, t, base):
    q_ref = r.inputs[0]
    o_ref, lse_ref = r.outputs
    q_smem, o_smem, lse_smem = r.smem[:3]
    if latent and latent_unions:
      q_smem, o_smem = r.smem[0]
    k_smem, v_smem = r.smem[_RING:_RING + 2]
    wg = r.wg
    if one_byte:
      ks_smem, vs_smem, column_smem, q_copy_smem = r.smem[
          _KEY_SCALES:_KEY_SCALES + 4]
    if unions:
      # This consumer's union (`wg` is its index, a Python int here).
      o_smem, wide = o_smem[wg]
    else:
      o_smem = o_smem.at[wg]
      wide = r.smem[-1].at[wg] if one_byte else None
    q_bar, k_bar, v_bar, k_free, v_free = r.barriers
    sched = runs(r)
    b, n, split = r.units.decode(r.cta, t)
    if latent:
      # The unit's value chunk: its V tile's columns, and the output's.
      chunk, n = kernel.rem(n, chunks), kernel.div(n, chunks)
      columns = pl.ds(pl.multiple_of(chunk * hv, hv), hv)
    ulo = sched[b, split, 0]
    length = sched.length(b)
    # The unit's rows and the rounding rows after them (the next head's,
    # or zeros past the array): every row's math is its own, and only the
    # unit's rows are merged. The tile's other rows hold what they hold.
    kernel.load_stationary(
        [(q_ref.at[pl.ds((b * num_kv + n) * rows, stored)],
          q_smem.at[wg, pl.ds(0, stored)])], q_bar.at[wg])
    # The rows Q K^T reads: as loaded, or a copy in its operands' dtype
    # (quantized to the cache's, or scaled into float16's range); the
    # logits' factor a row (the copy's scale) and a unit (the head's key
    # scale).
    q_rows_smem, row_factors, head_factor = q_smem, None, None
    if head_scales is not None:
      head_factor = _per_head(r.inputs[at["head_key_scale"]], b, n)
    if query_copy:
      copy = _quantized_rows if quantized_query else _float16_rows
      row_factors = copy(ops, q_smem.at[wg], q_copy_smem.at[wg])
      if head_factor is not None:
        row_factors, head_factor = row_factors * head_factor, None
      q_rows_smem = q_copy_smem
    tokens = kernel.rem(ops.iota_vector(TILE_ROWS, 0), new_tokens)
    q_pos, _, _ = sched.positions(b, tokens)

    def step(j, carry, *, masked):
      m_i, l_i, acc = carry
      slot = kernel.rem(base + j - ulo, stages)
      first = block_start(j)
      plgpu.barrier_wait(k_bar.at[slot])
      k_tile = k_smem.at[slot]
      key_factors = value_factors = None
      if both_scales_with_keys:
        # Read before the slot (and its scales) is released.
        key_factors, value_factors = _scale_columns(
            ops, (ks_smem.at[slot], vs_smem.at[slot]), n, column_smem.at[wg])
      if one_byte and not quantized_query:
        k_tile = _widened(ops, k_tile, wide.at[0], qk_dtype)
        plgpu.barrier_arrive(k_free.at[slot])
      qk = ops.mm(q_rows_smem.at[kernel.stationary_in_step(spec, wg)],
                  k_tile, transpose_b=True)
      if (not one_byte or quantized_query) and not latent:
        plgpu.barrier_arrive(k_free.at[slot])
      # The 1-byte products dequantized: a factor a row, a unit or a key.
      if row_factors is not None:
        qk = qk * lax.broadcast_in_dim(row_factors, qk.shape, (0,))
      if head_factor is not None:
        qk = qk * head_factor
      if key_factors is not None:
        qk = qk * lax.broadcast_in_dim(key_factors, qk.shape, (1,))
      s = qk if scale is not None else kernel.logits(spec, qk)[0]
      if masked:
        kv_pos = first + ops.iota_vector(bk, 1)
        # Keys of this block (not the one before, in a block shifted back
        # from the cache's end) below the length.
        real = jnp.logical_and(kv_pos >= j * bk, kv_pos < length)
        s = kernel.apply_mask(
            spec, s, 0, q_pos, None, kv_pos, None,
            lax.broadcast_in_dim(real, s.shape, (1,)))
      m_i, l_i, p, alpha = online_softmax.update(
          m_i, l_i, s, base2=True, per_query=_ROWS,
          tile_exp=forward.tile_exp(spec), scale=scale)
      acc = online_softmax.rescale(acc, alpha, per_query=_ROWS)
      # P in the products' dtype before the V tile widens: half the
      # registers of the float32 P live across the widening.
      if value_factors is not None:
        # The value scales onto P, a vector along its keys (those past the
        # length, which may be NaN, zeroed), so that the V tile widens
        # unscaled (a byte permute and a subtraction a value pair).
        if masked:
          value_factors = jnp.where(kv_pos < length, value_factors,
                                    jnp.zeros_like(value_factors))
        p = p * lax.broadcast_in_dim(value_factors, p.shape, (1,))
      p = p.astype(pv_dtype)
      if latent:
        v_tile = k_smem.at[slot, :, columns]
      else:
        plgpu.barrier_wait(v_bar.at[slot])
        v_tile = v_smem.at[slot]
      if one_byte:
        v_tile = _widened(ops, v_tile, wide.at[1], pv_dtype,
                          (first, length) if masked else None)
        plgpu.barrier_arrive(v_free.at[slot])
      elif masked:
        _zero_rows_past(ops, v_tile, first, length)
      acc = ops.mm(p, v_tile, a_in_smem=False, acc=acc)
      if latent:
        plgpu.barrier_arrive(k_free.at[slot])
      elif not one_byte:
        plgpu.barrier_arrive(v_free.at[slot])
      return m_i, l_i, acc

    carry = (
        ops.full_vector(TILE_ROWS, online_softmax.MASK_VALUE, 0),
        ops.full_vector(TILE_ROWS, 0.0, 0),
        ops.full((TILE_ROWS, hv), 0.0),
    )
    m_i, l_i, acc = _walk(sched, b, split, step, carry, base=base,
                          consumer=wg, consumers=spec.consumers)
    out, lse = online_softmax.finalize(m_i, l_i, acc, base2=True,
                                       per_query=_ROWS)
    if head_scales is not None:
      # The values were widened unscaled: their head's scale.
      out = out * _per_head(r.inputs[at["head_value_scale"]], b, n)
    part = wg * splits + split
    o_smem[...] = out
    lse_smem.at[wg][...] = lse
    result = (o_smem.at[pl.ds(0, stored)],
              o_ref.at[b, n, part, pl.ds(0, stored)])
    lse_result = (lse_smem.at[wg, pl.ds(0, stored)], lse_ref.at[b, n, part])
    if not latent:
      kernel.store([result, lse_result])
    else:
      kernel.store([(result[0], result[1].at[:, columns])])

      # (Every chunk of a split has the same logsumexp: one writes it.)
      @pl.when(chunk == 0)
      def _():
        kernel.store([lse_result])

    return base + sched[b, split, 1] - ulo

  # The widened tiles, in P V's operand dtype (Q K^T's too where K widens:
  # `product_dtypes` makes them one).
  wide = ops.smem((nc, 2, bk, max(h, hv)), pv_dtype, True)
  if unions:
    # Each consumer's result staging and the widened K and V tiles its
    # products read share memory, a `plgpu.RefUnion` a consumer: the tiles
    # are dead once a unit's last P V has run, which is when the staging
    # is written, and the next unit widens only after the staging's TMA
    # store has read it (`kernel.load_stationary`). The consumers run
    # copies of `unit` of their own (`static_consumers`), each naming its
    # union.
    staging = tuple(
        plgpu.RefUnion(ops.smem((TILE_ROWS, hv), _F32, True),
                       ops.smem((2, bk, max(h, hv)), pv_dtype, True))
        for _ in range(nc))
  else:
    staging = ops.smem((nc, TILE_ROWS, hv), _F32, True)
  rows_smem = ops.smem((nc, TILE_ROWS, h), spec.dtype, True)
  v_ring = ops.smem((stages, bk, hv), value.dtype, True,
                    swizzle=min(ops.swizzle, hv * value.dtype.itemsize))
  if latent:
    # No V ring (the K slot's columns); the staging in the packed rows'
    # memory where the launch takes unions (module doc).
    v_ring = plgpu.SMEM((8,), _F32)
    if latent_unions:
      rows_smem, staging = plgpu.RefUnion(rows_smem, staging), v_ring
  smem = (
      # Each consumer's packed rows, its result's staging and logsumexp.
      rows_smem,
      staging,
      plgpu.SMEM((nc, TILE_ROWS), _F32),
      # The K and V rings (a 1-byte tile's rows are H bytes: its swizzle
      # no wider).
      ops.smem((stages, bk, h), key.dtype, True,
               swizzle=min(ops.swizzle, h * key.dtype.itemsize)),
      v_ring,
  )
  if one_byte:
    # 1 KiB placeholders where a call has no use for a buffer.
    heads = layout.round_up(num_kv, _ROW_TILE)
    placeholder = plgpu.SMEM((8,), _F32)
    smem += (
        # The keys' and the values' scales, rings, and each consumer's
        # scale columns (`_scale_columns`).
        *((plgpu.SMEM((stages, bk, heads), _F32),) * 2
          if scales is not None else (placeholder,) * 2),
        plgpu.SMEM((nc, 2, bk), _F32) if scales is not None else placeholder,
        # Each consumer's copy of its query rows in Q K^T's operand dtype.
        ops.smem((nc, TILE_ROWS, h), qk_dtype, True,
                 swizzle=min(ops.swizzle, h * qk_dtype.itemsize))
        if query_copy else placeholder,
    ) + (() if unions else (wide,))
  # A block's copies: one, or a page each where pages are narrower; with
  # scales, theirs (both with the keys', `both_scales_with_keys`).
  copies = 1 if table is None else max(1, bk // key.shape[1])
  # (Each tensor of a block, the scales' included, in `copies` copies.)
  k_arrivals, v_arrivals = ((3 * copies, copies) if both_scales_with_keys
                            else (copies, copies))
  barriers = (
      gpu_ops.barrier(nc),  # each consumer's packed rows
      gpu_ops.barrier(stages, k_arrivals),  # K loaded
      gpu_ops.barrier(stages, v_arrivals),  # V loaded
      gpu_ops.barrier(stages),  # K slot released
      gpu_ops.barrier(stages),  # V slot released
  )
  out_types = (
      jax.ShapeDtypeStruct((spec.batch, num_kv, parts, stored, hv * chunks),
                           _F32),
      jax.ShapeDtypeStruct((spec.batch, num_kv, parts, stored), _F32),
  )
  return kernel.launch(
      spec, name="pfa_mgpu_decode", units=units, reps=1, operands=operands,
      out_types=out_types, smem_types=smem, barrier_types=barriers,
      unit=unit, producer_groups=producer_groups, schedule=runs,
      # Every reduction is of a row of a [64, block] tile, within a warp.
      cross_warp_reductions=False, static_consumers=unions, pdl=pdl)


def _walk(sched, b, split, step, carry, *, base, consumer, consumers: int):
  """A consumer's walk over a unit's key blocks: `kernel.phases`' masked /
  unmasked / masked runs of [first, end), all of them with one consumer;
  with two, the blocks whose ring step (base + j - first) has the
  consumer's parity (an even ring: the slots of that parity, every fill of
  which the consumer then awaits in order)."""
  if consumers == 1:
    return kernel.phases(sched, b, split, 0, step, carry, masked=True)
  ulo, uhi = sched[b, split, 0], sched[b, split, 1]
  flo, fhi = sched[b, split, 2], sched[b, split, 3]
  for lo, hi, masked in ((ulo, flo, True), (flo, fhi, False),
                         (fhi, uhi, True)):
    # The run's first block of this consumer's parity, and their count.
    first = lo + kernel.rem(consumer + 2 - kernel.rem(base + lo - ulo, 2), 2)
    count = kernel.div(jnp.maximum(hi - first + 1, 0), 2)

    def body(i, c, first=first, masked=masked):
      return step(first + 2 * i, c, masked=masked)

    carry = lax.fori_loop(0, count, body, carry)
  return carry


_WIDEN_COLUMNS = 128


def _widened(ops, tile, dst, dtype, past=None):
  """A 1-byte K or V tile [bk, H] widened into `dst` (the shared-memory
  tile the products read) in `dtype`, as stored (the scales multiply the
  logits and P); `past`: (first key, length), the rows at or past the
  length zeroed. Returns the view of `dst` it fills (the first H
  columns)."""
  bk, width = tile.shape
  out = dst if dst.shape[1] == width else dst.at[:, pl.ds(0, width)]
  # One conversion to `dtype` (e4m3 to float16 a `cvt` a pair, int8 a
  # byte permute and a subtraction a pair), no float32 step; e4m3 to
  # bfloat16 has no such conversion (ptxas 12.9), so it goes through
  # float32.
  direct = tile.dtype == jnp.int8 or dtype == jnp.float16
  # int8 tiles load in the 8-bit operand layout (4 bytes a thread a load,
  # stored as 8: 843 PTX instructions a 64-key step at H = 128 against 911
  # in the accumulator layout's 2); e4m3 ones did better in the
  # accumulator layout (to float16: 505 SASS instructions a step against
  # 514; through float32: 975 PTX against 1003).
  eight_bit = tile.dtype == jnp.int8 and width <= 128
  # A [64, 128] part at a time: a 128-key tile's float32 values (or a
  # [64, 256] part's) at once would be 128 registers a thread beside the
  # accumulator.
  cols = min(width, _WIDEN_COLUMNS)
  for lo in range(0, bk, TILE_ROWS):
    for c0 in range(0, width, cols):
      part = (pl.ds(lo, TILE_ROWS), pl.ds(c0, cols))
      x = ops.load_tile(tile.at[part], eight_bit=eight_bit)
      if tile.dtype == jnp.int8 and dtype == jnp.float16 and width > cols:
        # At H = 256 int8 to float16 value by value (I2F) spilled 28-60 B:
        # through bfloat16 (Mosaic's byte permute and two masks a pair) it
        # does not, at 1.28x the instructions of a 64-key step (H = 128:
        # 1,150 SASS against 899).
        x = x.astype(jnp.bfloat16).astype(_F32)
      x = x.astype(dtype if direct else _F32)
      if past is not None:
        first, length = past
        row = ops.iota(x.shape, 0, eight_bit=eight_bit)
        x = jnp.where(first + lo + row < length, x, jnp.zeros_like(x))
      out.at[part][...] = x.astype(dtype)
  # The generic-proxy stores, before wgmma reads the tile.
  plgpu.commit_smem()
  return out


def _quantized_rows(ops, q_tile, q8_tile):
  """Rounds a consumer's query rows (`q_tile`, [64, H] in the products'
  16-bit dtype) to `q8_tile`'s 1-byte dtype, each row at its own absmax
  scale (`quantize.quantize`'s rounding); returns the scales, a float32
  vector along the rows."""
  x = ops.load_tile(q_tile).astype(_F32)
  scale = quantize.absmax_scale(jnp.max(jnp.abs(x), axis=1), q8_tile.dtype)
  q8_tile[...] = quantize.scaled_values(
      x, lax.broadcast_in_dim(scale, x.shape, (0,)), q8_tile.dtype)
  # The generic-proxy stores, before wgmma reads the tile.
  plgpu.commit_smem()
  return scale


def _float16_rows(ops, q_tile, f16_tile):
  """Copies a consumer's bfloat16 query rows (`q_tile`, [64, H]) to
  `f16_tile` in float16, each row times the power of two that takes its
  largest magnitude into [2^14, 2^15) (`quantize.float16_unit`: every bit
  kept but those of entries 2^28 below the row's largest); returns the
  powers' inverses, a float32 vector along the rows, which multiply the
  logits back."""
  x = ops.load_tile(q_tile).astype(_F32)
  up, down = quantize.float16_unit(jnp.max(jnp.abs(x), axis=1))
  f16_tile[...] = (x * lax.broadcast_in_dim(up, x.shape, (0,))).astype(
      jnp.float16)
  # The generic-proxy stores, before wgmma reads the tile.
  plgpu.commit_smem()
  return down


def _head_column(ops, ref, head, lo, size):
  """Rows [lo, lo + size) of K/V head `head`'s column of a block's
  per-entry scales (`ref`: float32 [bk, K'], every head's), a vector
  along the rows of a tile in the accumulator layout."""
  every = ops.load_tile(ref.at[pl.ds(lo, size)])
  column = lax.broadcast_in_dim(ops.iota_vector(ref.shape[1], 1),
                                every.shape, (1,)) == head
  return jnp.sum(jnp.where(column, every, jnp.zeros_like(every)), axis=1)


def _scale_columns(ops, refs, head, staging):
  """The key and value scales of K/V head `head` for a block (`refs`: two
  float32 [bk, K'], every head's), each as a vector along the keys of a
  [64, bk] logit tile: the column read along the rows (`_head_column`),
  then through the consumer's `staging` [2, bk] (a warpgroup barrier
  between), since the two vectors' layouts differ. The consumer's next
  stores there follow the V tile's widening (another warpgroup
  barrier)."""
  bk = refs[0].shape[0]
  for i, ref in enumerate(refs):
    for lo in range(0, bk, TILE_ROWS):
      staging.at[i, pl.ds(lo, TILE_ROWS)][...] = _head_column(
          ops, ref, head, lo, TILE_ROWS)
  plgpu.commit_smem()
  return tuple(ops.load_vector(staging.at[i], 1) for i in range(2))


def _per_head(scales, b, n):
  """The scale of K/V head n of sequence b from float32 scales [1 or B, 1,
  1 or K] (a scalar read)."""
  return scales[b if scales.shape[0] > 1 else 0, 0,
                n if scales.shape[2] > 1 else 0]


def _zero_rows_past(ops, v_tile, first, length):
  """Zeroes the rows of a V tile (keys from `first` on) at or past the
  sequence's length, when the tile reaches past it."""
  bk, hv = v_tile.shape

  @pl.when(first + bk > length)
  def _():
    keep = first + ops.iota_vector(bk, 0) < length
    tile = ops.load_tile(v_tile)
    v_tile[...] = jnp.where(lax.broadcast_in_dim(keep, (bk, hv), (0,)),
                            tile, jnp.zeros_like(tile))
    # The generic-proxy stores, before wgmma reads the tile.
    plgpu.commit_smem()

