"""The canonical mask description: tile classification against brute force."""

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fa import masking


def _brute_force_kinds(visible, bq, bk):
  b, t, s = visible.shape
  v = visible.reshape(b, t // bq, bq, s // bk, bk)
  empty = ~v.any(axis=(2, 4))
  full = v.all(axis=(2, 4))
  return empty, full


# Slow (many compiled examples): CI runs it in its slow-test leg.
@pytest.mark.slow
@hypothesis.settings(max_examples=8, deadline=None, derandomize=True,
                     database=None)
@hypothesis.given(
    t_blocks=st.integers(1, 5), s_blocks=st.integers(1, 5),
    bq=st.sampled_from([1, 4, 8]), bk=st.sampled_from([1, 4, 8]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.tuples(
        st.one_of(st.none(), st.integers(0, 12)),
        st.one_of(st.none(), st.integers(0, 12)))),
    segments=st.booleans(), sorted_segments=st.booleans(),
    dense=st.booleans(), offset=st.integers(-6, 6), seed=st.integers(0, 99))
def test_classification_is_conservative_and_tight(
    t_blocks, s_blocks, bq, bk, causal, window, segments, sorted_segments,
    dense, offset, seed):
  gen = np.random.default_rng(seed)
  b, t, s = 2, t_blocks * bq, s_blocks * bk
  q_pos = jnp.broadcast_to(jnp.arange(t) + offset, (b, t)).astype(jnp.int32)
  kv_pos = jnp.broadcast_to(jnp.arange(s), (b, s)).astype(jnp.int32)
  q_seg = kv_seg = mask = None
  if segments:
    q_seg = gen.integers(0, 3, (b, t))
    kv_seg = gen.integers(0, 3, (b, s))
    if sorted_segments:
      q_seg, kv_seg = np.sort(q_seg), np.sort(kv_seg)
    # Padding (as the api folds it in): random tails of reserved ids.
    q_len = gen.integers(0, t + 1, (b, 1))
    kv_len = gen.integers(0, s + 1, (b, 1))
    q_seg = np.where(np.arange(t) < q_len, q_seg, masking.Q_PAD_SEGMENT)
    kv_seg = np.where(np.arange(s) < kv_len, kv_seg, masking.KV_PAD_SEGMENT)
    q_seg, kv_seg = jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg,
                                                                jnp.int32)
  if dense:
    mask = jnp.asarray(gen.random((b, 2, t, s)) < 0.7)
  info = masking.MaskInfo(
      q_positions=q_pos, kv_positions=kv_pos, q_segment_ids=q_seg,
      kv_segment_ids=kv_seg, mask=mask, is_causal=causal,
      window=None if window == (None, None) else window)
  vis = masking.visible(
      is_causal=causal, window=info.window,
      q_pos=q_pos[:, :, None], kv_pos=kv_pos[:, None, :],
      q_seg=None if q_seg is None else q_seg[:, :, None],
      kv_seg=None if kv_seg is None else kv_seg[:, None, :],
      dense=None if mask is None else mask.any(axis=1))
  if vis is None:
    vis = jnp.ones((b, t, s), bool)
  vis = np.asarray(jnp.broadcast_to(vis, (b, t, s)))
  kinds = np.asarray(masking.classify_blocks(info, bq, bk))
  empty, full = _brute_force_kinds(vis, bq, bk)
  # Conservative: never skip a tile with a visible element, never drop the
  # mask of a tile with a masked element.
  assert not np.any((kinds == masking.EMPTY) & ~empty)
  if mask is None:
    assert not np.any((kinds == masking.FULL) & ~full)
  # Tight where the description allows it: causal and window (min/max of
  # positions) are classified exactly; segment ranges only bound the truth.
  if mask is None and not segments:
    np.testing.assert_array_equal(kinds == masking.EMPTY, empty)
  lo, hi = masking.block_range(jnp.asarray(kinds))
  for bi in range(b):
    for i in range(t_blocks):
      nonempty = np.nonzero(~empty[bi, i])[0]
      if nonempty.size:
        assert lo[bi, i] <= nonempty.min() and hi[bi, i] > nonempty.max()


def test_full_run():
  for row, want in [
      ([0, 1, 2, 2, 1, 0], (2, 4)),  # a contiguous FULL run
      ([1, 2, 1, 2, 1, 0], (9, 9)),  # FULL tiles with a hole: no run
      ([0, 1, 1, 0, 0, 0], (9, 9)),  # no FULL tile
      ([2, 2, 2, 2, 2, 2], (0, 6)),
  ]:
    kinds = jnp.asarray([row, row], jnp.int32)
    lo, hi = masking.full_run(kinds, jnp.array([9, 9], jnp.int32))
    assert lo.tolist() == [want[0]] * 2 and hi.tolist() == [want[1]] * 2, row


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_listed_runs_visit_every_nonempty_block_once(splits):
  """The splits of each row cut its list of non-empty blocks: together they
  visit each such block exactly once, never an EMPTY one, and a position is
  below n_full exactly when its block is FULL."""
  gen = np.random.default_rng(splits)
  kinds = jnp.asarray(gen.integers(0, 3, size=(3, 2, 11)), jnp.int32)
  kinds = kinds.at[0, 0].set(masking.EMPTY)  # A row that sees nothing.
  order, runs = masking.listed_runs(kinds, splits)
  assert runs.shape == (3, 2, splits, 3)
  for row in np.ndindex(kinds.shape[:2]):
    row_kinds, row_order = np.asarray(kinds[row]), np.asarray(order[row])
    visited = []
    for first, end, n_full in np.asarray(runs[row]).tolist():
      assert first <= end
      for at in range(first, end):
        block = row_order[at]
        want = masking.FULL if at < n_full else masking.PARTIAL
        assert row_kinds[block] == want, (row, at, block)
        visited.append(block)
    assert sorted(visited) == np.flatnonzero(
        row_kinds != masking.EMPTY).tolist(), row


def test_padding_folds_into_segments():
  seg = masking.padding_segments(
      None, jnp.array([2, 4]), 4, masking.KV_PAD_SEGMENT)
  np.testing.assert_array_equal(
      seg, [[0, 0, masking.KV_PAD_SEGMENT, masking.KV_PAD_SEGMENT],
            [0, 0, 0, 0]])
  assert masking.padding_segments(None, None, 4, 0) is None


def test_zero_padding_removes_nan():
  x = jnp.full((1, 3, 1, 2), jnp.nan)
  seg = jnp.array([[0, masking.KV_PAD_SEGMENT, masking.KV_PAD_SEGMENT]])
  y = masking.zero_padding(x, seg, masking.KV_PAD_SEGMENT)
  assert np.isnan(y[0, 0]).all() and (y[0, 1:] == 0).all()


def test_positions_are_indices_only_while_positions_are_the_defaults():
  """`MaskInfo.positions_are_indices` (kernels may make such positions
  from tile offsets) is set for the default positions only, kept by
  padding and cleared by any change of positions."""
  from pallas_fa import api  # noqa: PLC0415 - api imports this module.

  x = jnp.asarray(np.random.default_rng().standard_normal((1, 6, 2, 8)),
                  jnp.float32)
  info = lambda **kw: api.canonicalize(  # noqa: E731
      x, x, x, is_causal=True, **kw).arrays[4]
  assert info().positions_are_indices
  arange = jnp.arange(6)[None]
  assert not info(query_positions=arange).positions_are_indices
  assert not info(key_positions=arange).positions_are_indices
  default = info()
  assert masking.pad_sequence(default, 8, 16).positions_are_indices
  assert not default.replace(q_positions=arange + 1).positions_are_indices
  assert not default.replace(kv_positions=arange).positions_are_indices
  assert default.replace(mask=None).positions_are_indices
