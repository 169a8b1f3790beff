import argparse
import json

import pytest

from pagedserve.workload.datasets import (FIRST_TOKEN_ID, SHAREGPT_MEAN_INPUT, add_dataset_args, dataset_from_args,
                                       jsonl_dataset, mixed_dataset, random_dataset, shared_prefix_dataset,
                                       sharegpt_like_dataset)


def test_random_lengths_ranges_and_determinism():
    a = random_dataset(50, 100, 20, 0.5, vocab_size=500, seed=7)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in a)
    assert all(FIRST_TOKEN_ID <= t < 500 for r in a for t in r.prompt_token_ids)
    b = random_dataset(50, 100, 20, 0.5, vocab_size=500, seed=7)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert random_dataset(3, 10, 5)[0].prompt_len == 10


def test_mixed_has_a_long_prompt_every_kth():
    reqs = mixed_dataset(32, 100, 4000, 8, 10)
    long_ones = [i for i, r in enumerate(reqs, 1) if r.prompt_len == 4000]
    assert long_ones == [8, 16, 24, 32]


def test_shared_prefix_groups_share_identical_ids():
    reqs = shared_prefix_dataset(12, 3, 64, 8, 4)
    for i, r in enumerate(reqs):
        assert r.prompt_token_ids[:64] == reqs[i % 3].prompt_token_ids[:64]
    assert reqs[0].prompt_token_ids[:64] != reqs[1].prompt_token_ids[:64]


def test_sharegpt_like_means():
    reqs = sharegpt_like_dataset(4000, max_len=100_000)
    mean_in = sum(r.prompt_len for r in reqs) / len(reqs)
    assert mean_in == pytest.approx(SHAREGPT_MEAN_INPUT, rel=0.1)


def test_jsonl_and_shared_args(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "output_len": 4}) + "\n"
                    + json.dumps({"prompt_len": 9, "output_len": 2, "arrival_time": 1.5}) + "\n")
    reqs = jsonl_dataset(path)
    assert [r.prompt_len for r in reqs] == [3, 9] and reqs[1].arrival_time == 1.5
    p = argparse.ArgumentParser()
    add_dataset_args(p)
    args = p.parse_args(["--dataset-name", "jsonl", "--dataset-path", str(path)])
    assert len(dataset_from_args(args)) == 2
    path.write_text(json.dumps({"output_len": 4}) + "\n")
    with pytest.raises(ValueError, match="prompt_token_ids or prompt_len"):
        jsonl_dataset(path)
    with pytest.raises(ValueError, match="range_ratio"):
        random_dataset(1, 10, 10, 1.5)
