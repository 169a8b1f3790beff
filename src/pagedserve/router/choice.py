"""One routing decision, shared by `pagedserve router` (router/proxy.py) and the Ray Serve
request router (entrypoints/ray_serve/request_router.py): each replica that may take the
request becomes a policy Candidate (its load and the prompt tokens its prefix cache is
expected to hold), the policy picks one, and the prompt's blocks count as held there
until its KV events (or stats) say so."""
from __future__ import annotations

from collections.abc import Sequence

from .backends import Backend
from .routing_policies import Candidate, Picker
from .prompt_keys import PromptKeys


def choose_backend(picker: Picker, backends: Sequence[Backend], keys: PromptKeys, routed_ttl_s: float) -> Backend:
    """The backend among `backends` (non-empty: those that may take the request) that the policy picks."""
    candidates = []
    for i, b in enumerate(backends):
        hit = b.matched_blocks(keys.hashes(b.block_size)) * b.block_size if keys.token_ids and b.block_size else 0
        candidates.append(Candidate(i, b.in_flight, hit))
    chosen = picker.pick(candidates, len(keys.token_ids))
    backend = backends[chosen.index]
    backend.num_matched_tokens += chosen.hit_tokens
    if keys.token_ids and backend.block_size:
        backend.note_routed(keys.hashes(backend.block_size), routed_ttl_s)
    return backend
