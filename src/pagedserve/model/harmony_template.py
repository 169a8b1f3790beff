"""The harmony chat format (gpt-oss) as a chat template of pagedserve's own, and the rule
that gives it to a gpt-oss-shaped model whose files carry no template (docs/harmony.md).

A vocabulary with harmony's special tokens also stops differently: `<|end|>` closes a
message, not the reply (the reasoning is followed by the answer), so a harmony model
stops on `<|return|>` (the answer is done) and `<|call|>` (a tool call waits for its
result) instead.
"""
from __future__ import annotations

from functools import cache
from importlib import resources

# GGUF `general.architecture` / HF `model_type` of the models that speak harmony.
HARMONY_ARCHITECTURES = frozenset({"gpt-oss", "gpt_oss"})
# The special token only harmony's vocabulary has: a template or vocabulary with it is harmony's.
HARMONY_CHANNEL = "<|channel|>"
# What a harmony reply stops on (with the model's EOS).
HARMONY_STOP_MARKERS = frozenset({"<|return|>", "<|call|>", "<|endoftext|>"})


@cache
def harmony_chat_template() -> str:
    return resources.files(__package__).joinpath("templates", "harmony.jinja").read_text(encoding="utf-8")


def default_chat_template(architecture: object) -> str | None:
    """The template a model without one of its own gets: harmony's for gpt-oss, else none."""
    return harmony_chat_template() if architecture in HARMONY_ARCHITECTURES else None


def is_harmony_vocabulary(special_tokens: set[str] | frozenset[str]) -> bool:
    return HARMONY_CHANNEL in special_tokens
