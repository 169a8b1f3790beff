"""A request's prefix-cache keys as the engine computes them: the same tokenizer, the
same chat template rendering and the same chained block hashes (core/block_hash.py).

Keys computed from token ids, not from text, cannot drift from what a replica caches:
two prompts that differ only after the first block share that block's key, and two
that tokenise differently never do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.block_hash import extend_block_hashes
from ..http.errors import APIError
from ..http.json_body import parse_body
from ..http.openai_bodies import ChatCompletionRequest, CompletionRequest, check_token_ids, completion_prompts
from ..http.reasoning_plan import template_variables
from ..http.tool_parsers import TOOL_PARSERS
from ..http.tools import plan_tools, render_chat_text, template_messages, tool_chat_tokenizer
from ..model.tokenizer import Tokenizer


@dataclass(slots=True)
class PromptKeys:
    """One request's prompt token ids and its block hashes, per block size asked for."""

    token_ids: list[int]
    cache_salt: str | None
    _hashes: dict[int, list[bytes]] = field(default_factory=dict)

    def hashes(self, block_size: int) -> list[bytes]:
        """Hashes of the full blocks the engine could hit: all but a last token, as the
        engine caps a hit below the prompt length (core/kv_cache_manager.py)."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            num_blocks = max(len(self.token_ids) - 1, 0) // block_size
            hashes = extend_block_hashes([], self.token_ids, block_size, num_blocks, self.cache_salt)
            self._hashes[block_size] = hashes
        return hashes


NO_KEYS = PromptKeys([], None)


class PromptKeyer:
    """Tokenises request bodies the way the server does. Runs in a thread pool."""

    def __init__(self, tokenizer: Tokenizer, tool_call_parser: str | None = "hermes"):
        self.tokenizer = tokenizer
        self._tool_parser = TOOL_PARSERS[tool_call_parser] if tool_call_parser else None
        self._tool_tokenizer = tool_chat_tokenizer(tokenizer, self._tool_parser)

    def completion(self, body: bytes) -> PromptKeys:
        """The first prompt's keys (a request with several prompts goes to one replica)."""
        req = parse_body(body, CompletionRequest)
        prompt = completion_prompts(req.prompt)[0]
        if isinstance(prompt, str):
            return PromptKeys(self.tokenizer.encode(prompt), req.cache_salt)
        # The hashes pack ids as int64 (a larger one made the router answer 500). An id the
        # tokenizer lacks gets the replica's 400, or (a padded vocabulary's tail) only loses
        # the cache-aware pick.
        check_token_ids(prompt, self.tokenizer.vocab_size, "prompt")
        return PromptKeys(list(prompt), req.cache_salt)

    def chat(self, body: bytes) -> PromptKeys:
        req = parse_body(body, ChatCompletionRequest)
        # Only what the template renders matters here; the replica validates the schemas.
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self._tool_parser, _unchecked)
        # The template's variables change the rendered prompt (enable_thinking, reasoning_effort), so they
        # are part of the key: two requests that differ only there do not share a prefix.
        variables = template_variables(req.chat_template_kwargs, req.reasoning_effort)
        text = render_chat_text(self.tokenizer, self._tool_tokenizer, template_messages(req.messages), True,
                                plan.tools, variables)
        return PromptKeys(self.tokenizer.encode(text, add_special_tokens=False), req.cache_salt)

    def keys(self, path: str, body: bytes) -> PromptKeys:
        """NO_KEYS for a body the replica will refuse anyway (it answers the 400 itself)."""
        try:
            return self.chat(body) if path.endswith("chat/completions") else self.completion(body)
        except (APIError, ValueError, TypeError):
            return NO_KEYS


def _unchecked(_: Any) -> None:
    return None

