"""What a request asks its output to match: `StructuredOutputs`, validated on creation.

Pure Python (SamplingParams imports it, and SamplingParams stays torch-free). Each
spec reduces to a (kind, text) key: the grammar cache's key and the backend's input.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The grammar kinds a backend compiles: a JSON schema, a regex, or a Lark / GBNF grammar.
# A choice list becomes a grammar of alternatives; json_object the schema {"type": "object"}.
KINDS = ("json", "regex", "choice", "grammar")
_ANY_OBJECT = json.dumps({"type": "object"})


def _schema_text(schema: Any) -> str:
    """The schema as JSON text, property order kept (it is the order the output follows)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    else:
        parsed = schema
    if not isinstance(parsed, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(parsed).__name__}")
    try:
        return json.dumps(parsed, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json cannot be written as JSON: {e}") from None


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """Exactly one constraint, as vLLM's StructuredOutputsParams.

    json: a JSON schema (dict or JSON text; stored as compact JSON text).
    regex: the whole output must match it.
    choice: the output is exactly one of these strings.
    grammar: a Lark grammar (or GBNF, converted) whose `start` rule the output matches.
    json_object: any JSON object.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            for option in self.choice:
                if not isinstance(option, str) or not option:
                    raise ValueError(f"structured_outputs.choice must hold non-empty strings, got {option!r}")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the backend compiles, and the compiled-grammar cache key."""
        if self.json is not None:
            return "json", self.json
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice), ensure_ascii=False)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json", _ANY_OBJECT
