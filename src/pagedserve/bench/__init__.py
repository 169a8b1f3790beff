"""Workload generators shared by `pagedserve sim` and the load generator (no torch)."""
