r"""Benchmarks `decode_attention` against the plain calls it replaces.

Decoding is memory-bound, so each cell reports the K/V bytes it must read,
the achieved rate, and that rate's share of the machine's memory bandwidth,
measured in the same run as the rate of a large on-device copy. Each
`decode_attention` implementation of --implementations is one candidate
(`decode/chunked`, `decode/triton`; the triton kernel runs interpreted on a
CPU, so keep its shapes tiny there); "decode x" is how many times faster
the first of them ran than each row. Peers in the same run:
`flash_attention` on the same cache (key lengths and query positions; the
plain call that decoding used before), and `jax.nn.dot_product_attention`
with a [B, 1, T_new, S] mask.

    python scripts/decode_benchmark.py                    # CPU subset
    python scripts/decode_benchmark.py --batch=1,8,32 \
        --seq_lens=1024,4096,16384,32768,65536,131072 --kv_heads=32,8,1 \
        --head_dims=128,512,4096 --new_tokens=1,4 --dtype=bfloat16 \
        --max_cache_gib=16 --json=decode.json            # the full grid
    python scripts/decode_benchmark.py --implementations=chunked,triton \
        --page_size=64                                   # both, paged

Cells whose cache exceeds --max_cache_gib are listed as skipped.
"""

from __future__ import annotations

import functools
import json
import platform as host_platform
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

import pallas_fa
from pallas_fa import api
from pallas_fa import testing

_BATCH = flags.DEFINE_list("batch", ["1", "8"], "Batch sizes B.")
_SEQ = flags.DEFINE_list(
    "seq_lens", ["4096", "32768"], "Cache lengths S (all rows full).")
_HEADS = flags.DEFINE_integer("heads", 32, "Query heads N.")
_KV_HEADS = flags.DEFINE_list("kv_heads", ["32", "8", "1"], "K/V heads K.")
_HEAD_DIMS = flags.DEFINE_list("head_dims", ["128"], "Head dims H.")
_NEW = flags.DEFINE_list("new_tokens", ["1", "4"], "New tokens T_new.")
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", list(testing.DTYPES), "Input dtype.")
_PAGE = flags.DEFINE_integer(
    "page_size", 0, "Read the cache as shuffled pages of this size (0: "
    "contiguous).")
_MAX_GIB = flags.DEFINE_float(
    "max_cache_gib", 1.0, "Skip cells whose K/V cache exceeds this.")
_IMPLEMENTATIONS = flags.DEFINE_list(
    "implementations", None, "decode_attention implementations timed "
    "(default: chunked,triton on a GPU, chunked elsewhere).")
_PEERS = flags.DEFINE_list(
    "peers", ["flash_attention", "jax_nn"], "Peers timed in the same run.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per cell.")
_JSON = flags.DEFINE_string("json", None, "Write the report here.")


def copy_bandwidth(nbytes: int, dtype, repeats: int) -> float:
  """Bytes per second of an on-device elementwise copy (read + write)."""
  x = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
  fn = jax.jit(lambda x: x * 2)
  timing = testing.time_call(fn, x, repeats=repeats, min_run_s=0.05)
  return 2 * x.nbytes / timing.median_s


def _inputs(b, s, n, num_kv, h, t, dtype, page_size, seed=0):
  gen = np.random.default_rng(seed)
  q = testing.normal(gen, (b, t, n, h), dtype)
  k = testing.normal(gen, (b, s, num_kv, h), dtype)
  v = testing.normal(gen, (b, s, num_kv, h), dtype)
  lengths = jnp.full((b,), s, jnp.int32)
  table = None
  if page_size:
    pages = b * (s // page_size)
    order = jnp.asarray(gen.permutation(pages), jnp.int32)
    # Page order[i] holds the i-th page of the row-major cache.
    k_pages = k.reshape(pages, page_size, num_kv, h)
    v_pages = v.reshape(pages, page_size, num_kv, h)
    inverse = jnp.argsort(order)
    table = order.reshape(b, s // page_size)
    k, v = k_pages[inverse], v_pages[inverse]
  return q, k, v, lengths, table


def implementations() -> list[str]:
  """The decode implementations this run times."""
  if _IMPLEMENTATIONS.value:
    return list(_IMPLEMENTATIONS.value)
  return ["chunked", "triton"] if api.platform() == "gpu" else ["chunked"]


def _candidates(t, s, page_size, impls):
  q_pos = lambda lengths: (lengths[:, None] - t  # noqa: E731
                           + jnp.arange(t, dtype=jnp.int32)[None, :])

  def decode(q, k, v, lengths, table, impl):
    return pallas_fa.decode_attention(q, k, v, lengths, block_table=table,
                                      implementation=impl)

  def plain(q, k, v, lengths, table):
    del table
    return pallas_fa.flash_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=lengths,
        query_positions=q_pos(lengths))

  def jax_nn(q, k, v, lengths, table):
    del table
    kv_pos = jnp.arange(s, dtype=jnp.int32)[None, None, None, :]
    visible = ((kv_pos <= q_pos(lengths)[:, None, :, None])
               & (kv_pos < lengths[:, None, None, None]))
    return jax.nn.dot_product_attention(q, k, v, mask=visible)

  out = {f"decode/{impl}": functools.partial(decode, impl=impl)
         for impl in impls}
  if not page_size:  # The peers read a contiguous cache.
    out.update(flash_attention=plain, jax_nn=jax_nn)
  return out


def run_cell(b, s, n, num_kv, h, t, dtype, page_size, peers, repeats,
             bandwidth):
  """Times every candidate on one shape; returns one row per candidate."""
  itemsize = jnp.dtype(dtype).itemsize
  kv_bytes = 2 * b * s * num_kv * h * itemsize
  base = dict(batch=b, seq_len=s, heads=n, kv_heads=num_kv, head_dim=h,
              new_tokens=t, dtype=jnp.dtype(dtype).name,
              page_size=page_size, kv_bytes=kv_bytes)
  if kv_bytes > _MAX_GIB.value * 2**30:
    return [dict(base, impl="*", status="skipped",
                 reason=f"cache {kv_bytes / 2**30:.1f} GiB > "
                        f"--max_cache_gib")]
  args = _inputs(b, s, n, num_kv, h, t, dtype, page_size)
  rows, times = [], {}
  impls = implementations()
  first = f"decode/{impls[0]}"
  for name, fn in _candidates(t, s, page_size, impls).items():
    if not name.startswith("decode/") and name not in peers:
      continue
    try:
      timing = testing.time_call(jax.jit(fn), *args, repeats=repeats)
    except Exception as e:  # noqa: BLE001  (reported, never hidden)
      rows.append(dict(base, impl=name, status="error",
                       reason=str(e).splitlines()[0][:200]))
      continue
    times[name] = timing.median_s
    rate = kv_bytes / timing.median_s
    rows.append(dict(base, impl=name, status="ok", ms=timing.ms,
                     bytes_per_s=rate, bandwidth_share=rate / bandwidth))
  for row in rows:
    if first in times and row.get("status") == "ok":
      row["decode_speedup"] = times[row["impl"]] / times[first]
  return rows


def format_table(rows, header: bool = True) -> str:
  lines = [f"{'B':>3} {'S':>7} {'K':>3} {'H':>5} {'T':>2} "
           f"{'impl':<17} {'ms':>9} {'GB/s':>7} {'of bw':>6} "
           f"{'decode x':>8}"] if header else []
  for r in rows:
    head = (f"{r['batch']:>3} {r['seq_len']:>7} {r['kv_heads']:>3} "
            f"{r['head_dim']:>5} {r['new_tokens']:>2} {r['impl']:<17}")
    if r["status"] != "ok":
      lines.append(f"{head} {r['status']}: {r['reason']}")
      continue
    lines.append(
        f"{head} {r['ms']:>9.3f} {r['bytes_per_s'] / 1e9:>7.2f} "
        f"{r['bandwidth_share']:>6.0%} {r.get('decode_speedup', 0):>8.2f}")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
  del argv
  dtype = testing.DTYPES[_DTYPE.value]
  ints = lambda values: [int(x) for x in values]  # noqa: E731
  bandwidth = copy_bandwidth(1 << 28, dtype, _REPEATS.value)
  print(f"device: {jax.devices()[0].device_kind}; copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s")
  rows = []
  for b in ints(_BATCH.value):
    for s in ints(_SEQ.value):
      for num_kv in ints(_KV_HEADS.value):
        for h in ints(_HEAD_DIMS.value):
          for t in ints(_NEW.value):
            cell = run_cell(b, s, _HEADS.value, num_kv, h, t, dtype,
                            _PAGE.value, _PEERS.value, _REPEATS.value,
                            bandwidth)
            print(format_table(cell, header=False), flush=True)
            rows += cell
  print(format_table(rows))
  if _JSON.value:
    report = dict(
        device=jax.devices()[0].device_kind, platform=api.platform(),
        jax=jax.__version__, python=sys.version.split()[0],
        host=host_platform.processor() or host_platform.machine(),
        command=" ".join(sys.argv), copy_bandwidth=bandwidth, rows=rows)
    with open(_JSON.value, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  app.run(main)
