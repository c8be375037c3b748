"""Training the decoder-only transformer: options, steps, loop, samples.

`Options` declares every setting of a run once: each field's metadata holds
its command-line help, and `define_flags` / `options_from_flags` turn the
fields into absl flags and back. `train` runs (or resumes) a run in its
workdir: orbax checkpoints and config.json (`models.checkpoint`),
metrics.jsonl and loss.png (`models.metrics`), on one device or a (data,
sequence) mesh (`models.sharding`); `benchmark` only times training steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from absl import app
from absl import flags
from flax import nnx

from models import checkpoint
from models import config as config_lib
from models import data as data_lib
from models import generate as generate_lib
from models import layers
from models import metrics as metrics_lib
from models import sharding
from models import transformer
from pallas_fa import vjp


def option(default: Any, help_: str, choices: tuple[str, ...] | None = None,
           *, lower_bound: float | None = None):
  """A dataclass field that is also a command-line flag.

  Args:
    default: the default value (the flag's too).
    help_: the flag's help text.
    choices: the allowed values of a str option (an enum flag).
    lower_bound: the least value of a number option (a smaller one is a
      usage error when the flags are parsed).

  Returns:
    A `dataclasses.field`.
  """
  return dataclasses.field(
      default=default, metadata={"help": help_, "choices": choices,
                                 "lower_bound": lower_bound})


# --kv_cache_dtype: "auto" (the model's dtype) or a quantized cache.
KV_CACHE_DTYPES = ("auto", "int8", "float8_e4m3fn", "float8_e5m2")


def cache_dtype(name: str):
  """The dtype `--kv_cache_dtype=name` names; None for "auto"."""
  return None if name == "auto" else jnp.dtype(name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """Everything a training run depends on; each `option` field is a flag."""

  task: str = option(
      "sort", "Dataset: a synthetic task, Python's stdlib sources, or --text.",
      (*data_lib.TASKS, "pystdlib", "text"))
  text: str | None = option(
      None, "Train on this text file (implies --task=text).")
  length: int = option(
      8, "Synthetic tasks: prompt symbols (pairs for recall).",
      lower_bound=1)
  num_symbols: int = option(10, "Synthetic tasks: alphabet size.",
                            lower_bound=2)
  seq_len: int = option(256, "Text: tokens per example.", lower_bound=1)
  model: str = option("tiny", "Preset.", ("tiny", "small"))
  attention_impl: str = option(
      "auto",
      "flash_attention implementation (auto = fastest available), or a "
      "baseline: 'flax' (Flax's default, materialised attention) or "
      "'cudnn' (cuDNN's through jax.nn, NVIDIA GPUs).")
  dtype: str = option(
      "float32", "Activation dtype.", ("float32", "bfloat16"))
  remat: bool = option(False, "Rematerialise blocks.")
  use_sinks: bool = option(
      False, "Attention sinks: a learnable sink logit per head (gpt-oss).")
  position_bias: str = option(
      "rope", "Token positions: rotary embeddings, or ALiBi's fixed per-head "
      "distance penalty (a flex attention score_mod; not with "
      "--sequence_parallel).",
      config_lib.POSITION_BIASES)
  batch_size: int = option(64, "Sequences per step.", lower_bound=1)
  num_steps: int = option(600, "Training steps.", lower_bound=1)
  learning_rate: float = option(3e-3, "Peak AdamW lr.", lower_bound=0.0)
  warmup_steps: int = option(100, "Linear warmup.", lower_bound=0)
  weight_decay: float = option(0.01, "AdamW decay.", lower_bound=0.0)
  grad_clip: float = option(1.0, "Global-norm clip (0: none).",
                            lower_bound=0.0)
  eval_every: int = option(100, "Steps between evals.", lower_bound=1)
  eval_batches: int = option(8, "Batches per eval.", lower_bound=1)
  checkpoint_every: int = option(100, "Steps between checkpoints.",
                                 lower_bound=1)
  log_every: int = option(10, "Steps between logs.", lower_bound=1)
  workdir: str | None = option(
      None, "Output directory (default runs/<task>).")
  fresh: bool = option(
      False, "Delete the workdir's run (checkpoints, config.json, "
      "metrics.jsonl, loss.png; nothing else) and start over.")
  seed: int = option(0, "Initialisation and data seed.", lower_bound=0)
  num_samples: int = option(8, "Samples printed after training.",
                            lower_bound=0)
  kv_cache_dtype: str = option(
      "auto", "The KV cache's dtype when sampling: the model's (auto), or "
      "int8 / float8 values with a float32 scale per token and head.",
      KV_CACHE_DTYPES)
  data_parallel: int = option(
      1, "Devices splitting the batch (data parallelism).", lower_bound=1)
  sequence_parallel: int = option(
      1, "Devices splitting each sequence (ring attention, zig-zag layout).",
      lower_bound=1)
  benchmark_steps: int = option(
      0, "If > 0: time this many training steps after a warm-up, print "
      "tokens/s and exit (no checkpoints).", lower_bound=0)
  # Not flags: overrides of the preset's model fields (for tests and
  # experiments) and silence (for tests).
  model_overrides: tuple[tuple[str, Any], ...] = ()
  quiet: bool = False

  def __post_init__(self):
    if self.text:
      object.__setattr__(self, "task", "text")


def flag_fields(options_cls) -> list[dataclasses.Field]:
  """The fields of `options_cls` that are flags (made with `option`)."""
  return [f for f in dataclasses.fields(options_cls) if "help" in f.metadata]


def define_flags(options_cls=Options,
                 flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines one absl flag per `option` field of `options_cls`.

  Args:
    options_cls: a dataclass whose flag fields were made with `option`.
    flag_values: where to define them.
  """
  hints = typing.get_type_hints(options_cls)
  for field in flag_fields(options_cls):
    kind, meta = hints[field.name], field.metadata
    args = (field.name, field.default)
    kw = dict(help=meta["help"], flag_values=flag_values)
    if kind is bool:
      flags.DEFINE_bool(*args, **kw)
    elif kind is int:
      flags.DEFINE_integer(*args, lower_bound=meta["lower_bound"], **kw)
    elif kind is float:
      flags.DEFINE_float(*args, lower_bound=meta["lower_bound"], **kw)
    elif meta["choices"]:
      flags.DEFINE_enum(*args, enum_values=list(meta["choices"]), **kw)
    else:
      flags.DEFINE_string(*args, **kw)


def options_from_flags(options_cls=Options,
                       flag_values: flags.FlagValues = flags.FLAGS):
  """The parsed flags of `define_flags(options_cls)` as an `options_cls`."""
  return options_cls(**{f.name: flag_values[f.name].value
                        for f in flag_fields(options_cls)})


def default_workdir(opts: Options) -> str:
  """runs/<task> (runs/text-<file stem> for --text)."""
  name = opts.task
  if opts.task == "text":
    name = "text-" + os.path.splitext(os.path.basename(opts.text or ""))[0]
  return os.path.join("runs", name)


# --------------------------------------------------------------------------
# Setup: dataset, model, optimiser, mesh.


def make_dataset(opts: Options):
  """The dataset `opts` asks for.

  Raises:
    app.UsageError: settings the dataset refuses (named), or a --text file
      that cannot be read or is too short for --seq_len.
  """
  try:
    return _make_dataset(opts)
  except (OSError, ValueError, TypeError) as e:
    raise app.UsageError(f"the flags ask for an invalid dataset: {e}") from e


def _make_dataset(opts: Options):
  if opts.task in data_lib.TASKS:
    return data_lib.SyntheticTask(
        task=opts.task, length=opts.length, num_symbols=opts.num_symbols,
        seed=opts.seed)
  if opts.task == "pystdlib":
    return data_lib.TextData(
        source="pystdlib", seq_len=opts.seq_len, seed=opts.seed)
  if opts.task == "text":
    if not opts.text:
      raise app.UsageError("--task=text needs --text=PATH.")
    return data_lib.TextData(
        source=os.path.abspath(opts.text), seq_len=opts.seq_len,
        seed=opts.seed)
  raise app.UsageError(f"unknown task {opts.task!r}.")


def check_attention_impl(impl: str) -> str:
  """`--attention_impl`, checked before anything runs or is written.

  Raises:
    app.UsageError: not "auto", a baseline or a registered implementation,
      or "cudnn" without an NVIDIA GPU.
  """
  known = ("auto", *layers.BASELINES, *vjp.REGISTRY)
  if impl not in known:
    raise app.UsageError(
        f"--attention_impl must be one of {', '.join(known)}; got {impl!r}.")
  if impl == "cudnn" and jax.default_backend() != "gpu":
    raise app.UsageError(
        f"--attention_impl=cudnn needs an NVIDIA GPU; this is "
        f"{jax.default_backend()}.")
  return impl


def make_config(opts: Options, dataset) -> config_lib.TransformerConfig:
  """The model preset of `opts`, sized for `dataset`."""
  preset = getattr(config_lib.TransformerConfig, opts.model)
  impl = check_attention_impl(opts.attention_impl)
  kw = dict(
      vocab_size=dataset.vocab_size,
      attention_impl=None if impl in (None, "auto") else impl,
      dtype=opts.dtype, remat=opts.remat, use_sinks=opts.use_sinks,
      position_bias=opts.position_bias, max_len=max(256, dataset.seq_len + 1),
  )
  kw.update(dict(opts.model_overrides))
  try:
    return preset(**kw)
  except ValueError as e:  # A config the flags ask for: before any file.
    raise app.UsageError(f"the flags ask for an invalid model: {e}") from e


def make_mesh(opts: Options, dataset) -> jax.sharding.Mesh | None:
  """The (data, sequence) mesh of `opts`, or None for one device.

  Raises:
    app.UsageError: a split that the devices, batch or sequence cannot take.
  """
  data, seq = opts.data_parallel, opts.sequence_parallel
  if data < 1 or seq < 1:
    raise app.UsageError(
        f"--data_parallel and --sequence_parallel must be >= 1, got "
        f"{data} and {seq}.")
  if data * seq == 1:
    return None
  if opts.position_bias != "rope" and seq > 1:
    # Ring attention runs on the tokens in the zig-zag order, where a
    # score_mod's q_idx / kv_idx are token indices, not positions.
    raise app.UsageError(
        f"--position_bias={opts.position_bias} runs with --data_parallel "
        "only: with --sequence_parallel the tokens are in the zig-zag "
        "order, where ALiBi's token indices are not positions.")
  if data * seq > jax.device_count():
    raise app.UsageError(
        f"--data_parallel={data} x --sequence_parallel={seq} needs "
        f"{data * seq} devices, but only {jax.device_count()} exist (on CPU "
        f"set XLA_FLAGS=--xla_force_host_platform_device_count={data * seq}).")
  if opts.batch_size % data:
    raise app.UsageError(
        f"--batch_size={opts.batch_size} must be a multiple of "
        f"--data_parallel={data}.")
  if (seq > 1 and not isinstance(dataset, data_lib.SyntheticTask)
      and dataset.seq_len % (2 * seq)):
    # Synthetic tasks have a fixed (odd) length: `place_batch` pads them.
    raise app.UsageError(
        f"--seq_len={dataset.seq_len} must be a multiple of 2 x "
        f"--sequence_parallel={2 * seq} (the zig-zag layout cuts each "
        "sequence into 2 chunks per device).")
  if opts.attention_impl in layers.BASELINES:
    raise app.UsageError(
        f"--attention_impl={opts.attention_impl} cannot be sharded; choose a "
        "flash_attention implementation.")
  return sharding.make_mesh(data, seq)


# optax.tree.norm where optax has it (optax.global_norm is deprecated there).
_global_norm = getattr(getattr(optax, "tree", None), "norm",
                       None) or optax.global_norm


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
  """AdamW with linear warmup and cosine decay (hashable: a jit static)."""

  learning_rate: float
  warmup_steps: int
  num_steps: int
  weight_decay: float
  grad_clip: float

  @classmethod
  def from_options(cls, opts: Options) -> OptimizerSpec:
    """The optimiser settings of `opts`."""
    return cls(learning_rate=opts.learning_rate,
               warmup_steps=opts.warmup_steps, num_steps=opts.num_steps,
               weight_decay=opts.weight_decay, grad_clip=opts.grad_clip)

  def make(self) -> optax.GradientTransformation:
    """Clip by global norm (unless grad_clip is 0), then AdamW on the
    warmup-cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=self.learning_rate,
        warmup_steps=min(self.warmup_steps, max(self.num_steps - 1, 1)),
        decay_steps=max(self.num_steps, 2),
        end_value=self.learning_rate * 0.01,
    )
    # Decay matrices only (not norm scales).
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    clip = ([optax.clip_by_global_norm(self.grad_clip)]
            if self.grad_clip > 0 else [])
    return optax.chain(
        *clip,
        optax.adamw(schedule, b1=0.9, b2=0.98,
                    weight_decay=self.weight_decay, mask=decay_mask),
    )


@dataclasses.dataclass(frozen=True)
class Run:
  """What `opts` builds before the first step."""

  dataset: Any
  cfg: config_lib.TransformerConfig
  optim: OptimizerSpec
  mesh: jax.sharding.Mesh | None


def make_run(opts: Options) -> Run:
  """The dataset, model config, optimiser and mesh of `opts`."""
  dataset = make_dataset(opts)
  return Run(dataset=dataset, cfg=make_config(opts, dataset),
             optim=OptimizerSpec.from_options(opts),
             mesh=make_mesh(opts, dataset))


def init_state(opts: Options, cfg: config_lib.TransformerConfig,
               optim: OptimizerSpec, mesh: jax.sharding.Mesh | None = None):
  """(graphdef, {"params", "opt_state"}) freshly initialised.

  With a mesh the model's attention runs sharded over it
  (`sharding.ShardedAttention`); the parameters are the same either way.
  "params" is the whole model state (what a checkpoint holds); the
  optimiser state covers its `nnx.Param`s (`learned`).
  """
  attention_fn = None if mesh is None else sharding.ShardedAttention(mesh)
  model = transformer.Transformer(
      cfg, rngs=nnx.Rngs(opts.seed), attention_fn=attention_fn)
  graphdef, params = nnx.split(model)
  opt_state = optim.make().init(learned(params)[0])
  return graphdef, {"params": params, "opt_state": opt_state}


def learned(params):
  """(the `nnx.Param`s, the rest) of a model state: the optimiser updates
  the first; the rest (ALiBi's slopes) stays fixed."""
  return nnx.split_state(params, nnx.Param, ...)


def plain_graphdef(cfg: config_lib.TransformerConfig):
  """The graphdef of the single-device model (for sampling)."""
  abstract = nnx.eval_shape(
      lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(abstract)[0]


# --------------------------------------------------------------------------
# Loss, train step, eval step.


def loss_and_metrics(logits, batch):
  """Weighted next-token cross entropy and exact-match statistics."""
  targets, weights = batch["targets"], batch["weights"]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  total = jnp.maximum(weights.sum(), 1.0)
  loss = (nll * weights).sum() / total
  correct = (jnp.argmax(logits, axis=-1) == targets) | (weights == 0)
  # With teacher forcing, "every answer token is the argmax" is exactly
  # "greedy decoding reproduces the answer".
  exact = jnp.all(correct, axis=-1).astype(jnp.float32)
  return loss, {
      "nll_sum": (nll * weights).sum(), "weight_sum": weights.sum(),
      "exact_sum": exact.sum(), "rows": jnp.float32(exact.shape[0]),
  }


def loss_fn(graphdef, params, batch):
  """(loss, metrics) of the model `graphdef` + `params` on `batch`."""
  model = nnx.merge(graphdef, params)
  # Sharded batches carry their true token positions (zig-zag order).
  logits = model(batch["inputs"], positions=batch.get("positions"))
  return loss_and_metrics(logits, batch)


# The model structure and optimiser are static, so repeated runs with the
# same settings (resuming, tests) reuse one compilation.
@functools.partial(jax.jit, static_argnums=(0, 1))
def train_step(graphdef, optim: OptimizerSpec, state, batch):
  """One AdamW step; returns (new state, {"loss", "grad_norm"})."""
  params, fixed = learned(state["params"])
  loss_of = lambda params: loss_fn(
      graphdef, nnx.merge_state(params, fixed), batch)
  (loss, _), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
  updates, opt_state = optim.make().update(
      grads, state["opt_state"], params)
  params = optax.apply_updates(params, updates)
  return ({"params": nnx.merge_state(params, fixed), "opt_state": opt_state},
          {"loss": loss, "grad_norm": _global_norm(grads)})


@functools.partial(jax.jit, static_argnums=(0,))
def eval_step(graphdef, params, batch):
  """Summed loss and exact-match statistics of one batch."""
  return loss_fn(graphdef, params, batch)[1]


def evaluate(graphdef, params, dataset, opts: Options,
             mesh: jax.sharding.Mesh | None = None) -> dict[str, float]:
  """Loss (and exact match or bits/byte) on the fixed eval batches."""
  sums = None
  for i in range(opts.eval_batches):
    batch = sharding.place_batch(
        dataset.batch(i, opts.batch_size, "eval"), mesh)
    m = eval_step(graphdef, params, batch)
    sums = m if sums is None else jax.tree.map(jnp.add, sums, m)
  sums = jax.device_get(sums)
  loss = float(sums["nll_sum"] / max(sums["weight_sum"], 1.0))
  out = {"eval_loss": loss}
  if isinstance(dataset, data_lib.SyntheticTask):
    out["accuracy"] = float(sums["exact_sum"] / sums["rows"])
  else:
    out["bits_per_byte"] = loss / math.log(2)
  return out


# --------------------------------------------------------------------------
# The run.


def benchmark(opts: Options) -> dict[str, float]:
  """Times `opts.benchmark_steps` training steps; returns tokens/s."""
  run = make_run(opts)
  graphdef, state = init_state(opts, run.cfg, run.optim, run.mesh)
  state = sharding.replicate(state, run.mesh)

  def batch(i):
    return sharding.place_batch(
        run.dataset.batch(i, opts.batch_size), run.mesh)

  t0 = time.perf_counter()
  state, m = train_step(graphdef, run.optim, state, batch(0))
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  for i in range(opts.benchmark_steps):
    state, m = train_step(graphdef, run.optim, state, batch(i + 1))
  jax.block_until_ready(m)
  dt = time.perf_counter() - t0
  seq_len = run.dataset.seq_len
  tokens = opts.benchmark_steps * opts.batch_size * seq_len
  result = {
      "tokens_per_s": tokens / dt, "step_s": dt / opts.benchmark_steps,
      "first_step_s": compile_s, "seq_len": seq_len,
      "batch_size": opts.batch_size, "attention_impl": opts.attention_impl,
      "data_parallel": opts.data_parallel,
      "sequence_parallel": opts.sequence_parallel,
  }
  print(json.dumps(result))
  return result


class _StopRequest:
  """A signal handler: the first signal asks the loop to save and stop at
  the next step boundary; a second one interrupts at once (nothing saved)."""

  def __init__(self):
    self.requested = False

  def __call__(self, signum, frame):
    del frame
    if self.requested:
      raise KeyboardInterrupt(f"signal {signum}")
    self.requested = True


def _say(opts: Options, msg: str) -> None:
  if not opts.quiet:
    tqdm.tqdm.write(msg, file=sys.stderr)


def _train_loop(opts: Options, run: Run, graphdef, state, mngr, config, log,
                start: int):
  """Runs steps start..num_steps; returns (step, state, last tokens/s).

  The manager saves every `checkpoint_every` steps; the final step is saved
  too. Ctrl-C or SIGTERM (or an orbax preemption sync point, when several
  processes run under JAX's preemption service) saves the state at the
  current step and raises KeyboardInterrupt.
  """
  tokens_per_step = opts.batch_size * run.dataset.seq_len
  stop = _StopRequest()
  # Across processes JAX's preemption service owns SIGTERM.
  signals = (signal.SIGINT,) + (
      (signal.SIGTERM,) if jax.process_count() == 1 else ())
  old_handlers = {s: signal.signal(s, stop) for s in signals}
  # disable=None: a bar on a terminal with room for it (a pseudo-terminal
  # may report width 0), plain lines otherwise.
  narrow = shutil.get_terminal_size((0, 0)).columns < 60
  bar = tqdm.tqdm(total=opts.num_steps, initial=start, unit="step",
                  dynamic_ncols=True, file=sys.stderr,
                  disable=True if opts.quiet or narrow else None)
  step = start
  # tokens_per_s: None until a step after the first (compiling) one.
  losses, t_log, steps_timed, tokens_per_s = [], None, 0, None
  try:
    while step < opts.num_steps:
      batch = sharding.place_batch(
          run.dataset.batch(step, opts.batch_size), run.mesh)
      # Checked right before the step: `state` is exactly `step` steps in,
      # even when the signal came while the batch was being prepared.
      if stop.requested or mngr.reached_preemption(step):
        checkpoint.save(mngr, step, state, config, force=True)
        bar.close()
        _say(opts, f"Interrupted: checkpoint saved at step {step}; run the "
             "same command again to resume.")
        raise KeyboardInterrupt(f"stopped at step {step}")
      state, metrics = train_step(graphdef, run.optim, state, batch)
      step += 1
      losses.append(metrics["loss"])
      if t_log is None:
        # The first step includes compilation: start the clock after it.
        jax.block_until_ready(metrics)
        t_log, steps_timed = time.perf_counter(), 0
      else:
        steps_timed += 1
      if step % opts.log_every == 0 or step == opts.num_steps:
        loss = float(np.mean(jax.device_get(losses)))
        now = time.perf_counter()
        if steps_timed:
          tokens_per_s = steps_timed * tokens_per_step / (now - t_log)
        t_log, losses, steps_timed = now, [], 0
        log.write({"step": step, "loss": loss, "tokens_per_s": tokens_per_s})
        rate = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=rate, refresh=False)
        bar.update(step - bar.n)
        if bar.disable:
          _say(opts, f"step {step:6d}/{opts.num_steps} | loss {loss:.4f} | "
               f"{rate} tokens/s")
      # Orbax decides: a multiple of checkpoint_every, or a preemption.
      checkpoint.save(mngr, step, state, config)
      if step % opts.eval_every == 0 and step < opts.num_steps:
        ev = evaluate(graphdef, state["params"], run.dataset, opts, run.mesh)
        log.write({"step": step, **ev})
        _say(opts, f"eval @ {step}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in ev.items()))
        t_log, steps_timed = time.perf_counter(), 0
  finally:
    bar.close()
    for s, handler in old_handlers.items():
      signal.signal(s, handler)
  checkpoint.save(mngr, step, state, config, force=True)
  return step, state, tokens_per_s


# What a run writes in its workdir; --fresh removes these and nothing else.
RUN_FILES = ("checkpoints", "config.json", "metrics.jsonl", "loss.png")


def remove_run(workdir: str) -> None:
  """Deletes the files of a run in `workdir` (`RUN_FILES`), keeping any
  other file there."""
  for name in RUN_FILES:
    path = os.path.join(workdir, name)
    if os.path.isdir(path):
      shutil.rmtree(path)
    elif os.path.exists(path):
      os.remove(path)


def train(opts: Options) -> dict[str, Any]:
  """Trains (resuming if possible), evaluates, plots and samples.

  Returns:
    The final eval metrics plus "step", "wall_s", "tokens_per_s" and, for
    synthetic tasks, "generate_accuracy". With `benchmark_steps` > 0, the
    `benchmark` result instead.

  Raises:
    KeyboardInterrupt: stopped by a signal (after saving a checkpoint).
    checkpoint.IncompatibleRunError: the workdir holds a different run.
  """
  if opts.benchmark_steps > 0:
    return benchmark(opts)
  wall0 = time.perf_counter()
  workdir = opts.workdir or default_workdir(opts)
  run = make_run(opts)  # Every flag checked before a file is touched.
  if opts.fresh:
    remove_run(workdir)
  os.makedirs(workdir, exist_ok=True)
  graphdef, state = init_state(opts, run.cfg, run.optim, run.mesh)
  config = checkpoint.run_config(
      run.cfg, run.dataset, dataclasses.asdict(opts))
  mngr = checkpoint.manager(workdir, save_interval_steps=opts.checkpoint_every)
  try:
    start = mngr.latest_step() or 0
    checkpoint.write_run_config(workdir, config, resuming=start > 0)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    mesh = run.mesh
    devices = (jax.devices() if mesh is None else
               f"mesh {dict(mesh.shape)} of {mesh.devices.size} devices")
    _say(opts, f"Model {opts.model}: {n_params:,} parameters, attention "
         f"{run.cfg.attention_impl or 'auto'}; data {run.dataset.spec()}; "
         f"devices {devices}; workdir {workdir}")
    if start > 0:
      state = checkpoint.restore_state(mngr, start, state)
      _say(opts, f"Resumed from the checkpoint at step {start}.")
    state = sharding.replicate(state, mesh)
    log = metrics_lib.MetricsLog(os.path.join(workdir, "metrics.jsonl"), start)
    step, state, tokens_per_s = _train_loop(
        opts, run, graphdef, state, mngr, config, log, start)
  finally:
    # Also on errors: let an in-flight asynchronous save finish.
    mngr.wait_until_finished()
    mngr.close()
  result = {"step": step, "tokens_per_s": tokens_per_s}
  ev = evaluate(graphdef, state["params"], run.dataset, opts, mesh)
  if not log.records or log.records[-1].get("eval_loss") != ev["eval_loss"]:
    log.write({"step": step, **ev})
  result.update(ev)
  plot_path = os.path.join(workdir, "loss.png")
  metrics_lib.plot_loss(
      log.records, plot_path, f"{opts.model} model, {opts.task}")
  _say(opts, f"Done: {step} steps; final eval " + ", ".join(
      f"{k} {v:.4f}" for k, v in ev.items()) +
      f"; {time.perf_counter() - wall0:.1f} s; loss curve {plot_path}")
  if opts.num_samples > 0:
    # Sampling runs the unsharded model on one device, same parameters.
    model = nnx.merge(plain_graphdef(run.cfg),
                      sharding.to_single_device(state["params"], mesh))
    with contextlib.ExitStack() as stack:
      out = (stack.enter_context(open(os.devnull, "w")) if opts.quiet
             else sys.stdout)
      samples = generate_lib.show_samples(
          model, run.dataset, num_shown=opts.num_samples, seed=opts.seed,
          cache_dtype=cache_dtype(opts.kv_cache_dtype), out=out)
    synthetic = isinstance(run.dataset, data_lib.SyntheticTask)
    result["generate_accuracy"] = samples[0] if synthetic else None
  result["wall_s"] = time.perf_counter() - wall0
  _say(opts, f"Total wall time {result['wall_s']:.1f} s.")
  return result
