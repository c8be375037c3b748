r"""Trains the decoder-only transformer on a built-in dataset, then samples.

The default trains the tiny model on the synthetic sort task on CPU to >= 99%
exact-match accuracy in a few minutes:

    python scripts/train.py

Other datasets and settings:

    python scripts/train.py --task=recall          # or copy
    python scripts/train.py --task=pystdlib        # Python's stdlib sources
    python scripts/train.py --text=PATH --seq_len=512 --model=small
    python scripts/train.py --attention_impl=xla   # any flash_attention impl,
                                                   # or a baseline: "flax",
                                                   # "cudnn" (jax.nn, GPU)
    python scripts/train.py --position_bias=alibi  # ALiBi (flex attention)
                                                   # instead of RoPE
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

Every flag is a field of `models.train_lib.Options`, where the training code
lives (`pip install -e '.[scripts]'` installs what it needs).
"""

from __future__ import annotations

import sys

from absl import app
from absl import flags
from absl import logging

from models import checkpoint
from models import train_lib


def main(argv):
  """Entry point: trains with the command-line flags."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Orbax logs every checkpoint step at INFO; keep the progress readable.
    logging.set_verbosity(logging.WARNING)
  try:
    train_lib.train(train_lib.options_from_flags())
  except checkpoint.IncompatibleRunError as e:
    raise app.UsageError(str(e)) from e
  except KeyboardInterrupt:
    sys.exit(130)


if __name__ == "__main__":
  # Only as a script: importing this file registers no global flags.
  train_lib.define_flags()
  # The flags are declared in train_lib: list them in this script's --help.
  flags.adopt_module_key_flags(train_lib)
  app.run(main)
