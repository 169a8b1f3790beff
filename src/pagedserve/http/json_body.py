"""A JSON request body decoded into a strict pydantic model, or a 400 in the API's shape.

Models are strict (no "5" for 5, no true for 1) and ignore unknown fields.
"""
from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import APIError


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


M = TypeVar("M", bound=StrictModel)


def parse_body(body: bytes, model: type[M]) -> M:
    """Decode a JSON object body into `model`, or raise a 400 APIError."""
    try:
        data = json.loads(body, parse_float=_json_number)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e.msg} at position {e.pos}") from None
    except (ValueError, RecursionError):
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got a JSON {type(data).__name__}")
    _refuse_lone_surrogates(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def _json_number(text: str) -> int | float:
    """A JSON number with a fraction part: 2.0 is an int (JSON Schema counts it as an
    integer, and some clients write counts that way); 2.5 stays a float, which strict
    parsing refuses where an integer is due."""
    value = float(text)
    return int(value) if value.is_integer() else value


def _refuse_lone_surrogates(data: dict[str, Any]) -> None:
    """400 for a string holding an unpaired UTF-16 surrogate ("\\ud800" is valid JSON but
    not Unicode text: no tokenizer or template can take it)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        # Only now look for the field, so the common case costs one pass; a field whose
        # name is not Unicode cannot be named in a (UTF-8) response.
        param = next((key for key, value in data.items()
                      if not _has_lone_surrogate(key) and _has_lone_surrogate(json.dumps(value, ensure_ascii=False))),
                     None)
        raise APIError(400, f"{param or 'the body'} contains an unpaired UTF-16 surrogate, which is not valid "
                            "Unicode text", param=param) from None


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_LOCATION_NOISE = frozenset({"body", "query", "path", "header", "str", "int", "float", "bool", "dict", "list"})


def validation_error(error: ValidationError | Any) -> APIError:
    """pydantic's errors (ours or FastAPI's) as one 400: the first problem, with its field."""
    errors = error.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    # pydantic names union members in the location ("stop.list[constrained-str].0"); clients
    # know only field names and indices.
    loc = [part for part in first.get("loc", ())
           if isinstance(part, int) or (part.isidentifier() and part not in _LOCATION_NOISE)]
    param = str(loc[0]) if loc else None
    path = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
    return APIError(400, f"{path or 'body'}: {first.get('msg', 'invalid value')}", param=param)

