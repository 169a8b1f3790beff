"""`--speculative-config` / `LLM(speculative_config=...)`: parsed and validated once."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ..core.validation import config_object, require_int

METHODS = ("ngram", "draft_model")
SELF_DRAFT_PREFIX = "self:"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    # ngram: match the last n tokens, n from prompt_lookup_max down to prompt_lookup_min.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # draft_model: a .gguf file / HF folder sharing the target's tokenizer, or "self:N"
    # (the target's first N layers plus its final norm and head).
    model: str | None = None
    # Speculate only while at most this many requests run (0 = always). Verifying
    # drafts costs compute that a large batch already uses fully.
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name, lo in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1),
                         ("disable_by_batch_size", 0)):
            require_int(f"speculative_config.{name}", getattr(self, name), lo)
        if self.num_speculative_tokens > 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be <= 16, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError('speculative_config.model is required for method "draft_model" '
                                 '(a model path or "self:N")')
            if self.model.startswith(SELF_DRAFT_PREFIX):
                layers = self.model[len(SELF_DRAFT_PREFIX):]
                if not layers.isdigit() or int(layers) < 1:
                    raise ValueError(f'speculative_config.model "self:N" needs N >= 1, got {self.model!r}')

    @property
    def self_draft_layers(self) -> int | None:
        """N for "self:N", else None."""
        if self.model is None or not self.model.startswith(SELF_DRAFT_PREFIX):
            return None
        return int(self.model[len(SELF_DRAFT_PREFIX):])

    def max_drafting_seqs(self, max_num_seqs: int) -> int:
        """Most requests that draft in one step."""
        return min(max_num_seqs, self.disable_by_batch_size or max_num_seqs)

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From a JSON string (the CLI), a dict (the Python API) or an instance."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = config_object("speculative_config", value, {f.name for f in fields(cls)})
        if "method" not in value:
            raise ValueError(f"speculative_config.method is required ({', '.join(METHODS)})")
        return cls(**value)

    def describe(self) -> dict[str, Any]:
        return asdict(self)
