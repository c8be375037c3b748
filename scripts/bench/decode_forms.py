"""The decode cache forms timed against their plain equivalents, in one run.

Four comparisons (`decode_benchmark.py --cache_forms`), each candidate
checked against the float32 result of its equivalent before it is timed:

* `dtype`: one row of S keys (B = 1, S = 32k, K = 8, N = 32, H = 128,
  T_new = 1) stored as float32, bfloat16, int8 and float8_e4m3fn (with
  scales): a narrow cache must never cost more than a wide one;
* `prefix`: B rows sharing a prefix of S_p tokens with S_own tokens each,
  decoded with `prefix_key`/`prefix_value` against the same rows over the
  materialised concatenation [B, S_p + S_own];
* `latent`: an MLA cache (H = 576, Hv = 512, K = 1) read once for K and V
  (`value=None`) against a separate 512-wide value cache (two reads) and
  against the floor of one 576-wide read (a one-column value cache).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa
from pallas_fa import kv_cache
from pallas_fa import testing


def _rows(form, cells, repeats, **shape):
  """Checks each cell `(name, fn, args, ref32, ref_same, dtype)` against
  its references, then times the ones that passed in turn
  (`testing.time_calls`), so that every ratio of two rows is of
  interleaved runs."""
  rows, timed = [], []
  for name, fn, args, ref32, ref_same, dtype in cells:
    fn = jax.jit(fn)
    check = testing.compare("out", fn(*args), ref32, ref_same, dtype=dtype,
                            precision="default")
    row = dict(form=form, impl=name, **shape)
    if check.ok:
      row.update(status="ok", max_error=check.error,
                 tolerance=check.tolerance)
      timed.append((row, fn, args))
    else:
      row.update(status="wrong", reason=check.message())
    rows.append(row)
  timings = testing.time_calls([(fn, args) for _, fn, args in timed],
                               repeats=repeats)
  for (row, _, _), timing in zip(timed, timings):
    row["ms"] = timing.ms
  return rows


def dtype_rows(implementation: str, repeats: int, *, b=1, s=32768, n=32,
               num_kv=8, h=128) -> list[dict]:
  gen = np.random.default_rng(0)
  q = testing.normal(gen, (b, 1, n, h))
  k = testing.normal(gen, (b, s, num_kv, h))
  v = testing.normal(gen, (b, s, num_kv, h))
  lengths = jnp.full((b,), s, jnp.int32)
  shape = dict(batch=b, seq_len=s, heads=n, kv_heads=num_kv, head_dim=h)

  def decode(q, k, v, **scales):
    return pallas_fa.decode_attention(q, k, v, lengths,
                                      implementation=implementation, **scales)

  ref32 = jax.jit(decode)(q, k, v)
  low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  cells = [("float32", decode, (q, k, v), ref32, None, jnp.float32),
           ("bfloat16", decode, low, ref32, jax.jit(decode)(*low),
            jnp.bfloat16)]
  for dtype in (jnp.int8, jnp.float8_e4m3fn):
    (k8, ks), (v8, vs) = (kv_cache.quantize(x, dtype) for x in (k, v))
    deq = [x.astype(jnp.float32) * c[..., None] for x, c in ((k8, ks),
                                                             (v8, vs))]
    cells.append((
        jnp.dtype(dtype).name,
        lambda q, k, v, ks, vs: decode(q, k, v, key_scale=ks, value_scale=vs),
        (q, k8, v8, ks, vs), jax.jit(decode)(q, *deq), None, jnp.float32))
  return _rows("dtype", cells, repeats, **shape)


def prefix_rows(implementation: str, repeats: int, *, b=16, s_p=16384,
                s_own=1024, n=32, num_kv=8, h=128) -> list[dict]:
  gen = np.random.default_rng(1)
  q = testing.normal(gen, (b, 1, n, h))
  pk, pv = (testing.normal(gen, (s_p, num_kv, h)) for _ in range(2))
  k, v = (testing.normal(gen, (b, s_own, num_kv, h)) for _ in range(2))
  lengths = jnp.full((b,), s_own, jnp.int32)
  shape = dict(batch=b, seq_len=s_own, prefix_len=s_p, heads=n,
               kv_heads=num_kv, head_dim=h)

  def shared(q, k, v, pk, pv):
    return pallas_fa.decode_attention(q, k, v, lengths, prefix_key=pk,
                                      prefix_value=pv,
                                      implementation=implementation)

  def materialised(q, k, v):
    return pallas_fa.decode_attention(q, k, v, lengths + s_p,
                                      implementation=implementation)

  cat_k, cat_v = (jnp.concatenate([jnp.broadcast_to(p, (b,) + p.shape), x],
                                  axis=1) for p, x in ((pk, k), (pv, v)))
  ref32 = jax.jit(materialised)(q, cat_k, cat_v)
  return _rows("prefix", [
      ("materialised", materialised, (q, cat_k, cat_v), ref32, None,
       jnp.float32),
      ("prefix", shared, (q, k, v, pk, pv), ref32, None, jnp.float32),
  ], repeats, **shape)


def latent_rows(implementation: str, repeats: int, *, b=1, s=16384, n=16,
                h=576, hv=512) -> list[dict]:
  gen = np.random.default_rng(2)
  q = testing.normal(gen, (b, 1, n, h))
  latent = testing.normal(gen, (b, s, 1, h))
  lengths = jnp.full((b,), s, jnp.int32)
  shape = dict(batch=b, seq_len=s, heads=n, kv_heads=1, head_dim=h,
               value_head_dim=hv)

  def decode(q, k, v, **kw):
    return pallas_fa.decode_attention(q, k, v, lengths,
                                      implementation=implementation, **kw)

  values = latent[..., :hv]
  ref32 = jax.jit(decode)(q, latent, values)
  one_column = latent[..., :1]
  ref_floor = jax.jit(decode)(q, latent, one_column)
  return _rows("latent", [
      ("latent", lambda q, k: decode(q, k, None, value_head_dim=hv),
       (q, latent), ref32, None, jnp.float32),
      ("separate_values", decode, (q, latent, values), ref32, None,
       jnp.float32),
      ("one_read_floor", decode, (q, latent, one_column), ref_floor, None,
       jnp.float32),
  ], repeats, **shape)


FORMS: dict[str, Callable[..., list[dict]]] = {
    "dtype": dtype_rows, "prefix": prefix_rows, "latent": latent_rows}

# (form, candidate, its baseline, the target ratio candidate / baseline).
TARGETS = (("dtype", "bfloat16", "float32", 1.0),
           ("dtype", "int8", "float32", 1 / 1.3),
           ("prefix", "prefix", "materialised", 1 / 5),
           ("latent", "latent", "one_read_floor", 1.15))


def ratios(rows: list[dict]) -> list[dict]:
  """Each target's measured time ratio (candidate / baseline)."""
  ms = {(r["form"], r["impl"]): r.get("ms") for r in rows}
  out = []
  for form, name, base, target in TARGETS:
    a, b = ms.get((form, name)), ms.get((form, base))
    if a and b:
      out.append(dict(form=form, impl=name, baseline=base, ratio=a / b,
                      target=target, met=a / b <= target))
  return out


def format_table(rows: list[dict]) -> str:
  lines = [f"{'form':<7} {'impl':<16} {'ms':>9}  status"]
  for r in rows:
    ms = f"{r['ms']:>9.2f}" if r.get("ms") else f"{'-':>9}"
    lines.append(f"{r['form']:<7} {r['impl']:<16} {ms}  {r['status']}")
  for r in ratios(rows):
    lines.append(f"{r['form']}: {r['impl']} / {r['baseline']} = "
                 f"{r['ratio']:.2f} (target <= {r['target']:.2f}: "
                 f"{'met' if r['met'] else 'MISSED'})")
  return "\n".join(lines)
