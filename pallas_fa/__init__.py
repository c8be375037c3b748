"""pallas_fa: exact, memory-linear flash attention for JAX, in Pallas."""

import importlib

from pallas_fa import dropout
from pallas_fa import gpu_target
from pallas_fa.api import flash_attention
from pallas_fa.api import implementations
from pallas_fa.masking import SegmentIds

__all__ = [
    "flash_attention",
    "decode_attention",
    "implementations",
    "SegmentIds",
    "dropout",
    "gpu_target",
    "MultiHeadAttention",
    "make_attention_fn",
    "sharded_flash_attention",
    "ring_attention",
]
__version__ = "0.1.0"

# Flax and the multi-device layer are imported on first use, so that
# `import pallas_fa` stays light for users of the bare op.
_LAZY = {
    "decode_attention": "pallas_fa.decode",
    "MultiHeadAttention": "pallas_fa.modules",
    "make_attention_fn": "pallas_fa.modules",
    "sharded_flash_attention": "pallas_fa.parallel",
    "ring_attention": "pallas_fa.ring",
}


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'pallas_fa' has no attribute {name!r}")
