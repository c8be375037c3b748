"""Flex attention: user score_mods and mask_mods, their block masks, and
their split for the kernels.

`flash_attention(score_mod=..., mask_mod=...)` takes functions written as for
one element of the logit matrix. Where each piece lives:

    examples.py    ready-made functions (ALiBi, T5 buckets, soft cap,
                   documents, prefix LM, ...), exported here: `flex.alibi`
    mods.py        the one place that checks and evaluates a user function
    block_mask.py  `create_block_mask`: which tiles are empty, partial, full
    fused_mods.py  a function split into what XLA computes before a kernel
                   and what the kernel computes on its tile (forward and
                   gradient)

`reads` declares the shapes of the arrays a function reads from its extra
arguments, which each call then checks (the examples declare theirs).
`BlockMask` and `create_block_mask` are also `pallas_fa.BlockMask` and
`pallas_fa.create_block_mask`.
"""

import importlib

from pallas_fa.flex.examples import alibi
from pallas_fa.flex.examples import alibi_slopes
from pallas_fa.flex.examples import causal_with_offset
from pallas_fa.flex.examples import chunked_causal
from pallas_fa.flex.examples import document
from pallas_fa.flex.examples import prefix_lm
from pallas_fa.flex.examples import sliding_window_with_sinks
from pallas_fa.flex.examples import t5_bucket
from pallas_fa.flex.examples import t5_relative_bias
from pallas_fa.flex.examples import tanh_soft_cap
from pallas_fa.flex.mods import reads

__all__ = [
    "alibi",
    "alibi_slopes",
    "causal_with_offset",
    "chunked_causal",
    "document",
    "prefix_lm",
    "reads",
    "sliding_window_with_sinks",
    "t5_bucket",
    "t5_relative_bias",
    "tanh_soft_cap",
    "BlockMask",
    "create_block_mask",
]


def __getattr__(name):
  # The block mask needs the masking layer, which needs `mods` from this
  # package: importing it on first use keeps that from being a circle.
  if name in ("BlockMask", "create_block_mask"):
    return getattr(importlib.import_module("pallas_fa.flex.block_mask"), name)
  raise AttributeError(f"module 'pallas_fa.flex' has no attribute {name!r}")
