"""Turns one SchedulerOutput into one batched forward pass and samples.

Everything the model needs for a step is built with array ops from a handful of
per-sequence numbers (start position, tokens to compute, samples wanted): token
positions, the slot of each new token, the padded block tables and the rows whose
logits are needed. The only per-sequence Python work is reading each request's
new token ids and block-table diff.

Speculative rows (a decode followed by draft tokens) need logits at every one of
their positions; their samples are verified against the drafts (spec_decode/verify.py)
and only the accepted tokens plus the target's own are returned.
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
from .block_table import BlockTableRows
from .row_sampling import RunnerOutput, sample_rows

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    # Rows that sample, in order, and where each one's logits rows start.
    sampling: list  # ScheduledRequest
    first_logits_row: np.ndarray


def allocate_kv_caches(
    model: LlamaModel, num_blocks: int, block_size: int, num_extra_blocks: int = 0, num_extra_layers: int = 0
) -> list[torch.Tensor]:
    """Per layer [2, num_blocks, block_size, kv_heads, head_dim]; the first
    num_extra_layers layers get num_extra_blocks more (a self-draft's scratch)."""
    c = model.config
    return [
        torch.zeros((2, num_blocks + (num_extra_blocks if i < num_extra_layers else 0), block_size,
                     c.num_kv_heads, c.head_dim), dtype=torch.float32)
        for i in range(c.num_layers)
    ]


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
        num_scratch_blocks: int = 0,
        num_scratch_layers: int = 0,
    ):
        self.model = model
        self.block_size = block_size
        # Scratch blocks (ids num_blocks and up) belong to the runner, not the pool: a
        # self-draft writes its unverified positions there, in the layers it runs.
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, num_scratch_blocks, num_scratch_layers)
        self.backend = get_backend(attention_backend)
        self.block_tables = BlockTableRows(max_num_seqs, -(-max_model_len // block_size))
        self.eos_token_ids = eos_token_ids
        # A DraftModelProposer when speculating with a draft model (see spec_decode/).
        self.drafter = None

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
        num_drafts = np.fromiter((len(s.draft_token_ids) for s in sched), np.int64, len(sched))
        token_ids: list[int] = []
        for s in sched:
            if s.draft_token_ids:
                token_ids.extend(s.request.all_token_ids[s.start : s.start + s.num_new_tokens - len(s.draft_token_ids)])
                token_ids.extend(s.draft_token_ids)
            else:
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
        # A row's last position, repeated n times at a fork; a speculative row's last
        # 1 + k positions, one each.
        cu_samples = np.zeros(len(sched) + 1, dtype=np.int64)
        np.cumsum(num_samples, out=cu_samples[1:])
        within = np.arange(cu_samples[-1]) - np.repeat(cu_samples[:-1], num_samples)
        logits_indices = np.repeat(cu[1:] - 1 - num_drafts, num_samples) + within * np.repeat(num_drafts > 0, num_samples)
        sampling = [s for s, k in zip(sched, num_samples.tolist()) if k]

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
            sampling=sampling,
            first_logits_row=cu_samples[:-1][num_samples > 0],
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
        if self.drafter is not None and self.drafter.needs_catch_up:
            self.drafter.catch_up(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sampling:
            return RunnerOutput({}, None, [])
        return sample_rows(logits, inputs.sampling, inputs.first_logits_row, self.eos_token_ids)

    def propose_drafts(self, requests: list[Request]) -> list[list[int]]:
        """Draft-model proposals for running decodes (between steps)."""
        return self.drafter.propose(requests)
