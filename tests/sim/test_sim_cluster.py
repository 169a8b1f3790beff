"""The cluster simulator: deterministic for a seed, KV transfers priced at bytes /
bandwidth, decode instances admitting transferred prompts as prefix hits without
leaking a block, and DistServe's ordering: disaggregation wins goodput under a tight
TTFT + TPOT SLO and loses it under a relaxed one."""
from __future__ import annotations

import pytest

from pagedserve.sim.cluster import KV_LINKS, ClusterSetup, Layout, kv_transfer_seconds, max_goodput, simulate_cluster
from pagedserve.sim.models import MODELS
from pagedserve.workload.datasets import BenchRequest, random_dataset
from pagedserve.workload.serving_stats import SLO

SETUP = ClusterSetup("llama-3.1-8b", "h100-sxm5")


def test_layouts_parse_and_refuse_nonsense():
    assert Layout.parse("4r") == Layout("4r", num_replicas=4)
    assert Layout.parse("2p3d:tp2").num_gpus == 10
    for bad in ("", "4", "0r", "0p2d", "2p0d", "2r:tp0", "1p1d:tp"):
        with pytest.raises(ValueError, match="layout"):
            Layout.parse(bad)
    with pytest.raises(ValueError, match="link"):
        ClusterSetup("llama-3.1-8b", "h100-sxm5", link="carrier-pigeon")


def test_same_seed_same_run_and_every_block_back():
    requests = random_dataset(40, 512, 32, 0.5, seed=3)
    runs = [simulate_cluster(requests, Layout.parse(spec), SETUP, 20.0) for spec in ("2p2d", "2p2d", "4r")]
    assert [r.token_times for r in runs[0].records] == [r.token_times for r in runs[1].records]
    other_seed = simulate_cluster(requests, Layout.parse("2p2d"), ClusterSetup("llama-3.1-8b", "h100-sxm5", seed=1),
                                  20.0)
    assert [r.send_time for r in other_seed.records] != [r.send_time for r in runs[0].records]
    for run in runs:
        assert all(len(r.token_times) == r.output_len for r in run.records)
        for sched in run.schedulers:
            sched.check_invariants()
            assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks and not sched.requests


@pytest.mark.parametrize("link", ["nvlink", "rdma-100"])
def test_disaggregation_adds_the_transfer_time_and_decode_hits_the_sent_blocks(link):
    prompt_len = 1000
    request = BenchRequest(list(range(7, 7 + prompt_len)), 3)
    colocated = simulate_cluster([request], Layout.parse("1r"), SETUP, float("inf"))
    split = simulate_cluster([request], Layout.parse("1p1d"), ClusterSetup("llama-3.1-8b", "h100-sxm5", link=link),
                             float("inf"))
    kv_bytes = prompt_len * MODELS["llama-3.1-8b"].kv_bytes_per_token(2)
    assert split.kv_transfer_bytes == int(kv_bytes)
    assert split.kv_transfer_seconds == pytest.approx(kv_bytes / KV_LINKS[link])
    assert kv_transfer_seconds(prompt_len, kv_bytes / prompt_len, link) == pytest.approx(kv_bytes / KV_LINKS[link])
    # The same prefill, so the same first token; then the transfer, then the decode
    # instance's first step: the 8-token tail past 62 full blocks plus the sampled token.
    (c,), (s,) = colocated.records, split.records
    assert s.token_times[0] == pytest.approx(c.token_times[0])
    decode_sched = split.schedulers[1]
    assert decode_sched.kv_cache.prefix_cache_hits == (prompt_len // 16) * 16 and split.num_recomputed == 0
    gap = s.token_times[1] - s.token_times[0]
    tail_step = SETUP.scenario(1).cost.cost([(prompt_len % 16 + 1, (prompt_len // 16) * 16)], 1).seconds
    assert gap == pytest.approx(split.kv_transfer_seconds + tail_step)


def test_disaggregation_wins_tight_slos_and_loses_relaxed_ones():
    """Long prompts on two H100s: one colocated replica per GPU vs one prefill + one
    decode instance. Under a TPOT SLO near the pure-decode step time, every prefill
    chunk in a colocated decode batch breaks it, and P/D keeps decodes clean; with room
    in the SLO, colocation's two GPUs of prefill capacity win."""
    requests = random_dataset(48, 2048, 128, 0.5, seed=0)
    tight, relaxed = SLO(0.5, 0.010), SLO(2.0, 0.1)
    good = {(spec, name): max_goodput(requests, Layout.parse(spec), SETUP, slo, iterations=6, hi=128.0)
            for spec in ("2r", "1p1d") for name, slo in (("tight", tight), ("relaxed", relaxed))}
    assert good["1p1d", "tight"] > good["2r", "tight"], good
    assert good["2r", "relaxed"] > good["1p1d", "relaxed"], good
