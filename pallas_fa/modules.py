"""Flax modules built on `pallas_fa.flash_attention`.

Two ways in:

* `MultiHeadAttention`: an NNX module with q/k/v/out projections, GQA, an
  optional rotary-embedding hook, segment ids and positions as inputs (packed
  sequences and padding never need a dense T x S mask) and autoregressive
  decoding with a key/value cache;
* `make_attention_fn(...)`: an `attention_fn` for Flax's own
  `flax.nnx.MultiHeadAttention` and `flax.linen.MultiHeadDotProductAttention`,
  accepting every keyword they pass, so existing models switch to flash
  attention with one argument.

Decoding with the cache writes the new keys/values at each sequence's own
cache index (a batch of prompts of different lengths decodes together) and
attends with query positions `index + arange(T)` over key positions
`arange(max_length)` and per-sequence lengths `index + T`: causal masking
on positions is then exactly the bottom-right alignment of a full forward, so
decoding reproduces the full forward's outputs. Calls of a few tokens go
through `pallas_fa.decode_attention` (split-KV, GQA-packed) when the default
attention function runs there; longer ones (the prompt) through
`flash_attention`. The cache is contiguous or, with
`init_cache(..., page_size=...)`, paged (`pallas_fa.kv_cache`).

Flex attention: the layer holds a `score_mod` with its arrays (learned
`nnx.Param`s or fixed `Constant`s, module state either way) and a
`mask_mod` whose arrays (document ids, prefix lengths) come with each call.
They see `flash_attention`'s token indices: `q_idx`/`kv_idx` count the
call's query and key tokens from 0, and when decoding both are cache
indices (the new tokens' positions), on every path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_fa import api
from pallas_fa import checks
from pallas_fa import decode as decode_lib
from pallas_fa import kv_cache
from pallas_fa import masking
from pallas_fa import quantize
from pallas_fa.flex import block_mask as block_mask_lib
from pallas_fa.flex import mods

Array = Any
# rope(x [B, T, N, H], positions int [B, T]) -> x rotated.
RopeFn = Callable[[Array, Array], Array]
# Decoding calls of at most this many new tokens use `decode_attention`.
DECODE_MAX_NEW_TOKENS = 16


def rope(
    x: Array, positions: Array, *, max_wavelength: float = 10_000.0
) -> Array:
  """Rotary position embedding (RoFormer), rotating halves of each head.

  Args:
    x: [B, T, N, H] queries or keys; H must be even.
    positions: int [B, T] absolute positions.
    max_wavelength: the longest wavelength (the "base").

  Returns:
    x with each head rotated by its position, in x's dtype.

  Raises:
    ValueError: H is odd or positions do not match x.
  """
  b, t, _, h = x.shape
  if h % 2:
    raise ValueError(
        f"rope needs an even head dim H, got x [B, T, N, H]={x.shape}.")
  if tuple(positions.shape) != (b, t):
    raise ValueError(
        f"positions must be [B, T]=({b}, {t}), got {positions.shape=}."
    )
  half = h // 2
  freq = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions.astype(jnp.float32)[..., None] * freq[None, None]
  sin = jnp.sin(angle)[:, :, None, :]  # [B, T, 1, H/2]
  cos = jnp.cos(angle)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Rope:
  """A `rope` hook with a fixed wavelength (hashable, compares by value).

  Attributes:
    max_wavelength: the longest wavelength (the "base").
  """

  max_wavelength: float = 10_000.0

  def __call__(self, x: Array, positions: Array) -> Array:
    return rope(x, positions, max_wavelength=self.max_wavelength)


class Constant(nnx.Variable):
  """A fixed array of a layer's `score_mod_args` (e.g. ALiBi slopes).

  Module state like an `nnx.Param` (split, merged and checkpointed with the
  layer), but not one: `nnx.grad`, and optimisers given the `nnx.Param`
  state, leave it alone.
  """


@functools.cache
def _at_cache_indices(fn: Callable, name: str) -> Callable:
  """`fn` (a score_mod or mask_mod) called with `q_idx + offsets[batch]`,
  `offsets` int [B] its first extra argument.

  A decoding call through `flash_attention` counts its queries from 0 while
  its keys are the whole cache; shifted by each row's cache index, `fn`
  sees cache indices as `decode_attention` gives them. Cached, so one
  function object (one trace) per `fn`.
  """
  if name == mods.SCORE_MOD:
    def shifted(score, batch, head, q_idx, kv_idx, offsets, *args):
      return fn(score, batch, head, q_idx + offsets[batch], kv_idx, *args)
  else:
    def shifted(batch, head, q_idx, kv_idx, offsets, *args):
      return fn(batch, head, q_idx + offsets[batch], kv_idx, *args)
  return shifted


class MultiHeadAttention(nnx.Module):
  """Multi-head (grouped-query) attention computed by `flash_attention`.

  Example:
    >>> layer = MultiHeadAttention(4, 64, num_kv_heads=2, is_causal=True,
    ...                            rope=Rope(), rngs=nnx.Rngs(0))
    >>> y = layer(x, segment_ids=seg)            # training / scoring
    >>> layer.init_cache(batch_size, max_length)
    >>> y = layer(prompt, decode=True)           # prefill, then
    >>> y = layer(next_token, decode=True)       # one token at a time
    >>> layer.init_cache(batch_size, max_length, page_size=16)  # paged
    >>> alibi = MultiHeadAttention(                # flex attention
    ...     4, 64, is_causal=True, score_mod=flex.alibi,
    ...     score_mod_args=(nnx.Param(flex.alibi_slopes(4)),),  # learned
    ...     mask_mod=flex.document, rngs=nnx.Rngs(0))
    >>> y = alibi(x, mask_mod_args=(doc_ids,))
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      *,
      num_kv_heads: int | None = None,
      head_dim: int | None = None,
      in_kv_features: int | None = None,
      out_features: int | None = None,
      use_bias: bool = False,
      is_causal: bool = False,
      rope: RopeFn | None = None,
      local_window_size: int | Sequence[int | None] | None = None,
      logits_soft_cap: float | None = None,
      scale: float | None = None,
      dropout_rate: float = 0.0,
      deterministic: bool = False,
      use_sinks: bool = False,
      score_mod: Callable[..., Array] | None = None,
      score_mod_args: Sequence[Array | nnx.Variable] = (),
      mask_mod: Callable[..., Array] | None = None,
      implementation: str | None = None,
      block_sizes: Any = None,
      precision: str | jax.lax.Precision | None = None,
      deterministic_backward: bool | None = None,
      fp8_attention: str | None = None,
      attention_fn: Callable[..., Array] | None = None,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      kernel_init: Callable[..., Array] | None = None,
      out_kernel_init: Callable[..., Array] | None = None,
      rngs: nnx.Rngs,
  ):
    """Creates the projections.

    Args:
      num_heads: query heads N.
      in_features: features of the query input.
      num_kv_heads: key/value heads K (N % K == 0); default N.
      head_dim: features per head H; default in_features // num_heads.
      in_kv_features: features of the key/value input (cross-attention);
        default in_features.
      out_features: output features; default in_features.
      use_bias: whether the projections have biases.
      is_causal: causal masking on positions.
      rope: optional `rope(x, positions)` applied to queries and keys, e.g.
        `pallas_fa.modules.Rope()`.
      local_window_size: sliding window, as in `flash_attention`.
      logits_soft_cap: logit soft cap, as in `flash_attention`.
      scale: logit scale; default 1/sqrt(head_dim).
      dropout_rate: attention dropout (`flash_attention`'s dropout_rate),
        applied in calls that are not `deterministic`, with keys from the
        "dropout" stream of `rngs`.
      deterministic: the default of the call's `deterministic`.
      use_sinks: learn an attention sink per query head (gpt-oss): an
        `nnx.Param` `sinks` [num_heads], initialised to zeros, passed as
        `flash_attention`'s (and `decode_attention`'s) `sinks` (and to a
        custom `attention_fn` as `sinks=`).
      score_mod: flex attention's score function (`flash_attention`'s
        `score_mod`, e.g. `pallas_fa.flex.alibi`), on every attention path
        of the layer (the full forward, decoding, a custom `attention_fn`).
      score_mod_args: the arrays score_mod reads. An `nnx.Variable` entry
        is kept as it is: an `nnx.Param` is learned (gradients reach it
        through the attention). Any other array is fixed: stored as a
        `Constant`. Either way it is module state (`score_mod_args[i]`).
      mask_mod: flex attention's mask function (`flash_attention`'s
        `mask_mod`, e.g. `pallas_fa.flex.document`); its arrays come with
        each call (`mask_mod_args=`).
      implementation: `flash_attention`'s implementation (None = automatic).
      block_sizes: that implementation's tiling config, or None.
      precision: matmul precision of the projections and the attention, as
        in `flash_attention`; None follows `jax.default_matmul_precision`
        and is not passed on to a custom `attention_fn`.
      deterministic_backward: a bitwise-reproducible backward for every
        attention call of the layer, as `flash_attention`'s (True: always;
        False: the fastest; None follows `XLA_FLAGS` where a call is
        traced, and is not passed on to a custom `attention_fn`). Not
        `deterministic`, which is Flax's "no dropout".
      fp8_attention: None, or "head" (the usual choice), "token" or
        "tensor": each attention call through `flash_attention` quantizes
        the layer's q, k and v to float8_e4m3fn with float32 scales of
        that granularity (per batch row and head, per token, or one for
        the tensor) and runs its float8 path (`flash_attention(quantize=
        ...)`, also passed to a custom `attention_fn`). The layer's output
        keeps its dtype, and it trains: gradients reach q, k, v (so the
        projections) straight through the quantization, computed in
        float32 at the dequantized inputs. Decoding steps through
        `decode_attention` read the cache as stored
        (`init_cache(dtype=jnp.float8_e4m3fn)` makes a float8 one).
      attention_fn: replaces `flash_attention` (same keyword interface), for
        baselines; None uses `flash_attention`.
      dtype: computation dtype; default inferred from inputs and params.
      param_dtype: parameter dtype.
      kernel_init: initializer of the q/k/v kernels (default LeCun normal).
      out_kernel_init: initializer of the output kernel (default as above).
      rngs: parameter initialisation keys (and dropout keys: its "dropout"
        stream, else its "default" one). Without either, calls with dropout
        must pass their own `rngs=` (or be deterministic).

    Raises:
      ValueError: a size below 1, inconsistent head counts or sizes, a
        dropout_rate outside [0, 1), a bad precision, score_mod_args
        without a score_mod, or an unknown fp8_attention.
      TypeError: a size (num_heads, in_features, num_kv_heads, head_dim,
        in_kv_features, out_features) that is not an int, a dropout_rate
        that is not a float, a use_bias, is_causal, deterministic or
        use_sinks that is not a bool, a score_mod or mask_mod that is not a
        function of the right arity, score_mod_args that are not arrays, a
        rope or attention_fn that is not callable, a dtype or param_dtype
        that is not a floating-point dtype, or a deterministic_backward
        that is not None or a bool.
    """
    # Sizes become parameter shapes: a float or a string would fail deep
    # in Flax's initialisers, and 0 divide by zero there.
    sizes = dict(num_heads=num_heads, in_features=in_features,
                 num_kv_heads=num_kv_heads, head_dim=head_dim,
                 in_kv_features=in_kv_features, out_features=out_features)
    for name, size in sizes.items():
      if size is not None:
        checks.check_positive_int(name, size)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads:
      raise ValueError(
          "num_heads must be a positive multiple of num_kv_heads, got "
          f"{num_heads=}, {num_kv_heads=}."
      )
    if head_dim is None:
      if in_features % num_heads:
        raise ValueError(
            "in_features must be divisible by num_heads when head_dim is "
            f"not given, got {in_features=}, {num_heads=}."
        )
      head_dim = in_features // num_heads
    dropout_rate = checks.check_dropout_rate(dropout_rate)
    for name, flag in (("use_bias", use_bias), ("is_causal", is_causal),
                       ("deterministic", deterministic),
                       ("use_sinks", use_sinks)):
      api.check_flag(name, flag)
    self.num_heads = int(num_heads)
    self.num_kv_heads = int(num_kv_heads)
    self.head_dim = int(head_dim)
    self.in_features = int(in_features)
    self.in_kv_features = (self.in_features if in_kv_features is None
                           else int(in_kv_features))
    self.out_features = (self.in_features if out_features is None
                         else int(out_features))
    self.is_causal = is_causal
    _check_attention_config(implementation, block_sizes, local_window_size,
                            logits_soft_cap, scale)
    for name, fn in (("rope", rope), ("attention_fn", attention_fn)):
      if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be callable or None, got {name}={fn!r}.")
    _check_float_dtype("dtype", dtype)
    _check_float_dtype("param_dtype", param_dtype)
    self.rope = rope
    self.local_window_size = local_window_size
    self.logits_soft_cap = logits_soft_cap
    self.scale = scale
    self.dropout_rate = dropout_rate
    self.deterministic = deterministic
    # Zeros: at initialisation each sink weighs as much as a key with logit
    # 0; training moves it.
    self.sinks = (nnx.Param(jnp.zeros((num_heads,), param_dtype))
                  if use_sinks else nnx.data(None))
    self.score_mod = score_mod
    self.score_mod_args = nnx.List(
        _score_mod_variables(score_mod, score_mod_args))
    if mask_mod is not None and not callable(mask_mod):
      raise TypeError(f"mask_mod must be callable or None, got {mask_mod=}.")
    self.mask_mod = mask_mod
    self.implementation = implementation
    self.block_sizes = block_sizes
    if precision is not None:
      precision = api.check_precision(precision)
    self.precision = precision
    self.deterministic_backward = _deterministic_backward(
        deterministic_backward)
    if fp8_attention is not None:
      quantize.check_granularity("fp8_attention", fp8_attention)
    self.fp8_attention = fp8_attention
    self.attention_fn = (api.flash_attention if attention_fn is None
                         else attention_fn)
    self.dtype = dtype
    kernel_init = kernel_init or nnx.initializers.lecun_normal()
    linear = lambda i, o, **kw: nnx.LinearGeneral(
        i, o, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        precision=precision, rngs=rngs, **kw,
    )
    heads = (self.num_heads, self.head_dim)
    kv_heads = (self.num_kv_heads, self.head_dim)
    self.query = linear(self.in_features, heads, kernel_init=kernel_init)
    self.key = linear(self.in_kv_features, kv_heads, kernel_init=kernel_init)
    self.value = linear(self.in_kv_features, kv_heads,
                        kernel_init=kernel_init)
    self.out = linear(
        heads, self.out_features, axis=(-2, -1),
        kernel_init=out_kernel_init or kernel_init,
    )
    # Forked after the projections draw their initial values, so that
    # dropout_rate does not change them (as in Flax's own layer). Without
    # a "dropout" (or "default") stream the layer can still run
    # deterministic calls, and calls that pass rngs=; a call that needs
    # the stream names what is missing (`_dropout_rng`).
    stream = _dropout_stream(rngs) if dropout_rate > 0 else None
    self.dropout_rngs = nnx.data(None) if stream is None else stream.fork()
    self.cached_key = nnx.data(None)
    self.cached_value = nnx.data(None)
    self.cache_index = nnx.data(None)
    self.block_table = nnx.data(None)

  def init_cache(
      self,
      batch_size: int,
      max_length: int,
      dtype: Any = None,
      *,
      page_size: int | None = None,
      num_pages: int | None = None,
      block_table: Array | None = None,
  ) -> None:
    """Allocates an empty key/value cache for `decode=True` calls.

    Contiguous by default: `cached_key`/`cached_value` are
    `[batch_size, max_length, K, H]`. With `page_size` they are a pool of
    pages `[num_pages, page_size, K, H]` and `block_table` (a cache variable,
    int32 `[batch_size, ceil(max_length / page_size)]`) names the page that
    holds entries `[i * page_size, (i + 1) * page_size)` of row b, the
    layout `pallas_fa.decode_attention` reads. Decoding writes each new
    key/value straight into its page; calls of a few tokens read the pages
    through the block table, longer ones (a prompt) gather each row's pages
    into a contiguous copy for `flash_attention`. Every row owns its pages
    for the life of the cache (static allocation, no page shared).

    Args:
      batch_size: B of the decoding calls.
      max_length: the most positions (prompt + generated) the cache holds
        (a paged cache rounds it up to whole pages).
      dtype: cache dtype; default the computation dtype (else float32).
        int8, float8_e4m3fn or float8_e5m2 make a quantized cache: each new
        key/value is quantized as it is written (`kv_cache.quantize`, a
        float32 scale per entry and K/V head in `cached_key_scale` /
        `cached_value_scale`) and decoding reads the narrow cache
        (`decode_attention(key_scale=...)`); calls of many tokens (a
        prompt) attend over its dequantized copy.
      page_size: entries per page; None for a contiguous cache.
      num_pages: pages in the pool (paged only); default
        batch_size * ceil(max_length / page_size).
      block_table: the pages of each row, int `[batch_size, ceil(max_length
        / page_size)]`, distinct, in [0, num_pages) (paged only); default
        row b owns pages b, b + batch_size, b + 2 * batch_size, ...

    Raises:
      ValueError: a batch_size or max_length below 1, a bad page_size,
        num_pages or block_table, or either of the last two without
        page_size.
      TypeError: a size that is not an int, or a dtype that is no dtype or
        neither floating nor int8/float8.
    """
    given = dtype
    dtype = quantize.as_dtype(dtype or self.dtype or jnp.float32)
    if dtype is None or not (jnp.issubdtype(dtype, jnp.floating)
                             or kv_cache.is_quantized(dtype)):
      raise TypeError(
          f"init_cache's dtype must be a float dtype, or int8, "
          f"float8_e4m3fn or float8_e5m2 for a quantized cache, got "
          f"dtype={given if dtype is None else dtype!r}.")
    if page_size is None and num_pages is None and block_table is None:
      shape = (checks.check_positive_int("batch_size", batch_size),
               checks.check_positive_int("max_length", max_length))
      self.block_table = nnx.data(None)
    else:
      page_size, num_pages, block_table = kv_cache.check_paged_config(
          batch_size, max_length, page_size=page_size, num_pages=num_pages,
          block_table=block_table)
      shape = (num_pages, page_size)
      self.block_table = nnx.Cache(block_table)
    self.cached_key = nnx.Cache(
        jnp.zeros(shape + (self.num_kv_heads, self.head_dim), dtype))
    self.cached_value = nnx.Cache(
        jnp.zeros(shape + (self.num_kv_heads, self.head_dim), dtype))
    if kv_cache.is_quantized(dtype):
      scales = jnp.ones(shape + (self.num_kv_heads,), jnp.float32)
      self.cached_key_scale = nnx.Cache(scales)
      self.cached_value_scale = nnx.Cache(scales)
    else:
      self.cached_key_scale = self.cached_value_scale = nnx.data(None)
    self.cache_index = nnx.Cache(jnp.zeros((batch_size,), jnp.int32))

  def __call__(
      self,
      inputs_q: Array,
      inputs_kv: Array | None = None,
      *,
      positions: Array | None = None,
      kv_positions: Array | None = None,
      segment_ids: Array | None = None,
      kv_segment_ids: Array | None = None,
      decode: bool = False,
      decode_lengths: Array | None = None,
      deterministic: bool | None = None,
      rngs: nnx.Rngs | None = None,
      mask_mod_args: Sequence[Array] = (),
      block_mask: block_mask_lib.BlockMask | None = None,
  ) -> Array:
    """Attends from `inputs_q` to `inputs_kv` (default: self-attention).

    Args:
      inputs_q: [B, T, in_features].
      inputs_kv: [B, S, in_kv_features], or None for self-attention.
      positions: int [B, T] query positions (causal, window and RoPE are
        measured on them); default arange(T).
      kv_positions: int [B, S]; default `positions` for self-attention, else
        arange(S).
      segment_ids: int [B, T]; tokens attend only within equal ids (packed
        sequences; give padding its own id).
      kv_segment_ids: int [B, S]; default `segment_ids` for self-attention.
      decode: append this call's keys/values to the cache (see
        `init_cache`) and attend over everything cached so far. A call
        that does not fit (cached + T past the cache's entries for a row)
        raises ValueError where the cache index is concrete; under `jit`,
        where it is traced, that row's output is NaN, and so is every
        later call's for it (the index keeps counting past the end).
      decode_lengths: int [B], with decode: how many of the T tokens of each
        row are real (default all); the cache index of row b advances by
        `decode_lengths[b]`, so prompts of different lengths (right-padded
        to T) prefill together and later tokens overwrite the padding.
      deterministic: no attention dropout; default the constructor's.
      rngs: dropout keys for this call (its "dropout" stream); default the
        stream forked at construction.
      mask_mod_args: the arrays of the layer's mask_mod for this call (per
        batch data such as document ids [B, T]; with decode, indexed by
        cache index: [B, max_length]).
      block_mask: a `pallas_fa.create_block_mask` of the layer's mask_mod
        for this call's shapes (full-sequence calls only; it may carry the
        mask_mod_args).

    Returns:
      [B, T, out_features].

    Raises:
      ValueError: bad arguments (inputs whose last dim is not the layer's
        in_features / in_kv_features, say), decoding without a cache, or a
        call with dropout and no "dropout" stream (in `rngs`, else in the
        constructor's).
      TypeError: mask_mod_args that are not arrays, or a deterministic
        that is not None or a bool.
    """
    mask_mod_args = self._check_mask_args(mask_mod_args, block_mask)
    if decode:
      if inputs_kv is not None or any(
          a is not None
          for a in (positions, kv_positions, segment_ids, kv_segment_ids)
      ):
        raise ValueError(
            "decode=True is self-attention at the cache's positions: "
            "inputs_kv, positions and segment ids must be None."
        )
      if block_mask is not None:
        raise ValueError(
            "block_mask is for full-sequence calls: decode=True classifies "
            "the cache's blocks itself.")
      return self._decode(inputs_q, decode_lengths, mask_mod_args)
    if decode_lengths is not None:
      raise ValueError("decode_lengths needs decode=True.")
    self_attention = inputs_kv is None
    _check_features("inputs_q", inputs_q, self.in_features)
    if self_attention:
      inputs_kv = inputs_q
      if self.in_kv_features != self.in_features:
        raise ValueError(
            f"self-attention (inputs_kv=None) projects inputs_q into keys "
            f"and values, which needs in_kv_features={self.in_kv_features} "
            f"to equal in_features={self.in_features}: pass inputs_kv.")
    else:
      _check_features("inputs_kv", inputs_kv, self.in_kv_features)
    q = self.query(inputs_q)  # [B, T, N, H]
    k = self.key(inputs_kv)  # [B, S, K, H]
    v = self.value(inputs_kv)
    b, t = q.shape[:2]
    s = k.shape[1]
    if self_attention:
      kv_positions = positions if kv_positions is None else kv_positions
      kv_segment_ids = (
          segment_ids if kv_segment_ids is None else kv_segment_ids)
    if (segment_ids is None) != (kv_segment_ids is None):
      raise ValueError(
          "give both segment_ids and kv_segment_ids or neither, got "
          f"{segment_ids is None=}, {kv_segment_ids is None=}."
      )
    if self.rope is not None:
      q = self.rope(q, _default_positions(positions, b, t))
      k = self.rope(k, _default_positions(kv_positions, b, s))
    segments = None
    if segment_ids is not None:
      segments = masking.SegmentIds(q=segment_ids, kv=kv_segment_ids)
    kwargs = {}
    if deterministic is None:
      deterministic = self.deterministic
    if not api.check_flag("deterministic", deterministic) and (
        self.dropout_rate > 0):
      kwargs = dict(dropout_rate=self.dropout_rate,
                    dropout_rng=self._dropout_rng(rngs))
    out = self._attend(
        q, k, v, segment_ids=segments, query_positions=positions,
        key_positions=kv_positions,
        **self._flex(mask_mod_args, block_mask=block_mask), **kwargs,
    )
    return self.out(out)

  def _dropout_rng(self, rngs: nnx.Rngs | None) -> Array:
    """A dropout key for a call that drops: from the call's `rngs`, else
    from the stream forked at construction.

    Raises:
      ValueError: that Rngs has no "dropout" (nor "default") stream.
    """
    stream = self.dropout_rngs if rngs is None else _dropout_stream(rngs)
    if stream is None:
      missing = "no 'dropout' (or 'default') stream"
      where = (f"the call's rngs has {missing}" if rngs is not None else
               f"the call passes no rngs= and the layer's rngs (at "
               f"construction) had {missing}")
      raise ValueError(
          f"dropout_rate={self.dropout_rate} in a call that is not "
          f"deterministic draws its keys from a 'dropout' RngStream, but "
          f"{where}: pass rngs=nnx.Rngs(dropout=...) to the call or the "
          f"constructor, or deterministic=True.")
    return stream()

  def _check_mask_args(self, mask_mod_args, block_mask) -> tuple[Array, ...]:
    """A call's mask_mod_args as arrays; they and block_mask need the
    layer's mask_mod."""
    mask_mod_args = mods.as_args("mask_mod_args", mask_mod_args)
    if self.mask_mod is None and (mask_mod_args or block_mask is not None):
      raise ValueError(
          "mask_mod_args and block_mask need a mask_mod: this layer has "
          f"none (got {len(mask_mod_args)} mask_mod_args, "
          f"{block_mask is not None=}).")
    return mask_mod_args

  def _decode(self, inputs: Array, new_lengths: Array | None,
              mask_mod_args: tuple[Array, ...]) -> Array:
    if self.cached_key is None:
      raise ValueError("decode=True needs a cache: call init_cache first.")
    _check_features("inputs_q", inputs, self.in_features)
    q = self.query(inputs)
    k = self.key(inputs)
    v = self.value(inputs)
    b, t = q.shape[:2]
    cache_b = self.cache_index.shape[0]
    if b != cache_b:
      raise ValueError(
          f"decode batch {b} differs from the cache's {cache_b} "
          f"({inputs.shape=}, cache shape {self.cached_key.shape})."
      )
    table = None if self.block_table is None else self.block_table[...]
    # Entries a row can hold: whole pages for a paged cache.
    capacity = self.cached_key.shape[1] * (
        1 if table is None else table.shape[1])
    index = self.cache_index[...]  # [B]
    if not isinstance(index, jax.core.Tracer) and int(index.max()) + t > (
        capacity):
      raise ValueError(
          f"cache overflow: {int(index.max())} cached + {t} new > the "
          f"cache's {capacity} entries per row."
      )
    if new_lengths is None:
      new_lengths = jnp.full((b,), t, jnp.int32)
    else:
      new_lengths = jnp.asarray(new_lengths)
      if new_lengths.shape != (b,) or not jnp.issubdtype(
          new_lengths.dtype, jnp.integer):
        raise ValueError(
            f"decode_lengths must be an int [B={b}] array, got "
            f"decode_lengths.shape={new_lengths.shape}, "
            f"decode_lengths.dtype={new_lengths.dtype}.")
      if not isinstance(new_lengths, jax.core.Tracer):
        known = np.asarray(new_lengths)
        if np.any((known < 0) | (known > t)):
          raise ValueError(
              f"decode_lengths must count real tokens of the call's T={t}, "
              f"in [0, {t}], got decode_lengths={known}.")
    positions = index[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if self.rope is not None:
      q = self.rope(q, positions)
      k = self.rope(k, positions)
    # Each row at its own index (into its own pages when paged).
    quantized = kv_cache.is_quantized(self.cached_key[...].dtype)
    scales = {}
    if quantized:
      keys, key_scale = kv_cache.write(
          self.cached_key[...], k, index, table,
          scale=self.cached_key_scale[...])
      values, value_scale = kv_cache.write(
          self.cached_value[...], v, index, table,
          scale=self.cached_value_scale[...])
      self.cached_key_scale[...] = key_scale
      self.cached_value_scale[...] = value_scale
      scales = dict(key_scale=key_scale, value_scale=value_scale)
    else:
      keys = kv_cache.write(self.cached_key[...], k, index, table)
      values = kv_cache.write(self.cached_value[...], v, index, table)
    self.cached_key[...] = keys
    self.cached_value[...] = values
    self.cache_index[...] = index + new_lengths.astype(jnp.int32)
    # Keys beyond index + t are unwritten cache slots: padding. Queries sit
    # at their true positions, so causal masking on positions is the
    # bottom-right alignment of the full forward. (A padded token of a
    # short row sees garbage-free keys only up to itself; its output is
    # never used.)
    lengths = index + t
    by_decode_attention = self._uses_decode_attention(t)
    if table is not None and not by_decode_attention:
      # flash_attention wants contiguous keys: copy each row's pages.
      keys, values = (kv_cache.gather(x, table) for x in (keys, values))
      scales = {name: kv_cache.gather(x, table) for name, x in scales.items()}
    if quantized and not by_decode_attention:
      # flash_attention reads float keys: a dequantized copy.
      keys = keys.astype(jnp.float32) * scales.pop("key_scale")[..., None]
      values = values.astype(jnp.float32) * scales.pop(
          "value_scale")[..., None]
    if not scales:  # decode_attention reads a quantized cache as it is.
      keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    if by_decode_attention:
      out = decode_lib.decode_attention(
          q, keys, values, lengths, block_table=table, **scales,
          query_positions=positions, scale=self.scale,
          is_causal=self.is_causal, local_window_size=self.local_window_size,
          logits_soft_cap=self.logits_soft_cap, precision=self.precision,
          implementation=self.implementation, **self._sinks(),
          **self._flex(mask_mod_args))
    else:
      out = self._attend(
          q, keys, values, query_positions=positions,
          key_value_seq_lengths=lengths,
          **self._flex(mask_mod_args, query_offsets=index))
    # A row past the cache's end (only under jit: eagerly it raised above)
    # wrote over its own entries: NaN, not a plausible wrong answer.
    overflow = index + t > capacity  # [B]
    return jnp.where(overflow[:, None, None], jnp.nan, self.out(out))

  def _uses_decode_attention(self, new_tokens: int) -> bool:
    """Whether a decoding call of `new_tokens` runs `decode_attention`: the
    default attention function, with an implementation that decodes."""
    return (new_tokens <= DECODE_MAX_NEW_TOKENS
            and self.attention_fn is api.flash_attention
            and self.block_sizes is None
            and self.implementation in (None, "chunked"))

  def _sinks(self) -> dict[str, Array]:
    """`sinks=` for the attention call, if this layer learns sinks."""
    return {} if self.sinks is None else {"sinks": self.sinks[...]}

  def _flex(self, mask_mod_args: tuple[Array, ...], *, block_mask=None,
            query_offsets: Array | None = None) -> dict[str, Any]:
    """The flex attention keywords of an attention call (none unset).

    Args:
      mask_mod_args: the call's (checked) mask_mod_args.
      block_mask: the call's block mask, or None.
      query_offsets: int [B], the cache index of each row's first query in
        a decoding call through `flash_attention`, whose q_idx counts the
        call's tokens from 0; the functions see cache indices all the same.
    """
    kwargs = {}
    for name, fn, args in (
        (mods.SCORE_MOD, self.score_mod,
         tuple(x[...] for x in self.score_mod_args)),
        (mods.MASK_MOD, self.mask_mod, mask_mod_args)):
      if fn is None:
        continue
      if query_offsets is not None:
        fn, args = _at_cache_indices(fn, name), (query_offsets, *args)
      kwargs[name], kwargs[f"{name}_args"] = fn, args
    if block_mask is not None:
      kwargs["block_mask"] = block_mask
    return kwargs

  def _attend(self, q, k, v, **kwargs):
    if self.precision is not None:
      kwargs["precision"] = self.precision
    if self.deterministic_backward is not None:
      kwargs["deterministic_backward"] = self.deterministic_backward
    if self.fp8_attention is not None:
      kwargs["quantize"] = self.fp8_attention
    kwargs.update(self._sinks())
    return self.attention_fn(
        q, k, v, is_causal=self.is_causal,
        local_window_size=self.local_window_size,
        logits_soft_cap=self.logits_soft_cap, scale=self.scale,
        implementation=self.implementation, block_sizes=self.block_sizes,
        **kwargs,
    )


def _score_mod_variables(score_mod, score_mod_args) -> list[nnx.Variable]:
  """A layer's score_mod_args as variables: `nnx.Variable`s as given (an
  `nnx.Param` is learned), other arrays as `Constant`s. Checks the
  score_mod against them once, eagerly.

  Raises:
    ValueError / TypeError: as `mods.as_args` and `mods.check_functions`.
  """
  if not isinstance(score_mod_args, (tuple, list)):
    raise TypeError(
        "score_mod_args must be a tuple of arrays or nnx.Variables, got "
        f"{type(score_mod_args).__name__}.")
  is_variable = lambda x: isinstance(x, nnx.Variable)
  arrays = mods.as_args("score_mod_args", [
      x[...] if is_variable(x) else x for x in score_mod_args])
  mods.check_functions(score_mod, arrays, None, ())
  return [x if is_variable(x) else Constant(a)
          for x, a in zip(score_mod_args, arrays)]


def _dropout_stream(rngs: Any):
  """The RngStream `rngs.dropout` (Flax falls back on a "default" stream),
  or None where that Rngs has neither."""
  try:
    return rngs.dropout
  except AttributeError:
    return None


def _check_attention_config(implementation, block_sizes, local_window_size,
                            logits_soft_cap, scale=None) -> None:
  """What a layer passes to every call, checked when it is built (as each
  call would, naming the argument) rather than at its first call."""
  api.check_implementation(implementation, block_sizes)
  api.check_window(local_window_size)
  api.check_static_float("logits_soft_cap", logits_soft_cap, True)
  api.check_static_float("scale", scale)


def _check_float_dtype(name: str, dtype) -> None:
  """dtype is None or a floating-point dtype (Flax's own errors come from
  its initialisers or at the first call, naming neither argument)."""
  if dtype is None:
    return
  try:
    floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    floating = False
  if not floating:
    raise TypeError(
        f"{name} must be None or a floating-point dtype, got {name}={dtype!r}.")


def _check_features(name: str, x: Array, features: int) -> None:
  """x is [B, length, `features`], the features its projection takes (Flax's
  own error is a dot_general's, naming neither; the positions, segment ids
  and RoPE read B and the length)."""
  shape = jnp.shape(x)
  if len(shape) != 3 or shape[-1] != features:
    length, size = (("T", "in_features") if name == "inputs_q"
                    else ("S", "in_kv_features"))
    raise ValueError(
        f"{name} must be [B, {length}, {size}={features}], got "
        f"{name}.shape={shape}.")


def _default_positions(positions, b, t):
  if positions is not None:
    return positions
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _deterministic_backward(value: bool | None) -> bool | None:
  """`deterministic_backward=` of a layer or attention_fn, checked once;
  None stays None, so that XLA_FLAGS is read where each call is traced."""
  return None if value is None else api.check_deterministic_backward(value)


def _flax_precision(precision):
  """Flax's `precision` argument as `flash_attention`'s `precision`.

  Flax also takes a pair, one per matmul operand; flash attention runs every
  product at one precision, so a pair must name one level twice.
  """
  if isinstance(precision, (tuple, list)) and len(precision) == 2:
    first, second = (api.check_precision(p) for p in precision)
    if first != second:
      raise NotImplementedError(
          f"per-operand matmul precisions are not supported, got {precision=}."
      )
    return first
  return precision


def make_attention_fn(
    *,
    implementation: str | None = None,
    block_sizes: Any = None,
    logits_soft_cap: float | None = None,
    local_window_size: int | Sequence[int | None] | None = None,
    score_mod: Callable[..., Array] | None = None,
    score_mod_args: Sequence[Array] = (),
    mask_mod: Callable[..., Array] | None = None,
    mask_mod_args: Sequence[Array] = (),
    deterministic_backward: bool | None = None,
) -> Callable[..., Array]:
  """An `attention_fn` for Flax's attention modules, using flash attention.

  Usage:
    nnx.MultiHeadAttention(..., attention_fn=make_attention_fn())
    linen.MultiHeadDotProductAttention(..., attention_fn=make_attention_fn())

  The returned function has the signature of Flax's `dot_product_attention`
  (query/key/value `[batch..., length, heads, head_dim]`, dense `mask`/`bias`
  broadcastable to `[batch..., heads, T, S]`, `is_causal`, decode-mode masks)
  and accepts every keyword the two modules pass. `precision` is passed to
  `flash_attention` (a per-operand pair must repeat one level);
  `force_fp32_for_softmax` is always honoured (the softmax statistics are
  float32). Attention dropout (`dropout_rate` > 0 and not `deterministic`)
  runs inside flash attention with `dropout_rng` (on every backend), a
  mask drawn per batch row and head even when Flax would
  broadcast one (`broadcast_dropout`). One documented difference: a query
  row that sees no key returns zeros, where Flax returns the mean of the
  values. No attention sinks: Flax's modules hold no sink parameter for an
  `attention_fn` to learn (`pallas_fa.MultiHeadAttention(use_sinks=True)`
  has one). Flex attention functions are fixed with their arrays here, for
  the same reason: Flax's modules hold no place to learn `score_mod_args`,
  so they are constants (`pallas_fa.MultiHeadAttention(score_mod_args=
  (nnx.Param(...),))` learns them), and the `mask_mod_args` (document ids)
  are those of every call.

  Args:
    implementation: `flash_attention`'s implementation (None = automatic).
    block_sizes: that implementation's tiling config, or None.
    logits_soft_cap: optional logit soft cap.
    local_window_size: optional sliding window, as in `flash_attention`.
    score_mod: flex attention's score function, as in `flash_attention`
      (e.g. `pallas_fa.flex.alibi`), applied after Flax's `bias`.
    score_mod_args: the (constant) arrays score_mod reads.
    mask_mod: flex attention's mask function, as in `flash_attention`,
      intersected with Flax's `mask` and `is_causal`.
    mask_mod_args: the arrays mask_mod reads.
    deterministic_backward: `flash_attention`'s: True for a bitwise-
      reproducible backward, False for the fastest, None to follow
      `XLA_FLAGS` where a call is traced. (Flax's `deterministic`, which
      the modules pass per call, means "no dropout".)

  Returns:
    attention_fn(query, key, value, bias=None, mask=None, **flax_kwargs).

  Raises:
    ValueError / TypeError: bad flex arguments (as `flash_attention`), or
      a deterministic_backward that is not None or a bool.
    NotImplementedError (from the returned function): a window, score_mod
      or mask_mod with query and key of different lengths, as in Flax's
      decode mode (one query against the cache, whose position Flax does
      not pass).
  """
  flex = dict(score_mod=score_mod,
              score_mod_args=mods.as_args("score_mod_args", score_mod_args),
              mask_mod=mask_mod,
              mask_mod_args=mods.as_args("mask_mod_args", mask_mod_args))
  mods.check_functions(**flex)
  deterministic_backward = _deterministic_backward(deterministic_backward)
  _check_attention_config(implementation, block_sizes, local_window_size,
                          logits_soft_cap)

  def attention_fn(
      query: Array,
      key: Array,
      value: Array,
      bias: Array | None = None,
      mask: Array | None = None,
      broadcast_dropout: bool = True,
      dropout_rng: Array | None = None,
      dropout_rate: float = 0.0,
      deterministic: bool = False,
      dtype: Any = None,
      precision: Any = None,
      module: Any = None,
      promote_dtype: Any = None,
      is_causal: bool = False,
      force_fp32_for_softmax: bool = False,
      einsum_dot_general: Any = None,
      qk_attn_weights_einsum: Any = None,
      attn_weights_value_einsum: Any = None,
  ) -> Array:
    # Dropout masks are drawn per batch row and head (`pallas_fa.dropout`);
    # Flax's broadcast_dropout (one mask shared by them) is not reproduced.
    del broadcast_dropout, force_fp32_for_softmax
    if deterministic or not dropout_rate:
      dropout_rate, dropout_rng = 0.0, None
    if module is not None:
      raise NotImplementedError(
          "sow_weights=True needs the T x S attention weights, which flash "
          "attention never materialises."
      )
    custom = {name: fn for name, fn in (
        ("einsum_dot_general", einsum_dot_general),
        ("qk_attn_weights_einsum", qk_attn_weights_einsum),
        ("attn_weights_value_einsum", attn_weights_value_einsum),
    ) if fn is not None}
    if custom:
      raise NotImplementedError(
          f"custom attention einsums (e.g. quantised) cannot run inside flash "
          f"attention: got {', '.join(custom)}."
      )
    if promote_dtype is not None:
      query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
      dtype = dtype or jnp.result_type(query, key, value)
      query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    positional = [name for name, given in (
        ("local_window_size", local_window_size is not None),
        ("score_mod", score_mod is not None),
        ("mask_mod", mask_mod is not None)) if given]
    if positional and query.shape[-3] != key.shape[-3]:
      # Flax's decode mode attends one query against the whole cache and
      # passes no query position: a window or mod would measure the query
      # from position 0 instead of its cache index, a wrong answer.
      raise NotImplementedError(
          f"make_attention_fn({', '.join(positional)}=...) needs query and "
          f"key of one length, got {query.shape=}, {key.shape=}: Flax's "
          "decode mode does not tell an attention_fn where its query sits "
          "in the cache. pallas_fa.MultiHeadAttention decodes with windows "
          "and flex mods.")
    if mask is not None:
      mask = jnp.asarray(mask).astype(jnp.bool_)
    # flash_attention takes Flax's [batch..., length, heads, head_dim] layout
    # and [batch..., heads, q, kv] masks as they are.
    return api.flash_attention(
        query, key, value, bias, mask, is_causal=is_causal,
        logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        implementation=implementation, block_sizes=block_sizes,
        precision=_flax_precision(precision),
        deterministic_backward=deterministic_backward, **flex,
    )

  return attention_fn
