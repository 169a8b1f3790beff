"""`bench compare` on the real model: tiny workloads through two policies."""
from __future__ import annotations

import json

import pytest

from pagedserve.bench.compare import run_engine
from pagedserve.workload.datasets import random_dataset, shared_prefix_dataset
from pagedserve.entrypoints.cli import main
from pagedserve.model.loader import load_model

SMALL_KV = 16 << 20


@pytest.fixture(scope="module")
def loaded():
    return load_model()


def test_compare_cli_writes_results_per_policy(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    rc = main(["bench", "compare", "--policies", "naive,chunked", "--dataset-name", "random", "--num-prompts", "6",
               "--input-len", "16", "--output-len", "4", "--range-ratio", "0.5", "--kv-cache-memory", "16MiB",
               "--serial-prompts", "3", "--itl-target-ms", "200", "--out", str(out), "--plot", str(tmp_path / "plots")])
    assert rc == 0
    table = capsys.readouterr().out
    assert "x naive" in table and "chunked" in table
    data = json.loads(out.read_text())
    requests = random_dataset(6, 16, 4, 0.5)
    # naive serves one at a time, so --serial-prompts 3 gives it the first 3 requests only.
    assert list(data["results"]) == ["naive", "chunked", "chunked+target"] and data["setup"]["itl_target_ms"] == 200
    for policy, num in (("naive", 3), ("chunked", 6), ("chunked+target", 6)):
        s = data["results"][policy]
        for key in ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "kv_waste"):
            assert s[key] == s[key], f"{policy} {key} is NaN"
        assert s["total_output_tokens"] == sum(r.output_len for r in requests[:num])
        assert s["completed"] == num
    assert data["ratio_to_naive"]["naive"] == 1.0
    assert sorted(p.rsplit("/", 1)[-1] for p in data["setup"]["plots"]) == ["itl.png", "timeline.png", "ttft.png"]


def test_naive_runs_one_request_at_a_time_and_concurrency_caps_the_engine(loaded):
    requests = random_dataset(4, 12, 3, 0.0, seed=3)
    naive = run_engine(loaded, "naive", requests, kv_cache_memory=SMALL_KV)
    assert max(st.num_running for st in naive.steps) == 1
    capped = run_engine(loaded, "continuous", requests, max_concurrency=2, kv_cache_memory=SMALL_KV)
    assert max(st.num_running + st.num_waiting for st in capped.steps) <= 2
    assert all(r.num_tokens == 3 for r in capped.records)


def test_prefix_caching_and_fan_out_change_the_blocks_used(loaded):
    # Four requests sharing a 64-token system prompt (4 blocks of 16).
    requests = shared_prefix_dataset(4, 1, 64, 8, 2, seed=1)
    shared = run_engine(loaded, "chunked", requests, enable_prefix_caching=True, kv_cache_memory=SMALL_KV)
    private = run_engine(loaded, "chunked", requests, enable_prefix_caching=False, kv_cache_memory=SMALL_KV)
    assert shared.summary()["peak_blocks_used"] < private.summary()["peak_blocks_used"]
    fan = run_engine(loaded, "chunked", requests[:1], n=3, kv_cache_memory=SMALL_KV)
    assert fan.records[0].num_tokens == 3 * 2


def test_hf_baseline_generates_exactly_output_len_greedy_tokens(hf_model):
    from pagedserve.bench.compare import run_hf

    requests = random_dataset(2, 8, 3, 0.5, seed=5)
    run = run_hf(hf_model, requests)
    assert [r.num_tokens for r in run.records] == [r.output_len for r in requests]
    # One at a time: the second request's first token comes after the first's last.
    assert run.records[1].token_times[0] > run.records[0].token_times[-1]
    s = run.summary()
    assert s["output_throughput"] > 0 and s["mean_ttft_ms"] > 0


def test_hf_static_batches_in_arrival_order_and_counts_only_requested_tokens(hf_model):
    from pagedserve.bench.compare import run_hf_static

    requests = random_dataset(3, 8, 4, 0.0, seed=2)
    for req, n in zip(requests, (2, 5, 3)):
        req.output_len = n
    run = run_hf_static(hf_model, requests, max_concurrency=2)
    a, b, c = run.records
    assert [r.num_tokens for r in run.records] == [2, 5, 3]
    # Rows of one batch share every step; the short row stops counting, the batch runs on.
    assert a.token_times == b.token_times[:2]
    # The third request waits for the whole first batch, and its clock starts when its batch does.
    assert c.send_time >= b.token_times[-1] and c.token_times[0] > c.send_time
    assert a.send_time == b.send_time < a.token_times[0]
    s = run.summary()
    assert s["total_output_tokens"] == 10  # the first row's 3 extra steps are not output
    assert s["output_throughput"] == pytest.approx(10 / run.duration)
    assert s["kv_waste"] != s["kv_waste"]  # NaN: transformers has no paged pool to measure
    # Without a cap every arrived request is in one batch, clocks from arrival.
    whole = run_hf_static(hf_model, requests)
    assert whole.records[2].token_times[0] == whole.records[0].token_times[0]
    with pytest.raises(ValueError, match="max_concurrency"):
        run_hf_static(hf_model, requests, max_concurrency=0)
