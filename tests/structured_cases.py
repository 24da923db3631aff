"""JSON Schemas of different shapes, each with one instance that matches it: shared by the structured-output
tests and scripts/bench_structured.py (which walks a grammar matcher along the instance's tokens); and
the shapes agent frameworks send, for scripts/fuzz_structured.py."""
from __future__ import annotations

from bie_trt.chat.tool_calls import required_schema

SCHEMAS: dict[str, tuple[dict, object]] = {
    "flat_required": ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                       "required": ["name", "age"], "additionalProperties": False},
                      {"name": "Ada", "age": 36}),
    "nested_object": ({"type": "object", "properties": {
                          "user": {"type": "object", "properties": {
                              "id": {"type": "integer", "minimum": 1, "maximum": 999},
                              "admin": {"type": "boolean"}},
                              "required": ["id", "admin"], "additionalProperties": False}},
                       "required": ["user"], "additionalProperties": False},
                      {"user": {"id": 7, "admin": False}}),
    "array_bounds": ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                      "minItems": 2, "maxItems": 4},
                     [3, 1, 4]),
    "enum": ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
              "required": ["color"], "additionalProperties": False},
             {"color": "green"}),
    "any_of": ({"type": "object", "properties": {"value": {"anyOf": [
                   {"type": "integer", "minimum": 0, "maximum": 99},
                   {"type": "string", "enum": ["none", "many"]}]}},
                "required": ["value"], "additionalProperties": False},
               {"value": "many"}),
    "number_range": ({"type": "object", "properties": {"t": {"type": "integer", "minimum": -40, "maximum": 50},
                                                       "ok": {"type": "boolean"}},
                      "required": ["t", "ok"], "additionalProperties": False},
                     {"t": -5, "ok": True}),
    "optional": ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "b": {"type": "string", "maxLength": 4}},
                  "required": ["a"], "additionalProperties": False},
                 {"a": 2}),
    "pattern": ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                 "required": ["code"], "additionalProperties": False},
                {"code": "ABC-12"}),
    "null_and_bool": ({"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
                       "required": ["ok", "note"], "additionalProperties": False},
                      {"ok": True, "note": None}),
    "array_of_objects": ({"type": "object", "properties": {"points": {
                             "type": "array", "minItems": 1, "maxItems": 2, "items": {
                                 "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                  "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                                 "required": ["x", "y"], "additionalProperties": False}}},
                          "required": ["points"], "additionalProperties": False},
                         {"points": [{"x": 1, "y": 2}]}),
    "tool_call": ({"type": "object", "properties": {
                      "name": {"const": "get_weather"},
                      "arguments": {"type": "object", "properties": {
                          "city": {"type": "string", "maxLength": 10},
                          "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}},
                   "required": ["name", "arguments"], "additionalProperties": False},
                  {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}),
    "bounded_string_array": ({"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 6},
                              "minItems": 1, "maxItems": 3},
                             ["ab", "cd"]),
}

# The shapes agent frameworks send as they come (pydantic's and LangChain's schemas): no
# additionalProperties, integers and numbers without bounds, lists without maxItems. Strings carry a
# maxLength, as the closed reading bounds no string: a model may still write one up to max_tokens.
_WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                 "required": ["city"]}
_ADD_ARGS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}
FRAMEWORK_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": _WEATHER_ARGS}},
                   {"type": "function", "function": {"name": "add", "parameters": _ADD_ARGS}}]
FRAMEWORK_SCHEMAS: dict[str, dict] = {
    "person": {"title": "Person", "type": "object", "properties": {
        "name": {"title": "Name", "type": "string", "maxLength": 20}, "age": {"title": "Age", "type": "integer"}},
        "required": ["name", "age"]},
    "tool_arguments": _WEATHER_ARGS,
    "coordinates": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"]},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "admin": {"type": "boolean"}}, "required": ["id", "admin"]}}, "required": ["user"]},
    "int_list": {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"}}},
                 "required": ["values"]},
    "optional_fields": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8},
                                                         "c": {"type": "boolean"}}, "required": ["a"]},
    "enum_field": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                    "shade": {"type": "number"}}, "required": ["color"]},
    "nullable": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
                 "required": ["value"]},
    "list_of_objects": {"type": "object", "properties": {"points": {"type": "array", "items": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}},
        "required": ["points"]},
    "defs_ref": {"$defs": {"Address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer"}}, "required": ["city", "zip"]}},
        "type": "object", "properties": {"address": {"$ref": "#/$defs/Address"}}, "required": ["address"]},
    "pattern_and_bool": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                          "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                         "required": ["ok", "code"]},
    # what tool_choice "required" constrains a reply to, over two tools with LangChain's schemas
    "required_tools": required_schema(FRAMEWORK_TOOLS),
}
