from __future__ import annotations

import pytest

from pagedserve.core import CacheConfig, SchedulerConfig


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 600, "max_num_batched_tokens": 512}, "max_num_seqs"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"policy": "greedy"}, "policy"),
        ({"enable_chunked_prefill": 1}, "enable_chunked_prefill"),
        ({"max_num_seqs": True}, "max_num_seqs"),
    ],
)
def test_scheduler_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 8, "block_size": 0}, "block_size"),
        ({"num_blocks": 8, "block_size": 4096}, "block_size"),
        ({"num_blocks": 8, "enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ],
)
def test_cache_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)


def test_defaults_follow_vllm():
    config = SchedulerConfig()
    assert (config.max_num_seqs, config.policy, config.scheduling_policy) == (128, "chunked", "fcfs")
    assert config.chunked_prefill
    cache = CacheConfig(num_blocks=10)
    assert (cache.block_size, cache.enable_prefix_caching, cache.num_slots) == (16, True, 160)


def test_disabling_chunked_prefill_downgrades_only_the_chunked_policy():
    assert not SchedulerConfig(enable_chunked_prefill=False).chunked_prefill
    assert not SchedulerConfig(policy="continuous").chunked_prefill
