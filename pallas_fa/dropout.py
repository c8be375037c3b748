"""Attention dropout whose mask is a pure function of where it applies.

Dropout zeroes each normalised attention probability with probability `rate`
and scales the survivors by 1 / (1 - rate), as Flax does. The keep/drop
decision for probability (b, n, i, j) (batch row, query head, query index,
key index) is a counter-based hash of (seed, b, n, i, j): no random state,
nothing T x S stored, the backward pass regenerates exactly the forward's
mask, and every backend and every tiling draws bit-identical masks (so a
kernel can be checked exactly against the reference). The hash is 32-bit
integer arithmetic only (murmur3's finaliser), which every backend, Pallas
kernels included, computes the same way.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = Any

_U32 = jnp.uint32
# Odd multiplier and offset that spread small coordinates over all 32 bits
# before mixing (the golden-ratio constant of Fibonacci hashing).
_SPREAD = 0x9E3779B9
_OFFSET = 0x7F4A7C15


def _fmix32(h: Array) -> Array:
  """murmur3's 32-bit finaliser: a bijection with full avalanche."""
  h = h ^ (h >> 16)
  h = h * _U32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * _U32(0xC2B2AE35)
  return h ^ (h >> 16)


def _absorb(h: Array, x: Array) -> Array:
  x = jnp.asarray(x).astype(_U32)
  return _fmix32(h ^ (x * _U32(_SPREAD) + _U32(_OFFSET)))


def threshold(rate: float) -> int:
  """A probability is dropped when its 32-bit hash is below this."""
  return min(round(rate * 2.0**32), 2**32 - 1)


def keep_mask(seed: Array, rate: float, batch: Array, head: Array,
              q_index: Array, kv_index: Array) -> Array:
  """Which probabilities survive: bool, the broadcast shape of the indices.

  Args:
    seed: uint32 scalar (`seed_from`).
    rate: the dropout rate, in [0, 1).
    batch, head, q_index, kv_index: integer index arrays (broadcastable);
      `batch` is the row of the folded batch, `head` the query head, and
      `q_index` / `kv_index` index the query and key axes (not positions).
  """
  return keep_in_row(row_state(seed, batch, head, q_index), rate, kv_index)


def row_state(seed: Array, batch: Array, head: Array,
              q_index: Array) -> Array:
  """The hash of (seed, batch, head, q_index), uint32: `keep_mask` in two
  stages, so that a kernel hashes the query side once per row and only the
  key index per element (`keep_in_row`)."""
  h = _absorb(jnp.asarray(seed, _U32), batch)
  h = _absorb(h, head)
  return _absorb(h, q_index)


def keep_in_row(state: Array, rate: float, kv_index: Array) -> Array:
  """`keep_mask` from a `row_state` and the key indices (broadcastable)."""
  return _absorb(state, kv_index) >= _U32(threshold(rate))


def factor(keep: Array, rate: float, dtype) -> Array:
  """1 / (1 - rate) where kept, 0 where dropped: multiplies probabilities
  (forward) and their cotangents (backward)."""
  return jnp.where(keep, 1.0 / (1.0 - rate), 0.0).astype(dtype)


def grouped_factor(seed: Array, rate: float, shape, dtype, q_start=0,
                   kv_start=0) -> Array:
  """`factor` of a [B, K, G, rows, cols] tile in the grouped-head layout
  (query head = k * G + g) whose first row and column are query q_start and
  key kv_start."""
  iota = lambda axis: jax.lax.broadcasted_iota(jnp.int32, shape, axis)
  keep = keep_mask(seed, rate, iota(0), iota(1) * shape[2] + iota(2),
                   q_start + iota(3), kv_start + iota(4))
  return factor(keep, rate, dtype)


def seed_for_shard(seed: Array, axis_names: tuple[str, ...]) -> Array:
  """The seed of this device's masks inside a `jax.shard_map`: `seed` with
  the device's index along each of `axis_names` absorbed.

  The masks hash the call's own indices, which inside a map are the
  shard's local ones: without this, devices holding different batch
  rows, heads or positions would draw the same masks. `axis_names` are the
  axes the call's arrays vary along (`manual_axes.axes`), so devices that
  replicate a call still draw one mask.
  """
  for name in axis_names:
    seed = _absorb(seed, jax.lax.axis_index(name))
  return seed


def seed_from(rng: Any) -> Array:
  """A uint32 seed from a JAX PRNG key (typed or raw uint32[2]) or an
  integer; raises TypeError for anything else."""
  if isinstance(rng, int) and not isinstance(rng, bool):
    return _U32(rng & 0xFFFFFFFF)
  x = jnp.asarray(rng) if not hasattr(rng, "dtype") else rng
  # One key: a batch of keys (split's result) is for a vmap to map over.
  if (jnp.issubdtype(x.dtype, jax.dtypes.prng_key) and x.ndim == 0) or (
      x.shape == (2,) and x.dtype == jnp.uint32):
    return jax.random.bits(x, (), _U32)
  if x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer):
    return x.astype(_U32)
  raise TypeError(
      "dropout_rng must be one JAX PRNG key (vmap the call over a batch "
      "of keys) or an integer seed, got "
      f"{getattr(x, 'dtype', type(rng))} {getattr(x, 'shape', '')}.")
