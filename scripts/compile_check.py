r"""Compiles every GPU kernel to machine code, with or without a GPU.

XLA's GPU compiler runs on a machine with no GPU: given a compile-only CUDA
device (`jax.experimental.topologies`, described by a GpuTargetConfigProto),
`jax.jit(f).trace(...).lower().compile()` runs the whole XLA:GPU pipeline,
including Triton and Mosaic GPU down to ptxas. Inside
`pallas_fa.gpu_target.compile_for(target)` our backends build the compiled
kernels (not the CPU interpreter) with the tiles that GPU would get. This
script compiles forward + backward over a matrix of cases (the forward of
`decode_attention` for the decode variants) and prints one row per kernel:
ok or the problem, registers, spill bytes, shared memory, grid; for a
decode variant also the kernels one call launches (over `DECODE_KERNELS`
is a problem).

Needs jax's CUDA plugin at exactly the installed jaxlib version and ptxas,
in a virtual environment of its own (never the test one: with the plugin,
JAX would try to start a CUDA backend). From the repository root:

  python3 -m venv /tmp/cc && /tmp/cc/bin/pip install -e . \
      "jax-cuda12-plugin==$(/tmp/cc/bin/python -c \
          'import jaxlib; print(jaxlib.__version__)')" \
      "jax-cuda12-pjrt==<same>" nvidia-cuda-nvcc-cu12
  JAX_PLATFORMS=cpu /tmp/cc/bin/python scripts/compile_check.py \
      --fail-on-spill --json=compile_check.json

  # Quick: H100 only, head dims 64/128/256, plain and causal, bfloat16:
  JAX_PLATFORMS=cpu python scripts/compile_check.py --quick
  # On a GPU machine, the real device (registers must agree):
  python scripts/compile_check.py --target=local --quick

Exit status: 0 every kernel compiled (and, with --fail-on-spill, none
spills), 1 a problem, 2 this machine cannot compile for CUDA at all.
`compile_case()` is the library entry point (`scripts/tune.py` prunes its
candidates with it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

# Both compilers print the `ptxas -v` report of every kernel they build:
# Mosaic GPU on stdout when MOSAIC_GPU_DUMP_PTXAS is set, XLA (which compiles
# the Triton kernels) in its verbose log of the ptxas subprocess. Set before
# jax starts logging.
os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
os.environ.setdefault("TF_CPP_VMODULE", "subprocess_compilation=3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from compile import ptxas as ptxas_lib  # noqa: E402

import pallas_fa  # noqa: E402
from pallas_fa import flex  # noqa: E402
from pallas_fa import gpu_target  # noqa: E402
from pallas_fa import mosaic_gpu  # noqa: E402

# GpuTargetConfigProto text of each target, trimmed from XLA's public specs
# (xla/backends/gpu/target_config/specs/{h100_sxm,a100_sxm_80}.txtpb).
_CONFIG = """
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {smem_core}
  threads_per_core_limit: 2048
  core_count: {cores}
  fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock}
  device_memory_size: 84942979072
  shared_memory_per_block_optin: {smem_block}
  cuda_compute_capability {{
    major: {major}
    minor: 0
    {features}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
  patch: 0
}}
device_description_str: "{kind}"
"""

TARGETS = {
    "h100": (gpu_target.H100, "sm_90a", _CONFIG.format(
        smem_core=233472, cores=132, fpus=128, bandwidth=3352320000000,
        l2=52428800, clock=1.98, smem_block=232448, major=9,
        features="feature_extension: ACCELERATED_FEATURES",
        kind=gpu_target.H100.device_kind)),
    "a100": (gpu_target.A100, "sm_80", _CONFIG.format(
        smem_core=167936, cores=108, fpus=64, bandwidth=2039000000000,
        l2=41943040, clock=1.41, smem_block=166912, major=8, features="",
        kind=gpu_target.A100.device_kind)),
}

# Which backends each target compiles: Mosaic GPU is Hopper-only.
BACKENDS = {"h100": ("triton", "mosaic_gpu"), "a100": ("triton",)}
DTYPES = {"triton": ("bfloat16", "float16", "float32"),
          "mosaic_gpu": ("bfloat16", "float16")}
VARIANTS = ("plain", "causal", "masked", "dropout", "decode", "decode_paged",
            "decode_paged16", "decode_int8", "decode_paged_int8", "decode_fp8",
            "decode_int8_64_rows", "decode_paged_fp8_64_rows",
            "decode_int8_two_consumers", "decode_int8_128_keys",
            "decode_fp8_quantized_query", "decode_int8_quantized_query",
            "decode_int8_quantized_query_two_consumers", "decode_fp8_unscaled",
            "decode_fp8_per_head", "decode_paged_fp8", "decode_paged16_int8",
            "decode_latent", "decode_latent_int8", "decode_latent_paged",
            "decode_pdl_merge",
            "value_dim", "flex_alibi", "flex_softcap",
            "flex_document", "flex_t5", "decode_flex", "split",
            "split_causal", "split_masked", "split_dropout", "fp8",
            "fp8_causal", "decode_prefix", "fused_step",
            "fused_step_causal", "fused_pipeline", "fused_pipeline_causal",
            "fused_softmax", "fused_softmax_causal", "fused_softmax_pipeline",
            "wide_keys", "wide_keys_causal", "wide_keys_fp8",
            "wide_keys_fp8_causal", "keys256_fp8", "keys256_fp8_causal",
            "free_fp8", "free_fp8_causal", "in_kernel_fp8", "bias")
# The tile variants: their prefix (the variant after it, "plain"
# without one, gives the inputs and masking), the block-size fields they
# set, and the divisor of the sequence length they compile at: another
# length than the base variant's and each other's, whose forward kernel
# would otherwise come from Mosaic's in-process cache (no ptxas report).
TILE_VARIANTS = {
    "split": (dict(backward="split"), 2),
    # (fused_pipeline off: full calls' default sets it, and the two are
    # alternatives.)
    "fused_step": (dict(backward="fused", fused_overlap=True,
                        fused_pipeline=False, dq_swizzle=32), 4),
    "fused_pipeline": (dict(backward="fused", fused_pipeline=True,
                            dq_swizzle=32), 8),
    # The softmax under dP^T's and dV's products (dQ in the step).
    "fused_softmax": (dict(backward="fused", fused_softmax_overlap=True,
                           fused_pipeline=False), 32),
    # Both: the step before's dQ ahead of S^T, then the softmax under dP^T
    # and dV (a full call's default with `fused_softmax_overlap` set).
    "fused_softmax_pipeline": (dict(backward="fused",
                                    fused_softmax_overlap=True,
                                    fused_pipeline=True), 64),
    # 192-key forward tiles, the last one part padding (masked by index).
    "wide_keys": (dict(block_kv=192, num_stages=2), 16),
    # 256-key float8 forward tiles in two stages (1-byte K and V^T tiles
    # fit twice the keys of bfloat16's in the same shared memory).
    "keys256": (dict(block_kv=256, num_stages=2), 3),
    # The two consumers without ping-pong (free-running: each one's
    # softmax, longer than the other's float8 products, no longer waits
    # for a turn), at a length of whole 256-key tiles (the full float8
    # default's).
    "free": (dict(pingpong=False), 2),
    # triton's float8 forward converting its 1-byte tiles in registers,
    # where a long call on Hopper widens them in XLA.
    "in_kernel": (dict(widen_float8=False), 1),
}
# The float8 forward variants: `flash_attention` on float8_e4m3fn query,
# key and value with per-head float32 scales (the case's dtype is the
# result's, `out_dtype`), their base variant's masking; the backward is the
# case's-dtype one of the dequantized inputs, compiled by "plain" / "causal".
FP8_VARIANTS = {"fp8": "plain", "fp8_causal": "causal"}
# The decode variants over a quantized cache: (the variant whose cache
# layout they have, the cache's dtype); the query's is the case's dtype.
QUANTIZED_DECODE = {"decode_int8": ("decode", "int8"),
                    "decode_paged_int8": ("decode_paged", "int8"),
                    "decode_fp8": ("decode", "float8_e4m3fn"),
                    "decode_paged_fp8": ("decode_paged", "float8_e4m3fn"),
                    "decode_paged16_int8": ("decode_paged16", "int8"),
                    "decode_int8_64_rows": ("decode", "int8"),
                    "decode_paged_fp8_64_rows": ("decode_paged",
                                                 "float8_e4m3fn"),
                    "decode_int8_two_consumers": ("decode", "int8"),
                    "decode_int8_128_keys": ("decode", "int8"),
                    "decode_fp8_quantized_query": ("decode",
                                                   "float8_e4m3fn"),
                    "decode_int8_quantized_query": ("decode", "int8"),
                    "decode_int8_quantized_query_two_consumers": ("decode",
                                                                  "int8"),
                    "decode_fp8_unscaled": ("decode", "float8_e4m3fn"),
                    "decode_fp8_per_head": ("decode", "float8_e4m3fn")}
# Decode variants with private options of their own: mosaic_gpu's query
# quantized to the cache's dtype (Q K^T on 8-bit wgmma), over a float8
# cache with one scale a K/V head (no scale rings) and an int8 one with a
# scale an entry (the key column through shared memory).
DECODE_OPTIONS = {
    **{name: dict(_quantized_query=True)
       for name in ("decode_fp8_quantized_query",
                    "decode_int8_quantized_query",
                    "decode_int8_quantized_query_two_consumers")},
    # The splits' merge as a Mosaic GPU kernel with programmatic dependent
    # launch (`mosaic_gpu.decode_merge`), over the contiguous bf16 cache.
    "decode_pdl_merge": dict(_pdl_merge=True)}
PER_HEAD_SCALES = ("decode_fp8_quantized_query", "decode_fp8_per_head")
# Decode variants over a 1-byte cache without scales (a float8 cache's
# default scale 1), or with one scale a K/V head: mosaic_gpu runs both
# products in float16 over a float8 one under bfloat16 queries
# (`mosaic_gpu.decode.product_dtypes`).
UNSCALED = ("decode_fp8_unscaled",)
# Decode variants with the kernel's `num_warps`: mosaic_gpu's two consumer
# warpgroups a CTA.
DECODE_NUM_WARPS = {"decode_int8_two_consumers": 8,
                    "decode_int8_quantized_query_two_consumers": 8}
# Decode variants with their own keys per block: mosaic_gpu's 128-key
# blocks over a 1-byte cache (three stages).
DECODE_BLOCK_KV = {"decode_int8_128_keys": 128}
# Decode variants of 16 new tokens a row (speculative decoding), so that the
# 4 query heads of a K/V head pack 64 rows: the tile that runs as one
# warpgroup on Hopper (`triton.decode._launch`).
WIDE_DECODE_NEW_TOKENS = {"decode_int8_64_rows": 16,
                          "decode_paged_fp8_64_rows": 16}
# The decode variants over a latent (MLA) cache, value=None with
# value_head_dim (DeepSeek's absorbed MLA), and their cache's dtype (None:
# the query's; int8 with float32 key scales per entry). Their shape is
# `LATENT_SHAPE`, whatever the matrix's head dims: such a variant compiles
# once per target, backend and dtype, as h=576 (`VARIANT_HEAD_DIMS`).
LATENT_DECODE = {"decode_latent": None, "decode_latent_int8": "int8",
                 "decode_latent_paged": None}
# The latent variants over pages, and their page size: FlashMLA's 64-key
# blocks, one a kernel block.
LATENT_PAGE_SIZE = {"decode_latent_paged": 64}
LATENT_SHAPE = dict(head_dim=576, value_head_dim=512, heads=16, kv_heads=1)
# Variants only some backends implement (the others decline them).
VARIANT_BACKENDS = {"dropout": ("triton", "mosaic_gpu"),
                    "decode": ("triton", "mosaic_gpu"),
                    "decode_paged": ("triton", "mosaic_gpu"),
                    "decode_paged16": ("triton", "mosaic_gpu"),
                    **{name: ("triton",) for name in QUANTIZED_DECODE},
                    **{name: ("triton", "mosaic_gpu") for name in (
                        "decode_int8", "decode_fp8", "decode_int8_64_rows",
                        "decode_paged_int8", "decode_paged_fp8")},
                    "decode_int8_two_consumers": ("mosaic_gpu",),
                    "decode_int8_128_keys": ("mosaic_gpu",),
                    **{name: ("mosaic_gpu",) for name in DECODE_OPTIONS},
                    "decode_fp8_unscaled": ("mosaic_gpu",),
                    "decode_fp8_per_head": ("mosaic_gpu",),
                    # 16-key pages of a 1-byte cache: four TMA copies a
                    # block for each tile and scale ring.
                    "decode_paged16_int8": ("mosaic_gpu",),
                    "decode_latent": ("triton", "mosaic_gpu"),
                    "decode_latent_int8": ("triton",),
                    "decode_latent_paged": ("triton", "mosaic_gpu"),
                    "value_dim": ("triton", "mosaic_gpu"),
                    "flex_alibi": ("triton", "mosaic_gpu"),
                    "flex_softcap": ("triton", "mosaic_gpu"),
                    "flex_document": ("triton", "mosaic_gpu"),
                    "flex_t5": ("triton",),
                    "decode_flex": ("triton",),
                    **{name: ("mosaic_gpu",) for name in (
                        "split", "split_causal", "split_masked",
                        "split_dropout")},
                    **{name: ("triton", "mosaic_gpu")
                       for name in FP8_VARIANTS},
                    "decode_prefix": ("triton",),
                    "fused_step": ("mosaic_gpu",),
                    "fused_step_causal": ("mosaic_gpu",),
                    "fused_pipeline": ("mosaic_gpu",),
                    "fused_pipeline_causal": ("mosaic_gpu",),
                    "fused_softmax": ("mosaic_gpu",),
                    "fused_softmax_pipeline": ("mosaic_gpu",),
                    "fused_softmax_causal": ("mosaic_gpu",),
                    "wide_keys": ("mosaic_gpu",),
                    "wide_keys_causal": ("mosaic_gpu",),
                    "wide_keys_fp8": ("mosaic_gpu",),
                    "wide_keys_fp8_causal": ("mosaic_gpu",),
                    "keys256_fp8": ("mosaic_gpu",),
                    "keys256_fp8_causal": ("mosaic_gpu",),
                    "free_fp8": ("mosaic_gpu",),
                    "free_fp8_causal": ("mosaic_gpu",),
                    "in_kernel_fp8": ("triton",),
                    "bias": ("triton",)}
# The least compute capability of a variant: Triton converts float8_e4m3fn
# from 8.9 on (on an sm_80 target, deviceless, LLVM aborts the process).
VARIANT_MIN_CAPABILITY = {"decode_fp8": (8, 9), "decode_paged_fp8": (8, 9),
                          "decode_paged_fp8_64_rows": (8, 9),
                          **{name: (8, 9) for name in FP8_VARIANTS},
                          "wide_keys_fp8": (8, 9),
                          "wide_keys_fp8_causal": (8, 9),
                          "keys256_fp8": (8, 9),
                          "keys256_fp8_causal": (8, 9),
                          "free_fp8": (8, 9), "free_fp8_causal": (8, 9),
                          "in_kernel_fp8": (8, 9)}
# The widest head dim of a variant (past it, its calls run another variant's
# kernels): past 128, or 64 with dropout, a default call's backward is the
# split one already (`mosaic_gpu.fused_backward_applies`); 192-key forward
# tiles, and float8's 256-key ones, do not fit shared memory past 128.
VARIANT_MAX_HEAD_DIM = {"split": 128, "split_causal": 128, "split_masked": 128,
                        "fused_step": 128, "fused_step_causal": 128,
                        "fused_pipeline": 128, "fused_pipeline_causal": 128,
                        "fused_softmax": 128, "fused_softmax_causal": 128,
                        "fused_softmax_pipeline": 128,
                        "wide_keys": 128, "wide_keys_causal": 128,
                        "wide_keys_fp8": 128, "wide_keys_fp8_causal": 128,
                        "keys256_fp8": 128, "keys256_fp8_causal": 128,
                        "split_dropout": 64}
# The head dims a backend's variant takes where they are fewer than the
# matrix's: mosaic_gpu's decode kernel reads H = 64, 128 and 256, but at
# 256 its 128-key blocks and two consumers do not fit shared memory over a
# 1-byte cache (`mosaic_gpu.decode.smem_bytes`: a clear ValueError).
BACKEND_HEAD_DIMS = {
    **{("mosaic_gpu", variant): (64, 128, 256) for variant in (
        "decode", "decode_paged", "decode_paged16", "decode_int8",
        "decode_fp8", "decode_int8_64_rows", "decode_paged_int8",
        "decode_paged_fp8", *UNSCALED,
        "decode_fp8_per_head", "decode_fp8_quantized_query",
        "decode_int8_quantized_query", "decode_pdl_merge")},
    **{("mosaic_gpu", variant): (64, 128) for variant in (
        "decode_int8_two_consumers", "decode_int8_128_keys",
        "decode_int8_quantized_query_two_consumers",
        # (1-byte pages narrower than a block are refused past 128.)
        "decode_paged16_int8")}}
# The head dims of a variant that has its own (in place of the matrix's).
VARIANT_HEAD_DIMS = {name: (LATENT_SHAPE["head_dim"],)
                     for name in LATENT_DECODE}
# `decode_attention`'s shape: new tokens, query heads, K/V heads, page size.
DECODE_SHAPE = dict(new_tokens=1, heads=8, kv_heads=2, page_size=64)
# The paged decode layouts and their page sizes: "decode_paged16" has
# vLLM's 16-key pages (on CUDA), smaller than the kernel's block, which
# then gathers several pages into one.
PAGED_DECODE = {"decode_paged": DECODE_SHAPE["page_size"],
                "decode_paged16": 16}
# The most kernels one decode step may launch (the split kernel and the
# merge): a step moves so few bytes that each further launch costs about as
# much as its work. The flex variant's mask_mod lists take more, and so
# does a head dim the kernel pads (H = 72: the padded copy of the cache,
# `pallas_fa.triton.decode`), which is reported, not checked.
DECODE_KERNELS = {"decode": 2, "decode_paged": 2, "decode_paged16": 2,
                  "decode_pdl_merge": 2,
                  # Both parts' split kernels, their one merge and the
                  # fold's transpose of the queries.
                  "decode_prefix": 4,
                  **{name: 2 for name in QUANTIZED_DECODE},
                  # T_new > 1: the packing's transposes of the queries
                  # and the output too.
                  **{name: 4 for name in WIDE_DECODE_NEW_TOKENS},
                  **{name: 2 for name in LATENT_DECODE}}
HEAD_DIMS = (64, 72, 128, 256)


@dataclasses.dataclass(frozen=True)
class Case:
  """One forward + backward compile.

  Attributes:
    backend: "triton" or "mosaic_gpu".
    head_dim: H.
    dtype: input dtype name.
    variant: "plain"; "causal"; "masked" = causal + sliding window + segment
      ids + GQA 4:1 (every masking path of the kernels at once);
      "dropout" = causal + attention dropout; "decode" /
      "decode_paged" = `decode_attention`'s forward (triton only) against
      a contiguous / paged cache of S keys (`DECODE_SHAPE`, B = 2);
      "decode_paged16" = "decode_paged" in 16-key pages (`PAGED_DECODE`);
      "decode_int8" / "decode_paged_int8" / "decode_fp8" /
      "decode_paged_fp8" = the same over a quantized cache, int8 or
      float8_e4m3fn with float32 scales per entry ([B, S, K] / [P,
      page_size, K], `QUANTIZED_DECODE`); "decode_int8_64_rows" /
      "decode_paged_fp8_64_rows" = "decode_int8" / "decode_paged_fp8"
      with 16 new tokens a row: 64 packed rows a K/V head
      (`WIDE_DECODE_NEW_TOKENS`);
      "decode_latent" / "decode_latent_int8" = "decode" over a latent
      cache (value=None, value_head_dim: DeepSeek's H = 576, Hv = 512,
      one K/V head, 16 query heads, `LATENT_SHAPE`, whatever the
      matrix's head dims), of the query's dtype or int8 with float32 key
      scales per entry; "decode_latent_paged" = "decode_latent" in pages
      of 64 keys (`LATENT_PAGE_SIZE`); "decode_pdl_merge" = "decode" with
      the splits' merge as a Mosaic GPU kernel launched under the split
      kernel (`_pdl_merge`, mosaic_gpu);
      "value_dim" = causal with a value head dim Hv = H // 2 (MLA-style
      values narrower than queries/keys), or 2 H at H <= 64: there H // 2
      pads to H's width on mosaic_gpu, the kernels of the causal case,
      which Mosaic's in-process cache would then not compile (no ptxas
      report); "flex_alibi" / "flex_softcap" / "flex_document" = causal
      with ALiBi / a learned tanh soft cap as a score_mod (the gradient of
      its slopes / cap included) / a document mask_mod (flex attention,
      `pallas_fa.flex`); "flex_t5" = causal with T5's relative-position
      bias (`flex.t5_relative_bias`, a [heads, 32] table read at computed
      offsets, its gradient included; triton only); "bias" = causal with
      a float32 [1, N, T, S] bias, its gradient included (triton only:
      its tile is pipelined beside K and V, `tiles.for_dense_tiles`);
      "decode_flex" =
      "decode" with
      ALiBi and a prefix-LM mask_mod; "decode_prefix" = "decode" with a
      shared prefix of S keys before the rows' caches (`prefix_key`,
      `prefix_value`); "split" / "split_causal" /
      "split_masked" / "split_dropout" = "plain" / "causal" / "masked" /
      "dropout" with mosaic_gpu's split backward, the reproducible one
      that `deterministic_backward=True` runs
      (`MosaicGpuBlockSizes(backward="split")`; the base variants compile
      the default, fused one), at head dims <= 128, <= 64 with dropout;
      "fused_step" / "fused_step_causal" = "plain" / "causal" with the
      fused backward's step options (`fused_overlap`, `dq_swizzle=32`:
      `TILE_VARIANTS`), at head dims <= 128; "fused_pipeline" /
      "fused_pipeline_causal" likewise with `fused_pipeline`;
      "fused_softmax" / "fused_softmax_causal" likewise with
      `fused_softmax_overlap`; "fused_softmax_pipeline" = "plain" with
      both it and `fused_pipeline`;
      "wide_keys" / "wide_keys_causal" = "plain" / "causal" with 192-key
      forward tiles in two stages, at head dims <= 128 (the causal one
      fits because default positions are made from indices, not stored),
      "wide_keys_fp8" / "wide_keys_fp8_causal" the same of "fp8" /
      "fp8_causal"; "keys256_fp8" / "keys256_fp8_causal" those with
      256-key float8 tiles in two stages, at head dims <= 128;
      "free_fp8" / "free_fp8_causal" those with the two consumers
      free-running (`pingpong=False`), at a length of whole 256-key tiles;
      "fp8" / "fp8_causal" = the forward of "plain" / "causal" on
      float8_e4m3fn query, key and value with per-head float32 scales
      (`FP8_VARIANTS`; compute capability 8.9 and up), the
      result in the case's dtype (the backward of a float8 call runs on
      the dequantized inputs: the float32 "plain" / "causal" cases compile
      it).
    tiles: "default" (what a call without block_sizes gets: tuned records
      for the target, else the heuristic) or "heuristic" (records ignored).
  """

  backend: str
  head_dim: int
  dtype: str
  variant: str = "plain"
  tiles: str = "default"

  @property
  def value_head_dim(self) -> int:
    if self.variant in LATENT_DECODE:
      return LATENT_SHAPE["value_head_dim"]
    if self.variant != "value_dim":
      return self.head_dim
    return self.head_dim // 2 if self.head_dim > 64 else 2 * self.head_dim

  @property
  def float8(self) -> bool:
    """Whether the case is a float8 forward (`FP8_VARIANTS`, after a tile
    variant's prefix)."""
    return self._suffix in FP8_VARIANTS

  @property
  def input_dtype(self) -> str:
    """The dtype of query, key and value (a float8 variant's, else the
    case's)."""
    return "float8_e4m3fn" if self.float8 else self.dtype

  @property
  def tile_variant(self) -> str | None:
    """The `TILE_VARIANTS` prefix the case's variant starts with."""
    return next((prefix for prefix in TILE_VARIANTS
                 if self.variant.startswith(prefix)), None)

  @property
  def _suffix(self) -> str:
    """The variant after its tile variant's prefix ("plain" for the
    prefix alone)."""
    prefix = self.tile_variant
    if prefix is None:
      return self.variant
    return self.variant.removeprefix(prefix).removeprefix("_") or "plain"

  @property
  def base(self) -> str:
    """The variant whose inputs and masking the case has (a tile
    variant's: that of its suffix; the float8 ones `FP8_VARIANTS`)."""
    return FP8_VARIANTS.get(self._suffix, self._suffix)

  def __str__(self):
    return (f"{self.backend:10s} h={self.head_dim:<3d} {self.dtype:8s} "
            f"{self.variant:6s} {self.tiles}")


# ----------------------------------------------------------------------------
# Compiling one case.


def _cuda_device(target: str):
  if target == "local":
    return jax.devices()[0]
  from jax.experimental import topologies  # noqa: PLC0415
  topology = topologies.get_topology_desc(
      platform="cuda", topology="1x1x1", target_config=TARGETS[target][2])
  return topology.devices[0]


def _target(target: str) -> tuple[gpu_target.GpuTarget, str]:
  if target == "local":
    local = gpu_target.current()
    if local is None:
      raise RuntimeError("--target=local needs a GPU")
    major, minor = local.compute_capability.split(".")
    suffix = "a" if major == "9" else ""
    return local, f"sm_{major}{minor}{suffix}"
  return TARGETS[target][0], TARGETS[target][1]


def _tiles(case: Case, seq: int, gpu, *, heuristic: bool = False):
  """The config a call of `case` gets on `gpu` without `block_sizes`: the
  backend's `default_block_sizes` (tuned records, else the heuristic), or
  its `heuristic_block_sizes` (records ignored); those of float16 inputs
  for a triton float8 call that widens them (`triton.widens_float8`)."""
  module = importlib.import_module(f"pallas_fa.{case.backend}")
  choose = (module.heuristic_block_sizes if heuristic
            else module.default_block_sizes)
  dtype = jnp.dtype(case.input_dtype)
  if (case.float8 and case.backend == "triton"
      and case.tile_variant is None and module.widens_float8(seq, target=gpu)):
    dtype = jnp.dtype(jnp.float16)
  return choose(
      q_len=seq, kv_len=seq, head_dim=case.head_dim,
      dtype=dtype, is_causal=case.base != "plain",
      dropout=case.base == "dropout", device_kind=gpu.device_kind,
      value_head_dim=case.value_head_dim)


def _decode_call(case: Case, seq: int, spec):
  """(argument specs, forward function) of a decode case."""
  if case.variant in LATENT_DECODE:
    return _latent_decode_call(case, seq, spec)
  shape = DECODE_SHAPE
  # A shared prefix's 16 rows fold into one 64-row tile a K/V head (4
  # query heads each), the serving shape the prefix pass is tiled for;
  # float32 queries fold up to 32 rows (`triton.decode.
  # MAX_FOLDED_ROWS_FLOAT32`): 8 rows.
  b, h = 2, case.head_dim
  if case.variant == "decode_prefix":
    b = 8 if case.dtype == "float32" else 16
  kv = shape["kv_heads"]
  layout, cache_dtype = QUANTIZED_DECODE.get(
      case.variant, (case.variant, case.dtype))
  args = [spec((b, _new_tokens(case), shape["heads"], h))]
  if layout in PAGED_DECODE:
    page = PAGED_DECODE[layout]
    pages = b * seq // page
    cache = (pages, page, kv)
    args += [spec((*cache, h), cache_dtype), spec((*cache, h), cache_dtype),
             spec((b,), jnp.int32), spec((b, seq // page), jnp.int32)]
  else:
    cache = (b, seq, kv)
    args += [spec((*cache, h), cache_dtype), spec((*cache, h), cache_dtype),
             spec((b,), jnp.int32), None]
  flex_call = case.variant == "decode_flex"
  if flex_call:  # ALiBi's slopes, prefix-LM's prefix lengths.
    args += [spec((shape["heads"],), jnp.float32), spec((b,), jnp.int32)]
  shared = case.variant == "decode_prefix"
  if shared:  # The prefix's keys and values.
    args += [spec((seq, kv, h)), spec((seq, kv, h))]
  quantized = (case.variant in QUANTIZED_DECODE
               and case.variant not in UNSCALED)
  if quantized:  # The key and value scales, one per cache entry or head.
    scales = (kv,) if case.variant in PER_HEAD_SCALES else cache
    args += [spec(scales, jnp.float32), spec(scales, jnp.float32)]

  def call(q, k, v, lengths, table, *extra):
    kw = {}
    if flex_call:
      slopes, prefix = extra
      kw = dict(score_mod=flex.alibi, score_mod_args=(slopes,),
                mask_mod=flex.prefix_lm, mask_mod_args=(prefix,))
    if quantized:
      kw = dict(key_scale=extra[0], value_scale=extra[1])
    if shared:
      kw = dict(prefix_key=extra[0], prefix_value=extra[1])
    if case.variant in DECODE_NUM_WARPS:
      kw["num_warps"] = DECODE_NUM_WARPS[case.variant]
    if case.variant in DECODE_BLOCK_KV:
      kw["block_kv"] = DECODE_BLOCK_KV[case.variant]
    kw.update(DECODE_OPTIONS.get(case.variant, {}))
    return pallas_fa.decode_attention(
        q, k, v, lengths, block_table=table, implementation=case.backend,
        **kw)

  return args, call


def _latent_decode_call(case: Case, seq: int, spec):
  """(argument specs, forward function) of a latent decode case: the
  query, the one [B, S, 1, H] cache (the values its first Hv columns; as
  pages [P, page_size, 1, H] with a block table where the variant has
  them), the lengths and, int8, the key scales [B, S, 1]."""
  b, latent = 2, LATENT_SHAPE
  page = LATENT_PAGE_SIZE.get(case.variant)
  cache = ((b * seq // page, page) if page else (b, seq)) + (
      latent["kv_heads"],)
  cache_dtype = LATENT_DECODE[case.variant] or case.dtype
  args = [spec((b, DECODE_SHAPE["new_tokens"], latent["heads"],
                latent["head_dim"])),
          spec((*cache, latent["head_dim"]), cache_dtype),
          spec((b,), jnp.int32),
          spec((b, seq // page), jnp.int32) if page else None]
  if LATENT_DECODE[case.variant]:
    args.append(spec(cache, jnp.float32))

  def call(q, k, lengths, table, *scales):
    return pallas_fa.decode_attention(
        q, k, None, lengths, value_head_dim=latent["value_head_dim"],
        block_table=table, key_scale=scales[0] if scales else None,
        implementation=case.backend)

  return args, call


def _decode_shape(case: Case) -> tuple[int, int, int]:
  """(query heads per K/V head, key head dim, value head dim) of a decode
  case; the latent key tiling depends on the value head dim."""
  shape = LATENT_SHAPE if case.variant in LATENT_DECODE else DECODE_SHAPE
  return (shape["heads"] // shape["kv_heads"], case.head_dim,
          case.value_head_dim)


def _decode_tiles(case: Case, seq: int) -> str:
  """The decode kernel's block and head-dim tiling of a case (its cache
  `seq` entries long)."""
  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415
  groups, h, hv = _decode_shape(case)
  if case.backend == "mosaic_gpu":
    from pallas_fa.mosaic_gpu import decode as mgpu_decode  # noqa: PLC0415
    rows = mgpu_decode.stored_rows(groups * _new_tokens(case))
    block = DECODE_BLOCK_KV.get(case.variant, mgpu_decode.DEFAULT_BLOCK)
    cache = QUANTIZED_DECODE.get(case.variant, (None, case.dtype))[1]
    consumers = 2 if DECODE_NUM_WARPS.get(case.variant) == 8 else 1
    scale_rings = (case.variant in QUANTIZED_DECODE
                   and case.variant not in PER_HEAD_SCALES + UNSCALED)
    query_copy = mgpu_decode.query_copy_itemsize(
        case.dtype, cache, cache, quantized_query="_quantized_query" in
        DECODE_OPTIONS.get(case.variant, {}), scale_rings=scale_rings)
    stages = mgpu_decode.stages_for(
        h, hv, block, jnp.dtype(cache).itemsize, DECODE_SHAPE["kv_heads"],
        consumers, query_copy, scale_rings)
    return (f"rows={mgpu_decode.TILE_ROWS} (stored {rows}) block_kv={block} "
            f"stages={stages} consumers={consumers}")
  rows = triton_decode.packed_rows(groups * _new_tokens(case))
  padded, chunk = triton_decode.key_tiling(
      h, rows, hv if case.variant in LATENT_DECODE else None)
  value_padded, value_chunk = triton_decode.value_tiling(hv, rows)
  block = triton_decode.block_for(
      head_dim=h, value_head_dim=hv, groups=groups,
      new_tokens=_new_tokens(case), block_kv=None,
      page_size=PAGED_DECODE.get(QUANTIZED_DECODE.get(
          case.variant, (case.variant,))[0]),
      one_byte=case.variant in QUANTIZED_DECODE, cache_len=seq,
      float32_queries=case.dtype == "float32")
  return (f"rows={rows} block_kv={block} head_dim={padded}/{chunk} "
          f"value_head_dim={value_padded}/{value_chunk}")


def _new_tokens(case: Case) -> int:
  """T_new of a decode case."""
  return WIDE_DECODE_NEW_TOKENS.get(case.variant, DECODE_SHAPE["new_tokens"])


def _decode_reads_cache_in_place(case: Case) -> bool:
  """Whether the decode kernel reads the case's cache without a padded
  copy: its head dims need no padding."""
  from pallas_fa.triton import decode as triton_decode  # noqa: PLC0415
  groups, h, _ = _decode_shape(case)
  rows = triton_decode.packed_rows(groups * _new_tokens(case))
  return triton_decode.key_tiling(h, rows)[0] == h


def compile_case(case: Case, *, target: str = "h100", seq: int = 4096,
                 block_sizes: Any = None, keep: str | None = None
                 ) -> dict[str, Any]:
  """Compiles forward + backward of one case; never raises.

  Args:
    case: what to compile.
    target: "h100", "a100" or "local" (this machine's GPU).
    seq: T = S (B = 1, 8 query heads).
    block_sizes: an explicit config of the case's backend (None: the
      `case.tiles` policy).
    keep: keep the XLA dump under this directory.

  Returns:
    {"case", "target", "block_sizes", "compile_s", "error", "kernels": [row]}
    with one row per kernel: kernel, grid, threads, smem_bytes, registers,
    spill_stores, spill_loads, stack_bytes, error; a decode case adds
    "kernels_per_call" (`kernels_per_call`).
  """
  if case.tile_variant:
    seq //= TILE_VARIANTS[case.tile_variant][1]
  result: dict[str, Any] = {
      **dataclasses.asdict(case), "target": target, "seq": seq,
      "error": None, "kernels": []}
  workdir = tempfile.mkdtemp(prefix="compile_check_")
  start = time.time()
  try:
    gpu, arch = _target(target)
    result["arch"] = arch
    device = _cuda_device(target)
    sharding = jax.sharding.SingleDeviceSharding(device)
    dtype = jnp.dtype(case.dtype)
    heads, kv_heads = 8, 2 if case.base == "masked" else 8

    def spec(shape, dt=dtype):
      return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    decode = case.variant.startswith("decode")
    if block_sizes is None and case.tiles == "heuristic" and not decode:
      block_sizes = _tiles(case, seq, gpu, heuristic=True)
    if case.tile_variant:
      block_sizes = dataclasses.replace(
          block_sizes or _tiles(case, seq, gpu),
          **TILE_VARIANTS[case.tile_variant][0])
    kwargs: dict[str, Any] = {}
    inputs = jnp.dtype(case.input_dtype)
    args = [spec((1, seq, heads, case.head_dim), inputs),
            spec((1, seq, kv_heads, case.head_dim), inputs),
            spec((1, seq, kv_heads, case.value_head_dim), inputs)]
    if case.base == "masked":
      args.append(pallas_fa.SegmentIds(q=spec((1, seq), jnp.int32),
                                       kv=spec((1, seq), jnp.int32)))
      kwargs["local_window_size"] = (seq // 4, 0)
    if case.base == "dropout":
      kwargs.update(dropout_rate=0.1, dropout_rng=12345)
    if case.base == "flex_alibi":
      args.append(spec((heads,), jnp.float32))
    if case.base == "flex_softcap":
      args.append(spec((), jnp.float32))
    if case.base == "flex_document":
      args.append(spec((1, seq), jnp.int32))
    if case.base == "flex_t5":
      args.append(spec((heads, 32), jnp.float32))
    if case.base == "bias":
      args.append(spec((1, heads, seq, seq), jnp.float32))

    def loss(q, k, v, extra=None):
      kw = dict(kwargs)
      if case.base == "masked":
        kw["segment_ids"] = extra
      if case.base == "flex_alibi":
        kw.update(score_mod=flex.alibi, score_mod_args=(extra,))
      if case.base == "flex_softcap":
        kw.update(score_mod=flex.tanh_soft_cap, score_mod_args=(extra,))
      if case.base == "flex_document":
        kw.update(mask_mod=flex.document, mask_mod_args=(extra,))
      if case.base == "flex_t5":
        kw.update(score_mod=flex.t5_relative_bias, score_mod_args=(extra,))
      if case.base == "bias":
        kw["bias"] = extra
      out = pallas_fa.flash_attention(
          q, k, v, is_causal=case.base != "plain",
          implementation=case.backend, block_sizes=block_sizes, **kw)
      return out.astype(jnp.float32).sum()

    # The float arguments: q, k, v and ALiBi's slopes, the soft cap,
    # T5's table or the bias.
    call = jax.grad(loss, argnums=(0, 1, 2, 3)[:3 + (
        case.base in ("flex_alibi", "flex_softcap", "flex_t5", "bias"))])
    if case.float8:
      # Per-head scales ([1, 1, N] / [1, 1, K]); the forward only.
      args += [spec((1, 1, heads), jnp.float32),
               spec((1, 1, kv_heads), jnp.float32),
               spec((1, 1, kv_heads), jnp.float32)]

      def call(q, k, v, q_scale, k_scale, v_scale):
        return pallas_fa.flash_attention(
            q, k, v, query_scale=q_scale, key_scale=k_scale,
            value_scale=v_scale, is_causal=case.base != "plain",
            out_dtype=dtype, implementation=case.backend,
            block_sizes=block_sizes, **kwargs)
    if decode:
      args, call = _decode_call(case, seq, spec)

    with gpu_target.compile_for(gpu):
      lowered = jax.jit(call).trace(*args).lower()
      if decode:
        result["block_sizes"] = "decode: " + _decode_tiles(case, seq)
      else:
        result["block_sizes"] = repr(
            _tiles(case, seq, gpu) if block_sizes is None else block_sizes)
      dump = keep or os.path.join(workdir, "xla")
      log = os.path.join(workdir, "compile.log")
      with ptxas_lib.captured_output(log):
        lowered.compile(compiler_options={"xla_dump_to": dump})
    result["compile_s"] = round(time.time() - start, 1)
    with open(log, errors="replace") as f:
      reports = ptxas_lib.parse_ptxas(f.read())
    if case.backend == "triton":
      prefix, launches = "flash_", ptxas_lib.triton_launches(dump)
    else:
      prefix, launches = "pfa_", ptxas_lib.mosaic_launches(lowered)
    # Mosaic GPU names an entry `<kernel>_mosaic_gpu_kernel`.
    reports = {name.removesuffix("_mosaic_gpu_kernel"): info
               for name, info in reports.items() if name.startswith(prefix)}
    names = sorted(set(reports) | {n for n in launches
                                   if n.startswith(prefix)})
    if not names:
      raise RuntimeError(f"no {prefix}* kernel was compiled")
    result["kernels"] = [
        {"kernel": name, **launches.get(name, {}), **reports.get(name, {})}
        for name in names]
    if decode:
      result["kernels_per_call"] = kernels_per_call(dump)
  except Exception as e:  # noqa: BLE001 - a report, not a crash.
    result["error"] = f"{type(e).__name__}: {e}"[:4000]
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return result


# A kernel launch in XLA's thunk-sequence dump, and the kernel's name.
_KERNEL_THUNK = re.compile(r"\bk(?:Custom)?Kernel \[[^\]]*\] (\S+)")


def kernels_per_call(dump: str) -> int:
  """The kernels one call launches: every kernel thunk of XLA's
  thunk-sequence dump (fusions and custom kernels alike; a command buffer
  lists its kernels again, counted once)."""
  names = set()
  for path in glob.glob(os.path.join(dump, "*thunk_sequence*.txt")):
    with open(path) as f:
      names.update(_KERNEL_THUNK.findall(f.read()))
  return len(names)


def spill_key(result: dict[str, Any], kernel: str) -> str:
  """The name of one kernel of one case in a known-spills file."""
  return "/".join((result["target"], result["backend"],
                   f"h{result['head_dim']}", result["dtype"],
                   result["variant"], result["tiles"], kernel))


def problems(row: dict[str, Any], smem_limit: int, fail_on_spill: bool,
             known_spill: int | None = None) -> list[str]:
  """What is wrong with one kernel row (empty: nothing).

  A spill is a problem with `fail_on_spill`, unless `known_spill` bytes are
  recorded for the kernel and it spills no more than that.
  """
  found = []
  if row.get("error"):
    found.append("error")
  if "registers" not in row:
    found.append("no ptxas report")
  if row.get("smem_bytes", 0) > smem_limit:
    found.append(f"smem > {smem_limit} B")
  spilled = max(row.get("spill_stores") or 0, row.get("spill_loads") or 0)
  if fail_on_spill and spilled:
    if known_spill is None:
      found.append("spills")
    elif spilled > known_spill:
      found.append(f"spills more than the known {known_spill} B")
  return found


def matrix(args) -> list[tuple[str, Case]]:
  """(target, case) pairs selected by the command line."""
  if args.quick:
    head_dims, variants, dtypes = (64, 128, 256), ("plain", "causal"), (
        "bfloat16",)
    targets = [args.target]
  else:
    head_dims = tuple(int(h) for h in args.head_dims.split(","))
    variants = tuple(args.variants.split(","))
    dtypes = tuple(args.dtypes.split(","))
    targets = args.target.split(",")
  out = []
  for target in targets:
    backends = BACKENDS.get(target, ("triton", "mosaic_gpu"))
    capability = tuple(
        int(x) for x in _target(target)[0].compute_capability.split("."))
    for backend in args.backends.split(","):
      if backend not in backends:
        continue
      for h in head_dims:
        for variant in variants:
          own = VARIANT_HEAD_DIMS.get(variant)
          if own is not None and h != head_dims[0]:
            continue  # Its own head dims, taken once (at the first).
          for dtype in dtypes:
            if dtype not in DTYPES[backend] or backend not in (
                VARIANT_BACKENDS.get(variant, (backend,))) or h > (
                VARIANT_MAX_HEAD_DIM.get(variant, h)) or capability < (
                VARIANT_MIN_CAPABILITY.get(variant, ())) or h not in (
                BACKEND_HEAD_DIMS.get((backend, variant), (h,))):
              continue
            for tiles in args.tiles.split(","):
              out += [(target, Case(backend, hh, dtype, variant, tiles))
                      for hh in own or (h,)]
  return out


def _versions() -> dict[str, str]:
  out = {}
  for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt",
               "jax-cuda13-plugin", "jax-cuda13-pjrt",
               "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvcc"):
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      out[name] = importlib.metadata.version(name)
  ptxas = ptxas_lib.ptxas_path()
  if ptxas:
    proc = subprocess.run([ptxas, "--version"], capture_output=True,
                          text=True, check=False)
    out["ptxas"] = (proc.stdout.strip().splitlines() or ["?"])[-1]
  return out


# With nvJitLink installed (`jax[cuda12]` installs it) XLA links the kernels
# in-process, and ptxas then writes no register/spill report.
_NVJITLINK = ("nvidia-nvjitlink-cu12", "nvidia-nvjitlink")


def _can_compile_for_cuda(target: str) -> str | None:
  """None, or why this machine cannot compile for CUDA."""
  if target == "local":
    return None if gpu_target.current() else "--target=local needs a GPU"
  try:
    _cuda_device("h100")
  except Exception as e:  # noqa: BLE001
    return (f"no CUDA compiler in this jax ({type(e).__name__}: {e}); install"
            " jax-cuda12-plugin and jax-cuda12-pjrt at jaxlib's version")
  found = []
  for name in _NVJITLINK:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      found.append(f"{name} {importlib.metadata.version(name)} (XLA then "
                   "links kernels in-process, without a ptxas report)")
  if mosaic_gpu.refuses_masked_kernels():
    found.append(f"a CUDA runtime {mosaic_gpu.cuda_runtime_version()} "
                 "(mosaic_gpu then refuses its masked kernels)")
  if found:
    return (f"this venv has {' and '.join(found)}, as jax[cuda12] installs "
            "them; use a venv with jax-cuda12-plugin, jax-cuda12-pjrt and "
            "nvidia-cuda-nvcc-cu12 only (BUILD.md)")
  return None


def _merge_known_spills(path: str, results: list[dict[str, Any]]) -> None:
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    data = {"about": "Kernels of default configs that still spill, with the "
                     "bytes measured (max of jax versions); compile_check.py "
                     "--known-spills fails on any other spill or growth.",
            "spills": {}}
  spills = data["spills"]
  for res in results:
    for row in res["kernels"]:
      spilled = max(row.get("spill_stores") or 0, row.get("spill_loads") or 0)
      if spilled:
        key = spill_key(res, row["kernel"])
        spills[key] = max(spills.get(key, 0), spilled)
  data["spills"] = dict(sorted(spills.items()))
  with open(path, "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--target", default="h100,a100",
                      help="h100, a100 and/or local (comma list)")
  parser.add_argument("--backends", default="triton,mosaic_gpu")
  parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--dtypes", default="bfloat16,float16,float32")
  parser.add_argument("--tiles", default="default",
                      help="default and/or heuristic (comma list)")
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--quick", action="store_true",
                      help="one target, H 64/128/256, plain+causal, bf16")
  parser.add_argument("--fail-on-spill", action="store_true")
  parser.add_argument(
      "--known-spills", metavar="JSON",
      help="kernels known to spill, {key: bytes}: with --fail-on-spill only "
      "a spill not listed, or larger than listed, fails")
  parser.add_argument(
      "--write-known-spills", metavar="JSON",
      help="merge this run's spills into that file (max bytes per key)")
  parser.add_argument("--json", help="write every result here")
  args = parser.parse_args(argv)
  if args.quick:
    args.target = args.target.split(",")[0]

  reason = _can_compile_for_cuda(args.target.split(",")[0])
  if reason:
    print(f"compile_check: cannot run here: {reason}")
    return 2
  versions = _versions()
  print(f"compile_check: deviceless={args.target != 'local'} {versions}")
  known = {}
  if args.known_spills:
    with open(args.known_spills) as f:
      known = json.load(f)["spills"]
  results, bad = [], 0
  for target, case in matrix(args):
    res = compile_case(case, target=target, seq=args.seq)
    results.append(res)
    gpu, _ = _target(target)
    print(f"\n== {target} {case} ({res.get('compile_s', '?')} s) "
          f"{res.get('block_sizes', '')}")
    if res["error"]:
      bad += 1
      print(f"   COMPILE FAILED: {res['error']}")
    if "kernels_per_call" in res:
      count, most = res["kernels_per_call"], DECODE_KERNELS.get(case.variant)
      if not _decode_reads_cache_in_place(case):
        most = None
      over = most is not None and count > most
      bad += over
      print(f"   kernels per call: {count}"
            + (f" FAIL(more than {most})" if over else ""))
    for row in res["kernels"]:
      found = problems(row, gpu.shared_memory_per_block, args.fail_on_spill,
                       known.get(spill_key(res, row["kernel"])))
      row["problems"] = found
      bad += bool(found)
      status = "ok" if not found else "FAIL(" + ", ".join(found) + ")"
      print(f"   {row['kernel']:20s} {status:8s} "
            f"regs={row.get('registers', '?'):>3} "
            f"spill st/ld={row.get('spill_stores', '?')}/"
            f"{row.get('spill_loads', '?')} B "
            f"smem={row.get('smem_bytes', '?')} B "
            f"grid=[{row.get('grid', '?')}] "
            f"threads=[{row.get('threads', '?')}]")
      if row.get("error"):
        print("     " + row["error"][:1500].replace("\n", "\n     "))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"versions": versions, "argv": sys.argv,
                 "results": results}, f, indent=1)
  if args.write_known_spills:
    _merge_known_spills(args.write_known_spills, results)
  print(f"\n{len(results)} cases, {bad} problem(s)")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
