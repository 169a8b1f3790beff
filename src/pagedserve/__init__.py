"""pagedserve: an LLM serving engine."""
