r"""Trains the decoder-only transformer on a built-in dataset, then samples.

The default trains the tiny model on the synthetic sort task on CPU to >= 99%
exact-match accuracy in a few minutes:

    python scripts/train.py

Other datasets and settings:

    python scripts/train.py --task=recall          # or copy
    python scripts/train.py --task=pystdlib        # Python's stdlib sources
    python scripts/train.py --text=PATH --seq_len=512 --model=small
    python scripts/train.py --attention_impl=xla   # any flash_attention impl,
                                                   # or "flax" (baseline)
    python scripts/train.py --task=pystdlib --seq_len=4096 --batch_size=1 \
        --benchmark_steps=5                        # training tokens/s only

Multi-device: --data_parallel=D splits the batch over D devices and
--sequence_parallel=S splits every sequence over S devices (ring attention,
in the load-balanced zig-zag token order), on the first D * S devices. On CPU,
simulate devices with XLA_FLAGS:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python scripts/train.py --task=pystdlib --seq_len=256 \
        --data_parallel=2 --sequence_parallel=4

Everything lands in --workdir (default runs/<task>): orbax checkpoints, a
metrics log, the loss curve (loss.png) and the run's config. Interrupting
(Ctrl-C, SIGTERM, or even SIGKILL) and running the same command again resumes
from the last checkpoint; --fresh starts over.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import app
from absl import flags
from absl import logging
from flax import nnx

from models import config as config_lib
from models import data as data_lib
from models import generate as generate_lib
from models import transformer
from pallas_fa import parallel

_TASK = flags.DEFINE_enum(
    "task", "sort", list(data_lib.TASKS) + ["pystdlib", "text"],
    "Dataset: a synthetic task, Python's stdlib sources, or --text.")
_TEXT = flags.DEFINE_string(
    "text", None, "Train on this text file (implies --task=text).")
_LENGTH = flags.DEFINE_integer(
    "length", 8, "Synthetic tasks: prompt symbols (pairs for recall).")
_NUM_SYMBOLS = flags.DEFINE_integer(
    "num_symbols", 10, "Synthetic tasks: alphabet size.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Text: tokens per example.")
_MODEL = flags.DEFINE_enum("model", "tiny", ["tiny", "small"], "Preset.")
_ATTENTION_IMPL = flags.DEFINE_string(
    "attention_impl", "auto",
    "flash_attention implementation (auto = fastest available), or 'flax' "
    "for Flax's default (materialised) attention as a baseline.")
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"], "Activation dtype.")
_REMAT = flags.DEFINE_bool("remat", False, "Rematerialise blocks.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Sequences per step.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 600, "Training steps.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW lr.")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 100, "Linear warmup.")
_WEIGHT_DECAY = flags.DEFINE_float("weight_decay", 0.01, "AdamW decay.")
_GRAD_CLIP = flags.DEFINE_float("grad_clip", 1.0, "Global-norm clip.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 100, "Steps between evals.")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 8, "Batches per eval.")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 100, "Steps between checkpoints.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 10, "Steps between logs.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (default runs/<task>).")
_FRESH = flags.DEFINE_bool(
    "fresh", False, "Delete the workdir's checkpoints and start over.")
_SEED = flags.DEFINE_integer("seed", 0, "Initialisation and data seed.")
_NUM_SAMPLES = flags.DEFINE_integer(
    "num_samples", 8, "Samples printed after training.")
_DATA_PARALLEL = flags.DEFINE_integer(
    "data_parallel", 1, "Devices splitting the batch (data parallelism).")
_SEQUENCE_PARALLEL = flags.DEFINE_integer(
    "sequence_parallel", 1,
    "Devices splitting each sequence (ring attention, zig-zag layout).")
_BENCHMARK_STEPS = flags.DEFINE_integer(
    "benchmark_steps", 0,
    "If > 0: time this many training steps after a warm-up, print tokens/s "
    "and exit (no checkpoints).")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """Everything a training run depends on (the flags, as a value)."""

  task: str = "sort"
  text: str | None = None
  length: int = 8
  num_symbols: int = 10
  seq_len: int = 256
  model: str = "tiny"
  attention_impl: str | None = None
  dtype: str = "float32"
  remat: bool = False
  batch_size: int = 64
  num_steps: int = 600
  learning_rate: float = 3e-3
  warmup_steps: int = 100
  weight_decay: float = 0.01
  grad_clip: float = 1.0
  eval_every: int = 100
  eval_batches: int = 8
  checkpoint_every: int = 100
  log_every: int = 10
  workdir: str | None = None
  fresh: bool = False
  seed: int = 0
  num_samples: int = 8
  benchmark_steps: int = 0
  data_parallel: int = 1
  sequence_parallel: int = 1
  # Overrides of the preset's model fields (for tests and experiments).
  model_overrides: tuple[tuple[str, Any], ...] = ()
  quiet: bool = False


def options_from_flags() -> Options:
  """The parsed command-line flags as `Options`."""
  impl = _ATTENTION_IMPL.value
  task = "text" if _TEXT.value else _TASK.value
  return Options(
      task=task, text=_TEXT.value, length=_LENGTH.value,
      num_symbols=_NUM_SYMBOLS.value, seq_len=_SEQ_LEN.value,
      model=_MODEL.value, attention_impl=None if impl == "auto" else impl,
      dtype=_DTYPE.value, remat=_REMAT.value, batch_size=_BATCH_SIZE.value,
      num_steps=_NUM_STEPS.value, learning_rate=_LEARNING_RATE.value,
      warmup_steps=_WARMUP_STEPS.value, weight_decay=_WEIGHT_DECAY.value,
      grad_clip=_GRAD_CLIP.value, eval_every=_EVAL_EVERY.value,
      eval_batches=_EVAL_BATCHES.value,
      checkpoint_every=_CHECKPOINT_EVERY.value, log_every=_LOG_EVERY.value,
      workdir=_WORKDIR.value, fresh=_FRESH.value, seed=_SEED.value,
      num_samples=_NUM_SAMPLES.value, benchmark_steps=_BENCHMARK_STEPS.value,
      data_parallel=_DATA_PARALLEL.value,
      sequence_parallel=_SEQUENCE_PARALLEL.value,
  )


# --------------------------------------------------------------------------
# Setup: dataset, model, optimiser.


def make_dataset(opts: Options):
  """The dataset `opts` asks for."""
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


def make_config(opts: Options, dataset) -> config_lib.TransformerConfig:
  """The model preset of `opts`, sized for `dataset`."""
  preset = getattr(config_lib.TransformerConfig, opts.model)
  kw = dict(
      vocab_size=dataset.vocab_size, attention_impl=opts.attention_impl,
      dtype=opts.dtype, remat=opts.remat,
  )
  kw["max_len"] = max(256, _seq_len(dataset) + 1)
  kw.update(dict(opts.model_overrides))
  return preset(**kw)


def _seq_len(dataset) -> int:
  return dataset.seq_len


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
    """Clip by global norm, then AdamW on the warmup-cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=self.learning_rate,
        warmup_steps=min(self.warmup_steps, max(self.num_steps - 1, 1)),
        decay_steps=max(self.num_steps, 2),
        end_value=self.learning_rate * 0.01,
    )
    # Decay matrices only (not norm scales).
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(self.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.98,
                    weight_decay=self.weight_decay, mask=decay_mask),
    )


def init_state(opts: Options, cfg: config_lib.TransformerConfig,
               optim: OptimizerSpec, mesh: jax.sharding.Mesh | None = None):
  """(graphdef, {"params", "opt_state"}) freshly initialised.

  With a mesh the model's attention runs sharded over it (`ShardedAttention`)
  and the state is replicated on it; the parameters are the same either way.
  """
  attention_fn = None if mesh is None else ShardedAttention(mesh)
  model = transformer.Transformer(
      cfg, rngs=nnx.Rngs(opts.seed), attention_fn=attention_fn)
  graphdef, params = nnx.split(model)
  return graphdef, {"params": params, "opt_state": optim.make().init(params)}


def plain_graphdef(cfg: config_lib.TransformerConfig):
  """The graphdef of the single-device model (for sampling)."""
  abstract = nnx.eval_shape(
      lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(abstract)[0]


# --------------------------------------------------------------------------
# Multi-device placement: a (data, sequence) mesh.


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
  """The model's attention as `parallel.sharded_flash_attention` on a mesh.

  Batch rows are split over the data axis and each sequence over the
  sequence axis (ring attention). The tokens are already in the zig-zag
  order (`place_batch`) and the model passes their true positions, so causal
  masking and RoPE stay exact. A hashable value: it is part of the graphdef,
  a jit static.

  Attributes:
    mesh: a `parallel.make_mesh` mesh.
  """

  mesh: jax.sharding.Mesh

  def __call__(self, query, key, value, **kwargs):
    return parallel.sharded_flash_attention(
        query, key, value, mesh=self.mesh, batch_axes=parallel.DATA_AXIS,
        sequence_axis=parallel.SEQUENCE_AXIS, **kwargs)


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
  if opts.attention_impl == "flax":
    raise app.UsageError(
        "--attention_impl=flax cannot be sharded; choose a flash_attention "
        "implementation.")
  return parallel.make_mesh(
      data=data, sequence=seq, devices=jax.devices()[:data * seq])


def place_batch(batch, mesh: jax.sharding.Mesh | None):
  """A host batch as the train/eval steps on `mesh` take it.

  One device: unchanged. On a mesh: the true token `positions` are added,
  a sequence split over the ring is padded to a multiple of 2 x ring size
  with zero-weight tokens (after every real token, so causally invisible to
  them), and `parallel.shard_batch` permutes the tokens into the zig-zag
  order and shards rows over the data axis and tokens over the sequence axis.
  Weighted losses and exact-match counts do not depend on the token order.
  """
  if mesh is None:
    return batch
  ring = mesh.shape[parallel.SEQUENCE_AXIS]
  b, t = batch["inputs"].shape
  multiple = 2 * ring if ring > 1 else 1
  tp = -(-t // multiple) * multiple
  batch = {k: np.pad(np.asarray(x), [(0, 0), (0, tp - t)])
           for k, x in batch.items()}
  batch["positions"] = np.broadcast_to(
      np.arange(tp, dtype=np.int32), (b, tp))
  return parallel.shard_batch(
      batch, mesh, batch_axes=parallel.DATA_AXIS,
      sequence_axis=parallel.SEQUENCE_AXIS)


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


def _loss_fn(graphdef, params, batch):
  model = nnx.merge(graphdef, params)
  # Sharded batches carry their true token positions (zig-zag order).
  logits = model(batch["inputs"], positions=batch.get("positions"))
  return loss_and_metrics(logits, batch)


# The model structure and optimiser are static, so repeated runs with the
# same settings (resuming, tests) reuse one compilation.
@functools.partial(jax.jit, static_argnums=(0, 1))
def train_step(graphdef, optim: OptimizerSpec, state, batch):
  """One AdamW step; returns (new state, {"loss", "grad_norm"})."""
  (loss, _), grads = jax.value_and_grad(_loss_fn, argnums=1, has_aux=True)(
      graphdef, state["params"], batch)
  updates, opt_state = optim.make().update(
      grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  return ({"params": params, "opt_state": opt_state},
          {"loss": loss, "grad_norm": optax.global_norm(grads)})


@functools.partial(jax.jit, static_argnums=(0,))
def eval_step(graphdef, params, batch):
  """Summed loss and exact-match statistics of one batch."""
  return _loss_fn(graphdef, params, batch)[1]


def evaluate(graphdef, params, dataset, opts: Options,
             mesh: jax.sharding.Mesh | None = None) -> dict[str, float]:
  """Loss (and exact match or bits/byte) on the fixed eval batches."""
  sums = None
  for i in range(opts.eval_batches):
    batch = place_batch(dataset.batch(i, opts.batch_size, "eval"), mesh)
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
# Checkpoints and the run directory.


def default_workdir(opts: Options) -> str:
  """runs/<task> (runs/text-<file stem> for --text)."""
  name = opts.task
  if opts.task == "text":
    name = "text-" + os.path.splitext(os.path.basename(opts.text or ""))[0]
  return os.path.join("runs", name)


def checkpoint_manager(workdir: str) -> ocp.CheckpointManager:
  """Orbax manager of <workdir>/checkpoints, keeping the last two."""
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
  )


def save_checkpoint(mngr, step: int, state) -> None:
  """Saves params and optimiser state at `step` (asynchronously)."""
  mngr.save(
      step,
      args=ocp.args.Composite(
          params=ocp.args.StandardSave(state["params"]),
          opt_state=ocp.args.StandardSave(state["opt_state"]),
      ),
      force=True,
  )


def restore_params(mngr, step: int, params):
  """Restores only the parameters (for sampling)."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
  restored = mngr.restore(
      step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
  return restored["params"]


def restore_state(mngr, step: int, state):
  """Restores params and optimiser state shaped like `state`."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = mngr.restore(
      step,
      args=ocp.args.Composite(
          params=ocp.args.StandardRestore(abstract["params"]),
          opt_state=ocp.args.StandardRestore(abstract["opt_state"]),
      ),
  )
  return {"params": restored["params"], "opt_state": restored["opt_state"]}


def _architecture(cfg_dict: dict[str, Any]) -> dict[str, Any]:
  """The config fields that change the parameters' shapes or meaning."""
  ignore = ("attention_impl", "attention_block_sizes", "remat", "dtype")
  return {k: v for k, v in cfg_dict.items() if k not in ignore}


def write_run_config(workdir, cfg, dataset, opts, resuming: bool) -> None:
  """Writes config.json; refuses to resume a different model or dataset."""
  path = os.path.join(workdir, "config.json")
  record = {"model": cfg.to_dict(), "data": dataset.spec(),
            "options": dataclasses.asdict(opts)}
  if resuming and os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if (_architecture(old["model"]) != _architecture(record["model"])
        or old["data"] != record["data"]):
      raise app.UsageError(
          f"{workdir} holds a run of a different model or dataset; pass "
          "--fresh to overwrite it or choose another --workdir.")
  with open(path, "w") as f:
    json.dump(record, f, indent=2, default=str)


def load_run(workdir: str):
  """(TransformerConfig, dataset) of the run stored in `workdir`."""
  with open(os.path.join(workdir, "config.json")) as f:
    record = json.load(f)
  return (config_lib.TransformerConfig.from_dict(record["model"]),
          data_lib.from_spec(record["data"]))


class MetricsLog:
  """metrics.jsonl: one JSON object per log/eval event, truncated on resume."""

  def __init__(self, path: str, start_step: int):
    self.path = path
    self.records = []
    if start_step > 0 and os.path.exists(path):
      with open(path) as f:
        self.records = [json.loads(line) for line in f if line.strip()]
      self.records = [r for r in self.records if r["step"] <= start_step]
    with open(path, "w") as f:
      for r in self.records:
        f.write(json.dumps(r) + "\n")

  def write(self, record: dict[str, Any]) -> None:
    """Appends one record."""
    self.records.append(record)
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")


def plot_loss(records, path: str, title: str) -> None:
  """Writes the training/eval loss curve (and accuracy, if any) as a PNG."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  train = [(r["step"], r["loss"]) for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  fig, ax = plt.subplots(figsize=(7, 4.2))
  if train:
    ax.plot(*zip(*train), label="train loss", lw=1)
  if evals:
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals],
            "o-", label="eval loss")
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("cross entropy (nats/token)")
  ax.grid(alpha=0.3)
  handles, labels = ax.get_legend_handles_labels()
  acc = [r for r in evals if "accuracy" in r]
  if acc:
    ax2 = ax.twinx()
    ax2.plot([r["step"] for r in acc], [r["accuracy"] for r in acc], "s--",
             color="tab:green", label="eval exact match")
    ax2.set_ylim(0, 1.02)
    ax2.set_ylabel("exact-match accuracy")
    h2, l2 = ax2.get_legend_handles_labels()
    handles, labels = handles + h2, labels + l2
  ax.legend(handles, labels, loc="center right")
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# --------------------------------------------------------------------------
# Progress reporting.


class Progress:
  """tqdm when available on a terminal, else a plain line every log."""

  def __init__(self, start: int, total: int, quiet: bool):
    self.bar = None
    self.quiet = quiet
    self.total = total
    # A bar needs a real terminal with room for it.
    if (not quiet and sys.stderr.isatty()
        and shutil.get_terminal_size((0, 0)).columns >= 60):
      try:
        import tqdm  # pylint: disable=g-import-not-at-top

        self.bar = tqdm.tqdm(
            total=total, initial=start, dynamic_ncols=True, unit="step")
      except ImportError:
        pass

  def update(self, step: int, n: int, info: dict[str, float]) -> None:
    """Advances by `n` steps and shows loss and tokens/s."""
    if self.bar is not None:
      self.bar.set_postfix(
          loss=f"{info['loss']:.4f}", tok_s=f"{info['tokens_per_s']:,.0f}",
          refresh=False)
      self.bar.update(n)
    elif not self.quiet:
      print(
          f"step {step:6d}/{self.total} | loss {info['loss']:.4f} | "
          f"{info['tokens_per_s']:,.0f} tokens/s", file=sys.stderr,
          flush=True)

  def write(self, msg: str) -> None:
    """Prints a message without breaking the bar."""
    if self.quiet:
      return
    if self.bar is not None:
      self.bar.write(msg, file=sys.stderr)
    else:
      print(msg, file=sys.stderr, flush=True)

  def close(self) -> None:
    """Closes the bar (idempotent)."""
    if self.bar is not None:
      self.bar.close()


# --------------------------------------------------------------------------
# Samples.


def show_samples(model, dataset, opts: Options, out=None):
  """Generates with the KV cache and prints; returns the generation accuracy.

  For synthetic tasks the accuracy of greedy generation over 512 fresh
  prompts is returned (None for text).
  """
  out = out or sys.stdout
  if isinstance(dataset, data_lib.SyntheticTask):
    rng = np.random.default_rng([opts.seed, 7])
    prompts, answers = dataset.examples(rng, 512)
    pred = np.asarray(generate_lib.generate(
        model, prompts, dataset.answer_len))
    ok = np.all(pred == answers, axis=1)
    print(f"Greedy KV-cache generation on {len(ok)} fresh prompts: "
          f"{ok.mean():.2%} exact match.", file=out)
    for i in range(min(opts.num_samples, len(ok))):
      verdict = "ok" if ok[i] else "WRONG, want " + dataset.decode(answers[i])
      print(f"  {dataset.decode(prompts[i])} -> {dataset.decode(pred[i])}  "
            f"{verdict}", file=out)
    return float(ok.mean())
  for i, text in enumerate(["def ", "import ", "class ", "    for "]):
    if i >= opts.num_samples:
      break
    prompt = dataset.encode(text)[None]
    new = generate_lib.generate(
        model, prompt, 200, rng=jax.random.key(i), temperature=0.8, top_k=20)
    print(f"--- sample {i} ---\n{text}{dataset.decode(new[0])}", file=out)
  return None


# --------------------------------------------------------------------------
# The run.


def benchmark(opts: Options) -> dict[str, float]:
  """Times `opts.benchmark_steps` training steps; returns tokens/s."""
  dataset = make_dataset(opts)
  cfg = make_config(opts, dataset)
  optim = OptimizerSpec.from_options(opts)
  mesh = make_mesh(opts, dataset)
  graphdef, state = init_state(opts, cfg, optim, mesh)
  if mesh is not None:
    state = parallel.replicate(state, mesh)
  batch = place_batch(dataset.batch(0, opts.batch_size), mesh)
  t0 = time.perf_counter()
  state, m = train_step(graphdef, optim, state, batch)
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  for i in range(opts.benchmark_steps):
    batch = place_batch(dataset.batch(i + 1, opts.batch_size), mesh)
    state, m = train_step(graphdef, optim, state, batch)
  jax.block_until_ready(m)
  dt = time.perf_counter() - t0
  tokens = opts.benchmark_steps * opts.batch_size * dataset.seq_len
  result = {
      "tokens_per_s": tokens / dt, "step_s": dt / opts.benchmark_steps,
      "first_step_s": compile_s, "seq_len": dataset.seq_len,
      "batch_size": opts.batch_size,
      "attention_impl": opts.attention_impl or "auto",
      "data_parallel": opts.data_parallel,
      "sequence_parallel": opts.sequence_parallel,
  }
  print(json.dumps(result))
  return result


def _train_loop(opts, graphdef, optim, state, dataset, mngr, log, start,
                mesh):
  """Runs steps start..num_steps; returns (step, state, last tokens/s).

  Checkpoints every `checkpoint_every` steps and at the end; SIGINT/SIGTERM
  save a checkpoint at the current step and re-raise KeyboardInterrupt.
  """
  tokens_per_step = opts.batch_size * dataset.seq_len

  def on_signal(signum, frame):
    del frame
    raise KeyboardInterrupt(f"signal {signum}")

  old_term = signal.signal(signal.SIGTERM, on_signal)
  progress = Progress(start, opts.num_steps, opts.quiet)
  step = last_saved = last_logged = start
  losses, t_log, steps_timed, tokens_per_s = [], None, 0, float("nan")
  try:
    while step < opts.num_steps:
      batch = place_batch(dataset.batch(step, opts.batch_size), mesh)
      state, metrics = train_step(graphdef, optim, state, batch)
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
        progress.update(step, step - last_logged,
                        {"loss": loss, "tokens_per_s": tokens_per_s})
        last_logged = step
      if step % opts.checkpoint_every == 0:
        save_checkpoint(mngr, step, state)
        last_saved = step
      if step % opts.eval_every == 0 and step < opts.num_steps:
        ev = evaluate(graphdef, state["params"], dataset, opts, mesh)
        log.write({"step": step, **ev})
        progress.write(f"eval @ {step}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in ev.items()))
        t_log, steps_timed = time.perf_counter(), 0
  except KeyboardInterrupt:
    progress.close()
    if step != last_saved:
      save_checkpoint(mngr, step, state)
    if not opts.quiet:
      print(f"Interrupted: checkpoint saved at step {step}; run the same "
            "command again to resume.", file=sys.stderr, flush=True)
    raise
  finally:
    progress.close()
    signal.signal(signal.SIGTERM, old_term)
  if step != last_saved:
    save_checkpoint(mngr, step, state)
  return step, state, tokens_per_s


def train(opts: Options) -> dict[str, Any]:
  """Trains (resuming if possible), evaluates, plots and samples.

  Returns:
    The final eval metrics plus "step", "wall_s", "tokens_per_s" and, for
    synthetic tasks, "generate_accuracy".
  """
  if opts.benchmark_steps > 0:
    return benchmark(opts)
  wall0 = time.perf_counter()
  workdir = opts.workdir or default_workdir(opts)
  if opts.fresh and os.path.isdir(workdir):
    shutil.rmtree(workdir)
  os.makedirs(workdir, exist_ok=True)
  dataset = make_dataset(opts)
  cfg = make_config(opts, dataset)
  optim = OptimizerSpec.from_options(opts)
  mesh = make_mesh(opts, dataset)
  graphdef, state = init_state(opts, cfg, optim, mesh)
  mngr = checkpoint_manager(workdir)
  start = mngr.latest_step() or 0
  write_run_config(workdir, cfg, dataset, opts, resuming=start > 0)
  say = (lambda *a: None) if opts.quiet else (
      lambda *a: print(*a, file=sys.stderr, flush=True))
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  devices = (jax.devices() if mesh is None else
             f"mesh {dict(mesh.shape)} of {mesh.devices.size} devices")
  say(f"Model {opts.model}: {n_params:,} parameters, attention "
      f"{cfg.attention_impl or 'auto'}; data {dataset.spec()}; "
      f"devices {devices}; workdir {workdir}")
  if start > 0:
    state = restore_state(mngr, start, state)
    say(f"Resumed from the checkpoint at step {start}.")
  if mesh is not None:
    state = parallel.replicate(state, mesh)
  log = MetricsLog(os.path.join(workdir, "metrics.jsonl"), start)
  try:
    step, state, tokens_per_s = _train_loop(
        opts, graphdef, optim, state, dataset, mngr, log, start, mesh)
  finally:
    # Also on errors: let an in-flight asynchronous save finish.
    mngr.wait_until_finished()
    mngr.close()
  result = {"step": step, "tokens_per_s": tokens_per_s}
  ev = evaluate(graphdef, state["params"], dataset, opts, mesh)
  if not log.records or log.records[-1].get("eval_loss") != ev["eval_loss"]:
    log.write({"step": step, **ev})
  result.update(ev)
  plot_path = os.path.join(workdir, "loss.png")
  plot_loss(log.records, plot_path, f"{opts.model} model, {opts.task}")
  train_wall = time.perf_counter() - wall0
  say(f"Done: {step} steps; final eval " + ", ".join(
      f"{k} {v:.4f}" for k, v in ev.items()) +
      f"; {train_wall:.1f} s; loss curve {plot_path}")
  if mesh is None:
    model = nnx.merge(graphdef, state["params"])
  else:
    # Sampling runs the unsharded model on one device, same parameters.
    model = nnx.merge(plain_graphdef(cfg),
                      jax.device_put(state["params"], jax.devices()[0]))
  if opts.num_samples > 0:
    out = open(os.devnull, "w") if opts.quiet else sys.stdout
    result["generate_accuracy"] = show_samples(model, dataset, opts, out)
  result["wall_s"] = time.perf_counter() - wall0
  say(f"Total wall time {result['wall_s']:.1f} s.")
  return result


def main(argv):
  """Entry point: trains with the command-line flags."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Orbax logs every checkpoint step at INFO; keep the progress readable.
    logging.set_verbosity(logging.WARNING)
  try:
    train(options_from_flags())
  except KeyboardInterrupt:
    sys.exit(130)


if __name__ == "__main__":
  app.run(main)
