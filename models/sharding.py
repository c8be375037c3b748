"""Multi-device training on a (data, sequence) mesh: placement and attention.

Batch rows are split over the data axis and every sequence over the sequence
axis, where attention runs as ring attention on tokens in the load-balanced
zig-zag order. The true token positions travel with the tokens, so causal
masking and RoPE stay exact and the loss equals the single-device loss.
Parameters and optimiser state are replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pallas_fa import parallel


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
  """The model's attention as `parallel.sharded_flash_attention` on a mesh.

  Batch rows are split over the data axis and each sequence over the
  sequence axis (ring attention). The tokens are already in the zig-zag
  order (`place_batch`) and the model passes their true positions, so causal
  masking and RoPE stay exact. A hashable value: it is part of the graphdef,
  a jit static.

  Attributes:
    mesh: a `make_mesh` mesh.
  """

  mesh: jax.sharding.Mesh

  def __call__(self, query, key, value, **kwargs):
    return parallel.sharded_flash_attention(
        query, key, value, mesh=self.mesh, batch_axes=parallel.DATA_AXIS,
        sequence_axis=parallel.SEQUENCE_AXIS, **kwargs)


def make_mesh(data: int, sequence: int) -> jax.sharding.Mesh | None:
  """A (data, sequence) mesh on the first data * sequence devices.

  Args:
    data: devices splitting the batch.
    sequence: devices splitting each sequence (the ring).

  Returns:
    The mesh, or None for a single device (nothing to shard).

  Raises:
    ValueError: fewer devices than data * sequence, or a size below 1.
  """
  if data < 1 or sequence < 1:
    raise ValueError(f"mesh sizes must be >= 1, got {data=}, {sequence=}.")
  if data * sequence == 1:
    return None
  if data * sequence > jax.device_count():
    raise ValueError(
        f"a {data} x {sequence} mesh needs {data * sequence} devices, but "
        f"only {jax.device_count()} exist.")
  return parallel.make_mesh(
      data=data, sequence=sequence,
      devices=jax.devices()[:data * sequence])


def place_batch(batch: dict[str, Any], mesh: jax.sharding.Mesh | None):
  """A host batch as the train/eval steps on `mesh` take it.

  One device: unchanged. On a mesh: the true token `positions` are added,
  a sequence split over the ring is padded to a multiple of 2 x ring size
  with zero-weight tokens (after every real token, so causally invisible to
  them), and `parallel.shard_batch` permutes the tokens into the zig-zag
  order and shards rows over the data axis and tokens over the sequence axis.
  Weighted losses and exact-match counts do not depend on the token order.

  Args:
    batch: {"inputs", "targets", "weights"}, each [B, T].
    mesh: a `make_mesh` mesh, or None.

  Returns:
    The batch to feed the step functions.
  """
  if mesh is None:
    return batch
  ring = mesh.shape[parallel.SEQUENCE_AXIS]
  b, t = batch["inputs"].shape
  multiple = 2 * ring if ring > 1 else 1
  tp = -(-t // multiple) * multiple
  batch = {k: np.pad(np.asarray(x), [(0, 0), (0, tp - t)])
           for k, x in batch.items()}
  batch["positions"] = np.broadcast_to(
      np.arange(tp, dtype=np.int32), (b, tp))
  return parallel.shard_batch(
      batch, mesh, batch_axes=parallel.DATA_AXIS,
      sequence_axis=parallel.SEQUENCE_AXIS)


def replicate(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
  """`tree` replicated on every device of `mesh` (unchanged without one)."""
  return tree if mesh is None else parallel.replicate(tree, mesh)


def to_single_device(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
  """`tree` on the first device, e.g. to sample with the unsharded model."""
  return tree if mesh is None else jax.device_put(tree, jax.devices()[0])
