"""Structured outputs, tool calls and the other generation fields of the OpenAI API, driven by the real
`openai` client against a real server on 127.0.0.1: every reply under a schema validates (checked by
`jsonschema`), tool_choice "required" / a named function always yields calls whose arguments validate,
streams reassemble to the same reply, and bad requests get a 400 naming the field."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.errors import RequestError
from bie_trt.sampling_params import StructuredOutputs
from structured_cases import SCHEMAS
from test_server import serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two small numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tiny_engine):
    """The tiny random model: grammars hold whatever the model prefers, so the protocol is tested on it."""
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=512))
    with serving(engine) as base:
        yield engine, base


@pytest.fixture(scope="module")
def smollm2_client(smollm2_engine):
    """A real model, where a test needs one to end its JSON within a few dozen tokens (a random model
    wanders through the whitespace JSON allows)."""
    engine = BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_model_len=512))
    with serving(engine) as base:
        yield engine.model_name, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(server):
    return server[0].model_name


def together(*calls):
    """Run the calls at once (so the engine batches them); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_parse_gives_a_pydantic_object(client, model):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        population_millions: int = pydantic.Field(ge=0, le=40)

    r = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Describe Paris."}],
                                      response_format=City, max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, City)


@pytest.mark.slow
def test_json_schema_replies_validate(smollm2_client):
    """Every shape of tests/structured_cases.py, all at once (batched), at temperature 1."""
    model, client = smollm2_client

    def ask(name: str, schema: dict):
        return lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Give me an example of {name}."}],
            response_format=schema_format(name, schema), max_tokens=40, temperature=1, seed=7)

    replies = together(*[ask(name, schema) for name, (schema, _) in SCHEMAS.items()])
    assert len(replies) >= 10
    for (name, (schema, _)), r in zip(SCHEMAS.items(), replies):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_regex_choice(client, model):
    obj, regex, choice, guided = together(
        lambda: client.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                               messages=[{"role": "user",
                                                          "content": 'Reply with a JSON object like {"city": "Paris"}.'}],
                                               response_format={"type": "json_object"}),
        lambda: client.completions.create(model=model, prompt="A date:", max_tokens=12, temperature=1, seed=3,
                                          extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}}),
        lambda: client.completions.create(model=model, prompt="Is the sky blue?", max_tokens=5, temperature=1,
                                          seed=1, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}),
        lambda: client.chat.completions.create(model=model, messages=ASK, max_tokens=5, temperature=1, seed=2,
                                               extra_body={"guided_choice": ["sunny", "rainy"]}))
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert jsonschema.Draft202012Validator({"type": "string", "pattern": r"^20[0-9]{2}-[01][0-9]$"}).is_valid(
        regex.choices[0].text), regex.choices[0].text
    assert choice.choices[0].text in ("yes", "no")
    assert guided.choices[0].message.content in ("sunny", "rainy")


def call_pairs(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.slow   # ~16 s: four sampled replies; the greedy tool_choice tests stay in the default suite
def test_required_and_named_always_call(smollm2_client):
    """At temperature 1 over several seeds (n choices each seeded apart): calls whose arguments validate."""
    model, client = smollm2_client
    required, named = together(
        lambda: client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, n=2, seed=11, temperature=1,
                                               max_tokens=40),
        lambda: client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, n=2, seed=21, temperature=1,
                                               tool_choice={"type": "function", "function": {"name": "add"}},
                                               max_tokens=24))
    for choice in required.choices + named.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        calls = call_pairs(choice.message)
        assert len(calls) == 1 and all(c.id.startswith("call_") for c in choice.message.tool_calls)
        jsonschema.validate(calls[0][1], PARAMS[calls[0][0]])
    assert {call_pairs(c.message)[0][0] for c in named.choices} == {"add"}


def reassemble(chunks) -> tuple[str | None, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert all(c["id"].startswith("call_") for c in calls.values())
    return content or None, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


@pytest.mark.slow
def test_streamed_calls_reassemble_to_the_same_call(smollm2_client):
    """For "required" and a named function (all four requests batched together)."""
    model, client = smollm2_client

    def pair(tool_choice, seed):
        kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                  seed=seed, temperature=1, max_tokens=40)
        return (lambda: client.chat.completions.create(**kw),
                lambda: list(client.chat.completions.create(stream=True, **kw)))

    named = {"type": "function", "function": {"name": "get_weather"}}
    whole_required, stream_required, whole_named, stream_named = together(*pair("required", 5), *pair(named, 6))
    for whole, chunks in ((whole_required, stream_required), (whole_named, stream_named)):
        message = whole.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert reassemble(chunks) == (message.content, calls, "tool_calls")
        jsonschema.validate(json.loads(calls[0][1]), PARAMS[calls[0][0]])
    assert len(stream_named) > 4   # a named call's arguments stream as they come, not in one piece


@pytest.mark.slow
def test_auto_parses_the_models_own_format(smollm2_client):
    """tool_choice auto: a reply in Hermes tags (made certain here with a regex, since the 135M model seldom
    calls tools by itself) comes back as tool_calls, the prose before it as content, whole or streamed."""
    model, client = smollm2_client
    regex = r'Sure\. <tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=1, seed=3, max_tokens=40,
              extra_body={"structured_outputs": {"regex": regex}})
    whole, chunks = together(lambda: client.chat.completions.create(**kw),
                             lambda: list(client.chat.completions.create(stream=True, **kw)))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    (name, arguments), = call_pairs(choice.message)
    assert name == "add"
    jsonschema.validate(arguments, PARAMS[name])
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert reassemble(chunks) == ("Sure. ", calls, "tool_calls")


def test_n_and_stream_with_a_schema(client, model):
    schema, _ = SCHEMAS["number_range"]
    stream = client.chat.completions.create(model=model, messages=ASK, response_format=schema_format("p", schema),
                                            n=2, stream=True, temperature=0, max_tokens=40)
    texts = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(texts) == [0, 1]
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)


def test_grammar_and_free_requests_batched_together(server, client, model):
    """Masks stay on their own rows: the unconstrained replies equal the same requests run alone."""
    engine = server[0]
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [engine.generate(p, SamplingParams(temperature=0, max_tokens=8)).text for p in prompts]
    schema, _ = SCHEMAS["enum"]
    replies = together(*[lambda p=p: client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0)
                         for p in prompts],
                       *[lambda s=s: client.completions.create(model=model, prompt="Colour:", max_tokens=16,
                                                              temperature=1, seed=s,
                                                              extra_body={"response_format": schema_format("c", schema)})
                         for s in (1, 2)])
    assert [r.choices[0].text for r in replies[:2]] == alone
    for r in replies[2:]:
        jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_logit_bias(server, client, model):
    prompt = "The capital of France is"
    greedy = server[0].generate(prompt, SamplingParams(temperature=0, max_tokens=1)).token_ids[0]
    forced = 1000 if greedy != 1000 else 1001
    banned, pushed = together(
        *[lambda bias=bias: client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                                      logprobs=0, logit_bias=bias)
          for bias in ({str(greedy): -100}, {str(forced): 100})])
    tokenize = lambda text: httpx.post(server[1] + "/tokenize", json={"prompt": text}).json()["tokens"]   # noqa: E731
    assert banned.choices[0].text != server[0].tokenizer.decode([greedy])
    assert tokenize(pushed.choices[0].text) == [forced] or pushed.choices[0].text == server[0].tokenizer.decode([forced])


def test_min_tokens_holds(server, client, model):
    """A stop token that ends the reply at once is held off until min_tokens have come."""
    prompt = "The capital of France is"
    first = server[0].generate(prompt, SamplingParams(temperature=0, max_tokens=1)).token_ids[0]
    early, held = together(
        *[lambda m=m: client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                extra_body={"stop_token_ids": [first], "min_tokens": m})
          for m in (0, 5)])
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens >= 5


def test_echo(client, model):
    prompt = "The capital of France is"
    whole = client.completions.create(model=model, prompt=prompt, echo=True, max_tokens=3, temperature=0)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, echo=True, max_tokens=3, temperature=0, stream=True))
    assert whole.choices[0].text == prompt + plain.choices[0].text == streamed


def test_tool_history_reaches_the_prompt(server, client, model):
    """Assistant tool calls and tool results are accepted; without native tool support in the template they
    are written as Hermes tags, after a system prompt that lists the tools."""
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"}]
    ids = httpx.post(server[1] + "/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(server[1] + "/detokenize", json={"tokens": ids}).json()["prompt"]
    for part in ('"name": "add"', '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"',
                 "<tool_response>\n12 degrees, rain\n</tool_response>"):
        assert part in text
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tokenize_detokenize(server):
    base, tok = server[1], server[0].tokenizer
    r = httpx.post(base + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r == {"tokens": tok("Hello world")["input_ids"], "count": len(r["tokens"]),
                 "max_model_len": 512}
    assert httpx.post(base + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = httpx.post(base + "/tokenize", json={"messages": ASK}).json()
    assert chat["tokens"] == server[0].encode(ASK, chat=True)


def test_json_schema_mode_picks_the_closed_or_lenient_grammar(server, client, model):
    """The random model at temperature 1 takes whatever a grammar leaves open: under the closed default
    no reply has a key the schema does not declare or a line break; the lenient form (the request's
    extension field, as OpenAI's clients send it in extra_body) lets it write both."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}   # no additionalProperties, as pydantic writes it

    def ask(seed, **extra):
        return lambda: client.chat.completions.create(
            model=model, messages=ASK, max_tokens=40, temperature=1, seed=seed,
            response_format=schema_format("n", schema), **extra).choices[0].message.content

    closed = together(*[ask(seed) for seed in range(4)])
    lenient = together(*[ask(seed, extra_body={"json_schema_mode": "lenient"}) for seed in range(4)])
    for text in closed:
        assert set(json.loads(text)) == {"n"} and "\n" not in text, text
    assert any("\n" in text or not text.startswith('{"n"') for text in lenient), lenient


def test_harmless_fields_accepted(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=1, user="u1", store=False,
                                       metadata={"k": "v"}, service_tier="auto")
    assert r.choices[0].finish_reason == "length"


BAD = [
    ("/v1/chat/completions", {"response_format": schema_format("x", {"type": "nonsense"})}, "response_format"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "(["}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs"),   # the library's regex
    ("/v1/completions", {"structured_outputs": {"json": {"not": {"type": "string"}}}}, "structured_outputs"),
    ("/v1/chat/completions", {"response_format": schema_format("x", {"type": "string", "format": "uri-reference"})},
     "response_format"),
    ("/v1/chat/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
                              "guided_regex": "[0-9]+"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "12"}]}, "messages"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"logit_bias": {"50": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"suffix": " the end"}, "suffix"),
    ("/v1/completions", {"best_of": 3, "n": 2}, "best_of"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"frobnicate": True}, "frobnicate"),
    ("/v1/chat/completions", {"json_schema_mode": "lenient"}, "json_schema_mode"),              # nothing to read
    ("/v1/completions", {"guided_regex": "a+", "json_schema_mode": "closed"}, "json_schema_mode"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "json_schema_mode": "loose"},
     "json_schema_mode"),
]


@pytest.mark.parametrize("route, extra, param", BAD, ids=[p for _, _, p in BAD])
def test_bad_requests_get_400_naming_the_field(server, route, extra, param):
    body = {"max_tokens": 4, **({"messages": ASK} if "chat" in route else {"prompt": "Hi"}), **extra}
    r = httpx.post(server[1] + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error


# Each check of a constraint, sent through each field a constraint comes from: the server's refusal is the
# SDK's (one place checks a constraint: SamplingParams), named by that field.
BAD_CONSTRAINTS = [
    ("structured_outputs", {"structured_outputs": {"regex": "(["}}, StructuredOutputs(regex="([")),
    ("structured_outputs", {"structured_outputs": {"choice": []}}, StructuredOutputs(choice=[])),
    ("structured_outputs", {"structured_outputs": {"grammar": "  "}}, StructuredOutputs(grammar="  ")),
    ("structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     StructuredOutputs(regex="a", choice=["a"])),
    ("guided_json", {"guided_json": "{not json"}, StructuredOutputs(json="{not json")),
    ("response_format", {"response_format": schema_format("x", {"type": "nonsense"})},
     StructuredOutputs(json={"type": "nonsense"})),
    ("guided_regex", {"guided_regex": "a(b"}, StructuredOutputs(regex="a(b")),
]


@pytest.mark.parametrize("param, extra, constraint", BAD_CONSTRAINTS, ids=[f"{p}-{i}" for i, (p, _, _) in
                                                                            enumerate(BAD_CONSTRAINTS)])
def test_a_bad_constraint_is_refused_in_the_sdks_words_naming_its_field(server, param, extra, constraint):
    with pytest.raises(RequestError) as sdk:
        SamplingParams(structured_outputs=constraint)
    r = httpx.post(server[1] + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": f"{param}: {sdk.value}", "type": "invalid_request_error",
                                 "param": param, "code": None}


def test_server_goes_on_after_bad_requests(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"


# logit_bias is checked where the SDK's is: its keys and range as its SamplingParams are made, its ids against
# the vocabulary as the engine takes the request (executor/prompt_checks.py). The protocol model holds no check
# of its own, so each body below is refused by that one place alone, in the SDK's words.
BAD_BIAS = [{"50": 101.5}, {"7": -100.25}, {"x": 1.0}, {"-3": 1.0}, "vocabulary", "vocabulary+1"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("bias", BAD_BIAS, ids=[str(b) for b in BAD_BIAS])
def test_a_bad_logit_bias_is_refused_in_the_sdks_words(server, route, bias):
    engine = server[0]
    if isinstance(bias, str):   # the first id past the vocabulary, and one further
        bias = {str(engine.vocab_size + bias.count("+1")): 1.0}
    with pytest.raises(RequestError) as sdk:
        engine.generate("Hi", SamplingParams(max_tokens=4, logit_bias=bias))
    body = {"max_tokens": 4, "logit_bias": bias, **({"messages": ASK} if "chat" in route else {"prompt": "Hi"})}
    r = httpx.post(server[1] + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": str(sdk.value), "type": "invalid_request_error", "param": "logit_bias",
                                 "code": None}


def test_the_last_id_of_the_vocabulary_takes_a_bias(server):
    """The other side of the vocabulary's bound: its last id is biased (greedily drawn), not refused."""
    engine, base = server
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "temperature": 0,
                                                   "logit_bias": {str(engine.vocab_size - 1): 100}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == engine.tokenizer.decode([engine.vocab_size - 1])


# tool_choice is checked against tools where the SDK's chat() checks it (ToolSetup.of): the chat body holds no
# check of its own, so each of these is refused by that one place, in the SDK's words.
BAD_TOOL_CHOICES = [(TOOLS, {"type": "function", "function": {"name": "nope"}}), (None, "required"), (None, "auto"),
                    (None, {"type": "function", "function": {"name": "add"}})]


@pytest.mark.parametrize("tools, choice", BAD_TOOL_CHOICES, ids=["unknown-name", "required-alone", "auto-alone",
                                                                 "named-alone"])
def test_a_bad_tool_choice_is_refused_in_the_sdks_words(server, tools, choice):
    with pytest.raises(RequestError) as sdk:
        server[0].chat(ASK, tools=tools, tool_choice=choice)
    r = httpx.post(server[1] + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "tool_choice": choice,
                                                             **({"tools": tools} if tools else {})}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": str(sdk.value), "type": "invalid_request_error", "param": "tool_choice",
                                 "code": None}


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}


@pytest.mark.parametrize("last", [{"role": "user", "content": "Go on."},
                                  {"role": "assistant", "content": "", "tool_calls": [CALL]}], ids=["user", "calls"])
def test_a_final_message_that_cannot_be_continued_is_refused_in_the_sdks_words(server, last):
    """Which final message a reply can continue is the prompt encoder's to say (the chat body holds no check of
    its own): the server's 400 is the SDK's refusal, named by the body's field."""
    messages = [{"role": "user", "content": "Count."}, last]
    with pytest.raises(RequestError) as sdk:
        server[0].encode_chat(messages, TOOLS, continue_final=True)
    r = httpx.post(server[1] + "/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 4,
                                                             "continue_final_message": True}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": str(sdk.value), "type": "invalid_request_error",
                                 "param": "continue_final_message", "code": None}
