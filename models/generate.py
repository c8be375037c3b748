"""Sampling from a `Transformer` with its key/value cache.

The prompt is prefilled in one call, then one token is decoded per step inside
a single jitted `fori_loop`; greedy (temperature 0) or temperature / top-k
sampling; the cache is contiguous, or paged with `page_size=`. `show_samples`
prints generations on a built-in dataset (and scores them on the synthetic
tasks).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import data as data_lib
from pallas_fa import checks

Array = Any


def sample_logits(
    logits: Array, rng: Array, temperature: float = 0.0,
    top_k: int | None = None,
) -> Array:
  """Picks one token per row of `logits`.

  Args:
    logits: float [B, V].
    rng: PRNG key (unused when greedy).
    temperature: 0 = argmax; otherwise logits are divided by it.
    top_k: keep only the k most likely tokens before sampling.

  Returns:
    int32 [B].
  """
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k is not None and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _check_sampling(max_new_tokens, temperature, top_k) -> None:
  """generate's sampling arguments, each named when out of range."""
  checks.check_positive_int("max_new_tokens", max_new_tokens)
  if top_k is not None:
    checks.check_positive_int("top_k", top_k)
  if not isinstance(temperature, (int, float, np.floating, np.integer)) or (
      isinstance(temperature, bool)):
    raise TypeError(f"temperature must be a number, got {temperature=!r}.")
  if not (math.isfinite(temperature) and temperature >= 0):
    raise ValueError(
        f"temperature must be finite and >= 0 (0: greedy), got "
        f"{temperature=}.")


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k",
                     "return_logits"),
)
def _generate(graphdef, state, prompt, prompt_lengths, rng, *, max_new_tokens,
              temperature, top_k, return_logits):
  model = nnx.merge(graphdef, state)
  # Every row's last real prompt token predicts its first new token.
  logits = model(prompt, decode=True, decode_lengths=prompt_lengths)
  logits = jnp.take_along_axis(
      logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
  rng, sub = jax.random.split(rng)
  token = sample_logits(logits, sub, temperature, top_k)
  b, vocab = logits.shape
  out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(token)
  all_logits = None
  if return_logits:
    all_logits = jnp.zeros((b, max_new_tokens, vocab), logits.dtype)
    all_logits = all_logits.at[:, 0].set(logits)

  def step(i, carry):
    state, out, all_logits, token, rng = carry
    model = nnx.merge(graphdef, state)
    logits = model(token[:, None], decode=True)[:, -1]
    rng, sub = jax.random.split(rng)
    token = sample_logits(logits, sub, temperature, top_k)
    if all_logits is not None:
      all_logits = all_logits.at[:, i].set(logits)
    return nnx.state(model), out.at[:, i].set(token), all_logits, token, rng

  _, out, all_logits, _, _ = jax.lax.fori_loop(
      1, max_new_tokens, step,
      (nnx.state(model), out, all_logits, token, rng))
  return (out, all_logits) if return_logits else out


def generate(
    model: nnx.Module,
    prompt: Array,
    max_new_tokens: int,
    *,
    rng: Array | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    cache_length: int | None = None,
    prompt_lengths: Array | None = None,
    page_size: int | None = None,
    cache_dtype: Any = None,
    return_logits: bool = False,
) -> Array | tuple[Array, Array]:
  """Continues `prompt` by `max_new_tokens` tokens.

  `model` itself is not modified: decoding runs on a copy with its own cache.

  Args:
    model: a `models.transformer.Transformer` (anything with `init_cache` and
      a `decode=True` call).
    prompt: int [B, P], P >= 1: prompts right-padded to P when
      `prompt_lengths` is given.
    max_new_tokens: tokens to generate (>= 1).
    rng: PRNG key for sampling; default key 0.
    temperature: 0 = greedy.
    top_k: sample among the k most likely tokens.
    cache_length: cache size; default P + max_new_tokens.
    prompt_lengths: int [B] in [1, P], each prompt's real length (a batch
      of prompts of different lengths decodes together, each continuing
      from its own end); default P for all.
    page_size: decode with a paged cache of pages this long (each row owns
      ceil(cache_length / page_size) pages, see
      `pallas_fa.modules.MultiHeadAttention.init_cache`); None = contiguous.
    cache_dtype: the cache's dtype; default the model's. int8 or float8
      quantize each key and value as it is written (a float32 scale per
      token and K/V head) and decode from the narrow cache.
    return_logits: also return the logits each token was drawn from.

  Returns:
    int32 [B, max_new_tokens], the generated tokens; with return_logits also
    float [B, max_new_tokens, vocab], equal to the full forward's logits over
    the prompt and the generated tokens.

  Raises:
    ValueError / TypeError: bad shapes, lengths or page_size, or a
      max_new_tokens, temperature or top_k out of range (named).
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must be [B, P] with P >= 1, got {prompt.shape=}.")
  _check_sampling(max_new_tokens, temperature, top_k)
  total = prompt.shape[1] + max_new_tokens
  cache_length = cache_length or total
  if cache_length < total:
    raise ValueError(
        f"{cache_length=} is shorter than prompt + new tokens ({total}).")
  b, p = prompt.shape
  if prompt_lengths is None:
    prompt_lengths = jnp.full((b,), p, jnp.int32)
  prompt_lengths = jnp.asarray(prompt_lengths)
  if prompt_lengths.shape != (b,) or not jnp.issubdtype(
      prompt_lengths.dtype, jnp.integer):
    raise ValueError(
        f"prompt_lengths must be an int [B={b}] array, got "
        f"{prompt_lengths.shape=}.")
  if not isinstance(prompt_lengths, jax.core.Tracer) and (
      int(prompt_lengths.min()) < 1 or int(prompt_lengths.max()) > p):
    raise ValueError(
        f"prompt_lengths must be in [1, P={p}], got {prompt_lengths}.")
  graphdef, state = nnx.split(model)
  decoder = nnx.merge(graphdef, state)  # A copy: the cache stays off `model`.
  decoder.init_cache(prompt.shape[0], cache_length, cache_dtype,
                     page_size=page_size)
  graphdef, state = nnx.split(decoder)
  rng = jax.random.key(0) if rng is None else rng
  return _generate(
      graphdef, state, prompt, prompt_lengths.astype(jnp.int32), rng,
      max_new_tokens=max_new_tokens,
      temperature=float(temperature), top_k=top_k,
      return_logits=return_logits,
  )


_TEXT_PROMPTS = ("def ", "import ", "class ", "    for ")


def show_samples(model, dataset, *, num_shown: int, num_prompts: int = 512,
                 seed: int = 0, prompts: Sequence[str] | None = None,
                 max_new_tokens: int = 200, temperature: float = 0.8,
                 top_k: int | None = 20, cache_dtype: Any = None, out=None):
  """Generates with the KV cache and prints the results.

  Args:
    model: a `transformer.Transformer`.
    dataset: the dataset it was trained on.
    num_shown: generations printed.
    num_prompts: synthetic tasks: fresh prompts scored.
    seed: seed of the prompts and of the sampling.
    prompts: text: the prompts to continue (default a few built-in ones).
    max_new_tokens: text: tokens generated per prompt.
    temperature: text: sampling temperature (0 = greedy).
    top_k: text: sample among the k most likely tokens (None = all).
    cache_dtype: the KV cache's dtype (`generate`); default the model's.
    out: where to print (default stdout).

  Returns:
    Synthetic tasks: (exact-match accuracy of greedy generation,
    predictions [num_prompts, answer_len]). Text: the generated strings.
  """
  out = out or sys.stdout
  if isinstance(dataset, data_lib.SyntheticTask):
    rng = np.random.default_rng([seed, 7])
    questions, answers = dataset.examples(rng, num_prompts)
    pred = np.asarray(generate(model, questions, dataset.answer_len,
                               cache_dtype=cache_dtype))
    ok = np.all(pred == answers, axis=1)
    print(f"Greedy KV-cache generation on {len(ok)} fresh prompts: "
          f"{ok.mean():.2%} exact match.", file=out)
    for i in range(min(num_shown, len(ok))):
      verdict = "ok" if ok[i] else "WRONG, want " + dataset.decode(answers[i])
      print(f"  {dataset.decode(questions[i])} -> {dataset.decode(pred[i])}  "
            f"{verdict}", file=out)
    return float(ok.mean()), pred
  texts = []
  for i, text in enumerate(list(prompts or _TEXT_PROMPTS)[:num_shown]):
    new = generate(
        model, dataset.encode(text)[None], max_new_tokens,
        rng=jax.random.key(seed + i), temperature=temperature, top_k=top_k,
        cache_dtype=cache_dtype)
    texts.append(text + dataset.decode(new[0]))
    print(f"--- sample {i} ---\n{texts[-1]}", file=out)
  return texts
