"""Pieces of benchmarks/serve.py (load generation, CPU sampling, child processes)."""
