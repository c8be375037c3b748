"""Persisted autotuning results: tile configs per device kind and backend.

`scripts/tune.py` times candidate tilings on a GPU and writes the winners to
package data, `pallas_fa/tuned/<kind>.json` (`device_file_name` turns
`jax.Device.device_kind` into `<kind>`). A tunable backend's
`default_block_sizes` asks `tuned_block_sizes` for the record nearest to a
call and falls back to its own heuristic when there is none: the heuristics
live with their backends (`triton.tiles`, `mosaic_gpu.tiles`);
this module only stores and finds records.

The JSON file holds, per backend, a list of records

    {"key": {"head_dim": 128, "dtype": "bfloat16", "q_len": 4096,
             "kv_len": 4096, "is_causal": false},
     "block_sizes": {"block_q": 128, ...}, "ms": {...}}

where `head_dim` is rounded up to a power of two (at least 16) and the
lengths to powers of two. A call takes the record with its head dim and
dtype whose lengths are nearest (in log2) to its own, preferring its own
causality; a missing file, no matching record or a record its backend's
config no longer accepts falls back to the heuristic.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
import re
from typing import Any
from typing import Callable

import jax.numpy as jnp

from pallas_fa import gpu_target
from pallas_fa import layout

TUNED_PACKAGE = "pallas_fa"
TUNED_DIR = "tuned"
# Head dims that round up to the same power of two share records.
_KEY_HEAD_DIM = layout.Alignment(head_dim=16, power_of_two=True)


def device_kind() -> str:
  """`device_kind` of the GPU kernels are built for (`gpu_target`), else of
  the default device ("cpu" when there is no GPU)."""
  return gpu_target.device_kind()


def device_file_name(kind: str) -> str:
  """A file-name-safe form of a device kind: "NVIDIA H100 80GB HBM3" ->
  "nvidia_h100_80gb_hbm3"."""
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "unknown"


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
      "head_dim": layout.padded_head_dim(head_dim, _KEY_HEAD_DIM),
      "dtype": jnp.dtype(dtype).name,
      "q_len": layout.next_power_of_2(q_len),
      "kv_len": layout.next_power_of_2(kv_len),
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


def tuned_block_sizes(
    backend: str,
    config: type,
    *,
    q_len: int,
    kv_len: int,
    head_dim: int,
    dtype,
    is_causal: bool = False,
    dropout: bool = False,
    device_kind: str | None = None,
    value_head_dim: int | None = None,
) -> Any:
  """The persisted tiling of `backend` nearest to a call, or None.

  Args:
    backend: the implementation name the records are stored under.
    config: the backend's tiling config class, built from the record.
    q_len: T.
    kv_len: S.
    head_dim: H (unpadded).
    dtype: the input dtype.
    is_causal: whether the call is causal.
    dropout: whether the call has attention dropout (records are tuned
      without; the backend adapts them).
    device_kind: a `jax.Device.device_kind`; None: that of the GPU the
      kernels are built for (`gpu_target`), else "cpu".
    value_head_dim: Hv (unpadded), None: H. Records are tuned with Hv = H:
      a call with Hv != H takes the record of the larger head dim, whose
      tiles are budgeted for wider operands than either of its own.

  Returns:
    A `config`, or None when no record matches or the record does not
    make a valid `config` (written for other field names, say).
  """
  del dropout
  kind = gpu_target.device_kind() if device_kind is None else device_kind
  head_dim = max(head_dim, value_head_dim or head_dim)
  key = tuning_key(head_dim=head_dim, dtype=dtype, q_len=q_len,
                   kv_len=kv_len, is_causal=is_causal)
  record = lookup(load_tuned(kind).get(backend, []), key)
  if not isinstance(record, dict):
    return None
  try:
    return config(**record)
  except (TypeError, ValueError):
    return None


def tuned_or_heuristic(backend: str, config: type,
                       heuristic: Callable[..., Any], **call) -> Any:
  """A tunable backend's `default_block_sizes`: `tuned_block_sizes` of the
  call, else `heuristic(**call)`.

  Args:
    backend: as for `tuned_block_sizes`.
    config: as for `tuned_block_sizes`.
    heuristic: the backend's `heuristic_block_sizes`.
    **call: the keyword arguments every `default_block_sizes` takes.

  Returns:
    A `config`.
  """
  tuned = tuned_block_sizes(backend, config, **call)
  return heuristic(**call) if tuned is None else tuned
