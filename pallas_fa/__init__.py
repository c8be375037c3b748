"""pallas_fa: exact, memory-linear flash attention for JAX, in Pallas.

`flash_attention` is the op; each `implementation=` is a backend module
(`chunked`, `triton`, `mosaic_gpu`, `mosaic_tpu`, `reference` for "xla")
with a tiling config exported here (`TritonBlockSizes`, ...) and a
`default_block_sizes` of one signature. To add a backend, see the contract
in `pallas_fa.vjp`. Flex attention (`score_mod=`, `mask_mod=`) takes a
`BlockMask` from `create_block_mask`; the `pallas_fa.flex` package holds
flex attention (with ready-made examples) and `pallas_fa.parallel` the
multi-device layer (`sharded_flash_attention`, `ring_attention`).
"""

import importlib

from pallas_fa import dropout
from pallas_fa import flex
from pallas_fa import gpu_target
from pallas_fa import kv_cache
from pallas_fa import quantize
from pallas_fa.api import flash_attention
from pallas_fa.api import implementations
from pallas_fa.flex.block_mask import BlockMask
from pallas_fa.flex.block_mask import create_block_mask
from pallas_fa.masking import SegmentIds
from pallas_fa.quantize import quantize_fp8

__all__ = [
    "flash_attention",
    "decode_attention",
    "merge_attention",
    "kv_cache",
    "quantize",
    "quantize_fp8",
    "implementations",
    "SegmentIds",
    "BlockMask",
    "create_block_mask",
    "flex",
    "dropout",
    "gpu_target",
    "ChunkedBlockSizes",
    "TritonBlockSizes",
    "MosaicGpuBlockSizes",
    "MosaicTpuBlockSizes",
    "MultiHeadAttention",
    "make_attention_fn",
    "sharded_flash_attention",
    "ring_attention",
]
__version__ = "0.1.0"

# Flax, the multi-device layer and the backends (whose tiling configs these
# are) are imported on first use, so that `import pallas_fa` stays light and
# a backend whose compiler stack is missing breaks nothing until it is used.
_LAZY = {
    "decode_attention": "pallas_fa.decode",
    "merge_attention": "pallas_fa.decode",
    "ChunkedBlockSizes": "pallas_fa.chunked",
    "TritonBlockSizes": "pallas_fa.triton",
    "MosaicGpuBlockSizes": "pallas_fa.mosaic_gpu",
    "MosaicTpuBlockSizes": "pallas_fa.mosaic_tpu",
    "MultiHeadAttention": "pallas_fa.modules",
    "make_attention_fn": "pallas_fa.modules",
    "sharded_flash_attention": "pallas_fa.parallel",
    "ring_attention": "pallas_fa.parallel",
}


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'pallas_fa' has no attribute {name!r}")
