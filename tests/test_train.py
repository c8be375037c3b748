"""Tests of models.train_lib, models.checkpoint and the train/sample scripts:
training, checkpoint cadence, interrupting and resuming, options as flags."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from absl import app
from absl import flags
from conftest import script_module
from flax import nnx

from models import checkpoint
from models import data
from models import train_lib

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
  return train_lib.Options(workdir=str(tmp_path / name), **(_OPTS | kw))


def _interrupt_at(monkeypatch, step, how):
  """Makes the training loop die when it asks for batch `step`."""
  original = data.SyntheticTask.batch

  def batch(self, s, batch_size, split="train"):
    if split == "train" and s == step:
      if how in ("sigterm", "sigint"):
        # The real handler path: the signal stops the loop, which saves.
        os.kill(os.getpid(), getattr(signal, how.upper()))
      else:
        raise RuntimeError("killed")  # No chance to save: like SIGKILL.
    return original(self, s, batch_size, split)

  monkeypatch.setattr(data.SyntheticTask, "batch", batch)


def _params(workdir):
  model, _, step, _ = checkpoint.load_model(workdir)
  return step, jax.tree.leaves(nnx.state(model))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  """An uninterrupted run: (workdir, seed, result, final params)."""
  seed = int(_RNG.integers(1000))
  tmp = tmp_path_factory.mktemp("full")
  result = train_lib.train(_opts(tmp, "run", seed=seed))
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
    # SIGTERM or Ctrl-C at step 7: a checkpoint is written at 7.
    ("sigterm", 7, 7),
    ("sigint", 7, 7),
    # A hard failure at step 6 saves nothing: the rerun resumes from step 4,
    # the last periodic checkpoint, losing only steps 5-6.
    ("kill", 6, 4),
])
def test_interrupted_run_resumes_exactly(
    full_run, tmp_path, monkeypatch, how, at, resumes_from):
  _, seed, _, want = full_run
  handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
  with monkeypatch.context() as m:
    _interrupt_at(m, at, how)
    with pytest.raises(RuntimeError if how == "kill" else KeyboardInterrupt):
      train_lib.train(_opts(tmp_path, "run", seed=seed))
  # The training loop's signal handlers are gone again.
  assert handlers == [
      signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
  assert _params(str(tmp_path / "run"))[0] == resumes_from
  train_lib.train(_opts(tmp_path, "run", seed=seed))
  # Batches depend only on (seed, step): the resumed run ends bitwise where
  # the uninterrupted one did, and its log holds each step once.
  step, got = _params(str(tmp_path / "run"))
  assert step == 12
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)
  steps = [r["step"] for r in _records(tmp_path / "run") if "loss" in r]
  assert steps == [2, 4, 6, 8, 10, 12]


def test_checkpoints_keep_the_interval_and_the_run_config(full_run):
  workdir = full_run[0]
  # checkpoint_every=4 and the end (12); orbax keeps the last two.
  assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["8", "12"]
  mngr = checkpoint.manager(str(workdir))
  try:
    saved = checkpoint.restore_config(mngr, 12)
  finally:
    mngr.close()
  assert saved == json.loads((workdir / "config.json").read_text())
  assert saved["options"]["checkpoint_every"] == 4
  assert saved["data"]["task"] == "sort"


def test_save_cadence(tmp_path):
  """Orbax saves on the interval (and possibly a fresh run's first step);
  force saves any step once."""
  mngr = checkpoint.manager(str(tmp_path), save_interval_steps=3)
  state = {"params": {"w": np.asarray(_RNG.standard_normal((2, 3)))},
           "opt_state": {"m": np.asarray(_RNG.standard_normal(3))}}
  config = {"model": {}, "data": {"task": "sort"}, "options": {}}
  try:
    saved = {s for s in range(1, 8)
             if checkpoint.save(mngr, s, state, config)}
    assert {3, 6} <= saved <= {1, 3, 6}
    assert checkpoint.save(mngr, 7, state, config, force=True)
    assert not checkpoint.save(mngr, 7, state, config, force=True)
    mngr.wait_until_finished()
    assert mngr.latest_step() == 7
    got = checkpoint.restore_state(mngr, 7, state)
    np.testing.assert_array_equal(got["params"]["w"], state["params"]["w"])
    assert checkpoint.restore_config(mngr, 7) == config
  finally:
    mngr.close()


def test_resume_refuses_a_different_model(full_run):
  workdir, seed, _, _ = full_run
  with pytest.raises(checkpoint.IncompatibleRunError, match="fresh"):
    train_lib.train(_opts(workdir.parent, "run", seed=seed, num_symbols=7))


def test_sample_script(full_run, capsys):
  with script_module("sample") as sample:
    acc, pred = sample.sample(str(full_run[0]), num_samples=3)
  assert pred.shape == (3, 4) and 0.0 <= acc <= 1.0
  assert "exact match" in capsys.readouterr().out


def test_sample_script_with_a_quantized_cache(full_run):
  """--kv_cache_dtype=int8: the same greedy answers as the float cache on
  this run's prompts, up to the few a near-tie can flip (a quantized key
  moves each logit by about 1/254 of its row's largest)."""
  with script_module("sample") as sample:
    with open(os.devnull, "w") as out:
      _, want = sample.sample(str(full_run[0]), num_samples=16, out=out)
      _, got = sample.sample(str(full_run[0]), num_samples=16, out=out,
                             cache_dtype=train_lib.cache_dtype("int8"))
  assert got.shape == want.shape == (16, 4)
  assert np.mean(np.all(got == want, axis=1)) >= 0.75
  assert train_lib.cache_dtype("auto") is None
  assert _parse("--kv_cache_dtype=float8_e5m2").kv_cache_dtype == (
      "float8_e5m2")


def _parse(*argv):
  flag_values = flags.FlagValues()
  train_lib.define_flags(flag_values=flag_values)
  flag_values(["train.py", *argv])
  return train_lib.options_from_flags(flag_values=flag_values)


def test_flags_are_the_options():
  opts = _parse()
  assert opts == train_lib.Options()
  assert train_lib.default_workdir(opts) == os.path.join("runs", "sort")
  opts = _parse("--num_steps=7", "--remat", "--learning_rate=0.5",
                "--attention_impl=xla", "--model=small",
                "--text=/data/notes.txt", "--use_sinks",
                "--position_bias=alibi")
  assert opts == train_lib.Options(
      num_steps=7, remat=True, learning_rate=0.5, attention_impl="xla",
      model="small", task="text", text="/data/notes.txt", use_sinks=True,
      position_bias="alibi")
  assert train_lib.default_workdir(opts) == os.path.join(
      "runs", "text-notes")
  with pytest.raises(flags.IllegalFlagValueError):
    _parse("--model=huge")
  with pytest.raises(flags.IllegalFlagValueError):
    _parse("--position_bias=t5")
  # Every option but the two test-only ones is a flag.
  names = {f.name for f in train_lib.flag_fields(train_lib.Options)}
  assert names == set(train_lib.Options.__dataclass_fields__) - {
      "model_overrides", "quiet"}


@pytest.mark.parametrize("argv", [
    "--log_every=0", "--eval_every=0", "--checkpoint_every=0",
    "--batch_size=0", "--batch_size=-8", "--num_steps=0", "--length=0",
    "--num_symbols=1", "--learning_rate=-1", "--data_parallel=0",
    "--grad_clip=-1", "--seed=-1"])
def test_flags_below_their_bound_are_usage_errors(argv):
  # Rejected as the flags are parsed, before a workdir exists.
  with pytest.raises(flags.IllegalFlagValueError):
    _parse(argv)


def test_fresh_removes_only_the_run_and_only_after_the_flags_pass(
    full_run, tmp_path):
  """--fresh with a bad flag leaves the workdir alone; a good one removes
  the run's files but keeps the user's own."""
  import shutil  # noqa: PLC0415
  workdir = tmp_path / "run"
  shutil.copytree(full_run[0], workdir)
  (workdir / "notes.txt").write_text("keep")
  before = sorted(os.listdir(workdir))
  with pytest.raises(app.UsageError, match="attention_impl"):
    train_lib.train(_opts(tmp_path, "run", fresh=True,
                          attention_impl="flsh"))
  assert sorted(os.listdir(workdir)) == before
  with pytest.raises(app.UsageError, match="invalid dataset.*length"):
    train_lib.train(_opts(tmp_path, "run", fresh=True, task="recall",
                          length=20))
  assert sorted(os.listdir(workdir)) == before
  train_lib.remove_run(str(workdir))
  assert os.listdir(workdir) == ["notes.txt"]
  assert set(train_lib.RUN_FILES) <= set(before)


def test_dataset_flags_a_dataset_refuses_are_usage_errors(tmp_path):
  short = tmp_path / "short.txt"
  short.write_text("too short")
  for kw, match in ((dict(task="text", text=str(tmp_path / "none.txt")),
                     "invalid dataset.*none.txt"),
                    (dict(task="text", text=str(short)), "fewer than"),
                    (dict(task="recall", length=20), "recall")):
    with pytest.raises(app.UsageError, match=match):
      train_lib.make_dataset(train_lib.Options(**kw))


def test_grad_clip_zero_means_no_clipping():
  """--grad_clip=0 turns clipping off (it used to zero every update)."""
  spec = train_lib.OptimizerSpec(learning_rate=0.1, warmup_steps=0,
                                 num_steps=10, weight_decay=0.0,
                                 grad_clip=0.0)
  params = {"w": jax.numpy.ones((2, 2))}
  grads = {"w": jax.numpy.full((2, 2), 100.0)}
  opt = spec.make()
  updates, _ = opt.update(grads, opt.init(params), params)
  assert np.all(np.asarray(updates["w"]) < 0)


def test_attention_impl_is_checked_up_front():
  for impl in ("auto", "flax", "xla", "chunked", "triton"):
    assert train_lib.check_attention_impl(impl) == impl
  with pytest.raises(app.UsageError, match="bogus"):
    train_lib.check_attention_impl("bogus")


def test_sample_script_flags(full_run, capsys):
  """sample.py's own bounds, and --attention_impl choosing the attention
  it samples with (the same greedy answers on this run)."""
  flag_values = flags.FlagValues()
  with script_module("sample") as sample:
    train_lib.define_flags(sample.SampleOptions, flag_values=flag_values)
    for argv in ("--temperature=-1", "--top_k=-5", "--max_new_tokens=0"):
      with pytest.raises(flags.IllegalFlagValueError):
        flag_values(["sample.py", argv])
    with open(os.devnull, "w") as out:
      _, want = sample.sample(str(full_run[0]), num_samples=4, out=out)
      _, got = sample.sample(str(full_run[0]), num_samples=4, out=out,
                             attention_impl="xla")
  np.testing.assert_array_equal(got, want)


def test_metrics_are_strict_json(tmp_path):
  # A log at step 1 (before any step was timed) has no rate: null, not NaN.
  train_lib.train(_opts(tmp_path, "run", num_steps=2, log_every=1,
                        checkpoint_every=100))
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  records = [json.loads(line, parse_constant=lambda c: pytest.fail(c))
             for line in lines]
  assert records[0]["tokens_per_s"] is None
  assert records[1]["tokens_per_s"] > 0


def test_train_script_help_lists_every_option():
  root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "scripts", "train.py"), "--help"],
      capture_output=True, text=True, timeout=120, check=False)
  # absl exits with status 1 after printing the help.
  assert "Traceback" not in proc.stderr, proc.stderr
  for field in train_lib.flag_fields(train_lib.Options):
    name = field.name
    assert f"--{name}:" in proc.stdout or f"--[no]{name}:" in proc.stdout, (
        name, proc.stdout)


def test_alibi_trains_its_params_and_keeps_its_slopes(tmp_path):
  """A train step with position_bias="alibi" updates the nnx.Params and
  leaves the ALiBi slopes (Constants) as they are; it refuses the ring
  (sequence_parallel), whose tokens are in the zig-zag order."""
  opts = _opts(tmp_path, "alibi", position_bias="alibi")
  run = train_lib.make_run(opts)
  graphdef, state = train_lib.init_state(opts, run.cfg, run.optim)
  new = state
  for step in range(2):  # The warmup's first step has a zero lr.
    new, _ = train_lib.train_step(
        graphdef, run.optim, new, run.dataset.batch(step, opts.batch_size))
  params, slopes = train_lib.learned(state["params"])
  new_params, new_slopes = train_lib.learned(new["params"])
  assert len(jax.tree.leaves(slopes)) == 1  # One layer.
  for a, b in zip(jax.tree.leaves(slopes), jax.tree.leaves(new_slopes),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  assert not all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True))
  with pytest.raises(app.UsageError, match="position_bias"):
    train_lib.make_mesh(
        train_lib.Options(position_bias="alibi", sequence_parallel=2),
        run.dataset)
