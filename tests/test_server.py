"""The OpenAI-compatible server, driven by the real `openai` client over 127.0.0.1."""
from __future__ import annotations

import contextlib
import itertools
import math
import socket
import threading
import time
from typing import Iterator

import httpx
import openai
import pytest
import uvicorn

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.server.app import ServerOptions, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(engine: BieEngine, options: ServerOptions | None = None) -> Iterator[str]:
    """The app on a real uvicorn server on 127.0.0.1, in a thread; yields its base URL."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine, options), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tiny_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=256))
    with serving(engine) as base:
        yield engine, base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def test_health_and_models(server, client):
    assert httpx.get(server[1] + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [server[0].model_name]


def test_completion_matches_sdk(server, client, model_id):
    engine = server[0]
    prompt = "The capital of France is"
    want = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12))
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_non_stream(client, model_id):
    kw = dict(model=model_id, prompt="Once upon a time", max_tokens=16, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16


def test_raw_sse_ends_with_done(server, model_id):
    with httpx.stream("POST", server[1] + "/v1/completions", timeout=60,
                      json={"model": model_id, "prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]" and len(lines) >= 4


def test_chat(client, model_id):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=20, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content and r.usage.completion_tokens > 0
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


@pytest.mark.parametrize("tiny", [{"temperature": 1e-300}, {"top_p": 1e-300}])
def test_a_tiny_temperature_or_top_p_is_greedy(client, model_id, tiny):
    """Both once turned the distribution into NaN, a 500 (found by the fuzz): 1e-300 as a divisor
    overflows the logits, and as top_p it rounds to 0 in float32, which dropped every token."""
    kw = dict(model=model_id, prompt="The capital of France is", max_tokens=6)
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    assert client.completions.create(seed=1, **kw, **tiny).choices[0].text == greedy


def test_seeded_sampling_is_reproducible(client, model_id):
    kw = dict(model=model_id, prompt="My favourite colour is", max_tokens=10, temperature=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


CONTEXT = ("the prompt has 401 tokens but this model's maximum context length is 256 tokens (max_model_len; "
           "prompt plus at least one generated token must fit); shorten the prompt or rebuild with a larger "
           "--max-model-len.")


@pytest.mark.parametrize("bad, message, param", [
    ({"prompt": "word " * 400}, CONTEXT, "prompt"),
    ({"max_tokens": "4"}, "max_tokens: input should be a valid integer (got '4')", "max_tokens"),
    ({"max_tokens": True}, "max_tokens: input should be a valid integer (got True)", "max_tokens"),
    ({"max_tokens": 0}, "max_tokens: input should be greater than or equal to 1", "max_tokens"),
    ({"temperature": -1}, "temperature: input should be greater than or equal to 0", "temperature"),
    ({"temperature": 2.5}, "temperature: input should be less than or equal to 2", "temperature"),
    ({"temperature": "0.5"}, "temperature: input should be a valid number", "temperature"),
    ({"top_p": 1.5}, "top_p: input should be less than or equal to 1", "top_p"),
    ({"prompt": ""}, "the prompt is empty", "prompt"),
    ({"prompt": []}, "prompt must not be empty", "prompt"),
    ({"prompt": ["Hi", ""]}, "prompt[1] is empty; send at least one token.", "prompt"),
    ({"prompt": [[1, 2], [1, 10 ** 6]]}, "prompt[1]: prompt token id 1000000 is outside the vocabulary", "prompt"),
    ({"prompt": ["Hello", 3]}, "prompt must be a string, a list of strings", "prompt"),
    ({"prompt": [1, 10 ** 6]}, "prompt token id 1000000 is outside the vocabulary [0, ", "prompt"),
    ({"logprobs": 21}, "logprobs: input should be less than or equal to 20", "logprobs"),
    ({"n": 0}, "n: input should be greater than or equal to 1", "n"),
    ({"repetition_penalty": 1e-30}, "repetition_penalty: input should be greater than or equal to 0.01",
     "repetition_penalty"),
    ({"n": 17}, "n: input should be less than or equal to 16", "n"),
    ({"stop": [1]}, "stop must be a string or a list of strings", "stop"),
    ({"seed": 2 ** 70}, "seed: input should be less than or equal to", "seed"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage: input should be a valid boolean",
     "stream_options.include_usage"),
])
def test_completion_errors_name_the_problem_and_param(client, model_id, bad, message, param):
    kw = {"model": model_id, "prompt": "Hello", "max_tokens": 4, **bad}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{k: v for k, v in kw.items() if k in ("model", "prompt")},
                                  extra_body={k: v for k, v in kw.items() if k not in ("model", "prompt")})
    assert e.value.status_code == 400
    assert message in e.value.body["message"] and e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"
    ok = client.completions.create(model=model_id, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


@pytest.mark.parametrize("messages, message, param", [
    ([{"role": "robot", "content": "hi"}], "messages[0].role: input should be 'system', 'developer', 'user', "
                                           "'assistant' or 'tool' (got 'robot')", "messages[0].role"),
    ([{"role": "user"}], "messages[0].content is required", "messages[0].content"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}],
     "messages[1].content: must not be null in a user message", "messages[1].content"),
    ([{"role": "system", "content": None}], "must not be null in a system message", "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content: image_url parts are not supported: this server reads text only", "messages[0].content"),
    ([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}],
     "messages[0].content must be a string or a list of text parts", "messages[0].content"),
    ([], "messages: list should have at least 1 item", "messages"),
    ("hello", "messages: input should be a valid list", "messages"),
    ([{"role": "user", "content": "word " * 300}], "this model's maximum context length is 256 tokens",
     "messages"),
])
def test_chat_errors_name_the_problem_and_param(server, model_id, messages, message, param):
    r = httpx.post(server[1] + "/v1/chat/completions", json={"model": model_id, "messages": messages,
                                                            "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_assistant_content_may_be_null(server, model_id):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]
    r = httpx.post(server[1] + "/v1/chat/completions", timeout=120,
                   json={"model": model_id, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("method, path, body, status, fragment", [
    ("GET", "/v1/nothing", None, 404, "no route GET /v1/nothing"),
    ("GET", "/v1/completions", None, 405, "GET is not allowed on /v1/completions"),
    ("POST", "/v1/completions", b'{"prompt": "Hi", ', 400, "the request body is not valid JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "the request body must be a JSON object"),
    ("POST", "/v1/completions", b"", 400, "the request body must be a JSON object"),
    ("POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": NaN}', 400, "max_tokens"),
    ("POST", "/v1/completions", b'{"prompt": "Hi", "temperature": Infinity}', 400, "temperature"),
])
def test_every_error_has_the_openai_shape(server, method, path, body, status, fragment):
    r = httpx.request(method, server[1] + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert fragment in r.json()["error"]["message"]


def test_two_prompts_get_a_choice_each(server, client, model_id):
    """A list of prompts is a batch: one choice per prompt (times n), in order, as if sent one by one."""
    engine, prompts = server[0], ["The capital of France is", "Once upon a time"]
    r = client.completions.create(model=model_id, prompt=prompts, max_tokens=6, temperature=0)
    alone = [engine.generate(p, SamplingParams(temperature=0, max_tokens=6)) for p in prompts]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [a.text for a in alone]
    assert r.usage.prompt_tokens == sum(len(a.prompt_token_ids) for a in alone)
    assert r.usage.completion_tokens == sum(len(a.token_ids) for a in alone)
    # token-id prompts, with n = 2: choice 2p + j is prompt p's j-th sample
    ids = [a.prompt_token_ids for a in alone]
    texts = ["", "", "", ""]
    for chunk in client.completions.create(model=model_id, prompt=ids, max_tokens=6, temperature=0, n=2,
                                           stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [alone[0].text, alone[0].text, alone[1].text, alone[1].text]


def test_completion_logprobs(server, client, model_id):
    engine = server[0]
    prompt, kw = "The capital of France is", {"max_tokens": 6, "temperature": 0}
    want = engine.generate(prompt, SamplingParams(logprobs=3, **kw))
    lp = client.completions.create(model=model_id, prompt=prompt, logprobs=3, **kw).choices[0].logprobs
    assert lp.tokens == [engine.tokenizer.decode([t]) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(want.token_ids, want.logprobs)], abs=1e-6)
    for top, sampled in zip(lp.top_logprobs, lp.token_logprobs):
        assert len(top) == 3 and sampled <= 0
        assert max(top.values()) == pytest.approx(sampled)   # greedy: the sampled token is the likeliest
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
    assert lp.text_offset == list(itertools.accumulate([len(t) for t in lp.tokens[:-1]], initial=0))
    # streamed: the same tokens and numbers chunk by chunk, offsets running on across chunks
    parts = [c.choices[0].logprobs for c in client.completions.create(model=model_id, prompt=prompt, logprobs=3,
                                                                      stream=True, **kw) if c.choices]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset
    assert sum((p.token_logprobs for p in parts), []) == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs(client, model_id):
    kw = {"model": model_id, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5,
          "temperature": 0, "logprobs": True, "top_logprobs": 2}
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(content) == 5
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob)   # greedy
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kw) if chunk.choices
                and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{**kw, "logprobs": False})
    assert "top_logprobs" in e.value.body["message"]


def test_n_choices_are_seeded_requests(server, client, model_id):
    engine = server[0]
    prompt, kw = "Once upon a time", {"max_tokens": 8, "temperature": 1.0}
    r = client.completions.create(model=model_id, prompt=prompt, n=3, seed=5, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    # choice i is the request with seed 5 + i: reproducible, and not three copies of one sample
    alone = [engine.generate(prompt, SamplingParams(seed=5 + i, **kw)) for i in range(3)]
    assert [c.text for c in r.choices] == [a.text for a in alone]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == len(alone[0].prompt_token_ids)
    assert r.usage.completion_tokens == sum(len(a.token_ids) for a in alone)
    # streamed: each choice's deltas, interleaved, rebuild the same texts
    texts = ["", "", ""]
    for chunk in client.completions.create(model=model_id, prompt=prompt, n=3, seed=5, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]


def test_n_chat_choices_stream_with_a_role_each(client, model_id):
    kw = {"model": model_id, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
          "temperature": 0, "n": 2}
    body = client.chat.completions.create(**kw)
    assert [c.index for c in body.choices] == [0, 1]
    assert body.choices[0].message.content == body.choices[1].message.content   # greedy: the same
    roles, texts = [0, 0], ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            roles[c.index] += c.delta.role == "assistant"
            texts[c.index] += c.delta.content or ""
    assert roles == [1, 1] and texts == [c.message.content for c in body.choices]


def test_stream_error_is_400_not_broken_stream(client, model_id):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                       temperature=-2, stream=True)


def test_any_model_name_is_answered_by_the_one_engine(server, client):
    """Agents send their own names (llama3.1:8b, claude-3-5-haiku-...): a one-engine server answers each with
    its engine, as llama-server does, and the reply's model says which engine answered."""
    for name in ("no-such-model", "llama3.1:8b"):
        r = client.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert r.model == server[0].model_name


def test_api_key_is_required_on_v1_routes_only(server, model_id):
    with serving(server[0], ServerOptions(api_key="s3cret-key")) as base:
        for headers in ({}, {"Authorization": "Bearer s3cret-kez"}, {"Authorization": "Basic s3cret-key"},
                        {"Authorization": "Bearer s3cret-key-and-more"}):
            r = httpx.post(base + "/v1/completions", headers=headers, json={"prompt": "Hi", "max_tokens": 1})
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key" and "--api-key" in r.json()["error"]["message"]
        # a bad body without the key is still 401: nothing is read before the key is checked
        assert httpx.post(base + "/v1/completions", content=b"{").status_code == 401
        assert httpx.get(base + "/health").status_code == 200 and httpx.get(base + "/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=base + "/v1", api_key="s3cret-key", max_retries=0)
        assert client.completions.create(model=model_id, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
