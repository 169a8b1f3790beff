"""Time paged-attention designs per layer on SmolLM2-135M shapes and print tables.

    .venv/bin/python benchmarks/attention_backends.py [--reps 9] [--threads 2]
        [--clock wall|cpu] [--cases decode,spec] [--tables 1,2]

Shapes: 9 query heads, 3 KV heads, head_dim 64, block_size 16, float32, random
shuffled block tables. Each figure is the best of --reps calls of one layer's
forward (write_kv included) in ms, candidates interleaved so that load from other
processes hits them alike; per-step work (prepare) is timed apart, since the runner
pays it once for all 30 layers. Every candidate is checked against the reference
(a wrong one is marked WRONG). On a machine shared with other jobs, wall-clock
figures swing by several times; `--threads 1 --clock cpu` (this thread's CPU time)
gives stable relative figures. Interleaving also leaves the caches cold for every
call, which costs the smallest shapes (under ~2 ms) a few tenths of a ms.

Table 1 compares the designs; table 2 takes the chosen backend ("cpu") apart, one
choice at a time.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.attention import cpu_backend
from pagedserve.attention.backend import ReferenceBackend, write_kv
from pagedserve.attention.cpu_backend import CpuPagedAttention, StepPlan, build_plan
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.testing import random_step

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
GROUP = NUM_HEADS // NUM_KV_HEADS
SCALE = HEAD_DIM**-0.5


def _cases() -> dict[str, list[tuple[int, int]]]:
    """(query_len, seq_len) per sequence, for each named step shape."""
    rnd = random.Random(0)
    uniform = [(1, rnd.randint(64, 2048)) for _ in range(64)]
    return {
        "decode 1x2048": [(1, 2048)],
        "decode 16x512": [(1, 512)] * 16,
        "decode 64x64": [(1, 64)] * 64,
        "decode 64x2048": [(1, 2048)] * 64,
        "decode 64xU[64,2048]": uniform,
        "decode 1x2000+31xU[64,128]": [(1, 2000)] + [(1, rnd.randint(64, 128)) for _ in range(31)],
        "prefill 1024, no context": [(1024, 1024)],
        "prefill 512 after 512": [(512, 1024)],
        "prefill 256 after 4000": [(256, 4256)],
        "prefill 1024 after 2000": [(1024, 3024)],
        "mixed 32 decodes + 512 after 1000": uniform[:32] + [(512, 1512)],
        "spec 16x(2..5) U[64,2048]": [(rnd.randint(2, 5), rnd.randint(64, 2048)) for _ in range(16)],
    }


def build_step(seqs: list[tuple[int, int]], seed: int = 0):
    return random_step(seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, seed, spare_blocks=1)


# ---- Candidate 1: everything padded into one SDPA call -------------------------------


def _fresh(kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A new gather buffer, as a backend without a workspace allocates for every call."""
    return torch.empty(2 * num_blocks * math.prod(kv_cache.shape[2:]), dtype=kv_cache.dtype)


def _short_seqs(meta: AttentionMetadata) -> list[int]:
    return [i for i, n in enumerate(meta.query_lens_cpu) if 0 < n < cpu_backend.PREFILL_MIN_QUERY_LEN]


class PaddedSDPA:
    """All sequences gathered (one index_select) into [B, Hkv, Lmax, D], queries padded
    to the longest, one masked SDPA call. `gqa` is how query heads meet KV heads:
    "expand" repeats K/V, "enable_gqa" leaves it to SDPA, "fold" puts the query heads
    of a KV head on the query axis."""

    def __init__(self, gqa: str) -> None:
        self.name = f"padded/{gqa}"
        self.gqa = gqa

    def prepare(self, meta: AttentionMetadata):
        group = cpu_backend._short_group(meta, [i for i, n in enumerate(meta.query_lens_cpu) if n])
        heads_per_kv = GROUP if self.gqa == "fold" else 1
        return group, group.bias_for(heads_per_kv, torch.float32)

    def forward(self, q, k, v, kv_cache, meta, scale, plan):
        group, bias = plan
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], NUM_HEADS * HEAD_DIM)
        if self.gqa == "fold":
            cpu_backend._attend_group(group, q, kv_cache, _fresh(kv_cache, group.block_ids.numel()), out, scale)
            return out
        n, qlen = group.num_seqs, group.query_len
        kv = kv_cache.index_select(1, group.block_ids).view(2, n, -1, NUM_KV_HEADS, HEAD_DIM).transpose(2, 3)
        keys, values = kv[0], kv[1]
        if self.gqa == "expand":
            keys, values = keys.repeat_interleave(GROUP, 1), values.repeat_interleave(GROUP, 1)
        queries = q.index_select(0, group.q_rows).view(n, qlen, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=bias, scale=scale, enable_gqa=self.gqa == "enable_gqa"
        )
        rows = attended.transpose(1, 2).reshape(n * qlen, -1)
        if group.real_rows is not None:
            rows = rows.index_select(0, group.real_rows)
        return out.index_copy_(0, group.out_rows, rows)


# ---- Candidate 2: decodes batched, prefill chunks one by one with a mask --------------


@dataclass
class MaskedChunk:
    """A prefill chunk attended in one call over its whole sequence with an explicit mask."""

    chunk: cpu_backend.PrefillChunk
    block_ids: torch.Tensor  # the blocks of the whole sequence, the chunk's own included
    bias: torch.Tensor  # [query_len, seq_len]: causal over the chunk, bottom-right aligned


def _masked_chunks(plan: StepPlan) -> list[MaskedChunk]:
    chunks = []
    for chunk in plan.prefills:
        seq_len = chunk.context_len + chunk.query_len
        row = int((plan.meta.query_start_loc == chunk.start).nonzero()[0])
        future = torch.arange(seq_len).unsqueeze(0) > torch.arange(chunk.context_len, seq_len).unsqueeze(1)
        chunks.append(
            MaskedChunk(
                chunk,
                plan.meta.block_tables[row, : -(-seq_len // BLOCK_SIZE)],
                torch.zeros(future.shape).masked_fill_(future, float("-inf")),
            )
        )
    return chunks


def _prefill_masked(masked: MaskedChunk, q, k, v, kv_cache, workspace, out, scale) -> None:
    """is_causal over the chunk's own K/V when there is no context, else one call over
    the gathered sequence with the explicit mask."""
    chunk = masked.chunk
    rows = slice(chunk.start, chunk.start + chunk.query_len)
    queries = q[rows].transpose(0, 1).unsqueeze(0)
    if chunk.context_len == 0:
        keys, values = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        seq_len = chunk.context_len + chunk.query_len
        kv = cpu_backend._gather(kv_cache, masked.block_ids, workspace)
        kv = kv.reshape(2, 1, -1, NUM_KV_HEADS, HEAD_DIM)[:, :, :seq_len].transpose(2, 3)
        attended = F.scaled_dot_product_attention(
            queries, kv[0], kv[1], attn_mask=masked.bias, scale=scale, enable_gqa=True
        )
    out[rows] = attended[0].transpose(0, 1).reshape(chunk.query_len, -1)


class SplitByKind:
    """Short queries in one padded group (SDPA, or matmul + softmax when `bmm`); each
    prefill chunk alone with an explicit mask. A fresh tensor for every gather."""

    def __init__(self, bmm: bool) -> None:
        self.name = "split/bmm" if bmm else "split/sdpa"
        self.bmm = bmm

    def prepare(self, meta):
        plan = build_plan(meta)
        members = _short_seqs(meta)
        groups = [cpu_backend._short_group(meta, members)] if members else []
        for group in groups:
            group.bias_for(GROUP, torch.float32)
        return groups, _masked_chunks(plan)

    def forward(self, q, k, v, kv_cache, meta, scale, plan):
        groups, chunks = plan
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], NUM_HEADS * HEAD_DIM)
        for group in groups:
            if self.bmm:
                _group_bmm(group, q, kv_cache, out, scale)
            else:
                cpu_backend._attend_group(group, q, kv_cache, _fresh(kv_cache, group.block_ids.numel()), out, scale)
        for masked in chunks:
            _prefill_masked(masked, q, k, v, kv_cache, _fresh(kv_cache, masked.block_ids.numel()), out, scale)
        return out


def _group_bmm(group, q, kv_cache, out, scale) -> None:
    n, qlen = group.num_seqs, group.query_len
    kv = kv_cache.index_select(1, group.block_ids).view(2, n, -1, NUM_KV_HEADS, HEAD_DIM).transpose(2, 3)
    queries = (
        q.index_select(0, group.q_rows)
        .view(n, qlen, NUM_KV_HEADS, GROUP, HEAD_DIM)
        .transpose(1, 2)
        .reshape(n, NUM_KV_HEADS, qlen * GROUP, HEAD_DIM)
    )
    scores = torch.matmul(queries, kv[0].transpose(-1, -2)).mul_(scale)
    bias = group.bias_for(GROUP, q.dtype)
    if bias is not None:
        scores += bias
    attended = torch.matmul(torch.softmax(scores, dim=-1), kv[1])
    rows = attended.view(n, NUM_KV_HEADS, qlen, GROUP, HEAD_DIM).transpose(1, 2).reshape(n * qlen, -1)
    if group.real_rows is not None:
        rows = rows.index_select(0, group.real_rows)
    out.index_copy_(0, group.out_rows, rows)


# ---- The chosen backend and its ablations ---------------------------------------------


class Chosen:
    """CpuPagedAttention as shipped, or with one of its choices undone."""

    def __init__(self, without: str | None = None) -> None:
        self.name = "cpu" if without is None else f"cpu - {without}"
        self.without = without
        self.backend = CpuPagedAttention()

    def prepare(self, meta):
        plan = self.backend.prepare(meta)
        if self.without == "length groups":
            members = _short_seqs(meta)
            plan.groups = [cpu_backend._short_group(meta, members)] if members else []
            plan.max_gathered_blocks = max([g.block_ids.numel() for g in plan.groups] + [plan.max_gathered_blocks])
        for group in plan.groups:
            group.bias_for(GROUP, torch.float32)
        if self.without == "two-part prefill":
            chunks = _masked_chunks(plan)
            plan.max_gathered_blocks = max([plan.max_gathered_blocks] + [c.block_ids.numel() for c in chunks])
            return plan, chunks
        return plan, None

    def forward(self, q, k, v, kv_cache, meta, scale, plan):
        plan, chunks = plan
        if self.without in (None, "length groups"):
            return self.backend.forward(q, k, v, kv_cache, meta, scale)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], NUM_HEADS * HEAD_DIM)
        if self.without == "workspace":
            for group in plan.groups:
                workspace = _fresh(kv_cache, group.block_ids.numel())
                cpu_backend._attend_group(group, q, kv_cache, workspace, out, scale)
            for chunk in plan.prefills:
                workspace = _fresh(kv_cache, chunk.block_ids.numel())
                cpu_backend.attend_prefill(chunk, q, k, v, kv_cache, workspace, out, scale)
        else:
            workspace = self.backend._workspace_for(kv_cache, plan.max_gathered_blocks)
            for group in plan.groups:
                cpu_backend._attend_group(group, q, kv_cache, workspace, out, scale)
            for masked in chunks:
                _prefill_masked(masked, q, k, v, kv_cache, workspace, out, scale)
        return out


class Reference:
    name = "reference"

    def prepare(self, meta):
        return None

    def forward(self, q, k, v, kv_cache, meta, scale, plan):
        return ReferenceBackend().forward(q, k, v, kv_cache, meta, scale)


def _time_once(fn: Callable[[], object], clock: Callable[[], float], results: dict[str, float], key: str) -> None:
    """Keep the best time seen for `key`."""
    t0 = clock()
    fn()
    results[key] = min(results.get(key, math.inf), (clock() - t0) * 1e3)


def run_table(title: str, candidates: list, cases: dict, reps: int, clock: Callable[[], float]) -> None:
    print(f"\n{title}  (ms per layer, best of {reps}; prepare = per-step plan of 'cpu')\n")
    names = [c.name for c in candidates]
    print("| step shape | " + " | ".join(names) + " | prepare |")
    print("|---" * (len(names) + 2) + "|")
    for case, seqs in cases.items():
        q, k, v, cache, meta = build_step(seqs)
        expected = ReferenceBackend().forward(q, k, v, cache.clone(), meta, SCALE)
        plans = {c.name: c.prepare(meta) for c in candidates}
        wrong = set()
        for c in candidates:
            got = c.forward(q, k, v, cache, meta, SCALE, plans[c.name])  # also the warm-up
            if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
                wrong.add(c.name)
        times: dict[str, float] = {}
        for _ in range(reps):
            for c in candidates:
                _time_once(lambda: c.forward(q, k, v, cache, meta, SCALE, plans[c.name]), clock, times, c.name)
            _time_once(lambda: build_plan(meta), clock, times, "prepare")
        cells = [f"{times[n]:.2f}" + (" WRONG" if n in wrong else "") for n in names]
        best = min(times[n] for n in names if n not in wrong)
        cells = [f"**{c}**" if times[n] == best else c for c, n in zip(cells, names)]
        print(f"| {case} | " + " | ".join(cells) + f" | {times['prepare']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this thread's CPU time, immune to other processes on a shared machine (needs --threads 1)",
    )
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names to keep")
    parser.add_argument("--tables", default="1,2", help="which tables to print: 1 (designs), 2 (ablations)")
    args = parser.parse_args()
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    if args.clock == "cpu" and args.threads != 1:
        raise ValueError(f"--clock cpu needs --threads 1 (one thread's CPU time), got --threads {args.threads}")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    cases = _cases()
    if args.cases:
        keep = args.cases.split(",")
        cases = {name: seqs for name, seqs in cases.items() if any(s in name for s in keep)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, float32, "
          f"H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block_size={BLOCK_SIZE}")
    if "1" in args.tables:
        designs = [
            Reference(),
            PaddedSDPA("expand"),
            PaddedSDPA("enable_gqa"),
            PaddedSDPA("fold"),
            SplitByKind(bmm=True),
            SplitByKind(bmm=False),
            Chosen(),
        ]
        run_table("Table 1: designs", designs, cases, args.reps, clock)
    if "2" in args.tables:
        ablations = [Chosen(), Chosen("workspace"), Chosen("length groups"), Chosen("two-part prefill")]
        run_table("Table 2: the chosen backend with one choice undone", ablations, cases, args.reps, clock)


if __name__ == "__main__":
    main()
