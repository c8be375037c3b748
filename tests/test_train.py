"""Tests of scripts/train.py and scripts/sample.py: training, resume."""

import json
import os
import signal
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from models import data

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import sample  # noqa: E402  (also imports train, which owns the flags)
import train  # noqa: E402

_RNG = np.random.default_rng()

# A very small model on a short sort task: a few steps already lower the loss.
# Every run below shares these settings, so one compilation of the train and
# eval steps serves all of them.
_OPTS = dict(
    task="sort", length=4, num_symbols=6, batch_size=16, num_steps=12,
    learning_rate=1e-2, warmup_steps=2, eval_every=1000, eval_batches=1,
    checkpoint_every=4, log_every=2, num_samples=0, quiet=True,
    model_overrides=(("num_layers", 1), ("embed_dim", 32), ("num_heads", 2),
                     ("num_kv_heads", 1), ("mlp_dim", 32)),
)


def _opts(tmp_path, name, **kw):
  return train.Options(workdir=str(tmp_path / name), **(_OPTS | kw))


def _interrupt_at(monkeypatch, step, how):
  """Makes the training loop die when it asks for batch `step`."""
  original = data.SyntheticTask.batch

  def batch(self, s, batch_size, split="train"):
    if split == "train" and s == step:
      if how == "signal":
        # The real handler path: SIGTERM becomes KeyboardInterrupt.
        os.kill(os.getpid(), signal.SIGTERM)
      else:
        raise RuntimeError("killed")  # No chance to save: like SIGKILL.
    return original(self, s, batch_size, split)

  monkeypatch.setattr(data.SyntheticTask, "batch", batch)


def _params(workdir):
  model, _, step = sample.load_model(workdir)
  return step, jax.tree.leaves(nnx.state(model))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  """An uninterrupted run: (workdir, seed, result, final params)."""
  seed = int(_RNG.integers(1000))
  tmp = tmp_path_factory.mktemp("full")
  result = train.train(_opts(tmp, "run", seed=seed))
  workdir = tmp / "run"
  step, params = _params(str(workdir))
  assert step == 12
  return workdir, seed, result, params


def _records(workdir):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines]


def test_training_lowers_loss(full_run):
  workdir, _, result, _ = full_run
  losses = [r["loss"] for r in _records(workdir) if "loss" in r]
  assert len(losses) == 6
  assert losses[-1] < 0.85 * losses[0], losses
  assert result["step"] == 12 and np.isfinite(result["eval_loss"])
  assert 0.0 <= result["accuracy"] <= 1.0
  assert (workdir / "loss.png").stat().st_size > 1000
  record = json.loads((workdir / "config.json").read_text())
  assert record["data"]["task"] == "sort"


@pytest.mark.parametrize("how, at, resumes_from", [
    # SIGTERM (like Ctrl-C) at step 7: a checkpoint is written at 7.
    ("signal", 7, 7),
    # A hard failure at step 6 saves nothing: the rerun resumes from step 4,
    # the last periodic checkpoint, losing only steps 5-6.
    ("kill", 6, 4),
])
def test_interrupted_run_resumes_exactly(
    full_run, tmp_path, monkeypatch, how, at, resumes_from):
  _, seed, _, want = full_run
  with monkeypatch.context() as m:
    _interrupt_at(m, at, how)
    with pytest.raises(KeyboardInterrupt if how == "signal" else RuntimeError):
      train.train(_opts(tmp_path, "run", seed=seed))
  assert _params(str(tmp_path / "run"))[0] == resumes_from
  train.train(_opts(tmp_path, "run", seed=seed))
  # Batches depend only on (seed, step): the resumed run ends bitwise where
  # the uninterrupted one did, and its log holds each step once.
  step, got = _params(str(tmp_path / "run"))
  assert step == 12
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)
  steps = [r["step"] for r in _records(tmp_path / "run") if "loss" in r]
  assert steps == [2, 4, 6, 8, 10, 12]


def test_resume_refuses_a_different_model(full_run):
  workdir, seed, _, _ = full_run
  with pytest.raises(Exception, match="fresh"):
    train.train(_opts(workdir.parent, "run", seed=seed, num_symbols=7))


def test_sample_script(full_run, capsys):
  acc, pred = sample.sample(str(full_run[0]), num_samples=3)
  assert pred.shape == (3, 4) and 0.0 <= acc <= 1.0
  assert "Exact match" in capsys.readouterr().out


def test_flag_defaults_match_options():
  train.flags.FLAGS(["train.py"])
  opts = train.options_from_flags()
  assert opts == train.Options()
  assert train.default_workdir(opts) == os.path.join("runs", "sort")
