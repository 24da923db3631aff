"""A schema fuzz of the HTTP API: request bodies drawn by hypothesis from the OpenAPI schema the server
publishes (every field, in and out of its declared type and range, plus unknown fields, raw bytes and
other JSON at the top level), sent over real HTTP. No answer may be a 5xx, and the server must still
answer properly afterwards."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bie_trt import BieEngine, EngineConfig
from bie_trt.server.app import ServerOptions
from test_server import serving

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=3), max_leaves=6)
# Values that break servers: wrong types, bounds, 32- and 64-bit limits, numbers no int64 holds.
EDGES = st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63, -(2 ** 63) - 1, 10 ** 20, 1e308, -0.0, 0.5, "", "4", True,
                         None, [], {}, [[]], [None], ["", ""]]) | JSON


def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """Valid values of one OpenAPI (JSON Schema) node: types, bounds, enums, unions, arrays and objects.
    Numbers stay small, so that a valid request generates a few tokens, not thousands; strings and
    lists are not empty (an empty prompt is a mistake the edge values cover)."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "allOf" in schema:
        return from_schema(schema["allOf"][0], defs)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    low = schema.get("minimum", schema.get("exclusiveMinimum", 0))   # unbounded: small, >= 0 (token ids)
    high = min(schema.get("maximum", schema.get("exclusiveMaximum", low + 5)), low + 5)
    if kind == "integer":
        return st.integers(low + ("exclusiveMinimum" in schema), high - ("exclusiveMaximum" in schema))
    if kind == "number":
        return st.floats(low, high, exclude_min="exclusiveMinimum" in schema,
                         exclude_max="exclusiveMaximum" in schema)
    if kind == "string":
        return st.text(min_size=1, max_size=20)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), min_size=max(1, schema.get("minItems", 0)),
                        max_size=3)
    if kind == "object" or "properties" in schema:
        props = {k: v for k, v in schema.get("properties", {}).items() if k != "model"}   # any other name: 404
        fields = {name: from_schema(sub, defs) for name, sub in props.items()}
        required = set(schema.get("required", []))
        return st.fixed_dictionaries({k: v for k, v in fields.items() if k in required},
                                     optional={k: v for k, v in fields.items() if k not in required})
    return JSON


def body_strategy(schema: dict, defs: dict) -> st.SearchStrategy:
    """A valid body (one token unless it asks for more, under the route's name for a token limit), or one
    with one field (or an unknown one) set to an edge value: every field is then tested on its own, with
    the rest valid."""
    limit = next((name for name in ("max_tokens", "max_output_tokens") if name in schema.get("properties", {})),
                 None)
    valid = from_schema(schema, defs).map(lambda body: {limit: 1, **body} if limit else body)

    def mutate(body: dict, key: str, value) -> dict:
        return {**body, key: value}

    field_names = st.sampled_from(sorted(schema.get("properties", {})) + ["unknown_field"])
    return st.one_of(valid, st.builds(mutate, valid, field_names, EDGES))


@pytest.fixture(scope="module")
def fuzz_server(tiny_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=64))
    with serving(engine, ServerOptions(request_timeout=20)) as base:
        schema = httpx.get(base + "/openapi.json").json()
        yield engine, base, schema


def _routes(schema: dict) -> list[tuple[str, dict]]:
    defs = schema["components"]["schemas"]
    out = []
    for path, methods in schema["paths"].items():
        body = methods.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body:
            out.append((path, defs[body["schema"]["$ref"].rsplit("/", 1)[-1]]))
    return out


def test_the_schema_lists_every_body_route(fuzz_server):
    assert sorted(path for path, _ in _routes(fuzz_server[2])) == sorted([
        "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/cache/save", "/v1/cache/restore",
        "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"])


def assert_error_shape(path: str, r: httpx.Response) -> None:
    """Anthropic's shape on its routes, OpenAI's on the others."""
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, (path, body)
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, (path, body)


def post_a_drawn_body(fuzz_server, data) -> None:
    engine, base, schema = fuzz_server
    path, request_schema = data.draw(st.sampled_from(_routes(schema)))
    body = data.draw(body_strategy(request_schema, schema["components"]["schemas"]) | JSON)
    r = httpx.post(base + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert_error_shape(path, r)


# Each valid body generates up to n x max_tokens tokens: 12 draws by default (the field-by-field sweep
# below covers the edges systematically), 200 under `-m slow`.
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_body_makes_a_5xx(fuzz_server, data):
    post_a_drawn_body(fuzz_server, data)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_body_makes_a_5xx_thorough(fuzz_server, data):
    post_a_drawn_body(fuzz_server, data)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                             "/v1", "/v1/models/x"]) | st.text(max_size=12).map(lambda t: "/" + t.lstrip("/")),
       raw=st.binary(max_size=40), content_type=st.sampled_from(["application/json", "text/plain", ""]))
def test_no_method_path_or_raw_body_makes_a_5xx(fuzz_server, method, path, raw, content_type):
    base = fuzz_server[1]
    try:
        r = httpx.request(method, base + path, content=raw, headers={"content-type": content_type}, timeout=60)
    except httpx.InvalidURL:
        return   # a path httpx itself refuses to send
    assert r.status_code < 500, (method, path, raw, r.text)


INT_EDGES = [-1, 2 ** 63, 10 ** 20, 1e308, "4", True]   # None, lists and objects: the hypothesis draws


HI = [{"role": "user", "content": "Hi"}]
# a valid one-token body of each route, and numeric fields its schema must list
SWEEPS = {"/v1/completions": ({"max_tokens": 1, "prompt": "Hi"}, {"max_tokens", "seed", "temperature", "n", "logprobs"}),
          "/v1/chat/completions": ({"max_tokens": 1, "messages": HI}, {"max_tokens", "seed", "n", "top_logprobs"}),
          "/v1/messages": ({"max_tokens": 1, "messages": HI}, {"max_tokens", "temperature", "top_p", "top_k"}),
          "/v1/responses": ({"max_output_tokens": 1, "input": "Hi"}, {"max_output_tokens", "temperature", "top_p"})}


@pytest.mark.parametrize("path", [pytest.param(path, marks=[pytest.mark.slow] if path == "/v1/chat/completions" else [])
                                  for path in SWEEPS])
def test_every_field_at_every_edge_with_the_rest_valid(fuzz_server, path):
    """Each numeric field of the schema in turn set to each edge value, on an otherwise valid one-token
    body: the sweep hypothesis might need thousands of draws to stumble on."""
    engine, base, schema = fuzz_server
    request_schema = dict(_routes(schema))[path]
    valid, expected = SWEEPS[path]
    failures = []
    numeric = [name for name, sub in request_schema["properties"].items()
               if {"integer", "number"} & {s.get("type") for s in sub.get("anyOf", [sub])}]
    assert expected <= set(numeric)
    for name in sorted(numeric):
        for value in INT_EDGES:
            body = {**valid, name: value}
            r = httpx.post(base + path, json=body, timeout=60)
            if r.status_code >= 500:
                failures.append((name, value, r.status_code, r.text[:200]))
            elif r.status_code >= 400:
                assert_error_shape(path, r)
    assert not failures


def test_the_server_still_answers_after_the_fuzz(fuzz_server):
    engine, base, _ = fuzz_server
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert engine.stats().kv_blocks["fp16"]["used"] == 0 and engine.stats().running == 0
