"""Draft-model proposals: k greedy decode steps of a small model, batched over requests.

The draft's KV for verified positions lives in paged blocks under the target's block
tables: for "self:N" it *is* the target's cache of its first N layers (the same
weights see the same tokens), for a separate model it is the draft's own cache with
the same layout, filled by running the draft over each step's batch as well.

Drafting writes KV for positions that are not verified yet. Those writes go to
runner-private scratch blocks (beyond the manager's pool), never to a request's own
blocks: the partly filled block holding the first drafted position is copied into
the request's first scratch block, and the draft's block table points there. The
target's verification then writes its own K/V for those positions as usual.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..attention.backend import AttentionBackend
from ..attention.metadata import AttentionMetadata, slot_mapping
from ..core.kv_plan import DraftKV, scratch_blocks_per_seq
from ..core.request import Request
from ..model.config import ModelConfig
from ..model.llama import LlamaModel
from ..model.loader import LoadedModel, load_model
from ..spec_decode.spec_config import SpeculativeConfig
from .block_table import BlockTableRows
from .kv_tensors import copy_blocks


def load_draft(target: LoadedModel, spec: SpeculativeConfig | None, kernels: str) -> LoadedModel | None:
    """The draft model: the target itself for "self:N", else a model sharing its tokenizer,
    running on the same `kernels` path."""
    if spec is None or spec.method != "draft_model":
        return None
    layers = spec.self_draft_layers
    if layers is not None:
        if layers >= target.config.num_layers:
            raise ValueError(f'speculative_config.model "self:{layers}" must use fewer layers than the '
                             f"target's {target.config.num_layers}")
        return target
    draft = load_model(spec.model)
    draft.model.set_kernels(kernels)
    probe = "Speculative decoding needs one vocabulary: ¿sí? 123 <|im_end|>"
    if (draft.config.vocab_size != target.config.vocab_size
            or draft.tokenizer.encode(probe) != target.tokenizer.encode(probe)
            or draft.tokenizer.eos_token_id != target.tokenizer.eos_token_id):
        raise ValueError(f"speculative_config.model {spec.model!r} does not share the target's tokenizer "
                         f"(vocab {draft.config.vocab_size} vs {target.config.vocab_size})")
    return draft


def draft_kv(spec: SpeculativeConfig, draft: ModelConfig, target: ModelConfig, max_num_seqs: int,
             dtype_bytes: int = 4) -> DraftKV:
    """The KV a draft model needs: a self-draft runs the target's first N layers."""
    layers = spec.self_draft_layers
    kv = draft.kv_bytes_per_token(dtype_bytes)
    if layers is not None:
        kv = kv * layers // target.num_layers
    return DraftKV(kv, own_cache=layers is None, num_seqs=spec.max_drafting_seqs(max_num_seqs),
                   num_speculative_tokens=spec.num_speculative_tokens)


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[torch.Tensor],
        block_tables: BlockTableRows,
        backend: AttentionBackend,
        block_size: int,
        k: int,
        scratch_start: int,
        max_num_seqs: int,
        shares_target_cache: bool,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_tables = block_tables
        self.backend = backend
        self.block_size = block_size
        self.k = k
        per_seq = scratch_blocks_per_seq(block_size, k)
        self.scratch = scratch_start + np.arange(max_num_seqs * per_seq, dtype=np.int64).reshape(max_num_seqs, per_seq)
        # A separate draft model must see every token the target computes.
        self.needs_catch_up = not shares_target_cache

    @torch.inference_mode()
    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write the draft's KV for one target step's tokens (no logits)."""
        self.model(input_ids, positions, self.kv_caches, meta, self.backend, torch.empty(0, dtype=torch.int64))

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request]) -> list[list[int]]:
        """Up to k greedy tokens per request, each limited to its max_draft_tokens.
        A request the runner has no table for yet (a child forked this step) gets none."""
        known = [i for i, r in enumerate(requests) if r.request_id in self.block_tables.row_of]
        out: list[list[int]] = [[] for _ in requests]
        for i, drafts in zip(known, self._propose([requests[i] for i in known])):
            out[i] = drafts
        return out

    def _propose(self, requests: Sequence[Request]) -> list[list[int]]:
        num = len(requests)
        if num == 0:
            return []
        bs = self.block_size
        wanted = np.fromiter((min(self.k, r.max_draft_tokens) for r in requests), np.int64, num)
        steps = int(wanted.max())
        if steps <= 0:
            return [[] for _ in requests]
        rows = np.fromiter((self.block_tables.row_of[r.request_id] for r in requests), np.int64, num)
        # Position of each request's last token, which has no KV yet.
        pos = np.fromiter((r.num_tokens - 1 for r in requests), np.int64, num)
        first_block = pos // bs
        scratch = self.scratch[:num]
        width = int(first_block.max()) + scratch.shape[1]
        real = self.block_tables.table[rows]
        table = np.zeros((num, width), dtype=np.int64)
        shared = min(width, real.shape[1])
        table[:, :shared] = real[:, :shared]
        seq = np.arange(num)
        table[seq[:, None], first_block[:, None] + np.arange(scratch.shape[1])] = scratch
        partial = pos % bs != 0
        if partial.any():
            copy_blocks(self.kv_caches, torch.from_numpy(real[partial, first_block[partial]]),
                        torch.from_numpy(scratch[partial, 0]))
        table_t = torch.from_numpy(table)
        tokens = torch.tensor([r.all_token_ids[-1] for r in requests], dtype=torch.int64)
        rows_out = torch.arange(num)
        query_start = torch.arange(num + 1)
        drafted = torch.empty((num, steps), dtype=torch.int64)
        for j in range(steps):
            p = pos + j
            meta = AttentionMetadata(
                query_start_loc=query_start,
                seq_lens=torch.from_numpy(p + 1),
                block_tables=table_t,
                slot_mapping=torch.from_numpy(slot_mapping(table, seq, p, bs)),
                query_lens_cpu=[1] * num,
                seq_lens_cpu=(p + 1).tolist(),
                block_size=bs,
            )
            logits = self.model(tokens, torch.from_numpy(p), self.kv_caches, meta, self.backend, rows_out)
            tokens = logits.argmax(dim=-1)
            drafted[:, j] = tokens
        return [row[: max(n, 0)] for row, n in zip(drafted.tolist(), wanted.tolist())]
