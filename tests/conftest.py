"""Shared test configuration: which implementations run, with which tiles."""

import contextlib
import importlib
import importlib.util
import os
import pathlib
import sys

import jaxlib.version  # Its version only: nothing reads XLA_FLAGS yet.


def _compile_cheaply() -> str:
  """XLA flags for a suite whose time is nearly all XLA:CPU compiling.

  Test shapes are tiny, so optimisation level 0 (about 40 % cheaper
  compiles) costs no running time worth having. jaxlib 0.10's XLA also
  keeps the older elementwise emitters, which compile a test's programs in
  about half the time of the MLIR fusion emitters (a one-op program in
  18 ms against 28; 0.11 removed the flag, and XLA aborts on a flag it does
  not know, hence the version check). Without LLVM's expensive passes
  jaxlib 0.10 runs a test file about 8 % sooner (test_sinks.py: 33 s
  against 36); 0.11 gains nothing from it.
  """
  flags = ["--xla_backend_optimization_level=0"]
  if jaxlib.version.__version_info__ < (0, 11):
    flags += ["--xla_cpu_use_fusion_emitters=false",
              "--xla_llvm_disable_expensive_passes=true"]
  return " ".join(flags)


# Set before jax starts its backend (pytest-xdist's workers inherit it).
os.environ.setdefault("XLA_FLAGS", _compile_cheaply())
# The Mosaic GPU interpreter needs a CPU client thread per warpgroup at
# once (`pallas_fa.mosaic_gpu.kernel.cpu_client_threads`); XLA sizes that
# pool by the cores, so on a 2-core machine it could deadlock.
os.environ.setdefault("NPROC", "8")

import jax  # noqa: E402
import pytest  # noqa: E402
from attention_testing import GPU_JAX_ONLY  # noqa: E402

import pallas_fa  # noqa: E402
from pallas_fa import api  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# JAX's own test harness forbids implicit rank promotion; so do we, so that
# the library works for users who run that way.
jax.config.update("jax_numpy_rank_promotion", "raise")

# Small tiles per backend so that short test sequences still cross many tile
# boundaries (ragged tails, skipped tiles, GQA groups). Entry: (module, config
# class name, keyword arguments).
TEST_BLOCK_SIZES = {
    "xla": None,
    "chunked": (
        "pallas_fa.chunked",
        "ChunkedBlockSizes",
        dict(block_q=16, block_kv=32, block_q_bwd=32, block_kv_bwd=16),
    ),
    "triton": (
        "pallas_fa.triton",
        "TritonBlockSizes",
        dict(block_q=16, block_kv=32, block_q_dkv=32, block_kv_dkv=16,
             block_q_dq=16, block_kv_dq=32, num_warps=4, num_stages=1),
    ),
    "mosaic_gpu": (
        "pallas_fa.mosaic_gpu",
        "MosaicGpuBlockSizes",
        dict(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64,
             block_q_dkv=64, block_kv_dkv=64),
    ),
    "mosaic_tpu": (
        "pallas_fa.mosaic_tpu",
        "MosaicTpuBlockSizes",
        dict(block_q=128, block_kv=128, block_q_bwd=128, block_kv_bwd=128),
    ),
}


def block_sizes_for(name):
  """The small-tile config used for `name` in the tests (None = default)."""
  entry = TEST_BLOCK_SIZES.get(name)
  if entry is None:
    return None
  module, cls, kwargs = entry
  return getattr(importlib.import_module(module), cls)(**kwargs)


# The Mosaic GPU interpreter takes about a minute per forward+backward case on
# a CPU: tests/test_mosaic_gpu.py covers it there, and the whole suite runs it
# compiled on a Hopper GPU. PALLAS_FA_TEST_IMPLEMENTATIONS=a,b overrides.
_TOO_SLOW_TO_INTERPRET = ("mosaic_gpu",)


def _implementations_under_test():
  chosen = os.environ.get("PALLAS_FA_TEST_IMPLEMENTATIONS")
  if chosen:
    return tuple(name.strip() for name in chosen.split(",") if name.strip())
  names = pallas_fa.implementations()
  if api.platform() == "cpu":
    names = tuple(n for n in names if n not in _TOO_SLOW_TO_INTERPRET)
  return names


IMPLEMENTATIONS = _implementations_under_test()


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request):
  return request.param


def _implementation_of(item):
  """The `implementation` a collected test runs, or None."""
  callspec = getattr(item, "callspec", None)
  if callspec is not None:
    return callspec.params.get("implementation")
  # Parameterized TestCase methods: test_<name>_<implementation>[__variant].
  name = item.name.split("__")[0]
  return next((n for n in api.REGISTRY if name.endswith("_" + n)),
              None)


# On a CPU the Triton kernels run in Pallas's interpreter: CI runs those
# tests with the GPU machines' jax only (gpu_jax, leg 2), while the oldest
# supported jax compiles the same kernels for the H100 and A100.
_GPU_JAX_ONLY_ON_CPU = ("triton",)


@pytest.hookimpl(tryfirst=True)  # before -m selects by the slow marker
def pytest_collection_modifyitems(items):
  """`slow_for(*names)`: the test is slow where it runs one of `names`;
  and the rule above. Tests marked `long` go first (in their order):
  pytest-xdist hands tests out in collection order, and a worker given
  a minute-long test last keeps the run going while the other idles."""
  on_cpu = api.platform() == "cpu"
  for item in items:
    implementation = _implementation_of(item)
    marker = item.get_closest_marker("slow_for")
    if marker is not None and implementation in marker.args:
      item.add_marker(pytest.mark.slow)
    if on_cpu and implementation in _GPU_JAX_ONLY_ON_CPU:
      for mark in GPU_JAX_ONLY:
        item.add_marker(mark)
  items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture
def strict_promotion():
  """JAX's strictest numpy modes, which JAX's own test harness uses: no
  implicit dtype promotion ("strict": bfloat16 + float32 is an error) and no
  implicit rank promotion (the suite's default already, set here as well so
  that the fixture stands alone). The library's internal dtype choices must
  not depend on the caller's promotion settings."""
  with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
    yield


# Every script module loaded, kept alive for the process: absl lets a
# module of the same name define its flags again only when it is another
# module object than the first, which it tells by id(); a collected
# module's id can be reused by the next one (a DuplicateFlagError that
# depended on garbage collection).
_SCRIPT_MODULES = []


@contextlib.contextmanager
def script_module(name):
  """scripts/<name>.py imported as a module, registered in sys.modules while
  in use (dataclasses look their module up).

  scripts/ is on sys.path while it loads, as when it runs as a script, so
  that it can import its sibling modules (scripts/bench/).
  """
  scripts = pathlib.Path(__file__).resolve().parents[1] / "scripts"
  spec = importlib.util.spec_from_file_location(
      name + "_script", scripts / (name + ".py"))
  module = importlib.util.module_from_spec(spec)
  _SCRIPT_MODULES.append(module)
  sys.modules[spec.name] = module
  sys.path.insert(0, str(scripts))
  try:
    spec.loader.exec_module(module)
    sys.path.remove(str(scripts))
    yield module
  finally:
    if str(scripts) in sys.path:
      sys.path.remove(str(scripts))
    sys.modules.pop(spec.name, None)
