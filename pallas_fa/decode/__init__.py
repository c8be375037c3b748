"""`decode_attention`: a few new query tokens against a (paged) KV cache.

The package: `front` (the public function and its checks), `plan` (GQA
packing, split counts, mask_mod block kinds, the merge of the splits),
`chunked` (the jax.numpy path), `kernels` (the Pallas kernels of
`triton.decode`, `mosaic_tpu.decode` and `mosaic_gpu.decode`) and `merge`
(`merge_attention`, the public merge of partial results).

Generation is memory-bound: each step reads the whole K/V cache once and does
little arithmetic per byte, so its speed limit is bytes read over memory
bandwidth. Two things get close to that limit (FlashDecoding):

* **GQA packing.** All G query heads of a K/V head, and all T_new new tokens,
  form one [G * T_new, H] tile, so each K/V byte is read once per K/V head,
  not once per query head.
* **Split-KV.** The key axis is split into `num_splits` parts that run
  side by side (one program each in the `triton` and `mosaic_tpu` kernels,
  one vectorised axis in `chunked`), each keeping its own online-softmax
  statistics; the partial results are merged exactly through their
  logsumexp. With one long sequence and few heads the splits are what fill
  the machine.

The cache is either contiguous, `[B, S_max, K, H]`, or **paged**: pages
`[num_pages, page_size, K, H]` plus a block table `[B, max_pages]` naming the
page that holds each sequence's keys [i * page_size, (i + 1) * page_size).
Both are read block by block (`chunked` through a table, a contiguous cache
being its own identity table, so one code path serves both). Per-sequence
`lengths` make the batch ragged; rows past a sequence's length are never
read into a result (they may hold anything, NaN included).

Semantics are `flash_attention`'s on the gathered cache: the new tokens sit at
positions `lengths - T_new + arange(T_new)` unless `query_positions` says
otherwise; keys are at their cache index; causal, sliding window and soft cap
act on those positions; attention sinks join once, after the splits merge.
Forward only.

Four implementations:

* `chunked` (the default): jax.numpy on any platform and head dim; split p
  reads blocks p, p + splits, ... of every sequence, all splits as one
  vectorised axis.
  A flex `mask_mod` (`q_idx` is the new token's position) is first
  classified over every step's keys, so keys no new token sees are never
  read and keys all of them see whole skip the masking.
* `triton`: a Pallas-Triton kernel (`triton.decode`), interpreted on CPU.
  Grid (B, K, splits x value-head-dim chunks): each program holds the
  packed [G * T_new, H] tile (rows padded to a power of two >= 16) and
  walks one contiguous run of the sequence's visible key blocks (blocks
  past the length, after the last query under causal or outside the
  window are never read), which it finds from the lengths itself; a
  second small kernel merges the partials (`online_softmax.merge_parts`),
  so a one-token step launches two kernels (with a mask_mod, its block
  lists are built and the partials merged in plain JAX). A paged cache
  is read page by page through the block table, in blocks of the largest
  power of two that divides the page size (multiples of 16). Head dims up
  to 256 are one tile; larger ones (up to 8192 and beyond) are cut into
  chunks: Q.K^T loops over them and each program writes one chunk of the
  output, recomputing the logits. float32, bfloat16 and float16;
  `num_splits` counts the value chunks as programs too.
* `mosaic_tpu`: a Pallas TPU kernel (`mosaic_tpu.decode`), compiled by
  Mosaic on a TPU and run in Pallas's TPU interpret mode elsewhere. Grid
  (B, K, splits, blocks per split), the last axis sequential: the packed
  tile (rows padded to whole sublane tiles) stays in VMEM while the
  pipeline streams the split's visible key blocks; the lengths, the split
  runs and the block table are scalar-prefetched, so the K/V index maps
  turn a paged cache into the DMAs' addresses, and skipped steps re-name
  the block already resident (no DMA). Head dims are padded to multiples of
  128; blocks are multiples of 128 keys (contiguous; fewer for very wide
  heads) or divisors of the page size (multiples of 8). float32, bfloat16
  and float16 (computed in float32).
* `mosaic_gpu`: a Pallas Mosaic GPU kernel for Hopper (`mosaic_gpu.decode`),
  run in the Mosaic GPU interpreter on a CPU: persistent CTAs walk
  (sequence, K/V head, split) units, a producer warpgroup streaming the
  split's key blocks by TMA while one consumer warpgroup runs both products
  on wgmma over the packed rows padded to 64; the triton merge kernel
  follows. Contiguous or paged caches (a TMA a page) of the query's
  16-bit dtype and int8/float8 ones (each tile widened in
  shared memory to the products' 16-bit dtype, the scales on the logits
  and P), H = 64, 128 or 256.
"""

from pallas_fa.decode.front import check_cache_indices
from pallas_fa.decode.front import decode_attention
from pallas_fa.decode.merge import merge_attention
from pallas_fa.decode.plan import block_kinds
from pallas_fa.decode.plan import default_num_splits

__all__ = [
    "decode_attention",
    "check_cache_indices",
    "default_num_splits",
    "block_kinds",
    "merge_attention",
]
