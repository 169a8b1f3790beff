"""Twenty JSON schemas of varied shape for the structured-output tests.

Strings and arrays are bounded so a complete answer fits a modest max_tokens: the
tests assert that every output finishes on its own and validates.
"""
from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 100}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person.", obj({"name": NAME, "age": SMALL_INT})),
    ("Is water wet?", obj({"answer": {"type": "boolean"}})),
    ("Pick a colour.", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("Give a temperature.", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("List three fruits.", obj({"fruits": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}})),
    ("Give a point.", obj({"point": obj({"x": SMALL_INT, "y": SMALL_INT})})),
    ("A US zip code.", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("A date.", obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("A product with an optional note.", obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                                              "note": NAME}, required=["sku"])),
    ("Scores.", obj({"scores": {"type": "array", "items": SMALL_INT, "maxItems": 4}})),
    ("A nested config.", obj({"server": obj({"host": NAME, "port": {"type": "integer", "minimum": 1,
                                                                     "maximum": 65535}}),
                              "debug": {"type": "boolean"}})),
    ("Status.", obj({"status": {"enum": ["ok", "error", 404]}})),
    ("A constant.", obj({"kind": {"const": "book"}, "pages": SMALL_INT})),
    ("Maybe a value.", obj({"value": {"anyOf": [SMALL_INT, {"type": "null"}]}})),
    ("Tags.", obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 2}})),
    ("A matrix.", obj({"rows": {"type": "array", "maxItems": 2,
                                "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                     "maximum": 9}, "maxItems": 2}}})),
    ("A list of people.", obj({"people": {"type": "array", "maxItems": 2, "items": obj({"name": NAME})}})),
    ("Just a number.", {"type": "integer", "minimum": 1, "maximum": 999}),
    ("Just a list.", {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}),
    ("An optional-heavy record.", obj({"id": SMALL_INT, "label": NAME, "ok": {"type": "boolean"}},
                                      required=["id"])),
]
