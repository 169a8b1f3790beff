"""Render a model's Jinja chat template the way Hugging Face transformers does.

The template is code shipped with the model (or a server-side file); it runs in
jinja2's immutable sandbox and is never taken from a request.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would corrupt tool schemas.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _refuse_private(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates may not set namespace attribute {name!r}")


class _GuardedNamespace(Namespace):
    """A `namespace()` whose attributes cannot be underscore names, so a template cannot plant dunders."""

    def __setitem__(self, name: str, value: Any) -> None:  # `{% set ns.name = value %}`
        _refuse_private(name)
        super().__setitem__(name, value)


def _namespace(*args: Any, **kwargs: Any) -> _GuardedNamespace:
    attrs = dict(*args, **kwargs)
    for name in attrs:
        _refuse_private(name)
    return _GuardedNamespace(attrs)


class _GenerationBlock(Extension):
    """Accept HF's ``{% generation %}...{% endgeneration %}`` (it marks assistant
    spans for training masks); serving only needs the text inside."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


# jinja's sandbox stops attribute escapes (`__class__`, `__globals__`), mutation and
# `range` beyond 100,000, but computes `10 ** 10 ** 10` and `'x' * 10 ** 10` as asked:
# a template from a downloaded model file could take the machine's memory or hang a
# tokenizer thread. These bound what one operation and one rendering may produce.
_MAX_INT_BITS = 4096
_MAX_REPEAT_ITEMS = 1 << 20
MAX_RENDERED_CHARS = 8 << 20


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and _is_int(left) and _is_int(right) and abs(left) > 1 and right > 0 \
                and right * math.log2(abs(left)) > _MAX_INT_BITS:
            raise jinja2.exceptions.SecurityError(f"{left} ** {right} is too large for a chat template")
        if operator == "*":
            sequence, count = (left, right) if _is_int(right) else (right, left)
            if isinstance(sequence, (str, list, tuple)) and _is_int(count) \
                    and len(sequence) * count > _MAX_REPEAT_ITEMS:
                raise jinja2.exceptions.SecurityError(f"repeating {len(sequence)} items {count} times is too much "
                                                      "for a chat template")
        return super().call_binop(context, operator, left, right)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _namespace
    return env


_IMAGE_PARTS = frozenset({"image_url", "image"})
# A template that compares a part's type with 'image' renders image parts itself (Idefics3's
# `{% elif line['type'] == 'image' %}`); any other gets the parts joined into text.
_TAKES_IMAGE_PARTS = re.compile(r"""['"]image['"]""")


def _message_content(content: Any, index: int, image_placeholder: str | None, image_parts: bool) -> Any:
    """OpenAI content parts -> one string, each image part its `image_placeholder`; or, for
    a template that renders image parts (`image_parts`), the parts with each image as
    {"type": "image"}. A string (or None) passes through."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}].content must be a string, null or a list of parts")
    pieces: list[dict[str, str]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind in _IMAGE_PARTS:
            if image_placeholder is None:
                raise ValueError(f"messages[{index}].content has an image part, but this model does not accept "
                                 "images")
            pieces.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            pieces.append({"type": "text", "text": part["text"]})
        else:
            raise ValueError(f"messages[{index}].content parts must be {{'type': 'text', 'text': str}} or image "
                             f"parts, got {kind!r}")
    if image_parts:
        return pieces
    # Newline between parts, as vLLM joins them for text-only templates.
    return "\n".join(p["text"] if p["type"] == "text" else image_placeholder for p in pieces)


def normalize_messages(messages: Sequence[Mapping[str, Any]], image_placeholder: str | None = None,
                       image_parts: bool = False) -> list[dict[str, Any]]:
    """Copies of `messages` with list contents joined (see `_message_content`); every
    other key passes through."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': ...} dicts")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}] must be a dict with a string 'role'")
        copy = dict(message)
        if "content" in copy:
            copy["content"] = _message_content(copy["content"], index, image_placeholder, image_parts)
        out.append(copy)
    return out


class ChatTemplate:
    """One compiled chat template; `render` is safe to call from any thread."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template source must be a non-empty string")
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc} (line {exc.lineno})") from exc
        # bos_token, eos_token, ... as the template sees them (HF passes these too).
        self._special_tokens = dict(special_tokens or {})
        self.takes_image_parts = bool(_TAKES_IMAGE_PARTS.search(source))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        image_placeholder: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages`; a template's `raise_exception` surfaces as ValueError.
        `image_placeholder`: what an image part becomes (None: image parts are refused)."""
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise ValueError("tools must be a list of JSON-schema dicts")
        context = {
            **self._special_tokens,
            **template_kwargs,
            # Parts pass through only for a vision model: text-only serving keeps joined text.
            "messages": normalize_messages(messages, image_placeholder,
                                           self.takes_image_parts and image_placeholder is not None),
            "tools": list(tools) if tools is not None else None,
            "documents": list(documents) if documents is not None else None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._render(context)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template rejected the conversation: {exc}") from exc
        except (TypeError, AttributeError, KeyError, IndexError, ValueError, ArithmeticError,
                RecursionError) as exc:
            # The template is trusted code, but it was written for well-formed conversations:
            # `message['content'] + ...` on a null content, an unknown role in a lookup. The
            # messages are what is wrong, so the caller gets a ValueError, not a crash.
            raise ValueError(f"chat template cannot render these messages: {type(exc).__name__}: {exc}") from exc


    def _render(self, context: dict[str, Any]) -> str:
        """Render piece by piece, stopping once the text passes MAX_RENDERED_CHARS."""
        pieces, size = [], 0
        for piece in self._template.generate(**context):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise jinja2.exceptions.SecurityError(
                    f"the chat template rendered more than {MAX_RENDERED_CHARS} characters")
            pieces.append(piece)
        return "".join(pieces)


def read_chat_template_file(path: str | Path) -> str:
    """A server-side chat template: a .jinja file, or a JSON file with a `chat_template` key."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"chat_template_path {str(path)!r} is not a file")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        template = json.loads(text).get("chat_template")
        if not isinstance(template, str):
            raise ValueError(f"chat_template_path {str(path)!r} has no string 'chat_template' key")
        return template
    return text
