"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the
verification rule and acceptance metrics. The scheduling side (drafts as tokens,
KV rollback) lives in core/scheduler.py."""
