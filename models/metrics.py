"""The metrics of a training run: the metrics.jsonl log and the loss curve."""

from __future__ import annotations

import json
import os
from typing import Any


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

  train_loss = [(r["step"], r["loss"]) for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  fig, ax = plt.subplots(figsize=(7, 4.2))
  if train_loss:
    ax.plot(*zip(*train_loss), label="train loss", lw=1)
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


