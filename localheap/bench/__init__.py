"""Benchmarks: each prints a human table and one JSON line, with ratios against stock
measured in the same run."""
