"""Server defaults on a small context: chat's max_tokens default, requests that end exactly at the
context's end, the /v1/models timestamp."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from bie_trt import BieEngine, EngineConfig
from test_server import serving

CONTEXT = 64   # small, so that a reply running to the end of the context takes seconds


@pytest.fixture(scope="module")
def small(smollm2_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_model_len=CONTEXT))
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
    with pytest.raises(openai.BadRequestError, match="maximum context length is 64 tokens"):
        client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=CONTEXT - prompt_tokens + 1)


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
