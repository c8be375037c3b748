"""Tests of multi-device training in models.train_lib (data x sequence mesh).

The device count of the CPU platform is fixed when jax is first imported, so
the checks run `tests/_train_sharded_worker.py` in a fresh process with 8
simulated CPU devices and fail with its output when it fails: one training
step's loss and gradients on a data=2 x sequence=4 mesh (and on a padded
synthetic task) equal the single-device step, bad splits raise UsageError,
and a short sharded run lowers the loss.
"""

import os
import subprocess
import sys

import pytest

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "_train_sharded_worker.py")
_TIMEOUT_S = 300


# Slow (a fresh 8-device process): CI runs it in its slow-test leg.
@pytest.mark.long
@pytest.mark.slow
def test_sharded_training_matches_single_device_and_learns(tmp_path):
  # The worker inherits the suite's XLA_FLAGS (`conftest._compile_cheaply`:
  # compiling dominates these tiny steps) and adds the device count.
  proc = subprocess.run(
      [sys.executable, _WORKER, str(tmp_path)], capture_output=True,
      text=True, timeout=_TIMEOUT_S, check=False,
  )
  assert proc.returncode == 0, (
      f"worker failed (rc={proc.returncode}):\n{proc.stdout}\n"
      f"{proc.stderr[-6000:]}"
  )
  for check in ("validation", "text step on data=2 x sequence=4",
                "sort step on data=2 x sequence=2", "sharded training"):
    assert f"ok {check}" in proc.stdout, proc.stdout
