r"""Loads a training run's latest checkpoint and generates with the KV cache.

    python scripts/sample.py                          # runs/sort
    python scripts/sample.py --workdir=runs/pystdlib --prompt="def " \
        --max_new_tokens=300 --temperature=0.8 --top_k=20

Synthetic tasks: prints greedy answers to fresh prompts and their exact-match
accuracy. Text: continues --prompt (or a few built-in prompts). The model is
rebuilt from the run config saved with the checkpoint; the training flags
(--workdir, --task, --seed, --num_samples, ...) pick the run as in train.py.
"""

from __future__ import annotations

import dataclasses
import sys

from absl import app
from absl import flags
from absl import logging

from models import checkpoint
from models import generate
from models import train_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class SampleOptions:
  """The options of sampling (next to the training ones)."""

  prompt: str | None = train_lib.option(
      None, "Text runs: prompt to continue.")
  max_new_tokens: int = train_lib.option(
      200, "Text runs: tokens to generate.", lower_bound=1)
  temperature: float = train_lib.option(
      0.8, "Text runs: sampling temperature (0 = greedy).", lower_bound=0.0)
  top_k: int = train_lib.option(20, "Text runs: top-k (0 = all).",
                                lower_bound=0)


def sample(workdir: str, opts: SampleOptions = SampleOptions(), *,
           num_samples: int = 8, seed: int = 0, cache_dtype=None, out=None,
           attention_impl: str | None = None):
  """Prints generations from the latest checkpoint in `workdir`.

  Args:
    workdir: the run directory.
    opts: prompt and sampling settings (text runs).
    attention_impl: the attention to sample with; None = the run's.
    num_samples: prompts generated for (and printed).
    seed: seed of the prompts and of the sampling.
    cache_dtype: the KV cache's dtype; None = the model's (int8 / float8
      quantize it, `--kv_cache_dtype`).
    out: where to print (default stdout).

  Returns:
    Synthetic tasks: (exact-match accuracy, predictions [n, answer_len]).
    Text: the list of generated strings.

  Raises:
    FileNotFoundError: no checkpoint in `workdir`.
  """
  out = out or sys.stdout
  model, dataset, step, _ = checkpoint.load_model(
      workdir, attention_impl=attention_impl)
  print(f"Loaded {workdir} at step {step}.", file=out)
  n = max(num_samples, 1)
  return generate.show_samples(
      model, dataset, num_shown=n, num_prompts=n, seed=seed,
      prompts=[opts.prompt] if opts.prompt else None,
      max_new_tokens=opts.max_new_tokens, temperature=opts.temperature,
      top_k=opts.top_k or None, cache_dtype=cache_dtype, out=out)


def main(argv):
  """Entry point: samples from --workdir."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  opts = train_lib.options_from_flags()
  # --attention_impl: the run's attention unless one is named.
  impl = train_lib.check_attention_impl(opts.attention_impl)
  try:
    sample(opts.workdir or train_lib.default_workdir(opts),
           train_lib.options_from_flags(SampleOptions),
           num_samples=opts.num_samples, seed=opts.seed,
           cache_dtype=train_lib.cache_dtype(opts.kv_cache_dtype),
           attention_impl=None if impl == "auto" else impl)
  except FileNotFoundError as e:
    raise app.UsageError(str(e)) from e


if __name__ == "__main__":
  # Only as a script: importing this file registers no global flags.
  train_lib.define_flags()
  train_lib.define_flags(SampleOptions)
  flags.adopt_module_key_flags(train_lib)
  app.run(main)
