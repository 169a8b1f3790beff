"""Paged attention backends: write new K/V into the block cache, attend over block tables."""
