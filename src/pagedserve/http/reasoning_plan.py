"""A request's reasoning fields: the thinking budget it asks for (vLLM's
`thinking_token_budget`, OpenAI's `reasoning_effort`, Anthropic's
`thinking.budget_tokens`) and the chat template switches (`chat_template_kwargs`),
checked into one plan; and the plan applied to a rendered prompt (docs/reasoning.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import SamplingParams
from .errors import APIError
from .reasoning_parsers import Encode, PromptReasoning, ReasoningFormat

# OpenAI's efforts as thinking budgets (clamped to the request's max_tokens).
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384}
# The variables the server gives a template (and the renderer's own argument names): a
# request's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "self",
                                      "image_placeholder"})


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """What the server does about one request's reasoning."""

    format: ReasoningFormat | None  # the server's parser (None: replies are not split)
    budget: int | None = None  # the thinking budget asked for (None: no cap)
    clamp: bool = False  # the budget came from an effort: at most max_tokens
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def for_prompt(self, prompt: str) -> PromptReasoning | None:
        """How this request's reply is split, given its rendered prompt (None: not at all)."""
        return None if self.format is None else self.format.for_prompt(prompt)

    def apply(self, params: SamplingParams, setup: PromptReasoning | None, encode: Encode,
              split_reply: bool = False) -> SamplingParams:
        """`params` with the section's markers where the engine needs them: to cap the
        thinking at the budget, or, for a reply the server splits into reasoning and answer
        (`split_reply`: chat, Responses, Messages), to hold a grammar back until the answer
        starts (docs/thinking-budget.md). A completion's text is returned whole, so its
        grammar keeps constraining all of it. Nothing when the prompt turned thinking off."""
        defers_grammar = split_reply and params.structured_outputs is not None
        if setup is None or (self.budget is None and not defers_grammar):
            return params
        budget = self.budget
        if budget is not None and self.clamp and params.max_tokens is not None:
            budget = min(budget, params.max_tokens)
        return dataclasses.replace(params, thinking_token_budget=budget, reasoning=setup.markers(encode))


def plan_reasoning(format: ReasoningFormat | None, *, budget: int | None = None, effort: str | None = None,
                   template_kwargs: dict[str, Any] | None = None, budget_param: str = "thinking_token_budget",
                   effort_param: str = "reasoning_effort") -> ReasoningPlan:
    """Check a request's reasoning fields; 400s name the field (the names the request's API uses)."""
    if budget is not None and effort is not None:
        raise APIError(400, f"give at most one of {budget_param} and {effort_param}", param=budget_param)
    if effort is not None and effort not in EFFORT_BUDGETS:
        raise APIError(400, f"{effort_param} must be one of {', '.join(EFFORT_BUDGETS)}, got {effort!r}",
                       param=effort_param)
    asked = budget_param if budget is not None else effort_param if effort is not None else None
    if asked is not None and format is None:
        raise APIError(400, f"{asked} needs a reasoning model: this server splits no reasoning (start it with "
                            "--reasoning-parser)", param=asked)
    kwargs = template_variables(template_kwargs, effort)
    if effort is not None:
        return ReasoningPlan(format, EFFORT_BUDGETS[effort], True, kwargs)
    return ReasoningPlan(format, budget, False, kwargs)


def template_variables(template_kwargs: dict[str, Any] | None, effort: str | None = None) -> dict[str, Any]:
    """What a request adds to its chat template's variables: its chat_template_kwargs
    (checked; 400 naming the field) and its reasoning effort as `reasoning_effort`
    (harmony's template writes it into the system message; chat_template_kwargs win)."""
    kwargs = dict(template_kwargs or {})
    for name in kwargs:
        if not name.isidentifier() or name.startswith("_") or name in RESERVED_TEMPLATE_KWARGS:
            raise APIError(400, f"chat_template_kwargs may not set {name!r} (template variables are identifiers "
                                f"not starting with '_', other than {', '.join(sorted(RESERVED_TEMPLATE_KWARGS))})",
                           param="chat_template_kwargs")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs
