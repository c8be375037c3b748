"""The parts of scripts/gpu_check.py: runner, environment, steps and report."""
