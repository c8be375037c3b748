r"""Loads a training run's latest checkpoint and generates with the KV cache.

    python scripts/sample.py                          # runs/sort
    python scripts/sample.py --workdir=runs/pystdlib --prompt="def " \
        --max_new_tokens=300 --temperature=0.8 --top_k=20

Synthetic tasks: prints greedy answers to fresh prompts and their exact-match
accuracy. Text: continues --prompt (or a few built-in prompts).
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
from absl import app
from absl import flags
from absl import logging
from flax import nnx

# train.py (next to this file) owns --workdir, --task, --seed, --num_samples.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402  pylint: disable=g-import-not-at-top

from models import data as data_lib  # noqa: E402
from models import generate as generate_lib  # noqa: E402
from models import transformer  # noqa: E402

_PROMPT = flags.DEFINE_string("prompt", None, "Text runs: prompt to continue.")
_MAX_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens", 200, "Text runs: tokens to generate.")
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 0.8, "Text runs: sampling temperature (0 = greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 20, "Text runs: top-k (0 = all).")


def load_model(workdir: str):
  """(model, dataset, step) restored from the latest checkpoint in `workdir`.

  Raises:
    FileNotFoundError: no run or no checkpoint in `workdir`.
  """
  if not os.path.exists(os.path.join(workdir, "config.json")):
    raise FileNotFoundError(f"no training run in {workdir!r}.")
  cfg, dataset = train.load_run(workdir)
  mngr = train.checkpoint_manager(workdir)
  step = mngr.latest_step()
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {workdir!r}.")
  graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  params = train.restore_params(mngr, step, params)
  mngr.close()
  return nnx.merge(graphdef, params), dataset, step


def sample(workdir: str, *, prompt: str | None = None, num_samples: int = 8,
           max_new_tokens: int = 200, temperature: float = 0.8,
           top_k: int | None = 20, seed: int = 0, out=None):
  """Prints generations from the run in `workdir`; returns them.

  Returns:
    Synthetic tasks: (exact-match accuracy, predictions [n, answer_len]).
    Text: the list of generated strings.
  """
  out = out or sys.stdout
  model, dataset, step = load_model(workdir)
  print(f"Loaded {workdir} at step {step}.", file=out)
  if isinstance(dataset, data_lib.SyntheticTask):
    prompts, answers = dataset.examples(
        np.random.default_rng([seed, 11]), max(num_samples, 1))
    pred = np.asarray(
        generate_lib.generate(model, prompts, dataset.answer_len))
    ok = np.all(pred == answers, axis=1)
    for p, y, good in zip(prompts, pred, ok):
      print(f"  {dataset.decode(p)} -> {dataset.decode(y)}  "
            f"{'ok' if good else 'WRONG'}", file=out)
    print(f"Exact match {ok.mean():.2%} on {len(ok)} prompts.", file=out)
    return float(ok.mean()), pred
  prompts = [prompt] if prompt else ["def ", "import ", "class "]
  texts = []
  for i, text in enumerate(prompts[:max(num_samples, 1)]):
    new = generate_lib.generate(
        model, dataset.encode(text)[None], max_new_tokens,
        rng=jax.random.key(seed + i), temperature=temperature,
        top_k=top_k or None)
    texts.append(text + dataset.decode(new[0]))
    print(f"--- sample {i} ---\n{texts[-1]}", file=out)
  return texts


def main(argv):
  """Entry point: samples from --workdir."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  opts = train.options_from_flags()
  sample(opts.workdir or train.default_workdir(opts), prompt=_PROMPT.value,
         num_samples=opts.num_samples, max_new_tokens=_MAX_NEW_TOKENS.value,
         temperature=_TEMPERATURE.value, top_k=_TOP_K.value, seed=opts.seed)


if __name__ == "__main__":
  app.run(main)
