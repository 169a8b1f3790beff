"""Structured output: constrain sampling to a JSON schema, regex, choice list or grammar.

`spec` (what a request asks for; pure Python) -> `manager` (compiles it once per
(kind, text) through a `backend`, with a time limit) -> per step, `logits` fills a
token bitmask for every constrained row, masks the logits before sampling and
advances each row's matcher with its sampled token.
"""
from .spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
