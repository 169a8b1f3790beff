"""The Llama family (Llama, Mistral, Qwen2, Qwen3, and with experts Mixtral, Qwen3-MoE,
OLMoE and gpt-oss: model/moe.py) as one model with flags.

The forward takes a flattened batch: the new tokens of every sequence of a step,
laid end to end, with their positions. Attention goes through a backend object
that reads and writes the paged KV cache; the model itself knows nothing about
blocks. Logits are computed only for the rows asked for.
"""
from __future__ import annotations

from collections import Counter
from itertools import groupby

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.backend import AttentionBackend
from ..attention.metadata import AttentionMetadata
from .config import ModelConfig
from .lora import LoRABatch
from .moe import MoE, QuantExperts
from .quant import QTYPES, ConcatLinear, QuantEmbedding, QuantLinear, arithmetic, held_as
from .rope import attention_factor, default_inv_freq, position_limit


class RotaryEmbedding(nn.Module):
    """HF-style RoPE (rotate halves), cos/sin tabulated once per position, over the first
    `config.rotary_dim` dims of a head (all of them but for Phi-3/4's partial RoPE)."""

    def __init__(self, config: ModelConfig, theta: float | None = None):
        super().__init__()
        self.head_dim = config.rotary_dim
        self.theta = config.rope_theta if theta is None else theta
        self.attention_factor = attention_factor(config)
        self.position_limit = position_limit(config)
        # Per-dimension divisors of the frequencies (model/rope.py); loaded with the weights.
        self.register_buffer("freq_divisors", torch.ones(self.head_dim // 2), persistent=False)
        self._table: torch.Tensor | None = None
        self._table_len = config.max_position_embeddings
        # Set by place(): the table covers every position the engine can reach, so a step
        # never reads positions.max() back (a device sync, and illegal in a CUDA graph).
        self._placed = False

    def set_freq_divisors(self, divisors: torch.Tensor) -> None:
        self.freq_divisors = divisors.float()
        self._table = None

    def _build(self, length: int) -> torch.Tensor:
        if self.position_limit is not None and length > self.position_limit:
            raise ValueError(f"rope_scaling dynamic is exact only below max_position_embeddings "
                             f"({self.position_limit}); position {length - 1} asked for")
        inv_freq = default_inv_freq(self.theta, self.head_dim) / self.freq_divisors.double().cpu()
        angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [L, head_dim]
        return (table * self.attention_factor).float()

    def place(self, device: torch.device, dtype: torch.dtype, length: int) -> None:
        """Tabulate positions 0 .. length - 1 once on `device`, in the activations' dtype."""
        self._table = self._build(length).to(device=device, dtype=dtype)
        self._placed = True

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, shaped [T, 1, head_dim/2] to broadcast over heads."""
        if not self._placed and (self._table is None or (positions.numel() and int(positions.max()) >= self._table.shape[0])):
            needed = int(positions.max()) + 1 if positions.numel() else 0
            self._table = self._build(max(self._table_len, needed))
        cs = self._table[positions].unsqueeze(1)
        half = self.head_dim // 2
        return cs[..., :half], cs[..., half:]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    """`native` (LlamaModel.set_kernels) runs pagedserve's fused op: torch's CPU
    rms_norm decomposes into ~7 ops, ~4x slower per call at decode's few rows."""

    native = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return torch.ops.pagedserve.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm). The native op adds into `residual` in place, so
        the caller must own it (the decoder's running hidden state does)."""
        if self.native:
            return residual, torch.ops.pagedserve.add_rms_norm_(x, residual, self.weight, self.eps)
        residual = residual + x
        return residual, self(residual)


# The row count oneDNN is told to expect when it lays out a packed weight. Decode
# batches dominate the serving time; a layout chosen for 64 rows also ran 1-row and
# 1,024-row products no slower than the plain weight (benchmarks/linear_kernels.py).
PACK_ROWS_HINT = 64


def can_pack_weights() -> bool:
    return torch.backends.mkldnn.is_available()


class Linear(nn.Linear):
    """nn.Linear whose weight can be handed to oneDNN once, prepacked into its blocked
    layout (`pack()`); the plain weight is then dropped.

    Why: torch's F.linear repacks the weight on every call, which at the 2-64 rows of a
    decode step costs as much as the product itself. On this project's 2-core AVX2
    machine the prepacked weight made 2-64-row products 1.4-2.2x faster and the LM head
    1.8-4.4x faster, and it computes each row the same whatever the batch around it.
    """

    packed_weight: torch.Tensor | None = None

    def pack(self) -> None:
        if self.weight is None:
            return
        if self.weight.dtype != torch.float32:
            raise ValueError(f"only float32 weights are packed, not {self.weight.dtype}")
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS_HINT)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            if x.shape[0] == 1:
                # oneDNN takes another kernel for one row (another summation order) when K
                # is large on AVX-512 CPUs (K >= 1,536 on an AMD EPYC Zen 5 VM): given two rows it takes
                # the kernel every larger batch takes, so a request's bits do not depend on
                # whether it decodes alone. At one row the product is bound by reading the
                # weight, so the second row costs next to nothing.
                return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), self.packed_weight,
                                                          self.bias, "none", [], "")[:1]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _linear(n_in: int, n_out: int, bias: bool = False) -> Linear:
    return Linear(n_in, n_out, bias=bias).requires_grad_(False)


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A Linear over `weight` [out, in] (and `bias` [out]), prepacked for oneDNN (an fp32 MoE expert)."""
    layer = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    layer.pack()
    return layer


class DecoderLayer(nn.Module):
    # `native` (LlamaModel.set_kernels): the MLP's SiLU x up as one op, 2.3-2.8x faster
    # than torch's chunk + silu + mul at 1-256 rows (docs/benchmarks.md).
    native = False

    def __init__(self, config: ModelConfig, index: int = 0):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_size, self.kv_size = config.num_heads * d, config.num_kv_heads * d
        self.rotary_dim = config.rotary_dim
        self.scale = (config.query_pre_attn_scalar or d) ** -0.5
        # Attention options (attention/backend.py): this layer's sliding window, Gemma 2's soft-cap.
        self.window, self.softcap = config.layer_window(index), config.attn_logit_softcapping or 0.0
        self.attn_norm = RMSNorm(h, config.rms_norm_eps)
        self.qkv = _linear(h, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # OLMoE normalises all of q (and of k) at once, the others each head.
        self.qk_norm_whole, self.clip_qkv = config.qk_norm_whole, config.clip_qkv
        q_dim, k_dim = (self.q_size, self.kv_size) if config.qk_norm_whole else (d, d)
        self.q_norm = RMSNorm(q_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_dim, config.rms_norm_eps) if config.qk_norm else None
        self.o = _linear(self.q_size, h, bias=config.o_bias)
        # gpt-oss: one logit per query head in every row's softmax, with no value (attention/backend.py).
        self.sinks = nn.Parameter(torch.empty(config.num_heads), requires_grad=False) \
            if config.attention_sinks else None
        self.ffn_norm = RMSNorm(h, config.rms_norm_eps)
        # A sparse layer's MLP is the experts; it has no dense gate_up and down.
        sparse = config.moe is not None and index in config.moe.sparse_layers
        self.moe = MoE(config.moe, h, _linear(h, config.moe.num_experts, bias=config.moe.biases)) if sparse else None
        self.gate_up = None if sparse else _linear(h, 2 * config.intermediate_size)
        self.down = None if sparse else _linear(config.intermediate_size, h)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        lora: tuple[LoRABatch, int] | None = None,  # the step's adapter rows, this layer's index
    ) -> torch.Tensor:
        out = self.attention(self.attn_norm(hidden), cos, sin, kv_cache, meta, backend, lora)
        hidden, normed = self.ffn_norm.add_forward(out, hidden)
        # In place: `hidden` is this forward's own running state (the embedding's output,
        # or a sum made above), so nothing else reads it.
        return hidden.add_(self.mlp(normed, lora))

    def attention(self, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, backend: AttentionBackend, lora: tuple[LoRABatch, int] | None
                  ) -> torch.Tensor:
        """The attention block's output projection, before the residual."""
        t = normed.shape[0]
        qkv = self.qkv(normed)
        if lora is not None:
            lora[0].add(lora[1], "qkv", normed, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (y.clamp(-self.clip_qkv, self.clip_qkv) for y in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        r = self.rotary_dim
        if self.native:
            torch.ops.pagedserve.rotary_(q[..., :r], k[..., :r], cos, sin)  # in place: torch's bits in one op
        elif r == self.head_dim:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        else:  # partial RoPE: the other dims pass through
            q = torch.cat([apply_rotary(q[..., :r], cos, sin), q[..., r:]], dim=-1)
            k = torch.cat([apply_rotary(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        attn = backend.forward(q, k, v.contiguous(), kv_cache, meta, self.scale, self.window, self.softcap,
                               self.sinks)
        out = self.o(attn)
        if lora is not None:
            lora[0].add(lora[1], "o", attn, out)
        return out

    def mlp(self, normed: torch.Tensor, lora: tuple[LoRABatch, int] | None) -> torch.Tensor:
        """The feed-forward block's output, before the residual."""
        if self.moe is not None:  # LoRA adapters on sparse layers' MLPs are refused at load (model/lora.py)
            return self.moe(normed)
        gate_up = self.gate_up(normed)
        if lora is not None:
            lora[0].add(lora[1], "gate_up", normed, gate_up)
        act = self.activate(gate_up)
        down = self.down(act)
        if lora is not None:
            lora[0].add(lora[1], "down", act, down)
        return down

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) x up."""
        if self.native:
            return torch.ops.pagedserve.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class LlamaModel(nn.Module):
    """Build it under `torch.device("meta")` and call load_weights: no memory is
    allocated or initialised for parameters that the checkpoint replaces."""

    layer_class: type[DecoderLayer] = DecoderLayer  # model/gemma.py's subclass takes its own

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # from_pretrained skips nn.Embedding's random init, whose first call on the meta
        # device imports torch's decompositions: ~2 s of every process's first model load.
        self.embed = nn.Embedding.from_pretrained(torch.empty(config.vocab_size, config.hidden_size), freeze=True)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A tied head is made from the embedding matrix once the weights are loaded.
        self.lm_head = None if config.tie_word_embeddings else _linear(config.hidden_size, config.vocab_size)
        with torch.device("cpu"):
            self.rotary = RotaryEmbedding(config)

    def load_weights(
        self,
        state: dict[str, torch.Tensor],
        pack: bool | None = None,
        quantization: str = "none",
        qtypes: dict[str, int] | None = None,
    ) -> None:
        """Take a fused state dict (model/weights.py) without copying its tensors, then
        prepack the fp32 linear layers' weights for oneDNN (`pack`: default when torch has it).

        `qtypes` names the state's matrices that are GGUF blocks (weights.fuse_gguf_blocks)
        and their GGML types (a tuple, with a list of tensors, for a matrix of parts): those
        layers (and a tied head, sharing the embedding's tiles) run on the blocks as they are,
        in fp32 arithmetic when `quantization` is none (the fp32 model the blocks define) and
        in llama.cpp's int8 otherwise (F16 / BF16 weights, kept as stored, always in fp32). q8_0 / q4_0 / q4_1 quantises every fp32
        linear layer at load, and the head to q8_0; the embedding stays fp32 (it is only indexed)."""
        state = dict(state)
        divisors = state.pop("rope_freq_divisors", None)
        if divisors is not None:
            self.rotary.set_freq_divisors(divisors)
        for name, qtype in (qtypes or {}).items():
            path = name.removesuffix(".weight")
            blocks, bias = state.pop(name), state.pop(f"{path}.bias", None)
            if path == "embed":
                self.embed = QuantEmbedding(blocks, qtype)
            elif isinstance(blocks, torch.Tensor) and blocks.dim() == 3:  # [experts, rows, row bytes]: experts
                self.set_submodule(path, QuantExperts(blocks, qtype, arithmetic(qtype, quantization), bias))
            elif isinstance(qtype, tuple):  # parts (q, k, v), packed a run of one type at a time
                layers, row = [], 0
                for t, run in groupby(zip(blocks, qtype), key=lambda part: part[1]):
                    run_blocks = [b for b, _ in run]
                    rows = sum(b.shape[0] for b in run_blocks)
                    part_bias = None if bias is None else bias[row:row + rows]
                    layers.append(QuantLinear(run_blocks, t, part_bias, arithmetic(t, quantization)))
                    row += rows
                self.set_submodule(path, layers[0] if len(layers) == 1 else ConcatLinear(layers))
            else:
                self.set_submodule(path, QuantLinear(blocks, qtype, bias, arithmetic(qtype, quantization)))
        self.load_state_dict(state, strict=True, assign=True)
        if self.lm_head is None:
            if isinstance(self.embed, QuantEmbedding):
                self.lm_head = QuantLinear(self.embed, self.embed.qtype,
                                           activations=arithmetic(self.embed.qtype, quantization))
            else:
                self.lm_head = Linear(self.config.hidden_size, self.config.vocab_size, bias=False, device="meta")
                self.lm_head.weight = self.embed.weight  # packing copies it; the embedding keeps its own
        if quantization in QTYPES:
            for path, module in self.named_linears():
                # The head in 4 bits put 10-20% error into the logits on SmolLM2 (tests/
                # test_quantized_model.py); like llama.cpp's 4-bit presets, keep it at 8 bits.
                qtype = QTYPES["q8_0"] if path == "lm_head" else QTYPES[quantization]
                if isinstance(module, Linear):
                    self.set_submodule(path, QuantLinear.from_float(module.weight, qtype, module.bias))
            for moe in self.moe_layers():
                moe.quantize(QTYPES[quantization], arithmetic(QTYPES[quantization], quantization))
        if pack is None:
            pack = can_pack_weights()
        if pack:
            for _, module in self.named_linears():
                if isinstance(module, Linear):
                    module.pack()
            for moe in self.moe_layers():
                moe.pack(packed_linear)
                if isinstance(moe.router, Linear):
                    moe.router.pack()

    def rotaries(self) -> list[RotaryEmbedding]:
        """Every RoPE table the forward reads (placement tabulates each on the device)."""
        return [self.rotary]

    def set_kernels(self, kernels: str) -> None:
        """"native" or "torch" (pagedserve.kernels.resolve_kernels decides which can run)."""
        if kernels not in ("native", "torch"):
            raise ValueError(f"kernels must be 'native' or 'torch', got {kernels!r}")
        if kernels == "torch" and any(isinstance(m, (QuantLinear, ConcatLinear, QuantExperts))
                                      for m in [m for _, m in self.named_linears()] + list(self.modules())):
            raise ValueError("layers on GGUF blocks run only on the native kernels (kernels='native' or 'auto' "
                             "where the library can run); load the model with quantization='none' and "
                             "keep_blocks=False for the torch path")
        for module in self.modules():
            if isinstance(module, (RMSNorm, DecoderLayer)):
                module.native = kernels == "native"

    def linear_layers(self) -> list[Linear | QuantLinear]:
        """Every decoder layer's qkv, o, gate_up and down, in forward order (not the head)."""
        return [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down) if m is not None]

    def named_linears(self) -> list[tuple[str, Linear | QuantLinear]]:
        """(submodule path, module) of every linear layer and the head."""
        names = ("qkv", "o", "gate_up", "down")
        return [(f"layers.{i}.{n}", getattr(layer, n)) for i, layer in enumerate(self.layers) for n in names
                if getattr(layer, n) is not None] + [("lm_head", self.lm_head)]

    def moe_layers(self) -> list[MoE]:
        """The sparse layers' experts (none in a dense model)."""
        return [layer.moe for layer in self.layers if layer.moe is not None]

    def describe_weights(self) -> str:
        """How many matrices take each path, e.g. "90 on Q8_0 blocks (fp32 arithmetic), 31
        fp32 (oneDNN packed)": the start-up log says what a file's types became."""
        def path(m: nn.Module) -> str:
            if isinstance(m, QuantLinear):
                return m.describe()
            if isinstance(m, Linear):
                return "fp32 (oneDNN packed)" if m.weight is None else f"{m.weight.dtype} (torch)"
            return type(m).__name__
        modules = [m for _, m in self.named_linears()]
        counts = Counter(path(p) for m in modules for p in (m.parts if isinstance(m, ConcatLinear) else [m]))
        counts.update(p for moe in self.moe_layers() for p in moe.weight_paths())
        embed = f"embedding {held_as(self.embed.qtype)}" if isinstance(self.embed, QuantEmbedding) \
            else f"embedding {self.embed.weight.dtype}"
        return ", ".join(f"{n} {p}" for p, n in counts.most_common()) + f"; {embed}"

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states: [R, hidden] -> [R, vocab]."""
        return self.lm_head(self.norm(hidden))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one per layer, laid out as KVTensorLayout says
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # [R] rows of the flattened batch whose logits are wanted
        lora: LoRABatch | None = None,  # the step's LoRA adapter rows (model/lora.py)
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden] in place of embed(input_ids) (images)
    ) -> torch.Tensor:  # [R, vocab]
        hidden = self.hidden_states(input_ids, positions, kv_caches, meta, backend, lora, inputs_embeds)
        return self.logits(hidden.index_select(0, logits_indices))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      meta: AttentionMetadata, backend: AttentionBackend, lora: LoRABatch | None = None,
                      inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's state after the last decoder layer, before the final norm: [T, hidden].
        `self.norm` of it is the final hidden state (pooling's source); `logits` takes it too.
        `inputs_embeds` (a vision model's image rows merged in) replaces the embedding lookup;
        the layers add into it in place, so it must be the caller's own tensor."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary.cos_sin(positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden = layer(hidden, cos, sin, kv_cache, meta, backend, None if lora is None else (lora, i))
        return hidden
