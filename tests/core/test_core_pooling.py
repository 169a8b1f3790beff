"""Pooling requests in the scheduler: prefill-only rows in the token budget that never
sample, finish when the prompt is computed, reserve only the prompt, take prefix-cache
hits unless told not to, and leave no block behind."""
from __future__ import annotations

import pytest

from fake_runner import Driver, make_scheduler, reference_output
from pagedserve.core import Request, RequestStatus


def pooled(rid: str, prompt_len: int, base: int = 0, pooling: str = "last", **kw) -> Request:
    return Request(rid, [base + i for i in range(prompt_len)], max_tokens=1, pooling=pooling, **kw)


@pytest.mark.parametrize("policy", ["chunked", "continuous", "static"])
def test_a_pooling_request_is_prefill_only_beside_generation(policy):
    sched = make_scheduler(max_num_batched_tokens=8 if policy == "chunked" else 64, max_num_seqs=4, policy=policy)
    driver = Driver(sched)
    gen = Request("g", list(range(500, 506)), 5, ignore_eos=True)
    sched.add_request(gen)
    sched.add_request(pooled("p", 20))
    driver.run()
    rows = [r for out in driver.history for r in out.scheduled if r.request_id == "p"]
    assert sum(r.num_new_tokens for r in rows) == 20 and all(r.num_samples == 0 for r in rows)
    assert (len(rows) > 2) if policy == "chunked" else (len(rows) == 1)  # chunks beside the decodes
    assert driver.outputs["p"] == [] and driver.finish_reasons["p"] == "stop"
    assert driver.outputs["g"] == reference_output(gen)
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    assert not sched.requests and not sched.padding


def test_a_pooling_request_reserves_only_its_prompt():
    sched = make_scheduler(max_model_len=16)
    sched.add_request(pooled("p", 16))
    with pytest.raises(ValueError, match=r"prompt \(16 tokens\) \+ max_tokens \(1\) = 17 exceeds max_model_len"):
        sched.add_request(Request("g", list(range(16)), 1))
    with pytest.raises(ValueError, match=r"prompt \(17 tokens\) exceeds max_model_len \(16\)"):
        sched.add_request(pooled("q", 17))
    with pytest.raises(ValueError, match="pooling must be one of"):
        pooled("x", 4, pooling="max")
    with pytest.raises(ValueError, match="n must be 1"):
        pooled("x", 4, n=2)


@pytest.mark.parametrize("skip", [False, True], ids=["last-takes-hits", "mean-skips-the-cache"])
def test_prefix_cache_hits_serve_last_pooling_and_the_last_token_is_recomputed(skip):
    sched = make_scheduler(block_size=4)
    driver = Driver(sched)
    sched.add_request(pooled("a", 12))
    driver.run()
    sched.add_request(pooled("b", 12, skip_prefix_cache=skip))
    out, updates = driver.step()
    (row,) = out.scheduled
    # Fully cached, the prompt's last block is still computed: its last token's state is what pools.
    assert (row.start, row.num_new_tokens) == ((0, 12) if skip else (8, 4))
    assert [(u.request_id, u.finished) for u in updates] == [("b", RequestStatus.FINISHED_STOPPED)]
    driver.run()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_an_aborted_pooling_request_frees_its_blocks_mid_prefill():
    sched = make_scheduler(max_num_batched_tokens=8)
    driver = Driver(sched)
    sched.add_request(pooled("p", 30))
    driver.step()
    assert sched.kv_cache.num_free_blocks < sched.kv_cache.num_blocks
    sched.abort("p")
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks and not sched.requests
