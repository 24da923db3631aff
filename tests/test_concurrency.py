"""Many requests on one engine loop: batched greedy outputs equal one-at-a-time ones (prefill chunks
interleaved with decodes, FP16 and INT4 KV), a pool far too small still completes every request over
HTTP (by preempting), and a client that disconnects, mid-stream or before a non-streamed reply,
gives its blocks back at once."""
from __future__ import annotations

import gc
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from bie_trt import BieEngine, EngineConfig, EngineError, SamplingParams
from bie_trt.server.app import create_app
from test_server import free_port

SYSTEM = ("You are a helpful assistant. Answer briefly, precisely and in plain English; if you do not know, say "
          "so, and never make up facts, names or numbers. Keep every answer under fifty words. ")
PROMPTS = [SYSTEM + "What is the capital of France?", "Once upon a time",
           SYSTEM + "Name three colours of the rainbow, then say why the sky is blue.", "1, 2, 3, 4, 5,"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("kv", [{}, {"kv_cache_dtype": "int4_asym", "kv_window": 16, "kv_group_size": 32}], ids=["fp16", "int4"])
def test_batched_greedy_equals_one_at_a_time(tiny_engine, kv):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=256,
                                    chunked_prefill_size=16, **kv))
    steps = []
    execute = engine.core.runner.execute
    engine.core.runner.execute = lambda batch, drafts=None: (steps.append([n for _, n in batch.chunks])
                                                        or execute(batch, drafts))
    together = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert any(1 in s and max(s) > 1 for s in steps)     # prompt chunks ran in the same steps as decodes
    assert max(len(s) for s in steps) == len(PROMPTS)
    alone = [engine.generate(p, GREEDY).token_ids for p in PROMPTS]
    assert together == alone
    if kv:   # blocks left the window and were quantised (and are kept for the prefix cache)
        assert engine.stats().kv_blocks["quant"]["cached"] > 0


def wait_until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=128))


def test_a_dropped_stream_is_aborted(engine):
    aborted = engine.stats().requests.get("abort", 0)
    stream = engine.stream("Tell me a long story", SamplingParams(max_tokens=100, ignore_eos=True))
    next(stream)
    del stream   # never closed: the finaliser aborts it
    gc.collect()
    wait_until(lambda: engine.stats().kv_blocks["fp16"]["used"] == 0, "the dropped stream still holds blocks")
    assert engine.stats().requests["abort"] == aborted + 1


def test_an_engine_error_reaches_every_stream_and_the_engine_recovers(engine, monkeypatch):
    def broken(inputs, quantise=()):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine.core.runner, "forward", broken)
    streams = [engine.stream(p, SamplingParams(max_tokens=4)) for p in ("Hi", "Hello there")]
    for stream in streams:
        with pytest.raises(RuntimeError, match="kernel exploded"):
            next(stream)
    assert engine.stats().kv_blocks["fp16"]["used"] == 0
    monkeypatch.undo()
    assert engine.generate("Hi", SamplingParams(max_tokens=2)).usage.completion_tokens == 2


def test_a_pool_too_small_for_one_sequence_is_refused(tiny_engine):
    with pytest.raises(EngineError, match="num_kv_blocks"):
        BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=64, num_kv_blocks=3))


def metric(base: str, name: str, **labels: str) -> float:
    text = httpx.get(base + "/metrics").text
    where = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    match = re.search(rf"^{re.escape(name + where)} (\S+)$", text, re.M)
    assert match, f"{name}{where} not in /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def small_pool_server(tiny_engine):
    """Six 16-token blocks: one 64-token sequence fits, four at once do not."""
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=64,
                                    num_kv_blocks=6, chunked_prefill_size=16))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_until(lambda: srv.started, "server did not start")
    yield engine, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.mark.slow
def test_a_pool_far_too_small_still_completes_every_request(small_pool_server):
    engine, base = small_pool_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    prompts = ["The capital of France is", "Once upon a time", "My favourite food is", "The weather today"]

    def complete(prompt: str):
        return client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(complete, prompts))
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 24 for r in results)
    assert metric(base, "bie_num_preemptions_total") > 0
    assert metric(base, "bie_request_success_total", finished_reason="length") >= len(prompts)
    assert metric(base, "bie_kv_blocks", pool="fp16", state="used") == 0
    # preempted requests were recomputed, not corrupted: the same text as each run alone
    alone = [engine.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)).text for p in prompts]
    assert [r.choices[0].text for r in results] == alone


def test_metrics_parse_as_prometheus_text(small_pool_server):
    parser = pytest.importorskip("prometheus_client.parser")
    r = httpx.get(small_pool_server[1] + "/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in parser.text_string_to_metric_families(r.text)}
    assert families["bie_time_to_first_token_seconds"].type == "histogram"
    assert families["bie_inter_token_latency_seconds"].type == "histogram"
    assert {"bie_request_success", "bie_prompt_tokens", "bie_generation_tokens", "bie_num_preemptions",
            "bie_kv_blocks", "bie_prefix_cache_queries", "bie_prefix_cache_hits",
            "bie_prefix_cache_hit_rate"} <= set(families)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(small_pool_server):
    engine, base = small_pool_server
    used, aborted = (metric(base, "bie_kv_blocks", pool="fp16", state="used"),
                     metric(base, "bie_request_success_total", finished_reason="abort"))
    body = {"model": engine.model_name, "prompt": "Tell me a long story", "max_tokens": 50, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            while not next(lines).startswith("data: "):
                pass
        assert metric(base, "bie_kv_blocks", pool="fp16", state="used") > used
    # leaving the block closes the connection mid-stream
    wait_until(lambda: metric(base, "bie_kv_blocks", pool="fp16", state="used") == used,
               "the disconnected request still holds KV blocks")
    assert metric(base, "bie_request_success_total", finished_reason="abort") == aborted + 1


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_that_leaves_a_non_streamed_request_frees_its_blocks(small_pool_server, n):
    """Nothing is sent before the end of a non-streamed reply, so the server must notice the closed
    connection itself: the request (each of its n choices) is aborted, not generated for nobody."""
    engine, base = small_pool_server
    used, aborted = (metric(base, "bie_kv_blocks", pool="fp16", state="used"),
                     metric(base, "bie_request_success_total", finished_reason="abort"))
    body = json.dumps({"model": engine.model_name, "prompt": "Tell me a long story", "max_tokens": 50,
                       "ignore_eos": True, "n": n}).encode()
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:   # a client we can hang up on mid-request
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: metric(base, "bie_kv_blocks", pool="fp16", state="used") > used, "the request never ran")
    wait_until(lambda: metric(base, "bie_kv_blocks", pool="fp16", state="used") == used,
               "the abandoned request still holds KV blocks")
    assert metric(base, "bie_request_success_total", finished_reason="abort") == aborted + n
