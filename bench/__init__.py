"""Benchmarks of the gateway and the store: runnable scripts (`python -m bench.<name>`), not tests."""
