"""The merge of `mosaic_gpu.decode`'s splits as a Mosaic GPU kernel, with
programmatic dependent launch (PDL).

`decode_attention(implementation="mosaic_gpu", _pdl_merge=True)`, an A/B
option until a GPU run times it. A decode step is two kernels: the split
kernel and the merge of its partial results. The merge's own work is a few
hundred kilobytes, so its cost is its launch: the gap between the split
kernel's last CTA and the merge's first, then its own drain. With PDL (jax
>= 0.11 launches a Mosaic GPU kernel that waits on its grid dependency with
the launch attribute that allows it) the split kernel lets its dependent
launch as soon as every one of its CTAs has started
(`griddepcontrol.launch_dependents`), so the merge's CTAs are launched and
resident (on the SMs the split kernel leaves free, then on each SM its CTA
leaves) while the split kernel runs; each waits in `griddepcontrol.wait`
until the split kernel has completed and its writes are visible, then
merges. Both kernels also wait on their own predecessor before they read
anything, so either may follow any kernel. Where the launch has no such
attribute (jax 0.10) the instructions are no-ops and the two kernels run in
turn, as with the Pallas Triton merge (`triton.decode_merge`), which this
kernel also replaces where Pallas Triton is not wanted (jax 0.12
deprecates that backend).

One CTA (one warpgroup) a packed row of a (sequence, K/V head): its
splits' normalised partial results come by TMA as the rows of a [64, Hv]
float32 tile, their logsumexps as scalars, and the exact merge
(`online_softmax.merge_parts`) and the sinks (`online_softmax.add_sink`)
run in registers; the row goes out in the query's dtype by TMA. At most
`MAX_PARTS` partial results (the tile's rows) a row, which the split
kernel writes into whole 8-row tiles (`padded_parts`); more take the
Triton merge.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa import layout
from pallas_fa import online_softmax
from pallas_fa.mosaic_gpu import kernel
from pallas_fa.mosaic_gpu import ops as gpu_ops

_F32 = jnp.float32
# A merge CTA's partial results: the rows of one wgmma-layout tile.
MAX_PARTS = 64


def applies(parts: int) -> bool:
  """Whether this kernel merges `parts` partial results a row: at most a
  tile's rows."""
  return parts <= MAX_PARTS


def padded_parts(parts: int) -> int:
  """The parts' axis this kernel reads for `parts` partial results: whole
  8-row tiles of its shared memory, a TMA copy's rows there."""
  return layout.round_up(parts, 8)


def merge_splits(out, lse, sinks, *, parts: int, dtype, value_head_dim: int,
                 real_rows: int, interpret: bool):
  """The splits' partial results merged and the sinks added, one kernel
  (`triton.decode_merge.merge_splits`' contract without a prefix).

  Args:
    out: float32 [B, K, padded_parts(P), R', Hv], normalised partial
      outputs (P `applies`; the others are never used).
    lse: float32 [B, K, padded_parts(P), R'], their logsumexps (-inf: no
      key).
    sinks: None or float32 [K, R], each packed row's sink logit.
    parts: P, the partial results a row.
    dtype: the output's dtype.
    value_head_dim: Hv (out's last dim).
    real_rows: the rows R <= R' that are merged; the others are never read.
    interpret: run in the Mosaic GPU interpreter.

  Returns:
    (out [B, K, R, Hv] in `dtype`, lse float32 [B, K, R]).
  """
  b, num_kv, padded, _, hv = out.shape
  if (not applies(parts) or padded != padded_parts(parts)
      or hv != value_head_dim):
    raise ValueError(f"the Mosaic GPU merge takes at most {MAX_PARTS} parts "
                     f"(in whole 8-row tiles) of the value head dim, got "
                     f"{parts=}, {out.shape=}.")
  rows = real_rows
  ops = gpu_ops.Ops(interpret)
  operands = (out, lse) + (() if sinks is None else (sinks,))

  def body(*refs):
    parts_ref, lse_ref = refs[:2]
    sinks_ref = refs[2] if sinks is not None else None
    out_ref, lse_out_ref, tile, staging, loaded = refs[-5:]
    cta = lax.axis_index("cta")
    row, head = cta % rows, cta // rows
    n, bi = head % num_kv, head // num_kv
    kernel.depend_on_grid(ops)
    plgpu.copy_gmem_to_smem(parts_ref.at[bi, n, pl.ds(0, padded), row],
                            tile.at[pl.ds(0, padded)], loaded)
    # The tile's rows past the parts (never written, in the array's
    # padding or past it) read as parts that saw no key, their values
    # zeroed, as they may hold NaN.
    index = ops.iota_vector(MAX_PARTS, 0)
    part_lse = ops.full_vector(MAX_PARTS, online_softmax.MASK_VALUE, 0)
    for p in range(parts):
      part_lse = jnp.where(index == p, lse_ref[bi, n, p, row], part_lse)
    plgpu.barrier_wait(loaded)
    values = jnp.where(ops.iota((MAX_PARTS, hv), 0) < parts,
                       ops.load_tile(tile), 0.0)
    merged, merged_lse = online_softmax.merge_parts.fun(values, part_lse, 0)
    if sinks_ref is not None:
      merged, merged_lse = online_softmax.add_sink.fun(
          merged, merged_lse, sinks_ref[n, row])
    staging[...] = merged.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(staging, out_ref.at[bi, n, row])
    lse_out_ref[bi, n, row] = merged_lse
    plgpu.wait_smem_to_gmem(0)

  out_types = (jax.ShapeDtypeStruct((b, num_kv, rows, hv), dtype),
               jax.ShapeDtypeStruct((b, num_kv, rows), _F32))
  scratch = [ops.smem((MAX_PARTS, hv), _F32, True),
             plgpu.SMEM((hv,), dtype), plgpu.Barrier(num_arrivals=1)]
  call = plgpu.kernel(
      body, kernel_name="pfa_mgpu_decode_merge", grid=(b * num_kv * rows,),
      grid_names=("cta",), num_threads=1, thread_name="wg",
      **kernel.kernel_kwargs(out_types=out_types, scratch=scratch,
                             interpret=(kernel.interpret_params()
                                        if interpret else None),
                             lowering_semantics="lane"))
  return call(*operands)
