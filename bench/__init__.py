"""Benchmark scripts: each prints a table with its baseline measured in the same run."""
