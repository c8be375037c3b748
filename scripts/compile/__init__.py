"""The parts of scripts/compile_check.py: ptxas and XLA dump parsing."""
