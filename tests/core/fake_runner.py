"""A deterministic stand-in for the model runner that really uses the paged cache.

It keeps a fake KV cache of one (token id, prefix state) pair per slot, maintains
its block tables only from the SchedulerOutput diffs, applies block copies, and
writes each computed token into the slot its table names. The "prefix state" of
position p chains all tokens 0..p (like real K/V, which depend on the whole
prefix), and the next token is a function of the last state: so a wrong block, a
missed copy-on-write, a stale prefix-cache hit or a lost table update changes the
generated text, and the checks below fail at the first bad read.
"""
from __future__ import annotations

from collections.abc import Callable

from pagedserve.core import CacheConfig, Request, RequestUpdate, Scheduler, SchedulerConfig, SchedulerOutput
from pagedserve.core.kv_connector import KVConnectorScheduler

_MOD = (1 << 61) - 1
_SEED = 0x5EED


def _mix(state: int, token: int) -> int:
    return (state * 1_000_003 + token + 0x9E3779B97F4A7C15) % _MOD


def sample(state: int, index: int, vocab_size: int) -> int:
    """The index-th sample after a prefix: a function of the prefix only."""
    return _mix(state, -1 - index) % vocab_size


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 1000):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.tokens: list[int | None] = [None] * (num_blocks * block_size)
        self.states: list[int] = [0] * (num_blocks * block_size)
        self.tables: dict[str, list[int]] = {}
        self.num_steps = 0
        self.num_tokens_computed = 0

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        # Gather every source first, then scatter, as a batched tensor copy would.
        saved = [(self.tokens[s * bs : (s + 1) * bs], self.states[s * bs : (s + 1) * bs]) for s, _ in copies]
        for (_, dst), (toks, states) in zip(copies, saved):
            self.tokens[dst * bs : (dst + 1) * bs] = toks
            self.states[dst * bs : (dst + 1) * bs] = states

    def _check_slot(self, rid: str, table: list[int], pos: int, expected_token: int, state: int | None) -> int:
        slot = self._slot(table, pos)
        if self.tokens[slot] != expected_token:
            raise AssertionError(f"{rid}: position {pos} holds token {self.tokens[slot]}, expected {expected_token}")
        if state is not None and self.states[slot] != _mix(state, expected_token):
            raise AssertionError(f"{rid}: position {pos} holds a state from another prefix")
        return self.states[slot]

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        self.num_steps += 1
        for rid in (*out.finished_request_ids, *out.preempted_request_ids):
            self.tables.pop(rid, None)
        self._copy_blocks(out.block_copies)
        sampled: dict[str, list[int]] = {}
        for row in out.scheduled:
            rid = row.request_id
            if row.block_ids is not None:
                self.tables[rid] = list(row.block_ids)
            else:
                if rid not in self.tables:
                    raise AssertionError(f"{rid}: scheduled as a diff but the runner never got its table")
                self.tables[rid].extend(row.new_block_ids)
            if row.is_new and list(row.new_block_ids) != self.tables[rid]:
                raise AssertionError(f"{rid}: is_new row must carry the whole table in new_block_ids")
            table = self.tables[rid]
            drafts = list(row.draft_token_ids)
            tokens = row.request.all_token_ids[: row.start + row.num_new_tokens - len(drafts)] + drafts
            start, end = row.start, row.start + row.num_new_tokens
            if end > len(table) * self.block_size:
                raise AssertionError(f"{rid}: table of {len(table)} blocks cannot hold {end} tokens")
            if row.is_new:
                # Everything before `start` must already be in the cache (a prefix hit or
                # a fork): verify the whole chain once.
                state = _SEED
                for pos in range(start):
                    state = self._check_slot(rid, table, pos, tokens[pos], state)
            elif start > 0:
                state = self._check_slot(rid, table, start - 1, tokens[start - 1], None)
            else:
                state = _SEED
            states = []
            for pos in range(start, end):
                state = _mix(state, tokens[pos])
                slot = self._slot(table, pos)
                self.tokens[slot] = tokens[pos]
                self.states[slot] = state
                states.append(state)
            self.num_tokens_computed += row.num_new_tokens
            if drafts:
                sampled[rid] = self._verify(drafts, states[-len(drafts) - 1 :])
            elif row.num_samples:
                sampled[rid] = [sample(state, i, self.vocab_size) for i in range(row.num_samples)]
        return sampled

    def _verify(self, drafts: list[int], states: list[int]) -> list[int]:
        """Greedy verification: the target's token at each position, up to the first
        that differs from the draft there (or the bonus token after all drafts)."""
        kept = []
        for i, state in enumerate(states):
            kept.append(sample(state, 0, self.vocab_size))
            if i == len(drafts) or kept[-1] != drafts[i]:
                break
        return kept


class Driver:
    """Runs the engine loop (schedule, execute, update) with checks after every call:
    block accounting, the token budget, progress, and streamed outputs."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner | None = None, check: bool = True,
                 propose: Callable[[Request], list[int]] | None = None):
        self.scheduler = scheduler
        # Speculative decoding: proposals for each running decode before every step.
        self.propose = propose
        cache = scheduler.cache_config
        self.runner = runner or FakeRunner(cache.num_blocks, cache.block_size)
        self.check = check
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.history: list[SchedulerOutput] = []
        # Every request the runner was given, forked children included.
        self.seen: dict[str, Request] = {}

    def step(self) -> tuple[SchedulerOutput, list[RequestUpdate]]:
        sched = self.scheduler
        had_work = sched.has_unfinished_requests()
        if self.propose is not None:
            sched.update_draft_token_ids({r.request_id: self.propose(r) for r in sched.running if r.is_decode})
        out = sched.schedule()
        self.history.append(out)
        if self.check:
            sched.check_invariants()
            self._check_output(out, had_work)
        sampled = self.runner.execute(out)
        updates = sched.update(out, sampled)
        if self.check:
            sched.check_invariants()
        for row in out.scheduled:
            self.seen.setdefault(row.request_id, row.request)
        for u in updates:
            self.seen.setdefault(u.request_id, u.request)
            self.outputs.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finished is not None:
                self.finish_reasons[u.request_id] = u.finish_reason
        return out, updates

    def _check_output(self, out: SchedulerOutput, had_work: bool) -> None:
        config = self.scheduler.config
        if had_work and not out.scheduled:
            raise AssertionError("a step with unfinished requests scheduled nothing")
        if sum(r.num_new_tokens for r in out.scheduled) != out.num_scheduled_tokens:
            raise AssertionError("num_scheduled_tokens is not the sum of the rows")
        if len({r.request_id for r in out.scheduled}) != len(out.scheduled):
            raise AssertionError("a request is scheduled twice in one step")
        if out.num_scheduled_tokens > config.max_num_batched_tokens:
            # Only a whole prompt longer than the budget, alone in its step, may exceed it.
            lone = len(out.scheduled) == 1 and out.scheduled[0].is_new
            if config.chunked_prefill or not lone:
                raise AssertionError(f"step of {out.num_scheduled_tokens} tokens breaks the budget")
        if len(out.scheduled) > config.max_num_seqs:
            raise AssertionError("more rows than max_num_seqs")

    def run(self, max_steps: int = 100_000, arrivals: dict[int, list[Request]] | None = None) -> int:
        """Step until nothing is left (adding `arrivals[step]` before each step); return steps."""
        arrivals = dict(arrivals or {})
        steps = 0
        while self.scheduler.has_unfinished_requests() or arrivals:
            for request in arrivals.pop(steps, ()):
                self.scheduler.add_request(request)
            if not self.scheduler.has_unfinished_requests():
                steps += 1
                continue
            if steps >= max_steps:
                raise AssertionError(f"not done after {max_steps} steps")
            self.step()
            steps += 1
        return steps


def make_scheduler(num_blocks: int = 64, block_size: int = 4, enable_prefix_caching: bool = True,
                   kv_connector: KVConnectorScheduler | None = None, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", min(16, config["max_num_batched_tokens"]))
    return Scheduler(SchedulerConfig(**config), CacheConfig(num_blocks, block_size, enable_prefix_caching),
                     kv_connector=kv_connector)


def true_continuation(request: Request, k: int, vocab_size: int = 1000) -> list[int]:
    """The k tokens the fake model will generate next for `request` (greedy)."""
    state = _SEED
    for token in request.all_token_ids:
        state = _mix(state, token)
    out = []
    for _ in range(k):
        out.append(sample(state, 0, vocab_size))
        state = _mix(state, out[-1])
    return out


def reference_output(request: Request, index: int = 0, vocab_size: int = 1000) -> list[int]:
    """What sample `index` of `request` must produce, computed without any cache: the
    fake model's next token depends only on the tokens before it."""
    probe = Request("reference", request.prompt_token_ids, request.max_tokens, min_tokens=request.min_tokens,
                    eos_token_id=request.eos_token_id, stop_token_ids=request.stop_token_ids,
                    ignore_eos=request.ignore_eos)
    state = _SEED
    for token in probe.prompt_token_ids:
        state = _mix(state, token)
    token = sample(state, index, vocab_size)
    while probe.append_output_token(token) is None:
        state = _mix(state, token)
        token = sample(state, 0, vocab_size)
    return probe.output_token_ids
