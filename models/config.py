"""`TransformerConfig`: the frozen description of a decoder-only transformer."""

from __future__ import annotations

import dataclasses
import importlib
import math
import operator
from typing import Any

import jax.numpy as jnp

_DTYPES = ("float32", "bfloat16", "float16")
POSITION_BIASES = ("rope", "alibi")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """Hyper-parameters of `models.transformer.Transformer`.

  Attributes:
    vocab_size: number of token ids.
    num_layers: transformer blocks.
    embed_dim: model width D.
    num_heads: query heads N.
    num_kv_heads: key/value heads K (GQA when K < N).
    head_dim: features per head; default embed_dim // num_heads.
    mlp_dim: hidden width of the SwiGLU MLP.
    max_len: the longest sequence the model is meant for (the default cache
      length when generating).
    rope_base: RoPE maximum wavelength (position_bias "rope").
    norm_eps: RMSNorm epsilon.
    attention_impl: `flash_attention`'s implementation; None = automatic.
      The baselines (`layers.BASELINES`): "flax", Flax's default
      attention, materialising T x S; "cudnn", cuDNN's through `jax.nn`.
    attention_block_sizes: the implementation's tiling config, or None.
    dtype: activation dtype name.
    param_dtype: parameter dtype name.
    remat: rematerialise each block in the backward pass.
    use_sinks: every attention layer learns a sink logit per query head
      (`pallas_fa.MultiHeadAttention(use_sinks=True)`).
    position_bias: how attention sees token positions: "rope" (rotary
      embeddings of queries and keys) or "alibi" (no RoPE; the fixed
      per-head distance penalty `pallas_fa.flex.alibi` as a score_mod).
  """

  vocab_size: int
  num_layers: int = 2
  embed_dim: int = 128
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int | None = None
  mlp_dim: int = 384
  max_len: int = 256
  rope_base: float = 10_000.0
  norm_eps: float = 1e-6
  attention_impl: str | None = None
  attention_block_sizes: Any = None
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  use_sinks: bool = False
  position_bias: str = "rope"

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "embed_dim", "num_heads",
                 "num_kv_heads", "mlp_dim", "max_len", "head_dim"):
      value = getattr(self, name)
      if name == "head_dim" and value is None:
        continue
      # numpy ints count (operator.index); bools and floats do not.
      if isinstance(value, bool) or not hasattr(value, "__index__") or (
          operator.index(value) < 1):
        raise ValueError(
            f"TransformerConfig.{name} must be a positive int"
            f"{' or None' if name == 'head_dim' else ''}, got {value!r}.")
      object.__setattr__(self, name, operator.index(value))
    for name in ("remat", "use_sinks"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(
            f"TransformerConfig.{name} must be a bool, got "
            f"{getattr(self, name)!r}.")
    for name, value, least in (("rope_base", self.rope_base, "> 0"),
                               ("norm_eps", self.norm_eps, ">= 0")):
      ok = isinstance(value, (int, float)) and not isinstance(value, bool)
      if not ok or not (value > 0 if least == "> 0" else value >= 0) or (
          not math.isfinite(value)):
        raise ValueError(
            f"TransformerConfig.{name} must be a finite number {least}, got "
            f"{value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          "TransformerConfig.num_heads must be a multiple of num_kv_heads, "
          f"got num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}."
      )
    if self.head_dim is None and self.embed_dim % self.num_heads:
      raise ValueError(
          "TransformerConfig.embed_dim must be divisible by num_heads when "
          f"head_dim is None, got embed_dim={self.embed_dim}, "
          f"num_heads={self.num_heads}."
      )
    if self.position_bias not in POSITION_BIASES:
      raise ValueError(
          f"TransformerConfig.position_bias must be one of {POSITION_BIASES}, "
          f"got {self.position_bias!r}."
      )
    if self.position_bias == "rope" and self.resolved_head_dim % 2:
      raise ValueError(
          "TransformerConfig.head_dim must be even (RoPE rotates halves), got "
          f"{self.resolved_head_dim}."
      )
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(
            f"TransformerConfig.{name} must be one of {_DTYPES}, got "
            f"{getattr(self, name)!r}."
        )
    if self.attention_impl is not None:
      # Imported here: `layers` imports this module.
      from models import layers  # pylint: disable=import-outside-toplevel
      from pallas_fa import vjp  # pylint: disable=import-outside-toplevel
      known = (*layers.BASELINES, *vjp.REGISTRY)
      if self.attention_impl not in known:
        raise ValueError(
            f"TransformerConfig.attention_impl must be None or one of "
            f"{', '.join(known)}, got {self.attention_impl!r}.")
      # The baselines take flash_attention's plain arguments only.
      extras = [name for name, used in (
          ("use_sinks=True", self.use_sinks),
          ("position_bias='alibi'", self.position_bias == "alibi")) if used]
      if self.attention_impl in layers.BASELINES and extras:
        raise ValueError(
            f"TransformerConfig.attention_impl={self.attention_impl!r} (a "
            f"baseline) takes neither sinks nor a score_mod, got "
            f"{' and '.join(extras)}.")

  @property
  def resolved_head_dim(self) -> int:
    """head_dim, or embed_dim // num_heads when unset."""
    if self.head_dim is None:
      return self.embed_dim // self.num_heads
    return self.head_dim

  @property
  def jnp_dtype(self):
    """The activation dtype as a numpy dtype."""
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    """The parameter dtype as a numpy dtype."""
    return jnp.dtype(self.param_dtype)

  @classmethod
  def tiny(cls, **overrides) -> TransformerConfig:
    """2 layers, width 128, 4 query / 2 key-value heads (~0.4M + embeddings).

    Trains on CPU in minutes.
    """
    kw = dict(num_layers=2, embed_dim=128, num_heads=4, num_kv_heads=2,
              mlp_dim=384, max_len=256)
    kw.update(overrides)
    kw.setdefault("vocab_size", 256)
    return cls(**kw)

  @classmethod
  def small(cls, **overrides) -> TransformerConfig:
    """6 layers, width 384, 6 query / 2 key-value heads (~10M + embeddings)."""
    kw = dict(num_layers=6, embed_dim=384, num_heads=6, num_kv_heads=2,
              mlp_dim=1024, max_len=1024)
    kw.update(overrides)
    kw.setdefault("vocab_size", 256)
    return cls(**kw)

  def replace(self, **changes) -> TransformerConfig:
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable dict (block sizes stored with their class)."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    bs = self.attention_block_sizes
    if bs is not None:
      d["attention_block_sizes"] = {
          "class": f"{type(bs).__module__}.{type(bs).__qualname__}",
          "fields": {
              f.name: getattr(bs, f.name) for f in dataclasses.fields(bs)
          },
      }
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> TransformerConfig:
    """Inverse of `to_dict`.

    Raises:
      ValueError: unknown keys.
    """
    d = dict(d)
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown TransformerConfig keys: {sorted(unknown)}.")
    bs = d.get("attention_block_sizes")
    if bs is not None:
      module, _, name = bs["class"].rpartition(".")
      d["attention_block_sizes"] = getattr(
          importlib.import_module(module), name)(**bs["fields"])
    return cls(**d)
