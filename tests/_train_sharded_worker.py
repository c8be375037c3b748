"""Sharded training checks of models.train_lib, run in a fresh process.

The device count of the CPU platform is fixed when jax is first imported, so
`tests/test_train_sharded.py` runs this file as a subprocess:

  python tests/_train_sharded_worker.py WORKDIR
      8 simulated CPU devices; prints one line per check and exits non-zero
      on the first failure.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402

from models import sharding  # noqa: E402
from models import train_lib  # noqa: E402

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

_TOL = 1e-5
_START = time.time()
# A tiny model; text windows of 32 tokens split over a ring of 4 (chunks of
# 4 tokens in the zig-zag order) and batch rows over 2 data shards.
_MODEL = (("num_layers", 2), ("embed_dim", 32), ("num_heads", 4),
          ("num_kv_heads", 2), ("mlp_dim", 64))


def _say(msg):
  print(f"ok {msg} ({time.time() - _START:.1f} s)", flush=True)


def _text_file(workdir):
  """A small corpus: this repository's training code, repeated."""
  path = os.path.join(workdir, "corpus.txt")
  with open(os.path.join(_ROOT, "models", "train_lib.py"), "rb") as f:
    text = f.read()
  with open(path, "wb") as f:
    f.write(text * 2)
  return path


def _options(workdir, **kw):
  base = dict(
      task="text", text=_text_file(workdir), seq_len=32, batch_size=8,
      num_steps=8, learning_rate=1e-2, warmup_steps=1, eval_every=1000,
      eval_batches=1, checkpoint_every=1000, log_every=2, num_samples=0,
      quiet=True, workdir=os.path.join(workdir, "run"), fresh=True,
      model_overrides=_MODEL, seed=int(np.random.default_rng().integers(1000)),
  )
  return train_lib.Options(**(base | kw))


@functools.partial(jax.jit, static_argnums=(0,))
def _loss_and_grads(graphdef, params, batch):
  (loss, _), grads = jax.value_and_grad(
      train_lib.loss_fn, argnums=1, has_aux=True)(graphdef, params, batch)
  return loss, grads


def _step_matches_single_device(workdir, data, seq, task="text", **kw):
  """One step's loss and gradients on a data x seq mesh == one device."""
  opts = _options(workdir, task=task, data_parallel=data,
                  sequence_parallel=seq, **kw)
  run = train_lib.make_run(opts)
  dataset, cfg, optim, mesh = run.dataset, run.cfg, run.optim, run.mesh
  assert dict(mesh.shape) == {"data": data, "heads": 1, "sequence": seq}
  graphdef, state = train_lib.init_state(opts, cfg, optim)
  sharded_graphdef, sharded_state = train_lib.init_state(
      opts, cfg, optim, mesh)
  params = sharding.replicate(sharded_state["params"], mesh)
  for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(params),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  host = dataset.batch(3, opts.batch_size)
  batch = sharding.place_batch(host, mesh)
  assert tuple(batch["inputs"].sharding.spec) == (
      "data", "sequence" if seq > 1 else None), batch["inputs"].sharding
  want_loss, want_grads = _loss_and_grads(graphdef, state["params"], host)
  loss, grads = _loss_and_grads(sharded_graphdef, params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=_TOL, atol=_TOL)
  for (path, g), w in zip(
      jax.tree_util.tree_leaves_with_path(grads),
      jax.tree.leaves(want_grads), strict=True):
    scale = max(float(np.max(np.abs(w))), 1e-3)
    np.testing.assert_allclose(
        g, w, rtol=_TOL, atol=_TOL * scale,
        err_msg=jax.tree_util.keystr(path))
  # The sharded attention really was used: the gradients live on the mesh.
  leaf = jax.tree.leaves(grads)[0]
  assert len(leaf.sharding.device_set) == data * seq, leaf.sharding
  _say(f"{task} step on data={data} x sequence={seq}: loss "
       f"{float(loss):.6f} == {float(want_loss):.6f}, gradients equal")


def _sharded_training_lowers_loss(workdir):
  """train_lib.train end to end on the mesh: loss falls, eval and samples
  run."""
  opts = _options(workdir, data_parallel=2, sequence_parallel=4,
                  num_samples=1)
  result = train_lib.train(opts)
  path = os.path.join(opts.workdir, "metrics.jsonl")
  with open(path) as f:
    losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
  assert len(losses) == 4, losses
  assert losses[-1] < 0.9 * losses[0], losses
  assert result["step"] == 8 and np.isfinite(result["eval_loss"]), result
  _say(f"sharded training: losses {[round(x, 3) for x in losses]}, eval "
       f"{result['eval_loss']:.3f}, {result['tokens_per_s']:.0f} tokens/s")


def _validation(workdir):
  """Bad splits are refused with a UsageError that names the flag."""
  cases = [
      (dict(data_parallel=3), "--batch_size"),
      (dict(sequence_parallel=4, seq_len=36), "--seq_len"),
      (dict(data_parallel=4, sequence_parallel=4), "devices"),
      (dict(data_parallel=2, attention_impl="flax"), "flax"),
      (dict(sequence_parallel=2, position_bias="alibi"), "position_bias"),
      (dict(sequence_parallel=0), "sequence_parallel"),
  ]
  for kw, word in cases:
    opts = _options(workdir, **kw)
    try:
      train_lib.make_mesh(opts, train_lib.make_dataset(opts))
    except app.UsageError as e:
      assert word in str(e), (kw, str(e))
    else:
      raise AssertionError(f"no UsageError for {kw}")
  _say("validation")


def main():
  workdir = sys.argv[1]
  assert jax.device_count() == 8, jax.devices()
  _validation(workdir)
  _step_matches_single_device(workdir, 2, 4)
  # Synthetic tasks have an odd length: padded with zero-weight tokens.
  _step_matches_single_device(
      workdir, 2, 2, task="sort", length=3, num_symbols=5)
  # ALiBi (a flex score_mod) with the batch split: global head indices.
  _step_matches_single_device(workdir, 4, 1, position_bias="alibi")
  _sharded_training_lowers_loss(workdir)


if __name__ == "__main__":
  main()
