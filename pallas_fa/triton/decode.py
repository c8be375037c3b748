"""The split-KV decode kernel of `decode_attention(implementation="triton")`.

One Pallas program per (sequence, K/V head, split[, value-head-dim chunk]):

* **Rows.** The program holds the packed query tile of its K/V head: the G
  query heads of the group times the T_new new tokens, R = G * T_new rows,
  padded to a power of two of at least 16 (Triton's `tl.dot` minimum), so
  each K/V byte is read once per K/V head, not once per query head. The
  padding exists in registers only: rows past R are masked off the loads
  and stores, so q and the partial results are never padded in memory.
* **Keys.** The visible key range of the sequence (lengths, causal and the
  window shrink it) is cut into `splits` contiguous runs of `block` keys,
  one per program. Each program derives its run itself, with scalar
  arithmetic on its sequence's length and new-token positions
  (`masking.decode_key_blocks`, `masking.split_run`), so no span arrays
  are computed before the kernel; it runs the online softmax over its run
  and writes a normalised partial (out, lse). The blocks every row sees
  whole (`masking.decode_whole_blocks`: inside the length, the causal mask
  and the window) run unmasked; in the others, at most a block or two at
  either end of a run, every key is masked by `masking.visible` with `key <
  length` as its dense term, and value rows past the length are zeroed
  (they may hold NaN). With a mask_mod the visible blocks need not be
  contiguous: each K/V head's non-empty blocks are listed
  (`masking.listed_runs`, computed before the kernel, `partials`) and the
  splits cut the list, so the blocks it hides are never read and those it
  shows whole skip the masking.
* **Merge.** Without a mask_mod (`attention`) a second, small kernel
  (`decode_merge`) merges the splits (`online_softmax.merge_parts`), adds
  the sinks and writes the output in the query's dtype: at T_new = 1 a
  decode step is these two kernels and nothing else (only reshapes
  around them), since
  at a few microseconds per launch the nine small fusions that built the
  spans and padded the queries, and the three that merged, cost about as
  much as reading the cache. With a mask_mod the partials merge in plain
  JAX (`decode.plan.merged`).
* **Paging.** A contiguous cache [B, S_max, K, H] is read in blocks of
  `block` keys (a `pl.ds` slice; when S_max is not a multiple of `block`,
  the last block is the cache's last `block` rows, its keys already read
  masked). A paged cache is read through the block
  table in blocks of the contiguous default. Where the page size is a
  multiple of it, block j of a sequence is rows [(j % per_page) * block,
  ...) of page `block_table[b, j // per_page]`. Smaller pages (vLLM's
  16 keys on CUDA) or sizes it does not divide give blocks that span
  pages: key i of block j, at position p = j * block + i, is row p %
  page_size of page `block_table[b, p // page_size]`, one [block, H] tile
  loaded with a pointer per row (a gather whose rows stay contiguous
  along H, so its loads are as wide as a slice's), and the products and
  the softmax run once per block as for a contiguous cache (16-key pages
  in 16-key blocks paid each step's fixed cost four times per 64 keys:
  1.96x the contiguous time on an H200). The table entries past the
  row's (a last block may run past `max_pages * page_size`) read its last
  page, keys the length masks. Page sizes must be multiples of 16.
* **Quantized caches.** An int8, float8_e4m3fn or float8_e5m2 cache
  (`QUANTIZED_CACHES`) is read as stored, in the same tiles at one byte
  an element (never a float copy of it in memory); each tile is converted
  in registers to the query's dtype, which holds every int8 and float8
  value exactly. The float32 scales act per key column: the key's
  multiply the logits after Q.K^T (q . (k c) = (q . k) c), the value's
  multiply P before P.V ((P c) . v = P . (v c)), and in masked blocks
  those of keys past the length (which may be NaN) are zeroed first. A
  paged cache's scales are read through the same page index. Scales come
  in as they are, a broadcast dim never expanded (`_scale_input`): one
  per key is a [block] load beside the tile, one per page or sequence a
  scalar load, one per program (per K/V head, say) a load before the
  loop (a value scale then multiplies the output once). Under bfloat16
  queries a 1-byte tile converts to float16 instead (float8: one
  instruction per two values; int8: five per four; `one_byte`; bfloat16
  takes two or three a value), and both products run in float16: the
  queries and P scaled by powers of two into float16's range, which
  keeps every bit of bfloat16 queries (`_float16_queries`) and more of
  P's than bfloat16 does. Under 16-bit queries a 1-byte value cache with
  value chunks of 128 columns or more (`_WORDS_MIN_COLUMNS`) is read as
  int32 words of four values along the head dim (a bitcast), and
  each value tile as four parts of a quarter of its columns
  (`one_byte.word_values`: Triton then loads a word, not a byte, per
  value pair of the product's operand), the parts' results stored with a
  column stride of 4. float8_e4m3fn needs compute capability 8.9
  (Triton's conversions).
* **Latent caches.** With `value_head_dim` (value=None, `LATENT_CACHES`:
  DeepSeek's absorbed MLA, H = 576, Hv = 512, one K/V head) the values are
  the key's first Hv columns and there is no value operand: a program
  reads each column of its key blocks once, its value columns included.
  Those (its value chunk, below) are whole key chunks (`key_tiling` caps
  the key chunk at the value chunk): Q.K^T loops over the other key
  chunks, then loads the value columns chunk by chunk, each tile adding
  its term of Q.K^T and then, held in registers, multiplying P into its
  own [R, chunk] part of the accumulator. (Loading them as one [block,
  Hv] tile would make that Q.K^T term one [R, Hv] x [Hv, block] product
  whose operands every warp holds whole: 217 registers at R = 16 on the
  H100 against 116 in chunks, 113 with a separate value cache.) With
  several value chunks (R > 32 at Hv = 512) each program still reads the
  whole key row of its blocks, as K is read once per value chunk anyway.
  A quantized latent cache's key scales dequantize both the logits and P
  (or the output, for a constant scale).
* **Head dims.** Up to 256 a head dim is padded to a power of two (one
  tile, `triton.ALIGN`); above, it is cut into power-of-two chunks that
  divide it rounded up to 16 (576 = 9 x 64, 4096 = 16 x 256), so a cache of
  such a head dim is read in place. Q.K^T sums over key chunks of at most
  256 in a loop. The output cannot stay in registers whole ([R, 4096]
  float32), so each program produces one value chunk of at most 1024
  columns (a grid axis), recomputing the logits: K is read once per value
  chunk (4 times at Hv = 4096, 9 times at Hv = 576, once at 512), V once.
  Tiles shrink with R so that a [R, chunk] float32 tile stays within the
  register budget (`_TILE_ELEMENTS`).

* **Flex attention.** A score_mod / mask_mod is split by `fused_mods`:
  in the packed layout each row is one (query head, new token), so the
  values a function computes per (batch, head) or per query are one per
  row ([B, K, R], computed outside), those per key one per cache position
  ([B, S], which must not depend on the head), and the kernel runs the
  rest on each [R, block] tile of logits.

The grid is (B, K, splits * value chunks); `decode.default_num_splits`
picks the splits (about two programs per streaming multiprocessor, four
over a 1-byte cache, value chunks counted). A cache whose head dims need
no padding (and that holds at least one block) is read in place;
otherwise the padded copy costs one extra pass over it. Forward only.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_fa import gpu_target
from pallas_fa import layout
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import quantize
from pallas_fa import triton
from pallas_fa.flex import fused_mods
from pallas_fa.flex import mods
from pallas_fa.triton import decode_merge
from pallas_fa.triton import exp2
from pallas_fa.triton import kernel as triton_kernel
from pallas_fa.triton import one_byte

Array = Any
_F32 = jnp.float32
_load = decode_merge.masked_load
_store = decode_merge.masked_store
# P's multiplier in float16 products (at most 1: then at most 2^14).
_P_UNIT = 2.0 ** 14
# Triton's tl.dot needs every matmul dimension to be at least 16.
_MIN = triton.MIN_BLOCK
# Widest key and value head-dim tiles, and the most float32 elements a
# [rows, chunk] tile (accumulator, resident Q chunk) may hold: read off
# ptxas (`scripts/compile_check.py --variants=decode`) so that nothing
# spills. The value tile may be wider: every value chunk past the first
# re-reads K.
# The narrowest value chunk read as words (`one_byte.word_values`): its
# four products are a quarter as wide, and under 32 columns each Triton
# lays them out at about twice the registers (sm_90a, bf16 queries, 16
# rows: int8 at H = 64, 80 -> 200; float8 96 -> 168; at H = 128 and 256
# no more than before), which would halve the programs an SM holds.
_WORDS_MIN_COLUMNS = 128
_KEY_CHUNK = 256
_VALUE_CHUNK = 1024
_TILE_ELEMENTS = 1 << 14
# int8 / float8 caches are read as stored and dequantized in registers
# (`decode.kernels.run` passes them with their scales).
QUANTIZED_CACHES = True
# A shared prefix's folded queries (B * T_new * G per K/V head) decode as
# one row's packed tile up to here (`decode.kernels.folds_rows`): 128 rows
# still hold a 128-wide head dim whole, in blocks of 32 keys, without
# spilling (ptxas, H100), and split over the prefix's keys they fill the
# GPU, where `flash_attention`'s grid over the folded tokens gives each
# query head one program that walks the whole prefix.
MAX_FOLDED_ROWS = 128
# float32 queries fold up to 32 rows: at 64 the prefix pass spills (H100,
# H = 128: 32 B on jax 0.10.2; H = 256: 12 B on 0.11.2, 700 B on 0.10.2)
# and overflows an A100's shared memory at H = 256 (172,032 B of
# 166,912); at 32 it compiles without either on both targets.
MAX_FOLDED_ROWS_FLOAT32 = 32
# `decode.front` passes a latent cache as value=key with `value_head_dim`:
# the kernel reads the values from the key tiles.
LATENT_CACHES = True
# A contiguous 1-byte cache's keys per block where a program's tile has
# 16 rows and chunks of at most 128 columns (`block_for`), and the
# programs an SM holds then (`programs_per_sm`): 128-key blocks pay the
# loop's per-block costs (the value scale's unit, its barriers, the
# bookkeeping) once per 128 keys: int8 about 450 SASS instructions a
# warp per 64 keys against 554 (sm_90a, H = 128), at 254 registers
# (int8; float8 214) and 108,544 B of shared memory: two programs an SM,
# the split count a 16-bit cache's.
# H200, B = 1, S = 32k, K = 8, H = 128, explicit 33 splits against the
# 64-key four-programs default: int8 0.965x (b85705a) and 0.943x
# (07213ac), float8 0.966x (07213ac).
ONE_BYTE_BLOCK = 128
# A latent call's value chunk unless the caller picks one (`decode.kernels.
# run`): four programs a split over Hv = 512, each reading its key blocks
# through L2, against one over 512 columns with [rows, 512] partials (H200,
# B = 1, S = 16384, N = 16, H = 576: 20.5 against 23.5 us, 07213ac).
LATENT_VALUE_CHUNK = 128


def interpreted() -> bool:
  """Whether the kernels run in the interpreter here (`decode.kernels`)."""
  return not gpu_target.builds_ptx()


def packed_rows(rows: int) -> int:
  """Rows of a program's query tile: the G * T_new packed query rows,
  padded to a power of two >= 16."""
  return max(_MIN, layout.next_power_of_2(rows))


def _head_tiling(head_dim: int, rows: int, widest: int) -> tuple[int, int]:
  """(padded head dim, chunk): the chunk a power of two in [16, widest]
  small enough that a [rows, chunk] float32 tile fits the register budget,
  the padded dim a multiple of it (a power of two up to 256, else the head
  dim rounded up to 16, so 576 = 9 x 64)."""
  if head_dim <= 256:
    padded = layout.padded_head_dim(head_dim, triton.ALIGN)
  else:
    padded = layout.round_up(head_dim, _MIN)
  limit = max(_MIN, min(widest, _TILE_ELEMENTS // rows))
  chunk = _MIN
  while chunk * 2 <= limit and padded % (chunk * 2) == 0:
    chunk *= 2
  return padded, chunk


def key_tiling(head_dim: int, rows: int,
               latent_value_head_dim: int | None = None,
               max_value_chunk: int | None = None) -> tuple[int, int]:
  """(padded head dim, chunk) of the queries and keys: Q.K^T loops over
  the chunks. A latent cache's (values = the key's first
  `latent_value_head_dim` columns) chunk is at most the value chunk
  (`value_tiling`), so that a program's value columns are whole key
  chunks (both powers of two: the smaller divides the larger)."""
  padded, chunk = _head_tiling(head_dim, rows, _KEY_CHUNK)
  if latent_value_head_dim is not None:
    chunk = min(chunk, value_tiling(latent_value_head_dim, rows,
                                    max_value_chunk)[1])
  return padded, chunk


def value_tiling(head_dim: int, rows: int,
                 max_value_chunk: int | None = None) -> tuple[int, int]:
  """(padded value head dim, chunk) of the values: one chunk of the output
  per program, at most `max_value_chunk` columns (None: `_VALUE_CHUNK`
  and the register budget decide)."""
  return _head_tiling(head_dim, rows, max_value_chunk or _VALUE_CHUNK)


def value_chunks(head_dim: int, rows: int,
                 max_value_chunk: int | None = None) -> int:
  """Programs per (sequence, K/V head, split): the value head-dim chunks
  of G * T_new = `rows` query rows."""
  padded, chunk = value_tiling(head_dim, packed_rows(rows), max_value_chunk)
  return padded // chunk


def default_block(head_dim: int, value_head_dim: int, rows: int,
                  max_value_chunk: int | None = None,
                  float32_queries: bool = False) -> int:
  """Keys per block of a contiguous cache: the widest K/V tiles and
  [rows, block] logits tile that fit registers (and two pipeline stages of
  shared memory) next to the accumulator. A float32 chunk of the most
  elements (`_TILE_ELEMENTS`: 64 rows at H = 256) takes half the block:
  at 32 keys it spilled 4 B over a float32 cache and 12 B over an int8
  one (sm_90a, 255 registers; 0 at 16 keys). A bfloat16 one over a 1-byte
  cache keeps 32 keys (201 registers with jax 0.11; 24 B spilled with
  jax 0.10, and still 8 at 16 keys: `scripts/known_spills.json`)."""
  widest = max(key_tiling(head_dim, rows)[1],
               value_tiling(value_head_dim, rows, max_value_chunk)[1])
  block = 64 if widest <= 128 else 32 if widest <= 256 else 16
  if float32_queries and rows * widest >= _TILE_ELEMENTS:
    block //= 2
  return max(_MIN, min(block, _TILE_ELEMENTS // (4 * rows)))


def block_for(*, head_dim: int, value_head_dim: int, groups: int,
              new_tokens: int, page_size: int | None,
              block_kv: int | None,
              max_value_chunk: int | None = None,
              one_byte: bool = False, cache_len: int = 0,
              float32_queries: bool = False) -> int:
  """Keys per block: `block_kv` or the default (`default_block`, of
  `float32_queries` or 16-bit ones; contiguous: `ONE_BYTE_BLOCK` for a
  `one_byte` key and value cache, not latent, of at least that many
  entries, `cache_len` (a shorter one would be padded to the block),
  whose tile has 16 rows and chunks of at most 128 columns); the default
  (paged), read a slice of a page when `page_size` is a multiple of it,
  else gathered from several pages (`_kernel.key_rows`).

  Raises:
    ValueError: `block_kv` is not a power of two >= 16.
    NotImplementedError: `page_size` is not a multiple of 16.
  """
  rows = packed_rows(groups * new_tokens)
  default = default_block(head_dim, value_head_dim, rows, max_value_chunk,
                          float32_queries)
  if (page_size is None and one_byte and cache_len >= ONE_BYTE_BLOCK
      and _one_byte_wide(head_dim, value_head_dim, rows, max_value_chunk)):
    default = ONE_BYTE_BLOCK
  if page_size is None:
    block = block_kv or default
    if block < _MIN or block & (block - 1):
      raise ValueError(
          f"block_kv must be a power of two >= {_MIN} for "
          f"implementation='triton', got {block_kv}.")
    return block
  if page_size % _MIN:
    raise NotImplementedError(
        f"implementation='triton' reads paged caches whose page_size is a "
        f"multiple of {_MIN}, got {page_size}.")
  return default


def _one_byte_wide(head_dim: int, value_head_dim: int, rows: int,
                   max_value_chunk: int | None) -> bool:
  """Whether a 1-byte cache's tile takes `ONE_BYTE_BLOCK` keys: 16 rows,
  key and value chunks of at most 128 columns."""
  return rows == _MIN and max(
      key_tiling(head_dim, rows)[1],
      value_tiling(value_head_dim, rows, max_value_chunk)[1]) <= 128


def programs_per_sm(block: int, one_byte: bool) -> int | None:
  """The programs an SM holds where a tiling fixes it (None: the split
  count's own default): two over `ONE_BYTE_BLOCK`-key 1-byte blocks."""
  return 2 if one_byte and block >= ONE_BYTE_BLOCK else None


def _listed_spans(lengths, lists, split_of):
  """The "span" input of a mask_mod's block lists (`masking.listed_runs`),
  one row of 4 int32 per program, [B, K, splits, 4]: (first, end, length,
  n_full), positions [first, end) of the K/V head's list, the first n_full
  of the list FULL."""
  first, end, n_full = (lists[1][..., i] for i in range(3))
  length = jnp.broadcast_to(lengths[:, None, None], first.shape)
  spans = jnp.stack([first, end, length, n_full], axis=-1)
  spec = triton.block_spec((None, None, None, 4),
                           lambda i, k, j: (i, k, split_of(j), 0))
  return spans.astype(jnp.int32), spec


def _dot_nt(a, b, precision):
  """a @ b.T with float32 accumulation."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                             precision=precision, preferred_element_type=_F32)


def _dot(a, b, precision):
  """a @ b with float32 accumulation."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=_F32)


def _flex_values(refs, mod, cols):
  """The residuals of a split score_mod/mask_mod for an [R, block] tile:
  per row [R, 1] (the program's block), per key [1, block] (`cols`)."""
  values = []
  for i, r in enumerate(mod.residuals):
    ref = refs[triton_kernel.residual_name(mod, i)]
    v = ref[cols][None, :] if r.level == fused_mods.Level.COLUMN else (
        ref[...][:, None])
    values.append(v != 0 if r.dtype == jnp.bool_ else v)
  return values


def _positions(refs, raw_length, rows: int, new_tokens: int,
               offset: int = 0):
  """(row positions [rows], smallest and largest new-token position) of a
  program's sequence: the "qpos" input's plus `offset`, or by default the
  last `new_tokens` positions below the (unclamped) length. Row r holds
  token r % new_tokens."""
  token = jnp.arange(rows, dtype=jnp.int32) % new_tokens
  if "qpos" not in refs:
    first = raw_length - new_tokens
    return first + token, first, raw_length - 1
  qpos = refs["qpos"]

  def body(t, carry):
    pos, lo, hi = carry
    p = qpos[t] + offset
    return jnp.where(token == t, p, pos), jnp.minimum(lo, p), jnp.maximum(
        hi, p)

  i32 = jnp.iinfo(jnp.int32)
  return jax.lax.fori_loop(
      0, new_tokens, body,
      (jnp.zeros((rows,), jnp.int32), jnp.int32(i32.max), jnp.int32(i32.min)))


def _power_of_two(x):
  """(2^e, 2^-e) in float32 that take x's largest magnitude into [2^14,
  2^15) (`quantize.float16_unit`)."""
  largest = jnp.abs(x.astype(_F32))
  while largest.ndim:
    # One axis at a time: Pallas-Triton lowers a reduction over several
    # through avals that jax 0.11's explicit meshes reject.
    largest = jnp.max(largest, axis=-1)
  return quantize.float16_unit(largest)


def _float16_queries(q):
  """(q 2^e in float16, 2^-e in float32): bfloat16 queries for float16
  products with float16 keys, the power of two taking q's largest
  magnitude into [2^14, 2^15).

  float16 holds every bfloat16 value from 2^-14 to 65504 exactly (8
  significant bits of its 11), so q 2^e is exact but for entries 2^28
  below the largest (float16 subnormals, negligible in q.k), and a float16
  product is as exact in float32 as a bfloat16 one: the logits, times
  2^-e, are those of bfloat16 products, rounded alike.
  """
  up, down = _power_of_two(q)
  return (q.astype(_F32) * up).astype(jnp.float16), down


def _tile_as(tile, dtype):
  """A cache tile in the products' dtype: an int8 one to float16 by
  `one_byte.to_float16` (five instructions per four values)."""
  if tile.dtype == jnp.int8 and dtype == jnp.float16:
    return one_byte.to_float16(tile)
  return tile.astype(dtype)


def _div_rem(x, d: int):
  """(x // d, x % d) of non-negative int32 x: a shift and a mask when d is
  a power of two (jnp's floor division would add sign fix-ups)."""
  if d & (d - 1) == 0:
    shift = d.bit_length() - 1
    return (jax.lax.shift_right_logical(x, jnp.int32(shift)),
            jax.lax.bitwise_and(x, jnp.int32(d - 1)))
  return jax.lax.div(x, jnp.int32(d)), jax.lax.rem(x, jnp.int32(d))


def _kernel(refs, *, block: int, head_chunk: int, head_chunks: int,
            value_chunk: int, value_chunks: int, page_size: int | None,
            max_pages: int | None, cache_len: int, capacity: int,
            num_pages: int, splits: int, new_tokens: int, real_rows: int,
            scale: float, soft_cap,
            is_causal: bool, window, precision, score_mod=None,
            mask_mod=None, latent: bool = False, position_offset: int = 0,
            value_words=None):
  # Grid indices at the kernel's top level (the interpreter resolves
  # `program_id` there, not inside loop bodies).
  column = pl.program_id(2) % value_chunks
  split = pl.program_id(2) // value_chunks
  rows = refs["q"].shape[0]
  # The packed rows past G * T_new exist only in registers (Triton's
  # minimum tile): never read, never written.
  row_ok = None if real_rows == rows else (
      jnp.arange(rows, dtype=jnp.int32) < real_rows)
  if "span" in refs:
    # A mask_mod's listed blocks: the runs and row positions come in.
    span = refs["span"]
    first, end, length = span[0], span[1], span[2]
    row_pos = refs["pos"][...]
  else:
    # Each program finds its run from its sequence's length and new-token
    # positions (`masking.decode_key_blocks`, `masking.split_run`): no
    # span arrays are built before the kernel. A traced length past the
    # cache keeps its positions but reads only the cache (`decode`).
    raw_length = refs["len"][0]
    length = jnp.clip(raw_length, 0, capacity)
    row_pos, q_first, q_last = _positions(refs, raw_length, rows,
                                          new_tokens, position_offset)
    lo, hi = masking.decode_key_blocks(
        length, q_first, q_last, block=block, is_causal=is_causal,
        window=window)
    first, end = masking.split_run(lo, hi, splits, split)
    whole_lo, whole_hi = masking.decode_whole_blocks(
        length, q_first, q_last, block=block, is_causal=is_causal,
        window=window)
  row_pos = row_pos[:, None]  # [R, 1]
  # The program's value columns start here.
  value_start = pl.multiple_of(column * value_chunk, value_chunk)
  q_mask = None if row_ok is None else row_ok[:, None]
  q_whole = (_load(refs["q"], q_mask, 0) if head_chunks == 1 else None)
  # A latent cache's value tile is the key's columns from `value_start`, a
  # whole number of key chunks (`key_tiling`): Q.K^T loops over the other
  # chunks, then reads these `parts` once, each serving its Q.K^T term and
  # then P.V into its own [R, chunk] part of the accumulator (see the
  # module docstring: not one [R, Hv] x [Hv, block] product).
  # A 1-byte value cache read as int32 words (`value_words`: its dtype)
  # takes four parts too, each word's value u (`one_byte.word_values`):
  # columns u, u + 4, ... of the chunk.
  parts = value_chunk // head_chunk if latent else 4 if value_words else 1
  part = value_chunk // parts
  other_chunks = head_chunks - parts if latent else head_chunks
  # The value scales: a latent cache's are the key's.
  v_scale_name = "k_scale" if latent else "v_scale"
  # A quantized cache's tiles are read as stored (1 byte an element) and
  # converted here to the queries' dtype, which holds every int8 and
  # float8 value exactly; the scales act on the logits and on P
  # (`_scale_input`). One scale for the program's whole cache is read once.
  compute = refs["q"].dtype
  constant = {name: refs[name][(0,) * refs[name].ndim]
              for name in ("k_scale", "v_scale")
              if name in refs and math.prod(refs[name].shape) == 1}
  # A 1-byte key tile under bfloat16 queries converts to float16 (float8:
  # one instruction per two values, int8: five per four, `one_byte`), not
  # to bfloat16 (two or three a value; `_float16_queries`).
  key_dtype, q_keys, key_unscale = compute, q_whole, None
  if (compute == jnp.bfloat16 and q_whole is not None and not latent
      and quantize.is_quantized(refs["k"].dtype)):
    key_dtype = jnp.float16
    q_keys, key_unscale = _float16_queries(q_whole)
  # A 1-byte value tile likewise multiplies P in float16, P scaled by a
  # power of two that takes its largest entry into [2^14, 2^15), so that
  # small entries keep their bits (float16's smallest normal is 2^-14):
  # 2^14 for P alone (at most 1); with per-key value scales c (P c) one
  # per block from the block's largest c, the accumulator then carried in
  # the latest block's unit (2^-e, `unit`; the exact change of unit folds
  # into alpha).
  value_dtype, per_key_units = compute, False
  if (compute == jnp.bfloat16 and not latent
      and quantize.is_quantized(value_words or refs["v"].dtype)):
    value_dtype = jnp.float16
    per_key_units = "v_scale" in refs and "v_scale" not in constant

  # The logits are the products times the scale alone (no cap or
  # score_mod): the max is taken on the products and the scale is applied
  # in the exponent's FMA (`online_softmax.exponent_scale`).
  exponent_scale = online_softmax.exponent_scale(
      scale, cap=soft_cap, has_score_mod=score_mod is not None)

  def key_rows(j):
    """(position of the first key read, (leading index, rows) in the K/V
    refs) of block j."""
    if page_size is None:
      # A last block that would run past the cache reads the cache's last
      # `block` rows instead (no padded copy); the keys of block j - 1
      # among them are masked.
      start = jnp.minimum(j * block, cache_len - block)
      return start, (pl.ds(start, block),)
    # Traced block-table entries outside the pool read a page inside it
    # (`decode.decode_attention`).
    if page_size % block == 0:
      per_page = page_size // block
      page = jnp.clip(refs["table"][j // per_page], 0, num_pages - 1)
      offset = pl.multiple_of((j % per_page) * block, block)
      return j * block, (page, pl.ds(offset, block))
    # The block spans pages: each key's row is gathered through its own
    # table entry ([block] int32 each; a load with per-row addresses,
    # contiguous along the head dim). Entries past the row's table (a
    # last block past max_pages * page_size) read its last one: keys past
    # the length, masked.
    pos = j * block + jnp.arange(block, dtype=jnp.int32)
    entry, row = _div_rem(pos, page_size)
    entry = jnp.minimum(entry, max_pages - 1)
    page = jnp.clip(refs["table"][entry], 0, num_pages - 1)
    return j * block, (page, row)

  def block_scales(name, lead, valid):
    """The scales of a block's keys: [1, block], or a scalar when they are
    one for the block (None: no scales). Those of keys past the length
    (`valid` False; None: all valid) may be NaN: zeroed."""
    if name not in refs:
      return None
    if name in constant:
      return constant[name]
    ref = refs[name]
    # An axis of size 1 is broadcast: its index is 0 (a stride of 0).
    c = ref[tuple(i if d > 1 else 0 for i, d in zip(lead, ref.shape))]
    if valid is not None:
      c = jnp.where(valid, c, jnp.zeros((), c.dtype))
    return c if c.ndim == 0 else c[None, :]

  def other_chunk(i):
    """Key chunk of Q.K^T's i-th step: past a latent program's value
    columns when it reaches them."""
    if not latent:
      return i
    if value_chunks == 1:
      return i + parts
    return jnp.where(i >= column * parts, i + parts, i)

  def value_tile(lead, u, valid):
    """Part u of the block's value tile, [block, part]: columns of the key
    (latent) or of the value (words: each word's value u), rows past the
    length (which may hold NaN, and 0 * NaN is NaN in P.V) zeroed."""
    if value_words:
      cols = None
      words = refs["v"][(*lead, pl.ds(pl.multiple_of(column * part, part),
                                      part))]
      v = one_byte.word_values(words, u, value_words)
    else:
      cols = pl.ds(pl.multiple_of(value_start + u * part, part) if u else
                   value_start, part)
      v = _tile_as(refs["k" if latent else "v"][(*lead, cols)], value_dtype)
    if valid is not None:
      v = jnp.where(valid[:, None], v, jnp.zeros((), v.dtype))
    return cols, v

  def step(j, carry, *, masked=True):
    m_i, l_i, acc, unit = carry
    start, lead = key_rows(j)
    if head_chunks == 1 and not latent:
      qk = _dot_nt(q_keys, _tile_as(refs["k"][(*lead, slice(None))],
                                    key_dtype), precision)
    else:
      def chunk(i, qk):
        c = other_chunk(i)
        cols = pl.ds(pl.multiple_of(c * head_chunk, head_chunk), head_chunk)
        q = _load(refs["q"].at[:, cols], q_mask, 0)
        return qk + _dot_nt(q, _tile_as(refs["k"][(*lead, cols)], compute),
                            precision)

      qk = jnp.zeros((rows, block), _F32)
      if other_chunks:
        qk = jax.lax.fori_loop(0, other_chunks, chunk, qk)
    kv_pos = start + jnp.arange(block, dtype=jnp.int32)
    valid = None
    if masked:
      valid = (kv_pos >= j * block) & (kv_pos < length)
    v_parts = []
    if latent:
      # The value tile, the key's columns: read here once, it completes
      # Q.K^T (the rows it zeroes past the length are masked below) and
      # then serves P.V.
      for u in range(parts):
        cols, v = value_tile(lead, u, valid)
        q = q_whole if head_chunks == 1 else _load(
            refs["q"].at[:, cols], q_mask, 0)
        qk = qk + _dot_nt(q, v, precision)
        v_parts.append(v)
    k_scale = block_scales("k_scale", lead, valid)
    # Dequantizing: q . (k * c) = (q . k) * c for the key's scale c, and
    # float16 queries' power of two with it (one multiply a logit).
    key_factor = k_scale
    if key_unscale is not None:
      key_factor = key_unscale if k_scale is None else k_scale * key_unscale
    if key_factor is not None:
      qk = qk * key_factor
    # The cache positions' per-key flex values (paged: logical positions).
    cols = pl.ds(start, block)
    if exponent_scale is not None:
      s = qk  # The logit scale goes into the exponent's FMA (`update`).
    elif score_mod is None:
      s, _ = online_softmax.logits(qk, scale=scale, cap=soft_cap,
                                   base2=True)
    else:
      s, _ = online_softmax.logits(qk, scale=scale, cap=soft_cap)
      s = score_mod.tile(_flex_values(refs, score_mod, cols),
                         q_idx=row_pos, kv_idx=kv_pos[None, :], score=s)
      s = s * online_softmax.LOG2_E
    if masked:
      visible = masking.visible(
          is_causal=is_causal, window=window, q_pos=row_pos,
          kv_pos=kv_pos[None, :], dense=valid[None, :])
      if mask_mod is not None:
        visible = visible & mask_mod.tile(
            _flex_values(refs, mask_mod, cols), q_idx=row_pos,
            kv_idx=kv_pos[None, :])
      s = online_softmax.apply_mask(s, visible)
    m_i, l_i, p, alpha = online_softmax.update(
        m_i, l_i, s, base2=True, tile_exp=exp2.exp2, scale=exponent_scale)
    if not latent:
      # [block, value_chunk], or its four word parts.
      v_parts = [value_tile(lead, u, valid)[1] for u in range(parts)]
    v_scale = k_scale if latent else block_scales("v_scale", lead, valid)
    if per_key_units:
      up, down = _power_of_two(v_scale)
      v_scale = v_scale * up
      alpha = alpha * (up * unit)
      unit = down
    elif value_dtype != compute:
      p = p * _P_UNIT
    if v_scale is not None and v_scale_name not in constant:
      # P . (v * c) = (P * c) . v for the value's scale c (a constant one
      # scales the output once, below).
      p = p * v_scale
    acc = tuple(online_softmax.rescale(a, alpha) + _dot(
        p.astype(value_dtype), v, precision) for a, v in zip(acc, v_parts))
    return m_i, l_i, acc, unit

  m_i, l_i, acc = online_softmax.init((rows,), (rows, part))
  carry = m_i, l_i, (acc,) * parts, jnp.float32(1) if per_key_units else None
  if "order" in refs:
    # A mask_mod's blocks: positions [first, end) of this K/V head's list,
    # those below n_full FULL (no masking at all).
    order, n_full = refs["order"], span[3]

    def listed(masked):
      def body(i, carry):
        return step(order[i], carry, masked=masked)
      return body

    carry = jax.lax.fori_loop(first, jnp.minimum(end, n_full),
                              listed(False), carry)
    carry = jax.lax.fori_loop(jnp.maximum(first, n_full), end, listed(True),
                              carry)
  else:
    # The run's blocks that every row sees whole
    # (`masking.decode_whole_blocks`) skip the masking; the masked loop
    # takes the rest, at most a block or two at either end of the run (the
    # length's, a window's).
    whole_first = jnp.clip(whole_lo, first, end)
    whole_end = jnp.clip(whole_hi, whole_first, end)
    carry = jax.lax.fori_loop(whole_first, whole_end,
                              functools.partial(step, masked=False), carry)
    head = whole_first - first

    def edge(i, carry):
      return step(jnp.where(i < head, first + i, whole_end + i - head),
                  carry)

    carry = jax.lax.fori_loop(0, head + end - whole_end, edge, carry)
  m_i, l_i, acc, unit = carry
  if value_dtype != compute and not per_key_units:
    unit = 1 / _P_UNIT
  outs = []
  for a in acc:
    out, lse = online_softmax.finalize(m_i, l_i, a, base2=True)
    if unit is not None:
      out = out * unit
    if v_scale_name in constant:
      out = out * constant[v_scale_name]
    outs.append(out)
  def out_at(*cols):
    return refs["out"].at[(slice(None), *cols)]

  if parts == 1:
    _store(out_at(), outs[0], q_mask)
  elif not value_words:
    for u, out in enumerate(outs):
      _store(out_at(slice(u * part, (u + 1) * part)), out, q_mask)
  elif gpu_target.builds_ptx():
    # Word part u holds columns u, u + 4, ...: strided stores.
    for u, out in enumerate(outs):
      _store(out_at(pl.ds(u, part, stride=parts)), out, q_mask)
  else:  # The interpreter stores no strided slice: interleaved here.
    _store(out_at(), jnp.stack(outs, axis=-1).reshape(rows, -1), q_mask)
  _store(refs["lse"], lse, row_ok)


def _scale_input(scale, *, paged: bool, cache_len: int):
  """(array, BlockSpec) of a quantized cache's float32 scales, rank 3, each
  dim 1 or the cache's: contiguous [B, S_max, K], paged [P, page_size, K].

  Passed as they are, never broadcast to full size: a program's block is
  its sequence's (contiguous; all pages when paged) scales of its K/V
  head, and a dim of size 1 is a broadcast one, its index 0 wherever the
  cache's is not (in effect a stride of 0: every program, page or key
  reads the same scale). In the kernel a key axis of size 1 is one scalar
  load per block (per page), and a scale with no key axis left (one per
  sequence, K/V head or cache) one load per program
  (`_kernel.block_scales`). A contiguous cache shorter than one block is
  padded to one block (`_split_call`), its scales with it.
  """
  lead, rows, heads = scale.shape
  if not paged and rows > 1:
    scale = masking.pad_axes(scale, {1: cache_len})

  def index(i, k, j):
    del j
    return (i if lead > 1 and not paged else 0, 0, k if heads > 1 else 0)

  return scale, triton.block_spec(
      (lead if paged else None, scale.shape[1], None), index)


def _split_call(q, key, value, block_table, inputs, row_pos, *, r: int,
                new_tokens: int, block: int, splits: int, scale: float,
                is_causal: bool, local_window_size, logits_soft_cap,
                precision, score_mod=None, score_mod_args=(), mask_mod=None,
                mask_mod_args=(), lists=None, key_scale=None,
                value_scale=None, value_head_dim=None, position_offset=0,
                num_warps=None, max_value_chunk=None):
  """The split kernel on packed queries q [B, K, R, H] (R = G * T_new,
  not padded) and the cache as given; `inputs` holds what tells a program
  its run ("len" and maybe "qpos", each read plus `position_offset`, or a
  mask_mod's lists) and `row_pos`,
  [B, R], each packed row's position, is needed with flex attention only.
  A quantized cache comes with its scales or None (`_scale_input`). With
  `value_head_dim` the cache is latent: `value` is ignored (the key's
  first `value_head_dim` columns are the values, its scales theirs).

  Returns (out float32 [B, K, splits, R, Hv padded], lse float32 [B, K,
  splits, R]): every split's normalised partial result (the value head dim
  padded as `value_tiling` pads it).
  """
  b, num_kv, _, h = q.shape
  latent = value_head_dim is not None
  if latent:
    value, value_scale = None, None  # The key's columns and scales.
  hv = value_head_dim if latent else value.shape[3]
  rows = packed_rows(r)
  # A latent program's value columns [c * value_chunk, (c + 1) *
  # value_chunk) of the key (hvp <= hp) are whole key chunks.
  hp, head_chunk = key_tiling(h, rows, value_head_dim, max_value_chunk)
  hvp, value_chunk = value_tiling(hv, rows, max_value_chunk)
  num_value_chunks = hvp // value_chunk
  q = masking.pad_axes(q, {3: hp})
  # A 1-byte value cache under 16-bit queries (float16 products) is read
  # as int32 words of four values along the head dim (`one_byte`), where
  # each program's value chunk is wide enough.
  value_words = None
  if (not latent and q.dtype in (jnp.bfloat16, jnp.float16)
      and quantize.is_quantized(value.dtype)
      and value_chunk >= _WORDS_MIN_COLUMNS):
    value_words = value.dtype
  if block_table is None:
    num_blocks = -(-key.shape[1] // block)
    capacity = key.shape[1]
    # Only a cache shorter than one block is padded (to one block).
    cache_len = max(key.shape[1], block)
    key = masking.pad_axes(key, {1: cache_len, 3: hp})
    if not latent:
      value = masking.pad_axes(value, {1: cache_len, 3: hvp})
    page_size = max_pages = None
    cache_block = (None, cache_len, None)

    def cache_index(i, k, j):
      return (i, 0, k, 0)
  else:
    page_size = cache_len = key.shape[1]
    max_pages = block_table.shape[1]
    capacity = max_pages * page_size
    # A block spans pages where `block` does not divide the page size
    # (`_kernel.key_rows`); the last may run past the capacity.
    num_blocks = -(-capacity // block)
    key = masking.pad_axes(key, {3: hp})
    if not latent:
      value = masking.pad_axes(value, {3: hvp})
    cache_block = (key.shape[0], page_size, None)

    def cache_index(i, k, j):
      return (0, 0, k, 0)
  splits = max(1, min(splits, num_blocks))

  def split_of(j):
    return j // num_value_chunks

  def column_of(j):
    return j % num_value_chunks

  inputs = {
      # A block of `rows` rows runs past the R rows of q and of the
      # outputs: the kernel masks those rows (no padded copy of q).
      "q": (q, triton.block_spec((None, None, rows, hp),
                                 lambda i, k, j: (i, k, 0, 0))),
      **inputs,
      "k": (key, triton.block_spec((*cache_block, hp), cache_index)),
  }
  if value_words is not None:
    inputs["v"] = (one_byte.as_words(value), triton.block_spec(
        (*cache_block, hvp // 4), cache_index))
  elif not latent:
    inputs["v"] = (value, triton.block_spec((*cache_block, hvp),
                                            cache_index))
  for name, x in (("k_scale", key_scale), ("v_scale", value_scale)):
    if x is not None:
      inputs[name] = _scale_input(x, paged=block_table is not None,
                                  cache_len=cache_len)
  if lists is not None:
    inputs["span"] = _listed_spans(inputs.pop("len")[0][:, 0], lists,
                                   split_of)
    order = lists[0]
    width = layout.next_power_of_2(num_blocks)  # Triton's block shapes.
    inputs["order"] = (masking.pad_axes(order, {2: width}), triton.block_spec(
        (None, None, width), lambda i, k, j: (i, k, 0)))
  if block_table is not None:
    table = block_table.astype(jnp.int32)
    inputs["table"] = (table, triton.block_spec(
        (None, table.shape[1]), lambda i, k, j: (i, 0)))
  outputs = {
      "out": (jax.ShapeDtypeStruct((b, num_kv, splits, r, hvp), _F32),
              triton.block_spec(
                  (None, None, None, rows, value_chunk),
                  lambda i, k, j: (i, k, split_of(j), 0, column_of(j)))),
      "lse": (jax.ShapeDtypeStruct((b, num_kv, splits, r), _F32),
              triton.block_spec((None, None, None, rows),
                                lambda i, k, j: (i, k, split_of(j), 0))),
  }
  fused = _add_flex_inputs(
      inputs, row_pos, num_kv=num_kv, rows=rows, r=r, new_tokens=new_tokens,
      kv_positions=num_blocks * block if page_size else cache_len,
      flex=((mods.SCORE_MOD, score_mod, score_mod_args),
            (mods.MASK_MOD, mask_mod, mask_mod_args)))
  kernel = functools.partial(
      _kernel, **fused, block=block, head_chunk=head_chunk,
      head_chunks=hp // head_chunk, value_chunk=value_chunk,
      value_chunks=num_value_chunks, page_size=page_size,
      max_pages=max_pages, cache_len=cache_len, capacity=capacity,
      num_pages=key.shape[0], splits=splits, new_tokens=new_tokens,
      real_rows=r, scale=scale, soft_cap=logits_soft_cap,
      is_causal=is_causal, window=local_window_size, precision=precision,
      latent=latent, position_offset=position_offset,
      value_words=value_words)
  target = gpu_target.current()
  # 0: the local GPU did not say.
  smem = target.shared_memory_per_block if target else 0
  warps, stages = _launch(
      rows, max(head_chunk, value_chunk), paged=page_size is not None,
      warps=num_warps, one_warpgroup=(
          target is not None and target.major == 9
          and q.dtype.itemsize == 2
          and (key.dtype == q.dtype
               or (not latent and key.dtype.itemsize == 1
                   and value.dtype.itemsize == 1))),
      tile_bytes=block * (hp + (0 if latent else value_chunk))
      * key.dtype.itemsize,
      shared_memory=smem or None)
  return triton.pallas_call(
      kernel, inputs, outputs, (b, num_kv, splits * num_value_chunks), warps,
      stages, "flash_decode")


def partials(q, row_pos, query_positions, key, value, lengths, block_table,
             *, block: int, splits: int, scale: float, is_causal: bool,
             local_window_size, logits_soft_cap, precision, score_mod=None,
             score_mod_args=(), mask_mod=None, mask_mod_args=(),
             kinds=None, key_scale=None, value_scale=None,
             value_head_dim=None, num_warps=None):
  """The kernel's per-split results on the packed layout of `decode`
  (`decode_attention` takes this path with a mask_mod; without one,
  `attention` runs the whole call in two kernels).

  Args:
    q: packed queries [B, K, R, H], R = G * T_new.
    row_pos: int32 [B, R], each row's query position.
    query_positions: int32 [B, T_new].
    key, value: the cache, contiguous [B, S_max, K, H] or pages
      [P, page_size, K, H] with `block_table` int [B, max_pages].
    lengths: int32 [B], within the cache.
    block: keys per block (`block_for`).
    splits: parts of each sequence's visible keys (at most one per block).
    scale, is_causal, local_window_size, logits_soft_cap, precision: the
      call's validated static arguments.
    score_mod, score_mod_args, mask_mod, mask_mod_args: flex attention
      (checked), fused into the kernel (see the module docstring).
    kinds: None, or with a mask_mod int32 [B, K, blocks], every block's
      kind for each K/V head (`decode.block_kinds`): a program visits its
      share of the non-empty blocks (`masking.listed_runs`), the FULL ones
      without masking.
    key_scale, value_scale: None, or a quantized cache's float32 scales,
      rank 3 with each dim 1 or the cache's (`decode_attention`).
    value_head_dim: None, or Hv of a latent cache: `value` is the key
      (`decode.front`), whose first Hv columns the kernel reads as the
      values from the key tiles (no value operand), the key scales
      dequantizing both.
    num_warps: None (`_launch`'s default) or the warps per program.

  Returns:
    (out float32 [B, K, splits, R, Hv], lse float32 [B, K, splits, R]):
    normalised partial results, merged by `online_softmax.merge_parts` on
    axis 2 (a split with no visible key has lse -inf).
  """
  b, _, r, _ = q.shape
  rows = packed_rows(r)
  inputs = {"len": (lengths.astype(jnp.int32).reshape(b, 1),
                    triton.block_spec((None, 1), lambda i, k, j: (i, 0)))}
  lists = None
  if kinds is not None:
    # As many runs as `_split_call` launches splits (at most one a block).
    splits = max(1, min(splits, kinds.shape[-1]))
    lists = masking.listed_runs(kinds, splits)
    inputs["pos"] = (masking.pad_axes(row_pos, {1: rows}), triton.block_spec(
        (None, rows), lambda i, k, j: (i, 0)))
  else:
    inputs["qpos"] = _qpos_input(query_positions)
  out, lse = _split_call(
      q, key, value, block_table, inputs, row_pos, r=r,
      new_tokens=query_positions.shape[1], block=block, splits=splits,
      scale=scale, is_causal=is_causal, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, precision=precision,
      score_mod=score_mod, score_mod_args=score_mod_args, mask_mod=mask_mod,
      mask_mod_args=mask_mod_args, lists=lists, key_scale=key_scale,
      value_scale=value_scale, value_head_dim=value_head_dim,
      num_warps=num_warps)
  return out[..., :value_head_dim or value.shape[3]], lse


def _qpos_input(query_positions):
  """The new tokens' positions [B, T_new], read a scalar at a time."""
  qpos = query_positions.astype(jnp.int32)
  return qpos, triton.block_spec((None, qpos.shape[1]),
                                 lambda i, k, j: (i, 0))


@functools.partial(jax.jit, static_argnames=(
    "block", "splits", "scale", "is_causal", "local_window_size",
    "logits_soft_cap", "precision", "score_mod", "mask_mod",
    "value_head_dim", "num_warps", "max_value_chunk"))
def attention(query, key, value, lengths, block_table, query_positions,
              sinks, *, block: int, splits: int, scale: float,
              is_causal: bool, local_window_size, logits_soft_cap,
              precision, score_mod=None, score_mod_args=(), mask_mod=None,
              mask_mod_args=(), key_scale=None, value_scale=None,
              value_head_dim=None, num_warps=None, max_value_chunk=None):
  """`decode_attention(implementation="triton")` without a mask_mod, as
  two kernels: the split kernel and the merge.

  A decode step moves little data, so a launch costs about as much as a
  small fusion's work: nothing runs before the split kernel at T_new = 1
  (its programs find their key runs from the raw lengths and positions and
  clamp them themselves, the packed queries are a reshape of the query,
  unpadded), and one Pallas kernel merges the splits, adds the sinks and
  writes the output in the query's dtype and layout. T_new > 1 adds the
  transposes of the packing; flex attention its values per row and key.

  Args:
    query: [B, T_new, N, H].
    key, value: the cache, contiguous [B, S_max, K, H] or pages
      [P, page_size, K, H] with `block_table` int [B, max_pages].
    lengths: int [B], checked when concrete, else clamped here.
    block_table: None or int [B, max_pages] (clamped into the pool here).
    query_positions: None (the last T_new positions below each length) or
      int [B, T_new].
    sinks: None or float32 [N].
    block, splits, scale, is_causal, local_window_size, logits_soft_cap,
      precision, score_mod, score_mod_args, key_scale, value_scale,
      value_head_dim, num_warps: as for `partials` (`mask_mod` must be
      None).
    max_value_chunk: None, or the most value columns a program computes
      (`value_tiling`; more programs a split, fewer splits).

  Returns:
    (out [B, T_new, N, Hv] in the query's dtype, lse float32 [B, T_new,
    N]).
  """
  if mask_mod is not None:
    raise NotImplementedError(
        "a mask_mod's block lists take `partials` (decode.kernels.run).")
  b, t, n, _ = query.shape
  num_kv = key.shape[2]
  g = n // num_kv
  if sinks is not None:
    # Packed row r of K/V head k belongs to query head k * G + r // T.
    sinks = sinks.astype(_F32).reshape(num_kv, g)
    if t > 1:
      sinks = jnp.repeat(sinks, t, axis=1)
  hv = value_head_dim or value.shape[3]
  out, lse = _row_partials(
      query, key, value, lengths, block_table, query_positions, block=block,
      splits=splits, scale=scale, is_causal=is_causal,
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
      precision=precision, score_mod=score_mod,
      score_mod_args=score_mod_args, key_scale=key_scale,
      value_scale=value_scale, value_head_dim=value_head_dim,
      num_warps=num_warps, max_value_chunk=max_value_chunk)
  out, lse = decode_merge.merge_splits(
      out, lse, sinks, dtype=query.dtype, value_head_dim=hv)
  if t == 1:
    return out.reshape(b, 1, n, hv), lse.reshape(b, 1, n)
  out = out.reshape(b, num_kv, g, t, hv).transpose(0, 3, 1, 2, 4)
  lse = lse.reshape(b, num_kv, g, t).transpose(0, 3, 1, 2)
  return out.reshape(b, t, n, hv), lse.reshape(b, t, n)


@functools.partial(jax.jit, static_argnames=(
    "block", "splits", "prefix_block", "prefix_splits", "scale",
    "is_causal", "local_window_size", "logits_soft_cap", "precision",
    "num_warps", "prefix_num_warps"))
def attention_with_prefix(query, key, value, lengths, block_table,
                          query_positions, sinks, prefix_key, prefix_value,
                          *, block: int, splits: int, prefix_block: int,
                          prefix_splits: int, scale: float, is_causal: bool,
                          local_window_size, logits_soft_cap, precision,
                          key_scale=None, value_scale=None, num_warps=None,
                          prefix_num_warps=None):
  """`decode_attention` with a shared prefix, one new token a row, in
  three kernels and the fold's transpose (`decode.kernels.run_with_prefix`):

  * the prefix's split kernel: the B rows' new tokens are one row's B new
    tokens (packed row g * B + b: row b's query head k * G + g), the
    prefix read once for all rows, its keys split over the programs;
  * the rows' split kernel over their own caches, positions shifted by
    S_p as in the concatenation `[prefix; cache[b]]`;
  * one merge of both kernels' partials
    (`decode_merge.merge_splits(prefix=...)`), which adds the sinks and
    writes the output.

  Args:
    query: [B, 1, N, H].
    key, value, lengths, block_table: the rows' own caches, as for
      `attention` (not latent).
    query_positions: None (each row's length plus S_p, less one) or int
      [B, 1], the new tokens' positions in the concatenation; the kernels
      read them (or the lengths) with the prefix's offset, so that no
      fusion runs before them.
    sinks: None or float32 [N].
    prefix_key, prefix_value: [S_p, K, H] and [S_p, K, Hv], the query's
      dtype.
    block, splits: the rows' kernel's tiling; prefix_block, prefix_splits:
      the prefix's (`decode.kernels._tiling` of the folded row);
      prefix_num_warps: the prefix kernel's warps (None: `num_warps`).
    scale, is_causal, local_window_size, logits_soft_cap, precision,
      key_scale, value_scale, num_warps: as for `attention`.

  Returns:
    (out [B, 1, N, Hv] in the query's dtype, lse float32 [B, 1, N]).
  """
  b, t, n, h = query.shape
  if t != 1:
    raise NotImplementedError(
        "attention_with_prefix folds one new token a row (T_new = 1), got "
        f"{t}; decode.prefix.attend takes the others.")
  s_p, num_kv, hv = prefix_key.shape[0], key.shape[2], value.shape[3]
  static = dict(scale=scale, is_causal=is_causal,
                local_window_size=local_window_size,
                logits_soft_cap=logits_soft_cap, precision=precision,
                num_warps=num_warps)
  if query_positions is None:
    # The rows' kernel takes its default (its length less one, in its own
    # cache); the prefix's reads each row's length, plus S_p less one.
    positions, own_offset, shared_offset = lengths, 0, s_p - 1
  else:
    positions, own_offset, shared_offset = query_positions[:, 0], -s_p, 0
  own = _row_partials(
      query, key, value, lengths, block_table, query_positions, block=block,
      splits=splits, key_scale=key_scale, value_scale=value_scale,
      position_offset=own_offset, **static)
  shared = _row_partials(
      query.reshape(1, b, n, h), prefix_key[None], prefix_value[None],
      jnp.full((1,), s_p, jnp.int32), None, positions.reshape(1, b),
      block=prefix_block, splits=prefix_splits,
      position_offset=shared_offset,
      **dict(static, num_warps=prefix_num_warps or num_warps))
  if sinks is not None:
    sinks = sinks.astype(_F32).reshape(num_kv, n // num_kv)
  out, lse = decode_merge.merge_splits(*own, sinks, dtype=query.dtype,
                                       value_head_dim=hv, prefix=shared)
  return out.reshape(b, 1, n, hv), lse.reshape(b, 1, n)


def _row_partials(query, key, value, lengths, block_table, query_positions,
                  *, block, splits, scale, is_causal, local_window_size,
                  logits_soft_cap, precision, score_mod=None,
                  score_mod_args=(), key_scale=None, value_scale=None,
                  value_head_dim=None, position_offset=0, num_warps=None,
                  max_value_chunk=None):
  """The split kernel's partials (`_split_call`) for the queries [B, T_new,
  N, H] packed as [B, K, G * T_new, H]: packed row r of K/V head k is new
  token r % T_new of query head k * G + r // T_new. `query_positions`
  (None: the last T_new below each length) are read plus
  `position_offset` (no score_mod)."""
  b, t, n, h = query.shape
  num_kv = key.shape[2]
  g = n // num_kv
  r = g * t
  if t == 1:
    q = query.reshape(b, num_kv, g, h)
  else:
    q = query.reshape(b, t, num_kv, g, h).transpose(0, 2, 3, 1, 4).reshape(
        b, num_kv, r, h)
  lengths = lengths.astype(jnp.int32)
  inputs = {"len": (lengths.reshape(b, 1),
                    triton.block_spec((None, 1), lambda i, k, j: (i, 0)))}
  if query_positions is not None:
    inputs["qpos"] = _qpos_input(query_positions)
  row_pos = None
  if score_mod is not None:
    # Packed row r is the new token r % T_new (`decode.plan.packed`).
    positions = query_positions
    if positions is None:
      positions = (lengths[:, None] - t
                   + jnp.arange(t, dtype=jnp.int32)[None, :])
    row_pos = jnp.tile(positions.astype(jnp.int32), (1, g))
  return _split_call(
      q, key, value, block_table, inputs, row_pos, r=r, new_tokens=t,
      block=block, splits=splits, scale=scale, is_causal=is_causal,
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
      precision=precision, score_mod=score_mod,
      score_mod_args=score_mod_args, key_scale=key_scale,
      value_scale=value_scale, value_head_dim=value_head_dim,
      position_offset=position_offset, num_warps=num_warps,
      max_value_chunk=max_value_chunk)


def _add_flex_inputs(inputs, row_pos, *, num_kv, rows, r, new_tokens,
                     kv_positions, flex) -> dict:
  """Splits the call's score_mod / mask_mod (`fused_mods`), adds their
  values to `inputs` (per packed row: [B, K, rows]; per cache position:
  [B, kv_positions]; `fused_mods.packed_values`) and returns them as
  `_kernel`'s arguments.

  Raises:
    NotImplementedError: a function the kernel cannot fuse.
  """
  out = {}
  for name, fn, args in flex:
    if fn is None:
      continue
    mod = fused_mods.split(name, fn, args, "triton decode")
    values = fused_mods.packed_values(
        mod, args, row_pos[:, :r], num_kv=num_kv, new_tokens=new_tokens,
        kv_positions=kv_positions, backend="triton decode")
    for i, (res, value) in enumerate(zip(mod.residuals, values)):
      if res.level == fused_mods.Level.COLUMN:
        spec = triton.block_spec((None, kv_positions),
                                 lambda i, k, j: (i, 0))
      else:
        value = masking.pad_axes(value, {2: rows})  # [B, K, rows]
        spec = triton.block_spec((None, None, rows),
                                 lambda i, k, j: (i, k, 0))
      if value.dtype == jnp.bool_:  # Triton loads bytes.
        value = value.astype(jnp.int8)
      inputs[triton_kernel.residual_name(mod, i)] = (value, spec)
    out[name] = mod
  return out


def _launch(rows: int, chunk: int, paged: bool = False, *,
            tile_bytes: int = 0, shared_memory: int | None = None,
            warps: int | None = None,
            one_warpgroup: bool = False) -> tuple[int, int]:
  """(warps, software-pipeline stages): 4 warps cover a 16-row tile; wider
  tiles take 8 so the per-thread share of the accumulator stays small
  (`warps`: the caller's choice instead, `decode_attention(num_warps=)`),
  but a 64-row tile of 128-column chunks takes 4 where `one_warpgroup`
  (Hopper, 16-bit queries over a cache of their dtype, or over a 1-byte
  key and value cache: a shared prefix's 16 rows x 4 query heads folded
  into one tile, or G x T_new = 64). 64 rows are one warpgroup's wgmma
  M: with 4 warps every row's max and sum stay within its warps, and the
  program needs 210 registers and 114,688 B of shared memory, two
  programs an SM; 8 warps split the keys over two warpgroups, whose row
  statistics meet through shared memory and barriers, at 130 registers
  over 256 threads, one program an SM (ptxas, sm_90a, bf16, H = 128, 64
  keys: 386 SASS instructions a warp and 64 keys in the loop, 1,544 a
  program, against 344 and 2,752; the 16 rows' 16k-key prefix pass ran
  at 40 % of HBM with 8, 07213ac). Over an int8 cache the same holds:
  231 registers against 166 (one program an SM), 776 instructions a warp
  and 64 keys, 3,104 a program, against 679 and 5,432 (float8: 229
  registers, 694 a warp, against 166 and 637).

  Three stages keep two blocks of keys in flight per program while it
  computes on a third: with two programs an SM (a B = 1 step's grid), two
  stages left a 1-byte cache waiting on memory latency (int8 as slow as
  bfloat16). On an H200 (B = 1, S = 32k, K = 8, H = 128), against two
  stages: bfloat16 42.5 -> 38.3 us, int8 44.3 -> 38.3, float8 50.2 ->
  42.1, 16 rows sharing a 16k prefix 79.3 -> 65.5; four stages were
  slower than three.

  A paged cache takes two more: Triton's pipeliner gives a load whose
  address comes from another load in the loop (the K/V tiles, from the
  block table's entries) its own share of the stages, so three stages
  kept one K/V block in flight (the shared memory of two stages) and
  five keep two, as three do for a contiguous cache (ptxas, sm_90a, jax
  0.10.2 and 0.11.2, H = 128, bfloat16, 4 query heads per K/V head:
  88,576 B of shared memory over 16-key pages against 88,064 contiguous,
  and 121 registers against 125 with three stages).

  Fewer stages where the blocks in flight would not fit the target's
  shared memory (`shared_memory` bytes a block; None: no limit, as
  interpreted): Triton holds about one K/V block (`tile_bytes`) more than
  it keeps in flight (float32, H = 128, 64 keys: 176,128 B at three
  stages, past an A100's 166,912), and never fewer than one in flight.
  """
  if warps is None:
    warps = 4 if rows * chunk <= 16 * 128 else 8
    if one_warpgroup and rows == 64 and chunk == 128:
      warps = 4
  # Stages the pipeliner spends on other than K/V blocks in flight.
  spare = 3 if paged else 1
  stages = 5 if paged else 3
  while (shared_memory is not None and stages > spare + 1
         and (stages - spare + 1) * tile_bytes > shared_memory):
    stages -= 1
  return warps, stages

