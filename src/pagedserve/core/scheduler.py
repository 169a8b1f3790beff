"""One token budget per step, running requests first, preemption by recompute.

The engine loop is: out = schedule(); sampled = runner.execute(out);
updates = update(out, sampled). schedule() advances each scheduled request's
num_computed_tokens (the row records where it started); update() appends the
sampled tokens, applies stop conditions and releases finished requests.

A step is built in two phases:
1. Running rows: decodes first (so they never starve), then static padding rows,
   then unfinished prefills. When the pool runs dry, padding rows give up their
   blocks first, then a victim is preempted (recompute: blocks freed,
   num_computed_tokens = 0, back into the waiting queue - at its front under fcfs,
   at its own place under priority; it keeps its output tokens).
2. Waiting requests, in queue order, while seats, budget and blocks allow;
   nothing is admitted in a step that preempted. A request that cannot be
   admitted stops admission (no overtaking), which is safe because add_request
   rejects anything that could never fit.

Speculative decoding: a decode whose request carries proposals (spec_token_ids)
computes its last token plus as many drafts as the budget left over by the other
decodes and its remaining max_tokens allow; the drafts need KV slots like any token.
update() keeps the accepted ones and rolls num_computed_tokens back to them, giving
unneeded blocks back; only verified tokens are ever indexed in the prefix cache.

Without chunked prefill a prompt must be computed whole. If the next one cannot
fit beside the running decodes, the step is a prefill step instead: running rows
wait one step, and waiting prompts are admitted while they fit the budget, the
first even if it alone exceeds it. Every non-empty schedule therefore makes
progress, and no prompt waits for the running batch to drain.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .beam_search import BeamCandidates
from .scheduler_config import CacheConfig, SchedulerConfig
from .kv_cache import Allocation, KVCache, PrefixHit
from .kv_cache_manager import KVCacheManager
from .kv_connector import KVConnectorOutput, KVConnectorScheduler
from .scheduler_output import RequestUpdate, ScheduledRequest, SchedulerOutput, SchedulerStats
from .policies import make_policy
from .request import CHILD_ID_SEPARATOR, Request, RequestStatus
from .request_groups import RequestGroups
from .request_queue import make_waiting_queue
from .step_budget import StepBudget
from .transfer_hooks import LoadOutcome, NoTransfers, TransferHooks

# The aging rule of priority preemption (_preempt_for_priority).
MAX_PRIORITY_PREEMPTIONS = 1
RUNNING = RequestStatus.RUNNING
ABORTED = RequestStatus.FINISHED_ABORTED
STOPPED = RequestStatus.FINISHED_STOPPED
LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS


class _Step:
    """The step being built: its rows in order, the budget left, who was preempted."""

    __slots__ = ("budget", "num_tokens", "rows", "index", "copies", "preempted", "ran_dry", "decodes_left")

    def __init__(self, budget: int):
        self.budget = budget
        # Running decodes not placed yet: each needs one token of the budget.
        self.decodes_left = 0
        self.num_tokens = 0
        self.rows: list[ScheduledRequest | None] = []
        self.index: dict[str, int] = {}
        self.copies: dict[int, tuple[tuple[int, int], ...]] = {}
        self.preempted: list[str] = []
        # Whether a running row found the pool dry and preempted for blocks: then nothing
        # is admitted this step (priority preemption, which frees room for admission, is not this).
        self.ran_dry = False

    @property
    def is_empty(self) -> bool:
        return not self.index

    def add(self, row: ScheduledRequest, copies: tuple[tuple[int, int], ...]) -> None:
        i = len(self.rows)
        self.rows.append(row)
        self.index[row.request_id] = i
        if copies:
            self.copies[i] = copies
        self.budget -= row.num_new_tokens
        self.num_tokens += row.num_new_tokens

    def drop(self, request_id: str) -> None:
        """Take back a row scheduled earlier in this step (its request lost its blocks)."""
        i = self.index.pop(request_id, None)
        if i is None:
            return
        row = self.rows[i]
        self.rows[i] = None
        self.copies.pop(i, None)
        self.budget += row.num_new_tokens
        self.num_tokens -= row.num_new_tokens

    def live_rows(self) -> list[ScheduledRequest]:
        return [r for r in self.rows if r is not None]

    def build(self, finished_ids: list[str], kv_connector_metadata: object | None) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled=self.live_rows(),
            num_scheduled_tokens=self.num_tokens,
            block_copies=[c for i in sorted(self.copies) for c in self.copies[i]],
            preempted_request_ids=self.preempted,
            finished_request_ids=finished_ids,
            kv_connector_metadata=kv_connector_metadata,
        )


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 step_budget: StepBudget | None = None, kv_connector: KVConnectorScheduler | None = None,
                 kv_cache: KVCache | None = None):
        """`step_budget`: choose each step's budget from a latency target (chunked policy
        only); None keeps the fixed max_num_batched_tokens. `kv_connector`: the scheduler
        half of a KV connector (disaggregated prefill/decode); None calls nothing of it.
        `kv_cache`: another KV layout; None builds the paged one from cache_config."""
        self.config = scheduler_config
        # Which options go together (a connector's policy, a target's chunked prefill and
        # cap) is EngineConfig.resolve's; the engine and the simulator build from its parts.
        self.transfers: NoTransfers | TransferHooks = (
            TransferHooks(kv_connector) if kv_connector is not None else NoTransfers())
        self.step_budget = step_budget
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache: KVCache = kv_cache if kv_cache is not None else KVCacheManager(cache_config)
        self.policy = make_policy(scheduler_config)
        self.waiting = make_waiting_queue(scheduler_config.scheduling_policy)
        # In admission order; a forked parent's children sit right after it.
        self.running: list[Request] = []
        # Static policy: finished members still computing padding rows, in finish order.
        self.padding: dict[str, Request] = {}
        # Every request not yet released (waiting, running or padding), by id.
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # max_num_seqs seats held: n for an unforked parent, 1 per other row.
        self._seats = 0
        # Requests whose next row must carry the whole block table: forked children
        # (new to the runner) and requests whose rejected drafts gave blocks back.
        self._unsynced: set[str] = set()
        self._truncated: set[str] = set()
        # Parallel-sampling families and beam groups: who belongs together, and a beam group's decisions.
        self.groups = RequestGroups()
        self._released_ids: list[str] = []

    # -- requests in -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request, or raise ValueError (with the numbers) if it can never run."""
        rid = request.request_id
        if CHILD_ID_SEPARATOR in rid:
            raise ValueError(f"request_id {rid!r} must not contain {CHILD_ID_SEPARATOR!r} (reserved for samples n > 1)")
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.output_token_ids or request.num_computed_tokens:
            raise ValueError(f"request {rid} must be new (waiting, no outputs, nothing computed)")
        if request.n > self.config.max_num_seqs:
            raise ValueError(f"request {rid}: n ({request.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        self.groups.validate(request, self.kv_cache.supports_forks)
        total = request.num_reserved_tokens
        # A pooling request reserves its prompt only: it never generates.
        what = (f"prompt ({total} tokens)" if request.pooling is not None else
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) = {total}")
        max_len = self.config.max_model_len
        if max_len is not None and total > max_len:
            raise ValueError(f"request {rid}: {what} exceeds max_model_len ({max_len})")
        problem = self.kv_cache.fit_error(total)
        if problem is not None:
            raise ValueError(f"request {rid}: {what} tokens {problem}")
        self.transfers.validate(request)
        self.requests[rid] = request
        self.groups.add(request)
        self.waiting.add(request)

    # -- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.kv_cache.begin_step()
        step = _Step(self._budget())
        if self._wants_prefill_step():
            self._schedule_waiting(step)
        if step.is_empty:
            self._preempt_for_priority(step)
            self._schedule_running(step)
            if not step.ran_dry:
                self._schedule_waiting(step)
        self.policy.end_step()
        released, self._released_ids = self._released_ids, []
        return step.build(released, self.transfers.metadata())

    def _budget(self) -> int:
        if self.step_budget is None:
            return self.config.max_num_batched_tokens
        rows = context = 0
        prefill_context = None
        for r in self.running:
            if r.is_decode:
                rows += 1
                context += r.num_computed_tokens
            elif prefill_context is None:
                prefill_context = r.num_computed_tokens
        demand = min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
        expected = None
        if self.running and self.step_budget.wants_expected_lengths:
            # Until a request finishes, the running requests' prompts and max_tokens stand in
            # for the lengths the supply floor learns from finished ones (the floor applies
            # only beside running decodes; at most max_num_seqs of them, whatever the queue).
            expected = (sum(r.num_prompt_tokens for r in self.running) / len(self.running),
                        sum(r.max_tokens for r in self.running) / len(self.running))
        return self.step_budget.budget(rows, context, prefill_context or 0, demand, expected)

    def observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """How long the step `output` took to run: a latency target learns from it (its
        other input, finished requests' lengths, the scheduler feeds itself)."""
        if self.step_budget is not None and output.scheduled:
            self.step_budget.observe([(r.num_new_tokens, r.start) for r in output.scheduled],
                                     sum(r.num_samples for r in output.scheduled), seconds)

    def _wants_prefill_step(self) -> bool:
        """Whole-prompt policies: is the next prompt too long to sit beside the decodes?"""
        if self.policy.prefill.chunks or not (self.running or self.padding):
            return False
        head = self.policy.next_candidate(self.waiting)
        if head is None or self._seats + head.num_seats > self.config.max_num_seqs:
            return False
        need = head.num_tokens - self.kv_cache.find_prefix_hit(head).num_tokens
        return need > self.config.max_num_batched_tokens - len(self.running) - len(self.padding)

    def _schedule_running(self, step: _Step) -> None:
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            (decodes if r.is_decode else prefills).append(r)
        step.decodes_left = len(decodes)
        # Rows that fill a block: indexed only once the step's rows are final, since a
        # row can still be taken back (its request preempted) while later rows are
        # placed, and an indexed block must not outlive a computation that never ran.
        filling: list[ScheduledRequest] = []
        bs = self.block_size
        for req in (*decodes, *self.padding.values(), *prefills):
            start = req.num_computed_tokens
            size = self._row_size(req, step)
            if size is None:
                continue
            placed = self._allocate_row(req, *size, step)
            if placed is None:
                continue
            n, drafts, alloc = placed
            row = self._build_row(req, start, n, drafts, alloc)
            step.add(row, alloc.copies)
            if not row.is_padding:
                # A preempted request restarts from 0, so advancing now is safe.
                req.num_computed_tokens = start + n
                req.num_unverified_tokens = len(drafts)
                if (start + n - len(drafts)) // bs > start // bs:
                    filling.append(row)
        for row in filling:
            if row.request_id in step.index:
                self.kv_cache.cache_blocks(row.request, row.request.num_verified_tokens)

    def _row_size(self, req: Request, step: _Step) -> tuple[int, tuple[int, ...]] | None:
        """Tokens the request computes this step and the drafts among them; None when it
        has no row (preempted or released earlier in this step, or nothing fits)."""
        drafts: tuple[int, ...] = ()
        if req.status is RUNNING:
            if req.is_decode:
                step.decodes_left -= 1
                if req.spec_token_ids:
                    # Drafts only from budget no later decode needs for its own token.
                    drafts = self._take_drafts(req, step.budget - 1 - step.decodes_left)
                n = 1 + len(drafts)
            else:
                n = self.policy.prefill.num_tokens(req.num_tokens - req.num_computed_tokens, step.budget, False)
        elif req.request_id in self.padding:
            n = 1
        else:
            return None
        if n == 0 or n > step.budget:
            return None
        return n, drafts

    def _allocate_row(self, req: Request, n: int, drafts: tuple[int, ...],
                      step: _Step) -> tuple[int, tuple[int, ...], Allocation] | None:
        """KV slots for the row, making room if the pool is dry; the row's final size
        (drafts may be dropped) and its allocation, or None if it cannot run."""
        alloc = self.kv_cache.allocate_slots(req, n)
        if alloc is None and drafts:
            # Speculation never costs another request its blocks: drop the drafts.
            drafts, n = (), 1
            alloc = self.kv_cache.allocate_slots(req, n)
        if alloc is None:
            alloc = self._make_room(req, n, step, None, may_preempt=True)
            if alloc is None:
                return None
        return n, drafts, alloc

    def _build_row(self, req: Request, start: int, n: int, drafts: tuple[int, ...],
                   alloc: Allocation) -> ScheduledRequest:
        """The row, with the whole block table when the runner's copy is stale."""
        rid = req.request_id
        is_padding = req.status is not RUNNING
        num_samples = 0 if is_padding else (1 + len(drafts) if drafts else self._num_samples(req, start, n))
        if rid in self._unsynced:
            self._unsynced.discard(rid)
            return ScheduledRequest.with_table(req, n, start, self.kv_cache.block_ids(req), num_samples,
                                               drafts=drafts, is_padding=is_padding)
        table = self.kv_cache.block_ids(req) if alloc.copies or rid in self._truncated else None
        self._truncated.discard(rid)
        return ScheduledRequest.with_new_blocks(req, n, start, alloc.new_block_ids, num_samples, table=table,
                                                drafts=drafts, is_padding=is_padding)

    def _schedule_waiting(self, step: _Step) -> None:
        prefill_tokens = self.policy.prefill.num_tokens
        max_seats = self.config.max_num_seqs
        while step.budget > 0:
            req = self.policy.next_candidate(self.waiting)
            if req is None or self._seats + req.num_seats > max_seats:
                return
            hit = self.kv_cache.find_prefix_hit(req)
            num_external = self.transfers.external_tokens(req, hit.num_tokens)
            if num_external is None:
                return
            if num_external:
                # The load costs no compute budget: the request waits for it holding its blocks.
                alloc = (self.kv_cache.allocate_slots(req, num_external, hit)
                         or self._make_room(req, num_external, step, hit, may_preempt=False))
                if alloc is None:
                    return
                self._start_loading(req, hit, num_external)
                continue
            n = prefill_tokens(req.num_tokens - hit.num_tokens, step.budget, step.is_empty)
            if n == 0:
                return
            alloc = self.kv_cache.allocate_slots(req, n, hit) or self._make_room(req, n, step, hit, may_preempt=False)
            if alloc is None:
                return
            self._admit(req, hit, n, step)

    def _admit(self, req: Request, hit: PrefixHit, n: int, step: _Step) -> None:
        self.waiting.remove(req)
        req.status = RUNNING
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit.num_tokens
        self.running.append(req)
        self._seats += req.num_seats
        self.policy.on_admitted(req)
        start = hit.num_tokens
        self.kv_cache.cache_blocks(req, start + n)
        step.add(ScheduledRequest.with_table(req, n, start, self.kv_cache.block_ids(req),
                                             self._num_samples(req, start, n)), ())
        req.num_computed_tokens = start + n

    def _start_loading(self, req: Request, hit: PrefixHit, num_external: int) -> None:
        self.waiting.remove(req)
        req.status = LOADING
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit.num_tokens
        self._seats += req.num_seats
        req.num_computed_tokens = hit.num_tokens
        self.transfers.start_loading(req, self.kv_cache.block_ids(req), num_external)

    def update_connector_output(self, output: KVConnectorOutput) -> list[RequestUpdate]:
        """Apply what the connector's worker half reported after a step: free blocks it no
        longer serves, start requests whose load finished, and handle failed loads
        (kv_load_failure_policy: recompute the prompt, or fail the request). Returns the
        updates of requests that failed."""
        freed, outcomes = self.transfers.worker_report(output)
        for req in freed:
            self.kv_cache.free(req)
        updates = []
        for req, outcome, loaded_end in outcomes:
            if outcome is LoadOutcome.ENDED:  # it ended while the load was writing its blocks
                self._release(req)
                continue
            if outcome is LoadOutcome.FAIL:
                req.status = ABORTED
                self._seats -= req.num_seats
                self._release(req)
                updates.append(RequestUpdate(req, [], ABORTED))
                continue
            if outcome is LoadOutcome.LOADED:
                req.num_computed_tokens = loaded_end
                self.kv_cache.cache_blocks(req, req.num_computed_tokens)
            # It runs from its computed tokens: the first one the load did not bring, the
            # local prefix hit after a failed one (whose blocks are then written again).
            req.status = RUNNING
            self.running.append(req)
            self._unsynced.add(req.request_id)
            self.policy.on_admitted(req)
        return updates

    @staticmethod
    def _take_drafts(req: Request, room: int) -> tuple[int, ...]:
        """Consume the request's proposals: as many as the budget `room` allows and no
        more than its remaining output can hold beside the target's own token."""
        proposals, req.spec_token_ids = req.spec_token_ids, []
        k = min(len(proposals), room, req.max_draft_tokens)
        return tuple(proposals[:k]) if k > 0 else ()

    @staticmethod
    def _num_samples(req: Request, start: int, n: int) -> int:
        if start + n < req.num_tokens or req.pooling is not None:
            return 0  # a partial prefill chunk: its logits predict nothing new
        # A beam group's row gives one logits row whatever its width (its candidates come from it).
        return req.n if req.fork_pending and req.beam is None else 1

    def _make_room(
        self, req: Request, n: int, step: _Step, hit: PrefixHit | None, may_preempt: bool
    ) -> Allocation | None:
        """After allocate_slots failed: free blocks until it succeeds. Padding rows go
        first, then (in the running phase) preemption victims. None if `req` itself
        had to go, or (admission) nothing more can be freed."""
        while True:
            if self.padding:
                victim = self.padding[next(reversed(self.padding))]
                self._release_padding_row(victim, step)
            elif may_preempt:
                victim = self.waiting.pick_victim(self.running)
                self._preempt(victim, step)
                step.ran_dry = True
            else:
                return None
            if victim is req:
                return None
            alloc = self.kv_cache.allocate_slots(req, n, hit)
            if alloc is not None:
                return alloc

    def _preempt_for_priority(self, step: _Step) -> None:
        """Priority policy: the first waiting request, short of a seat or of blocks for its
        first chunk, takes them from running requests of lower priority (a larger value),
        the lowest first. Done before any running row is placed, so no victim's row or
        freshly indexed block has to be taken back. Aging: a request is a priority victim
        at most MAX_PRIORITY_PREEMPTIONS times, so a stream of higher-priority arrivals
        cannot keep restarting it; it re-enters the queue at its own (priority, arrival)
        place, ahead of later arrivals of its class. The blocks counted ignore a prefix-cache
        hit (looking one up here would count a query twice) and running prefill chunks
        (which, short, preempt as before and hold admission to the next step)."""
        if self.config.scheduling_policy != "priority" or not self.running:
            return
        head = self.policy.next_candidate(self.waiting)
        if head is None:
            return
        bs = self.block_size
        chunk = -(-min(head.num_tokens - head.num_computed_tokens, step.budget) // bs)
        while (self._seats + head.num_seats > self.config.max_num_seqs
               # The head's first chunk, and a block for each decode whose next token starts one.
               or self.kv_cache.num_free_blocks
               < chunk + sum(r.is_decode and r.num_computed_tokens % bs == 0 for r in self.running)):
            victims = [r for r in self.running
                       if r.priority > head.priority and r.num_priority_preemptions < MAX_PRIORITY_PREEMPTIONS]
            if not victims:
                return
            victim = self.waiting.pick_victim(victims)
            victim.num_priority_preemptions += 1
            self._preempt(victim, step)

    def _preempt(self, victim: Request, step: _Step) -> None:
        step.drop(victim.request_id)
        self.num_preemptions += 1
        if self.groups.leave_on_preempt(victim):
            self._drop_beam(victim)
            return
        self.running.remove(victim)
        self.kv_cache.free(victim)
        self._seats -= victim.num_seats
        self._unsynced.discard(victim.request_id)
        self._truncated.discard(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_unverified_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.waiting.prepend(victim)
        self.policy.on_preempted(victim)
        step.preempted.append(victim.request_id)

    def update_draft_token_ids(self, drafts: Mapping[str, list[int]]) -> None:
        """Proposals for the next step (request id -> tokens to follow its last one),
        from the runner between steps; ids no longer running are ignored."""
        for rid, tokens in drafts.items():
            req = self.requests.get(rid)
            if req is not None and req.status is RUNNING and req.beam is None:  # beams advance together, unspeculated
                req.spec_token_ids = tokens

    # -- results in ----------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]],
               beams: Mapping[str, BeamCandidates] | None = None) -> list[RequestUpdate]:
        """Apply one step's sampled tokens (request id -> its num_samples tokens; for a
        row with drafts, the accepted drafts plus the target's token: 1 to num_samples)
        and its beam candidates (root request id -> the group's best continuations).

        Rows that sample nothing (partial prefill chunks, padding) and requests that
        finished or were aborted since schedule() are skipped. Returns one update per
        request that gained tokens, forked children included.
        """
        updates: list[RequestUpdate] = []
        finished: list[Request] = []
        for row in output.scheduled:
            k = row.num_samples
            req = row.request
            if req.pooling is not None and req.status is RUNNING and row.start + row.num_new_tokens == req.num_tokens:
                # Its prompt is computed: a pooling request is done (the runner pooled it this step).
                req.status = STOPPED
                updates.append(RequestUpdate(req, [], STOPPED))
                finished.append(req)
                continue
            if k == 0 or req.status is not RUNNING or req.beam is not None:
                continue
            tokens = sampled.get(row.request_id)
            if row.draft_token_ids:
                if tokens is None or not 1 <= len(tokens) <= k:
                    raise ValueError(f"sampled[{row.request_id!r}] must hold 1 to {k} tokens, got "
                                     f"{None if tokens is None else len(tokens)}")
                update = self._verify(row, tokens)
                updates.append(update)
                if update.finished is not None:
                    req.status = update.finished
                    finished.append(req)
                continue
            if tokens is None or len(tokens) != k:
                raise ValueError(
                    f"sampled[{row.request_id!r}] must hold {k} token(s), got {None if tokens is None else len(tokens)}"
                )
            members = (req,) if k == 1 else (req, *self._fork(req))
            for r, token in zip(members, tokens):
                status = r.append_output_token(token)
                updates.append(RequestUpdate(r, [token], status))
                if status is not None:
                    r.status = status
                    finished.append(r)
        if finished:
            self.running = [r for r in self.running if r.status is RUNNING]
            for req in finished:
                self._retire(req, was_running=True)
        if beams:
            updates += self._advance_beams(beams)
        return updates

    def _advance_beams(self, beams: Mapping[str, BeamCandidates]) -> list[RequestUpdate]:
        """Advance each group by its candidates: live beams extend or re-point their blocks,
        finished groups end (one update each, for the root request, whose `beam` holds the result)."""
        updates = []
        for root_id, candidates in beams.items():
            advanced = self.groups.advance(root_id, candidates)
            if advanced is None:
                continue  # aborted since the step was scheduled
            root = advanced.root
            if root.beam.done:
                for member in advanced.live:
                    self._end(member, STOPPED)
                updates.append(RequestUpdate(root, [], STOPPED))
                continue
            if root.fork_pending:
                self._fork(root)
            moves = self.groups.seat(root_id, advanced.continuations)
            self.kv_cache.repoint(moves.moved)
            self._unsynced.update(member.request_id for member, _ in moves.moved)
            for member in moves.dropped:
                self._drop_beam(member)
        return updates

    def _drop_beam(self, member: Request) -> None:
        """Release a beam its group no longer needs (nothing reports it: the group reports once)."""
        self.running.remove(member)
        member.status = RequestStatus.FINISHED_STOPPED
        self._seats -= member.num_seats
        self._retire(member, was_running=False)

    def _verify(self, row: ScheduledRequest, tokens: Sequence[int]) -> RequestUpdate:
        """Keep a speculative row's accepted tokens and roll its KV back to them."""
        req = row.request
        kept: list[int] = []
        status = None
        for token in tokens:
            kept.append(token)
            status = req.append_output_token(token)
            if status is not None:
                break
        # The KV of the row's first len(kept) tokens (its last token and the accepted
        # drafts) is final; the slots of rejected drafts will be written again.
        req.num_computed_tokens = row.start + len(kept)
        req.num_unverified_tokens = 0
        if self.kv_cache.rollback(req):
            self._truncated.add(req.request_id)
        self.kv_cache.cache_blocks(req, req.num_computed_tokens)
        return RequestUpdate(req, kept, status)

    def _fork(self, parent: Request) -> list[Request]:
        """Split a parent (n > 1, or a beam group) at its first sample into n rows sharing its blocks."""
        children = self.groups.fork(parent, self.block_size)
        for child in children:
            self.kv_cache.fork(parent, child)
            self.requests[child.request_id] = child
            self._unsynced.add(child.request_id)
        pos = self.running.index(parent) + 1
        self.running[pos:pos] = children
        self.policy.on_forked(children)
        return children

    # -- requests out --------------------------------------------------------------------

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """The engine ends requests itself (e.g. a stop string matched). Returns the
        requests this changed; finished or unknown ids are ignored. Aborting by a
        parent id also aborts its children."""
        status = RequestStatus(status)
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status.name}")
        if status is ABORTED:
            return [r for rid in request_ids for r in self.abort(rid)]
        ended = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self._end(req, status)
                ended.append(req)
        return ended

    def abort(self, request_id: str) -> list[Request]:
        """Abort a request in any state (and, for a parallel-sampling parent, its
        children), freeing blocks at once. Returns the requests aborted."""
        targets = [r for r in (self.requests.get(request_id), *self.groups.children(request_id))
                   if r is not None and not r.is_finished]
        for req in targets:
            self._end(req, ABORTED)
        return targets

    def _end(self, req: Request, status: RequestStatus) -> None:
        if req.status is LOADING:
            # The worker may still be writing its blocks: they are freed when it reports.
            req.status = status
            self._seats -= req.num_seats
            return
        was_running = req.status is RUNNING
        if was_running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self._retire(req, was_running)

    def _retire(self, req: Request, was_running: bool) -> None:
        """Release a request that just finished or was aborted, or park it as padding."""
        # A pooling request has no next token for a padding row to compute.
        can_pad = was_running and req.status is not ABORTED and req.pooling is None
        if can_pad and self.step_budget is not None:
            self.step_budget.finished(req.num_prompt_tokens - (req.num_cached_tokens or 0), req.num_output_tokens)
        if self.policy.on_finished(req, can_pad):
            self.padding[req.request_id] = req
        else:
            if was_running:
                self._seats -= req.num_seats
            self._release(req)
        if self.policy.batch_done():
            for row in list(self.padding.values()):
                self._release_padding_row(row, None)

    def _release_padding_row(self, req: Request, step: _Step | None) -> None:
        del self.padding[req.request_id]
        if step is not None:
            step.drop(req.request_id)
        self._seats -= 1
        self._release(req)

    def _release(self, req: Request) -> None:
        rid = req.request_id
        if not self.transfers.release(req, self.kv_cache.block_ids(req)):
            self.kv_cache.free(req)
        self._unsynced.discard(rid)
        self._truncated.discard(rid)
        del self.requests[rid]
        self._released_ids.append(rid)
        self.groups.release(req, self.requests)

    # -- introspection -------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.padding or len(self.waiting) or self.transfers.loading)

    def has_connector_work(self) -> bool:
        """Transfers the engine must keep stepping for, though nothing may be computing."""
        return self.transfers.has_pending_work()

    def has_pending_prefills(self) -> bool:
        """Whether any prompt, waiting or running, still has tokens to compute."""
        return bool(len(self.waiting)) or not all(r.is_decode for r in self.running)

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(
            kv_total_blocks=kv.num_blocks,
            kv_free_blocks=kv.num_free_blocks,
            kv_usage=kv.usage,
            kv_waste=kv.waste(),
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.transfers.loading),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if block accounting or request bookkeeping is off."""
        self.kv_cache.check_invariants()
        seats = (sum(r.num_seats for r in self.running) + len(self.padding)
                 + sum(r.num_seats for r in self.transfers.loading.values() if r.status is LOADING))
        if seats != self._seats or seats > self.config.max_num_seqs:
            raise AssertionError(f"seats: counted {self._seats}, rows hold {seats}, max {self.config.max_num_seqs}")
        for r in self.running:
            if r.status is not RUNNING or not self.kv_cache.has_blocks(r) or r.num_verified_tokens > r.num_tokens:
                raise AssertionError(f"running request {r.request_id} is {r.status.name} with "
                                     f"{r.num_computed_tokens}/{r.num_tokens} computed")
        for r in self.padding.values():
            if not r.is_finished or not self.kv_cache.has_blocks(r):
                raise AssertionError(f"padding row {r.request_id} must be finished and hold blocks")
        self.transfers.check_invariants(self.kv_cache.has_blocks, self.requests)
        for r in self.waiting:
            if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or r.num_computed_tokens:
                raise AssertionError(f"waiting request {r.request_id} is {r.status.name}")
            if self.kv_cache.has_blocks(r):
                raise AssertionError(f"waiting request {r.request_id} holds blocks")
        live = ({r.request_id for r in self.running} | set(self.padding) | {r.request_id for r in self.waiting}
                | set(self.transfers.loading))
        if live != set(self.requests):
            raise AssertionError(f"requests {sorted(live ^ set(self.requests))} are lost or duplicated")
        self.groups.check_invariants(self.requests)
