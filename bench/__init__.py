"""Benchmarks: damacy side by side with zarr-python and tensorstore on generated data."""
