"""A chat request's tools: checked, rendered and, for forced choices, turned into a grammar.

tool_choice:
- "auto" (the default when tools are given): the model sees the tools and may call
  them; its text is parsed, and is plain content when it holds no valid call.
- "none": the model does not see the tools and its text is plain content.
- "required" or {"type": "function", "function": {"name": ...}}: the reply is
  generated under a grammar of the parser's call format whose arguments follow the
  function's parameters schema, so it always parses and validates.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..model.tokenizer import Tokenizer
from ..structured_output.spec import StructuredOutputs
from .errors import APIError
from .openai_bodies import ChatMessage
from .tool_parsers import ToolParser

# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What the server does with a request's tools."""

    tools: list[dict[str, Any]] | None  # what the template renders (None: no tools)
    parser: ToolParser | None  # reads calls out of the reply (None: plain content)
    constraint: StructuredOutputs | None  # forces a call (required / named)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool, parser: ToolParser | None,
               check_schema: Callable[[StructuredOutputs], None]) -> ToolPlan:
    """Check `tools` and `tool_choice` (400s name the field); `check_schema` compiles a
    constraint and raises ValueError when it is invalid."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
        return ToolPlan(None, None, None)
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    for i, function in enumerate(functions):
        if "parameters" in function:
            try:
                check_schema(StructuredOutputs(json=function["parameters"]))
            except ValueError as e:
                raise APIError(400, f"tools[{i}].function.parameters is not a valid JSON schema: {e}",
                               param="tools") from None
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(None, None, None)
    if parser is None:
        raise APIError(400, "tools need a tool-call parser: start the server with --tool-call-parser", param="tools")
    rendered = [{"type": "function", "function": f} for f in functions]
    if choice == "auto":
        return ToolPlan(rendered, parser, None)
    if choice == "required":
        forced = functions
    else:
        forced = [_named(choice, functions)]
    constraint = StructuredOutputs(grammar=parser.grammar(forced, parallel and choice == "required"))
    try:
        check_schema(constraint)
    except ValueError as e:
        raise APIError(400, f"the tools cannot be made into a call grammar: {e}", param="tools") from None
    return ToolPlan(rendered, parser, constraint)


def _function(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise APIError(400, f"{where} must be {{'type': 'function', 'function': {{...}}}}", param="tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                       param="tools")
    if "description" in function and not isinstance(function["description"], str):
        raise APIError(400, f"{where}.function.description must be a string", param="tools")
    if "parameters" in function and not isinstance(function["parameters"], dict):
        raise APIError(400, f"{where}.function.parameters must be a JSON schema object", param="tools")
    keep = ("name", "description", "parameters")
    return {key: function[key] for key in keep if key in function}


def _named(choice: Any, functions: list[dict[str, Any]]) -> dict[str, Any]:
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    for function in functions:
        if function["name"] == name:
            return function
    raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template sees them: assistant tool calls with their arguments
    as dicts (templates write them with tojson), tool results with their call id."""
    out = []
    for i, m in enumerate(messages):
        content = [part.model_dump() for part in m.content] if isinstance(m.content, list) else m.content
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [_template_call(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(m.tool_calls)]
        out.append(message)
    return out


def _template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                       param="messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise APIError(400, f"{where}.function.arguments is not valid JSON", param="messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def uses_tools(messages: list[dict[str, Any]]) -> bool:
    """Whether the conversation has tool turns (so it needs a template that renders them)."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def tool_chat_tokenizer(tokenizer: Tokenizer, tool_parser: ToolParser | None) -> Tokenizer:
    """The tokenizer whose template renders conversations with tools: a model whose own
    template ignores `tools` (SmolLM2's) gets the parser's format instead."""
    own = tokenizer.chat_template
    if tool_parser is not None and (own is None or "tools" not in own):
        return tokenizer.with_chat_template(tool_parser.chat_template())
    return tokenizer


def render_chat_text(tokenizer: Tokenizer, tool_tokenizer: Tokenizer, messages: list[dict[str, Any]],
                     add_generation_prompt: bool, tools: list[dict[str, Any]] | None,
                     template_kwargs: dict[str, Any] | None = None, image_placeholder: str | None = None) -> str:
    """The prompt text of a conversation (the router renders it the same way to find
    which replica caches it); ValueError if the template refuses the messages.
    `template_kwargs`: the request's chat_template_kwargs (enable_thinking, ...);
    `image_placeholder`: the vision model's text for an image part (None: none accepted)."""
    chosen = tool_tokenizer if tools or uses_tools(messages) else tokenizer
    return chosen.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                      image_placeholder=image_placeholder, **(template_kwargs or {}))
