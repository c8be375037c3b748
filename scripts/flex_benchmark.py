r"""Times flex attention (score_mod, mask_mod) against the same work done
otherwise, on one implementation (`--implementation`; by default the
automatic choice: `chunked` on a CPU).

Cells, each checked before it is timed:

* document masking, `--documents` random documents per sequence:
  `mask_mod=flex.document` with a precomputed `BlockMask` (reused, as across
  layers) against the same mask as `segment_ids` (the built-in fast path)
  and against `jax.nn.dot_product_attention` with the dense [T, T] mask;
  forward and forward+backward. The block mask's own creation is timed
  too.
* ALiBi: `score_mod=flex.alibi` against the same penalty as a dense
  [N, T, T] bias through `jax.nn.dot_product_attention`, and against plain
  causal attention (the score_mod's overhead), forward and
  forward+backward.

Each candidate's output, and with fwd_bwd its gradients, are checked
against `jax.nn.dot_product_attention` doing the same work (plain causal
against `jax.nn`'s plain causal) before any cell is timed.

Command (from the repository root; the CPU table of issue 28):

  python scripts/flex_benchmark.py --seq_len=8192 \
      --json=benchmarks/results/flex_cpu.json \
      --markdown=benchmarks/results/flex_cpu.md

On a GPU, the fused kernels against their own plain calls (the jax.nn
cells then run cuDNN or XLA's dense attention, whatever jax picks):

  python scripts/flex_benchmark.py --implementation=triton \
      --dtype=bfloat16 --seq_len=16384 --heads=16 --head_dim=128
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

import pallas_fa
from pallas_fa import flex
from pallas_fa import testing

FLAGS = flags.FLAGS
MODES = ("fwd", "fwd_bwd")


def define_flags() -> None:
  """The command-line flags (only when run as a script)."""
  flags.DEFINE_integer("seq_len", 8192, "T = S.")
  flags.DEFINE_integer("batch", 1, "B.")
  flags.DEFINE_integer("heads", 4, "N (= K).")
  flags.DEFINE_integer("head_dim", 64, "H.")
  flags.DEFINE_integer("documents", 8, "Documents per sequence.")
  flags.DEFINE_integer("repeats", 3, "Timed runs per cell (the median).")
  flags.DEFINE_string("implementation", None,
                      "The pallas_fa implementation timed (default: the "
                      "automatic choice).")
  flags.DEFINE_enum("dtype", "float32", list(testing.DTYPES),
                    "The inputs' dtype.")
  flags.DEFINE_list("modes", list(MODES), "fwd and/or fwd_bwd.")
  flags.DEFINE_string("json", None, "Write the results here.")
  flags.DEFINE_string("markdown", None, "Write the table here.")


def _timed(fn, args, repeats):
  return testing.time_call(jax.jit(fn), *args, repeats=repeats).ms


def _loss_grad(attention):
  """forward+backward: the gradients of sum(out * dout) in q, k, v."""
  def f(q, k, v, dout):
    return jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v) * dout),
                    argnums=(0, 1, 2))(q, k, v)
  return f


def _check(name, got, want, tol):
  """max|got - want| (each a tuple of arrays) within tol, relative to the
  largest |want| of each array."""
  for i, (g, w) in enumerate(zip(got, want)):
    g, w = g.astype(jnp.float32), w.astype(jnp.float32)
    err = float(jnp.max(jnp.abs(g - w)))
    bound = tol * max(1.0, float(jnp.max(jnp.abs(w))))
    if not err <= bound:
      raise AssertionError(
          f"{name} (result {i}): max|err|={err:.3g} > {bound:.3g}")


def run(seq_len, batch, heads, head_dim, documents, repeats, modes,
        implementation=None, dtype="float32"):
  """Returns {"meta": ..., "results": [one record per cell]}."""
  gen = np.random.default_rng(0)
  shape = (batch, seq_len, heads, head_dim)
  q, k, v, dout = (testing.normal(gen, shape, testing.DTYPES[dtype])
                   for _ in range(4))
  # Candidates compute the same result: float32 agrees to rounding, low
  # precision to its own.
  tol = 2e-4 if dtype == "float32" else 5e-2
  attend = functools.partial(pallas_fa.flash_attention,
                             implementation=implementation)
  cuts = np.sort(gen.choice(np.arange(1, seq_len), documents - 1, False))
  ids = np.zeros((batch, seq_len), np.int32)
  for c in cuts:
    ids[:, c:] += 1
  ids = jnp.asarray(ids)
  segments = pallas_fa.SegmentIds(q=ids, kv=ids)
  dense = (ids[:, None, :, None] == ids[:, None, None, :])  # [B, 1, T, T]
  make_mask = jax.jit(lambda ids: pallas_fa.create_block_mask(
      flex.document, (ids,), batch=batch, heads=None, q_len=seq_len,
      kv_len=seq_len))
  block_mask = make_mask(ids)
  slopes = flex.alibi_slopes(heads)
  index = jnp.arange(seq_len)
  distance = jnp.abs(index[:, None] - index[None, :])  # [T, T]
  alibi_bias = (-slopes[:, None, None] * distance[None]).astype(
      q.dtype)[None]  # [1, N, T, T]
  jax_nn = jax.nn.dot_product_attention

  cells = {
      "document": {
          "flex mask_mod + BlockMask": lambda q, k, v: (
              attend(q, k, v, block_mask=block_mask)),
          "segment_ids": lambda q, k, v: attend(
              q, k, v, segment_ids=segments),
          "jax.nn dense mask": lambda q, k, v: jax.nn.dot_product_attention(
              q, k, v, mask=dense),
      },
      "alibi": {
          "flex score_mod (causal)": lambda q, k, v: attend(
              q, k, v, is_causal=True, score_mod=flex.alibi,
              score_mod_args=(slopes,)),
          "jax.nn dense ALiBi bias": lambda q, k, v: jax_nn(
              q, k, v, bias=alibi_bias, is_causal=True),
          "plain causal": lambda q, k, v: attend(q, k, v, is_causal=True),
      },
  }
  # What each candidate is checked against: jax.nn doing the same work.
  references = {
      "document": cells["document"]["jax.nn dense mask"],
      "alibi": cells["alibi"]["jax.nn dense ALiBi bias"],
      "plain causal": lambda q, k, v: jax_nn(q, k, v, is_causal=True),
  }
  results = []
  mask_ms = testing.time_call(make_mask, ids, repeats=repeats).ms
  results.append(dict(problem="document", candidate="create_block_mask",
                      mode="-", ms=mask_ms))
  unknown = set(modes) - set(MODES)
  if unknown:
    raise ValueError(f"modes must be among {MODES}, got {sorted(unknown)}.")
  for problem, candidates in cells.items():
    for name, fn in candidates.items():
      reference = references.get(name, references[problem])
      _check(f"{problem}: {name}", (jax.jit(fn)(q, k, v),),
             (jax.jit(reference)(q, k, v),), tol)
      if "fwd_bwd" in modes:
        _check(f"{problem}: {name}, gradients",
               jax.jit(_loss_grad(fn))(q, k, v, dout),
               jax.jit(_loss_grad(reference))(q, k, v, dout), tol)
    for mode in modes:
      for name, fn in candidates.items():
        if mode == "fwd":
          ms = _timed(fn, (q, k, v), repeats)
        else:
          ms = _timed(_loss_grad(fn), (q, k, v, dout), repeats)
        results.append(dict(problem=problem, candidate=name, mode=mode,
                            ms=ms))
        print(f"{problem:9s} {mode:8s} {name:28s} {ms:10.1f} ms",
              flush=True)
  for r in results:
    base = [x for x in results if x["problem"] == r["problem"]
            and x["mode"] == r["mode"] and x["candidate"] in (
                "flex mask_mod + BlockMask", "flex score_mod (causal)")]
    r["relative_to_flex"] = (r["ms"] / base[0]["ms"]) if base else None
  meta = dict(
      command=" ".join(sys.argv), device=jax.devices()[0].device_kind,
      platform=jax.default_backend(), jax=jax.__version__,
      jaxlib=jax.lib.__version__ if hasattr(jax, "lib") else None,
      batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim,
      documents=documents, dtype=dtype, repeats=repeats,
      implementation=implementation or "automatic",
      note=("Median of repeated runs on a shared 2-core machine: timings "
            "are noisy."))
  return {"meta": meta, "results": results}


def markdown(report) -> str:
  """The results as one Markdown table."""
  m = report["meta"]
  lines = [
      f"Flex attention on {m['device']} ({m['platform']}), jax "
      f"{m['jax']}: B={m['batch']}, T=S={m['seq_len']}, N={m['heads']}, "
      f"H={m['head_dim']}, {m['dtype']}, {m['documents']} documents, "
      f"implementation {m.get('implementation', 'automatic')}. "
      f"{m['note']}",
      "",
      f"`{m['command']}`",
      "",
      "| problem | mode | candidate | ms | time / flex |",
      "| --- | --- | --- | ---: | ---: |",
  ]
  for r in report["results"]:
    rel = "" if r["relative_to_flex"] is None else (
        f"{r['relative_to_flex']:.2f}")
    lines.append(f"| {r['problem']} | {r['mode']} | {r['candidate']} | "
                 f"{r['ms']:.1f} | {rel} |")
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not 1 <= FLAGS.documents <= FLAGS.seq_len:
    raise app.UsageError(
        f"--documents must be in [1, --seq_len={FLAGS.seq_len}], got "
        f"{FLAGS.documents}.")
  if not FLAGS.modes or set(FLAGS.modes) - set(MODES):
    raise app.UsageError(
        f"--modes must list fwd and/or fwd_bwd, got {FLAGS.modes}.")
  if FLAGS.implementation not in (None, *pallas_fa.implementations()):
    raise app.UsageError(
        f"--implementation must be one of "
        f"{', '.join(pallas_fa.implementations())} (here), got "
        f"{FLAGS.implementation!r}.")
  report = run(FLAGS.seq_len, FLAGS.batch, FLAGS.heads, FLAGS.head_dim,
               FLAGS.documents, FLAGS.repeats, FLAGS.modes,
               FLAGS.implementation, FLAGS.dtype)
  table = markdown(report)
  print(table)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(report, f, indent=1)
  if FLAGS.markdown:
    with open(FLAGS.markdown, "w") as f:
      f.write(table)


if __name__ == "__main__":
  define_flags()
  app.run(main)
