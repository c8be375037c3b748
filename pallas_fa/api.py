"""`flash_attention`: validation, canonicalisation and backend dispatch.

The per-argument checks are in `pallas_fa.checks`; this module runs them and
exports the public ones under their own names (`api.check_window`, ...).

This module is also the front door for the rest of the package (the
multi-device layer, `pallas_fa.testing`, the scripts): `canonicalize` turns
public arguments into a `Call` (what every backend receives), and
`choose_backend` picks the backend that runs it. The path of one call:

  flash_attention -> static_arguments (eager checks, jit cache key)
    -> canonicalize -> Call(q, k, v, bias, info, params, batch_shape)
    -> choose_backend -> vjp.attention(backend, ...) -> backend.forward /
       backend.backward (a Pallas kernel or jax.numpy).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_fa import checks
from pallas_fa import dropout
from pallas_fa import gpu_target
from pallas_fa import manual_axes
from pallas_fa import masking
from pallas_fa import online_softmax
from pallas_fa import quantize as quantize_lib
from pallas_fa import vjp

# The argument checks live in `pallas_fa.checks`; the public ones are also
# reached as `api.check_*` by the rest of the package.
from pallas_fa.checks import check_bias_and_mask
from pallas_fa.checks import check_deterministic_backward
from pallas_fa.checks import check_dropout
from pallas_fa.checks import check_flag
from pallas_fa.checks import check_int32_values
from pallas_fa.checks import check_lengths
from pallas_fa.checks import check_non_negative
from pallas_fa.checks import check_out_dtype
from pallas_fa.checks import check_per_token
from pallas_fa.checks import check_precision
from pallas_fa.checks import check_scale
from pallas_fa.checks import check_sinks
from pallas_fa.checks import check_static_float
from pallas_fa.checks import check_window
from pallas_fa.flex import block_mask as block_mask_lib
from pallas_fa.flex import mods
from pallas_fa.vjp import REGISTRY  # noqa: F401  (re-export)
from pallas_fa.vjp import get_backend

Array = Any

# Automatic choice, fastest first, per platform (DESIGN §2).
AUTO_ORDER = {
    "gpu": ("mosaic_gpu", "triton", "chunked"),
    "tpu": ("mosaic_tpu", "chunked"),
    "cpu": ("chunked",),
}
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def implementations() -> tuple[str, ...]:
  """Names accepted by `implementation=` whose backend imports here."""
  names = []
  for name in REGISTRY:
    try:
      get_backend(name)
    except NotImplementedError:
      continue
    names.append(name)
  return tuple(names)


def platform() -> str:
  """The platform kernels are built for, with CUDA/ROCm reported as "gpu"
  (an ahead-of-time `gpu_target.compile_for` target counts as a GPU)."""
  if gpu_target.ahead_of_time() is not None:
    return "gpu"
  p = jax.default_backend()
  return "gpu" if p in ("cuda", "rocm", "gpu") else p


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
  """One canonical attention call: what every backend receives.

  Attributes:
    q: [B, T, N, H], the batch dims of the public call folded into B.
    k: [B, S, K, H], or [1, S, K, H] shared by every query row (only from
      `canonicalize(shared_kv=True)`; `for_backend` broadcasts it for a
      backend that does not read it so).
    v: [B, S, K, Hv], or [1, S, K, Hv] with k.
    bias: float [1 or B, 1 or N, 1 or T, 1 or S'] or None (S' is S, or the
      `bias_key_length` given to `canonicalize`).
    info: every mask argument, as one `masking.MaskInfo`.
    params: the static settings (`vjp.Params`).
    batch_shape: the public call's batch dims, to unfold results with.
    sinks: [N] sink logits in the stats dtype of q, or None (not a backend
      argument: `vjp.attention` adds them).
    scales: a float8 call's (q_scale, k_scale, v_scale), float32
      [B|1, T|1, N|1], [B|1, S|1, K|1] and [B|1, S|1, K|1] (q, k, v are
      float8); None for any other call.
    straight_through: the high-precision (q, k, v) that
      `flash_attention(quantize=...)` quantized into q, k, v, shaped like
      them (`vjp.attention`); else None.
  """

  q: Array
  k: Array
  v: Array
  bias: Array | None
  info: masking.MaskInfo
  params: vjp.Params
  batch_shape: tuple[int, ...]
  sinks: Array | None = None
  scales: tuple[Array, Array, Array] | None = None
  straight_through: tuple[Array, Array, Array] | None = None

  @property
  def arrays(self):
    """(q, k, v, bias, info, params): the arguments of a backend's forward
    and check."""
    return self.q, self.k, self.v, self.bias, self.info, self.params

  def unfold(self, out: Array, lse: Array) -> tuple[Array, Array]:
    """Results [B, T, ...] back to the public call's [*B, T, ...]."""
    return (out.reshape(self.batch_shape + out.shape[1:]),
            lse.reshape(self.batch_shape + lse.shape[1:]))

  def for_backend(self, backend: vjp.Backend) -> Call:
    """This call as `backend` receives it: a K/V shared by every query row
    (batch 1) stays so for a backend that reads it so
    (`vjp.Backend.shared_kv`), and is broadcast to the query's batch for
    the others -- the Pallas kernels, whose index maps read K/V at the
    query's batch row. The broadcast is outside the backend's custom_vjp,
    so its transpose sums their per-row dK/dV."""
    b = self.q.shape[0]
    if self.k.shape[0] == b or backend.shared_kv:
      return self
    wide = lambda x: jnp.broadcast_to(x, (b,) + x.shape[1:])
    straight = self.straight_through
    if straight is not None:
      straight = (straight[0], wide(straight[1]), wide(straight[2]))
    return dataclasses.replace(self, k=wide(self.k), v=wide(self.v),
                               straight_through=straight)

  @property
  def out_dtype(self):
    """The result's dtype: `params.out_dtype` for a float8 call, else q's."""
    return self.params.out_dtype or self.q.dtype

  @property
  def empty(self) -> bool:
    """No batch rows, no queries or no keys (B, T or S = 0)."""
    return 0 in (self.q.shape[0], self.q.shape[1], self.k.shape[1])

  def empty_result(self) -> tuple[Array, Array]:
    """(out, lse) of an `empty` call, before `unfold`, without a backend.

    With no keys every query row sees none: zeros and lse -inf, the rule
    for fully masked rows (and `jax.nn`'s empty output when there are no
    rows). Constants, so every gradient is zero.
    """
    b, t, n, _ = self.q.shape
    out = jnp.zeros((b, t, n, self.v.shape[-1]), self.out_dtype)
    lse = jnp.full((b, t, n), online_softmax.MASK_VALUE,
                   online_softmax.stats_dtype(self.q.dtype))
    return out, lse


def canonicalize(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None,
    local_window_size=None, segment_ids=None, query_positions=None,
    key_positions=None, logits_soft_cap=None, dropout_rate=0.0,
    dropout_rng=None, block_sizes=None, precision=None,
    deterministic_backward=None, bias_key_length=None, sinks=None,
    score_mod=None, score_mod_args=(), mask_mod=None, mask_mod_args=(),
    block_mask=None, shared_kv=False, query_scale=None, key_scale=None,
    value_scale=None, quantize=None, out_dtype=None, float8=False,
) -> Call:
  """Validates the arguments of `flash_attention` (same names, same
  meaning) and returns the canonical `Call`.

  Traceable: `flash_attention` calls it inside its jit. `bias_key_length`:
  bias and mask span this many keys instead of S (ring attention, whose
  bias covers every shard's keys). Key/value batch dims of size 1 are
  broadcast against the query's; `shared_kv`: a key/value whose batch dims
  are all 1 stays [1, S, K, H] in the `Call` (see `Call.for_backend`), for
  callers that run it through `choose_backend`; otherwise it is broadcast
  to the query's batch here. `float8`: whether the caller runs float8
  calls (passes `Call.scales` and `Call.straight_through` on to
  `vjp.attention`); without it float8 inputs and `quantize` are rejected.

  Raises:
    ValueError / TypeError: invalid arguments (the message names them).
  """

  query, key, value = (checks.as_array(name, x) for name, x in (
      ("query", query), ("key", key), ("value", value)))
  if query.ndim < 3:
    raise ValueError(
        f"query must be [*B, T, N, H] (any number of batch dims, including "
        f"none), got {query.shape=}."
    )
  # Messages name the argument ("key.shape=..."), not the loop variable.
  for name, x in (("key", key), ("value", value)):
    if x.ndim != query.ndim:
      raise ValueError(
          f"{name} must have the same rank as query, got {name}.shape="
          f"{x.shape} and {query.shape=}."
      )
  batch_shape = query.shape[:-3]
  for name, x in (("key", key), ("value", value)):
    if any(d not in (1, want) for d, want in zip(x.shape[:-3], batch_shape)):
      raise ValueError(
          f"{name} must be [*B, S, K, H] with the query's batch dims (or 1 "
          f"where shared by every query row), got {name}.shape={x.shape} "
          f"and {query.shape=}."
      )
  is_float8 = _check_dtypes(query, key, value, float8)
  scales = _check_scales(
      query, key, value, batch_shape, query_scale=query_scale,
      key_scale=key_scale, value_scale=value_scale)
  out_dtype = _check_float8_options(query, is_float8, quantize,
                                    check_out_dtype(out_dtype), float8)
  # Explicit sizes: with an empty dim a -1 would be ambiguous (0 / 0).
  query = query.reshape((math.prod(batch_shape),) + query.shape[-3:])
  key, value = _fold_key_value(key, value, batch_shape, shared_kv)
  b, t, n, h = query.shape
  if key.shape[:-1] != value.shape[:-1]:
    raise ValueError(
        "value must be [*B, S, K, Hv] with key's B, S and K, got "
        f"{key.shape=}, {value.shape=}.")
  _, s, num_kv, hk = key.shape
  hv = value.shape[-1]
  if hk != h:
    raise ValueError(
        "key must be [*B, S, K, H] with the query's head dim H, got "
        f"{query.shape=}, {key.shape=}."
    )
  # No batch rows, queries or keys is a valid call (`Call.empty`); no heads
  # or an empty head dim is not.
  if 0 in (n, h, num_kv, hv):
    raise ValueError(
        f"heads and head dims must be non-empty, got {query.shape=}, "
        f"{key.shape=}, {value.shape=}.")
  if n % num_kv:
    raise ValueError(
        "query heads N must be a multiple of key/value heads K, got "
        f"N={n}, K={num_kv} ({query.shape=}, {key.shape=})."
    )
  # A symbolic head dim (jax.export) is bounded by its constraints, not
  # here (its default scale came traced: `fold_traced_scale`).
  if not checks.symbolic_dims((h, hv)) and max(h, hv) > 256:
    raise ValueError(
        f"head dims must be <= 256, got {query.shape=}, {value.shape=}.")
  scale = check_static_float("scale", scale)
  scale = 1.0 / math.sqrt(h) if scale is None else scale
  soft_cap = check_static_float("logits_soft_cap", logits_soft_cap, True)
  window = check_window(local_window_size)

  if not batch_shape:
    bias, mask, query_seq_lengths, key_value_seq_lengths = _drop_batch_of_one(
        bias, mask, query_seq_lengths, key_value_seq_lengths)
  bias, mask = check_bias_and_mask(
      bias, mask, batch_shape, (n, t, bias_key_length or s))
  dropout_rate, dropout_rng = check_dropout(dropout_rate, dropout_rng)

  q_len = check_lengths("query_seq_lengths", query_seq_lengths, batch_shape)
  kv_len = check_lengths(
      "key_value_seq_lengths", key_value_seq_lengths, batch_shape)
  straight_through = None
  if quantize is not None:
    # Quantized here, so the float8 arrays are data; the gradients reach
    # the high-precision ones straight through (`vjp.attention`).
    straight_through = (query, key, value)
    query, key, value, scales = _quantize_inputs(
        straight_through, quantize, q_len, kv_len)

  if query_positions is None:
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  else:
    q_pos = check_per_token(
        "query_positions", query_positions, batch_shape, t)
  if key_positions is None:
    kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  else:
    kv_pos = check_per_token("key_positions", key_positions, batch_shape, s)

  q_seg = kv_seg = None
  if segment_ids is not None:
    _check_segment_ids_type(segment_ids)
    q_seg = check_per_token("segment_ids.q", segment_ids.q, batch_shape, t)
    kv_seg = check_per_token(
        "segment_ids.kv", segment_ids.kv, batch_shape, s)
  q_seg = masking.padding_segments(q_seg, q_len, t, masking.Q_PAD_SEGMENT)
  kv_seg = masking.padding_segments(kv_seg, kv_len, s, masking.KV_PAD_SEGMENT)
  if (q_seg is None) != (kv_seg is None):
    # One side is padded, the other not: give the other real ids (all 0).
    if q_seg is None:
      q_seg = jnp.zeros((b, t), jnp.int32)
    else:
      kv_seg = jnp.zeros((b, s), jnp.int32)

  flex = check_flex(
      score_mod, score_mod_args, mask_mod, mask_mod_args, block_mask,
      batch=b, heads=n, q_len=t, kv_len=s)
  info = masking.MaskInfo(
      q_positions=q_pos,
      kv_positions=kv_pos,
      q_segment_ids=q_seg,
      kv_segment_ids=kv_seg,
      mask=mask,
      is_causal=check_flag("is_causal", is_causal),
      window=window,
      dropout_seed=(None if dropout_rng is None
                    else dropout.seed_from(dropout_rng)),
      dropout_rate=dropout_rate,
      positions_are_indices=query_positions is None and key_positions is None,
      **flex,
  )
  params = vjp.Params(
      scale=scale, soft_cap=soft_cap, block_sizes=block_sizes,
      precision=check_precision(precision),
      deterministic_backward=check_deterministic_backward(
          deterministic_backward), out_dtype=out_dtype)
  sinks = check_sinks(sinks, n, online_softmax.stats_dtype(query.dtype))
  # Inside a user's shard_map that checks varying axes: one type for every
  # array of the call (`manual_axes`), before a backend checks it.
  query, key, value, bias, info, sinks, scales, straight_through = (
      manual_axes.vary_together(query, key, value, bias, info, sinks, scales,
                                straight_through))
  if info.dropout_seed is not None:
    info = dataclasses.replace(info, dropout_seed=dropout.seed_for_shard(
        info.dropout_seed, manual_axes.axes(query)))
  return Call(q=query, k=key, v=value, bias=bias, info=info, params=params,
              batch_shape=batch_shape, sinks=sinks, scales=scales,
              straight_through=straight_through)


_SCALE_FORMS = {
    "query_scale": "[*B, T, N] per token, [*B, 1, N] or [N] per head, or a "
                   "scalar per tensor",
    "key_scale": "[*B, S, K] per token, [*B, 1, K] or [K] per head, or a "
                 "scalar per tensor",
}
_SCALE_FORMS["value_scale"] = _SCALE_FORMS["key_scale"]


def _check_dtypes(query, key, value, float8: bool) -> bool:
  """Checks the input dtypes; returns whether the call is a float8 one.

  Inputs share one float dtype, or are all float8 (with `float8`): each is
  dequantized with its own scale, so e4m3 and e5m2 may mix. A float8 array
  next to a 16/32-bit one has no single meaning (would the float8 one be
  upcast, or the other quantized?), so that is an error.
  """
  named = (("query", query), ("key", key), ("value", value))
  fp8 = [quantize_lib.is_fp8(x.dtype) for _, x in named]
  accepted = "float32, bfloat16, float16 or float64"
  if float8:
    accepted += " (or float8_e4m3fn or float8_e5m2, with scales)"
  for (name, x), is_fp8 in zip(named, fp8):
    if not (any(x.dtype == d for d in _FLOAT_DTYPES) or (is_fp8 and float8)):
      raise TypeError(f"{name} must be {accepted}, got {name}.dtype="
                      f"{x.dtype}.")
  if any(fp8) and not all(fp8):
    raise TypeError(
        "query, key and value must all be float8 or none of them (quantize "
        "the others with pallas_fa.quantize_fp8, or pass quantize=), got "
        f"query.dtype={query.dtype}, key.dtype={key.dtype}, "
        f"value.dtype={value.dtype}.")
  if not any(fp8) and not query.dtype == key.dtype == value.dtype:
    raise TypeError(
        "query, key and value must share a dtype, got "
        f"{query.dtype=}, {key.dtype=}, {value.dtype=}."
    )
  return all(fp8)


def _check_scales(query, key, value, batch_shape, **scales):
  """query_scale/key_scale/value_scale (before the batch dims are folded)
  -> float32 rank-3 [B|1, T|1, N|1] / [B|1, S|1, K|1] (batch folded as the
  arrays', missing scales 1) for a float8 call, or None."""
  arrays = {"query_scale": ("query", query), "key_scale": ("key", key),
            "value_scale": ("value", value)}
  checked = {
      name: check_scale(name, scale, arrays[name][1], arrays[name][0],
                        forms=_SCALE_FORMS[name],
                        dtypes=quantize_lib.FP8_DTYPES)
      for name, scale in scales.items()}
  if not quantize_lib.is_fp8(query.dtype):
    return None  # check_scale has rejected any scale given.
  rows = math.prod(batch_shape)
  folded = []
  for name in ("query_scale", "key_scale", "value_scale"):
    scale = checked[name]
    if scale is None:
      folded.append(jnp.ones((1, 1, 1), jnp.float32))
      continue
    lead, rest = scale.shape[:len(batch_shape)], scale.shape[len(batch_shape):]
    if math.prod(lead) == 1:  # Shared by every batch row: keep it so.
      folded.append(scale.reshape((1,) + rest))
    else:
      folded.append(jnp.broadcast_to(scale, batch_shape + rest).reshape(
          (rows,) + rest))
  return tuple(folded)


def _check_float8_options(query, is_float8, quantize, out_dtype, float8):
  """The `out_dtype` of `vjp.Params` (None for a call that is not a float8
  one), after checking `quantize=` and `out_dtype=` against the inputs."""
  if quantize is not None:
    if not float8:
      raise ValueError(
          f"{quantize=} runs through flash_attention's float8 path, which "
          "this entry point does not take.")
    quantize_lib.check_granularity("quantize", quantize)
    if is_float8:
      raise TypeError(
          f"quantize= quantizes 16/32-bit inputs, got {query.dtype=} "
          "(float8 already: pass its scales as query_scale/key_scale/"
          "value_scale instead).")
    return out_dtype or query.dtype
  if is_float8:
    return out_dtype or jnp.dtype(jnp.bfloat16)
  if out_dtype is not None and out_dtype != query.dtype:
    raise ValueError(
        f"out_dtype applies to float8 calls (float8 inputs, or quantize=); "
        f"a {query.dtype} call returns {query.dtype}, got {out_dtype=}.")
  return None


def _drop_batch_of_one(bias, mask, q_lengths, kv_lengths):
  """Unbatched [T, N, H] inputs take what jax.nn.dot_product_attention
  takes for them: it adds a batch dim of 1, so a rank-4 bias or mask with
  a leading 1 and lengths of shape [1] mean the one row (their own [N, T,
  S] and scalar forms stay valid too)."""
  def squeezed(x, rank):
    if x is not None and jnp.ndim(x) == rank and jnp.shape(x)[0] == 1:
      return jnp.reshape(x, jnp.shape(x)[1:])
    return x
  return (squeezed(bias, 4), squeezed(mask, 4), squeezed(q_lengths, 1),
          squeezed(kv_lengths, 1))


def _quantize_inputs(arrays, granularity, q_len, kv_len):
  """`flash_attention(quantize=granularity)`: (q, k, v) [B|1, L, heads, H]
  -> (q8, k8, v8, scales). Positions past the lengths are padding, whose
  values (NaN or inf included) must never reach a result, so they count as
  zeros toward the scales (and are stored as zeros)."""
  quantized = []
  for x, lengths in zip(arrays, (q_len, kv_len, kv_len)):
    x = jax.lax.stop_gradient(x)
    if lengths is not None:
      # A batch-1 K/V shared by every row keeps what the longest row sees.
      rows = lengths if x.shape[0] == lengths.shape[0] else jnp.max(
          lengths, keepdims=True)
      real = jnp.arange(x.shape[1])[None, :] < rows[:, None]
      x = jnp.where(real[:, :, None, None], x, 0)
    quantized.append(quantize_lib.quantize_fp8(x, granularity))
  (q, q_scale), (k, k_scale), (v, v_scale) = quantized
  scales = tuple(s.reshape((1,) * (3 - s.ndim) + s.shape)
                 for s in (q_scale, k_scale, v_scale))
  return q, k, v, scales


def _fold_key_value(key, value, batch_shape, shared):
  """key/value [*B|1, S, K, H] -> [prod(B), S, K, H], or [1, S, K, H] when
  `shared` and both are shared by every query row (all batch dims 1).

  Broadcasting follows `bias`: a size-1 batch dim means the same K/V for
  every query row along it, and autodiff of the broadcast sums dK/dV over
  those rows, so the gradients are shaped like the arrays passed.
  """
  rows = math.prod(batch_shape)
  if shared and math.prod(key.shape[:-3]) == math.prod(
      value.shape[:-3]) == 1:
    return (key.reshape((1,) + key.shape[-3:]),
            value.reshape((1,) + value.shape[-3:]))
  return tuple(
      jnp.broadcast_to(x, batch_shape + x.shape[-3:]).reshape(
          (rows,) + x.shape[-3:])
      for x in (key, value))


def check_flex(score_mod, score_mod_args, mask_mod, mask_mod_args,
               block_mask, *, batch, heads, q_len, kv_len) -> dict[str, Any]:
  """Validates the flex-attention arguments of a traced call (`mods`,
  `block_mask`) and returns them as `masking.MaskInfo` fields.

  A block mask supplies the mask_mod (and its arguments) when the call
  gives none.

  Raises:
    ValueError / TypeError: invalid arguments (the message names them).
  """
  score_mod_args = mods.as_args("score_mod_args", score_mod_args)
  mask_mod_args = mods.as_args("mask_mod_args", mask_mod_args)
  block_mask = block_mask_lib.check_block_mask(
      block_mask, mask_mod, batch=batch, heads=heads, q_len=q_len,
      kv_len=kv_len)
  if block_mask is not None and mask_mod is None:
    if block_mask.mask_mod is None:
      raise ValueError(
          "block_mask carries no mask_mod; pass mask_mod= with it.")
    mask_mod = block_mask.mask_mod
    mask_mod_args = mask_mod_args or block_mask.mask_mod_args
  mods.check_functions(score_mod, score_mod_args, mask_mod, mask_mod_args)
  for name, fn, args in ((mods.SCORE_MOD, score_mod, score_mod_args),
                         (mods.MASK_MOD, mask_mod, mask_mod_args)):
    mods.check_shapes(name, fn, args, batch=batch, heads=heads,
                      q_len=q_len, kv_len=kv_len)
  return dict(
      score_mod=score_mod, score_mod_args=score_mod_args, mask_mod=mask_mod,
      # The mask is not differentiated (its arrays may be floats).
      mask_mod_args=tuple(jax.lax.stop_gradient(x) for x in mask_mod_args),
      block_mask=block_mask)


def _accepts_block_sizes(backend, block_sizes) -> bool:
  if block_sizes is None:
    return True
  kind = backend.block_sizes_type
  return kind is not None and isinstance(block_sizes, kind)


def _block_sizes_error(implementation, backend, block_sizes) -> TypeError:
  kind = backend.block_sizes_type
  if kind is None:
    want = "None (it takes no tiling config)"
  else:
    want = (f"None or its config class pallas_fa.{kind.__name__}, e.g. "
            f"pallas_fa.{kind.__name__}(block_q=128)")
  return TypeError(
      f"block_sizes for implementation={implementation!r} must be {want}, "
      f"got {block_sizes=} (a {type(block_sizes).__name__}).")


def check_implementation(implementation, block_sizes) -> None:
  """Checks `implementation=` and `block_sizes=` before they key a jit cache
  (where an unhashable value, such as a dict, would fail with jit's own
  error, naming neither).

  Raises:
    TypeError: implementation is not a str or None; block_sizes is not the
      named backend's config class (with implementation=None: not a config
      class at all).
    ValueError: an unknown implementation.
    NotImplementedError: the named backend cannot be imported here.
  """
  if implementation is not None and not isinstance(implementation, str):
    raise TypeError(
        f"implementation must be a str or None, got {implementation=}.")
  if block_sizes is None:
    return
  if implementation is not None:
    backend = get_backend(implementation)
    if not _accepts_block_sizes(backend, block_sizes):
      raise _block_sizes_error(implementation, backend, block_sizes)
    return
  # Every config class is a frozen dataclass; which one fits is the
  # automatic choice's business (a backend whose class does not match
  # declines and the choice moves on). The backends are imported only to
  # name their classes in the error.
  if dataclasses.is_dataclass(block_sizes) and not isinstance(
      block_sizes, type):
    return
  kinds = (get_backend(name).block_sizes_type for name in implementations())
  names = ", ".join(f"pallas_fa.{kind.__name__}" for kind in kinds if kind)
  raise TypeError(
      "block_sizes must be None or the tiling config of the backend that "
      f"runs the call (one of {names}; name it with implementation=), got "
      f"{block_sizes=} (a {type(block_sizes).__name__}).")


def choose_backend(implementation: str | None, call: Call) -> vjp.Backend:
  """The backend to run `call`: the named one (which must support it), or
  the first of `AUTO_ORDER` for this platform that does.

  Raises:
    TypeError: `implementation` or `block_sizes` has the wrong type.
    NotImplementedError: the named backend, or every candidate, declines.
  """
  params = call.params
  if implementation is not None:
    if not isinstance(implementation, str):
      raise TypeError(f"implementation must be a str or None, got "
                      f"{implementation=}.")
    backend = get_backend(implementation)
    if not _accepts_block_sizes(backend, params.block_sizes):
      raise _block_sizes_error(implementation, backend, params.block_sizes)
    backend.check_call(*call.for_backend(backend).arrays)
    return backend
  reasons = []
  candidates = AUTO_ORDER.get(platform(), ("chunked",))
  if checks.symbolic_batch_and_rest(*call.arrays[:3])[1]:
    # Shape-polymorphic lengths (`jax.export`): the tiled backends pick
    # their tiles from them and decline; the reference takes any.
    candidates += ("xla",)
  for name in candidates:
    try:
      backend = get_backend(name)
    except NotImplementedError as e:
      reasons.append(str(e))
      continue
    if not _accepts_block_sizes(backend, params.block_sizes):
      reasons.append(f"{name}: block_sizes is not its config type")
      continue
    try:
      backend.check_call(*call.for_backend(backend).arrays)
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
      continue
    return backend
  raise NotImplementedError(
      "No implementation supports this call: " + "; ".join(reasons)
  )


def static_arguments(*, scale, is_causal, local_window_size,
                     logits_soft_cap, precision, query_seq_lengths=None,
                     key_value_seq_lengths=None) -> dict[str, Any]:
  """Checks the static arguments of a public call eagerly (before any jit,
  so that `precision=None` reads `jax.default_matmul_precision` now) and
  returns them validated and hashable, keyed by argument name."""
  check_non_negative("query_seq_lengths", query_seq_lengths)
  check_non_negative("key_value_seq_lengths", key_value_seq_lengths)
  return dict(
      scale=check_static_float("scale", scale),
      is_causal=check_flag("is_causal", is_causal),
      local_window_size=check_window(local_window_size),
      logits_soft_cap=check_static_float(
          "logits_soft_cap", logits_soft_cap, True),
      precision=check_precision(precision),
  )


def flash_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    local_window_size: int | Sequence[int | None] | None = None,
    segment_ids: masking.SegmentIds | None = None,
    query_positions: Array | None = None,
    key_positions: Array | None = None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Any = None,
    sinks: Array | None = None,
    implementation: str | None = None,
    block_sizes: Any = None,
    precision: str | jax.lax.Precision | None = None,
    deterministic_backward: bool | None = None,
    return_residual: bool = False,
    score_mod: Callable | None = None,
    score_mod_args: Sequence[Array] = (),
    mask_mod: Callable | None = None,
    mask_mod_args: Sequence[Array] = (),
    block_mask: block_mask_lib.BlockMask | None = None,
    query_scale: Array | None = None,
    key_scale: Array | None = None,
    value_scale: Array | None = None,
    quantize: str | None = None,
    out_dtype: Any = None,
):
  """Exact scaled dot-product attention, memory-linear in sequence length.

  A drop-in superset of `jax.nn.dot_product_attention`: every argument the two
  share means the same. Logits are
  `score_mod(soft_cap(scale * q.k) + bias)`, masked by the intersection of
  every mask argument and `mask_mod`; a query row with no visible key
  returns zeros (logsumexp -inf) with zero gradients. Empty calls are valid
  on every implementation: no batch rows or queries (B or T = 0) give empty
  results, no keys (S = 0) zeros with logsumexp -inf, and every gradient is
  zero.

  Args:
    query: [*B, T, N, H]: any number of leading batch dims B (none
      included); float32/bfloat16/float16, or float64 (with x64 enabled;
      `xla` and `chunked` only, computing in float64); or float8_e4m3fn /
      float8_e5m2 with `query_scale` (a float8 call, below).
    key: [*B, S, K, H] with N % K == 0 (GQA/MQA without repeating K/V).
      A batch dim of size 1 is shared by every query row along it
      (broadcast, as for bias and PyTorch's FlexAttention; dK/dV come back
      summed over those rows, shaped like key/value). Lengths, positions
      and segment ids stay per query row.
    value: [*B, S, K, Hv], key's dtype (batch dims of size 1 shared, as
      for key; in a float8 call any float8 format); a value head dim
      Hv != H (as in MLA) runs on every implementation.
    bias: float, broadcastable to [*B, N, T, S]; differentiable.
    mask: bool, broadcastable to [*B, N, T, S]; True = may attend.
    scale: logit scale, default 1/sqrt(H): a Python float, or a traced
      scalar (a learned temperature, say) as jax.nn takes, which multiplies
      the query before the kernels (float8: its query_scale) and is
      differentiated; with a 16-bit query that product is rounded to the
      query's dtype once, and must fit it (float16: magnitudes up to
      65504; past that it is inf and the result NaN, where a Python float
      scale, applied to the float32 logits, is not).
    is_causal: keep keys with key position <= query position (top-left
      aligned; see `pallas_fa.masking` for a picture).
    query_seq_lengths: int [*B]; queries at index >= length are padding.
    key_value_seq_lengths: int [*B]; keys at index >= length are padding.
    local_window_size: int w (= (w, w)) or (left, right): keep
      q_pos - left <= k_pos <= q_pos + right; a None side, or one of 2**30
      or more, is unbounded. With a window, positions lie in
      [-2**29, 2**29) (a known one outside is a ValueError).
    segment_ids: `SegmentIds(q=[*B, T], kv=[*B, S])`; attend within equal ids.
      Ids are int32 above -2**31 + 1 (the two lowest are padding's); a known
      id outside that is a ValueError, a traced one is cast.
    query_positions: int [*B, T], default arange(T); int32 values, as for
      segment ids.
    key_positions: int [*B, S], default arange(S).
    logits_soft_cap: c > 0: logits -> c * tanh(logits / c), before bias/mask.
    dropout_rate: attention dropout in [0, 1): each normalised probability
      is zeroed with this probability and the rest scaled by
      1 / (1 - rate), as in Flax. The mask is a hash of (dropout_rng, batch
      row, query head, query index, key index), identical on every backend
      and tiling and regenerated (never stored) by the backward pass
      (`pallas_fa.dropout`). Every backend implements it.
    dropout_rng: a JAX PRNG key or an integer seed; needed when
      dropout_rate > 0.
    sinks: float [N] (or [1], shared), any float dtype, computed in float32
      (float64 for float64 inputs); differentiable. Attention sinks
      (gpt-oss): query head n's row t gets one more logit, `sinks[n]`, that
      joins the softmax denominator and carries no value,
      `p_ts = exp(l_ts - m) / (exp(sinks[n] - m) + sum_s' exp(l_ts' - m))`
      over the visible keys s (l the final logits), so the row's weights
      sum to less than one; the max m includes the sink, so a huge sink
      gives a zero row without overflow. Dropout never drops the sink (it
      has no value). A row with no visible key still returns zeros and
      lse -inf, and its sink gets gradient 0. The logsumexp residual
      includes the sink term, so results merged by logsumexp (split-KV
      decoding, ring attention) stay exact. Every backend runs them.
    implementation: None (fastest that supports the call on this platform),
      or one of `pallas_fa.implementations()`.
    block_sizes: the chosen backend's frozen tiling config, or None.
    precision: the matmul precision of every product of query/key/value-
      derived data, as in `jnp.dot`: a `jax.lax.Precision` or one of JAX's
      names for it ("default"/"bfloat16"/"fastest", "high"/"tensorfloat32"/
      "bfloat16_3x", "highest"/"float32"). It matters for float32 inputs on
      accelerators (DEFAULT float32 is one bfloat16 pass on TPU and
      TensorFloat-32 on recent GPUs). None follows
      `jax.default_matmul_precision` at the time of the call.
    deterministic_backward: whether the backward must be bitwise
      reproducible (equal gradients on every rerun of the call). True: it
      is, on every implementation (one exception below); False: the
      fastest backward, which on `mosaic_gpu` (its fused one, whose dQ is
      reduce-added in float32 in no fixed order) may differ in the last
      bits between runs; None follows XLA: True when `XLA_FLAGS` sets
      `--xla_gpu_deterministic_ops` or
      `--xla_gpu_exclude_nondeterministic_ops`, read when the call is
      traced (inside a jit of yours: when that traces; its cache keeps the
      choice); True or False given wins over the flags. True also wins
      over `MosaicGpuBlockSizes(backward="fused")`: the split backward
      runs. Only `mosaic_gpu` changes path: every other
      backward is reproducible either way, except that on a GPU the `xla`
      and `chunked` gradient of score_mod arrays read by a gather (T5's
      bucket table) is XLA's scatter-add, reproducible only with XLA's
      flag (README, "Reproducibility").
    return_residual: also return the logsumexp [*B, T, N] (natural log,
      float32; float64 for float64 inputs; with `sinks`, the sink term
      included).
    score_mod: flex attention's score function, `(score, batch, head,
      q_idx, kv_idx, *score_mod_args) -> score`, applied to the float32
      logits after soft cap and bias. Written as for one element and
      broadcast-safe: `batch` (the flattened batch index) and `head` (the
      query head) are int32 scalars, `q_idx`/`kv_idx` (token indices from
      0) int32 arrays broadcasting against the tile. Differentiable (to
      q, k, bias and `score_mod_args`); see `pallas_fa.flex` for examples.
      Arrays it reads must come through `score_mod_args` (a closure over
      one is an error). A new function object retraces the call: make it
      once. Runs on "xla" and "chunked" and fused into the "triton",
      "mosaic_tpu" and (per-head score_mods only) "mosaic_gpu" kernels
      (`pallas_fa.flex.fused_mods`), which decline a function whose per-tile
      part gathers (see README, "Flex attention").
    score_mod_args: the arrays score_mod reads (ALiBi slopes, a relative
      bias table), differentiable.
    mask_mod: `(batch, head, q_idx, kv_idx, *mask_mod_args) -> bool`,
      True = may attend; intersects every other mask. Evaluated exactly,
      tile by tile: tiles it leaves empty are skipped and it runs only on
      partial ones (`pallas_fa.BlockMask`).
    mask_mod_args: the arrays mask_mod reads (document ids, prefix
      lengths); not differentiated.
    block_mask: a `pallas_fa.create_block_mask` of the same mask_mod for
      these T and S, reused across calls (without one, each call classifies
      its tiles itself); it also supplies the mask_mod when none is given.
    query_scale: float32 scales of a float8 query, broadcastable to
      query.shape[:-1] = [*B, T, N]: per token ([*B, T, N]), per head
      ([*B, 1, N] or [N]) or per tensor (a scalar); default 1. The call
      attends with `query.astype(float32) * query_scale[..., None]`
      (`pallas_fa.quantize.dequantize`; `pallas_fa.quantize_fp8` makes
      such pairs). Only with float8 inputs (a ValueError otherwise).
    key_scale: the same for a float8 key, broadcastable to [*B, S, K].
    value_scale: the same for a float8 value, broadcastable to [*B, S, K].
    quantize: None, or "head", "token" or "tensor": the call quantizes
      its 16/32-bit query, key and value to float8_e4m3fn with scales of
      that granularity (`quantize_fp8`) and runs the float8 call on them;
      gradients reach the high-precision arrays straight through (below).
    out_dtype: the result's dtype in a float8 call: bfloat16, float32 or
      float16; default bfloat16 for float8 inputs and the query's dtype
      with `quantize`. Other calls return the query's dtype (out_dtype, if
      given, must name it).

  Float8 calls: query, key and value all float8 (e4m3 and e5m2 may mix;
  a float8 array next to a 16/32-bit one is a TypeError), or `quantize`.
  The result is the attention of the dequantized inputs, every other
  argument meaning what it always does; the logsumexp residual is float32.
  `xla` and `chunked` dequantize to float32 and compute as for float32
  inputs (at `precision`; `chunked` tile by tile, holding no float32 copy);
  `triton` (compute capability 8.9 and up, or its CPU interpreter) reads
  the 1-byte tiles and runs both products on them converted in registers
  to float16 (exact), float32 accumulation, P rounded to float16, the
  scales applied to the float32 logits, P and the output;
  `mosaic_gpu` (Hopper, e4m3; the automatic choice there) runs both
  products on 8-bit wgmma, V transposed outside the kernel and P rounded
  to e4m3 in registers with FlashAttention-3's offset of 2^8 (the 8-bit
  products accumulate in fewer bits than float32: its logsumexp is within
  about 2^-12 of sum_i |q_i k_i| * scale, against float32's rounding);
  `mosaic_tpu` (the automatic choice on a TPU) reads the 1-byte tiles and
  widens them to bfloat16 (exact) for bfloat16 products with float32
  accumulation, the scales applied to the float32 logits and P, P
  rounded to bfloat16 for P.V as in a bfloat16 call.
  Gradients: the scales (and bias, sinks, score_mod_args) get the
  float32 gradients of that attention, from a backward run on the float32
  dequantized inputs with the forward's output (exact after `xla` and
  `chunked`, within `triton`'s and `mosaic_tpu`'s rounding of P and
  `mosaic_gpu`'s logits after them). The float8 arrays
  themselves are not differentiated (a TypeError): JAX types their
  cotangent float8, which would round typical gradients to zero. With
  `quantize`, the high-precision query, key and value get the gradient of
  the attention at the dequantized inputs, cast to their dtypes (the
  straight-through estimator of quantization-aware training).

  Returns:
    out [*B, T, N, Hv] typed like query (a float8 call: `out_dtype`), or
    (out, lse) with return_residual.

  Raises:
    ValueError / TypeError: invalid arguments (the message names them),
      including differentiating a float8 input.
    NotImplementedError: the named implementation cannot honour this call.
  """
  rate, rng = check_dropout(dropout_rate, dropout_rng)
  check_flag("return_residual", return_residual)
  check_implementation(implementation, block_sizes)
  if quantize is not None:
    quantize_lib.check_granularity("quantize", quantize)
  query, query_scale, scale = fold_traced_scale(query, query_scale, scale)
  static = static_arguments(
      scale=scale, is_causal=is_causal, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, precision=precision,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths)
  _check_index_values(query_seq_lengths, key_value_seq_lengths,
                      query_positions, key_positions, segment_ids,
                      windowed=static["local_window_size"] is not None)
  score_mod_args = mods.as_args("score_mod_args", score_mod_args)
  mask_mod_args = mods.as_args("mask_mod_args", mask_mod_args)
  mods.check_callable(mods.SCORE_MOD, score_mod, len(score_mod_args))
  mods.check_callable(mods.MASK_MOD, mask_mod, len(mask_mod_args))
  # Before the jit, whose tracers would stand for them in the messages.
  if segment_ids is not None:
    _check_segment_ids_type(segment_ids)
  block_mask_lib.check_made_from(block_mask, mask_mod, mask_mod_args)
  static.update(
      dropout_rate=rate, implementation=implementation,
      block_sizes=block_sizes, score_mod=score_mod, mask_mod=mask_mod,
      # Resolved now (None reads XLA_FLAGS), so it keys the trace cache.
      deterministic_backward=check_deterministic_backward(
          deterministic_backward),
      # Keys the trace cache: kernels built for an ahead-of-time GPU target
      # differ from those built for this machine.
      target=gpu_target.ahead_of_time(),
      quantize=quantize, out_dtype=check_out_dtype(out_dtype))
  call = functools.partial(_flash_attention, **static)
  spec = manual_axes.explicit_spec(query)
  if spec is not None:  # The result is sharded as the query is.
    call = jax.sharding.auto_axes(
        call, out_sharding=(spec, jax.sharding.PartitionSpec(*spec[:-1])))
  out, lse = call(
      query, key, value, bias, mask, query_seq_lengths,
      key_value_seq_lengths, segment_ids, query_positions, key_positions,
      rng, sinks, score_mod_args, mask_mod_args, block_mask, query_scale,
      key_scale, value_scale)
  return (out, lse) if return_residual else out


def _check_segment_ids_type(segment_ids) -> None:
  if not isinstance(segment_ids, masking.SegmentIds):
    raise TypeError(
        "segment_ids must be pallas_fa.SegmentIds(q=..., kv=...), got "
        f"{type(segment_ids).__name__}.")


def _check_index_values(query_seq_lengths, key_value_seq_lengths,
                        query_positions, key_positions, segment_ids, *,
                        windowed):
  """The integer arguments' known values fit the kernels' int32 (jit would
  wrap a 64-bit one silently), and with a window positions stay where
  position +- side does (`checks.WINDOW_POSITIONS`); real segment ids stay
  above the two reserved for padding (`masking.KV_PAD_SEGMENT`), where a
  real id would make padded keys visible to its queries."""
  check_int32_values("query_seq_lengths", query_seq_lengths, low=0)
  check_int32_values("key_value_seq_lengths", key_value_seq_lengths, low=0)
  bounds = {}
  if windowed:
    bounds = dict(low=-checks.WINDOW_POSITIONS,
                  high=checks.WINDOW_POSITIONS - 1,
                  why="with a local_window_size, whose comparisons of "
                  "positions must fit int32")
  check_int32_values("query_positions", query_positions, **bounds)
  check_int32_values("key_positions", key_positions, **bounds)
  if isinstance(segment_ids, masking.SegmentIds):
    real = masking.KV_PAD_SEGMENT + 1
    check_int32_values("segment_ids.q", segment_ids.q, low=real)
    check_int32_values("segment_ids.kv", segment_ids.kv, low=real)


def fold_traced_scale(query, query_scale, scale):
  """(query, query_scale, scale), a traced logit `scale` carried by the
  query, which cannot key the kernels (they are built for a static one):
  softcap(scale * q.k) is softcap((scale * q).k), so the scale multiplies
  a float8 query's scale, or the query itself, and the call runs with
  scale 1. So does the default 1/sqrt(H) of a symbolic head dim H
  (`jax.export`). Any other scale passes through."""
  # A bad query (None, a scalar) is named by the checks that follow.
  head_dim = query.shape[-1] if getattr(query, "ndim", 0) else None
  if scale is None and checks.symbolic_dims((head_dim,)):
    scale = jax.lax.rsqrt(jnp.asarray(head_dim, jnp.float32))
  if not isinstance(scale, jax.core.Tracer):
    return query, query_scale, scale
  if jnp.ndim(scale) or not jnp.issubdtype(jnp.result_type(scale),
                                          jnp.floating):
    raise TypeError(
        f"scale must be a float scalar, got a traced {jnp.shape(scale)} "
        f"{jnp.result_type(scale)} array.")
  query = jnp.asarray(query)
  if quantize_lib.is_fp8(query.dtype):
    factor = jnp.asarray(scale, jnp.float32)
    return query, (factor if query_scale is None
                   else query_scale * factor), 1.0
  wide = online_softmax.stats_dtype(query.dtype)
  return (query.astype(wide) * scale.astype(wide)).astype(query.dtype), (
      query_scale), 1.0


def clear_cache() -> None:
  """Drops `flash_attention`'s compiled traces.

  The backend is chosen while a call is traced, so a later call with the
  same shapes and static arguments reuses the earlier choice. Clearing the
  cache makes the next call choose again: needed after something that choice
  depends on changes in-process, such as `get_backend`'s answer.
  """
  _flash_attention.clear_cache()


@functools.partial(
    jax.jit,
    static_argnames=("scale", "is_causal", "local_window_size",
                     "logits_soft_cap", "dropout_rate", "implementation",
                     "block_sizes", "precision", "deterministic_backward",
                     "target", "score_mod", "mask_mod", "quantize",
                     "out_dtype"),
)
def _flash_attention(
    query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
    segment_ids, query_positions, key_positions, dropout_rng, sinks,
    score_mod_args, mask_mod_args, block_mask, query_scale, key_scale,
    value_scale, *, scale, is_causal, local_window_size, logits_soft_cap,
    dropout_rate, implementation, block_sizes, precision,
    deterministic_backward, target, score_mod, mask_mod, quantize, out_dtype,
):
  del target  # Read by the backends through `gpu_target.current()`.
  # Everything from here on is traced once per shape/static configuration:
  # canonicalisation adds no eager dispatches and no compilations per call.
  call = canonicalize(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      query_positions=query_positions, key_positions=key_positions,
      logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, block_sizes=block_sizes, precision=precision,
      deterministic_backward=deterministic_backward, sinks=sinks,
      score_mod=score_mod, score_mod_args=score_mod_args, mask_mod=mask_mod,
      mask_mod_args=mask_mod_args, block_mask=block_mask, shared_kv=True,
      query_scale=query_scale, key_scale=key_scale, value_scale=value_scale,
      quantize=quantize, out_dtype=out_dtype, float8=True,
  )
  if call.empty:
    if implementation is not None:
      get_backend(implementation)  # An unknown name is still an error.
    return call.unfold(*call.empty_result())
  backend = choose_backend(implementation, call)
  # A K/V shared by every query row reaches `chunked` as one row; the
  # Pallas kernels (and `xla`) get it broadcast to the query's batch here.
  call = call.for_backend(backend)
  return call.unfold(*vjp.attention(
      backend, call.params, call.q, call.k, call.v, call.bias, call.info,
      call.sinks, call.scales, call.straight_through))
