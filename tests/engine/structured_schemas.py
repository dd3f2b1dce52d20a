"""JSON schemas for the structured-output tests: each bounds its strings, numbers and
arrays so a random-weight model (which never chooses to stop) can finish."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = obj({"leaf": SMALL_INT})
    for level in range(depth):
        schema = obj({f"n{level}": schema, "id": {"type": "integer", "minimum": 0, "maximum": 9}})
    return schema


SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": obj({"name": NAME, "age": SMALL_INT}),
    "boolean": obj({"ok": {"type": "boolean"}}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "const": obj({"version": {"const": 3}, "kind": {"const": "point"}}),
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    "date_pattern": obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    "bounded_ints": obj({"x": {"type": "integer", "minimum": -5, "maximum": 5},
                         "y": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}}),
    "string_lengths": obj({"short": {"type": "string", "minLength": 2, "maxLength": 3},
                           "exact": {"type": "string", "minLength": 4, "maxLength": 4}}),
    "nested_6": nested(6),
    "nested_8": nested(8),
    "array_of_ints": obj({"values": {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 4}}),
    "array_of_objects": obj({"people": {"type": "array", "minItems": 2, "maxItems": 3,
                                        "items": obj({"name": NAME, "age": SMALL_INT})}}),
    "enum_array": obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}),
    "any_of": obj({"value": {"anyOf": [SMALL_INT, {"enum": ["none", "all"]}]}}),
    "any_of_objects": obj({"shape": {"anyOf": [obj({"r": SMALL_INT}), obj({"w": SMALL_INT, "h": SMALL_INT})]}}),
    "ref_defs": {"$defs": {"person": obj({"name": NAME, "age": SMALL_INT})},
                 **obj({"owner": {"$ref": "#/$defs/person"}, "friend": {"$ref": "#/$defs/person"}})},
    "ref_chain": {"$defs": {"leaf": {"enum": [1, 2, 3]}, "pair": obj({"l": {"$ref": "#/$defs/leaf"},
                                                                      "r": {"$ref": "#/$defs/leaf"}})},
                  **obj({"p": {"$ref": "#/$defs/pair"}})},
    "nullable": obj({"maybe": {"anyOf": [{"type": "null"}, NAME]}}),
    "optional_fields": obj({"a": SMALL_INT, "b": NAME, "c": {"type": "boolean"}}, required=["a"]),
    "top_level_array": {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 2},
    "top_level_enum": {"enum": ["yes", "no"]},
    "mixed_types": obj({"s": NAME, "i": SMALL_INT, "b": {"type": "boolean"}, "n": {"type": "null"},
                        "e": {"enum": ["x", "y"]}}),
    "matrix": obj({"rows": {"type": "array", "minItems": 1, "maxItems": 2,
                            "items": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 2, "maxItems": 2}}}),
    "one_of_consts": obj({"op": {"oneOf": [{"const": "add"}, {"const": "sub"}]}, "arg": SMALL_INT}),
    "deep_array_objects": obj({"teams": {"type": "array", "minItems": 1, "maxItems": 2, "items": obj({
        "lead": obj({"name": NAME}), "members": {"type": "array", "maxItems": 2, "items": obj({"id": SMALL_INT})}})}}),
    "number_bounded": obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}, required=[]),
}
