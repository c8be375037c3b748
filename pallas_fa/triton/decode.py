"""The split-KV decode kernel of `decode_attention(implementation="triton")`.

One Pallas program per (sequence, K/V head, split[, value-head-dim chunk]):

* **Rows.** The program holds the packed query tile of its K/V head: the G
  query heads of the group times the T_new new tokens, R = G * T_new rows,
  padded to a power of two of at least 16 (Triton's `tl.dot` minimum), so
  each K/V byte is read once per K/V head, not once per query head.
* **Keys.** The visible key range of the sequence (lengths, causal and the
  window's left edge shrink it; `masking.classify_blocks`) is cut into
  `splits` contiguous runs of `block` keys, one per program; each program
  runs the online softmax over its run and writes a normalised partial
  (out, lse). `online_softmax.merge_parts` merges the splits after the
  kernel, in plain JAX. Inside a block every key is masked by
  `masking.visible` with `key < length` as its dense term, and value rows
  past the length are zeroed (they may hold NaN). With a mask_mod the
  visible blocks need not be contiguous: each K/V head's non-empty blocks
  are listed (`masking.listed_runs`) and the splits cut the list, so the
  blocks it hides are never read and those it shows whole skip the masking.
* **Paging.** A contiguous cache [B, S_max, K, H] is read in blocks of
  `block` keys (a `pl.ds` slice; when S_max is not a multiple of `block`,
  the last block is the cache's last `block` rows, its keys already read
  masked). A paged cache is read through the block
  table: `block` is the largest power of two <= the contiguous default that
  divides `page_size` (so a block never straddles two pages), and block j
  of a sequence is rows [(j % per_page) * block, ...) of page
  `block_table[b, j // per_page]`. Page sizes must be multiples of 16.
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
picks the splits (about two programs per streaming multiprocessor, value
chunks counted). A cache whose head dims need no padding (and that holds at
least one block) is read in place; otherwise the padded copy costs one
extra pass over it. Forward only.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_fa import fused_mods
from pallas_fa import layout
from pallas_fa import masking
from pallas_fa import mods
from pallas_fa import online_softmax
from pallas_fa import triton
from pallas_fa.triton import kernel as triton_kernel

Array = Any
_F32 = jnp.float32
# Triton's tl.dot needs every matmul dimension to be at least 16.
_MIN = triton.MIN_BLOCK
# Widest key and value head-dim tiles, and the most float32 elements a
# [rows, chunk] tile (accumulator, resident Q chunk) may hold: read off
# ptxas (`scripts/compile_check.py --variants=decode`) so that nothing
# spills. The value tile may be wider: every value chunk past the first
# re-reads K.
_KEY_CHUNK = 256
_VALUE_CHUNK = 1024
_TILE_ELEMENTS = 1 << 14


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


def key_tiling(head_dim: int, rows: int) -> tuple[int, int]:
  """(padded head dim, chunk) of the queries and keys: Q.K^T loops over
  the chunks."""
  return _head_tiling(head_dim, rows, _KEY_CHUNK)


def value_tiling(head_dim: int, rows: int) -> tuple[int, int]:
  """(padded value head dim, chunk) of the values: one chunk of the output
  per program."""
  return _head_tiling(head_dim, rows, _VALUE_CHUNK)


def value_chunks(head_dim: int, rows: int) -> int:
  """Programs per (sequence, K/V head, split): the value head-dim chunks
  of G * T_new = `rows` query rows."""
  padded, chunk = value_tiling(head_dim, packed_rows(rows))
  return padded // chunk


def default_block(head_dim: int, value_head_dim: int, rows: int) -> int:
  """Keys per block of a contiguous cache: the widest K/V tiles and
  [rows, block] logits tile that fit registers (and two pipeline stages of
  shared memory) next to the accumulator."""
  widest = max(key_tiling(head_dim, rows)[1],
               value_tiling(value_head_dim, rows)[1])
  block = 64 if widest <= 128 else 32 if widest <= 256 else 16
  return max(_MIN, min(block, _TILE_ELEMENTS // (4 * rows)))


def block_for(*, head_dim: int, value_head_dim: int, groups: int,
              new_tokens: int, page_size: int | None,
              block_kv: int | None) -> int:
  """Keys per block: `block_kv` or the default (contiguous), or the largest
  power-of-two divisor of `page_size` no wider than the default (paged).

  Raises:
    ValueError: `block_kv` is not a power of two >= 16.
    NotImplementedError: `page_size` is not a multiple of 16.
  """
  default = default_block(head_dim, value_head_dim,
                          packed_rows(groups * new_tokens))
  if page_size is None:
    block = block_kv or default
    if block < _MIN or block & (block - 1):
      raise ValueError(
          f"block_kv must be a power of two >= {_MIN} for "
          f"implementation='triton', got {block_kv}.")
    return block
  if page_size % _MIN:
    raise NotImplementedError(
        f"implementation='triton' reads pages in blocks of at least {_MIN} "
        f"keys: page_size must be a multiple of {_MIN}, got {page_size}.")
  block = default
  while page_size % block:
    block //= 2
  return block


def _spans(lengths, q_pos, lists, *, num_blocks: int, block: int,
           splits: int, is_causal: bool, window, split_of):
  """The "span" input, one row of 4 int32 per program: (first, end,
  length, n_full). Without block `lists`, [B, splits, 4]: blocks [first, end)
  (`masking.split_runs`), n_full unused; with a mask_mod's lists
  (`masking.listed_runs`), [B, K, splits, 4]:
  positions [first, end) of the K/V head's block list, the first n_full of
  the list FULL."""
  if lists is None:
    first, end = masking.split_runs(
        lengths, q_pos, num_blocks=num_blocks, block=block, splits=splits,
        is_causal=is_causal, window=window)
    n_full = jnp.zeros_like(first)
    spec = triton.block_spec((None, None, 4),
                             lambda i, k, j: (i, split_of(j), 0))
  else:
    first, end, n_full = (lists[1][..., i] for i in range(3))
    spec = triton.block_spec((None, None, None, 4),
                             lambda i, k, j: (i, k, split_of(j), 0))
  length = jnp.broadcast_to(
      lengths.reshape((-1,) + (1,) * (first.ndim - 1)), first.shape)
  spans = jnp.stack([first, end, length, n_full], axis=-1)
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


def _kernel(refs, *, block: int, head_chunk: int, head_chunks: int,
            value_chunk: int, value_chunks: int, per_page: int | None,
            cache_len: int, scale: float, soft_cap, is_causal: bool, window,
            precision, score_mod=None, mask_mod=None):
  # Grid indices at the kernel's top level (the interpreter resolves
  # `program_id` there, not inside loop bodies).
  column = pl.program_id(2) % value_chunks
  span = refs["span"]
  first, end, length = span[0], span[1], span[2]
  row_pos = refs["pos"][...][:, None]  # [R, 1]
  rows = row_pos.shape[0]
  values = pl.ds(pl.multiple_of(column * value_chunk, value_chunk),
                 value_chunk)
  q_whole = refs["q"][...] if head_chunks == 1 else None

  def key_rows(j):
    """(position of the first key read, (leading index, rows) in the K/V
    refs) of block j."""
    if per_page is None:
      # A last block that would run past the cache reads the cache's last
      # `block` rows instead (no padded copy); the keys of block j - 1
      # among them are masked.
      start = jnp.minimum(j * block, cache_len - block)
      return start, (pl.ds(start, block),)
    page = refs["table"][j // per_page]
    offset = pl.multiple_of((j % per_page) * block, block)
    return j * block, (page, pl.ds(offset, block))

  def step(j, carry, *, masked=True):
    m_i, l_i, acc = carry
    start, lead = key_rows(j)
    if head_chunks == 1:
      qk = _dot_nt(q_whole, refs["k"][(*lead, slice(None))], precision)
    else:
      def chunk(c, qk):
        cols = pl.ds(pl.multiple_of(c * head_chunk, head_chunk), head_chunk)
        return qk + _dot_nt(refs["q"][:, cols], refs["k"][(*lead, cols)],
                            precision)

      qk = jax.lax.fori_loop(0, head_chunks, chunk,
                             jnp.zeros((rows, block), _F32))
    kv_pos = start + jnp.arange(block, dtype=jnp.int32)
    # The cache positions' per-key flex values (paged: logical positions).
    cols = pl.ds(start, block)
    if score_mod is None:
      s, _ = online_softmax.logits(qk, scale=scale, cap=soft_cap,
                                   base2=True)
    else:
      s, _ = online_softmax.logits(qk, scale=scale, cap=soft_cap)
      s = score_mod.tile(_flex_values(refs, score_mod, cols),
                         q_idx=row_pos, kv_idx=kv_pos[None, :], score=s)
      s = s * online_softmax.LOG2_E
    if masked:
      valid = (kv_pos >= j * block) & (kv_pos < length)
      visible = masking.visible(
          is_causal=is_causal, window=window, q_pos=row_pos,
          kv_pos=kv_pos[None, :], dense=valid[None, :])
      if mask_mod is not None:
        visible = visible & mask_mod.tile(
            _flex_values(refs, mask_mod, cols), q_idx=row_pos,
            kv_idx=kv_pos[None, :])
      s = online_softmax.apply_mask(s, visible)
    m_i, l_i, p, alpha = online_softmax.update(m_i, l_i, s, base2=True)
    v = refs["v"][(*lead, values)]  # [block, value_chunk]
    if masked:
      # Rows past the length may hold NaN, and 0 * NaN is NaN in P.V.
      v = jnp.where(valid[:, None], v, jnp.zeros((), v.dtype))
    acc = online_softmax.rescale(acc, alpha) + _dot(
        p.astype(v.dtype), v, precision)
    return m_i, l_i, acc

  carry = online_softmax.init((rows,), (rows, value_chunk))
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
    carry = jax.lax.fori_loop(first, end, step, carry)
  m_i, l_i, acc = carry
  out, lse = online_softmax.finalize(m_i, l_i, acc, base2=True)
  refs["out"][...] = out
  refs["lse"][...] = lse


def partials(q, row_pos, query_positions, key, value, lengths, block_table,
             *, block: int, splits: int, scale: float, is_causal: bool,
             local_window_size, logits_soft_cap, precision, score_mod=None,
             score_mod_args=(), mask_mod=None, mask_mod_args=(),
             kinds=None):
  """The kernel's per-split results on the packed layout of `decode`.

  Args:
    q: packed queries [B, K, R, H], R = G * T_new.
    row_pos: int32 [B, R], each row's query position.
    query_positions: int32 [B, T_new].
    key, value: the cache, contiguous [B, S_max, K, H] or pages
      [P, page_size, K, H] with `block_table` int [B, max_pages].
    lengths: int32 [B].
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

  Returns:
    (out float32 [B, K, splits, R, Hv], lse float32 [B, K, splits, R]):
    normalised partial results, merged by `online_softmax.merge_parts` on
    axis 2 (a split with no visible key has lse -inf).
  """
  b, num_kv, r, h = q.shape
  hv = value.shape[3]
  rows = packed_rows(r)
  hp, head_chunk = key_tiling(h, rows)
  hvp, value_chunk = value_tiling(hv, rows)
  num_value_chunks = hvp // value_chunk
  # Padded rows (zero queries) are sliced off below.
  q = masking.pad_axes(q, {2: rows, 3: hp})
  row_pos = masking.pad_axes(row_pos, {1: rows})
  if block_table is None:
    num_blocks = -(-key.shape[1] // block)
    # Only a cache shorter than one block is padded (to one block).
    cache_len = max(key.shape[1], block)
    key = masking.pad_axes(key, {1: cache_len, 3: hp})
    value = masking.pad_axes(value, {1: cache_len, 3: hvp})
    per_page = None
    cache_block = (None, cache_len, None)

    def cache_index(i, k, j):
      return (i, 0, k, 0)
  else:
    page_size = cache_len = key.shape[1]
    per_page = page_size // block
    num_blocks = block_table.shape[1] * per_page
    key = masking.pad_axes(key, {3: hp})
    value = masking.pad_axes(value, {3: hvp})
    cache_block = (key.shape[0], page_size, None)

    def cache_index(i, k, j):
      return (0, 0, k, 0)
  splits = max(1, min(splits, num_blocks))
  lists = None if kinds is None else masking.listed_runs(kinds, splits)

  def split_of(j):
    return j // num_value_chunks

  def column_of(j):
    return j % num_value_chunks

  inputs = {
      "q": (q, triton.block_spec((None, None, rows, hp),
                                 lambda i, k, j: (i, k, 0, 0))),
      "pos": (row_pos, triton.block_spec((None, rows),
                                         lambda i, k, j: (i, 0))),
      "span": _spans(lengths, query_positions, lists, num_blocks=num_blocks,
                     block=block, splits=splits, is_causal=is_causal,
                     window=local_window_size, split_of=split_of),
      "k": (key, triton.block_spec((*cache_block, hp), cache_index)),
      "v": (value, triton.block_spec((*cache_block, hvp), cache_index)),
  }
  if lists is not None:
    order = lists[0]
    width = layout.next_power_of_2(num_blocks)  # Triton's block shapes.
    inputs["order"] = (masking.pad_axes(order, {2: width}), triton.block_spec(
        (None, None, width), lambda i, k, j: (i, k, 0)))
  if block_table is not None:
    table = block_table.astype(jnp.int32)
    inputs["table"] = (table, triton.block_spec(
        (None, table.shape[1]), lambda i, k, j: (i, 0)))
  outputs = {
      "out": (jax.ShapeDtypeStruct((b, num_kv, splits, rows, hvp), _F32),
              triton.block_spec(
                  (None, None, None, rows, value_chunk),
                  lambda i, k, j: (i, k, split_of(j), 0, column_of(j)))),
      "lse": (jax.ShapeDtypeStruct((b, num_kv, splits, rows), _F32),
              triton.block_spec((None, None, None, rows),
                                lambda i, k, j: (i, k, split_of(j), 0))),
  }
  fused = _add_flex_inputs(
      inputs, row_pos, num_kv=num_kv, rows=rows, r=r,
      new_tokens=query_positions.shape[1],
      kv_positions=num_blocks * block if per_page else cache_len,
      flex=((mods.SCORE_MOD, score_mod, score_mod_args),
            (mods.MASK_MOD, mask_mod, mask_mod_args)))
  kernel = functools.partial(
      _kernel, **fused, block=block, head_chunk=head_chunk,
      head_chunks=hp // head_chunk, value_chunk=value_chunk,
      value_chunks=num_value_chunks, per_page=per_page,
      cache_len=cache_len, scale=scale,
      soft_cap=logits_soft_cap, is_causal=is_causal,
      window=local_window_size, precision=precision)
  warps, stages = _launch(rows, max(head_chunk, value_chunk))
  out, lse = triton.pallas_call(
      kernel, inputs, outputs, (b, num_kv, splits * num_value_chunks), warps,
      stages, "flash_decode")
  return out[..., :r, :hv], lse[..., :r]


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


def _launch(rows: int, chunk: int) -> tuple[int, int]:
  """(warps, software-pipeline stages): 4 warps cover a 16-row tile; wider
  tiles take 8 so the per-thread share of the accumulator stays small."""
  warps = 4 if rows * chunk <= 16 * 128 else 8
  return warps, 2

