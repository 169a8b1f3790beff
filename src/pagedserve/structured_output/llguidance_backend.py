"""The llguidance backend: Earley parsing over a lazily built lexer, masks in microseconds.

Its tokenizer is built from the `tokenizers` JSON that pagedserve already holds (no
transformers needed). EOS for the grammar is every id the model stops on, so a
complete grammar lets the model end with any of them.
"""
from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from ..model.tokenizer import Tokenizer
from .grammar_backend import Grammar, Matcher, StructuredOutputBackend

# llguidance's names for our kinds (a "grammar" may be Lark or GBNF; it converts the latter).
_FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# No free whitespace in JSON: a small model given the choice tends to emit runs of blank
# lines until max_tokens. The usual separators keep the text close to what it was trained on.
_JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}


class LLGuidanceMatcher(Matcher):
    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def accept(self, token_ids: Sequence[int]) -> bool:
        return self._m.consume_tokens(list(token_ids))

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        return self._m.validate_tokens(list(token_ids))

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._m.deep_copy())

    @property
    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None


class LLGuidanceGrammar(Grammar):
    def __init__(self, template: llguidance.LLMatcher):
        self._template = template

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(tokenizer.stop_token_ids)
        )

    def compile(self, kind: str, text: str) -> LLGuidanceGrammar:
        if kind not in _FORMATS:
            raise ValueError(f"structured_outputs kind must be one of {list(_FORMATS)}, got {kind!r}")
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)
            elif kind == "regex":
                # Rust regex's \d is any Unicode digit, so a phone-number pattern could be
                # met with exotic numerals; requests mean the ASCII ones (as JSON Schema does).
                grammar = llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(text, 'd')}/")
            else:
                grammar = llguidance.grammar_from(_FORMATS[kind], text)
        except ValueError as e:
            raise ValueError(f"structured_outputs: invalid {kind}: {e}") from None
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if not template.is_error():
            # Some problems (an over-complex lexer) only show when the first mask is
            # computed; find them now, while a 400 is still possible.
            template.compute_bitmask()
        if template.is_error():
            raise ValueError(f"structured_outputs: invalid {kind}: {template.get_error()}")
        return LLGuidanceGrammar(template)
