"""KV connectors, worker half: moving KV blocks between engine instances
(disaggregated prefill/decode). The scheduler half lives in core/kv_connector.py."""
