"""Multi-device checks of `pallas_fa.parallel`, run in a fresh process.

The device count of the CPU platform is fixed when jax is first imported, so
`tests/test_parallel.py` runs this file as a subprocess:

  python tests/_parallel_worker.py sharded|ring|hlo [implementation ...]
      8 simulated CPU devices; prints one line per check, exits non-zero on
      the first mismatch.
  python tests/_parallel_worker.py user_shard_map
      the public calls inside a user's own shard_map (4 of the devices).
  python tests/_parallel_worker.py orders IMPLEMENTATION ORDER [ORDER ...]
      the same, over meshes "A", "B", "C" called in each ORDER ("ABA").
  python tests/_parallel_worker.py process PROCESS_ID PORT
      one of two processes (4 CPU devices each) joined on localhost:PORT by
      `jax.distributed.initialize`; ring attention over all 8 devices.
"""

import os
import sys

_MODE = sys.argv[1] if len(sys.argv) > 1 else ""
_DEVICES = 4 if _MODE == "process" else 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={_DEVICES}"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import collections  # noqa: E402
import functools  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

if _MODE == "process":
  # Before anything (conftest included) initialises the XLA backend.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=f"localhost:{sys.argv[3]}", num_processes=2,
      process_id=int(sys.argv[2]), initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attention_testing  # noqa: E402
import conftest  # noqa: E402

import pallas_fa  # noqa: E402
from pallas_fa import parallel  # noqa: E402

_TOL = 2e-5
_START = time.time()


def _inputs(seed, b, t, s, n, k, h, dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), dtype)
  kk = jax.random.normal(keys[1], (b, s, k, h), dtype)
  v = jax.random.normal(keys[2], (b, s, k, h), dtype)
  return q, kk, v


def _sinks(seed, n):
  """Sink logits [N] near a row's logsumexp, so they matter."""
  return 2.0 + 1.5 * jax.random.normal(jax.random.PRNGKey(seed), (n,))


def _segments(seed, b, length, num=3):
  rng = np.random.RandomState(seed)
  return jnp.asarray(np.sort(rng.randint(0, num, (b, length)), axis=1))


def _value_and_grads(fn, q, k, v, bias, static, traced):
  """{"out", "lse", "dq", "dk", "dv"[, "dbias"][, "dsinks"]} of a loss
  touching out and lse (sinks, if given, among the traced arguments)."""
  traced = dict(traced)
  sinks = traced.pop("sinks", None)
  names = ["dq", "dk", "dv"]
  argnums = [0, 1, 2]
  for i, name, x in ((3, "dbias", bias), (4, "dsinks", sinks)):
    if x is not None:
      names.append(name)
      argnums.append(i)

  def loss(q, k, v, bias, sinks, traced):
    if sinks is not None:
      traced = dict(traced, sinks=sinks)
    out, lse = fn(q, k, v, bias, return_residual=True, **static, **traced)
    finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
    value = jnp.sum(out * jnp.cos(out)) + 0.3 * jnp.sum(finite)
    return value, (out, lse)

  grad = jax.value_and_grad(loss, argnums=tuple(argnums), has_aux=True)
  (_, (out, lse)), grads = jax.jit(grad)(q, k, v, bias, sinks, traced)
  return dict(out=out, lse=lse, **dict(zip(names, grads, strict=True)))


def _compare(label, got, want):
  assert got.keys() == want.keys(), (label, got.keys(), want.keys())
  for name in got:
    g, w = got[name], want[name]
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(
        g, w, rtol=_TOL, atol=_TOL, err_msg=f"{label}: {name}")
  finite = [np.abs(np.nan_to_num(np.asarray(g, np.float32), neginf=0)).max()
            for g in got.values()]
  print(f"ok {label} (max |x| {max(finite):.2f}) t={time.time() - _START:.0f}s",
        flush=True)


def _implementations():
  names = sys.argv[2:] or ["chunked", "xla"]
  return [(n, conftest.block_sizes_for(n)) for n in names]


def _split(kwargs):
  """Static (hashable) keyword arguments vs array ones passed to jit."""
  arrays = ("segment_ids", "query_positions", "key_positions", "mask",
            "query_seq_lengths", "key_value_seq_lengths", "sinks")
  static = {a: x for a, x in kwargs.items() if a not in arrays}
  traced = {a: x for a, x in kwargs.items() if a in arrays}
  return static, traced


def _check_against_single(label, case, layouts, impl, block_sizes):
  q, k, v, bias, kwargs = case
  static, traced = _split(dict(kwargs, implementation=impl,
                               block_sizes=block_sizes))
  want = _value_and_grads(pallas_fa.flash_attention, q, k, v, bias, static,
                          traced)
  for name, mesh, axes in layouts:
    got = _value_and_grads(parallel.sharded_flash_attention, q, k, v, bias,
                           dict(static, mesh=mesh, **axes), traced)
    _compare(f"{impl} {label} {name}", got, want)


def sharded():
  """Batch/head sharding equals the single-device call."""
  b, t, n, kv, h = 4, 40, 8, 2, 16
  q, k, v = _inputs(0, b, t, t, n, kv, h)
  seg = _segments(1, b, t)
  case = (q, k, v, None, dict(
      is_causal=True, local_window_size=(6, 2), logits_soft_cap=5.0,
      segment_ids=pallas_fa.SegmentIds(seg, seg),
      key_value_seq_lengths=jnp.array([40, 17, 1, 33])))
  q, k, v, bias, kwargs = case
  with_sinks = (q, k, v, bias, dict(kwargs, sinks=_sinks(11, n)))
  for impl, block_sizes in _implementations():
    # K=2 heads split with their query groups over 2 devices.
    _check_against_single("causal+window+segments+lengths+softcap", case, [
        ("data4xheads2", parallel.make_mesh(data=4, heads=2),
         dict(batch_axes="data", head_axes="heads")),
    ], impl, block_sizes)
    # K=2 < 4 head shards (MQA-like): K/V replicated, sliced per device;
    # the sinks split with their query heads.
    _check_against_single("causal+window+segments+lengths+softcap+sinks",
                          with_sinks, [
        ("data2xheads4", parallel.make_mesh(data=2, heads=4),
         dict(batch_axes="data", head_axes="heads")),
    ], impl, block_sizes)
    _check_two_meshes(impl, block_sizes)
    _check_flex(impl, block_sizes, [
        ("data2xheads4", parallel.make_mesh(data=2, heads=4),
         dict(batch_axes="data", head_axes="heads")),
    ])
    # K=2 < 4 head shards: the key/value scales sliced per device too.
    _check_float8(impl, block_sizes, [
        ("data2xheads4", parallel.make_mesh(data=2, heads=4),
         dict(batch_axes="data", head_axes="heads")),
    ])


def _check_flex(impl, block_sizes, layouts, t=40):
  """Flex attention sharded over `layouts` [(name, mesh, axes)]: every
  shard's functions see global indices (ALiBi reads the head and both token
  indices, the document mask the batch row and both token indices), forward
  and every gradient, the ALiBi slopes' included (each shard's share
  summed); a global block mask supplies its mask_mod."""
  b, n, kv, h = 4, 8, 2, 16
  q, k, v = _inputs(21, b, t, t, n, kv, h)
  doc = _segments(22, b, t)
  slopes = pallas_fa.flex.alibi_slopes(n) * jnp.linspace(0.5, 1.5, n)
  block_mask = pallas_fa.create_block_mask(
      pallas_fa.flex.document, (doc,), batch=b, heads=None, q_len=t,
      kv_len=t)
  kwargs = dict(is_causal=True, implementation=impl, block_sizes=block_sizes,
                score_mod=pallas_fa.flex.alibi)

  def value_and_grads(fn, **mesh_kwargs):
    def loss(q, k, v, slopes):
      out, lse = fn(q, k, v, score_mod_args=(slopes,), block_mask=block_mask,
                    return_residual=True, **kwargs, **mesh_kwargs)
      finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
      return jnp.sum(out * jnp.cos(out)) + 0.3 * jnp.sum(finite), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(
        loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, slopes)
    return dict(out=out, lse=lse,
                **dict(zip(("dq", "dk", "dv", "dslopes"), grads)))

  want = value_and_grads(pallas_fa.flash_attention)
  for name, mesh, axes in layouts:
    got = value_and_grads(parallel.sharded_flash_attention, mesh=mesh,
                          **axes)
    _compare(f"{impl} flex alibi+document {name}", got, want)

def _check_float8(impl, block_sizes, layouts, t=40):
  """Float8 calls sharded over `layouts` [(name, mesh, axes)] equal the
  single-device call: e4m3 inputs with per-token scales (which travel
  with their rows: around the ring with their key/value shard), out, lse
  and the scales' gradients; and `quantize="head"` on float32 inputs
  (quantized before the split), whose gradients reach the float32 arrays
  straight through."""
  b, n, kv, h = 2, 4, 2, 16
  wide = _inputs(23, b, t, t, n, kv, h)
  pairs = [pallas_fa.quantize_fp8(x, "token") for x in wide]
  values = tuple(p[0] for p in pairs)
  scales = tuple(p[1] for p in pairs)
  kwargs = dict(is_causal=True, out_dtype=jnp.float32, implementation=impl,
                block_sizes=block_sizes, sinks=_sinks(24, n),
                key_value_seq_lengths=jnp.array([t, t - 7]))

  def value_and_grads(fn, **mesh_kwargs):
    def loss(args, quantize):
      if quantize:
        call = dict(quantize="head")
      else:
        call = dict(zip(("query_scale", "key_scale", "value_scale"), args))
        args = values
      out, lse = fn(*args, return_residual=True, **call, **kwargs,
                    **mesh_kwargs)
      finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
      return jnp.sum(out * jnp.cos(out)) + 0.3 * jnp.sum(finite), (out, lse)

    results = {}
    for quantize, args, names in (
        (False, scales, ("dquery_scale", "dkey_scale", "dvalue_scale")),
        (True, wide, ("dq", "dk", "dv"))):
      (_, (out, lse)), grads = jax.jit(
          jax.value_and_grad(loss, has_aux=True),
          static_argnums=1)(args, quantize)
      prefix = "quantize " if quantize else ""
      results.update({prefix + "out": out, prefix + "lse": lse},
                     **{prefix + k: g for k, g in zip(names, grads)})
    return results

  def relative(results):
    # A scale's gradient sums a row's H products of dv and v (dk and k):
    # compared against its largest entry, as its float32 sums round.
    return {k: x / (jnp.abs(want[k]).max() if "scale" in k else 1.0)
            for k, x in results.items()}

  want = value_and_grads(pallas_fa.flash_attention)
  for name, mesh, axes in layouts:
    got = value_and_grads(parallel.sharded_flash_attention, mesh=mesh,
                          **axes)
    _compare(f"{impl} float8 {name}", relative(got), relative(want))


def _check_two_meshes(impl, block_sizes):
  """One mesh, then one of another shape, then the first again, in one
  process, on the same inputs (laid out for the first mesh): each call runs
  on its own mesh, forward and backward (eager autodiff, no jit of ours
  around the call)."""
  b, t, n, kv, h = 2, 64, 4, 2, 16
  inputs = _inputs(11, b, t, t, n, kv, h)
  kwargs = dict(is_causal=True, key_value_seq_lengths=jnp.array([40, 64]),
                implementation=impl, block_sizes=block_sizes)

  def value_and_grads(fn, q, k, v):
    def loss(q, k, v):
      out, lse = fn(q, k, v, return_residual=True, **kwargs)
      finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
      return jnp.sum(out * jnp.cos(out)) + 0.3 * jnp.sum(finite), (out, lse)

    (_, (out, lse)), grads = jax.value_and_grad(
        loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv"), grads)))

  want = value_and_grads(pallas_fa.flash_attention, *inputs)
  devices = np.asarray(jax.devices())
  seq = jax.sharding.Mesh(devices.reshape(8), ("seq",))
  data_seq = jax.sharding.Mesh(devices.reshape(2, 4), ("data", "seq"))
  on_seq = jax.sharding.NamedSharding(
      seq, jax.sharding.PartitionSpec(None, "seq"))
  placed = [jax.device_put(x, on_seq) for x in inputs]
  for name, mesh, axes in (("seq8", seq, {}),
                           ("data2xseq4", data_seq, dict(batch_axes="data")),
                           ("seq8 again", seq, {})):
    fn = functools.partial(parallel.sharded_flash_attention, mesh=mesh,
                           sequence_axis="seq", load_balance=True, **axes)
    got = value_and_grads(fn, *placed)
    assert got["out"].sharding.mesh == mesh, (name, got["out"].sharding)
    _compare(f"{impl} two meshes: {name}", got, want)


# Meshes of different shapes over the same 8 devices, each with the axes a
# call splits over: a ring of 8; a ring of 4 times 2 batch shards; and the
# batch, heads and a ring of 2.
_MESHES = {
    "A": ((8,), ("seq",), dict(sequence_axis="seq")),
    "B": ((2, 4), ("data", "seq"), dict(batch_axes="data",
                                        sequence_axis="seq")),
    "C": ((2, 2, 2), ("data", "heads", "seq"),
          dict(batch_axes="data", head_axes="heads", sequence_axis="seq",
               load_balance=True)),
}


def orders(impl, *sequences):
  """Calls over meshes of different shapes, in each order given ("AB",
  "ABA", "CBA", ...), as a training script makes them: plain unplaced
  inputs, a forward call, then the gradient of sum(out * ct) with a fresh,
  uncommitted ct; and the same step under `jit`. Every order starts from
  empty JAX caches, as a process of its own would, so each order's first
  mesh is the one JAX's caches meet first. (Compiled programs are kept on
  disk across orders, which only saves compile time: what an executable
  returns is typed from its trace, not from that cache.)"""
  block_sizes = conftest.block_sizes_for(impl)
  b, t, n, kv, h = 2, 32, 4, 2, 8
  q, k, v = _inputs(31, b, t, t, n, kv, h)
  kwargs = dict(is_causal=True, key_value_seq_lengths=jnp.array([20, 32]),
                implementation=impl, block_sizes=block_sizes)

  @jax.jit
  def single(q, k, v, ct):
    out, pullback = jax.vjp(
        functools.partial(pallas_fa.flash_attention, **kwargs), q, k, v)
    return out, pullback(ct)

  def step(fn, ct):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v) * ct)  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  def jitted_step(fn, q, k, v, ct):
    loss = lambda q, k, v: (jnp.sum(fn(q, k, v) * ct),  # noqa: E731
                            fn(q, k, v))
    (_, out), grads = jax.value_and_grad(
        loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads

  devices = np.asarray(jax.devices())
  with tempfile.TemporaryDirectory() as cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    for o, sequence in enumerate(sequences):
      jax.clear_caches()
      for i, name in enumerate(sequence):
        shape, axis_names, axes = _MESHES[name]
        mesh = jax.sharding.Mesh(devices.reshape(shape), axis_names)
        fn = functools.partial(parallel.sharded_flash_attention, mesh=mesh,
                               **axes, **kwargs)
        key = jax.random.PRNGKey(10 * o + i)
        # A fresh ct for each gradient: a new, uncommitted array.
        eager = (fn(q, k, v),
                 step(fn, jax.random.normal(key, q.shape)))
        jitted = jax.jit(functools.partial(jitted_step, fn))(
            q, k, v, jax.random.normal(key, q.shape))
        want_out, want_grads = single(q, k, v, jax.random.normal(key, q.shape))
        want = dict(out=want_out, **dict(zip(("dq", "dk", "dv"), want_grads)))
        for label, (out, grads) in (("eager", eager), ("jit", jitted)):
          assert out.sharding.mesh == mesh, (sequence, name, out.sharding)
          _compare(f"{impl} meshes {' -> '.join(sequence)}: {name} {label}",
                   dict(out=out, **dict(zip(("dq", "dk", "dv"), grads))),
                   want)


def ring():
  """Ring attention equals the single-device call."""
  b, t, n, kv, h = 2, 64, 4, 2, 16
  q, k, v = _inputs(2, b, t, t, n, kv, h)
  seg = _segments(3, b, t)
  causal = (q, k, v, None, dict(
      is_causal=True, segment_ids=pallas_fa.SegmentIds(seg, seg)))
  causal_sinks = causal[:4] + (dict(causal[4], sinks=_sinks(12, n)),)
  # Cross attention with lengths that do not divide the ring (padded),
  # a dense bias and mask, a window and padding.
  qx, kx, vx = _inputs(5, b, 36, 52, n, kv, h)
  keys = jax.random.split(jax.random.PRNGKey(4), 2)
  bias = jax.random.normal(keys[0], (1, n, 36, 52))
  mask = jax.random.bernoulli(keys[1], 0.8, (b, 1, 36, 52))
  window = (qx, kx, vx, bias, dict(
      mask=mask, logits_soft_cap=4.0, local_window_size=(9, 3),
      query_seq_lengths=jnp.array([36, 21]),
      key_value_seq_lengths=jnp.array([30, 52]), sinks=_sinks(13, n)))
  for impl, block_sizes in _implementations():
    _check_against_single("causal+segments", causal, [
        # Contiguous shards: steps entirely in a shard's future are skipped.
        ("data2xring4", parallel.make_mesh(data=2, sequence=4),
         dict(batch_axes="data", sequence_axis="sequence")),
    ], impl, block_sizes)
    # Each row's sink joins once, after the ring's last step.
    _check_against_single("causal+segments+sinks", causal_sinks, [
        ("ring8-zigzag", parallel.make_mesh(sequence=8),
         dict(sequence_axis="sequence", load_balance=True)),
    ], impl, block_sizes)
    _check_against_single("cross+window+bias+mask+lengths+sinks", window, [
        # GQA: K=2 split over 2 head shards, times a ring of 4.
        ("heads2xring4", parallel.make_mesh(heads=2, sequence=4),
         dict(head_axes="heads", sequence_axis="sequence")),
    ], impl, block_sizes)
    if impl == "chunked":
      _check_low_precision(causal, impl, block_sizes)
    # Global token indices on every ring step: contiguous shards (T = 40)
    # and the zig-zag layout (T = 38, padded to the ring's multiple).
    _check_flex(impl, block_sizes, [
        ("data2xring4", parallel.make_mesh(data=2, sequence=4),
         dict(batch_axes="data", sequence_axis="sequence")),
    ], t=40)
    _check_flex(impl, block_sizes, [
        ("heads2xring4-zigzag", parallel.make_mesh(heads=2, sequence=4),
         dict(head_axes="heads", sequence_axis="sequence",
              load_balance=True)),
    ], t=38)
    # The scales padded and permuted with their rows, the key's and value's
    # around the ring with their shard.
    _check_float8(impl, block_sizes, [
        ("data2xring4", parallel.make_mesh(data=2, sequence=4),
         dict(batch_axes="data", sequence_axis="sequence")),
        ("heads2xring4-zigzag", parallel.make_mesh(heads=2, sequence=4),
         dict(head_axes="heads", sequence_axis="sequence",
              load_balance=True)),
    ], t=38)
  _check_ring_positions(causal)


def _check_ring_positions(case):
  """A ring's shards hold slices of the default positions, not their
  indices: no backend of a ring step is told they are
  (`MaskInfo.positions_are_indices`, which mosaic_gpu would act on)."""
  q, k, v, _, kwargs = case
  with attention_testing.positions_flags_seen() as seen:
    for load_balance in (False, True):
      attention = functools.partial(
          parallel.sharded_flash_attention, mesh=parallel.make_mesh(
              data=2, sequence=4), batch_axes="data",
          sequence_axis="sequence", load_balance=load_balance,
          implementation="chunked", **kwargs)

      def loss(*x, attention=attention):
        return attention(*x).sum()

      jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v)
  assert len(seen) >= 4 and not any(seen), seen
  print(f"ok ring positions are not indices ({len(seen)} passes)",
        flush=True)


def _check_low_precision(case, impl, block_sizes):
  """bfloat16 ring: the FlashAttention rule against the float32 call."""
  q, k, v, _, kwargs = case
  static, traced = _split(dict(kwargs, implementation=impl,
                               block_sizes=block_sizes))
  ring = dict(static, mesh=parallel.make_mesh(sequence=8),
              sequence_axis="sequence", load_balance=True)
  low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  want = _value_and_grads(pallas_fa.flash_attention, q, k, v, None, static,
                          traced)
  same = _value_and_grads(pallas_fa.flash_attention, *low, None, static,
                          traced)
  got = _value_and_grads(parallel.sharded_flash_attention, *low, None, ring,
                         traced)
  for name in got:
    g, s, w = got[name], same[name], want[name]
    w = np.nan_to_num(np.asarray(w, np.float32), neginf=0)
    err = lambda x, w=w: np.abs(
        np.nan_to_num(np.asarray(x, np.float32), neginf=0) - w).max()
    assert err(g) <= 2 * err(s) + 1e-5, (name, err(g), err(s))
  print(f"ok {impl} bfloat16 ring8-zigzag within 2x of the bfloat16 "
        f"single-device error", flush=True)


_COLLECTIVE = re.compile(
    r"= (\([^)]*\)|\S+) (all-gather|all-to-all|collective-permute|all-reduce|"
    r"reduce-scatter)(?:-start)?\(")


def _collectives(compiled_text):
  """Counts of each collective and the largest element count one returns."""
  counts, largest = collections.Counter(), 0
  for shapes, op in _COLLECTIVE.findall(compiled_text):
    counts[op] += 1
    for dims in re.findall(r"\[([\d,]*)\]", shapes):
      size = int(np.prod([int(d) for d in dims.split(",") if d]))
      largest = max(largest, size)
  return counts, largest


def hlo():
  """Ring attention moves K/V only by collective-permute; no all-gather."""
  b, t, n, kv, h = 2, 256, 4, 2, 16
  mesh = parallel.make_mesh(data=2, sequence=4)
  spec = jax.sharding.PartitionSpec("data", "sequence")
  sharding = jax.sharding.NamedSharding(mesh, spec)
  q, k, v = (jax.device_put(x, sharding)
             for x in _inputs(6, b, t, t, n, kv, h))
  # The model-level usage: tokens already in the zig-zag layout, true
  # positions passed along.
  pos = parallel.zigzag(jnp.broadcast_to(jnp.arange(t), (b, t)), 4)
  pos = jax.device_put(pos, sharding)
  seg = jax.device_put(_segments(7, b, t), sharding)
  for impl, block_sizes in _implementations():

    def loss(q, k, v, pos, seg, impl=impl, block_sizes=block_sizes):
      out = parallel.sharded_flash_attention(
          q, k, v, mesh=mesh, batch_axes="data", sequence_axis="sequence",
          is_causal=True, query_positions=pos, key_positions=pos,
          segment_ids=pallas_fa.SegmentIds(seg, seg),
          implementation=impl, block_sizes=block_sizes)
      return jnp.sum(out * out)

    for label, f in (("forward", loss),
                     ("gradient", jax.grad(loss, argnums=(0, 1, 2)))):
      text = jax.jit(f).lower(q, k, v, pos, seg).compile().as_text()
      ops, largest = _collectives(text)
      assert ops["all-gather"] == 0 and ops["all-to-all"] == 0, (label, ops)
      # No collective returns anything as large as the whole K: a ring step
      # moves one device's shard.
      assert largest < k.size, (label, largest, k.size)
      # K, V, key positions and segment ids travel (+ dK, dV backwards).
      want = 4 if label == "forward" else 10
      assert ops["collective-permute"] == want, (label, ops)
      print(f"ok {impl} hlo {label}: {dict(ops)}, largest {largest}",
            flush=True)

  # `ring_attention` inside the caller's own shard_map, contiguous shards;
  # then a mesh with explicit axes. Both are plumbing: "xla" compiles
  # fastest.
  impl, block_sizes = "xla", None
  q, k, v = _inputs(8, b, 64, 64, n, kv, h)
  kwargs = dict(is_causal=True, local_window_size=(20, 0),
                implementation=impl, block_sizes=block_sizes)
  ring = functools.partial(parallel.ring_attention, axis_name="sequence",
                           return_residual=True, **kwargs)
  qspec = jax.sharding.PartitionSpec("data", "sequence")
  lspec = jax.sharding.PartitionSpec("data", "sequence")
  f = jax.jit(parallel.shard_map(ring, mesh=mesh, in_specs=(qspec,) * 3,
                                 out_specs=(qspec, lspec)))
  got = f(q, k, v)
  want = jax.jit(functools.partial(pallas_fa.flash_attention,
                                   return_residual=True, **kwargs))(q, k, v)
  _compare(f"{impl} ring_attention in shard_map",
           dict(zip(("out", "lse"), got)), dict(zip(("out", "lse"), want)))
  # Sinks replicated into the caller's shard_map: each device's share of
  # dsinks is summed by the shard_map's transpose.
  sinks = _sinks(14, n)
  sharded = parallel.shard_map(
      lambda q, k, v, sinks: ring(q, k, v, sinks=sinks), mesh=mesh,
      in_specs=(qspec,) * 3 + (jax.sharding.PartitionSpec(),),
      out_specs=(qspec, lspec))
  single = lambda q, k, v, sinks: pallas_fa.flash_attention(  # noqa: E731
      q, k, v, sinks=sinks, return_residual=True, **kwargs)

  def sink_loss(fn, sinks):
    out, lse = fn(q, k, v, sinks)
    return jnp.sum(out * jnp.cos(out)) + 0.3 * jnp.sum(
        jnp.where(jnp.isfinite(lse), lse, 0.0)), out

  got = jax.jit(jax.grad(functools.partial(sink_loss, sharded),
                         has_aux=True))(sinks)
  want = jax.jit(jax.grad(functools.partial(sink_loss, single),
                          has_aux=True))(sinks)
  _compare(f"{impl} ring_attention in shard_map, sinks",
           dict(zip(("dsinks", "out"), got)),
           dict(zip(("dsinks", "out"), want)))
  # float8 shards with per-token scales, sharded like their rows: the
  # key's and value's travel with their shard.
  pairs = [pallas_fa.quantize_fp8(x, "token") for x in (q, k, v)]
  values, scales = [p[0] for p in pairs], [p[1] for p in pairs]
  names = ("query_scale", "key_scale", "value_scale")
  got = jax.jit(parallel.shard_map(
      lambda *x: ring(*x[:3], out_dtype=jnp.float32,
                      **dict(zip(names, x[3:]))),
      mesh=mesh, in_specs=(qspec,) * 6, out_specs=(qspec, lspec)))(
          *values, *scales)
  want = jax.jit(lambda *x: pallas_fa.flash_attention(
      *x[:3], out_dtype=jnp.float32, return_residual=True,
      **dict(zip(names, x[3:])), **kwargs))(*values, *scales)
  _compare(f"{impl} ring_attention in shard_map, float8",
           dict(zip(("out", "lse"), got)), dict(zip(("out", "lse"), want)))

  # A mesh with explicit axes (jax.make_mesh's default): inputs are laid
  # out as shard_map requires, padding and the zig-zag permutation run with
  # the sequence gathered.
  axis_type = getattr(jax.sharding, "AxisType", None)
  if axis_type is not None:
    explicit = jax.make_mesh((2, 4), ("data", "sequence"),
                             axis_types=(axis_type.Explicit,) * 2)
    case = (q[:, :60], k[:, :44], v[:, :44], None,
            dict(is_causal=True, local_window_size=(30, 0)))
    _check_against_single("explicit-mesh", case, [
        ("data2xring4-zigzag", explicit,
         dict(batch_axes="data", sequence_axis="sequence",
              load_balance=True)),
    ], impl, block_sizes)

  # Splits that cannot work are refused with a message naming the argument.
  q, k, v = _inputs(8, 3, 16, 16, 6, 3, 8)
  for axes, needle in (
      (dict(batch_axes="data"), "batch B=3"),
      (dict(head_axes="heads"), "query heads N=6"),
      (dict(sequence_axis="nope"), "'nope' is not in the mesh"),
      (dict(batch_axes="sequence", sequence_axis="sequence"), "used twice"),
  ):
    mesh = parallel.make_mesh(data=2, heads=4)
    if "sequence" in axes.values():
      mesh = parallel.make_mesh(sequence=8)
    try:
      parallel.sharded_flash_attention(q, k, v, mesh=mesh, **axes)
    except ValueError as e:
      assert needle in str(e), (needle, str(e))
    else:
      raise AssertionError(f"no ValueError for {axes}")
  print("ok validation", flush=True)

  # shard_batch: rows over "data", tokens over the ring in zig-zag order.
  mesh = parallel.make_mesh(data=2, sequence=4)
  tokens = np.arange(4 * 16).reshape(4, 16)
  placed = parallel.shard_batch({"tokens": tokens}, mesh)["tokens"]
  assert placed.sharding.spec == jax.sharding.PartitionSpec(
      "data", "sequence"), placed.sharding
  np.testing.assert_array_equal(placed, parallel.zigzag(tokens, 4))
  for shard in placed.addressable_shards:
    assert shard.data.shape == (2, 4), shard.data.shape
  params = parallel.replicate({"w": np.ones((3, 2), np.float32)}, mesh)
  assert params["w"].sharding.is_fully_replicated
  assert len(params["w"].sharding.device_set) == 8
  print("ok shard_batch, replicate", flush=True)


def process(process_id):
  """One of two processes running ring attention over 8 devices."""
  assert jax.process_index() == process_id
  assert jax.process_count() == 2 and len(jax.devices()) == 8, jax.devices()
  assert len(jax.local_devices()) == 4
  b, t, n, kv, h = 2, 64, 4, 2, 16
  # Every process draws the same global inputs (same seed).
  q, k, v = (np.asarray(x) for x in _inputs(9, b, t, t, n, kv, h))
  seg = np.asarray(_segments(10, b, t))
  pos = np.broadcast_to(np.arange(t), (b, t))
  # Ring over all 8 devices: half its hops cross the process boundary.
  mesh = parallel.make_mesh(sequence=8)
  # Each process keeps its devices' part, in the zig-zag layout.
  batch = parallel.shard_batch(dict(q=q, k=k, v=v, pos=pos, seg=seg), mesh)
  assert batch["q"].sharding.spec == jax.sharding.PartitionSpec(
      "data", "sequence"), batch["q"].sharding
  assert not batch["q"].is_fully_addressable
  scale = parallel.replicate(np.float32(0.5), mesh)
  assert scale.sharding.is_fully_replicated and not scale.is_fully_addressable

  impl = "chunked"
  block_sizes = conftest.block_sizes_for(impl)

  def loss(q, k, v, pos, seg, scale):
    q = q * (2 * scale)  # A replicated parameter (2 * 0.5 = 1).
    out = parallel.sharded_flash_attention(
        q, k, v, mesh=mesh, sequence_axis="sequence", is_causal=True,
        query_positions=pos, key_positions=pos,
        segment_ids=pallas_fa.SegmentIds(seg, seg),
        implementation=impl, block_sizes=block_sizes)
    return jnp.sum(out * jnp.cos(out)), out

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  args = [batch[name] for name in ("q", "k", "v", "pos", "seg")] + [scale]
  (_, out), grads = grad(*args)
  gather = jax.experimental.multihost_utils.process_allgather
  got = [gather(x, tiled=True) for x in (out,) + tuple(grads)]
  got = [np.asarray(parallel.unzigzag(x, 8)) for x in got]

  # The single-device call on this process's first device, natural order.
  local = jax.local_devices()[0]
  with jax.default_device(local):
    def single(q, k, v, seg):
      out = pallas_fa.flash_attention(
          q, k, v, is_causal=True, segment_ids=pallas_fa.SegmentIds(seg, seg),
          implementation=impl, block_sizes=block_sizes)
      return jnp.sum(out * jnp.cos(out)), out

    (_, out), grads = jax.jit(
        jax.value_and_grad(single, argnums=(0, 1, 2), has_aux=True))(
            q, k, v, seg)
  want = [out, *grads]
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want,
                        strict=True):
    np.testing.assert_allclose(g, np.asarray(w), rtol=_TOL, atol=_TOL,
                               err_msg=name)
  print(f"ok process {process_id}: ring over {len(jax.devices())} devices "
        f"in {jax.process_count()} processes", flush=True)
  jax.distributed.shutdown()


def user_shard_map():
  """The public calls inside a user's own `jax.shard_map` that checks
  varying axes (check_vma=True, its default), beside arguments it
  replicates (P(): a bias, sinks, a float8 call's scales), equal the
  single-device calls, gradients of the replicated arguments (summed over
  the devices) included; interpreted kernels decline by name."""
  from jax.sharding import Mesh  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
  b, t, n, kh, h = 4, 24, 4, 2, 16
  q, k, v = _inputs(11, b, t, t, n, kh, h)
  bias = 0.5 * jax.random.normal(jax.random.PRNGKey(12), (1, n, t, t))
  sinks = _sinks(13, n)
  segments = _segments(14, b, t)
  lengths = jnp.array([24, 17, 9, 24])

  def in_user_map(fn, sharded, replicated):
    """fn(*sharded, *replicated) inside the user's map, batch-sharded."""
    def call(*args):
      return jax.shard_map(
          fn, mesh=mesh, out_specs=P("d"),
          in_specs=(P("d"),) * len(sharded) + (P(),) * len(replicated),
      )(*args)
    return call

  for impl in ("chunked", "xla"):
    def attend(q, k, v, seg, lengths, bias, sinks, impl=impl):
      return pallas_fa.flash_attention(
          q, k, v, bias, is_causal=True, sinks=sinks,
          segment_ids=pallas_fa.SegmentIds(q=seg, kv=seg),
          key_value_seq_lengths=lengths, implementation=impl)

    def loss(fn, q, k, v, bias, sinks):
      out = fn(q, k, v, segments, lengths, bias, sinks)
      return jnp.sum(out * jnp.cos(out))

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5))
    user = in_user_map(attend, "qkvsl", "bs")
    got = jax.jit(functools.partial(grad, user))(q, k, v, bias, sinks)
    want = grad(attend, q, k, v, bias, sinks)
    names = ["loss", "dq", "dk", "dv", "dbias", "dsinks"]
    _compare(f"{impl} user shard_map",
             dict(zip(names, [got[0], *got[1]])),
             dict(zip(names, [want[0], *want[1]])))

    def quantized(q, k, v, impl=impl):
      return pallas_fa.flash_attention(
          q, k, v, quantize="head", out_dtype=jnp.float32,
          implementation=impl)

    grad = jax.grad(lambda fn, q, k, v: jnp.sum(jnp.sin(fn(q, k, v))),
                    argnums=(1, 2, 3))
    got = grad(in_user_map(quantized, "qkv", ""), q, k, v)
    want = grad(quantized, q, k, v)
    _compare(f"{impl} user shard_map float8",
             dict(zip(["dq", "dk", "dv"], got)),
             dict(zip(["dq", "dk", "dv"], want)))

  # Ring attention over the user's own axis (sequence-sharded).
  def ring_loss(q, k, v, sinks):
    out = pallas_fa.ring_attention(q, k, v, axis_name="d", is_causal=True,
                                   sinks=sinks, implementation="chunked")
    return jax.lax.psum(jnp.sum(out * jnp.cos(out)), "d")

  seq = P(None, "d")
  ring = jax.shard_map(ring_loss, mesh=mesh, in_specs=(seq,) * 3 + (P(),),
                       out_specs=P())
  got = jax.value_and_grad(ring, argnums=(0, 1, 2, 3))(q, k, v, sinks)

  def single(q, k, v, sinks):
    out = pallas_fa.flash_attention(q, k, v, is_causal=True, sinks=sinks,
                                    implementation="chunked")
    return jnp.sum(out * jnp.cos(out))

  want = jax.value_and_grad(single, argnums=(0, 1, 2, 3))(q, k, v, sinks)
  names = ["loss", "dq", "dk", "dv", "dsinks"]
  _compare("ring in a user shard_map", dict(zip(names, [got[0], *got[1]])),
           dict(zip(names, [want[0], *want[1]])))

  # Decode from an int8 cache, its rows sharded, sinks replicated.
  cache_k, k_scale = pallas_fa.kv_cache.quantize(k, jnp.int8)
  cache_v, v_scale = pallas_fa.kv_cache.quantize(v, jnp.int8)
  new = q[:, :2]

  def decode(q, ck, cv, ks, vs, lengths, sinks):
    return pallas_fa.decode_attention(
        q, ck, cv, lengths, key_scale=ks, value_scale=vs, sinks=sinks)

  got = in_user_map(decode, "qkvabl", "s")(
      new, cache_k, cache_v, k_scale, v_scale, lengths, sinks)
  want = decode(new, cache_k, cache_v, k_scale, v_scale, lengths, sinks)
  _compare("decode in a user shard_map", {"out": got}, {"out": want})

  # Dropout: the masks hash the call's indices, which are the shard's own
  # local ones, so each device folds its index along the axes the call
  # varies along into the seed. Four equal batch rows, one a device: four
  # different masks (so four different rows out), as in the unsharded
  # call; replicated over the devices, the unsharded call's masks.
  same = tuple(jnp.broadcast_to(x[:1], x.shape) for x in (q, k, v))
  key = jax.random.PRNGKey(15)

  def dropped(q, k, v):
    return pallas_fa.flash_attention(q, k, v, dropout_rate=0.5,
                                     dropout_rng=key, implementation="chunked")

  rows = np.asarray(in_user_map(dropped, "qkv", "")(*same))
  distinct = {rows[i].tobytes() for i in range(b)}
  assert len(distinct) == b, "devices drew the same dropout masks"
  replicated = jax.shard_map(dropped, mesh=mesh, in_specs=(P(),) * 3,
                             out_specs=P())(q, k, v)
  _compare("dropout in a user shard_map", {"out": replicated},
           {"out": dropped(q, k, v)})

  # Interpreted kernels cannot run there: a NotImplementedError that says
  # what to do, not an error from JAX's interpreter.
  # With q, k and v replicated, sinks alone may vary.
  calls = {
      "flash_attention": lambda q, k, v, sinks: pallas_fa.flash_attention(
          q, k, v, sinks=sinks, implementation="triton"),
      "decode_attention": lambda q, k, v, sinks: pallas_fa.decode_attention(
          q[:, :1], k, v, jnp.full((1,), t), sinks=sinks,
          implementation="triton"),
  }
  for name, fn in calls.items():
    try:
      jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * 3 + (P("d"),),
                    out_specs=P("d"))(q[:1], k[:1], v[:1],
                                      jnp.tile(sinks[:1], 4))
    except NotImplementedError as e:
      assert "check_vma=False" in str(e), str(e)
    else:
      raise AssertionError(f"interpreted triton ran {name} in a user map")
    print(f"ok interpreted triton declines {name} in a user shard_map",
          flush=True)


def explicit_mesh():
  """flash_attention and decode_attention on arrays typed with Explicit
  mesh axes (`jax.make_mesh`'s default), inside `jax.set_mesh`: batch and
  heads sharded, with a sharded bias, segments and lengths, equal the
  unsharded calls (values and gradients), on chunked, xla and the
  automatic choice; the result keeps the query's sharding. decode_attention
  on a float cache and on an int8 one with a shared prefix."""
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  mesh = jax.make_mesh((2, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  b, t, n, kh, h = 4, 40, 4, 2, 16
  q, k, v = _inputs(21, b, t, t, n, kh, h)
  bias = 0.5 * jax.random.normal(jax.random.PRNGKey(22), (b, n, t, t))
  traced = dict(segment_ids=pallas_fa.SegmentIds(
      q=_segments(23, b, t), kv=_segments(23, b, t)),
      key_value_seq_lengths=jnp.array([40, 31, 17, 40]))

  def place(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))

  tokens = P("data", None, "model", None)
  placed = (place(q, tokens), place(k, tokens), place(v, tokens),
            place(bias, P("data", "model", None, None)))
  placed_traced = dict(
      segment_ids=pallas_fa.SegmentIds(
          q=place(traced["segment_ids"].q, P("data", None)),
          kv=place(traced["segment_ids"].kv, P("data", None))),
      key_value_seq_lengths=place(traced["key_value_seq_lengths"],
                                  P("data")))
  for impl, block_sizes in [("chunked", conftest.block_sizes_for("chunked")),
                            ("xla", None), (None, None)]:
    static = dict(implementation=impl, block_sizes=block_sizes,
                  is_causal=True)
    want = _value_and_grads(pallas_fa.flash_attention, q, k, v, bias, static,
                            traced)
    with jax.set_mesh(mesh):
      got = _value_and_grads(pallas_fa.flash_attention, *placed, static,
                             placed_traced)
    assert got["out"].sharding.spec == tokens, got["out"].sharding
    _compare(f"{impl} on explicit mesh axes", got, want)

  # decode_attention too, over a float cache and an int8 one with a shared
  # prefix (the prefix pass and the merge), keeping the query's sharding.
  lengths = jnp.array([40, 31, 17, 40])
  (kq, ks), (vq, vs) = (pallas_fa.kv_cache.quantize(x) for x in (k, v))
  prefix = dict(prefix_key=k[0, :8], prefix_value=v[0, :8])
  for name, cache, extra in [
      ("float", (k, v), {}),
      ("int8 with a prefix", (kq, vq), dict(key_scale=ks, value_scale=vs))]:
    if extra:
      extra = dict(extra, **prefix)

    def decode(q, k, v, lengths, extra):
      return pallas_fa.decode_attention(q, k, v, lengths,
                                        implementation="chunked", **extra)

    want = decode(q[:, :1], *cache, lengths, extra)
    data = {key: place(x, P("data", None, "model")
                       if x.ndim == 3 and key.endswith("scale")
                       else P(*(None,) * x.ndim))
            for key, x in extra.items()}
    args = (place(q[:, :1], tokens),
            *(place(x, tokens) for x in cache), place(lengths, P("data")))
    with jax.set_mesh(mesh):
      got = jax.jit(decode)(*args, data)
    assert got.sharding.spec == tokens, got.sharding
    _compare(f"decode on explicit mesh axes, {name} cache", {"out": got},
             {"out": want})


def entry_points():
  """sharded_flash_attention and ring_attention take what flash_attention
  takes: a traced (learned) scale, values and gradients equal to the
  single-device call's; ring_attention(quantize=...) called eagerly in a
  user's shard_map; a second derivative through a ring is refused by
  name."""
  from jax.sharding import Mesh  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  q, k, v = _inputs(31, 2, 32, 32, 4, 2, 8)
  mesh = parallel.make_mesh(sequence=4, devices=jax.devices()[:4])
  ring_mesh = Mesh(np.array(jax.devices()[:4]), ("s",))
  seq = P(None, "s")

  def in_ring(**kwargs):
    return jax.shard_map(
        lambda q, k, v, scale: parallel.ring_attention(
            q, k, v, axis_name="s", is_causal=True, scale=scale, **kwargs),
        mesh=ring_mesh, in_specs=(seq,) * 3 + (P(),), out_specs=seq)

  calls = {
      "flash_attention": lambda q, k, v, scale: pallas_fa.flash_attention(
          q, k, v, scale=scale, is_causal=True, implementation="chunked"),
      "sharded_flash_attention": (
          lambda q, k, v, scale: parallel.sharded_flash_attention(
              q, k, v, scale=scale, mesh=mesh, sequence_axis="sequence",
              is_causal=True, implementation="chunked")),
      "ring_attention": in_ring(implementation="chunked"),
  }
  grads = {
      name: jax.jit(jax.value_and_grad(
          lambda q, scale, f=f: jnp.sum(jnp.sin(f(q, k, v, scale))),
          argnums=(0, 1)))(q, jnp.float32(0.3))
      for name, f in calls.items()}
  want = grads.pop("flash_attention")
  for name, got in grads.items():
    _compare(f"{name} with a traced scale",
             {"loss": got[0], "dq": got[1][0], "dscale": got[1][1]},
             {"loss": want[0], "dq": want[1][0], "dscale": want[1][1]})

  quantized = dict(quantize="head", out_dtype=jnp.float32,
                   implementation="chunked")
  # Each device quantizes its own shards: the jitted call is the reference.
  got = in_ring(**quantized)(q, k, v, 0.5)  # Eager, not under jit.
  want = jax.jit(in_ring(**quantized))(q, k, v, 0.5)
  _compare("eager ring_attention(quantize=...)", {"out": got}, {"out": want})

  def loss(q):
    return jnp.sum(jnp.sin(calls["sharded_flash_attention"](q, k, v, 0.3)))

  try:
    jax.jvp(jax.grad(loss), (q,), (q,))
  except NotImplementedError as e:
    assert "Ring attention merges" in str(e), str(e)
  else:
    raise AssertionError("a second derivative went through a ring")


if __name__ == "__main__":
  jax.config.update("jax_default_matmul_precision", "highest")
  if _MODE == "process":
    import jax.experimental.multihost_utils  # noqa: E402, F401

    process(int(sys.argv[2]))
  elif _MODE == "orders":
    orders(*sys.argv[2:])
  else:
    {"sharded": sharded, "ring": ring, "hlo": hlo,
     "user_shard_map": user_shard_map,
     "explicit_mesh": explicit_mesh, "entry_points": entry_points}[_MODE]()
