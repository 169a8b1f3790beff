"""The waiting queue and the preemption victim rule, for each scheduling_policy.

fcfs: arrival order; a preempted request goes back to the very front; the victim
is the most recently admitted running request.
priority: lowest `priority` value first, then earliest arrival (vLLM's order); a
preempted request re-enters at its own place in that order; the victim is the
running request with the largest priority value, then the latest arrival.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from .request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request | None: ...
    def remove(self, request: Request) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...

    @staticmethod
    def pick_victim(running: list[Request]) -> Request: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def remove(self, request: Request) -> bool:
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
            return True
        try:
            self._queue.remove(request)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    @staticmethod
    def pick_victim(running: list[Request]) -> Request:
        # `running` is in admission order (forked children sit right after their parent).
        return running[-1]


class PriorityQueue:
    """A heap keyed (priority, arrival_time, insertion order), with lazy removal."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[int, int] = {}  # id(request) -> its heap entry's sequence number
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        seq = next(self._counter)
        self._live[id(request)] = seq
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))

    # Priority order already puts a preempted request where it belongs.
    prepend = add

    def _prune(self) -> None:
        heap = self._heap
        while heap and self._live.get(id(heap[0][3])) != heap[0][2]:
            heapq.heappop(heap)

    def peek(self) -> Request | None:
        self._prune()
        return self._heap[0][3] if self._heap else None

    def remove(self, request: Request) -> bool:
        if self._live.pop(id(request), None) is None:
            return False
        self._prune()
        return True

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        live = [entry for entry in self._heap if self._live.get(id(entry[3])) == entry[2]]
        return (entry[3] for entry in sorted(live, key=lambda e: e[:3]))

    @staticmethod
    def pick_victim(running: list[Request]) -> Request:
        # Ties on (priority, arrival) go to the most recently admitted.
        best = 0
        best_key = (running[0].priority, running[0].arrival_time)
        for i in range(1, len(running)):
            r = running[i]
            key = (r.priority, r.arrival_time)
            if key >= best_key:
                best, best_key = i, key
        return running[best]


def make_waiting_queue(scheduling_policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if scheduling_policy == "priority" else FCFSQueue()
