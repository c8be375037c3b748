"""Block-size heuristics and persisted autotuning results, per device kind.

A backend asks `triton_block_sizes(...)` for the tiling of a call it was given
no `block_sizes=` for. The answer comes from, in order:

1. tuning results persisted as package data, `pallas_fa/tuned/<kind>.json`,
   written by `scripts/tune.py` on that device kind (`device_file_name` turns
   `jax.Device.device_kind` into `<kind>`);
2. a heuristic keyed on head dim, dtype, sequence lengths and device kind that
   keeps the software-pipelined tiles within the device's shared memory.

The JSON file holds, per backend, a list of records

    {"key": {"head_dim": 128, "dtype": "bfloat16", "q_len": 4096,
             "kv_len": 4096, "is_causal": false},
     "block_sizes": {"block_q": 128, ...}, "ms": {...}}

where `head_dim` is the padded (power of two) head dim and the lengths are
rounded up to powers of two. A call takes the record with its head dim and
dtype whose lengths are nearest (in log2) to its own, preferring its own
causality; a missing file or no matching record falls back to the heuristic.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
import re
from typing import Any

import jax.numpy as jnp

from pallas_fa import gpu_target

# Shared memory per block (bytes) the Triton compiler can use, by device-kind
# substring; the first match wins. Unknown GPUs get the conservative default.
_SHARED_MEMORY = (
    ("H100", 227 * 1024),
    ("H200", 227 * 1024),
    ("H800", 227 * 1024),
    ("GH200", 227 * 1024),
    ("B200", 227 * 1024),
    ("A100", 163 * 1024),
    ("A800", 163 * 1024),
    ("A10", 99 * 1024),
    ("L4", 99 * 1024),
    ("L40", 99 * 1024),
    ("RTX", 99 * 1024),
)
_DEFAULT_SHARED_MEMORY = 99 * 1024

TUNED_PACKAGE = "pallas_fa"
TUNED_DIR = "tuned"


def next_power_of_2(x: int) -> int:
  return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
  """The head dim the kernels compute with: a power of two, at least 16."""
  return max(16, next_power_of_2(head_dim))


def device_kind() -> str:
  """`device_kind` of the GPU kernels are built for (`gpu_target`), else of
  the default device ("cpu" when there is no GPU)."""
  return gpu_target.device_kind()


def device_file_name(kind: str) -> str:
  """A file-name-safe form of a device kind: "NVIDIA H100 80GB HBM3" ->
  "nvidia_h100_80gb_hbm3"."""
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "unknown"


def shared_memory_bytes(kind: str) -> int:
  """Shared memory per thread block usable by one kernel on `kind`."""
  for name, size in _SHARED_MEMORY:
    if name.lower() in kind.lower():
      return size
  return _DEFAULT_SHARED_MEMORY


@functools.cache
def load_tuned(kind: str) -> dict[str, list[dict[str, Any]]]:
  """The persisted tuning records of a device kind ({} if there are none).

  Args:
    kind: a `jax.Device.device_kind`.

  Returns:
    backend name -> list of records (see the module docstring).
  """
  name = device_file_name(kind) + ".json"
  try:
    resource = importlib.resources.files(TUNED_PACKAGE) / TUNED_DIR / name
    if not resource.is_file():
      return {}
    data = json.loads(resource.read_text())
  except (FileNotFoundError, ModuleNotFoundError, NotADirectoryError,
          json.JSONDecodeError):
    return {}
  return data if isinstance(data, dict) else {}


def tuning_key(
    *, head_dim: int, dtype, q_len: int, kv_len: int, is_causal: bool
) -> dict[str, Any]:
  """The key under which a tuning result is stored and looked up."""
  return {
      "head_dim": padded_head_dim(head_dim),
      "dtype": jnp.dtype(dtype).name,
      "q_len": next_power_of_2(q_len),
      "kv_len": next_power_of_2(kv_len),
      "is_causal": bool(is_causal),
  }


def lookup(
    records: list[dict[str, Any]], key: dict[str, Any]
) -> dict[str, Any] | None:
  """The block sizes of the record nearest to `key`, or None.

  Head dim and dtype must match; among those, the nearest lengths in log2
  win, then equal causality.
  """
  best, best_cost = None, None
  for record in records:
    rk = record.get("key", {})
    if rk.get("head_dim") != key["head_dim"] or rk.get("dtype") != key["dtype"]:
      continue
    try:
      cost = (
          abs(math.log2(rk["q_len"]) - math.log2(key["q_len"]))
          + abs(math.log2(rk["kv_len"]) - math.log2(key["kv_len"])),
          rk.get("is_causal") != key["is_causal"],
      )
    except (KeyError, TypeError, ValueError):
      continue
    if best_cost is None or cost < best_cost:
      best, best_cost = record.get("block_sizes"), cost
  return best


def _forward_shared_memory(bq, bk, hp, itemsize, stages):
  # Q stays resident; K and V tiles are multi-buffered by the pipeliner.
  return (bq * hp + stages * 2 * bk * hp) * itemsize


def _backward_shared_memory(b_rows, b_stream, hp, itemsize, stages):
  # One side resident (two tiles: K,V or Q,dO), the other side streamed (two
  # tiles per stage), plus the f32 [rows, stream] staging of P / dS.
  return (2 * b_rows * hp + stages * 2 * b_stream * hp) * itemsize + (
      b_rows * b_stream * 4
  )


def triton_block_sizes(
    *,
    head_dim: int,
    dtype,
    q_len: int,
    kv_len: int,
    is_causal: bool = False,
    kind: str | None = None,
) -> dict[str, int]:
  """Default tiling of the `triton` backend for one call.

  Args:
    head_dim: H (before padding).
    dtype: the input dtype.
    q_len: T.
    kv_len: S.
    is_causal: whether the call is causal (used to pick tuned records).
    kind: device kind; defaults to that of the default device.

  Returns:
    Keyword arguments of `pallas_fa.triton.BlockSizes`.
  """
  kind = device_kind() if kind is None else kind
  key = tuning_key(head_dim=head_dim, dtype=dtype, q_len=q_len,
                   kv_len=kv_len, is_causal=is_causal)
  tuned = lookup(load_tuned(kind).get("triton", []), key)
  if tuned:
    return dict(tuned)
  return triton_heuristic(key["head_dim"], jnp.dtype(dtype).itemsize, kind)


def triton_heuristic(hp: int, itemsize: int, kind: str) -> dict[str, int]:
  """FlashAttention-2 style tiles, shrunk until they fit shared memory."""
  if kind == "cpu" or "cpu" in kind.lower():
    # Interpret mode: the cost is per grid step and per loop iteration, so
    # large tiles are fastest; there is no shared memory to respect.
    return dict(block_q=128, block_k=128, block_q_dkv=128, block_kv_dkv=128,
                block_q_dq=128, block_kv_dq=128, num_warps=4, num_stages=1)
  budget = shared_memory_bytes(kind)
  wide = itemsize >= 4  # float32 tiles take twice the memory.
  # Hopper's wgmma reads both operands from shared memory; older GPUs
  # (mma.sync) hold them in registers, which leaves less for accumulators.
  hopper = any(name in kind for name in ("H100", "H200", "H800", "GH200"))
  # Register budgets below were read off ptxas (`scripts/compile_check.py`):
  # each choice is the largest tiling that compiles without spilling.
  if hp <= 64:
    fwd = (128, 64 if wide else 128)
    warps = 4 if hopper and not wide else 8
  elif hp <= 128:
    fwd = (128, 32 if wide else 64)
    warps = 8
  else:
    fwd = (32 if wide else 64, 32)
    warps = 8
  # dK/dV keeps a K/V tile resident and streams Q; dQ the converse. The
  # streamed side is the narrow one (FlashAttention-2 §3.2). dK/dV works on
  # S^T = K Q^T, so its key tile is the M dimension of every matmul (at
  # least 64, one Hopper wgmma, where registers allow): the two float32
  # accumulators [block_kv, Hp] plus the [block_kv, block_q] logits must fit
  # 8 warps' registers. At head dim 256 that caps the key tile at 32.
  if hp <= 64:
    dkv, dq = (64 if hopper and not wide else 32, 128), (128, 64)
  elif hp <= 128:
    dkv, dq = (32, 128 if hopper and not wide else 64), (128, 32)
  else:
    dkv, dq = (16, 32), (64, 32)
  if wide:
    # float32 operands: twice the registers per element again.
    if hp <= 64:
      dkv, dq = (16, dkv[1]), (32, 64)
    elif hp <= 128:
      dkv, dq = (16, 32), (32, 32)
    else:
      dkv, dq = (16, 16), (16, 32)
  warps_bwd = 8
  # Deeper backward pipelines than this spill at head dim 256.
  max_stages_bwd = 3 if hp <= 128 else 2

  def bwd_bytes(dkv, dq, stages):
    return max(_backward_shared_memory(dkv[1], dkv[0], hp, itemsize, stages),
               _backward_shared_memory(dq[0], dq[1], hp, itemsize, stages))

  # Deepest software pipeline that fits; shrink the resident tiles (never
  # below 32 rows) when not even one stage does.
  while (_forward_shared_memory(*fwd, hp, itemsize, 1) > budget
         and fwd[0] > 32):
    fwd = (fwd[0] // 2, fwd[1])
  while bwd_bytes(dkv, dq, 1) > budget and max(dkv[1], dq[0]) > 32:
    dkv, dq = (dkv[0], max(32, dkv[1] // 2)), (max(32, dq[0] // 2), dq[1])
  stages = 3
  while stages > 1 and (
      _forward_shared_memory(*fwd, hp, itemsize, stages) > budget):
    stages -= 1
  stages_bwd = max_stages_bwd
  while stages_bwd > 1 and bwd_bytes(dkv, dq, stages_bwd) > budget:
    stages_bwd -= 1
  return dict(
      block_q=fwd[0], block_k=fwd[1],
      block_q_dkv=dkv[0], block_kv_dkv=dkv[1],
      block_q_dq=dq[0], block_kv_dq=dq[1],
      num_warps=warps, num_stages=stages,
      num_warps_bwd=warps_bwd, num_stages_bwd=stages_bwd,
  )
