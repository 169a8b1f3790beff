"""A batch's lines in and out, in OpenAI's formats (vLLM's run-batch reads and writes the
same): the input JSONL checked line by line, and each result as an output-file line or as
an Anthropic results line."""
from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from .batch_store import Line, LineResult, new_id

# What a batch line may ask for: the routes it runs through, as they serve live requests.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
ANTHROPIC_ENDPOINT = "/v1/messages"
# The status a line gets that never reached its endpoint (a malformed line, an expired one).
LINE_ERROR_STATUS = 400
EXPIRED_ERROR = {"code": "batch_expired",
                 "message": "This request could not be executed before the completion window expired."}


@dataclass(frozen=True, slots=True)
class ParsedInput:
    """A batch's input file read: the lines to run, the results of lines that cannot run,
    and what fails the whole batch (OpenAI's `errors.data`; empty when it may run)."""

    lines: list[Line]
    early: list[LineResult]
    errors: list[dict[str, Any]]
    urls: dict[int, str]  # each line's endpoint, by line index


def parse_input(batch_id: str, endpoints: Collection[str], raw_lines: Iterable[bytes]) -> ParsedInput:
    """Check each JSONL line: a malformed one, or one for an endpoint not in `endpoints`,
    becomes an error result and the rest run; a repeated custom_id or an empty file fails
    the batch."""
    lines: list[Line] = []
    early: list[LineResult] = []
    seen: dict[str, int] = {}
    errors: list[dict[str, Any]] = []
    for idx, raw in enumerate(raw_lines):
        if not raw.strip():
            continue
        line, problem = _parse_line(batch_id, idx, raw, endpoints)
        custom_id = line.custom_id if line is not None else problem[0]
        if custom_id is not None and custom_id in seen:
            errors.append({"code": "duplicate_custom_id", "line": idx + 1, "param": "custom_id",
                           "message": f"custom_id {custom_id!r} is on line {seen[custom_id] + 1} too; each line's "
                                      "custom_id must be unique within the batch"})
        if custom_id is not None:
            seen.setdefault(custom_id, idx)
        if line is not None:
            lines.append(line)
        else:
            early.append(line_error(idx, problem[0], problem[1], problem[2]))
    if not lines and not early:
        errors.append({"code": "empty_file", "line": None, "param": "input_file_id",
                       "message": "the input file holds no request lines"})
    return ParsedInput(lines, early, errors, {line.idx: line.url for line in lines})


def _parse_line(batch_id: str, idx: int, raw: bytes,
                endpoints: Collection[str]) -> tuple[_Parsed | None, tuple[str | None, str, str]]:
    """The line, or (its custom_id if readable, an error code, a message)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None, (None, "invalid_json_line", f"line {idx + 1} is not valid JSON")
    if not isinstance(data, dict):
        return None, (None, "invalid_json_line", f"line {idx + 1} must be a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, (None, "missing_custom_id", f"line {idx + 1} has no custom_id (a non-empty string)")
    if data.get("method", "POST") != "POST":
        return None, (custom_id, "invalid_method", f"line {idx + 1}: method must be POST, got {data.get('method')!r}")
    if data.get("url") not in endpoints:
        return None, (custom_id, "invalid_url", f"line {idx + 1}: url {data.get('url')!r} is not one of "
                                                f"{sorted(endpoints)}")
    body = data.get("body")
    if not isinstance(body, dict):
        return None, (custom_id, "invalid_body", f"line {idx + 1}: body must be a JSON object")
    if body.get("stream"):
        return None, (custom_id, "invalid_body", f"line {idx + 1}: stream is not supported in a batch")
    return _Parsed(batch_id, idx, custom_id, body, data["url"]), (None, "", "")


@dataclass(frozen=True, slots=True)
class _Parsed(Line):
    url: str = ""


def line_error(idx: int, custom_id: str | None, code: str, message: str) -> LineResult:
    return LineResult(idx, custom_id, LINE_ERROR_STATUS, new_id("batch_req_"), None, {"code": code, "message": message})


def openai_line(result: LineResult) -> dict[str, Any]:
    """An output- or error-file line: {"id", "custom_id", "response", "error"}."""
    response = None
    if result.error is None:
        response = {"status_code": result.status_code, "request_id": result.request_id, "body": result.body}
    return {"id": result.request_id, "custom_id": result.custom_id, "response": response, "error": result.error}


def anthropic_line(result: LineResult) -> dict[str, Any]:
    """A Message Batches results line: {"custom_id", "result": {"type", ...}}."""
    if result.status_code == 200:
        return {"custom_id": result.custom_id, "result": {"type": "succeeded", "message": result.body}}
    error = result.body
    if error is None or "error" not in error:
        error = {"type": "error", "error": {"type": "invalid_request_error",
                                            "message": (result.error or {}).get("message", "invalid request")}}
    return {"custom_id": result.custom_id, "result": {"type": "errored", "error": error}}


def dumps(line: dict[str, Any]) -> str:
    return json.dumps(line, ensure_ascii=False, separators=(",", ":"))
