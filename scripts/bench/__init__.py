"""The parts of scripts/benchmark.py: options, cells and report."""
