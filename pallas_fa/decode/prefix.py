"""Cascade decoding: a prompt prefix shared by every row, read once.

With `prefix_key` [S_p, K, H] and `prefix_value` [S_p, K, Hv] before each
row's own cache, attention over the concatenation `[prefix; cache[b]]` is
the exact merge (`online_softmax.merge_parts`) of two parts over disjoint
keys:

* the prefix, attended by every row's new tokens in one call: the B rows'
  T_new queries folded into one query sequence of B * T_new tokens against
  the one prefix (decoded as one row whose packed tile holds all B * T_new
  * G queries of a K/V head, its keys split over the programs, or, where
  that tile is too large for a kernel, `flash_attention` with each token's
  position), so the prefix is read once per call instead of once per row;
  with a score_mod/mask_mod (which read the row as `batch`) the queries
  keep their rows and the prefix is passed with batch 1 to
  `flash_attention` (read once by `chunked`, broadcast by the kernels),
  and they are called with the new tokens' positions as q_idx
  (`at_positions`), as decoding calls them;
* each row's own cache, decoded as without a prefix with every position
  shifted by S_p (the mods see the positions of the concatenation).

Attention sinks are added once, after the merge.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp

from pallas_fa import api
from pallas_fa import online_softmax
from pallas_fa.decode import kernels

Array = Any


def check(prefix_key, prefix_value, query, value_head_dim: int,
          num_kv_heads: int):
  """(prefix_key, prefix_value) as arrays, or (None, None).

  Raises:
    ValueError / TypeError: one without the other, or shapes and dtypes
      that do not match the query and the cache (named): the prefix has
      the cache's K/V heads, since the call attends over [prefix; cache].
  """
  if (prefix_key is None) != (prefix_value is None):
    raise ValueError(
        "prefix_key and prefix_value go together, got only "
        f"{'prefix_key' if prefix_value is None else 'prefix_value'}.")
  if prefix_key is None:
    return None, None
  prefix_key, prefix_value = jnp.asarray(prefix_key), jnp.asarray(
      prefix_value)
  _, _, n, h = query.shape
  for name, x, width in (("prefix_key", prefix_key, h),
                         ("prefix_value", prefix_value, value_head_dim)):
    if x.ndim != 3 or x.shape[2] != width:
      raise ValueError(
          f"{name} must be [S_p, K, {width}] (no batch dim: every row shares "
          f"it), got {name}.shape={x.shape}.")
    if x.dtype != query.dtype:
      raise TypeError(
          f"{name} must have the query's dtype {query.dtype}, got "
          f"{name}.dtype={x.dtype}.")
  if prefix_key.shape[:2] != prefix_value.shape[:2]:
    raise ValueError(
        f"prefix_value must match prefix_key's first two dims, got "
        f"prefix_key.shape={prefix_key.shape}, prefix_value.shape="
        f"{prefix_value.shape}.")
  if prefix_key.shape[1] != num_kv_heads:
    raise ValueError(
        f"prefix_key must have the cache's K={num_kv_heads} K/V heads (the "
        f"call attends over the prefix and the cache together), got "
        f"prefix_key.shape={prefix_key.shape}.")
  return prefix_key, prefix_value


@functools.cache
def shifted(fn, offset: int, takes_score: bool):
  """`fn` (a score_mod or mask_mod) seeing q_idx and kv_idx shifted by
  `offset`; cached, so that a serving loop keeps one function (the mods
  are static arguments of the jitted paths)."""
  if fn is None or offset == 0:
    return fn
  if takes_score:
    def score_mod(score, batch, head, q_idx, kv_idx, *args):
      return fn(score, batch, head, q_idx + offset, kv_idx + offset, *args)
    return score_mod

  def mask_mod(batch, head, q_idx, kv_idx, *args):
    return fn(batch, head, q_idx + offset, kv_idx + offset, *args)
  return mask_mod


@functools.cache
def at_positions(fn, takes_score: bool):
  """`fn` called by `flash_attention` (whose q_idx is the query's index in
  its sequence) with decode's q_idx, the new token's position: read from
  the array appended to its arguments, [B, T_new]."""
  if fn is None:
    return None
  if takes_score:
    def score_mod(score, batch, head, q_idx, kv_idx, *args):
      *args, positions = args
      return fn(score, batch, head, positions[batch, q_idx], kv_idx, *args)
    return score_mod

  def mask_mod(batch, head, q_idx, kv_idx, *args):
    *args, positions = args
    return fn(batch, head, positions[batch, q_idx], kv_idx, *args)
  return mask_mod


def attend(query, prefix_key, prefix_value, query_positions, *,
           implementation, static, flex, decode_one_row, fold=True):
  """Every row's new tokens over the prefix: (out [B, T_new, N, Hv] typed
  like the query, lse [B, T_new, N]), without sinks.

  `decode_one_row(query, query_positions, key, value)` decodes a one-row
  cache (the front's own path): without mods, the rows' tokens are folded
  into that row's new tokens, so each K/V head's B * T_new * G queries are
  one packed tile and the prefix's keys are split over the programs as a
  long row's are (FlashInfer's cascade planner does the same). A kernel
  takes this path while the tile is within its `MAX_FOLDED_ROWS`
  (`kernels.folds_rows`); a larger one, or `fold=False`, takes
  `flash_attention` over the folded tokens, whose grid has one program per
  query tile and query head, each walking the whole prefix.
  """
  b, t, n, h = query.shape
  name = "chunked" if implementation is None else implementation
  kw = dict(static, implementation=name, return_residual=True)
  if flex:
    # The mods read the row: the queries keep it, the prefix has batch 1.
    positions = query_positions.astype(jnp.int32)
    mods = dict(
        score_mod=at_positions(flex["score_mod"], True),
        score_mod_args=(*flex["score_mod_args"], positions),
        mask_mod=at_positions(flex["mask_mod"], False),
        mask_mod_args=(*flex["mask_mod_args"], positions))
    if flex["score_mod"] is None:
      mods.update(score_mod_args=())
    if flex["mask_mod"] is None:
      mods.update(mask_mod_args=())
    return api.flash_attention(
        query, prefix_key[None], prefix_value[None],
        query_positions=query_positions, **mods, **kw)
  # Every row's new tokens as one query sequence against the one prefix.
  tokens, positions = (query.reshape(1, b * t, n, h),
                       query_positions.reshape(1, b * t))
  if fold and kernels.folds_rows(name, b * t * (n // prefix_key.shape[1]),
                                 query.dtype):
    out, lse = decode_one_row(tokens, positions, prefix_key[None],
                              prefix_value[None])
  else:
    out, lse = api.flash_attention(tokens, prefix_key[None],
                                   prefix_value[None],
                                   query_positions=positions, **kw)
  return out.reshape(b, t, n, -1), lse.reshape(b, t, n)


def merge(prefix_part, own_part, sinks, dtype):
  """The two parts merged exactly, then the sinks added once."""
  stats = online_softmax.stats_dtype(dtype)
  out = jnp.stack([prefix_part[0].astype(stats), own_part[0].astype(stats)])
  lse = jnp.stack([prefix_part[1], own_part[1]]).astype(stats)
  out, lse = online_softmax.merge_parts(out, lse, axis=0)
  if sinks is not None:
    out, lse = online_softmax.add_sink(out, lse, sinks)
  return out.astype(dtype), lse
