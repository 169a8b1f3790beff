"""`predict` reads the Ray app's YAML and runs the cluster simulator on it (no Ray)."""
from __future__ import annotations

import pytest

from pagedserve.entrypoints.ray_serve.settings import RayServeConfig, predict
from pagedserve.workload.datasets import shared_prefix_dataset


def _config(policy: str, kv_cache_memory: str) -> RayServeConfig:
    return RayServeConfig.from_dict({"engine": {"kv_cache_memory": kv_cache_memory}, "replicas": {"num_replicas": 2},
                                     "router": {"policy": policy}})


def _hit_rate(policy: str, num_groups: int, kv_cache_memory: str = "128MiB") -> float:
    # The shape of test_ray_serve's shared-prefix run: 24 prompts, prefix 160, suffix 16, output 4.
    requests = shared_prefix_dataset(24, num_groups, 160, 16, 4)
    rows = predict(_config(policy, kv_cache_memory), requests, "llama-3.1-8b", "h100-sxm5", request_rate=8.0)
    assert len(rows) == 2
    return sum(r["hit_rate"] for r in rows) / len(rows)


def test_cache_aware_predicts_more_prefix_hits_than_round_robin():
    # 3 groups: round robin over 2 replicas scatters each group (with 4 it would pin them).
    assert _hit_rate("cache_aware", 3) == pytest.approx(0.795, abs=0.001)
    assert _hit_rate("round_robin", 3) == pytest.approx(0.682, abs=0.001)


def test_the_kv_pool_is_the_engine_sections():
    # llama-3.1-8b's KV is 128 KiB a token: 64MiB is 32 blocks a replica. Round robin puts all
    # three 10-block prefixes on each replica, where they evict one another; 128MiB holds them.
    assert _hit_rate("round_robin", 3, "64MiB") == pytest.approx(0.545, abs=0.001)
    assert _hit_rate("cache_aware", 3, "64MiB") == pytest.approx(0.795, abs=0.001)  # 2 prefixes fit


def test_the_documented_run_matches_the_measured_hit_rate():
    # docs/scale-out.md: the two-replica Ray run measured 0.758 on 4 groups.
    assert _hit_rate("cache_aware", 4) == pytest.approx(0.758, abs=0.01)


def test_a_misspelt_key_is_named():
    with pytest.raises(ValueError, match="num_replica"):
        RayServeConfig.from_dict({"replicas": {"num_replica": 2}})
