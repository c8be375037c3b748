"""Built-in datasets that need no download.

* Synthetic tasks that cannot be solved without attention, scored by
  exact-match accuracy of the whole answer:
  - `copy`:   BOS x1..xn SEP -> x1..xn
  - `sort`:   BOS x1..xn SEP -> sorted(x1..xn)
  - `recall`: BOS k1 v1 .. kn vn SEP q -> the v paired with key q
    (associative recall).
* Character-level (UTF-8 byte) language modelling on any text file, or on a
  corpus present on every machine: the running Python's own standard-library
  source files.

Batches are a pure function of (seed, split, step), so a resumed run sees
exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import glob
import inspect
import os
import sysconfig
from typing import Any

import numpy as np

from pallas_fa import checks

PAD, BOS, SEP = 0, 1, 2
_NUM_SPECIAL = 3
TASKS = ("copy", "sort", "recall")
_SPLITS = {"train": 0, "eval": 1, "sample": 2}


def _rng(seed: int, split: str, step: int) -> np.random.Generator:
  return np.random.default_rng([seed, _SPLITS[split], step])


def _lm_batch(seqs: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray]:
  """Next-token batch: inputs seq[:-1], targets seq[1:]."""
  return {
      "inputs": seqs[:, :-1].astype(np.int32),
      "targets": seqs[:, 1:].astype(np.int32),
      "weights": weights[:, 1:].astype(np.float32),
  }


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticTask:
  """A prompt -> answer task with exact-match accuracy.

  Attributes:
    task: "copy", "sort" or "recall".
    length: symbols in the prompt (key/value pairs for "recall").
    num_symbols: alphabet size.
    seed: data seed.
  """

  task: str = "sort"
  length: int = 8
  num_symbols: int = 10
  seed: int = 0

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"task must be one of {TASKS}, got {self.task!r}.")
    for name, low in (("length", 1), ("num_symbols", 2), ("seed", 0)):
      checks.check_int(f"SyntheticTask.{name}", getattr(self, name), low)
    if self.task == "recall" and self.length > self.num_symbols:
      raise ValueError(
          "recall needs distinct keys: length <= num_symbols, got "
          f"{self.length=}, {self.num_symbols=}."
      )

  kind = "synthetic"

  @property
  def vocab_size(self) -> int:
    """Special tokens plus the alphabet."""
    return _NUM_SPECIAL + self.num_symbols

  @property
  def prompt_len(self) -> int:
    """Prompt tokens including BOS and SEP (and the query for recall)."""
    if self.task == "recall":
      return 2 * self.length + 3
    return self.length + 2

  @property
  def answer_len(self) -> int:
    """Answer tokens (scored by exact match)."""
    return 1 if self.task == "recall" else self.length

  @property
  def seq_len(self) -> int:
    """Model input length (the full sequence minus the last token)."""
    return self.prompt_len + self.answer_len - 1

  def examples(self, rng: np.random.Generator, n: int):
    """(prompts int [n, prompt_len], answers int [n, answer_len])."""
    sym = lambda x: x + _NUM_SPECIAL
    bos = np.full((n, 1), BOS)
    sep = np.full((n, 1), SEP)
    if self.task == "recall":
      keys = np.argsort(rng.random((n, self.num_symbols)), axis=1)
      keys = keys[:, : self.length]
      values = rng.integers(0, self.num_symbols, (n, self.length))
      pairs = np.stack([keys, values], axis=2).reshape(n, -1)
      which = rng.integers(0, self.length, n)
      query = keys[np.arange(n), which][:, None]
      answer = values[np.arange(n), which][:, None]
      prompt = np.concatenate([bos, sym(pairs), sep, sym(query)], axis=1)
      return prompt.astype(np.int32), sym(answer).astype(np.int32)
    x = rng.integers(0, self.num_symbols, (n, self.length))
    answer = np.sort(x, axis=1) if self.task == "sort" else x
    prompt = np.concatenate([bos, sym(x), sep], axis=1)
    return prompt.astype(np.int32), sym(answer).astype(np.int32)

  def batch(self, step: int, batch_size: int, split: str = "train"):
    """{inputs, targets, weights} [batch_size, seq_len]; loss on answers."""
    prompt, answer = self.examples(_rng(self.seed, split, step), batch_size)
    seqs = np.concatenate([prompt, answer], axis=1)
    weights = np.zeros(seqs.shape, np.float32)
    weights[:, self.prompt_len:] = 1.0
    return _lm_batch(seqs, weights)

  def decode(self, tokens) -> str:
    """Readable form of token ids (symbols as letters/digits)."""
    names = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    out = []
    for t in np.asarray(tokens).tolist():
      if t == BOS:
        out.append("^")
      elif t == SEP:
        out.append("|")
      elif t == PAD:
        out.append("_")
      else:
        i = t - _NUM_SPECIAL
        out.append(names[i] if i < len(names) else f"<{i}>")
    return "".join(out)

  def spec(self) -> dict[str, Any]:
    """JSON-serialisable description; `from_spec` rebuilds the task."""
    return {"kind": self.kind, "task": self.task, "length": self.length,
            "num_symbols": self.num_symbols, "seed": self.seed}


def python_stdlib_files() -> list[str]:
  """The running interpreter's top-level stdlib `.py` files, sorted."""
  root = sysconfig.get_paths().get("stdlib")
  if not root or not os.path.isdir(root):
    root = os.path.dirname(inspect.getfile(inspect))
  return sorted(glob.glob(os.path.join(root, "*.py")))


def python_stdlib_text(max_bytes: int = 8 << 20) -> bytes:
  """Concatenated standard-library sources, at most `max_bytes`.

  Raises:
    FileNotFoundError: no source files were found.
  """
  chunks, total = [], 0
  for path in python_stdlib_files():
    with open(path, "rb") as f:
      data = f.read()
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  if not chunks:
    raise FileNotFoundError(
        "no Python standard-library sources found next to "
        f"{inspect.getfile(inspect)!r}."
    )
  return b"\n".join(chunks)[:max_bytes]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextData:
  """Byte-level language modelling on a text corpus.

  Attributes:
    source: a file path, or "pystdlib" for the Python standard library.
    seq_len: model input length.
    seed: data seed.
    eval_fraction: the corpus tail held out for evaluation.
  """

  source: str = "pystdlib"
  seq_len: int = 256
  seed: int = 0
  eval_fraction: float = 0.05

  corpus: np.ndarray = dataclasses.field(
      init=False, repr=False, compare=False)

  kind = "text"
  vocab_size = 256

  def __post_init__(self):
    for name, low in (("seq_len", 1), ("seed", 0)):
      checks.check_int(f"TextData.{name}", getattr(self, name), low)
    if not 0 < self.eval_fraction < 1:
      raise ValueError(
          f"TextData.eval_fraction must be in (0, 1), got "
          f"{self.eval_fraction!r}.")
    object.__setattr__(self, "corpus", _load_corpus(self.source))
    for split in ("train", "eval"):  # Each long enough for a window.
      self._split(split)

  def _split(self, split: str) -> np.ndarray:
    data = self.corpus
    cut = int(len(data) * (1 - self.eval_fraction))
    part = data[cut:] if split == "eval" else data[:cut]
    if len(part) < self.seq_len + 2:
      raise ValueError(
          f"the {split} split of {self.source!r} has {len(part)} bytes, "
          f"fewer than seq_len + 2 = {self.seq_len + 2}."
      )
    return part

  def batch(self, step: int, batch_size: int, split: str = "train"):
    """{inputs, targets, weights} [batch_size, seq_len] of random windows."""
    part = self._split("eval" if split == "eval" else "train")
    rng = _rng(self.seed, split, step)
    # Windows of seq_len + 1 bytes; the last starts at len - seq_len - 1.
    starts = rng.integers(0, len(part) - self.seq_len, batch_size)
    idx = starts[:, None] + np.arange(self.seq_len + 1)[None]
    seqs = part[idx]
    return _lm_batch(seqs, np.ones(seqs.shape, np.float32))

  def encode(self, text: str) -> np.ndarray:
    """UTF-8 bytes of `text` as int32 token ids."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, tokens) -> str:
    """Token ids back to text (invalid UTF-8 replaced)."""
    return bytes(np.asarray(tokens, np.uint8).tolist()).decode(
        "utf-8", errors="replace")

  def spec(self) -> dict[str, Any]:
    """JSON-serialisable description; `from_spec` rebuilds the dataset."""
    return {"kind": self.kind, "source": self.source,
            "seq_len": self.seq_len, "seed": self.seed,
            "eval_fraction": self.eval_fraction}


def _load_corpus(source: str) -> np.ndarray:
  if source == "pystdlib":
    raw = python_stdlib_text()
  else:
    with open(source, "rb") as f:
      raw = f.read()
  return np.frombuffer(raw, np.uint8)


def from_spec(spec: dict[str, Any]):
  """Rebuilds a dataset from its `spec()`.

  Raises:
    ValueError: unknown kind.
  """
  spec = dict(spec)
  kind = spec.pop("kind")
  if kind == "synthetic":
    return SyntheticTask(**spec)
  if kind == "text":
    return TextData(**spec)
  raise ValueError(f"unknown dataset kind {kind!r}.")
