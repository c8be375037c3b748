"""Tests of `pallas_fa.parallel`: sharded and ring attention.

The multi-device checks need `--xla_force_host_platform_device_count` set
before jax is imported, so they run `tests/_parallel_worker.py` in a fresh
process (8 simulated CPU devices; two processes of 4 for the multi-process
test) and fail with its output when it fails.
"""

import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testing import GPU_JAX_ONLY
from attention_testing import gpu_jax_only
from attention_testing import positions_flags_seen

import pallas_fa
from pallas_fa import masking
from pallas_fa import parallel
from pallas_fa.parallel import mesh as mesh_lib
from pallas_fa.parallel import ring
from pallas_fa.parallel import sharded as sharded_lib

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "_parallel_worker.py")
_TIMEOUT_S = 300


def _run_worker(*args):
  # The worker inherits the suite's XLA_FLAGS (`conftest._compile_cheaply`:
  # compiling dominates these tiny programs) and adds the device count.
  proc = subprocess.run(
      [sys.executable, _WORKER, *args], capture_output=True,
      text=True, timeout=_TIMEOUT_S, check=False,
  )
  assert proc.returncode == 0, (
      f"worker {args} failed (rc={proc.returncode}):\n{proc.stdout}\n"
      f"{proc.stderr[-6000:]}"
  )
  assert "ok " in proc.stdout, proc.stdout
  return proc.stdout


# chunked is the blockwise path a CPU mesh runs, checked with the GPU
# machines' jax (sharding moves fast between versions); xla repeats the same
# sharding code around another backend with the oldest supported jax. Both
# slow: a worker process of 8 devices each.
_MULTI_DEVICE_IMPLEMENTATIONS = (
    pytest.param("chunked", marks=GPU_JAX_ONLY),
    pytest.param("xla", marks=pytest.mark.slow))


@pytest.mark.long
@pytest.mark.parametrize("implementation", _MULTI_DEVICE_IMPLEMENTATIONS)
def test_batch_and_head_sharding_matches_single_device(implementation):
  _run_worker("sharded", implementation)


@pytest.mark.long
@pytest.mark.parametrize("implementation", _MULTI_DEVICE_IMPLEMENTATIONS)
def test_ring_attention_matches_single_device(implementation):
  _run_worker("ring", implementation)


@pytest.mark.long
def test_calls_inside_a_user_shard_map_that_checks_varying_axes():
  """flash_attention (chunked, xla; float8 too), ring_attention and
  decode_attention inside the user's own `jax.shard_map(check_vma=True)`
  equal the single-device calls, the gradients of replicated arguments
  included; interpreted triton declines by name (`manual_axes`). Dropout
  draws a mask per device where the call is sharded, the unsharded call's
  where it is replicated."""
  out = _run_worker("user_shard_map")
  assert out.count("ok ") == 9, out


@pytest.mark.long
def test_calls_on_explicit_mesh_axes():
  """Arrays typed with Explicit mesh axes (`jax.make_mesh`'s default, under
  `jax.set_mesh`): flash_attention on chunked, xla and the automatic choice
  equals the unsharded call and keeps the query's sharding (it failed with
  JAX type errors in chunked's loops); so does decode_attention, over a
  float cache and an int8 one with a shared prefix."""
  out = _run_worker("explicit_mesh")
  assert out.count("ok ") == 5, out


@pytest.mark.long
def test_parallel_entry_points_take_what_flash_attention_takes():
  """A traced scale through sharded_flash_attention and ring_attention
  (refused before), ring_attention(quantize=...) called eagerly in a
  user's map (JAX's internal error before), and a named refusal of
  second derivatives through a ring (it blamed Pallas kernels)."""
  out = _run_worker("entry_points")
  assert out.count("ok ") == 3, out


def test_mosaic_gpu_kernels_decline_inside_a_user_shard_map():
  """Mosaic GPU traces its kernels' bodies with the map's types, compiled
  too: inside a shard_map that checks varying axes it declines by name
  (automatic choice moves on to triton), and outside it passes."""
  from pallas_fa import manual_axes  # noqa: PLC0415

  x = jnp.ones((1, 8, 2, 16))
  manual_axes.check_kernels("mosaic_gpu", x, interpreted=lambda: False)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))

  def check(x, implementation, interpreted):
    manual_axes.check_kernels(implementation, x,
                              interpreted=lambda: interpreted)
    return x

  for implementation, interpreted in (("mosaic_gpu", False),
                                      ("triton", True)):
    with pytest.raises(NotImplementedError, match="check_vma=False"):
      jax.shard_map(
          lambda x, i=implementation, t=interpreted: check(x, i, t),
          mesh=mesh, in_specs=jax.sharding.PartitionSpec("d"),
          out_specs=jax.sharding.PartitionSpec("d"))(x)
  # Compiled triton and Mosaic TPU kernels run there.
  jax.shard_map(lambda x: check(x, "triton", False), mesh=mesh,
                in_specs=jax.sharding.PartitionSpec("d"),
                out_specs=jax.sharding.PartitionSpec("d"))(x)


# Meshes "A" (a ring of 8), "B" (2 batch shards x a ring of 4) and "C"
# (batch x heads x a ring of 2, zig-zag) of `_parallel_worker._MESHES`, called
# one after another in one process, each order from empty JAX caches. The
# orders of A and B (A -> B, B -> A as their prefixes) run with the GPU
# machines' jax (CI leg 2), those of all three with the slow tests (the
# oldest jax). "xla" compiles fastest, and what is checked is plumbing.
@pytest.mark.long
@pytest.mark.parametrize("orders", [
    pytest.param(("ABA", "BAB"), marks=GPU_JAX_ONLY),
    pytest.param(("ABC", "ACB", "BAC", "BCA", "CAB", "CBA"),
                 marks=pytest.mark.slow),
], ids=["two", "three"])
def test_calls_over_meshes_of_other_shapes_in_every_order(orders):
  """Forward and gradient, eager and jitted, equal the single-device call
  whatever mesh an earlier call of the process used."""
  out = _run_worker("orders", "xla", *orders)
  assert out.count("ok xla meshes") == 2 * sum(map(len, orders)), out


@pytest.mark.long
@gpu_jax_only  # as chunked above
def test_ring_program_has_no_all_gather_and_errors_name_arguments():
  out = _run_worker("hlo", "chunked")
  assert "ok validation" in out and "ring_attention" in out


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


# Slow (two processes with gloo): CI runs it in its slow-test leg.
@pytest.mark.long
@pytest.mark.slow
def test_ring_attention_across_two_processes():
  port = str(_free_port())
  procs = [
      subprocess.Popen(
          [sys.executable, _WORKER, "process", str(i), port],
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      )
      for i in range(2)
  ]
  outputs = []
  try:
    for p in procs:
      stdout, stderr = p.communicate(timeout=_TIMEOUT_S)
      outputs.append((p.returncode, stdout, stderr[-4000:]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  for i, (rc, stdout, stderr) in enumerate(outputs):
    assert rc == 0, f"process {i} failed (rc={rc}):\n{stdout}\n{stderr}"
    assert f"ok process {i}" in stdout, stdout


# Single-process checks (the default single CPU device).


@pytest.mark.parametrize("num_shards", [1, 2, 3, 8])
def test_zigzag_is_a_balanced_permutation(num_shards):
  length = 2 * num_shards * 5
  idx = parallel.zigzag_indices(length, num_shards)
  np.testing.assert_array_equal(np.sort(idx), np.arange(length))
  x = np.random.RandomState(0).randint(0, 1000, (2, length, 3))
  np.testing.assert_array_equal(parallel.zigzag(x, num_shards), x[:, idx])
  np.testing.assert_array_equal(
      parallel.unzigzag(parallel.zigzag(x, num_shards), num_shards), x)
  # Causal work per shard (visible query/key pairs) is equal on every shard,
  # and so is the work of every shard pair against its mirror.
  shards = idx.reshape(num_shards, -1)
  work = [(shards[r][:, None] >= idx[None, :]).sum()
          for r in range(num_shards)]
  assert len(set(work)) == 1, work


def test_zigzag_gradients_are_the_inverse_permutation():
  """The transpose of each permutation is the other (a gather both ways),
  and integer inputs (positions) pass through a gradient untouched."""
  gen = np.random.default_rng()
  x = jnp.asarray(gen.standard_normal((2, 12, 3)), jnp.float32)
  w = jnp.asarray(gen.standard_normal((2, 12, 3)), jnp.float32)
  for f, inverse in ((parallel.zigzag, parallel.unzigzag),
                     (parallel.unzigzag, parallel.zigzag)):
    grad = jax.grad(lambda x, f=f: jnp.sum(f(x, 3) * w))(x)
    np.testing.assert_array_equal(grad, inverse(w, 3))
  pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
  grad = jax.grad(
      lambda x: jnp.sum(parallel.zigzag(x, 2) * parallel.zigzag(pos, 2)))(x[
          ..., 0])
  np.testing.assert_array_equal(grad, pos.astype(jnp.float32))


def test_zigzag_rejects_lengths_that_do_not_split():
  with pytest.raises(ValueError, match="length % \\(2 \\* num_shards\\)"):
    parallel.zigzag_indices(10, 3)


def test_make_mesh_rejects_wrong_device_count():
  with pytest.raises(ValueError, match="data \\* heads \\* sequence"):
    parallel.make_mesh(data=2, sequence=len(jax.devices()) + 1)


def test_one_device_mesh_matches_flash_attention():
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (2, 24, 4, 8))
  k = jax.random.normal(keys[1], (2, 24, 2, 8))
  v = jax.random.normal(keys[2], (2, 24, 2, 8))
  kwargs = dict(is_causal=True, implementation="xla")
  want = pallas_fa.flash_attention(q, k, v, **kwargs)
  got = parallel.sharded_flash_attention(
      q, k, v, mesh=mesh, batch_axes="data", head_axes="heads",
      sequence_axis="sequence", **kwargs)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # Unbatched input keeps its rank.
  got = parallel.sharded_flash_attention(
      q[0], k[0], v[0], mesh=mesh, head_axes="heads", **kwargs)
  assert got.shape == q.shape[1:]
  np.testing.assert_allclose(got, want[0], rtol=1e-6, atol=1e-6)
  assert jnp.all(jnp.isfinite(got))


@pytest.mark.parametrize("sequence_axis", [None, "sequence"])
def test_one_device_mesh_batch_dims_and_value_head_dim(sequence_axis):
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  gen = np.random.default_rng()
  normal = lambda *shape: jnp.asarray(gen.standard_normal(shape), jnp.float32)
  q, k, v = normal(2, 3, 24, 4, 8), normal(2, 3, 20, 2, 8), normal(
      2, 3, 20, 2, 12)
  kwargs = dict(is_causal=True, implementation="chunked")
  want = pallas_fa.flash_attention(q, k, v, **kwargs)
  got = parallel.sharded_flash_attention(
      q, k, v, mesh=mesh, batch_axes="data", head_axes="heads",
      sequence_axis=sequence_axis, **kwargs)
  assert got.shape == (2, 3, 24, 4, 12)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sequence_axis", [None, "sequence"])
def test_unsplit_sequences_keep_positions_as_indices(sequence_axis):
  """Shards of batch and heads (and a ring of one) hold the whole
  sequence, so the backend is still told that default positions are its
  indices (`MaskInfo.positions_are_indices`: mosaic_gpu then makes them
  from tile offsets). A ring's shards are not (`_parallel_worker.py`'s
  ring check)."""
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  gen = np.random.default_rng()
  q = jnp.asarray(gen.standard_normal((1, 16, 2, 8)), jnp.float32)
  kwargs = dict(is_causal=True, implementation="xla")
  with positions_flags_seen() as seen:
    got = parallel.sharded_flash_attention(
        q, q, q, mesh=mesh, batch_axes="data", head_axes="heads",
        sequence_axis=sequence_axis, **kwargs)
  assert seen == [True], seen
  np.testing.assert_allclose(
      got, pallas_fa.flash_attention(q, q, q, **kwargs), rtol=1e-6,
      atol=1e-6)


@pytest.mark.parametrize("b, t, s", [(2, 0, 8), (2, 8, 0), (0, 8, 8)])
def test_one_device_mesh_empty_calls(b, t, s):
  """As flash_attention: empty results, or zeros and lse -inf (S = 0)."""
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  q, k = jnp.ones((b, t, 4, 8)), jnp.ones((b, s, 2, 8))
  out, lse = parallel.sharded_flash_attention(
      q, k, k, mesh=mesh, batch_axes="data", sequence_axis="sequence",
      return_residual=True)
  np.testing.assert_array_equal(out, jnp.zeros(q.shape))
  np.testing.assert_array_equal(lse, jnp.full(q.shape[:-1], -jnp.inf))


def test_onto_mesh_keeps_the_splits_the_new_mesh_has():
  device = np.asarray(jax.devices()[:1])
  old = jax.sharding.Mesh(device.reshape(1, 1), ("data", "old"))
  new = jax.sharding.Mesh(device.reshape(1, 1), ("data", "seq"))
  spec = jax.sharding.PartitionSpec
  x = jax.device_put(jnp.ones((2, 4)), jax.sharding.NamedSharding(
      old, spec("data", "old")))
  on_new = jax.device_put(jnp.ones(3), jax.sharding.NamedSharding(new, spec()))
  moved = mesh_lib.onto_mesh(
      {"x": x, "on_new": on_new, "host": np.ones(2), "none": None}, new)
  assert moved["x"].sharding == jax.sharding.NamedSharding(
      new, spec("data", None))
  assert moved["on_new"] is on_new and moved["none"] is None
  assert isinstance(moved["host"], np.ndarray)


def test_fresh_cotangents_is_the_identity_and_places_cotangents():
  """Values and gradients pass through unchanged, eagerly and under jit;
  an eager cotangent arrives laid out like its primal."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("seq",))
  on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  gen = np.random.default_rng()
  x = jax.device_put(jnp.asarray(gen.standard_normal((3, 4)), jnp.float32),
                     on_mesh)
  w = jnp.asarray(gen.standard_normal((3, 4)), jnp.float32)
  loss = lambda x: jnp.sum(mesh_lib.fresh_cotangents(x) * w)  # noqa: E731
  np.testing.assert_array_equal(mesh_lib.fresh_cotangents(x), x)
  grads = jax.grad(loss)(x)
  np.testing.assert_array_equal(grads, w)
  assert grads.sharding == on_mesh, grads.sharding
  np.testing.assert_array_equal(jax.jit(jax.grad(loss))(x), w)


def test_sharded_block_sizes_of_the_wrong_type_are_named():
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  q = jnp.ones((2, 8, 2, 8))
  with pytest.raises(TypeError, match="ChunkedBlockSizes.*got block_sizes="):
    parallel.sharded_flash_attention(
        q, q, q, mesh=mesh, implementation="chunked",
        block_sizes={"block_q": 7})
  with pytest.raises(TypeError, match="return_residual must be a bool"):
    parallel.sharded_flash_attention(q, q, q, mesh=mesh, return_residual="no")


def test_sharded_float8_arguments_are_checked():
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  gen = np.random.default_rng(7)
  q, k, v = (jnp.asarray(gen.standard_normal((2, 8, 2, 8)), jnp.float32)
             for _ in range(3))
  (q8, qs), (k8, ks), (v8, vs) = (pallas_fa.quantize_fp8(x, "token")
                                  for x in (q, k, v))
  with pytest.raises(ValueError, match="quantize must be one of"):
    parallel.sharded_flash_attention(q, k, v, mesh=mesh, quantize="row")
  with pytest.raises(ValueError, match="out_dtype applies to float8 calls"):
    parallel.sharded_flash_attention(q, k, v, mesh=mesh,
                                     out_dtype=jnp.bfloat16)
  with pytest.raises(TypeError, match="must all be float8"):
    parallel.sharded_flash_attention(q8, k, v, mesh=mesh, query_scale=qs)

  def loss(q8):
    return parallel.sharded_flash_attention(
        q8, k8, v8, mesh=mesh, query_scale=qs, key_scale=ks,
        value_scale=vs).astype(jnp.float32).sum()

  with pytest.raises(TypeError, match="does not differentiate float8"):
    jax.grad(loss)(q8)
  # A one-device mesh runs the call as flash_attention does.
  got = parallel.sharded_flash_attention(
      q8, k8, v8, mesh=mesh, query_scale=qs, key_scale=ks, value_scale=vs,
      is_causal=True, out_dtype=jnp.float32)
  want = pallas_fa.flash_attention(
      q8, k8, v8, query_scale=qs, key_scale=ks, value_scale=vs,
      is_causal=True, out_dtype=jnp.float32)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_sharded_float8_scales_reach_shards_as_given(monkeypatch):
  """A per-head scale stays one per head inside the shard_map (each
  shard's kernel takes its per-head path), a per-token one per token."""
  seen = []
  attention = sharded_lib.vjp.attention

  def spy(*args, scales=None, **kwargs):
    seen.append([x.shape for x in scales])
    return attention(*args, scales=scales, **kwargs)

  monkeypatch.setattr(sharded_lib.vjp, "attention", spy)
  jax.clear_caches()  # Traced afresh, through the spy.
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  gen = np.random.default_rng(8)
  q, k, v = (jnp.asarray(gen.standard_normal((2, 8, 4, 8)), jnp.float32)
             for _ in range(3))
  for granularity, want in (("head", [(2, 1, 4)] * 3),
                            ("token", [(2, 8, 4)] * 3)):
    seen.clear()
    parallel.sharded_flash_attention(q, k, v, mesh=mesh,
                                     quantize=granularity)
    assert seen == [want], (granularity, seen)


def test_ring_steps_with_no_visible_key_are_skipped():
  pos = jnp.arange(16)[None]
  info = masking.MaskInfo(q_positions=pos, kv_positions=pos + 16,
                          is_causal=True)
  # Keys entirely in the queries' future: the step is skipped.
  assert bool(ring.step_is_empty(info))
  assert not bool(ring.step_is_empty(info.replace(kv_positions=pos)))
  # A window that does not reach the shard.
  window = info.replace(is_causal=False, window=(3, 3),
                        kv_positions=pos + 20)
  assert bool(ring.step_is_empty(window))
  # Disjoint segments.
  seg = info.replace(is_causal=False, kv_positions=pos,
                     q_segment_ids=jnp.zeros((1, 16), jnp.int32),
                     kv_segment_ids=jnp.ones((1, 16), jnp.int32))
  assert bool(ring.step_is_empty(seg))
  # Nothing restricts attention: no predicate at all (never skipped).
  assert ring.step_is_empty(info.replace(is_causal=False)) is None


def test_mesh_axes_must_be_names():
  assert mesh_lib.axis_names(None) == ()
  assert mesh_lib.axis_names("data") == ("data",)
  assert mesh_lib.axis_names(["data", "heads"]) == ("data", "heads")
  for bad in (1, ("data", 2), {"data"}):
    with pytest.raises(TypeError, match="mesh axes must be"):
      mesh_lib.axis_names(bad)


# Sizes are ints (`checks.check_int`) and flags bools.


@pytest.mark.parametrize("call, error, match", [
    (lambda: parallel.make_mesh(data=1.0), TypeError, "data must be an int"),
    (lambda: parallel.make_mesh(data=2.0, sequence=2), TypeError, "data"),
    (lambda: parallel.make_mesh(heads="1"), TypeError, "heads"),
    (lambda: parallel.make_mesh(sequence=0), ValueError,
     "sequence must be a positive int"),
    (lambda: parallel.zigzag_indices(16.0, 2), TypeError,
     "length must be an int"),
    (lambda: parallel.zigzag_indices(16, 2.0), TypeError, "num_shards"),
    (lambda: parallel.zigzag_indices(16, 0), ValueError, "num_shards"),
    (lambda: parallel.zigzag_indices(12, 4), ValueError, "2 \\* num_shards"),
    (lambda: parallel.zigzag(jnp.ones((1, 8)), 2, axis=1.0), TypeError,
     "axis"),
    (lambda: parallel.unzigzag(jnp.ones((1, 8)), 2, axis=2), ValueError,
     "axis"),
    (lambda: parallel.shard_batch({"x": np.ones((2, 8))},
                                  parallel.make_mesh(), load_balance="no"),
     TypeError, "load_balance must be a bool"),
])
def test_parallel_sizes_and_flags_are_checked(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_sharded_flash_attention_load_balance_is_a_flag():
  gen = np.random.default_rng(31)
  q = jnp.asarray(gen.standard_normal((1, 8, 2, 16)), jnp.float32)
  with pytest.raises(TypeError, match="load_balance must be a bool"):
    parallel.sharded_flash_attention(q, q, q, mesh=parallel.make_mesh(),
                                     load_balance="no")


@pytest.mark.parametrize("axis", [1, -2])
def test_zigzag_takes_numpy_sizes_and_round_trips(axis):
  order = parallel.zigzag_indices(np.int64(16), np.int32(2))
  assert np.issubdtype(order.dtype, np.integer)
  np.testing.assert_array_equal(order, parallel.zigzag_indices(16, 2))
  x = jnp.asarray(np.random.default_rng(32 + axis).standard_normal((2, 16, 3)),
                  jnp.float32)
  zz = parallel.zigzag(x, 2, axis=axis)
  np.testing.assert_array_equal(zz, np.asarray(x)[:, order])
  np.testing.assert_array_equal(parallel.unzigzag(zz, 2, axis=axis), x)
