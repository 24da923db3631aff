"""Server defaults on a small context: chat's max_tokens default, requests that end exactly at the
context's end, max_tokens past the context clamped on every route, the /v1/models timestamp."""
from __future__ import annotations

import time

import anyio
import httpx
import openai
import pytest

from bie_trt import BieEngine, EngineConfig
from test_server import serving

CONTEXT = 64   # small, so that a reply running to the end of the context takes seconds


@pytest.fixture(scope="module")
def small(tiny_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=CONTEXT))
    with serving(engine) as base:
        yield engine, base, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(small):
    engine, _, client = small
    messages = [{"role": "user", "content": "Count from one to fifty."}]
    prompt_tokens = len(engine.encode(messages, chat=True))
    assert CONTEXT - prompt_tokens > 16   # otherwise the old 16-token default would pass too
    r = client.chat.completions.create(model=engine.model_name, messages=messages, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == CONTEXT - prompt_tokens and r.choices[0].finish_reason == "length"


def test_completions_keep_16_tokens_and_accept_a_request_ending_exactly_at_the_context(small):
    engine, _, client = small
    prompt = "The capital of France is"
    prompt_tokens = len(engine.encode(prompt))
    r = client.completions.create(model=engine.model_name, prompt=prompt, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    exact = client.completions.create(model=engine.model_name, prompt=prompt, temperature=0,
                                      max_tokens=CONTEXT - prompt_tokens, extra_body={"ignore_eos": True})
    assert exact.usage.completion_tokens == CONTEXT - prompt_tokens
    # past the context: clamped to what the context leaves, and the reply that reaches it ends as length
    past = client.completions.create(model=engine.model_name, prompt=prompt, temperature=0, max_tokens=32000,
                                     extra_body={"ignore_eos": True})
    assert (past.choices[0].text, past.choices[0].finish_reason) == (exact.choices[0].text, "length")


@pytest.mark.slow
def test_completions_with_max_tokens_null_fill_the_context(small):
    engine, base, _ = small
    prompt = "Once upon a time"
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": None, "temperature": 0,
                                                   "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == CONTEXT


def test_models_lists_when_the_server_started(small):
    before = int(time.time())
    created = httpx.get(small[1] + "/v1/models").json()["data"][0]["created"]
    assert before - 3600 < created <= before


LIMIT = 2**20 + 64 * CONTEXT   # the default --max-request-bytes for this context


def chunked(body: bytes):
    """The body as a generator: httpx sends it chunked, without Content-Length, so it is counted as it arrives."""
    for i in range(0, len(body), 65536):
        yield body[i:i + 65536]


def test_a_body_above_the_limit_is_refused_with_413_before_it_is_read(small):
    limit = LIMIT
    body = b'{"prompt": "' + b"word " * (limit // 5) + b'", "max_tokens": 1}'
    r = httpx.post(small[1] + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413, r.text
    assert f"above this server's --max-request-bytes {limit:,}" in r.json()["error"]["message"]

    r = httpx.post(small[1] + "/v1/completions", content=chunked(body), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413, r.text
    just_under = b'{"prompt": "Hi", "max_tokens": 1, "user": "' + b"x" * (limit - 100) + b'"}'
    assert len(just_under) <= limit
    assert httpx.post(small[1] + "/v1/completions", content=just_under,
                      headers={"content-type": "application/json"}, timeout=60).status_code == 200


def test_a_body_of_exactly_the_limit_is_served_and_one_byte_more_is_413(small):
    head = b'{"prompt": "Hi", "max_tokens": 1, "user": "'
    for size, status in ((LIMIT, 200), (LIMIT + 1, 413)):
        body = head + b"x" * (size - len(head) - 2) + b'"}'
        assert len(body) == size
        for content in (chunked(body), body):   # counted as it arrives, and declared by Content-Length
            r = httpx.post(small[1] + "/v1/completions", content=content,
                           headers={"content-type": "application/json"}, timeout=60)
            assert r.status_code == status, (size, type(content).__name__, r.text[:200])

LONG = [{"role": "user", "content": "abc " * 5_000}]   # 20,000 characters: far past 64 tokens however cut


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": LONG[0]["content"]}),
    ("/v1/chat/completions", {"messages": LONG}),
    ("/v1/messages", {"messages": LONG, "max_tokens": 8}),
    ("/v1/responses", {"input": LONG}),
])
def test_every_route_meets_the_one_context_check_on_token_ids(small, path, body):
    """The context is measured in one place, the engine's, on the prompt's token ids: every route refuses
    with its words and its token count (no route counts characters, or words its own message)."""
    engine, base, _ = small
    tokens = len(engine.encode(body["prompt"]) if "prompt" in body else engine.encode(LONG, chat=True))
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == (f"the prompt has {tokens} tokens but this model's maximum context length is "
                                f"{CONTEXT} tokens (max_model_len; prompt plus at least one generated token must "
                                f"fit); shorten the prompt or rebuild with a larger --max-model-len."), error
    if path != "/v1/messages":   # Anthropic's errors carry no code or param
        assert (error["code"], error["param"]) == ("context_length_exceeded",
                                                   "prompt" if "prompt" in body else "messages")


def test_the_context_check_lets_the_last_token_of_room_through(small):
    """CONTEXT - 1 prompt tokens leave room for one generated token; CONTEXT leave none."""
    _, base, _ = small
    for length, status in ((CONTEXT - 1, 200), (CONTEXT, 400)):
        r = httpx.post(base + "/v1/completions", json={"prompt": [1] * length, "max_tokens": 1}, timeout=60)
        assert r.status_code == status, (length, r.text)
    batch = httpx.post(base + "/v1/completions", json={"prompt": [[1, 2], [1] * CONTEXT], "max_tokens": 1})
    assert batch.json()["error"]["message"].startswith(f"prompt[1]: the prompt has {CONTEXT} tokens"), batch.text


AGENT_ASK = [{"role": "user", "content": "Refactor this repository."}]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["Hi", "Hello"], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": AGENT_ASK, "max_tokens": 1}),
    ("/v1/messages", {"messages": AGENT_ASK, "max_tokens": 1}),
    ("/v1/responses", {"input": AGENT_ASK, "max_output_tokens": 1}),
    ("/v1/chat/completions", {"messages": AGENT_ASK, "max_tokens": 1, "stream": True}),
    ("/v1/messages/count_tokens", {"messages": AGENT_ASK}),
])
def test_a_request_takes_one_thread_hop_before_the_engine(small, monkeypatch, path, body):
    """Encoding (the chat template), the sampling parameters, the grammar and the start run together in
    one worker thread: each hop off the event loop is a wait in a queue of threads under load."""
    _, base, _ = small
    hops = []
    real = anyio.to_thread.run_sync

    def counted(fn, *args, **kwargs):
        hops.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(hops) == 1, hops


@pytest.mark.parametrize("route", ["chat", "messages", "responses"])
def test_max_tokens_past_the_context_is_clamped_on_every_route(small, route):
    """Claude Code and OpenCode send max_tokens 32000 on every turn, meaning "as long as you can": the reply
    runs to the end of the context and ends as each API says so (length, max_tokens, incomplete)."""
    engine, base, _ = small
    prompt_tokens = len(engine.encode(AGENT_ASK, chat=True))
    ask = {"chat": ("/v1/chat/completions", {"messages": AGENT_ASK, "max_tokens": 32000, "ignore_eos": True}),
           "messages": ("/v1/messages", {"messages": AGENT_ASK, "max_tokens": 32000}),
           "responses": ("/v1/responses", {"input": AGENT_ASK, "max_output_tokens": 32000})}
    path, body = ask[route]
    r = httpx.post(base + path, json={"model": "claude-sonnet-4-5-20250929", "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    reply = r.json()
    if route == "chat":
        generated, ended = reply["usage"]["completion_tokens"], reply["choices"][0]["finish_reason"] == "length"
    elif route == "messages":
        generated, ended = reply["usage"]["output_tokens"], reply["stop_reason"] == "max_tokens"
    else:
        generated = reply["usage"]["output_tokens"]
        ended = (reply["status"], reply["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert generated == CONTEXT - prompt_tokens and ended
    assert reply["model"] == engine.model_name   # any name is answered by the one engine, which says so


def test_a_prompt_that_fills_the_context_alone_is_still_refused(small):
    engine, base, _ = small
    r = httpx.post(base + "/v1/messages", json={"model": "claude-3-5-haiku-20241022", "max_tokens": 32000,
                                                "messages": [{"role": "user", "content": "word " * 70}]})
    assert r.status_code == 400 and "maximum context length is 64 tokens" in r.json()["error"]["message"], r.text
