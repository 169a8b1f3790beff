"""Speculative decoding's pure parts: the config, the n-gram proposer, the verification
rule and acceptance metrics. The model runner owns speculation (it builds the proposer,
worker/draft_model.py runs a draft model); the scheduling side (drafts as tokens, KV
rollback) lives in core/scheduler.py."""
