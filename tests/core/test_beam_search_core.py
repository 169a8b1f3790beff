"""Beam search in the core: transformers' rules in BeamGroup, and beams that fork, re-point
and drop blocks in the scheduler, checked by the fake runner's cache (a wrong block changes
what it reads) and by block accounting."""
from __future__ import annotations

import random

import pytest

from fake_runner import Driver, make_scheduler
from test_contiguous_kv import contiguous_scheduler
from pagedserve.core import Request
from pagedserve.core.beam_search import BeamCandidates, BeamGroup

VOCAB = 1000


def _candidates(group: BeamGroup, seeds: dict[int, int]) -> BeamCandidates:
    """A fake model's best continuations: member i (whose runner-computed prefix gave
    `seeds[i]`) continues with tokens and logprobs drawn from that seed alone."""
    triples = []
    for index, seed in seeds.items():
        rng = random.Random(seed)
        for token in rng.sample(range(VOCAB), group.num_candidates):
            triples.append((group.scores[index] - rng.expovariate(1.0), -index, index, token))
    triples.sort(reverse=True)
    best = triples[: group.num_candidates]
    return BeamCandidates([t[2] for t in best], [t[3] for t in best], [t[0] for t in best])


def run_beams(driver: Driver, roots: list[Request]) -> None:
    """The engine loop with beam candidates from the fake runner's own computed states."""
    sched = driver.scheduler
    for _ in range(500):
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()
        sched.check_invariants()
        sampled = driver.runner.execute(out)
        beams: dict[str, dict[int, int]] = {}
        for row in out.scheduled:
            if row.request.beam is not None and row.num_samples:
                beams.setdefault(row.request.parent_id or row.request_id, {})[row.request.index] = sampled[row.request_id][0]
        groups = {r.request_id: r.beam for r in roots}
        sched.update(out, sampled, {rid: _candidates(groups[rid], seeds) for rid, seeds in beams.items()})
        sched.check_invariants()
    raise AssertionError("beam search did not finish")


def beam_request(rid: str, prompt: list[int], width: int = 3, max_tokens: int = 8, **group) -> Request:
    request = Request(rid, prompt, max_tokens, n=width, eos_token_id=7, stop_token_ids=frozenset({7}))
    request.beam = BeamGroup(width, max_tokens, stop_token_ids=frozenset({7}), **group)
    return request


def test_hypotheses_score_by_generated_length_and_keep_the_best_width():
    group = BeamGroup(2, 10, length_penalty=2.0, stop_token_ids=frozenset({0}))
    group.num_generated = 3
    # Best first: (source, token, cumulative). Two stops among the best two, one further down.
    live = group.advance(BeamCandidates([0, 1, 0, 1], [0, 5, 6, 0], [-1.0, -2.0, -3.0, -0.5]), {0: [9, 9, 9], 1: [8, 8, 8]})
    # Only stops among the best `width` candidates are kept as hypotheses: length 4 (the stop counted).
    assert [(h.token_ids, h.score) for h in group.hypotheses] == [((9, 9, 9, 0), -1.0 / 16)]
    assert live == [(1, 5, -2.0), (0, 6, -3.0)]
    assert not group.done


def test_early_stopping_true_ends_once_width_hypotheses_finished():
    group = BeamGroup(1, 10, early_stopping=True, stop_token_ids=frozenset({0}))
    assert group.advance(BeamCandidates([0, 0], [0, 4], [-0.1, -0.2]), {0: []}) == []
    assert group.done and group.hypotheses[0].finish_reason == "stop"


def test_the_heuristic_stops_when_no_running_beam_can_catch_up():
    # early_stopping False compares at the current length: -3/1 cannot beat -0.1.
    group = BeamGroup(1, 10, stop_token_ids=frozenset({0}))
    group.advance(BeamCandidates([0, 0], [0, 4], [-0.1, -3.0]), {0: []})
    assert group.done and not group.improvable
    # "never" with a positive penalty bounds it at max_tokens: -3/10 can still beat -0.5.
    group = BeamGroup(1, 10, early_stopping="never", stop_token_ids=frozenset({0}))
    assert group.advance(BeamCandidates([0, 0], [0, 4], [-0.5, -3.0]), {0: []}) == [(0, 4, -3.0)]


def test_max_tokens_turns_the_best_width_into_length_hypotheses():
    group = BeamGroup(2, 1)
    assert group.advance(BeamCandidates([0, 0, 0, 0], [3, 4, 5, 6], [-1.0, -2.0, -3.0, -4.0]), {0: []}) == []
    assert [(h.token_ids, h.finish_reason) for h in group.hypotheses] == [((3,), "length"), ((4,), "length")]


def test_placement_keeps_beams_in_their_own_slot_and_drops_the_rest():
    group = BeamGroup(3, 10)
    placements, empty = group.place([(2, 11, -1.0), (2, 12, -1.5)], [0, 1, 2])
    assert [(p.slot, p.source, p.token) for p in placements] == [(2, 2, 11), (0, 2, 12)]
    assert empty == [1] and group.scores == {2: -1.0, 0: -1.5}


@pytest.mark.parametrize("bad", [dict(width=0, max_tokens=4), dict(width=2, max_tokens=4, early_stopping="soon")])
def test_bad_groups_are_refused(bad):
    with pytest.raises(ValueError):
        BeamGroup(**bad)


def test_beams_share_the_prompt_and_repoint_blocks_without_copying_it():
    sched = make_scheduler(num_blocks=64, block_size=4)
    driver = Driver(sched)
    root = beam_request("b", list(range(100, 118)), width=3, max_tokens=9)  # 18 tokens: 4 full blocks + 2
    sched.add_request(root)
    out = sched.schedule()
    sampled = driver.runner.execute(out)
    sched.update(out, {}, {"b": _candidates(root.beam, {0: sampled["b"][0]})})
    members = [m for m in sched.running]
    assert len(members) == 3
    tables = [sched.kv_cache.block_ids(m) for m in members]
    # The four full prompt blocks are one set of blocks, held by every beam.
    assert len({t[:4] for t in tables}) == 1
    assert sched.kv_cache.num_blocks - sched.kv_cache.num_free_blocks == 5
    run_beams(driver, [root])
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    assert root.beam.done and 1 <= len(root.beam.hypotheses) <= 3
    assert not sched.groups


def test_beams_alone_equal_beams_in_a_busy_batch():
    def run(extra: int) -> list[tuple[int, ...]]:
        sched = make_scheduler(num_blocks=200, block_size=4, max_num_seqs=16)
        driver = Driver(sched)
        root = beam_request("b", list(range(50, 61)), width=4, max_tokens=10)
        others = [Request(f"r{i}", list(range(i, i + 5 + i)), 6 + i % 3, n=1 + i % 2, ignore_eos=True)
                  for i in range(extra)]
        for r in [*others[:2], root, *others[2:]]:
            sched.add_request(r)
        run_beams(driver, [root])
        assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
        return [h.token_ids for h in root.beam.hypotheses]

    assert run(0) == run(6)


def test_abort_mid_search_frees_every_block():
    sched = make_scheduler(num_blocks=64, block_size=4)
    driver = Driver(sched)
    root = beam_request("b", list(range(30, 40)), width=3, max_tokens=12)
    sched.add_request(root)
    for _ in range(3):
        out = sched.schedule()
        sampled = driver.runner.execute(out)
        seeds = {r.request.index: sampled[r.request_id][0] for r in out.scheduled}
        sched.update(out, {}, {"b": _candidates(root.beam, seeds)})
    assert len(sched.running) == 3
    assert {m.request_id for m in sched.abort("b")} == {"b", "b#1", "b#2"}
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    sched.check_invariants()


def test_a_preempted_beam_is_dropped_and_the_group_finishes():
    # Too few blocks for three beams to grow: members are dropped rather than recomputed.
    sched = make_scheduler(num_blocks=9, block_size=4, enable_prefix_caching=False)
    driver = Driver(sched)
    root = beam_request("b", list(range(30, 42)), width=3, max_tokens=14)
    sched.add_request(root)
    run_beams(driver, [root])
    assert sched.num_preemptions > 0
    assert root.beam.done and root.beam.hypotheses
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_the_contiguous_layout_refuses_beams():
    sched, _ = contiguous_scheduler(memory_pages=12)
    with pytest.raises(ValueError, match="beam search needs kv_layout='paged'"):
        sched.add_request(beam_request("b", list(range(4)), width=1, max_tokens=2))
    assert not sched.requests
