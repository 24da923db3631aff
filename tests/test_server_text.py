"""Text that is not Unicode (a lone surrogate: JSON's "\\ud800" parses into one) is refused in any field of a
body, prompts and the fields a reply echoes alike, with a 400 naming the field as each API spells it, over
real HTTP; the SDK refuses it where prompts meet the tokenizer."""
from __future__ import annotations

import json

import httpx
import pytest

from bie_trt import BieEngine, EngineConfig
from bie_trt.errors import RequestError
from bie_trt.executor.prompt_checks import unencodable
from test_server import serving

LONE = "\ud800"
TOOL = {"type": "function", "function": {"name": "f", "description": "d" + LONE, "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "hi"}]

# (route, body, the field the refusal names)
CASES = [
    ("/v1/completions", {"prompt": LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a" + LONE], "max_tokens": 2}, "prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" + LONE}], "max_tokens": 2},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": HI + [{"role": "assistant", "content": "a"},
                                                {"role": "user", "content": [{"type": "text", "text": LONE}]}],
                              "max_tokens": 2}, "messages[2].content[0].text"),
    ("/v1/chat/completions", {"messages": HI, "tools": [TOOL], "max_tokens": 2}, "tools[0].function.description"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"k": LONE}, "max_tokens": 2},
     "chat_template_kwargs.k"),
    # a string input is named as the one message it stands for
    ("/v1/responses", {"input": LONE, "max_output_tokens": 2}, "input[0].content[0].text"),
    ("/v1/responses", {"input": "hi", "instructions": LONE, "max_output_tokens": 2}, "instructions"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": LONE}]}],
                       "max_output_tokens": 2}, "input[0].content[0].text"),
    # as the body validates: string content named as the text block it stands for
    ("/v1/messages", {"messages": [{"role": "user", "content": LONE}], "max_tokens": 2},
     "messages[0].content[0].text"),
    ("/v1/messages", {"system": LONE, "messages": HI, "max_tokens": 2}, "system[0].text"),
    ("/v1/messages/count_tokens", {"messages": HI + [{"role": "assistant", "content": [
        {"type": "text", "text": LONE}]}]}, "messages[1].content[0].text"),
    # fields a reply echoes (the Responses object carries them back): refused before any handler runs
    ("/v1/responses", {"input": "hi", "metadata": {"k": "v" + LONE}, "max_output_tokens": 2}, "metadata.k"),
    ("/v1/responses", {"input": "hi", "user": LONE, "max_output_tokens": 2}, "user"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2,
                       "tools": [{"type": "function", "name": "f", "description": LONE,
                                  "parameters": {"type": "object"}}]}, "tools[0].description"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": {"format": {
        "type": "json_schema", "name": "a", "schema": {"type": "object", "description": LONE}}}},
     "text.format.schema.description"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "user": LONE}, "user"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "stop": ["x" + LONE]}, "stop[0]"),
    ("/v1/messages", {"messages": HI, "max_tokens": 2, "metadata": {"user_id": LONE}}, "metadata.user_id"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
]


@pytest.fixture(scope="module")
def base(tiny_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=256))
    with serving(engine) as url:
        yield url


def post(base: str, path: str, body: dict) -> httpx.Response:
    # json.dumps writes a lone surrogate as the escape a client sends; httpx's own encoder would refuse it
    return httpx.post(base + path, content=json.dumps({"model": "x", **body}),
                      headers={"content-type": "application/json"}, timeout=120)


@pytest.mark.parametrize("path,body,field", CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_a_lone_surrogate_is_a_400_naming_its_field(base, path, body, field):
    r = post(base, path, body)
    assert r.status_code == 400, r.text
    if path.startswith("/v1/messages"):   # Anthropic's errors have no param: the message names the field
        assert r.json()["error"]["message"].startswith(f"{field} holds a lone surrogate (U+D800)")
    else:
        assert r.json()["error"]["param"] == field, r.text
        assert "lone surrogate" in r.json()["error"]["message"]


NAMED = [("/v1/responses", {"input": "hi", "max_output_tokens": 2,
                            "tools": [{"type": "function", "name": "f" + LONE, "parameters": {"type": "object"}}]},
          "tools[0].name"),
         ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "tools": [{"type": "custom", "name": "p" + LONE}]},
          "tools[0].name"),
         ("/v1/chat/completions", {"messages": HI, "max_tokens": 2,
                                   "tools": [{"type": "function", "function": {"name": "f" + LONE}}]},
          "tools[0].function.name")]


@pytest.mark.parametrize("path,body,field", NAMED, ids=[f"{c[0]}:{c[2]}" for c in NAMED])
def test_a_lone_surrogate_in_a_tool_name_fails_the_names_pattern(base, path, body, field):
    """A name is held to a pattern as the body validates, which text that is not Unicode fails: the
    refusal names the field (and quotes the name escaped, so the error itself can be written)."""
    r = post(base, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "unicode string" in r.json()["error"]["message"], r.text


def test_a_surrogate_pair_is_text(base):
    """The escape pair of one emoji (as json.dumps writes it) is text like any other."""
    r = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "\U0001F600"}],
                                             "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_the_sdk_refuses_it_by_name(tiny_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=256))
    with pytest.raises(RequestError, match=r"^prompt holds a lone surrogate"):
        engine.encode("a" + LONE)
    with pytest.raises(RequestError, match=r"^messages\[0\]\.content holds"):
        engine.encode([{"role": "user", "content": LONE}])


def test_unencodable_names_the_path_and_character():
    found = unencodable({"a": [1, "ok", {"b": "xy" + LONE}]})
    assert (found.field, str(found).split(" at character ")[1][:1]) == ("a[2].b", "2")
    assert unencodable({"a": ["fine", "\U0001F600"]}) is None
