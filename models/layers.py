"""Transformer building blocks: SwiGLU MLP, pre-norm decoder block."""

from __future__ import annotations

import functools
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models import config as config_lib
from pallas_fa import api
from pallas_fa import flex
from pallas_fa import modules

Array = Any


def flax_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    is_causal: bool = False,
    segment_ids: Any = None,
    query_positions: Array | None = None,
    key_positions: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    local_window_size: Any = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    implementation: str | None = None,
    block_sizes: Any = None,
    sinks: Array | None = None,
    score_mod: Any = None,
    score_mod_args: Any = (),
) -> Array:
  """Baseline: Flax's default attention behind `flash_attention`'s interface.

  Plain causal attention goes straight to `flax.nnx.dot_product_attention`
  (which materialises the T x S logits); positions, segments and lengths are
  turned into the dense mask that Flax needs.

  Raises:
    NotImplementedError: window, soft cap, sinks, a score_mod or a custom
      scale.
  """
  del implementation, block_sizes, score_mod_args
  if (local_window_size is not None or logits_soft_cap is not None
      or scale is not None or sinks is not None or score_mod is not None):
    raise NotImplementedError(
        "the Flax baseline supports only causal, positions, segments and "
        "lengths."
    )
  plain = (segment_ids is None and query_positions is None
           and key_positions is None and key_value_seq_lengths is None)
  if plain:
    return nnx.dot_product_attention(query, key, value, is_causal=is_causal)
  b, t = query.shape[:2]
  s = key.shape[1]
  q_pos = (jnp.arange(t)[None] if query_positions is None
           else query_positions)
  k_pos = jnp.arange(s)[None] if key_positions is None else key_positions
  mask = jnp.ones((b, 1, t, s), bool)
  if is_causal:
    mask &= (k_pos[:, None, None, :] <= q_pos[:, None, :, None])
  if segment_ids is not None:
    mask &= (segment_ids.q[:, None, :, None]
             == segment_ids.kv[:, None, None, :])
  if key_value_seq_lengths is not None:
    mask &= (jnp.arange(s)[None, None, None, :]
             < key_value_seq_lengths[:, None, None, None])
  return nnx.dot_product_attention(query, key, value, mask=mask)


def cudnn_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    is_causal: bool = False,
    key_value_seq_lengths: Array | None = None,
    implementation: str | None = None,
    block_sizes: Any = None,
    score_mod_args: Any = (),
    **others: Any,
) -> Array:
  """Baseline: cuDNN's fused attention (`jax.nn.dot_product_attention`,
  implementation "cudnn"; NVIDIA GPUs only) behind `flash_attention`'s
  interface, for the end-to-end comparison a model's users make.

  A decoding call (`query_positions` given: new tokens against a cache)
  runs `flash_attention` instead: cuDNN's causal mask is aligned top-left
  and takes no positions, so it cannot place a new token after its cache.
  A model trained with this baseline thus still samples.

  Raises:
    NotImplementedError: any other of `flash_attention`'s arguments given
      (segments, key positions, window, soft cap, sinks, a score_mod, a
      scale).
  """
  del implementation, block_sizes, score_mod_args
  if others.get("query_positions") is not None:
    return api.flash_attention(
        query, key, value, is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths, **others)
  given = sorted(name for name, x in others.items() if x is not None)
  if given:
    raise NotImplementedError(
        "the cuDNN baseline supports only causal attention and key lengths, "
        f"not {', '.join(given)}."
    )
  return jax.nn.dot_product_attention(
      query, key, value, is_causal=is_causal,
      key_value_seq_lengths=key_value_seq_lengths, implementation="cudnn")


# Attention functions other than `flash_attention` that `attention_impl`
# can name, as baselines: the name -> the function.
BASELINES = {"flax": flax_attention, "cudnn": cudnn_attention}


def _position_bias(cfg: config_lib.TransformerConfig) -> dict[str, Any]:
  """The attention layer's arguments for cfg.position_bias: RoPE, or ALiBi
  with the paper's fixed slopes (constants, not learned)."""
  if cfg.position_bias == "alibi":
    return dict(rope=None, score_mod=flex.alibi,
                score_mod_args=(flex.alibi_slopes(cfg.num_heads),))
  return dict(rope=modules.Rope(cfg.rope_base))


class SwiGLU(nnx.Module):
  """Gated MLP: down(silu(gate(x)) * up(x)) (Shazeer, 2020)."""

  def __init__(self, features: int, hidden: int, *, dtype, param_dtype,
               rngs: nnx.Rngs):
    linear = functools.partial(
        nnx.Linear, use_bias=False, dtype=dtype, param_dtype=param_dtype,
        rngs=rngs,
    )
    self.gate = linear(features, hidden)
    self.up = linear(features, hidden)
    self.down = linear(hidden, features)

  def __call__(self, x: Array) -> Array:
    return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: config_lib.TransformerConfig, *, rngs: nnx.Rngs,
               attention_fn: Callable[..., Array] | None = None):
    """Creates the block.

    Args:
      cfg: the model config.
      rngs: parameter initialisation keys.
      attention_fn: replaces the attention function of cfg.attention_impl
        (same keyword interface as `flash_attention`), e.g. a sharded one.
    """
    dtype, param_dtype = cfg.jnp_dtype, cfg.jnp_param_dtype
    norm = functools.partial(
        nnx.RMSNorm, cfg.embed_dim, epsilon=cfg.norm_eps, dtype=dtype,
        param_dtype=param_dtype, rngs=rngs,
    )
    impl = cfg.attention_impl
    self.attn_norm = norm()
    self.attn = modules.MultiHeadAttention(
        cfg.num_heads, cfg.embed_dim, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.resolved_head_dim, is_causal=True,
        use_sinks=cfg.use_sinks, **_position_bias(cfg),
        implementation=None if impl in BASELINES else impl,
        block_sizes=cfg.attention_block_sizes,
        attention_fn=attention_fn or BASELINES.get(impl),
        dtype=dtype, param_dtype=param_dtype, rngs=rngs,
    )
    self.mlp_norm = norm()
    self.mlp = SwiGLU(cfg.embed_dim, cfg.mlp_dim, dtype=dtype,
                      param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x, *, positions=None, segment_ids=None, decode=False,
               decode_lengths=None):
    x = x + self.attn(self.attn_norm(x), positions=positions,
                      segment_ids=segment_ids, decode=decode,
                      decode_lengths=decode_lengths)
    return x + self.mlp(self.mlp_norm(x))
