"""Routers in front of several pagedserve instances: replicas behind one endpoint
(docs/router.md) and disaggregated prefill/decode (docs/disaggregated.md)."""
