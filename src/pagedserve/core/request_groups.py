"""Requests that run as one group: a parallel-sampling parent (n > 1) and its forked
children, or a beam search's members.

Either kind is one request until its prompt is computed. At its first sample it forks
into n members (the beam width for a beam group) that share its blocks copy-on-write:
`fork` makes the children, the scheduler gives them the parent's blocks. From then on
this type knows which members belong together (by the root request's id) until the last
of them is released, and makes a beam group's per-step decisions: which member continues
which beam, and which members the group no longer needs. The scheduler owns everything
else about a member (its status, seats and rows) and makes every KV-cache call.
"""
from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from .beam_search import BeamCandidates
from .request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class BeamStep:
    """A beam group after one step's candidates: its root request (whose `beam` holds the
    result), the members live when the candidates arrived, and the live continuations
    (source member index, token, cumulative logprob), best first; none once `beam.done`."""

    root: Request
    live: list[Request]
    continuations: list[tuple[int, int, float]]


@dataclass(frozen=True, slots=True)
class BeamMoves:
    """How a group's members took up its continuations: in each (member, source) pair the
    member became the source's beam (its block table must become a share of the
    source's); the `dropped` members hold no beam any more."""

    moved: list[tuple[Request, Request]]
    dropped: list[Request]


class RequestGroups:
    def __init__(self) -> None:
        # Root request id -> the members in member-index order: a beam group's root alone
        # until it forks, a sampling parent's family from its fork on. Kept until every
        # member is released, so aborting the root id still reaches its children.
        self._members: dict[str, list[Request]] = {}

    def __len__(self) -> int:
        """Groups with a member not yet released."""
        return len(self._members)

    @staticmethod
    def validate(request: Request, supports_forks: bool) -> None:
        """Refuse a group the KV layout cannot run: its members must share blocks."""
        rid = request.request_id
        if request.beam is not None and not supports_forks:
            raise ValueError(f"request {rid}: beam search needs kv_layout='paged' (beams share pages, which the "
                             "contiguous layout cannot)")
        if request.n > 1 and not supports_forks:
            raise ValueError(f"request {rid}: n > 1 needs kv_layout='paged' (forked samples share pages, "
                             "which the contiguous layout cannot)")

    def add(self, request: Request) -> None:
        """A new request: a beam group's root is its first member."""
        if request.beam is not None:
            self._members[request.request_id] = [request]

    def fork(self, parent: Request, block_size: int) -> list[Request]:
        """Split a parent at its first sample: its n - 1 children, which share its
        computed prefix (the caller gives them its blocks and rows)."""
        parent.fork_pending = False
        children = [parent.make_child(i, block_size) for i in range(1, parent.n)]
        self._members[parent.request_id] = [parent, *children]
        return children

    def children(self, request_id: str) -> Sequence[Request]:
        """The forked children of the request with this id; none unless it forked."""
        members = self._members.get(request_id)
        return members[1:] if members is not None else ()

    def live_beams(self, root_id: str) -> list[Request]:
        return [m for m in self._members.get(root_id, ()) if m.status is RequestStatus.RUNNING]

    def leave_on_preempt(self, member: Request) -> bool:
        """A beam picked for preemption leaves its group when the group has other live
        beams (True): a beam cannot rejoin its group after a recompute, so the group goes
        on without it. Otherwise (False) it is preempted like any request."""
        if member.beam is None or len(self.live_beams(member.parent_id or member.request_id)) <= 1:
            return False
        member.beam.scores.pop(member.index, None)
        return True

    def advance(self, root_id: str, candidates: BeamCandidates) -> BeamStep | None:
        """Apply one step's candidates to the group; None when no member is live (it was
        aborted since the step was scheduled)."""
        live = self.live_beams(root_id)
        if not live:
            return None
        continuations = live[0].beam.advance(candidates, {m.index: m.output_token_ids for m in live})
        return BeamStep(self._members[root_id][0], live, continuations)

    def seat(self, root_id: str, continuations: list[tuple[int, int, float]]) -> BeamMoves:
        """Seat the live continuations in the group's live members: a member that continues
        another beam adopts that beam's tokens; every seated member gains its token."""
        live = self.live_beams(root_id)
        by_index = {m.index: m for m in live}
        placements, empty = live[0].beam.place(continuations, sorted(by_index))
        moved = [(by_index[p.slot], by_index[p.source]) for p in placements if p.slot != p.source]
        # Every source's tokens as they were before any member adopts (a source may move too).
        states = [source.token_state() for _, source in moved]
        for (member, _), state in zip(moved, states):
            member.adopt(state)
        for p in placements:
            by_index[p.slot].append_output_token(p.token)
        return BeamMoves(moved, [by_index[slot] for slot in empty])

    def release(self, request: Request, live_ids: Container[str]) -> None:
        """The request was released: forget its group once no member is live."""
        root = request.parent_id or request.request_id
        members = self._members.get(root)
        if members is not None and all(m.request_id not in live_ids for m in members):
            del self._members[root]

    def check_invariants(self, live_ids: Container[str]) -> None:
        for root, members in self._members.items():
            if all(m.request_id not in live_ids for m in members):
                raise AssertionError(f"request group {root} outlived its members")
