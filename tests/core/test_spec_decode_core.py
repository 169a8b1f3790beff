"""Speculative decoding in the core: drafts scheduled as tokens, verified, rolled back.

The fake runner verifies greedily against its deterministic model, so whatever the
proposals, every request must produce exactly its reference output; the runner's
chained states catch any KV slot that rejected drafts leave wrong or any prefix-cache
entry made from unverified tokens.
"""
from __future__ import annotations

import random

import pytest

from fake_runner import Driver, make_scheduler, reference_output, true_continuation
from pagedserve.core import Request


def req(rid: str, prompt_len: int, max_tokens: int, base: int = 0, **kw) -> Request:
    return Request(rid, [base + i for i in range(prompt_len)], max_tokens, ignore_eos=True, **kw)


def noisy_proposer(k: int, p_right: float, seed: int = 0):
    """Proposes the true continuation, corrupted from a random position on."""
    rng = random.Random(seed)

    def propose(r: Request) -> list[int]:
        drafts = true_continuation(r, k)
        for i in range(k):
            if rng.random() > p_right:
                drafts[i:] = [rng.randrange(1000) for _ in range(k - i)]
                break
        return drafts[: rng.randint(0, k)]

    return propose


def test_all_accepted_drafts_advance_several_tokens_per_step():
    sched = make_scheduler(block_size=4)
    r = req("a", 6, 20)
    sched.add_request(r)
    driver = Driver(sched, propose=lambda r: true_continuation(r, 3))
    driver.step()  # prefill: no drafts
    out, updates = driver.step()
    (row,) = out.scheduled
    assert row.num_new_tokens == 4 and row.num_samples == 4 and len(row.draft_token_ids) == 3
    assert len(updates[0].new_token_ids) == 4  # 3 accepted + the bonus token
    assert r.num_computed_tokens == r.num_tokens - 1 and r.num_unverified_tokens == 0
    driver.run()
    assert driver.outputs["a"] == reference_output(r)
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def wrong_drafts(k: int):
    """Proposals that all differ from the token the model will produce."""
    return lambda r: [(true_continuation(r, 1)[0] + 1) % 1000] * k


def test_rejected_drafts_give_their_blocks_back_and_resync_the_runner_table():
    sched = make_scheduler(block_size=4)
    r = req("a", 4, 30)
    sched.add_request(r)
    driver = Driver(sched, propose=wrong_drafts(7))
    driver.step()
    out, updates = driver.step()
    (row,) = out.scheduled
    # Position 4 (the sampled token) + 7 drafts span blocks 1 and 2 (positions 4..11).
    assert row.num_new_tokens == 8 and len(row.new_block_ids) == 2
    assert len(updates[0].new_token_ids) == 1  # the first draft was wrong
    assert r.num_computed_tokens == 5 and len(sched.kv_cache.block_ids(r)) == 2
    sched.check_invariants()
    kept = sched.kv_cache.block_ids(r)
    out, _ = driver.step()
    # The runner still lists the two freed blocks: the next row carries the whole table.
    assert out.scheduled[0].block_ids[:2] == kept and not out.scheduled[0].is_new
    driver.run()
    assert driver.outputs["a"] == reference_output(r)


def test_drafts_respect_max_tokens_and_leave_budget_for_every_decode():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    driver = Driver(sched, propose=lambda r: true_continuation(r, 6))
    reqs = [req(f"r{i}", 2, 5, base=10 * i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    driver.step()  # all four prompts (8 tokens)
    while sched.has_unfinished_requests():
        num_running = len(sched.running)
        out, _ = driver.step()
        assert len(out.scheduled) == num_running  # drafts never crowd out a decode
        for row in out.scheduled:
            outputs_before = row.start + 1 - row.request.num_prompt_tokens
            assert len(row.draft_token_ids) <= row.request.max_tokens - outputs_before - 1
    for r in reqs:
        assert driver.outputs[r.request_id] == reference_output(r)


def test_unverified_tokens_never_reach_the_prefix_cache():
    sched = make_scheduler(block_size=4)
    a = req("a", 4, 6)
    sched.add_request(a)
    proposed: list[list[int]] = []

    def propose(r: Request) -> list[int]:
        proposed.append(wrong_drafts(3)(r))
        return proposed[-1]

    driver = Driver(sched, propose=propose)
    driver.step()
    driver.step()  # block 1 was filled by the sampled token and 3 rejected drafts
    assert sum(b.block_hash is not None for b in sched.kv_cache.pool.blocks) == 1  # the prompt's block
    # A prompt made of a's verified tokens and the rejected drafts must not hit block 1.
    probe = Request("probe", a.all_token_ids[:5] + proposed[0] + [1], 2, ignore_eos=True)
    assert sched.kv_cache.find_prefix_hit(probe).num_tokens == 4


@pytest.mark.parametrize("policy", ["chunked", "continuous"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_drafts_under_pressure_match_the_reference(policy, seed):
    """Shared prefixes, a pool small enough to preempt, n > 1 and noisy drafts."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=32, max_num_seqs=8, policy=policy)
    driver = Driver(sched, propose=noisy_proposer(5, 0.7, seed))
    shared = list(range(500, 512))
    reqs = []
    for i in range(14):
        prompt = (shared if i % 2 else []) + [1000 + 37 * i + j for j in range(rng.randint(1, 20))]
        reqs.append(Request(f"r{i}", prompt, rng.randint(1, 40), ignore_eos=True, n=2 if i % 5 == 0 else 1))
    arrivals: dict[int, list[Request]] = {}
    for i, r in enumerate(reqs):
        arrivals.setdefault(i // 3, []).append(r)
    driver.run(arrivals=arrivals)
    assert sched.num_preemptions > 0
    for r in reqs:
        for index in range(r.n):
            rid = r.request_id if index == 0 else f"{r.request_id}#{index}"
            assert driver.outputs[rid] == reference_output(r, index)
    sched.schedule()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
