"""The triton decode kernel's private A/B options, against the chunked
reference and the default path: narrower value chunks (`_value_chunk`),
the shared prefix pass's tiling (`_prefix_block_kv`, `_prefix_num_warps`)
and the options' checks."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import pallas_fa
from tests import attention_testing
from tests.attention_testing import assert_close
from tests.attention_testing import rng


@attention_testing.gpu_jax_only_on_cpu
@pytest.mark.parametrize("name, k, h, hv, chunk", [
    # A latent cache: the key chunk follows the value chunk down.
    ("latent", 1, 80, 64, 16),
    ("latent_32", 1, 80, 64, 32),
    # Separate values, four chunks of 32 columns a split.
    ("values", 2, 32, 128, 32),
])
def test_triton_narrower_value_chunks(monkeypatch, name, k, h, hv, chunk):
  """`_value_chunk`: more programs a split (each its value columns, the
  keys read once per chunk), fewer splits by default, the same
  attention."""
  from pallas_fa import triton as triton_pkg  # noqa: PLC0415
  grids = []
  real = triton_pkg.pallas_call

  def spy(kernel, inputs, outputs, grid, *args, **kw):
    if args[-1] == "flash_decode":
      grids.append(grid)
    return real(kernel, inputs, outputs, grid, *args, **kw)

  monkeypatch.setattr(triton_pkg, "pallas_call", spy)
  gen = rng("decode value chunks", name)
  b, t, n, s = 2, 1, 4, 96
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), jnp.bfloat16)
  key = jnp.asarray(gen.standard_normal((b, s, k, h)), jnp.bfloat16)
  if hv < h:
    cache = dict(key=key, value=None, value_head_dim=hv)
  else:
    cache = dict(key=key, value=jnp.asarray(
        gen.standard_normal((b, s, k, hv)), jnp.bfloat16))
  lengths = jnp.asarray([s, 45], jnp.int32)
  got = pallas_fa.decode_attention(
      q, lengths=lengths, implementation="triton", _value_chunk=chunk,
      return_residual=True, **cache)
  wide = {key: (x.astype(jnp.float32) if x is not None else None)
          for key, x in cache.items() if key != "value_head_dim"}
  want32 = pallas_fa.decode_attention(
      q.astype(jnp.float32), lengths=lengths, implementation="chunked",
      value_head_dim=cache.get("value_head_dim"), return_residual=True,
      **wide)
  same = pallas_fa.decode_attention(
      q, lengths=lengths, implementation="chunked", return_residual=True,
      **cache)
  for part, x, w, w16 in zip(("out", "lse"), got, want32, same):
    assert_close(part, x, w, w16, jnp.bfloat16)
  # One split (a CPU's default) of hv / chunk programs a K/V head.
  assert grids == [(b, k, hv // chunk)], grids


def test_value_chunk_is_checked():
  """`_value_chunk` is a power of two >= 16, only where the call takes the
  triton kernel's two-kernel path."""
  gen = rng("decode value chunk checks")
  q = jnp.asarray(gen.standard_normal((1, 1, 4, 16)), jnp.float32)
  k = jnp.asarray(gen.standard_normal((1, 40, 2, 16)), jnp.float32)
  lengths = jnp.asarray([33])
  for kw in (dict(implementation="chunked"),
             dict(implementation="triton",
                  mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx),
             dict(implementation="triton", prefix_key=k[0],
                  prefix_value=k[0])):
    with pytest.raises(ValueError, match="_value_chunk applies"):
      pallas_fa.decode_attention(q, k, k, lengths, _value_chunk=32, **kw)
  for bad in (24, 8, True, 32.0):
    with pytest.raises(ValueError, match="_value_chunk must be a power"):
      pallas_fa.decode_attention(q, k, k, lengths, _value_chunk=bad,
                                 implementation="triton")


@attention_testing.gpu_jax_only_on_cpu
@pytest.mark.parametrize("t", [1, 2])
def test_prefix_tiling_options_tile_the_prefix_pass(monkeypatch, t):
  """`_prefix_block_kv` and `_prefix_num_warps`: the prefix's folded pass
  reads blocks of that many keys with that many warps (one new token a
  row: the in-place merge's prefix kernel; two: the folded row's own
  decode), the rows' caches keep theirs, and the result is the
  concatenation's."""
  from pallas_fa import triton as triton_pkg  # noqa: PLC0415
  from pallas_fa.decode import kernels  # noqa: PLC0415
  tilings, launched = [], []
  real = kernels._tiling  # noqa: SLF001
  real_call = triton_pkg.pallas_call

  def spy(kernel, implementation, query, key, *args):
    tiling = real(kernel, implementation, query, key, *args)
    tilings.append((key.shape[1], tiling[0]))
    return tiling

  def spy_call(kernel, inputs, outputs, grid, warps, *args, **kw):
    if args[-1] == "flash_decode":
      launched.append(warps)
    return real_call(kernel, inputs, outputs, grid, warps, *args, **kw)

  monkeypatch.setattr(kernels, "_tiling", spy)
  monkeypatch.setattr(triton_pkg, "pallas_call", spy_call)
  gen = rng("prefix block kv", t)
  b, n, num_kv, h, s_p, s = 3, 4, 2, 32, 72, 40
  q = jnp.asarray(gen.standard_normal((b, t, n, h)), jnp.float32)
  pk, pv = (jnp.asarray(gen.standard_normal((s_p, num_kv, h)), jnp.float32)
            for _ in range(2))
  k, v = (jnp.asarray(gen.standard_normal((b, s, num_kv, h)), jnp.float32)
          for _ in range(2))
  lengths = jnp.asarray([s, 0, 23], jnp.int32)
  got = pallas_fa.decode_attention(
      q, k, v, lengths, prefix_key=pk, prefix_value=pv,
      implementation="triton", _prefix_block_kv=16, _prefix_num_warps=2,
      return_residual=True)
  # The prefix's tiling is the one over its S_p keys.
  assert (s_p, 16) in tilings and all(
      block != 16 for keys, block in tilings if keys == s), tilings
  # The rows' kernel first (in place) or the prefix's row first (folded).
  assert sorted(launched) == [2, 4], launched
  cat = [jnp.concatenate([jnp.broadcast_to(p, (b,) + p.shape), x], axis=1)
         for p, x in ((pk, k), (pv, v))]
  want = pallas_fa.decode_attention(q, *cat, lengths + s_p,
                                    implementation="chunked",
                                    return_residual=True)
  for part, x, w in zip(("out", "lse"), got, want):
    assert_close(part, x, w)


def test_prefix_tiling_options_are_checked():
  """`_prefix_block_kv` is a power of two >= 16, `_prefix_num_warps` a
  triton warp count, each with a prefix only."""
  gen = rng("prefix block kv checks")
  q = jnp.asarray(gen.standard_normal((1, 1, 4, 16)), jnp.float32)
  k = jnp.asarray(gen.standard_normal((1, 40, 2, 16)), jnp.float32)
  lengths = jnp.asarray([33])
  for bad in (24, 8, True, 32.0):
    with pytest.raises(ValueError, match="_prefix_block_kv must be a power"):
      pallas_fa.decode_attention(q, k, k, lengths, prefix_key=k[0],
                                 prefix_value=k[0], _prefix_block_kv=bad)
  prefix = dict(prefix_key=k[0], prefix_value=k[0])
  with pytest.raises(ValueError, match="_prefix_num_warps must be 1, 2"):
    pallas_fa.decode_attention(q, k, k, lengths, _prefix_num_warps=3,
                               implementation="triton", **prefix)
  with pytest.raises(ValueError, match="_prefix_num_warps applies to "
                     "implementation='triton'"):
    pallas_fa.decode_attention(q, k, k, lengths, _prefix_num_warps=4,
                               implementation="chunked", **prefix)
  for kw in (dict(_prefix_block_kv=32),
             dict(_prefix_num_warps=4, implementation="triton")):
    with pytest.raises(ValueError, match="_prefix_block_kv and "
                       "_prefix_num_warps apply to a call with prefix_key"):
      pallas_fa.decode_attention(q, k, k, lengths, **kw)
