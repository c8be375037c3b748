"""The jax.numpy decode path (`implementation="chunked"`, the default):
every platform, head dim and dtype; split p reads blocks p, p + splits, ...
of every sequence, all splits as one vectorised axis.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa import api
from pallas_fa import manual_axes
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import quantize
from pallas_fa.decode import plan
from pallas_fa.flex import mods

Array = Any

# Bytes of K (or V) one step reads (every row's block, all K/V heads):
# large enough to amortise the per-step loop overhead, small enough that a
# step's tiles and their relaid-out copies stay in the CPU's caches. On a
# 2-core x86 CPU at S = 32k, 4 MiB steps ran several times faster than
# 512 KiB ones; at B = 16, 64 MiB steps (1k keys a row) ran 3x slower
# than 4 MiB ones.
_BLOCK_BYTES = 1 << 22


# The batch a symbolic one is taken for when sizing blocks: a serving
# batch, whose steps then span _BLOCK_BYTES; a smaller batch runs the same
# loop over narrower steps.
_SYMBOLIC_BATCH = 8


def paged_block(page_size: int, num_pages: int, batch: int, num_kv: int,
                h: int, query_dtype) -> int:
  """Keys per block of a paged cache: the whole pages that come nearest to
  a contiguous cache's block (`default_block`), at least one. A page a
  step (16 keys for vLLM's pages) made a step's fixed cost the call's:
  4.2x a contiguous cache's time at S = 32k on a 2-core CPU (jax
  0.11.2)."""
  block = default_block(page_size * num_pages, batch, num_kv, h, query_dtype)
  return page_size * max(1, block // page_size)


def default_block(s_max: int, batch: int, num_kv: int, h: int,
                  query_dtype) -> int:
  """Keys per block of a contiguous cache: a power of two in [16, 2048]
  whose step's tiles (in `_tile_dtype`) span about `_BLOCK_BYTES` over all
  rows."""
  itemsize = jnp.dtype(_tile_dtype(query_dtype)).itemsize
  if not isinstance(batch, int):
    # A symbolic batch (`jax.export`): sized as for _SYMBOLIC_BATCH rows.
    batch = _SYMBOLIC_BATCH
  rows = _BLOCK_BYTES // (batch * num_kv * h * itemsize)
  block = 1 << max(4, min(11, rows.bit_length() - 1))  # 16 .. 2048
  return min(block, max(16, 1 << (s_max - 1).bit_length()))


@functools.partial(
    jax.jit,
    static_argnames=plan.STATIC + ("score_mod", "mask_mod", "value_head_dim"))
def attention(query, key, value, lengths, block_table, query_positions, sinks,
              score_mod_args, mask_mod_args, key_scale=None, value_scale=None,
              *, block, splits, scale, is_causal, local_window_size,
              logits_soft_cap, precision, score_mod, mask_mod,
              value_head_dim):
  """Decoding in jax.numpy: `decode_attention`'s arguments as its checks
  leave them (scales float32 of rank 3, each dim 1 or the cache's; value
  None for a latent cache, whose values are key's first `value_head_dim`
  columns, read with the keys)."""
  b, t, n, h = query.shape
  num_kv, hv = key.shape[2], value_head_dim
  latent = value is None
  rows = n // num_kv * t
  acc_dtype = online_softmax.stats_dtype(query.dtype)
  tile_dtype = _tile_dtype(query.dtype)
  key_dtype = key.dtype
  value_dtype = key_dtype if latent else value.dtype
  key = _stored(key)
  value = None if latent else _stored(value)
  lengths = lengths.astype(jnp.int32)
  q, row_pos, query_positions = plan.packed(
      query, lengths, query_positions, num_kv)
  lengths, block_table = plan.in_range(lengths, block_table, key)

  # Split p reads blocks p, p + splits, p + 2 splits, ...: interleaving keeps
  # every split equally busy whatever the (ragged) lengths. Step j reads
  # blocks [j * splits, (j + 1) * splits), the keys [j * span, (j + 1) *
  # span); `read(j)` returns them with the cache index of its first key.
  span = splits * block
  if block_table is None:
    # Each step's blocks are one contiguous slice of the cache (no gather).
    num_blocks = -(-key.shape[1] // block)
    steps = -(-num_blocks // splits)
    s_max = key.shape[1]
    if s_max < span:  # A cache shorter than one step: pad it.
      key, value, key_scale, value_scale = (
          x if x is None or x.shape[1] != s_max else
          jnp.pad(x, [(0, 0), (0, span - s_max)] + [(0, 0)] * (x.ndim - 2))
          for x in (key, value, key_scale, value_scale))
      s_max = span

    def read(step):
      # A last step that would run past the cache reads its last span
      # instead of a padded copy of the cache; the masked body drops the
      # keys the step before read.
      start = jnp.minimum(step * span, s_max - span)

      def rows(x, broadcasts):  # [B, P, C, ...]; a scale's 1s stay 1.
        if x is None or (broadcasts and x.shape[1] == 1):
          return None if x is None else x[:, None]
        return jax.lax.dynamic_slice_in_dim(x, start, span, 1).reshape(
            x.shape[0], splits, block, *x.shape[2:])

      return (start, rows(key, False), rows(value, False),
              rows(key_scale, True), rows(value_scale, True))
  else:
    # A split's block is `per_block` whole pages (`paged_block`), gathered
    # at once: step j reads table entries [j * splits * per_block, (j + 1)
    # * splits * per_block), split p the p-th run of `per_block` of them.
    page_size = key.shape[1]
    per_block = block // page_size
    num_pages = block_table.shape[1]
    steps = -(-num_pages // (splits * per_block))
    table = jnp.pad(block_table.astype(jnp.int32),
                    ((0, 0), (0, steps * splits * per_block - num_pages)))
    table = table.reshape(b, steps, splits * per_block)

    def read(step):
      pages = jax.lax.dynamic_index_in_dim(table, step, 1, keepdims=False)

      def rows(x, broadcasts):  # [B, P, C, ...]; a scale's 1s stay 1.
        if x is None or (broadcasts and x.shape[0] == 1):
          if x is not None and x.shape[1] > 1:  # One page's scales, each.
            x = jnp.tile(x, (1, per_block, 1))
          return None if x is None else x[None]
        x = x[pages]  # [B, P * per_block, page_size (a scale's: or 1), ...]
        x = jnp.broadcast_to(x, x.shape[:2] + (page_size,) + x.shape[3:])
        return x.reshape(b, splits, block, *x.shape[3:])

      return (step * span, rows(key, False), rows(value, False),
              rows(key_scale, True), rows(value_scale, True))

  if acc_dtype == query.dtype:
    # Full precision: fold the scale into q once instead of per logit.
    q, logit_scale = q * scale, 1.0
  else:
    logit_scale = scale
  offsets = jnp.arange(span, dtype=jnp.int32).reshape(splits, block)
  g = n // num_kv
  tile = (b, splits, num_kv, g, t, block)  # What the mods are evaluated on.

  def flex_indices(kv_pos):
    """(batch, head, q_idx, kv_idx) of a step's [B, P, K, G, T, C] tile:
    packed row r of K/V head k is query head k * G + r // T, the new token
    r % T at its position."""
    i32 = jnp.int32
    return (jnp.arange(b, dtype=i32).reshape(b, 1, 1, 1, 1, 1),
            jnp.arange(n, dtype=i32).reshape(1, 1, num_kv, g, 1, 1),
            query_positions.reshape(b, 1, 1, 1, t, 1),
            kv_pos.reshape(1, splits, 1, 1, 1, block))

  def mod_visible(kv_pos):
    """mask_mod on a step's [B, P, K, G * T, C] tile."""
    indices = flex_indices(kv_pos)
    return mods.evaluate(
        mask_mod, tile, batch=indices[0],
        head=indices[1], q_idx=indices[2], kv_idx=indices[3],
        args=mask_mod_args).reshape(b, splits, num_kv, g * t, block)

  def body(step, carry, *, masked):
    m_i, l_i, acc = carry
    start, k_blk, v_blk, k_scale, v_scale = read(step)  # [B, P, C, K, H]
    k_blk = _widened(k_blk, key_dtype, tile_dtype)
    if latent:  # The values are the keys' first columns: no second read.
      v_blk, v_scale = k_blk[..., :hv], k_scale
    else:
      v_blk = _widened(v_blk, value_dtype, tile_dtype)
    s = _einsum("bkrh,bpckh->bpkrc", q, k_blk, precision=precision,
                preferred_element_type=acc_dtype)
    if logit_scale != 1.0:
      s = s * logit_scale
    if k_scale is not None:
      # Dequantizing: q . (k * c) = (q . k) * c for the key's scale c.
      s = s * _logit_layout(k_scale)
    s = online_softmax.soft_cap(s, logits_soft_cap)
    kv_pos = start + offsets  # [P, C]
    if score_mod is not None:
      indices = flex_indices(kv_pos)
      s = online_softmax.ScoreMod(
          fn=score_mod, args=score_mod_args, batch=indices[0],
          head=indices[1], q_idx=indices[2], kv_idx=indices[3],
      )(s.reshape(tile)).reshape(s.shape)
    if masked:
      valid = ((kv_pos >= step * span)[None]
               & (kv_pos[None] < lengths[:, None, None]))  # [B, P, C]
      # Rows past a length may hold anything; 0 * NaN would leak into P.V.
      v_blk = jnp.where(valid[..., None, None], v_blk, 0)
      if v_scale is not None:
        v_scale = jnp.where(valid[..., None], v_scale, 0)
      vis = _visible(valid, kv_pos, row_pos, is_causal, local_window_size)
      if mask_mod is not None:
        vis = vis & mod_visible(kv_pos)
      s = online_softmax.apply_mask(s, vis)
    m_i, l_i, p, alpha = online_softmax.update(m_i, l_i, s)
    if v_scale is not None:
      # P . (v * c) = (P * c) . v for the value's scale c.
      p = p * _logit_layout(v_scale)
    acc = acc * alpha[..., None] + _einsum(
        "bpkrc,bpckh->bpkrh", p.astype(tile_dtype), v_blk,
        precision=precision, preferred_element_type=acc_dtype)
    return m_i, l_i, acc

  carry = online_softmax.init(
      (b, splits, num_kv, rows), (b, splits, num_kv, rows, hv), acc_dtype)
  # Inside a user's shard_map, varying as the cache's tiles do.
  carry = manual_axes.vary_like(carry, (query, key))
  # Only the blocks below the longest sequence are visited, and the steps
  # that every new token of every sequence sees whole (typically all but
  # the last under causal masking) skip the masking arithmetic.
  last = -(-jnp.max(lengths) // block)
  end = jnp.minimum(steps, -(-last // splits))
  if mask_mod is None:
    kinds = masking.decode_block_kinds(
        lengths, query_positions, num_blocks=steps, block=span,
        is_causal=is_causal, window=local_window_size)
    full_lo, full_hi = masking.full_run(
        jnp.where((kinds == masking.FULL).all(axis=0), masking.FULL,
                  masking.PARTIAL), 0)
    for lo, hi, masked in ((0, full_lo, True), (full_lo, full_hi, False),
                           (full_hi, end, True)):
      carry = jax.lax.fori_loop(
          lo, jnp.maximum(lo, hi), functools.partial(body, masked=masked),
          carry)
  else:
    # A step no new token sees is never read, and one that every new token
    # sees whole skips all masking.
    kinds = masking.shared_kinds(plan.block_kinds(
        mask_mod, mask_mod_args, lengths, query_positions, num_heads=n,
        num_kv=num_kv, num_blocks=steps, block=span, is_causal=is_causal,
        window=local_window_size), axis=(0, 1))  # [steps]

    def visit(step, carry):
      branches = {masking.EMPTY: lambda c: c,
                  masking.PARTIAL: functools.partial(body, step, masked=True),
                  masking.FULL: functools.partial(body, step, masked=False)}
      return jax.lax.switch(
          kinds[step], [branches[kind] for kind in sorted(branches)], carry)

    carry = jax.lax.fori_loop(0, end, visit, carry)
  m_i, l_i, acc = carry
  out, lse = plan.merged(*online_softmax.finalize(m_i, l_i, acc), sinks, 1, t)
  return plan.unpacked(out, lse, query)


def _tile_dtype(query_dtype):
  """The dtype the cache's tiles are computed in: the query's, but float32
  on CPU for narrower queries (XLA:CPU runs bfloat16 and float16 products
  far below its float32 rate)."""
  if api.platform() == "cpu" and jnp.dtype(query_dtype).itemsize < 4:
    return jnp.float32
  return query_dtype


def _stored(cache):
  """The cache as the unsigned integers of its bits when it is a 16-bit or
  float8 float that this XLA:CPU cannot slice in a loop (`_slices_widen`),
  else itself.

  Integer slices stay in the loop, each tile widened on its own
  (`_widened`). A 16-bit cache's bit view XLA:CPU materialises as one
  16-bit copy of the cache per call, which keeps a bfloat16 cache slower
  than a float32 one there (2x at S = 32k, against 4.8x sliced as floats);
  where 16-bit slices are native (jax >= 0.11, and every accelerator) the
  cache is sliced as stored: 0.6x the float32 time. A float8 cache sliced
  as stored was widened to float16 whole before the loop and each tile
  converted back (XLA:CPU's float8 conversions run an element at a time:
  5.7x a bfloat16 cache's time at S = 32k, jax 0.11.2); its bits are
  sliced and widened by `quantize.float8_bits_as_float32`.
  """
  if (jnp.issubdtype(cache.dtype, jnp.floating) and cache.dtype.itemsize < 4
      and api.platform() == "cpu" and _slices_widen(cache.dtype)):
    return jax.lax.bitcast_convert_type(
        cache, jnp.uint16 if cache.dtype.itemsize == 2 else jnp.uint8)
  return cache


@functools.cache
def _slices_widen(dtype) -> bool:
  """Whether XLA:CPU widens a loop's slices of a `dtype` array into a
  wider float copy of the whole array, made before the loop on every call.

  Its float normalization had no 16-bit float dynamic slices in jaxlib
  0.10 (a float32 copy) and has no float8 ones (a float16 copy, 0.10 and
  0.11): it converts the array, and loop-invariant code motion hoists the
  conversion out of the loop. Probed by compiling one small loop (a
  dynamic trip count, so that it is not unrolled).
  """
  def loop(x, trips):
    def body(i, total):
      tile = jax.lax.dynamic_slice_in_dim(x, i * 8, 8)
      return total + tile.astype(jnp.float32).sum()
    return jax.lax.fori_loop(0, trips, body, jnp.float32(0))

  compiled = jax.jit(loop).lower(
      jax.ShapeDtypeStruct((64, 8), dtype),
      jax.ShapeDtypeStruct((), jnp.int32)).compile()
  wider = ("f32",) + (("f16", "bf16") if jnp.dtype(dtype).itemsize == 1
                      else ())
  return re.search(rf"\b({'|'.join(wider)})\[64,8\]",
                   compiled.as_text()) is not None


def _widened(tile, dtype, tile_dtype):
  """A tile of a `_stored` cache of `dtype`, in `tile_dtype`: int8 and
  float8 values exactly (every one is a bfloat16 or wider). A float8
  cache's bits (a CPU's) become float32 by integer operations
  (`quantize.float8_bits_as_float32`), with no float8 value in the loop,
  kept out of the consumer's fusion (fused into a transposing one they ran
  1.5x slower)."""
  if tile.dtype == jnp.uint8 and quantize.is_fp8(dtype):
    wide = quantize.float8_bits_as_float32(tile, dtype)
    return jax.lax.optimization_barrier(wide).astype(tile_dtype)
  if tile.dtype != dtype:
    tile = jax.lax.bitcast_convert_type(tile, dtype)
  return tile.astype(tile_dtype)


def _logit_layout(scale):
  """A step's per-key scales [B, P, C, K] (each dim 1 or full) laid out
  like its logits [B, P, K, R, C]."""
  return jnp.swapaxes(scale, 2, 3)[:, :, :, None, :]


def _einsum(subscripts: str, x, y, **kwargs):
  """`jnp.einsum` of two operands, as a plain matrix product when every
  batch axis is 1.

  The decode einsums carry batch, split and K/V-head axes that are all 1
  for one sequence with one K/V head on CPU (one split). XLA's CPU backend
  runs such a dot as a batched one with relaid-out operands and transposed
  logits; with the size-1 axes dropped it is one matrix product, ~20%
  faster for the whole decode step at B = K = 1, T_new = 4, S = 32k. With
  a batch axis above 1 the einsum is left as written: dropping the others
  there leaves a batched dot over strided operands, several times slower.
  """
  inputs, output = subscripts.split("->")
  x_labels, y_labels = inputs.split(",")
  sizes = dict(zip(x_labels + y_labels, x.shape + y.shape))
  batch = set(x_labels) & set(y_labels) & set(output)
  # `!= 1`, not `> 1`: a symbolic batch (`jax.export`) is not known > 1.
  if any(sizes[label] != 1 for label in batch):
    return jnp.einsum(subscripts, x, y, **kwargs)

  def kept(labels):
    return "".join(label for label in labels if sizes[label] != 1)

  def squeezed(labels, operand):
    return operand.reshape([sizes[label] for label in kept(labels)])

  out = jnp.einsum(
      f"{kept(x_labels)},{kept(y_labels)}->{kept(output)}",
      squeezed(x_labels, x), squeezed(y_labels, y), **kwargs)
  return out.reshape([sizes[label] for label in output])


def _visible(valid, kv_pos, row_pos, is_causal, window):
  """[B, P, 1, R, C] visibility of one block of keys for the packed rows:
  `masking.visible` with the lengths as its dense term."""
  return masking.visible(
      is_causal=is_causal, window=window,
      q_pos=row_pos[:, None, None, :, None],  # [B, 1, 1, R, 1]
      kv_pos=kv_pos[None, :, None, None, :],  # [1, P, 1, 1, C]
      dense=valid[:, :, None, None, :])
