"""What entered and left the prefix-cache index, in order, for observers outside the engine.

A router that knows which block hashes a replica holds can send a request where its
prefix is cached. The block pool appends to a log only while one is attached (nobody
subscribed: nothing recorded, one attribute test at the two points that change the
index); the owner drains it between steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

STORED = "stored"
REMOVED = "removed"


@dataclass(slots=True)
class KVEventLog:
    # (kind, block hash) in the order the index changed: a hash evicted and stored again
    # in one step must end up stored.
    events: list[tuple[str, bytes]] = field(default_factory=list)

    def stored(self, block_hash: bytes) -> None:
        self.events.append((STORED, block_hash))

    def removed(self, block_hash: bytes) -> None:
        self.events.append((REMOVED, block_hash))

    def drain(self) -> list[tuple[str, bytes]]:
        events, self.events = self.events, []
        return events
