"""Request fields declared once. The handlers validate a body by reading these specs
(each failure a 400 naming its param, see `fields`), and /openapi.json is generated
from the same specs, so the document cannot drift from what the server checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ruvllm_cli.server.errors import bad_request
from ruvllm_cli.server.fields import Fields, invalid_type, invalid_value

JsonSchema = dict[str, Any]


@dataclass(frozen=True)
class Field:
    """One field of a JSON object. Scalars (integer, number, string, boolean) are
    checked by their bounds and enum alone; an object's `properties` are checked
    before `parse` sees its Fields; any other value goes to `parse`, which raises
    the 400s of its own checks and which `schema` describes for the document."""

    name: str
    type: str | None                  # its JSON type; None: whatever `parse` accepts
    description: str = ""
    default: Any = None               # the value when absent or null
    required: bool = False
    low: float | None = None          # bounds, inclusive
    high: float | None = None
    above_low: bool = False           # `low` itself refused: 0 < top_p <= 1
    enum: tuple[str, ...] = ()
    properties: tuple["Field", ...] = ()
    parse: Callable[[Any], Any] | None = None
    schema: Mapping[str, Any] | None = None   # the JSON schema of what `parse` accepts

    def read(self, fields: Fields) -> Any:
        """This field's value in `fields` (the default when absent), checked."""
        value = fields.required(self.name) if self.required else fields.raw(self.name)
        if value is None:
            return self.default
        param = fields.prefix + self.name
        if self.type in _SCALARS:
            return self._scalar(fields, param, value)
        if self.type == "object":
            nested = fields.object(self.name)
            assert nested is not None
            values = read_fields(nested, self.properties)
            return self.parse(nested) if self.parse else (values if self.properties else nested.body)
        if self.type == "array" and not isinstance(value, list):
            raise invalid_type(param, "an array", value)
        assert self.parse is not None, f"{self.name}: a non-scalar field needs parse"
        return self.parse(value)

    def _scalar(self, fields: Fields, param: str, value: Any) -> Any:
        if self.type == "integer":
            value = fields.integer(self.name, low=_int(self.low), high=_int(self.high))
        elif self.type == "number":
            value = fields.number(self.name, 0.0, low=self.low, high=self.high)
        elif self.type == "boolean":
            value = fields.boolean(self.name)
        else:
            value = fields.string(self.name)
        if self.required and value == "":
            raise bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
        if self.above_low and value == self.low:
            raise invalid_value(param, self.above_low_rule, value)
        if self.enum and value not in self.enum:
            raise invalid_value(param, f"must be one of {', '.join(self.enum)}", value)
        return self.parse(value) if self.parse else value

    @property
    def above_low_rule(self) -> str:
        rule = f"must be greater than {self.low:g}"
        return rule + (f" and at most {self.high:g}" if self.high is not None else "")

    def json_schema(self) -> JsonSchema:
        """This field in JSON Schema (OpenAPI 3.1); null is allowed where it means absent."""
        schema: JsonSchema = dict(self.schema) if self.schema is not None else {"type": self.type}
        if self.description:
            schema["description"] = self.description
        if isinstance(self.default, (bool, int, float, str)):
            schema["default"] = self.default
        if self.low is not None:
            schema["exclusiveMinimum" if self.above_low else "minimum"] = self.low
        if self.high is not None:
            schema["maximum"] = self.high
        if self.enum:
            schema["enum"] = list(self.enum)
        if self.type == "string" and self.required:
            schema["minLength"] = 1
        if self.type == "object" and self.properties:
            schema.update(object_schema(self.properties))
        return schema if self.required else nullable(schema)


_SCALARS = {"integer", "number", "string", "boolean"}


def _int(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


def read_fields(fields: Fields, specs: Sequence[Field]) -> dict[str, Any]:
    """Every spec's value, read in order (so the first bad field is the one reported)."""
    return {spec.name: spec.read(fields) for spec in specs}


def object_schema(specs: Sequence[Field]) -> JsonSchema:
    """The JSON schema of an object holding `specs`; other keys are allowed and ignored."""
    schema: JsonSchema = {"type": "object", "properties": {spec.name: spec.json_schema() for spec in specs}}
    required = [spec.name for spec in specs if spec.required]
    if required:
        schema["required"] = required
    return schema


def nullable(schema: JsonSchema) -> JsonSchema:
    kind = schema.get("type")
    if kind == "null":   # a field only null (absent) may take: refused whenever it is given
        return schema
    if isinstance(kind, str) and "enum" not in schema:
        return {**schema, "type": [kind, "null"]}
    return {"anyOf": [schema, {"type": "null"}]}
