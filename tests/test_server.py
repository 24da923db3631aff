"""The OpenAI-compatible server, driven by the real `openai` client over 127.0.0.1."""
from __future__ import annotations

import itertools
import math
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.server.app import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_model_len=256))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    yield engine, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


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


def test_seeded_sampling_is_reproducible(client, model_id):
    kw = dict(model=model_id, prompt="My favourite colour is", max_tokens=10, temperature=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize("bad, fragment", [
    ({"prompt": "word " * 400}, "max_model_len"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": ""}, "empty"),
    ({"logprobs": 21}, "logprobs"),
])
def test_errors_are_400_and_server_keeps_serving(client, model_id, bad, fragment):
    kw = {"model": model_id, "prompt": "Hello", "max_tokens": 4, **bad}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw)
    assert e.value.status_code == 400 and fragment in e.value.body["message"]
    ok = client.completions.create(model=model_id, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


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


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_400(client, model_id, n):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="Hello", max_tokens=2, n=n)
    assert "n must be between 1 and 16" in e.value.body["message"]


def test_stream_error_is_400_not_broken_stream(client, model_id):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                       temperature=-2, stream=True)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)


def test_malformed_body_is_400(server):
    r = httpx.post(server[1] + "/v1/chat/completions", json={"messages": "not a list"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
