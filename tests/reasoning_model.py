"""A tiny Qwen3-shaped reasoning model whose replies are known in advance.

The tokenizer is SmolLM2's with `<think>` and `</think>` added as single tokens (as
Qwen3's are); the chat templates are this file's own. The weights are a bigram table:
attention and MLP write nothing, so the last token alone picks the next one, and each
token of the chain `REPLY` is followed by the next with a logit 80 above all others
(greedy and temperature 1 alike). So a prompt ending in "\n" gets
`<think>Hmm, the user greets.</think>\n\nHello!`, one ending in `<think>` (R1's
template) gets the reply from "Hmm", and one ending in "</think>\n\n" (Qwen3's template
with enable_thinking false) gets "Hello!"; nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from pagedserve.model.registry import default_model_path
from pagedserve.model.tokenizer import load_tokenizer

REASONING = "Hmm, the user greets."
ANSWER = "Hello!"
REPLY = f"<think>{REASONING}</think>\n\n{ANSWER}"

_CHAT = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
         "{%- endfor %}")
# Qwen3's shape: the model opens <think> itself; enable_thinking false closes an empty section in the prompt.
QWEN3_TEMPLATE = _CHAT + ("{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                          "{%- if enable_thinking is defined and enable_thinking is false %}"
                          "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
# DeepSeek-R1's shape: the prompt opens the section, so the output holds only </think>.
R1_TEMPLATE = _CHAT + "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>' }}{%- endif %}"
HIDDEN = 64


def write_reasoning_model(folder: Path, chat_template: str) -> Path:
    """Write the model (config.json, model.safetensors, tokenizer) into `folder`."""
    # "\n\n" as one token, as a prompt ending in it encodes it (in "\n\nHello" it would be two).
    return write_chain_model(folder, chat_template, ("<think>", "</think>"),
                             [["\n" + REPLY.partition("\n\n")[0], "\n\n", ANSWER]])


def write_chain_model(folder: Path, chat_template: str, added: tuple[str, ...], chains: list[list[str]]) -> Path:
    """A bigram model over SmolLM2's tokenizer with `added` as single tokens: each chain's
    pieces, encoded, are followed token by token, then EOS (no token may appear twice)."""
    folder.mkdir(parents=True, exist_ok=True)
    load_tokenizer(default_model_path()).with_chat_template(chat_template).save(folder)
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_tokens([AddedToken(marker, normalized=False, special=False) for marker in added])
    backend.save(str(folder / "tokenizer.json"))
    tokenizer = load_tokenizer(folder)
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    encoded = [[t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]
               + [tokenizer.eos_token_id] for pieces in chains]
    every = [t for chain in encoded for t in chain[:-1]]
    assert len(set(every)) == len(every) <= HIDDEN, "every token of the chains must be its own"
    save_file(_bigram_weights(encoded, vocab_size), folder / "model.safetensors")
    write_bigram_config(folder, vocab_size, tokenizer.eos_token_id)
    return folder


def write_bigram_config(folder: Path, vocab_size: int, eos_token_id: int) -> None:
    """The config.json of the one-layer Qwen3-shaped bigram model `_bigram_weights` fills."""
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab_size,
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "eos_token_id": eos_token_id, "torch_dtype": "float32",
    }))


def _bigram_weights(chains: list[list[int]], vocab_size: int) -> dict[str, torch.Tensor]:
    embed = torch.zeros(vocab_size, HIDDEN)
    head = torch.zeros(vocab_size, HIDDEN)
    pairs = [pair for chain in chains for pair in zip(chain, chain[1:])]
    for i, (token, successor) in enumerate(pairs):
        embed[token, i] = 1.0
        head[successor, i] = 10.0  # the normed one-hot is 8 there: a logit of 80
    layer = "model.layers.0."
    weights = {
        "model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(HIDDEN),
        layer + "input_layernorm.weight": torch.ones(HIDDEN), layer + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        layer + "self_attn.q_proj.weight": torch.zeros(64, HIDDEN), layer + "self_attn.k_proj.weight": torch.zeros(32, HIDDEN),
        layer + "self_attn.v_proj.weight": torch.zeros(32, HIDDEN), layer + "self_attn.o_proj.weight": torch.zeros(HIDDEN, 64),
        layer + "self_attn.q_norm.weight": torch.ones(32), layer + "self_attn.k_norm.weight": torch.ones(32),
        layer + "mlp.gate_proj.weight": torch.zeros(64, HIDDEN), layer + "mlp.up_proj.weight": torch.zeros(64, HIDDEN),
        layer + "mlp.down_proj.weight": torch.zeros(HIDDEN, 64),
    }
    return weights
