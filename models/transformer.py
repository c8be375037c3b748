"""A decoder-only transformer whose attention is `pallas_fa.flash_attention`.

RMSNorm, RoPE (or ALiBi, a flex attention score_mod), SwiGLU MLP,
grouped-query attention and tied input/output embeddings. Packed sequences
are described by segment ids and positions, never by a dense mask.
`init_cache` + `decode=True` decodes with a key/value cache
and gives the same logits as the full forward.
"""

from __future__ import annotations

import math
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models import config as config_lib
from models import layers

Array = Any


def _apply_block(block, x, positions, segment_ids):
  return block(x, positions=positions, segment_ids=segment_ids)


class Transformer(nnx.Module):
  """Decoder-only language model.

  Example:
    >>> model = Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))
    >>> logits = model(tokens)                   # [B, T, vocab]
  """

  def __init__(self, cfg: config_lib.TransformerConfig, *, rngs: nnx.Rngs,
               attention_fn: Callable[..., Array] | None = None):
    """Creates the parameters.

    Args:
      cfg: the model config.
      rngs: parameter initialisation keys.
      attention_fn: replaces every block's attention function (same keyword
        interface as `flash_attention`), e.g. a sharded one; the parameters
        do not depend on it.
    """
    self.cfg = cfg
    self.embed = nnx.Embed(
        cfg.vocab_size, cfg.embed_dim, dtype=cfg.jnp_dtype,
        param_dtype=cfg.jnp_param_dtype,
        # Unit-RMS inputs after the sqrt(D) scale and unit-scale logits from
        # the tied output projection.
        embedding_init=nnx.initializers.normal(stddev=cfg.embed_dim**-0.5),
        rngs=rngs,
    )
    self.blocks = nnx.List(
        [layers.Block(cfg, rngs=rngs, attention_fn=attention_fn)
         for _ in range(cfg.num_layers)])
    self.final_norm = nnx.RMSNorm(
        cfg.embed_dim, epsilon=cfg.norm_eps, dtype=cfg.jnp_dtype,
        param_dtype=cfg.jnp_param_dtype, rngs=rngs,
    )

  def __call__(
      self,
      tokens: Array,
      *,
      positions: Array | None = None,
      segment_ids: Array | None = None,
      decode: bool = False,
      decode_lengths: Array | None = None,
  ) -> Array:
    """Next-token logits.

    Args:
      tokens: int [B, T].
      positions: int [B, T] (restart at 0 in each packed sequence); default
        arange(T). Must be None when decoding (the cache knows them).
      segment_ids: int [B, T]; tokens attend only within equal ids. None
        when decoding.
      decode: append to the key/value cache (`init_cache`) and attend over
        everything cached so far.
      decode_lengths: int [B], with decode: the real tokens of each row
        (rows right-padded to T); each row's cache advances by its own.

    Returns:
      float32 logits [B, T, vocab_size].

    Raises:
      ValueError: positions or segment_ids with decode, or decode_lengths
        without it.
    """
    if decode and (positions is not None or segment_ids is not None):
      raise ValueError(
          "positions and segment_ids must be None when decoding (the cache "
          f"places each token), got {positions is None=}, "
          f"{segment_ids is None=}.")
    if not decode and decode_lengths is not None:
      raise ValueError("decode_lengths needs decode=True.")
    x = self.embed(tokens) * math.sqrt(self.cfg.embed_dim)
    for block in self.blocks:
      if decode:
        x = block(x, decode=True, decode_lengths=decode_lengths)
      elif self.cfg.remat:
        x = nnx.remat(_apply_block)(block, x, positions, segment_ids)
      else:
        x = _apply_block(block, x, positions, segment_ids)
    x = self.final_norm(x)
    return self.embed.attend(x).astype(jnp.float32)

  def init_cache(
      self,
      batch_size: int,
      max_length: int | None = None,
      dtype: Any = None,
      *,
      page_size: int | None = None,
      num_pages: int | None = None,
      block_table: Array | None = None,
  ) -> None:
    """Allocates every layer's key/value cache (default length cfg.max_len).

    With `page_size` the caches are paged, as in
    `pallas_fa.modules.MultiHeadAttention.init_cache`: each layer has its
    own pool of `num_pages` pages, and all layers share one block table.
    """
    max_length = max_length or self.cfg.max_len
    for block in self.blocks:
      block.attn.init_cache(
          batch_size, max_length, dtype, page_size=page_size,
          num_pages=num_pages, block_table=block_table)


def count_params(model: nnx.Module) -> int:
  """Number of parameters of `model`."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
