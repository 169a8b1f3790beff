"""Run pagedserve's model on whole sequences without the engine: contiguous block
tables over a private KV cache. Tests of the model alone use it."""
from __future__ import annotations

import torch

from pagedserve.attention.backend import ReferenceBackend
from pagedserve.attention.metadata import AttentionMetadata

BLOCK_SIZE = 16


def new_kv_caches(model, num_blocks: int) -> list[torch.Tensor]:
    c = model.config
    return [torch.zeros(2, num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]


def step_metadata(starts: list[int], query_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """Sequence i computes positions starts[i] .. starts[i]+query_lens[i]-1 using block table tables[i]."""
    seq_lens = [s + q for s, q in zip(starts, query_lens)]
    return AttentionMetadata.for_sequences(query_lens, seq_lens, tables, BLOCK_SIZE)


@torch.inference_mode()
def prefill_logits(model, token_ids: list[int], backend=None) -> torch.Tensor:
    """Logits at every position of one sequence (asked for explicitly, row by row)."""
    backend = backend or ReferenceBackend()
    n = len(token_ids)
    nblocks = -(-n // BLOCK_SIZE)
    caches = new_kv_caches(model, nblocks + 1)
    meta = step_metadata([0], [n], [list(range(1, nblocks + 1))])
    return model(torch.tensor(token_ids), torch.arange(n), caches, meta, backend, torch.arange(n))


@torch.inference_mode()
def greedy_generate(model, token_ids: list[int], max_new_tokens: int, backend=None) -> list[int]:
    """Prefill, then decode one token per step through the paged cache."""
    backend = backend or ReferenceBackend()
    total = len(token_ids) + max_new_tokens
    nblocks = -(-total // BLOCK_SIZE)
    caches = new_kv_caches(model, nblocks + 1)
    table = list(range(nblocks, 0, -1))  # deliberately not in ascending order
    ids = list(token_ids)
    out: list[int] = []
    start, new = 0, list(token_ids)
    for _ in range(max_new_tokens):
        meta = step_metadata([start], [len(new)], [table])
        logits = model(
            torch.tensor(new), torch.arange(start, start + len(new)), caches, meta, backend,
            torch.tensor([len(new) - 1]),
        )
        tok = int(logits[0].argmax())
        out.append(tok)
        start += len(new)
        new = [tok]
        ids.append(tok)
    return out


def fp32_matrices(model: torch.nn.Module) -> list[str]:
    """Every 2-D float32 tensor the model holds, parameters or plain attributes."""
    found = [n for n, p in model.named_parameters() if p.dim() == 2 and p.dtype == torch.float32]
    for name, m in model.named_modules():
        found += [f"{name}.{k}" for k, v in vars(m).items()
                  if isinstance(v, torch.Tensor) and v.dim() == 2 and v.dtype == torch.float32]
    return found


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters, buffers, plain attributes such as
    packed tiles), each storage counted once (a tied head shares its embedding's)."""
    storages: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t.device.type != "meta":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
