"""GET /tokenizer_info: the tokenizer's special tokens and chat template, in the shape of
vLLM's endpoint of that name. lm-eval's API models look for it (with /tokenize and
/detokenize) to use the server's own tokenizer, so an evaluation needs neither the hub
nor a local copy of the tokenizer."""
from __future__ import annotations

from typing import Any

from ...model.tokenizer import Tokenizer


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    def spelling(token_id: int | None) -> str | None:
        # Special tokens are spelled as their text ("<|im_end|>"), which /tokenize maps back to the id.
        return None if token_id is None else tokenizer.id_to_token(token_id)

    return {
        "bos_token": spelling(tokenizer.bos_token_id),
        "eos_token": spelling(tokenizer.eos_token_id),
        "pad_token": spelling(tokenizer.pad_token_id),
        "unk_token": spelling(tokenizer.unk_token_id),
        "chat_template": tokenizer.chat_template,
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.vocab_size,
    }
