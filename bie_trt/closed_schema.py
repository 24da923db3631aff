"""A JSON Schema made to close: what a grammar built from it lets a model write always ends.

JSON Schema's own reading is open: an object takes keys it does not declare, an integer or a number
any number of digits. A small model under such a grammar fills undeclared keys and digits until its
token budget runs out. `close_schema` returns the schema with those doors shut, as OpenAI's and
xgrammar's strict modes read a schema, while every value it admits still validates against the schema
as written (it only adds constraints):

- an object that declares `properties` admits no other keys unless the schema says how
  (`additionalProperties`, `patternProperties` or `unevaluatedProperties` present);
- an integer without a bound gets the int64 one on that side (to INT64_BOUND, which llguidance's float
  bounds hold exactly);
- a number without a bound gets +/-NUMBER_BOUND, and one without `multipleOf` at most
  NUMBER_DECIMALS decimals (a bounded number has no exponent form in the grammar).

Objects under an `allOf` of several schemas are left open: each branch would refuse the others' keys.
"""
from __future__ import annotations

from typing import Any

INT64_BOUND = 2 ** 63 - 1024       # the widest symmetric range inside int64 that a float64 holds exactly
NUMBER_BOUND = 1e15                # 15 digits before the point
NUMBER_DECIMALS = 6

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
                  "unevaluatedItems", "unevaluatedProperties")


def close_schema(schema: Any) -> Any:
    """The closed copy of a schema (the input is not changed); see the module's docstring."""
    return _close(schema, open_objects=False)


def _close(node: Any, open_objects: bool) -> Any:
    if isinstance(node, list):   # `items` in its older tuple form
        return [_close(n, open_objects) for n in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [_close(n, False) for n in node[key]]
    if isinstance(node.get("allOf"), list):
        out["allOf"] = [_close(n, open_objects or len(node["allOf"]) > 1) for n in node["allOf"]]
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: _close(n, False) for name, n in node[key].items()}
    for key in _SCHEMA_VALUES:
        if isinstance(node.get(key), (dict, list)):
            out[key] = _close(node[key], False)
    types = node.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if isinstance(node.get("properties"), dict) and not open_objects and not any(k in node for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    if "integer" in types or "number" in types:
        bound = NUMBER_BOUND if "number" in types else INT64_BOUND
        low, high = node.get("minimum", node.get("exclusiveMinimum")), node.get("maximum", node.get("exclusiveMaximum"))
        if low is None:   # (a one-sided bound beyond ours keeps the range non-empty)
            out["minimum"] = -bound if not isinstance(high, (int, float)) else min(-bound, high)
        if high is None:
            out["maximum"] = bound if not isinstance(low, (int, float)) else max(bound, low)
        if "number" in types and "multipleOf" not in node:
            out["multipleOf"] = 10.0 ** -NUMBER_DECIMALS
    return out
