"""Multi-device flash attention: batch/head sharding and ring attention.

XLA cannot partition a Pallas kernel by itself ("Mosaic kernels cannot be
automatically partitioned"), so every implementation is run here per device
inside `shard_map`:

* batch and head sharding are embarrassingly parallel: each device runs the
  chosen implementation on its own batch rows and heads. With grouped-query
  attention the key/value heads are split with their query groups; when there
  are fewer key/value heads than head shards (MQA), K/V are replicated over the
  head axis and each device slices the one key/value head its queries use.
* ring (context-parallel) attention over a sequence axis
  (`pallas_fa.parallel.ring`): each device keeps its query shard while the
  key/value shards travel around the ring, and the partial results are
  merged exactly through their logsumexp. Causal ring attention on
  contiguous shards would leave device r idle on the r steps whose keys lie
  in its future; the zig-zag layout (`zigzag`) gives device r the sequence
  chunks r and 2P-1-r of 2P, so every device has the same number of
  visible keys at every step.

`sharded_flash_attention` (`sharded.py`) takes global arrays and plans the
split; `ring_attention` (`ring.py`) is the per-device op for use inside a
`shard_map` of your own. Both, and the mesh and layout helpers of `mesh.py`
(`make_mesh`, `shard_batch`, `zigzag`, ...), are exported here.
"""

from pallas_fa.parallel.mesh import DATA_AXIS
from pallas_fa.parallel.mesh import HEAD_AXIS
from pallas_fa.parallel.mesh import SEQUENCE_AXIS
from pallas_fa.parallel.mesh import AxisNames
from pallas_fa.parallel.mesh import make_mesh
from pallas_fa.parallel.mesh import replicate
from pallas_fa.parallel.mesh import shard_batch
from pallas_fa.parallel.mesh import shard_map
from pallas_fa.parallel.mesh import unzigzag
from pallas_fa.parallel.mesh import zigzag
from pallas_fa.parallel.mesh import zigzag_indices
from pallas_fa.parallel.ring import ring_attention
from pallas_fa.parallel.sharded import sharded_flash_attention

__all__ = [
    "sharded_flash_attention",
    "ring_attention",
    "make_mesh",
    "shard_batch",
    "replicate",
    "shard_map",
    "zigzag",
    "unzigzag",
    "zigzag_indices",
    "AxisNames",
    "DATA_AXIS",
    "HEAD_AXIS",
    "SEQUENCE_AXIS",
]
