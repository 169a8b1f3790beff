"""Turns one SchedulerOutput into one batched forward pass and samples.

Everything the model needs for a step is built with array ops from a handful of
per-sequence numbers (start position, tokens to compute, samples wanted): token
positions, the slot of each new token, the padded block tables and the rows whose
logits are needed. The only per-sequence Python work is reading each request's
new token ids and block-table diff.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata
from ..attention.selector import get_backend
from ..core.outputs import SchedulerOutput
from ..core.request import Request
from ..model.llama import LlamaModel
from ..structured_output.logits import constrain
from .block_table import BlockTableRows
from .sampler import LogprobsTensors, SamplingRow, build_sampling_metadata, sample

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_requests: list  # ScheduledRequest per logits row (repeated at a fork point)


@dataclass
class RunnerOutput:
    # Sampled token ids per request id: one each, n at a parallel-sampling fork point.
    sampled: dict[str, list[int]]
    # Logprobs of the rows that asked for them (None when none did), and for each
    # such row the request it was sampled for and the sample index (i at a fork).
    logprobs: LogprobsTensors | None
    logprob_samples: list[tuple[Request, int]]


def allocate_kv_caches(model: LlamaModel, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    c = model.config
    shape = (2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
    return [torch.zeros(shape, dtype=torch.float32) for _ in range(c.num_layers)]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        attention_backend: str | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size)
        self.backend = get_backend(attention_backend)
        self.block_tables = BlockTableRows(max_num_seqs, -(-max_model_len // block_size))
        self.eos_token_ids = eos_token_ids

    # -- per-step state ---------------------------------------------------------------

    def _update_block_tables(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids:
            self.block_tables.remove(rid)
        for rid in out.preempted_request_ids:
            self.block_tables.remove(rid)
        for s in out.scheduled:
            if s.block_ids is not None:  # new, resumed, forked, or changed by copy-on-write
                self.block_tables.set(s.request_id, s.block_ids)
            elif s.new_block_ids:
                self.block_tables.append(s.request_id, s.new_block_ids)

    @torch.inference_mode()
    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give a request its private copy of a shared, partly filled block."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies])
        dst = torch.tensor([c[1] for c in copies])
        for kv in self.kv_caches:
            kv[:, dst] = kv[:, src]

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        sched = out.scheduled
        bs = self.block_size
        rows = np.fromiter((self.block_tables.row_of[s.request_id] for s in sched), np.int64, len(sched))
        starts = np.fromiter((s.start for s in sched), np.int64, len(sched))
        num_new = np.fromiter((s.num_new_tokens for s in sched), np.int64, len(sched))
        num_samples = np.fromiter((s.num_samples for s in sched), np.int64, len(sched))
        token_ids: list[int] = []
        for s in sched:
            token_ids.extend(s.request.all_token_ids[s.start : s.start + s.num_new_tokens])

        cu = np.zeros(len(sched) + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])
        seq_lens = starts + num_new
        # Position of every token: its sequence's start plus its offset inside the step's chunk.
        positions = np.arange(total) - np.repeat(cu[:-1] - starts, num_new)
        token_rows = np.repeat(rows, num_new)
        slots = self.block_tables.table[token_rows, positions // bs] * bs + positions % bs
        width = int((seq_lens.max() + bs - 1) // bs) if len(sched) else 0
        block_tables = self.block_tables.table[rows, :width]
        logits_indices = np.repeat(cu[1:] - 1, num_samples)
        sampled_requests = [s for s, k in zip(sched, num_samples.tolist()) for _ in range(k)]

        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(cu),
            seq_lens=torch.from_numpy(seq_lens),
            block_tables=torch.from_numpy(block_tables),
            slot_mapping=torch.from_numpy(slots),
            query_lens_cpu=num_new.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=bs,
        )
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=torch.from_numpy(positions),
            meta=meta,
            logits_indices=torch.from_numpy(logits_indices),
            sampled_requests=sampled_requests,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._update_block_tables(out)
        self._copy_blocks(out.block_copies)
        if not out.scheduled:
            return RunnerOutput({}, None, [])
        inputs = self.prepare_inputs(out)
        prepare = getattr(self.backend, "prepare", None)
        if prepare is not None:
            prepare(inputs.meta)
        logits = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend, inputs.logits_indices
        )
        if not inputs.sampled_requests:
            return RunnerOutput({}, None, [])
        return self._sample(logits, inputs.sampled_requests)

    def _sample(self, logits: torch.Tensor, sampled_requests: list) -> RunnerOutput:
        rows: list[SamplingRow] = []
        samples: list[tuple[Request, int]] = []
        matchers = []
        previous, index = None, 0
        for s in sampled_requests:
            req = s.request
            state = req.sampling
            # Rows of one request are adjacent; more than one only at a parallel-sampling
            # fork, where sample i is drawn with child i's own generator.
            index = index + 1 if s is previous else 0
            previous = s
            generator = state.fork_generators[index] if s.num_samples > 1 else state.generator
            matchers.append(state.fork_matchers[index] if s.num_samples > 1 else state.matcher)
            rows.append(SamplingRow(state.params, req.prompt_token_ids, req.output_token_ids, generator))
            samples.append((req, index if s.num_samples > 1 else req.index))
        meta = build_sampling_metadata(rows, logits.shape[-1], self.eos_token_ids)
        grammar = constrain(logits, matchers)  # before any other processing; None when no row is constrained
        result = sample(logits, meta)
        if grammar is not None:
            grammar.accept(result.sampled_token_ids)
        sampled: dict[str, list[int]] = {}
        for s, tok in zip(sampled_requests, result.sampled_token_ids.tolist()):
            sampled.setdefault(s.request_id, []).append(tok)
        logprob_samples = [samples[r] for r in result.logprobs.rows.tolist()] if result.logprobs else []
        return RunnerOutput(sampled, result.logprobs, logprob_samples)
