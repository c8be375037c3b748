"""Cascade decoding over a shared prefix, and latent (MLA) caches, against
`flash_attention` ("xla") on the materialised caches."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa
from pallas_fa import flex
from pallas_fa import kv_cache
from pallas_fa import quantize
from tests import attention_testing
from tests.attention_testing import assert_close
from tests.attention_testing import rng


def _reference(q, k, v, lengths, q_pos, **kw):
  return pallas_fa.flash_attention(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
      key_value_seq_lengths=jnp.asarray(lengths),
      query_positions=jnp.asarray(q_pos), implementation="xla",
      precision="highest", return_residual=True, **kw)


def _prefix_case(gen, *, b=3, t=2, n=4, num_kv=2, h=32, hv=16, s_p=40,
                 s_max=48, page_size=None):
  q = gen.standard_normal((b, t, n, h)).astype(np.float32)
  pk = gen.standard_normal((s_p, num_kv, h)).astype(np.float32)
  pv = gen.standard_normal((s_p, num_kv, hv)).astype(np.float32)
  k = gen.standard_normal((b, s_max, num_kv, h)).astype(np.float32)
  v = gen.standard_normal((b, s_max, num_kv, hv)).astype(np.float32)
  lengths = gen.integers(t, s_max + 1, b).astype(np.int32)
  lengths[0] = 0  # a row with no own entries yet: the prefix only
  past = np.arange(s_max)[None] >= lengths[:, None]
  k_nan, v_nan = k.copy(), v.copy()
  k_nan[past], v_nan[past] = np.nan, np.nan  # never read
  table = None
  if page_size is not None:
    table = attention_testing.page_table(gen, b, -(-s_max // page_size))
    k_nan, v_nan = (attention_testing.paged(x, table, page_size, np.nan)
                    for x in (k_nan, v_nan))
  # The concatenation each row attends to, and its positions.
  cat_k = np.concatenate([np.broadcast_to(pk, (b,) + pk.shape), k], axis=1)
  cat_v = np.concatenate([np.broadcast_to(pv, (b,) + pv.shape), v], axis=1)
  q_pos = s_p + lengths[:, None] - t + np.arange(t)[None]
  return dict(q=q, pk=pk, pv=pv, k=k_nan, v=v_nan, table=table,
              lengths=lengths, cat_k=cat_k, cat_v=cat_v, q_pos=q_pos,
              cat_lengths=s_p + lengths)


@pytest.mark.parametrize("page_size, splits, extras", [
    (None, 1, {}), (16, 2, {}), (None, 3, "window_softcap_sinks"),
    (16, 1, "positions")])
def test_prefix_equals_decoding_the_concatenation(page_size, splits, extras):
  gen = rng("prefix", page_size, splits, str(extras))
  c = _prefix_case(gen, page_size=page_size)
  kw, q_pos = {}, c["q_pos"]
  if extras == "window_softcap_sinks":
    kw = dict(local_window_size=(30, 0), logits_soft_cap=20.0,
              sinks=jnp.asarray(gen.standard_normal(4), jnp.float32))
  if extras == "positions":  # new tokens not at the end (speculative)
    q_pos = q_pos - gen.integers(0, 3, (3, 1))
    kw = dict(query_positions=jnp.asarray(q_pos, jnp.int32))
  out, lse = pallas_fa.decode_attention(
      jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(c["v"]),
      jnp.asarray(c["lengths"]),
      block_table=None if c["table"] is None else jnp.asarray(c["table"]),
      prefix_key=jnp.asarray(c["pk"]), prefix_value=jnp.asarray(c["pv"]),
      num_splits=splits, return_residual=True, **kw)
  kw.pop("query_positions", None)
  ref = _reference(c["q"], c["cat_k"], c["cat_v"], c["cat_lengths"], q_pos,
                   is_causal=True, **kw)
  assert out.shape == (3, 2, 4, 16) and out.dtype == jnp.float32
  assert_close("out", out, ref[0])
  assert_close("lse", lse, ref[1])


def test_prefix_with_score_mod_and_mask_mod_sees_concatenated_positions():
  gen = rng("prefix flex")
  c = _prefix_case(gen)
  slopes = flex.alibi_slopes(4)
  doc = gen.integers(0, 2, (3, 40 + 48)).astype(np.int32)
  doc[:, :40] = 0  # the prefix is everyone's first document
  mods = dict(score_mod=flex.alibi, score_mod_args=(slopes,))

  def same_document_or_prefix(batch, head, q_idx, kv_idx, ids):
    return (kv_idx < 40) | (ids[batch, q_idx] == ids[batch, kv_idx])

  mods.update(mask_mod=same_document_or_prefix,
              mask_mod_args=(jnp.asarray(doc),))
  out = pallas_fa.decode_attention(
      jnp.asarray(c["q"]), jnp.asarray(c["k"]), jnp.asarray(c["v"]),
      jnp.asarray(c["lengths"]), prefix_key=jnp.asarray(c["pk"]),
      prefix_value=jnp.asarray(c["pv"]), **mods)
  # The oracle: decoding each row over its materialised concatenation (the
  # mods see positions in it, q_idx the new token's).
  ref = pallas_fa.decode_attention(
      jnp.asarray(c["q"]), jnp.asarray(c["cat_k"]), jnp.asarray(c["cat_v"]),
      jnp.asarray(c["cat_lengths"]), **mods)
  assert_close("out", out, ref)


def test_prefix_is_read_once_for_all_rows():
  """The prefix part is one attention call whose key operand is the prefix
  itself (no per-row copy): the traced program holds no array of B times
  the prefix."""
  import jax  # noqa: PLC0415

  gen = rng("prefix once")
  c = _prefix_case(gen, s_p=512)
  args = [jnp.asarray(c[name]) for name in ("q", "k", "v", "lengths", "pk",
                                             "pv")]

  def step(q, k, v, lengths, pk, pv):
    return pallas_fa.decode_attention(q, k, v, lengths, prefix_key=pk,
                                      prefix_value=pv)

  text = jax.jit(step).lower(*args).as_text()
  assert "3x512x2x32" not in text and "3x512x2x16" not in text


@pytest.mark.parametrize("quantized, page_size", [
    (False, None), (True, None), (True, 16)])
def test_latent_cache_reads_values_from_the_keys(quantized, page_size):
  gen = rng("latent", quantized, page_size)
  b, t, n, h, hv, s_max = 2, 1, 8, 72, 64, 64
  q = gen.standard_normal((b, t, n, h)).astype(np.float32)
  k = gen.standard_normal((b, s_max, 1, h)).astype(np.float32)
  lengths = np.asarray([s_max, 23], np.int32)
  scales, k_seen = {}, k
  if quantized:
    k_vals, k_scale = kv_cache.quantize(jnp.asarray(k), jnp.int8)
    k_seen = np.asarray(k_vals, np.float32) * np.asarray(k_scale)[..., None]
    k, scales = np.asarray(k_vals), dict(key_scale=k_scale)
  cache, table = jnp.asarray(k), None
  if page_size is not None:
    pages = s_max // page_size
    table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    cache = cache.reshape(b * pages, page_size, 1, h)
    scales = {name: x.reshape(b * pages, page_size, 1)
              for name, x in scales.items()}
  out = pallas_fa.decode_attention(
      jnp.asarray(q), cache, None, jnp.asarray(lengths), value_head_dim=hv,
      block_table=table, num_splits=2, **scales)
  q_pos = lengths[:, None] - 1
  ref = _reference(q, k_seen, k_seen[..., :hv], lengths, q_pos,
                   is_causal=True)
  assert out.shape == (b, t, n, hv)
  assert_close("out", out, ref[0])


def test_latent_cache_with_a_prefix():
  gen = rng("latent prefix")
  b, t, n, h, hv, s_p, s_max = 2, 1, 4, 24, 16, 20, 32
  q = gen.standard_normal((b, t, n, h)).astype(np.float32)
  k = gen.standard_normal((b, s_max, 1, h)).astype(np.float32)
  pk = gen.standard_normal((s_p, 1, h)).astype(np.float32)
  lengths = np.asarray([s_max, 5], np.int32)
  out = pallas_fa.decode_attention(
      jnp.asarray(q), jnp.asarray(k), None, jnp.asarray(lengths),
      value_head_dim=hv, prefix_key=jnp.asarray(pk))
  cat = np.concatenate([np.broadcast_to(pk, (b,) + pk.shape), k], axis=1)
  ref = _reference(q, cat, cat[..., :hv], s_p + lengths,
                   s_p + lengths[:, None] - 1, is_causal=True)
  assert_close("out", out, ref[0])


def _small():
  gen = rng("prefix latent errors")
  q = jnp.asarray(gen.standard_normal((2, 1, 4, 8)), jnp.float32)
  k = jnp.asarray(gen.standard_normal((2, 16, 2, 8)), jnp.float32)
  return q, k, jnp.asarray([3, 16], jnp.int32)


@pytest.mark.parametrize("change, error, match", [
    (dict(prefix_key=np.ones((5, 2, 8), np.float32)), ValueError,
     "prefix_key and prefix_value go together"),
    (dict(prefix_key=np.ones((5, 2, 8), np.float32),
          prefix_value=np.ones((5, 2, 4), np.float32)), ValueError,
     r"prefix_value must be \[S_p, K, 8\]"),
    (dict(prefix_key=np.ones((1, 5, 2, 8), np.float32),
          prefix_value=np.ones((5, 2, 8), np.float32)), ValueError,
     "no batch dim"),
    (dict(prefix_key=np.ones((5, 2, 8), np.float16),
          prefix_value=np.ones((5, 2, 8), np.float32)), TypeError,
     "prefix_key must have the query's dtype"),
    # The prefix has the cache's K = 2 K/V heads: [prefix; cache] is one
    # sequence of keys.
    *[(dict(prefix_key=np.ones((5, heads, 8), np.float32),
            prefix_value=np.ones((5, heads, 8), np.float32)), ValueError,
       "prefix_key must have the cache's K=2") for heads in (1, 3, 4)],
    (dict(value=None), ValueError, "takes value_head_dim"),
    (dict(value=None, value_head_dim=9), ValueError, r"\[1, H=8\]"),
    (dict(value_head_dim=4), ValueError, "value_head_dim applies to a latent"),
])
def test_bad_prefix_and_latent_arguments_are_named(change, error, match):
  q, k, lengths = _small()
  kw = dict(value=k)
  kw.update({name: jnp.asarray(x) if isinstance(x, np.ndarray) else x
             for name, x in change.items()})
  with pytest.raises(error, match=match):
    pallas_fa.decode_attention(q, k, lengths=lengths, **kw)


def test_latent_value_scale_is_rejected():
  q, k, lengths = _small()
  k8, scale = kv_cache.quantize(k, jnp.int8)
  with pytest.raises(ValueError, match="value_scale applies to a value"):
    pallas_fa.decode_attention(q, k8, None, lengths, value_head_dim=4,
                               key_scale=scale, value_scale=scale)


@pytest.mark.parametrize("implementation, t, fold", [
    ("triton", 1, True), ("triton", 2, True), ("triton", 1, False),
    ("mosaic_tpu", 1, True)])
def test_prefix_on_the_kernels(implementation, t, fold):
  """The kernels decode the rows' own caches; triton decodes the prefix as
  one row whose packed tile holds every row's queries (its keys split over
  programs), or with `_fold_prefix=False` in `flash_attention` over the
  folded queries, as mosaic_tpu does."""
  import jax  # noqa: PLC0415

  gen = rng("prefix kernels", implementation, t, fold)
  c = _prefix_case(gen, t=t, hv=32, page_size=16)
  kw = dict(block_table=jnp.asarray(c["table"]),
            prefix_key=jnp.asarray(c["pk"]),
            prefix_value=jnp.asarray(c["pv"]), return_residual=True,
            num_splits=3, implementation=implementation, _fold_prefix=fold)
  args = [jnp.asarray(c[name]) for name in ("q", "k", "v", "lengths")]
  out, lse = pallas_fa.decode_attention(*args, **kw)
  ref = _reference(c["q"], c["cat_k"], c["cat_v"], c["cat_lengths"],
                   c["q_pos"], is_causal=True)
  assert_close("out", out, ref[0])
  assert_close("lse", lse, ref[1])
  if implementation == "triton":
    jaxpr = str(jax.make_jaxpr(
        lambda *a: pallas_fa.decode_attention(*a, **kw))(*args))
    assert ("flash_fwd" in jaxpr) == (not fold)
    assert len(re.findall(r"name=flash_decode\b(?!_)", jaxpr)) == 1 + fold


@pytest.mark.parametrize("case", ["window_softcap_sinks", "positions_window",
                                  "int8_paged", "eight_groups",
                                  "wide_tile"])
def test_triton_prefix_merges_in_place(case):
  """One new token a row on triton: the prefix's and the rows' split
  kernels feed one merge (`triton.decode.attention_with_prefix`), which
  reads the folded prefix partials in place; the result is the
  concatenation's, with a window cutting into the prefix, sinks, an int8
  own cache on pages, 8 query heads a K/V head over many splits, and 16
  rows x 4 query heads at H = 128 (a 64-row tile in 32-key blocks,
  `triton.decode.default_block`)."""
  import jax  # noqa: PLC0415

  gen = rng("prefix in place", case)
  shape = dict(t=1, page_size=16 if case == "int8_paged" else None)
  if case == "eight_groups":
    shape.update(b=5, n=16, num_kv=2)
  if case == "wide_tile":
    shape.update(b=16, n=8, num_kv=2, h=128, hv=128)
  c = _prefix_case(gen, **shape)
  n = c["q"].shape[2]
  kw = dict(prefix_key=jnp.asarray(c["pk"]), prefix_value=jnp.asarray(
      c["pv"]), return_residual=True, implementation="triton", num_splits=5,
            block_table=None if c["table"] is None else jnp.asarray(
                c["table"]))
  ref_kw = {}
  k, v, cat_k, cat_v = c["k"], c["v"], c["cat_k"], c["cat_v"]
  if case == "window_softcap_sinks":
    ref_kw = dict(local_window_size=(20, 0), logits_soft_cap=20.0,
                  sinks=jnp.asarray(gen.standard_normal(n), jnp.float32))
  q_pos = c["q_pos"]
  if case == "positions_window":  # new tokens not at the end (speculative)
    q_pos = q_pos - gen.integers(0, 3, q_pos.shape)
    kw.update(query_positions=jnp.asarray(q_pos, jnp.int32))
    ref_kw = dict(local_window_size=(25, 0))
  if case == "int8_paged":
    k8, k_scale = kv_cache.quantize(jnp.asarray(k), jnp.int8)
    v8, v_scale = kv_cache.quantize(jnp.asarray(v), jnp.int8)
    kw.update(key_scale=k_scale, value_scale=v_scale)
    k, v = k8, v8
    # Entries past the lengths (NaN, so scales NaN) are never seen.
    own_k = np.nan_to_num(np.asarray(quantize.dequantize(k8, k_scale)))
    own_v = np.nan_to_num(np.asarray(quantize.dequantize(v8, v_scale)))
    # The concatenation of the dequantized pages, in each row's order.
    table, page = c["table"], 16
    rows_k = own_k[table].reshape(table.shape[0], -1, *own_k.shape[2:])
    rows_v = own_v[table].reshape(table.shape[0], -1, *own_v.shape[2:])
    prefix_k = np.broadcast_to(c["pk"], (table.shape[0],) + c["pk"].shape)
    prefix_v = np.broadcast_to(c["pv"], (table.shape[0],) + c["pv"].shape)
    cat_k = np.concatenate([prefix_k, rows_k], axis=1)
    cat_v = np.concatenate([prefix_v, rows_v], axis=1)
    assert rows_k.shape[1] == c["k"].shape[0] // table.shape[0] * page
  args = [jnp.asarray(x) for x in (c["q"], k, v, c["lengths"])]
  q, dtype, same = c["q"], jnp.float32, (None, None)
  if case in ("eight_groups", "wide_tile"):
    # 40 and 64 folded rows: 16-bit queries (float32 ones fold at most
    # `MAX_FOLDED_ROWS_FLOAT32`), against the reference on the rounded
    # inputs and in bfloat16.
    dtype = jnp.bfloat16
    args[:3] = [x.astype(dtype) for x in args[:3]]
    kw.update(prefix_key=kw["prefix_key"].astype(dtype),
              prefix_value=kw["prefix_value"].astype(dtype))
    q, cat_k, cat_v = (jnp.asarray(x, dtype) for x in (q, cat_k, cat_v))
    same = _reference(q, cat_k, cat_v, c["cat_lengths"], q_pos,
                      is_causal=True, **ref_kw)
    q, cat_k, cat_v = (x.astype(jnp.float32) for x in (q, cat_k, cat_v))

  def decode(*a):
    return pallas_fa.decode_attention(*a, **kw, **ref_kw)

  jaxpr = str(jax.make_jaxpr(decode)(*args))
  assert len(re.findall(r"name=flash_decode\b(?!_)", jaxpr)) == 2
  assert len(re.findall(r"name=flash_decode_merge\b", jaxpr)) == 1
  out, lse = decode(*args)
  ref = _reference(q, cat_k, cat_v, c["cat_lengths"], q_pos,
                   is_causal=True, **ref_kw)
  assert_close("out", out, ref[0], same[0], dtype)
  assert_close("lse", lse, ref[1], same[1], dtype)


def test_triton_prefix_past_the_folded_rows_takes_flash_attention(
    monkeypatch):
  """Folded queries over `MAX_FOLDED_ROWS` keep the `flash_attention`
  path (a tile that large would spill), with the same result."""
  import jax  # noqa: PLC0415

  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415

  gen = rng("prefix kernels wide")
  c = _prefix_case(gen, t=2)  # 3 rows x 2 tokens x 2 heads = 12 rows
  monkeypatch.setattr(triton_decode, "MAX_FOLDED_ROWS", 8)
  # The case's float32 queries' own limit (`MAX_FOLDED_ROWS_FLOAT32`).
  monkeypatch.setattr(triton_decode, "MAX_FOLDED_ROWS_FLOAT32", 8)
  args = [jnp.asarray(c[name]) for name in ("q", "k", "v", "lengths", "pk",
                                             "pv")]

  def decode(q, k, v, lengths, pk, pv):
    return pallas_fa.decode_attention(
        q, k, v, lengths, prefix_key=pk, prefix_value=pv,
        implementation="triton", return_residual=True)

  assert "flash_fwd" in str(jax.make_jaxpr(decode)(*args))
  out, lse = decode(*args)
  ref = _reference(c["q"], c["cat_k"], c["cat_v"], c["cat_lengths"],
                   c["q_pos"], is_causal=True)
  assert_close("out", out, ref[0])
  assert_close("lse", lse, ref[1])


def test_triton_folds_fewer_float32_rows():
  """float32 queries fold up to `MAX_FOLDED_ROWS_FLOAT32` rows (a 64-row
  float32 tile spills, and overflows an A100's shared memory at H =
  256), 16-bit ones up to `MAX_FOLDED_ROWS`; chunked folds any."""
  from pallas_fa.decode import kernels  # noqa: PLC0415
  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415
  assert triton_decode.MAX_FOLDED_ROWS_FLOAT32 == 32
  for rows, dtype, folds in ((64, jnp.bfloat16, True), (64, jnp.float16, True),
                             (128, jnp.bfloat16, True),
                             (129, jnp.bfloat16, False),
                             (32, jnp.float32, True), (64, jnp.float32, False)):
    assert kernels.folds_rows("triton", rows, dtype) == folds, (rows, dtype)
  assert kernels.folds_rows("chunked", 1024, jnp.float32)


def latent_case(gen, *, quantized_as=None, page_size=None, h=576, hv=512,
                 b=2, t=1, n=8, s_max=64):
  """A one-head latent cache [B, S_max, 1, H] (or its shuffled pages) with
  NaN (float) or extreme values and NaN scales (quantized) past the
  lengths, and the decode arguments (float32 queries); shared by the
  kernels' latent tests."""
  q = gen.standard_normal((b, t, n, h)).astype(np.float32)
  k = gen.standard_normal((b, s_max, 1, h)).astype(np.float32)
  lengths = np.asarray([s_max, 37], np.int32)[:b]
  past = np.arange(s_max)[None] >= lengths[:, None]
  scales = {}
  if quantized_as is None:
    k[past] = np.nan
  else:
    values, scale = kv_cache.quantize(jnp.asarray(k), quantized_as)
    k, scale = np.array(values), np.array(scale)
    k[past] = np.array(127 if quantized_as == jnp.int8 else 448,
                       np.float32).astype(k.dtype)
    scale[past] = np.nan
    scales = dict(key_scale=scale)
  table = None
  if page_size is not None:
    pages = s_max // page_size
    table = gen.permutation(b * pages).reshape(b, pages).astype(np.int32)
    order = np.argsort(table.reshape(-1))  # pool page -> (row, page)

    def pooled(x):
      x = x.reshape(b * pages, page_size, *x.shape[2:])
      return x[order]

    k = pooled(k)
    scales = {name: pooled(x) for name, x in scales.items()}
  return dict(query=jnp.asarray(q), key=jnp.asarray(k), value=None,
              lengths=jnp.asarray(lengths), value_head_dim=hv,
              block_table=None if table is None else jnp.asarray(table),
              **{name: jnp.asarray(x) for name, x in scales.items()})
