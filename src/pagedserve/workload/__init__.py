"""Workloads and their per-request records: what the benchmarks send and the simulator
replays, and how both summarise the outcome. Pure Python, below both bench/ and sim/."""
