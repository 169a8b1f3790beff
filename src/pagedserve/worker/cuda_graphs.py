"""Decode steps replayed from captured graphs: the capture ladder, bucket choice, padding into
static buffers, and what invalidates a graph.

A decode step's kernels are small at low batch sizes (one token per sequence), so on a GPU
launching ~10 kernels x layers costs more than running them; a CUDA graph launches the whole
forward at once. A graph replays fixed kernels on fixed addresses, so:

- the step's inputs are copied into static buffers (ids, positions, slots, seq lens, block
  tables) and its logits read from a static output;
- one graph per batch size on a ladder (1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, 256),
  or --max-cudagraph-batch); a batch of n pads to the smallest captured size >= n. A padding
  row computes token 0 at position 0 with a context of one token in a reserved dummy block
  that no request owns, so it writes nothing real and reads nothing real;
- the block tables have a static width; a step needing more blocks per sequence than that
  widens it (doubling, up to max_model_len) and drops every graph, which are then captured
  again as their sizes are next used (invalidation);
- only decode-only steps replay: every row computes exactly one token and samples once,
  without prompt logprobs. Prefill and mixed steps run eagerly: their token counts and
  per-sequence query lengths vary every step, so a graph per shape is not worth its memory
  (vLLM's piecewise graphs likewise keep attention outside the graph for them).

A captured decode's attention metadata lists the static block-table width (in tokens) as
every row's length in `seq_lens_cpu`, and its query lengths as 1: a graph-safe backend sizes
its launch from those host numbers and reads the real lengths from the `seq_lens` tensor.

On CPU there is nothing to capture; `EagerGraph` runs the same function on the same static
buffers at every replay (with the padded step's real host lengths, which the CPU backends
branch on), so tests exercise bucketing, padding and the dummy block on the real model.
"""
from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_MAX_CUDAGRAPH_BATCH = 256
# The first static block-table width covers this many tokens (or max_model_len if less):
# a launch sized for the width then does not pay for 128k-token contexts nobody has.
INITIAL_GRAPH_CONTEXT = 4096

# The captured function: (input_ids, positions, metadata, logits_indices) -> fp32 logits.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


def capture_sizes(max_num_seqs: int, max_cudagraph_batch: int | None = None) -> tuple[int, ...]:
    """The ladder 1, 2, 4, 8, 16, 24, 32, ... (steps of 8) up to the cap, the cap itself last."""
    cap = min(max_num_seqs, max_cudagraph_batch or DEFAULT_MAX_CUDAGRAPH_BATCH)
    if cap < 1:
        raise ValueError(f"the largest captured batch must be >= 1, got {cap}")
    sizes = [s for s in (1, 2, 4, *range(8, cap + 1, 8)) if s <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return tuple(sizes)


def bucket_for(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size >= num_seqs; None when the batch is larger than all."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def widen(width: int, needed: int, max_width: int) -> int:
    """The next static block-table width holding `needed` blocks: doubled until it does."""
    if needed > max_width:
        raise ValueError(f"a step needs {needed} blocks per sequence; max_model_len allows {max_width}")
    while width < needed:
        width *= 2
    return min(width, max_width)


@dataclass
class StaticDecodeBuffers:
    """The addresses every captured graph reads and writes, sized for the largest batch."""

    input_ids: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int64 [B]
    slot_mapping: torch.Tensor  # int64 [B]
    seq_lens: torch.Tensor  # int64 [B]
    block_tables: torch.Tensor  # int64 [B, width]
    query_start_loc: torch.Tensor  # int64 [B + 1]: 0, 1, 2, ... (one token per row)
    logits_indices: torch.Tensor  # int64 [B]: 0, 1, 2, ...
    dummy_block: int
    block_size: int

    @classmethod
    def allocate(cls, max_batch: int, width: int, dummy_block: int, block_size: int,
                 device: torch.device) -> "StaticDecodeBuffers":
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        buffers = cls(zeros(max_batch), zeros(max_batch), zeros(max_batch), zeros(max_batch), zeros(max_batch, width),
                      torch.arange(max_batch + 1, device=device), torch.arange(max_batch, device=device),
                      dummy_block, block_size)
        buffers.pad(0)
        return buffers

    @property
    def width(self) -> int:
        return self.block_tables.shape[1]

    def pad(self, start: int, end: int | None = None) -> None:
        """Rows start .. end become padding: token 0 at position 0 of the dummy block."""
        rows = slice(start, end)
        self.input_ids[rows] = 0
        self.positions[rows] = 0
        self.slot_mapping[rows] = self.dummy_block * self.block_size
        self.seq_lens[rows] = 1
        self.block_tables[rows] = self.dummy_block

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, padded: int) -> None:
        """Copy a decode step of n rows into rows 0 .. n - 1 and pad rows n .. padded - 1.
        Columns past the step's own block-table width keep stale ids: a row reads only the
        blocks its length reaches."""
        n, w = meta.num_seqs, meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :w].copy_(meta.block_tables, non_blocking=True)
        if padded > n:
            self.pad(n, padded)

    def metadata(self, batch: int, seq_lens_cpu: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch], slot_mapping=self.slot_mapping[:batch],
            query_lens_cpu=[1] * batch, seq_lens_cpu=seq_lens_cpu, block_size=self.block_size)


class EagerGraph:
    """A "graph" that runs its function again at each replay, on the same static buffers:
    the CPU stand-in for a CUDA graph (and what tests drive)."""

    def __init__(self, forward: DecodeForward, buffers: StaticDecodeBuffers, batch: int):
        self.forward, self.buffers, self.batch = forward, buffers, batch

    def replay(self, seq_lens_cpu: list[int]) -> torch.Tensor:
        b = self.buffers
        meta = b.metadata(self.batch, seq_lens_cpu)
        return self.forward(b.input_ids[: self.batch], b.positions[: self.batch], meta, b.logits_indices[: self.batch])


class CudaGraph:
    """One captured decode forward of `batch` rows; replay() reruns its kernels."""

    def __init__(self, forward: DecodeForward, buffers: StaticDecodeBuffers, batch: int, pool: object):
        b = buffers
        bound = b.width * b.block_size
        # Frozen into the graph: the host lengths are the width's bound (see the module doc).
        meta = b.metadata(batch, [bound] * batch)
        args = (b.input_ids[:batch], b.positions[:batch], meta, b.logits_indices[:batch])
        # Warm up on a side stream (lazy initialisation, autotuning, workspaces) before capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward(*args)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = forward(*args)

    def replay(self, seq_lens_cpu: list[int]) -> torch.Tensor:
        self.graph.replay()
        return self.output


@dataclass
class GraphStats:
    replays: Counter = field(default_factory=Counter)  # by captured size
    captures: int = 0
    invalidations: int = 0
    eager: Counter = field(default_factory=Counter)  # decode-or-not steps run eagerly, by reason


class DecodeGraphRunner:
    """Graphs for a ladder of decode batch sizes over one set of static buffers.

    `mode` "cuda" captures CUDA graphs (all sizes at `capture_all`, largest first so smaller
    ones reuse its memory pool); "eager" replays the function eagerly (CPU, tests)."""

    def __init__(self, forward: DecodeForward, sizes: tuple[int, ...], max_blocks_per_seq: int, block_size: int,
                 dummy_block: int, device: torch.device, mode: str = "cuda",
                 initial_width: int | None = None):
        if mode not in ("cuda", "eager"):
            raise ValueError(f"mode must be 'cuda' or 'eager', got {mode!r}")
        self.forward, self.sizes, self.mode = forward, sizes, mode
        self.max_blocks = max_blocks_per_seq
        self.block_size, self.dummy_block, self.device = block_size, dummy_block, device
        first = initial_width or -(-INITIAL_GRAPH_CONTEXT // block_size)
        self.buffers = StaticDecodeBuffers.allocate(sizes[-1], min(first, max_blocks_per_seq), dummy_block,
                                                    block_size, device)
        self.graphs: dict[int, EagerGraph | CudaGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.stats = GraphStats()

    @torch.inference_mode()
    def capture_all(self) -> None:
        for size in reversed(self.sizes):
            self._graph(size)

    def _graph(self, size: int) -> EagerGraph | CudaGraph:
        graph = self.graphs.get(size)
        if graph is None:
            graph = (CudaGraph(self.forward, self.buffers, size, self._pool) if self.mode == "cuda"
                     else EagerGraph(self.forward, self.buffers, size))
            self.graphs[size] = graph
            self.stats.captures += 1
        return graph

    def invalidate(self, width: int) -> None:
        """New static buffers `width` blocks wide; every graph read the old ones, so all go."""
        logger.info("decode graphs: block-table width %d -> %d blocks; recapturing as used", self.buffers.width, width)
        self.graphs.clear()
        self.buffers = StaticDecodeBuffers.allocate(self.sizes[-1], width, self.dummy_block, self.block_size,
                                                    self.device)
        self.stats.invalidations += 1

    def eager_reason(self, meta: AttentionMetadata, num_logits_rows: int, has_prompt_logprobs: bool) -> str | None:
        """Why a step cannot replay (None: it can)."""
        if meta.max_query_len != 1:
            return "prefill or speculative rows"
        if has_prompt_logprobs or num_logits_rows != meta.num_seqs:
            return "not one sample per row"
        if meta.num_seqs > self.sizes[-1]:
            return "batch above the largest captured size"
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only step (eager_reason None) from its padded graph."""
        n = meta.num_seqs
        size = bucket_for(n, self.sizes)
        needed = meta.block_tables.shape[1]
        if needed > self.buffers.width:
            self.invalidate(widen(self.buffers.width, needed, self.max_blocks))
        self.buffers.fill(input_ids, positions, meta, size)
        graph = self._graph(size)
        self.stats.replays[size] += 1
        return graph.replay(meta.seq_lens_cpu + [1] * (size - n))[:n]
