"""The engine-thread side of the live dashboard: step records and block-map frames.

Nothing here runs unless a page is watching: the engine thread reads one flag per
step. While watched, it records each step's split of the token budget (sums over
the step's rows) and, when the server asks for a frame (a few times a second), it
builds one from the KV cache's block map (reference counts, prefix-cache index) and
its tables, as numpy arrays filled in C, never a Python loop per block.
A frame is plain JSON-able data; prompt text is in it only with `show_prompts`.
"""
from __future__ import annotations

import itertools

import numpy as np

from ..core.kv_cache import BlockMap, KVCache
from .llm_engine import LLMEngine

# One character per block in a frame's map, in increasing precedence.
FREE, CACHED, USED, SHARED, COPIED = "f", "c", "u", "s", "w"
_CODES = np.frombuffer((FREE + CACHED + USED + SHARED + COPIED).encode(), dtype=np.uint8)
# Queues can hold hundreds of requests; a page shows the head of each.
MAX_LISTED_REQUESTS = 64
# Enough of a prompt to recognise it on the page.
PROMPT_PREVIEW_TOKENS = 48
# Steps kept between two frames if the page falls behind (a frame drains them).
MAX_PENDING_STEPS = 256


class DashboardFeed:
    """Owned by the engine thread, except `watched`, which the event loop sets."""

    def __init__(self, show_prompts: bool = False):
        self.show_prompts = show_prompts
        # A bool written by the event loop and read by the engine thread: no lock needed.
        self.watched = False
        self._frame_ids = itertools.count()
        self._num_steps = 0
        self._steps: list[dict] = []
        self._copied: list[int] = []
        self._last_fingerprint: tuple[int, int, int, bool] | None = None
        self._prompts: dict[str, str] = {}

    def watch(self, watched: bool) -> None:
        """Called on the event loop when the first page opens or the last one closes."""
        if watched:
            # Requests may have come and gone unrecorded: the next frame must be built,
            # and steps or copies left from an earlier page are stale.
            self._last_fingerprint = None
            self._steps, self._copied = [], []
        self.watched = watched

    # -- per step, while watched ----------------------------------------------------------

    def record_step(self, engine: LLMEngine, seconds: float) -> None:
        """Split the step just run into decode rows, prefill chunks and draft tokens."""
        out = engine.last_scheduled
        self._num_steps += 1
        if out is None:
            return
        decode = prefill = draft = 0
        for row in out.scheduled:
            drafts = len(row.draft_token_ids)
            computed = row.num_new_tokens - drafts
            draft += drafts
            # A decode computes the one token sampled last step, which sits past the prompt.
            if computed == 1 and row.start >= row.request.num_prompt_tokens:
                decode += 1
            else:
                prefill += computed
        self._copied.extend(dst for _, dst in out.block_copies)
        if len(self._steps) >= MAX_PENDING_STEPS:
            del self._steps[0]
        self._steps.append({
            "ms": round(seconds * 1000, 3), "decode": decode, "prefill": prefill,
            "draft": draft, "budget": engine.scheduler.config.max_num_batched_tokens, "rows": len(out.scheduled),
        })

    # -- on request ------------------------------------------------------------------------

    def build_frame(self, engine: LLMEngine) -> dict | None:
        """The engine's state now, or None when nothing changed since the last frame."""
        scheduler = engine.scheduler
        kv = scheduler.kv_cache
        fingerprint = (self._num_steps, kv.num_free_blocks, len(scheduler.requests), engine.speculate)
        if fingerprint == self._last_fingerprint:
            return None
        self._last_fingerprint = fingerprint
        block_map = kv.block_map()
        if block_map is None:
            # No pool to draw (the contiguous layout's regions): the tables are listed as sequences.
            blocks = {"state": "", "owner": [], "ref": []}
            seqs = [{"id": rid, "tokens": n, "blocks": len(ids)} for rid, (ids, n) in kv.block_tables().items()]
        else:
            blocks, seqs = self._draw(kv, block_map)
        steps, self._steps = self._steps, []
        return {
            "frame": next(self._frame_ids),
            "num_steps": self._num_steps,
            "block_size": kv.block_size,
            "blocks": blocks,
            "seqs": seqs,
            "requests": self._requests(engine),
            "steps": steps,
            "stats": engine.stats(),
            "speculating": engine.speculate,
        }

    def _draw(self, kv: KVCache, block_map: BlockMap) -> tuple[dict, list[dict]]:
        """The pool's block map (state, owner, ref count per block) and its sequences."""
        ref = np.frombuffer(block_map.ref_counts, dtype=np.intc)
        code = np.where(ref > 1, 3, np.where(ref > 0, 2, 0)).astype(np.uint8)
        cached = np.frombuffer(block_map.cached_block_ids, dtype=np.intc)
        code[cached[ref[cached] == 0]] = 1
        if self._copied:
            copied = np.asarray(self._copied, dtype=np.intc)
            code[copied[ref[copied] > 0]] = 4
            self._copied = []
        owner = np.full(len(ref), -1, dtype=np.intc)
        seqs = []
        for i, (request_id, (block_ids, num_tokens)) in enumerate(kv.block_tables().items()):
            owner[np.frombuffer(block_ids, dtype=np.intc)] = i
            seqs.append({"id": request_id, "tokens": num_tokens, "blocks": len(block_ids)})
        return {"state": _CODES[code].tobytes().decode(), "owner": owner.tolist(), "ref": ref.tolist()}, seqs

    def _requests(self, engine: LLMEngine) -> list[dict]:
        scheduler = engine.scheduler
        listed = list(itertools.islice(scheduler.running, MAX_LISTED_REQUESTS))
        listed += itertools.islice(scheduler.waiting, MAX_LISTED_REQUESTS)
        prompts = {}
        rows = []
        for r in listed:
            row = {
                "id": r.request_id,
                "state": r.status.name.lower(),  # running, waiting or preempted
                "prompt_tokens": r.num_prompt_tokens,
                "computed": min(r.num_computed_tokens, r.num_prompt_tokens),
                "output_tokens": r.num_output_tokens,
                "max_tokens": r.max_tokens,
            }
            if self.show_prompts:
                text = self._prompts.get(r.request_id)
                if text is None:
                    text = engine.tokenizer.decode(r.prompt_token_ids[:PROMPT_PREVIEW_TOKENS])
                prompts[r.request_id] = row["prompt"] = text
            rows.append(row)
        # Only the listed requests' previews are kept, so finished ones are forgotten.
        self._prompts = prompts
        return rows
