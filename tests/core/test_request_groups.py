"""RequestGroups on its own: who belongs to a family or a beam group, when a group is
forgotten, and a beam group's seating and preemption rule."""
from __future__ import annotations

import pytest

from pagedserve.core import Request, RequestStatus
from pagedserve.core.beam_search import BeamCandidates, BeamGroup
from pagedserve.core.request_groups import RequestGroups

RUNNING = RequestStatus.RUNNING


def running(request: Request) -> Request:
    """A request whose prompt was computed (as the scheduler leaves it before its first sample)."""
    request.status = RUNNING
    request.num_computed_tokens = request.num_tokens
    return request


def beam_root(rid: str = "b", width: int = 3) -> Request:
    request = Request(rid, [1, 2, 3, 4, 5], 6, n=width)
    request.beam = BeamGroup(width, 6)
    return request


def test_a_family_lives_until_its_last_member_is_released():
    groups = RequestGroups()
    parent = running(Request("p", [1, 2, 3, 4, 5], 4, n=3))
    groups.add(parent)
    assert not groups and groups.children("p") == ()  # sampling parents join at their fork
    children = groups.fork(parent, block_size=4)
    assert [c.request_id for c in children] == ["p#1", "p#2"] and not parent.fork_pending
    assert [c.num_computed_tokens for c in children] == [5, 5]
    assert list(groups.children("p")) == children and groups.children("p#1") == ()
    live = {"p#1", "p#2"}
    groups.release(parent, live)
    assert list(groups.children("p")) == children  # aborting "p" must still reach its children
    live.discard("p#1")
    groups.release(children[0], live)
    groups.check_invariants(live)
    live.discard("p#2")
    groups.release(children[1], live)
    assert not groups
    groups.check_invariants(live)


def test_a_group_without_live_members_breaks_the_invariants():
    groups = RequestGroups()
    groups.add(beam_root())
    groups.check_invariants({"b"})
    with pytest.raises(AssertionError, match="outlived"):
        groups.check_invariants(set())


def test_a_preempted_beam_leaves_only_a_group_that_goes_on():
    groups = RequestGroups()
    root = running(beam_root())
    groups.add(root)
    assert not groups.leave_on_preempt(root)  # alone: preempted like any request
    assert not groups.leave_on_preempt(running(Request("x", [1], 2)))
    children = groups.fork(root, block_size=4)
    root.beam.scores = {0: -1.0, 1: -2.0, 2: -3.0}
    assert groups.leave_on_preempt(children[0])
    assert root.beam.scores == {0: -1.0, 2: -3.0}


def test_seating_moves_tokens_and_drops_the_empty_slots():
    groups = RequestGroups()
    root = running(beam_root())
    groups.add(root)
    step = groups.advance("b", BeamCandidates([0, 0, 0], [10, 11, 12], [-0.1, -0.2, -0.3]))
    assert step.root is root and step.live == [root] and len(step.continuations) == 3
    children = groups.fork(root, block_size=4)
    moves = groups.seat("b", step.continuations)
    assert [(m.index, s.index) for m, s in moves.moved] == [(1, 0), (2, 0)] and moves.dropped == []
    assert [m.output_token_ids for m in (root, *children)] == [[10], [11], [12]]
    # Next step only member 2's beam continues, twice: it keeps its slot, member 0 takes the
    # other continuation, and member 1 is dropped.
    step = groups.advance("b", BeamCandidates([2, 2], [20, 21], [-0.4, -0.5]))
    moves = groups.seat("b", step.continuations)
    assert [(m.index, s.index) for m, s in moves.moved] == [(0, 2)] and moves.dropped == [children[0]]
    assert root.output_token_ids == [12, 21] and children[1].output_token_ids == [12, 20]


def test_groups_need_a_layout_that_shares_blocks():
    with pytest.raises(ValueError, match="n > 1 needs kv_layout='paged'"):
        RequestGroups.validate(Request("p", [1], 2, n=2), supports_forks=False)
    with pytest.raises(ValueError, match="beam search needs kv_layout='paged'"):
        RequestGroups.validate(beam_root(width=1), supports_forks=False)
    RequestGroups.validate(beam_root(), supports_forks=True)
