r"""Per-device memory and reachable sequence length of ring attention.

Compiles -- never runs -- the forward and backward pass of
`pallas_fa.parallel.sharded_flash_attention` with the sequence split over a
ring of P simulated CPU devices (`--xla_force_host_platform_device_count`),
and reads XLA's buffer assignment for one device (arguments + outputs +
temporaries, the memory of a device's share of the program). Since nothing
executes, sequence lengths far beyond this machine's RAM can be measured.

Two tables are printed:

* the per-device memory at a fixed sequence length (`--seq_len`) for every
  device count: the ring keeps it ~1/P of one device's;
* the longest sequence whose per-device memory fits `--budget_gib`, found by
  doubling and then bisecting T (to `--resolution`).

Memory is XLA:CPU's estimate; on a GPU the Pallas kernels keep their tiles in
on-chip memory, so the device figures there are lower, not higher.

Commands (from the repository root):

  # The table in BUILD.md: Llama-3-8B attention shapes (bf16, B=1, N=32, K=8,
  # H=128), causal, 16 GiB per device, chunked and xla per ring step.
  python scripts/parallel_memory.py

  # Other shapes / budgets:
  python scripts/parallel_memory.py --devices=1,2,4,8 --heads=16 \
      --kv_heads=16 --head_dim=64 --budget_gib=4 --impls=chunked
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app
from absl import flags

_DEVICES = flags.DEFINE_list("devices", ["1", "2", "4", "8"],
                             "Ring sizes P to measure.")
_IMPLS = flags.DEFINE_list("impls", ["chunked", "xla"],
                           "Implementations run at every ring step.")
_BATCH = flags.DEFINE_integer("batch", 1, "B.")
_HEADS = flags.DEFINE_integer("heads", 32, "Query heads N.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 8, "Key/value heads K.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dim H.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16",
                           ["float32", "bfloat16", "float16"], "Input dtype.")
_CAUSAL = flags.DEFINE_boolean("causal", True, "Causal (zig-zag layout).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 32768,
                                "T = S of the fixed-length table.")
_BUDGET_GIB = flags.DEFINE_float("budget_gib", 16.0,
                                 "Per-device memory budget, GiB.")
_RESOLUTION = flags.DEFINE_float(
    "resolution", 1 / 16, "Bisection stops when hi/lo - 1 is below this.")
_JSON = flags.DEFINE_string("json", None, "Also write the results here.")

_GIB = 1 << 30


def _per_device_bytes(mesh_devices, impl, t):
  """XLA's per-device memory of ring fwd+bwd at T = S = t (compile only)."""
  import jax  # noqa: PLC0415 (imported after XLA_FLAGS is set)
  import jax.numpy as jnp  # noqa: PLC0415

  from pallas_fa import parallel  # noqa: PLC0415

  p = len(mesh_devices)
  mesh = parallel.make_mesh(sequence=p, devices=mesh_devices)
  spec = jax.sharding.PartitionSpec(None, parallel.SEQUENCE_AXIS)
  sharding = jax.sharding.NamedSharding(mesh, spec)
  dtype = jnp.dtype(_DTYPE.value)
  b, n, k, h = _BATCH.value, _HEADS.value, _KV_HEADS.value, _HEAD_DIM.value

  def arg(shape, dt):
    return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

  def loss(q, kk, v, pos):
    # The model-level usage: tokens in the zig-zag layout, true positions.
    out = parallel.sharded_flash_attention(
        q, kk, v, mesh=mesh, sequence_axis=parallel.SEQUENCE_AXIS,
        is_causal=_CAUSAL.value, query_positions=pos, key_positions=pos,
        implementation=impl)
    return jnp.sum(out.astype(jnp.float32))

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  compiled = f.lower(
      arg((b, t, n, h), dtype), arg((b, t, k, h), dtype),
      arg((b, t, k, h), dtype), arg((b, t), jnp.int32),
  ).compile()
  stats = compiled.memory_analysis()
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def _reachable(devices, impl, budget, start):
  """Largest T (a multiple of 2P * 128) whose memory fits `budget`."""
  grain = 2 * len(devices) * 128
  fits = lambda t: _per_device_bytes(devices, impl, t) <= budget
  lo = max(grain, start // grain * grain)
  if fits(lo):
    hi = lo * 2
    while fits(hi):
      lo, hi = hi, hi * 2
  else:
    hi = lo
    lo = max(grain, lo // 2 // grain * grain)
    while lo > grain and not fits(lo):
      hi, lo = lo, max(grain, lo // 2 // grain * grain)
    if not fits(lo):
      return 0
  while hi - lo > grain and hi / lo - 1 > _RESOLUTION.value:
    mid = (lo + hi) // 2 // grain * grain
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  counts = sorted(int(d) for d in _DEVICES.value)
  # The simulated device count is fixed when jax is imported.
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={max(counts)}"
  )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # noqa: PLC0415

  devices = jax.devices()
  budget = int(_BUDGET_GIB.value * _GIB)
  shape = (f"B={_BATCH.value} N={_HEADS.value} K={_KV_HEADS.value} "
           f"H={_HEAD_DIM.value} {_DTYPE.value} causal={_CAUSAL.value}")
  print(f"# ring attention fwd+bwd, {shape}; jax {jax.__version__}, "
        f"{devices[0].platform} x{len(devices)} (simulated); "
        f"XLA buffer assignment per device")
  print(f"# command: {' '.join(sys.argv)}")
  results = {"shape": shape, "jax": jax.__version__, "fixed": [],
             "reachable": [], "budget_gib": _BUDGET_GIB.value,
             "seq_len": _SEQ_LEN.value}
  t0 = time.time()
  print(f"\nper-device memory at T = S = {_SEQ_LEN.value}:")
  print("| impl | " + " | ".join(f"P={p}" for p in counts) + " |")
  print("|---|" + "---|" * len(counts))
  fixed = {}
  for impl in _IMPLS.value:
    row = []
    for p in counts:
      mem = _per_device_bytes(devices[:p], impl, _SEQ_LEN.value)
      fixed[impl, p] = mem
      row.append(mem)
      results["fixed"].append(dict(impl=impl, devices=p, bytes=mem))
    print(f"| {impl} | " + " | ".join(f"{m / _GIB:.2f} GiB" for m in row)
          + " |", flush=True)

  print(f"\nlongest T = S with per-device memory <= {_BUDGET_GIB.value} GiB:")
  print("| impl | " + " | ".join(f"P={p}" for p in counts) + " |")
  print("|---|" + "---|" * len(counts))
  for impl in _IMPLS.value:
    row = []
    for p in counts:
      # Start from a linear extrapolation of the fixed-length measurement.
      guess = int(_SEQ_LEN.value * budget / fixed[impl, p])
      t = _reachable(devices[:p], impl, budget, guess)
      row.append(t)
      results["reachable"].append(dict(impl=impl, devices=p, seq_len=t))
    print(f"| {impl} | " + " | ".join(f"{t:,}" for t in row) + " |",
          flush=True)
  print(f"\n({time.time() - t0:.0f} s)")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
