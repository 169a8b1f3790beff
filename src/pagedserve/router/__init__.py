"""Several pagedserve replicas behind one OpenAI-compatible endpoint (docs/router.md)."""
