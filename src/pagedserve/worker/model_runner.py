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

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..attention.backend import AttentionBackend
from ..attention.metadata import AttentionMetadata, slot_mapping
from ..attention.selector import get_backend
from ..attention.timed import TimedBackend
from ..core.kv_plan import KVCachePlan
from ..core.scheduler_output import ScheduledRequest, SchedulerOutput
from ..core.request import Request
from ..kv_transfer.base import KVConnectorWorker
from ..model.llama import LlamaModel
from ..model.lora import LoRABatch, LoRASlots
from ..spec_decode.spec_config import SpeculativeConfig
from ..spec_decode.ngram import NgramProposer
from .beam_candidates import beam_candidates, split_beam_rows
from .block_table import BlockTableRows
from .cuda_graphs import DecodeGraphRunner, capture_sizes
from .device_inputs import DeviceInputs
from .draft_model import DraftModelProposer
from .image_embeds import ImageEmbedder, ImageRows
from .kv_tensors import allocate_kv_caches, copy_blocks, kv_cache_torch_dtype
from .pooling import PoolingPlan, PoolingState, plan_pooling
from .prompt_logprobs import PromptLogprobsPlan, compute_prompt_logprobs, plan_prompt_logprobs
from .row_sampling import RunnerOutput, sample_rows


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    # Rows that sample, in order, and where each one's logits rows start.
    sampling: list[ScheduledRequest]
    first_logits_row: np.ndarray
    # Rows that want prompt logprobs; their logits rows follow the sampling ones.
    prompt_logprobs: PromptLogprobsPlan | None = None
    # Tokens that run a LoRA adapter, by slot; None when every row is the base model's.
    lora: LoRABatch | None = None
    # Pooling rows and the hidden rows they need; None when no row pools.
    pooling: PoolingPlan | None = None
    # Image-token rows and the vision encoder's output for them; None when the step has none.
    images: ImageRows | None = None


class StepPeers(Protocol):
    """The other tensor-parallel ranks (distributed.executor): told each step's inputs and
    block copies before this rank runs its own part of the forward."""

    def run_step(self, inputs: StepInputs | None, copies: tuple[torch.Tensor, torch.Tensor] | None) -> None: ...


def check_attention_options(backend: AttentionBackend, model: LlamaModel) -> None:
    """ValueError at start-up for a model whose layers need an attention option the backend lacks."""
    if not backend.masks and any(layer.window or layer.softcap for layer in model.layers):
        raise ValueError(f"{model.config.architecture} has sliding-window or soft-capped attention layers, which "
                         f"the {backend.name} attention backend lacks; use the native or cpu backend "
                         "(the paged KV layout)")
    if not backend.attention_sinks and any(layer.sinks is not None for layer in model.layers):
        raise ValueError(f"{model.config.architecture} has attention sinks, which the {backend.name} "
                         "attention backend lacks; use the native or cpu backend")


class ModelRunner:
    """Owns the model's device state: KV caches, block tables, the attention backend and,
    with a SpeculativeConfig, the proposer (n-gram, or a draft model and its scratch)."""

    def __init__(
        self,
        model: LlamaModel,
        kv_plan: KVCachePlan,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        attention_backend: str | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: LlamaModel | None = None,
        kv_cache_dtype: str = "auto",
        peers: StepPeers | None = None,
        kv_connector: KVConnectorWorker | None = None,
        device: torch.device | None = None,
        decode_graphs: str | None = None,
        max_cudagraph_batch: int | None = None,
        model_dtype: torch.dtype = torch.float32,
        kv_caches: list[torch.Tensor] | None = None,
        lora_slots: LoRASlots | None = None,
        images: ImageEmbedder | None = None,
    ):
        """`device`: where the model's weights are (default cpu). `decode_graphs`: None (eager),
        "cuda" (CUDA graphs) or "eager" (the same bucketing and padding, replayed eagerly: tests).
        `model_dtype`: the activations' dtype, which kv_cache_dtype "auto" stores. `kv_caches`:
        per-layer caches made elsewhere (the contiguous layout's mapping); None allocates the paged
        pool the plan sizes. `images`: a vision model's encoder and its requests' pixels (or None)."""
        self.model, self.images, self.peers = model, images, peers
        self.device = device = device or torch.device("cpu")
        # The loaded LoRA adapters' stacked weights (None: LoRA is off).
        self.lora_slots = lora_slots
        self.block_size = bs = kv_plan.block_size
        self_layers = speculative.self_draft_layers if speculative is not None else None
        # Scratch blocks (ids num_blocks and up) belong to the runner, not the pool: a
        # self-draft writes its unverified positions there, in the layers it runs.
        num_scratch = kv_plan.num_scratch_blocks if self_layers is not None else 0
        if decode_graphs is not None and speculative is not None and speculative.method != "ngram":
            # A draft model's steps run eagerly beside the target's; EngineConfig.resolve keeps draft models off cuda.
            raise ValueError("decode graphs cannot run beside a draft model; pass decode_graphs=None")
        # Decode graphs pad their batch with rows in a dummy block past the pool (id num_blocks).
        num_dummy = 1 if decode_graphs is not None else 0
        dtype = kv_cache_torch_dtype(kv_cache_dtype, auto=model_dtype)
        self.kv_caches = kv_caches if kv_caches is not None else allocate_kv_caches(
            model, kv_plan.num_blocks + num_dummy, bs, dtype, num_scratch, self_layers or 0, device=device)
        # One pinned host-to-device copy per step off the CPU; on CPU the inputs stay as built.
        self._device_inputs = DeviceInputs(device) if device.type != "cpu" else None
        self.backend = get_backend(attention_backend)
        check_attention_options(self.backend, model)
        # The worker half of a KV connector (disaggregated prefill/decode), or None.
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.kv_caches)
        self.block_tables = BlockTableRows(max_num_seqs, -(-max_model_len // bs))
        self.eos_token_ids = eos_token_ids
        self.pooling = PoolingState()
        self.speculative = speculative
        self._drafter: DraftModelProposer | None = None
        self._propose: Callable[[Sequence[Request]], list[list[int]]] | None = None
        if speculative is not None and speculative.method == "ngram":
            self._propose = NgramProposer(speculative.num_speculative_tokens, speculative.prompt_lookup_min,
                                          speculative.prompt_lookup_max).propose
        elif speculative is not None:
            self._drafter = DraftModelProposer(
                draft,
                self.kv_caches[:self_layers] if self_layers is not None
                else allocate_kv_caches(draft, kv_plan.num_blocks + kv_plan.num_scratch_blocks, bs, dtype),
                self.block_tables, self.backend, bs, speculative.num_speculative_tokens,
                scratch_start=kv_plan.num_blocks, max_num_seqs=speculative.max_drafting_seqs(max_num_seqs),
                shares_target_cache=self_layers is not None,
            )
            self._propose = self._drafter.propose
        self.graphs: DecodeGraphRunner | None = None
        if decode_graphs is not None:
            self.graphs = DecodeGraphRunner(
                self.decode_forward, capture_sizes(max_num_seqs, max_cudagraph_batch), self.block_tables.table.shape[1],
                bs, dummy_block=kv_plan.num_blocks, device=device, mode=decode_graphs)
            self.graphs.capture_all()

    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        logits_indices: torch.Tensor) -> torch.Tensor:
        """The forward a decode graph captures (or, eager, reruns) on its static buffers."""
        self.backend.prepare(meta)
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend, logits_indices).float()

    # -- per-step state ---------------------------------------------------------------

    def _update_block_tables(self, out: SchedulerOutput) -> None:
        for rid in (*out.finished_request_ids, *out.preempted_request_ids):
            self.block_tables.remove(rid)
            self.pooling.drop(rid)
        for s in out.scheduled:
            if s.block_ids is not None:  # new, resumed, forked, or changed by copy-on-write
                self.block_tables.set(s.request_id, s.block_ids)
            elif s.new_block_ids:
                self.block_tables.append(s.request_id, s.new_block_ids)

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
        slots = slot_mapping(self.block_tables.table, token_rows, positions, bs)
        width = int((seq_lens.max() + bs - 1) // bs) if len(sched) else 0
        block_tables = self.block_tables.table[rows, :width]
        # A row's last position, repeated n times at a fork; a speculative row's last
        # 1 + k positions, one each.
        cu_samples = np.zeros(len(sched) + 1, dtype=np.int64)
        np.cumsum(num_samples, out=cu_samples[1:])
        within = np.arange(cu_samples[-1]) - np.repeat(cu_samples[:-1], num_samples)
        logits_indices = np.repeat(cu[1:] - 1 - num_drafts, num_samples) + within * np.repeat(num_drafts > 0, num_samples)
        sampling = [s for s, k in zip(sched, num_samples.tolist()) if k]
        lora = None
        if self.lora_slots is not None and self.lora_slots.slot_of:
            slot_of = self.lora_slots.slot_of
            row_slots = np.fromiter((slot_of.get(s.request.lora_id, -1) for s in sched), np.int64, len(sched))
            lora = self.lora_slots.batch(np.repeat(row_slots, num_new))
        prompt_plan = plan_prompt_logprobs(sched, cu[:-1])
        if prompt_plan is not None:
            logits_indices = np.concatenate([logits_indices, prompt_plan.logits_indices])

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
            prompt_logprobs=prompt_plan,
            lora=lora,
            pooling=plan_pooling(sched, cu[:-1]),
            images=self.images.step_rows(sched, cu[:-1]) if self.images is not None else None,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._update_block_tables(out)
        if self.kv_connector is not None:
            # Loads run beside this step's forward (into blocks no row of it touches).
            self.kv_connector.bind_connector_metadata(out.kv_connector_metadata)
            self.kv_connector.start_load_kv()
        copies = None
        if out.block_copies:
            # Copy-on-write: each request gets its private copy of a shared, partly filled block.
            copies = (torch.tensor([c[0] for c in out.block_copies]), torch.tensor([c[1] for c in out.block_copies]))
            copy_blocks(self.kv_caches, *copies)
        inputs = self.prepare_inputs(out) if out.scheduled else None
        if self.peers is not None and (inputs is not None or copies is not None):
            self.peers.run_step(inputs, copies)
        if inputs is None:
            return RunnerOutput({}, None, [])
        if self._device_inputs is not None:
            ids, positions, logits_indices, meta = self._device_inputs.send(
                inputs.input_ids, inputs.positions, inputs.logits_indices, inputs.meta)
            inputs = dataclasses.replace(inputs, input_ids=ids, positions=positions, logits_indices=logits_indices,
                                         meta=meta)
        logits, pooled = self._forward(inputs)
        if self._drafter is not None and self._drafter.needs_catch_up:
            self._drafter.catch_up(inputs.input_ids, inputs.positions, inputs.meta)
        prompt_logprobs = []
        if inputs.prompt_logprobs is not None:
            num_extra = len(inputs.prompt_logprobs.logits_indices)
            prompt_logprobs = compute_prompt_logprobs(logits[-num_extra:].cpu(), inputs.prompt_logprobs)
            logits = logits[:-num_extra]
        sampling, first_logits_row, beams = inputs.sampling, inputs.first_logits_row, {}
        if any(s.request.beam is not None for s in sampling):
            split = split_beam_rows(sampling, first_logits_row)
            beams = beam_candidates(logits[torch.from_numpy(split.beam_logits_rows).to(logits.device)],
                                    split.beam_members)
            sampling, first_logits_row = split.sampling, split.first_logits_row
            logits = logits[torch.from_numpy(split.kept_logits_rows).to(logits.device)]
        if not sampling:
            return RunnerOutput({}, None, [], prompt_logprobs, pooled, beams)
        result = sample_rows(logits, sampling, first_logits_row, self.eos_token_ids)
        result.prompt_logprobs = prompt_logprobs
        result.pooled = pooled
        result.beams = beams
        return result

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step's logits (fp32), and the pooled vector of each pooling request whose prompt it finished."""
        # A captured graph has no adapter deltas, hidden rows or image rows: such steps run eagerly.
        eager = inputs.lora is not None or inputs.pooling is not None or inputs.images is not None
        logits = self._decode_graph_logits(inputs) if self.graphs is not None and not eager else None
        if logits is not None:
            return logits, {}
        self.backend.prepare(inputs.meta)
        embeds = None
        if inputs.images is not None:
            embeds = self.model.embed(inputs.input_ids)
            embeds[inputs.images.rows.to(embeds.device)] = inputs.images.embeds.to(embeds.dtype)
        if inputs.pooling is None:
            return self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend, inputs.logits_indices,
                inputs.lora, embeds,
            ).float(), {}  # a no-op on the fp32 CPU path; sampling works on fp32 logits
        hidden = self.model.hidden_states(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                          self.backend, inputs.lora, embeds)
        logits = self.model.logits(hidden.index_select(0, inputs.logits_indices)).float()
        rows = torch.from_numpy(inputs.pooling.hidden_indices).to(hidden.device)
        final = self.model.norm(hidden.index_select(0, rows)).float().cpu()
        return logits, self.pooling.collect(inputs.pooling, final)

    def _decode_graph_logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """A decode-only step's logits from its padded graph; None for a step that runs eagerly."""
        reason = self.graphs.eager_reason(inputs.meta, len(inputs.logits_indices), inputs.prompt_logprobs is not None)
        if reason is not None:
            self.graphs.stats.eager[reason] += 1
            return None
        return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)

    @property
    def speculates(self) -> bool:
        return self._propose is not None

    def propose_drafts(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Proposals for the next step (between steps), by request id, for every running
        decode with room for drafts; none while more than disable_by_batch_size requests
        run, where verifying drafts would cost more than it saves."""
        limit = self.speculative.disable_by_batch_size
        if not running or (limit and len(running) > limit):
            return {}
        decodes = [r for r in running if r.is_decode and r.max_draft_tokens > 0]
        return {r.request_id: drafts for r, drafts in zip(decodes, self._propose(decodes))}

    @contextmanager
    def attention_timer(self) -> Iterator[TimedBackend]:
        """While open, the target's attention backend adds up the seconds of its calls (the
        twin calibrates its cost model against them; a draft model keeps the plain one);
        the plain backend is back after."""
        timed = TimedBackend(self.backend)
        self.backend = timed
        try:
            yield timed
        finally:
            self.backend = timed.inner
