"""`sharded_flash_attention`: global arrays in, the split planned here.

Each device runs the chosen implementation inside `shard_map` on its own
batch rows, heads and (over a sequence axis) query shard, the key/value
shards travelling around the ring (`ring.ring_local`). The plan (`_Plan`)
says which mesh axis splits which dimension; the layouts and the zig-zag
order are in `pallas_fa.parallel.mesh`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_fa import api
from pallas_fa import masking
from pallas_fa import quantize as quantize_lib
from pallas_fa import vjp
from pallas_fa.parallel import mesh as mesh_lib
from pallas_fa.parallel import ring as ring_lib
from pallas_fa.parallel.mesh import AxisNames
from pallas_fa.parallel.mesh import spec_entry

Array = Any
_P = jax.sharding.PartitionSpec

# --------------------------------------------------------------------------
# Global-array entry point.


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Plan:
  """Static description of one sharded call, built at trace time."""

  mesh: jax.sharding.Mesh
  batch: tuple[str, ...]
  heads: tuple[str, ...]
  sequence: str | None
  ring_size: int
  # How many query heads share one K/V head (GQA group size), and whether
  # K/V are replicated over the head axes (fewer K/V heads than shards).
  group: int
  kv_replicated: bool
  zigzag: bool
  implementation: str | None
  params: vjp.Params

  def q_spec(self):  # [B, T, N, H]
    return _P(spec_entry(self.batch), self.sequence, spec_entry(self.heads),
              None)

  def kv_spec(self):  # [B, S, K, H]
    heads = None if self.kv_replicated else spec_entry(self.heads)
    return _P(spec_entry(self.batch), self.sequence, heads, None)

  def rows_spec(self):  # [B, T] positions / segment ids; [B, T, N] lse
    return _P(spec_entry(self.batch), self.sequence)

  def lse_spec(self):  # [B, T, N]: lse, a float8 query's scales
    return _P(spec_entry(self.batch), self.sequence, spec_entry(self.heads))

  def kv_rows_spec(self):  # [B, S, K]: a float8 key's or value's scales
    return _P(*self.kv_spec()[:3])

  def dense_spec(self, x):  # [B|1, N|1, T|1, S|1]; S is never split
    if x is None:
      return None
    return _P(
        spec_entry(self.batch) if x.shape[0] > 1 else None,
        spec_entry(self.heads) if x.shape[1] > 1 else None,
        self.sequence if x.shape[2] > 1 else None,
        None,
    )

  def info_spec(self, info):
    seg = None if info.q_segment_ids is None else self.rows_spec()
    # Flex arrays are read whole by every shard (`_GlobalIndices`).
    return info.replace(
        q_positions=self.rows_spec(),
        kv_positions=self.rows_spec(),
        q_segment_ids=seg,
        kv_segment_ids=seg,
        mask=self.dense_spec(info.mask),
        score_mod_args=tuple(_P() for _ in info.score_mod_args),
        mask_mod_args=tuple(_P() for _ in info.mask_mod_args),
        # The spec tree's static fields are the info's.
        positions_are_indices=info.positions_are_indices,
    )


def _make_plan(mesh, batch_axes, head_axes, sequence_axis, zigzag_layout,
               q_shape, k_shape, implementation, params):
  batch, heads = mesh_lib.axis_names(batch_axes), mesh_lib.axis_names(head_axes)
  seq = () if sequence_axis is None else (sequence_axis,)
  used = batch + heads + seq
  for a in used:
    if a not in mesh.shape:
      raise ValueError(
          f"mesh axis {a!r} is not in the mesh (axes "
          f"{tuple(mesh.axis_names)}); got {batch_axes=}, {head_axes=}, "
          f"{sequence_axis=}."
      )
  if len(set(used)) != len(used):
    raise ValueError(
        f"a mesh axis is used twice: {batch_axes=}, {head_axes=}, "
        f"{sequence_axis=}."
    )
  b, t, n, _ = q_shape
  s, num_kv = k_shape[1], k_shape[2]
  nb = mesh_lib.mesh_size(mesh, batch)
  if b % nb:
    raise ValueError(
        f"batch B={b} must be a multiple of the {nb} devices on "
        f"{batch_axes=} (query shape {tuple(q_shape)})."
    )
  nh = mesh_lib.mesh_size(mesh, heads)
  kv_replicated = False
  if n % nh:
    raise ValueError(
        f"query heads N={n} must be a multiple of the {nh} devices on "
        f"{head_axes=}."
    )
  if num_kv % nh:
    if nh % num_kv:
      raise ValueError(
          f"key/value heads K={num_kv} must divide or be a multiple of the "
          f"{nh} devices on {head_axes=} (GQA groups cannot be split)."
      )
    kv_replicated = True
  ring = 1 if sequence_axis is None else mesh.shape[sequence_axis]
  if zigzag_layout and sequence_axis is None:
    raise ValueError("load_balance=True needs a sequence_axis.")
  del t, s  # Sequence lengths are padded to the ring's multiple.
  return _Plan(
      mesh=mesh, batch=batch, heads=heads,
      sequence=sequence_axis if ring > 1 else None, ring_size=ring,
      group=n // num_kv, kv_replicated=kv_replicated,
      zigzag=bool(zigzag_layout) and ring > 1,
      implementation=implementation, params=params,
  )


def _permute_axis(x, axis, num_shards):
  if x is None or x.shape[axis] == 1:
    return x
  return mesh_lib.zigzag(x, num_shards, axis)


@dataclasses.dataclass(frozen=True)
class _GlobalIndices:
  """A score_mod / mask_mod as a shard calls it: the shard's local batch
  row and head arrive offset to the global ones, the offsets being the
  function's last two arguments (so they are traced data, not closures).
  Frozen and compared by value, so equal shards' calls share one trace."""

  fn: Any
  score: bool  # Whether fn takes a score first (a score_mod).

  def __call__(self, *xs):
    lead = int(self.score)
    *args, batch0, head0 = xs[lead + 4:]
    score = xs[:lead]
    batch, head, q_idx, kv_idx = xs[lead:lead + 4]
    return self.fn(*score, batch + batch0, head + head0, q_idx, kv_idx,
                   *args)


def _axis_offset(axes, local: int):
  """The first global index of this shard along dims split over `axes`."""
  if not axes:
    return jnp.zeros((), jnp.int32)
  index = jax.lax.axis_index(axes if len(axes) > 1 else axes[0])
  return (index * local).astype(jnp.int32)


def _with_global_indices(plan, info, q):
  """The shard's `info` with its flex functions seeing global indices."""
  offsets = (_axis_offset(plan.batch, q.shape[0]),
             _axis_offset(plan.heads, q.shape[2]))
  changes = {}
  if info.score_mod is not None:
    changes.update(score_mod=_GlobalIndices(info.score_mod, True),
                   score_mod_args=info.score_mod_args + offsets)
  if info.mask_mod is not None:
    changes.update(mask_mod=_GlobalIndices(info.mask_mod, False),
                   mask_mod_args=info.mask_mod_args + offsets)
  return info.replace(**changes)


def _select_kv_heads(plan, q, *kv):
  """K/V replicated over the head axes: keep the one head these queries
  use, of each [B, S, K, ...] array in `kv` (None stays None)."""
  n_local = q.shape[2]
  me = jax.lax.axis_index(plan.heads if len(plan.heads) > 1
                          else plan.heads[0])
  kv_head = (me * n_local) // plan.group
  pick = lambda x: jax.lax.dynamic_slice_in_dim(x, kv_head, 1, 2)
  return tuple(None if x is None else pick(x) for x in kv)


def _is_explicit(mesh) -> bool:
  axis_type = getattr(jax.sharding, "AxisType", None)
  types = getattr(mesh, "axis_types", ())
  return axis_type is not None and any(a == axis_type.Explicit for a in types)


def _reshard(plan, tree, specs):
  """On meshes with explicit axes, lays `tree` out as `specs` demand.

  shard_map requires explicitly sharded inputs to match in_specs, and
  padding / permuting a sequence split over an explicit axis is refused, so
  those steps run with the sequence gathered. Automatic (GSPMD) axes need
  none of this: XLA inserts whatever layout change is needed.
  """
  if not _is_explicit(plan.mesh):
    return tree
  shardings = jax.tree.map(
      lambda spec: jax.sharding.NamedSharding(plan.mesh, spec), specs,
      is_leaf=lambda x: isinstance(x, _P),
  )
  return jax.sharding.reshard(tree, shardings)


def _sequence_layout(plan, q, k, v, bias, info, float8=None):
  """Pads T and S to equal shards and permutes into the zig-zag layout;
  `float8`: a float8 call's (scales, straight_through) (`_Float8`), or
  None, laid out with the rows they belong to."""
  t, s = q.shape[1], k.shape[1]
  # Shards must be equal: pad the tails as padding (folded into segment ids,
  # so they are masked like user padding and cost no extra logic).
  multiple = plan.ring_size * (2 if plan.zigzag else 1)
  tp, sp = -(-t // multiple) * multiple, -(-s // multiple) * multiple
  if (tp, sp) != (t, s):
    info = masking.pad_sequence(info, tp, sp)
    q = masking.pad_axes(q, {1: tp})
    k, v = masking.pad_axes(k, {1: sp}), masking.pad_axes(v, {1: sp})
    bias = masking.pad_axes(bias, {2: tp, 3: sp}, broadcast=True)
    if float8 is not None:
      float8 = float8.map(lambda x: masking.pad_axes(x, {1: tp}),
                          lambda x: masking.pad_axes(x, {1: sp}), axis=1)
  if plan.zigzag:
    r = plan.ring_size
    q, k, v = (_permute_axis(x, 1, r) for x in (q, k, v))
    if float8 is not None:
      permute = lambda x: _permute_axis(x, 1, r)  # noqa: E731
      float8 = float8.map(permute, permute, axis=1)
    bias = _permute_axis(_permute_axis(bias, 2, r), 3, r)
    info = info.replace(
        q_positions=_permute_axis(info.q_positions, 1, r),
        kv_positions=_permute_axis(info.kv_positions, 1, r),
        q_segment_ids=_permute_axis(info.q_segment_ids, 1, r),
        kv_segment_ids=_permute_axis(info.kv_segment_ids, 1, r),
        mask=_permute_axis(_permute_axis(info.mask, 2, r), 3, r),
    )
  return q, k, v, bias, info, float8


class _Float8(NamedTuple):
  """A float8 call's arrays beside q, k and v: the scales, float32
  [B|1, T|1, N|1], [B|1, S|1, K|1] twice (a broadcast dim stays 1, so
  that per-head or per-tensor scales reach each shard as such, with the
  kernels' paths for them), and the high-precision q, k, v of
  `quantize=` or None (`vjp.attention`)."""

  scales: tuple[Array, Array, Array]
  straight_through: tuple[Array, Array, Array] | None

  @classmethod
  def of(cls, scales, straight_through):
    if scales is None:
      return None
    return cls(tuple(x.astype(jnp.float32) for x in scales),
               straight_through)

  def map(self, on_queries, on_keys, axis: int):
    """`on_queries` applied to the query's arrays, `on_keys` to the
    others', each where it spans `axis` (not a broadcast dim)."""
    fns = (on_queries, on_keys, on_keys)
    apply = lambda f, x: f(x) if x.shape[axis] > 1 else x  # noqa: E731
    straight = self.straight_through
    return _Float8(
        tuple(apply(f, x) for f, x in zip(fns, self.scales)),
        None if straight is None else tuple(
            apply(f, x) for f, x in zip(fns, straight)))

  def specs(self, plan):
    straight = None
    if self.straight_through is not None:
      straight = (plan.q_spec(), plan.kv_spec(), plan.kv_spec())
    rows = (plan.lse_spec(), plan.kv_rows_spec(), plan.kv_rows_spec())
    return _Float8(
        tuple(_P(*(None if d == 1 else entry
                   for entry, d in zip(spec, x.shape)))
              for spec, x in zip(rows, self.scales)),
        straight)


def _specs(plan, bias, info, float8=None):
  return (plan.q_spec(), plan.kv_spec(), plan.kv_spec(),
          plan.dense_spec(bias), plan.info_spec(info),
          None if float8 is None else float8.specs(plan))


def _sharded(plan: _Plan, q, k, v, bias, info, sinks, scales=None,
             straight_through=None):
  t, s = q.shape[1], k.shape[1]
  ring = plan.sequence is not None
  float8 = _Float8.of(scales, straight_through)
  if info.has_flex:
    # Each shard classifies its own tiles (its rows, heads and tokens) from
    # the mask_mod; a global block mask does not describe them.
    info = info.replace(block_mask=None)
  relayout = ring and (plan.zigzag or t % plan.ring_size
                       or s % plan.ring_size)
  gathered = dataclasses.replace(plan, sequence=None)
  if relayout:
    args = _reshard(plan, (q, k, v, bias, info, float8),
                    _specs(gathered, bias, info, float8))
    q, k, v, bias, info, float8 = _sequence_layout(plan, *args)

  def body(q, k, v, bias, info, float8, sinks):
    if plan.kv_replicated:
      k, v = _select_kv_heads(plan, q, k, v)
      if float8 is not None:
        float8 = float8.map(lambda x: x,
                            lambda x: _select_kv_heads(plan, q, x)[0],
                            axis=2)
    if info.has_flex:
      info = _with_global_indices(plan, info, q)
    scales, straight = (None, None) if float8 is None else float8
    if not ring:
      backend = api.choose_backend(plan.implementation, api.Call(
          q=q, k=k, v=v, bias=bias, info=info, params=plan.params,
          batch_shape=q.shape[:1]))
      return vjp.attention(backend, plan.params, q, k, v, bias, info, sinks,
                           scales=scales, straight_through=straight)
    return ring_lib.ring_local(
        plan.implementation, plan.params, plan.sequence, q, k, v, bias, info,
        sinks, zigzag=plan.zigzag, scales=scales, straight_through=straight)

  # The sinks [N] go with their query heads; replicated over the batch and
  # ring axes, whose shares of dsinks shard_map's transpose sums.
  in_specs = _specs(plan, bias, info, float8) + (
      None if sinks is None else _P(spec_entry(plan.heads)),)
  out_specs = (plan.q_spec(), plan.lse_spec())
  args = _reshard(plan, (q, k, v, bias, info, float8, sinks), in_specs)
  out, lse = mesh_lib.shard_map(
      body, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs)(*args)
  if relayout:
    out, lse = _reshard(plan, (out, lse),
                        (gathered.q_spec(), gathered.lse_spec()))
    if plan.zigzag:
      out = mesh_lib.unzigzag(out, plan.ring_size, 1)
      lse = mesh_lib.unzigzag(lse, plan.ring_size, 1)
    out, lse = out[:, :t], lse[:, :t]
  return out, lse


def sharded_flash_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    *,
    mesh: jax.sharding.Mesh,
    batch_axes: AxisNames = None,
    head_axes: AxisNames = None,
    sequence_axis: str | None = None,
    load_balance: bool = False,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    local_window_size: int | Sequence[int | None] | None = None,
    segment_ids: masking.SegmentIds | None = None,
    query_positions: Array | None = None,
    key_positions: Array | None = None,
    logits_soft_cap: float | None = None,
    sinks: Array | None = None,
    implementation: str | None = None,
    block_sizes: Any = None,
    precision: str | jax.lax.Precision | None = None,
    deterministic_backward: bool | None = None,
    return_residual: bool = False,
    score_mod: Any = None,
    score_mod_args: Sequence[Array] = (),
    mask_mod: Any = None,
    mask_mod_args: Sequence[Array] = (),
    block_mask: Any = None,
    query_scale: Array | None = None,
    key_scale: Array | None = None,
    value_scale: Array | None = None,
    quantize: str | None = None,
    out_dtype: Any = None,
):
  """`pallas_fa.flash_attention` on global arrays sharded over `mesh`.

  Takes the arguments of `pallas_fa.flash_attention` (same meaning, same
  result), but for attention dropout, plus where the work is split. Works
  under `jit`, `grad` and `vmap`-free training loops, with any registered
  implementation, including Pallas kernels that XLA cannot partition
  itself: each device runs the implementation on its shard inside
  `shard_map`.

  * batch_axes / head_axes: B (and N, K) are split over these mesh axes.
    K/V heads are split along with their query groups; with fewer K/V heads
    than head shards (MQA) K/V are replicated over the head axes.
  * sequence_axis: ring attention over this axis (context parallelism): T
    and S are split into equal shards (tails padded internally), queries stay
    put and K/V travel around the ring. For causal attention pass
    `load_balance=True`, or better, keep the whole model in the zig-zag
    layout (`pallas_fa.parallel.mesh.zigzag`) and pass the true
    `query_positions`/`key_positions`.

  Args:
    query: [*B, T, N, H] (any number of batch dims, including none; they
      are folded into one, which `batch_axes` split).
    key: [*B, S, K, H].
    value: [*B, S, K, H].
    bias: see `pallas_fa.flash_attention`.
    mask: see `pallas_fa.flash_attention`.
    mesh: the device mesh. Each call runs on its own mesh: inputs laid
      out on another mesh (an earlier call's, say) are moved onto this one
      first (`pallas_fa.parallel.mesh.onto_mesh`), and so are the cotangents its
      backward receives (`pallas_fa.parallel.mesh.fresh_cotangents`). Within one
      `jit` of yours, calls over meshes of different shapes need that jit's
      `out_shardings`: JAX gives a jit's results the mesh of one of them.
    batch_axes: mesh axis name(s) splitting B, or None.
    head_axes: mesh axis name(s) splitting the heads, or None.
    sequence_axis: mesh axis name of the ring, or None.
    load_balance: permute the sequence into the zig-zag layout on the way
      in and back on the way out, so causal ring steps are balanced (this
      costs two all-to-alls per call; a model can instead permute its tokens
      once with `parallel.zigzag`).
    scale: see `pallas_fa.flash_attention`.
    is_causal: see `pallas_fa.flash_attention`.
    query_seq_lengths: see `pallas_fa.flash_attention`.
    key_value_seq_lengths: see `pallas_fa.flash_attention`.
    local_window_size: see `pallas_fa.flash_attention`.
    segment_ids: see `pallas_fa.flash_attention`.
    query_positions: see `pallas_fa.flash_attention`.
    key_positions: see `pallas_fa.flash_attention`.
    logits_soft_cap: see `pallas_fa.flash_attention`.
    sinks: see `pallas_fa.flash_attention`; split with the query heads,
      added once per row (after the ring's last step).
    implementation: see `pallas_fa.flash_attention`.
    block_sizes: see `pallas_fa.flash_attention`.
    precision: see `pallas_fa.flash_attention`.
    deterministic_backward: see `pallas_fa.flash_attention`; each
      device's backward (ring steps included).
    return_residual: also return the logsumexp [B, T, N].
    score_mod, score_mod_args, mask_mod, mask_mod_args, block_mask: flex
      attention, see `pallas_fa.flash_attention`. Every shard reads the
      arrays whole and its functions see global batch, head and token
      indices (ring steps and the zig-zag layout included); each shard
      classifies its own tiles (a block_mask supplies its mask_mod).
    query_scale, key_scale, value_scale, quantize, out_dtype: a float8
      call, see `pallas_fa.flash_attention`. The scales are split with
      their rows and heads (a broadcast dim stays broadcast), the key's
      and value's per-token ones around the ring with their shard.
      `quantize` quantizes the global arrays, before they are split.

  Returns:
    out shaped and typed like query (a float8 call: `out_dtype`), sharded
    like it, or (out, lse).

  Raises:
    ValueError / TypeError: invalid arguments or a split that does not
      divide B, N or the K/V head groups (the message names them).
    NotImplementedError: the named implementation cannot honour this call.
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(
        f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
  if sequence_axis is not None and not isinstance(sequence_axis, str):
    raise TypeError(
        f"sequence_axis must be one mesh axis name, got {sequence_axis=}.")
  api.check_implementation(implementation, block_sizes)
  api.check_flag("return_residual", return_residual)
  if quantize is not None:  # A static argument: checked before it keys.
    quantize_lib.check_granularity("quantize", quantize)
  query, query_scale, scale = api.fold_traced_scale(query, query_scale, scale)
  static = api.static_arguments(
      scale=scale, is_causal=is_causal, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, precision=precision,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths)
  static.update(
      mesh=mesh,
      batch_axes=mesh_lib.axis_names(batch_axes),
      head_axes=mesh_lib.axis_names(head_axes),
      sequence_axis=sequence_axis,
      load_balance=api.check_flag("load_balance", load_balance),
      implementation=implementation,
      block_sizes=block_sizes,
      # Resolved now (None reads XLA_FLAGS), so it keys the trace cache.
      deterministic_backward=api.check_deterministic_backward(
          deterministic_backward),
      quantize=quantize,
      out_dtype=api.check_out_dtype(out_dtype),
  )
  # Inputs laid out on another mesh (an earlier call's, say) move onto this
  # one: jit would otherwise give the results their mesh (`onto_mesh`).
  static.update(score_mod=score_mod, mask_mod=mask_mod)
  args = mesh_lib.onto_mesh(
      (query, key, value, bias, mask, query_seq_lengths,
       key_value_seq_lengths, segment_ids, query_positions, key_positions,
       sinks, tuple(score_mod_args), tuple(mask_mod_args), block_mask,
       query_scale, key_scale, value_scale),
      mesh)
  out, lse = _sharded_flash_attention(*args, **static)
  # Eager gradients may bring cotangents typed for another mesh (an
  # earlier call's); they are laid out on this call's before its backward.
  return mesh_lib.fresh_cotangents((out, lse) if return_residual else out)


@functools.partial(
    jax.jit,
    static_argnames=("mesh", "batch_axes", "head_axes", "sequence_axis",
                     "load_balance", "scale", "is_causal",
                     "local_window_size", "logits_soft_cap",
                     "implementation", "block_sizes", "precision",
                     "deterministic_backward", "score_mod", "mask_mod",
                     "quantize", "out_dtype"),
)
def _sharded_flash_attention(
    query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
    segment_ids, query_positions, key_positions, sinks, score_mod_args,
    mask_mod_args, block_mask, query_scale, key_scale, value_scale, *, mesh,
    batch_axes, head_axes, sequence_axis, load_balance, scale, is_causal,
    local_window_size, logits_soft_cap, implementation, block_sizes,
    precision, deterministic_backward, score_mod, mask_mod, quantize,
    out_dtype,
):
  # Canonicalised once per trace, like `pallas_fa.flash_attention`: the
  # global mask description (padding folded into segment ids) is built
  # before sharding, so every shard sees exact global semantics.
  call = api.canonicalize(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      query_positions=query_positions, key_positions=key_positions,
      logits_soft_cap=logits_soft_cap, block_sizes=block_sizes,
      precision=precision, deterministic_backward=deterministic_backward,
      sinks=sinks, score_mod=score_mod,
      score_mod_args=score_mod_args, mask_mod=mask_mod,
      mask_mod_args=mask_mod_args, block_mask=block_mask,
      query_scale=query_scale, key_scale=key_scale, value_scale=value_scale,
      quantize=quantize, out_dtype=out_dtype, float8=True,
  )
  if call.empty:  # Nothing to split: as `flash_attention`.
    return call.unfold(*call.empty_result())
  plan = _make_plan(mesh, batch_axes, head_axes, sequence_axis, load_balance,
                    call.q.shape, call.k.shape, implementation, call.params)
  return call.unfold(*_sharded(plan, *call.arrays[:5], call.sinks,
                               call.scales, call.straight_through))
