"""The server under pressure, over real HTTP on 127.0.0.1: a bounded waiting queue (503 + Retry-After),
a per-request timeout (408), a fault inside the engine's step that fails only that step's request,
/metrics through prometheus_client, and a graceful stop on SIGTERM in a real `bie-trt serve` process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.executor.outputs import EngineStats
from bie_trt.server.app import ServerOptions
from bie_trt.server.metrics import CONTENT_TYPE, Metrics
from test_concurrency import wait_until
from test_server import free_port, serving

LONG = {"prompt": "Tell me a long story", "max_tokens": 1000, "ignore_eos": True}   # longer than any test waits


@pytest.fixture(scope="module")
def engine(tiny_engine):
    """One sequence at a time: a second request is certain to wait."""
    return BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=1024, max_num_seqs=1))


def test_a_full_queue_answers_503_with_retry_after(engine):
    with (serving(engine, ServerOptions(max_waiting=1)) as base, httpx.Client(timeout=120) as http,
          ThreadPoolExecutor(1) as pool):
        with http.stream("POST", base + "/v1/completions", json={**LONG, "stream": True}) as running:
            lines = running.iter_lines()   # kept: dropping the iterator would close the connection
            next(lines)   # the first request holds the only running slot
            waiting = pool.submit(http.post, base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            wait_until(lambda: engine.stats().waiting == 1, "the second request never queued")
            full = http.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert full.status_code == 503 and full.headers["Retry-After"] == "1"
            assert "the server is full (2 requests in flight, at most 2)" in full.json()["error"]["message"]
            assert full.json()["error"]["type"] == "overloaded_error"
            # n=2 needs two places: refused whole, not half-admitted
            assert http.post(base + "/v1/completions", json={"prompt": "Hi", "n": 2}).status_code == 503
        # the stream closed (the client left): its place is free, the waiting request runs
        assert waiting.result().status_code == 200
        wait_until(lambda: engine.stats().kv_blocks["fp16"]["used"] == 0, "blocks still held")
        assert http.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_request_past_its_timeout_is_aborted_with_408(engine):
    aborted = engine.stats().requests.get("abort", 0)
    with serving(engine, ServerOptions(request_timeout=1.0)) as base, httpx.Client(timeout=120) as http:
        r = http.post(base + "/v1/completions", json=LONG)
        assert r.status_code == 408, r.text
        assert "--request-timeout of 1.0 s" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "timeout_error"
        # streamed: the status is sent already, so the error arrives as the last event before [DONE]
        with http.stream("POST", base + "/v1/completions", json={**LONG, "stream": True}) as s:
            events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "timeout_error"
        wait_until(lambda: engine.stats().kv_blocks["fp16"]["used"] == 0, "timed-out requests still hold blocks")
        assert engine.stats().requests["abort"] == aborted + 2
        assert http.get(base + "/v1/models").status_code == 200   # (a generation may exceed 1 s on a busy CPU)


POISON = [28, 28, 28, 28, 28, 28, 28, 28]   # a prompt no other request sends


def test_a_fault_in_a_step_fails_only_that_steps_request(engine, monkeypatch):
    """Request A's decode step raises inside the engine once B waits for the slot A holds: A gets a 500
    with an OpenAI error body, B is served in full and equals a run alone, every block comes back."""
    forward, poisoned = engine.core.runner.forward, set()

    def faulty(inputs, quantise=()):
        for seq_input in inputs:
            if seq_input.start_pos == 0 and seq_input.token_ids.tolist() == POISON:
                poisoned.add(seq_input.block_table[0])   # A's first block names A in its later steps
            elif poisoned and seq_input.block_table[0] in poisoned and engine.stats().waiting == 1:
                poisoned.clear()   # B is queued behind A (requests join between steps, so never block here)
                raise RuntimeError("injected fault in the forward pass")
        return forward(inputs, quantise)

    monkeypatch.setattr(engine.core.runner, "forward", faulty)
    errors = engine.stats().requests.get("error", 0)
    alone = engine.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    with serving(engine) as base, httpx.Client(timeout=120) as http, ThreadPoolExecutor(2) as pool:
        # A is long enough to still be decoding when B arrives, however fast the model
        a = pool.submit(http.post, base + "/v1/completions", json={"prompt": POISON, "max_tokens": 1000,
                                                                   "ignore_eos": True})
        wait_until(lambda: engine.stats().running == 1, "A never ran")
        b = pool.submit(http.post, base + "/v1/completions",
                        json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        ra, rb = a.result(), b.result()
        assert ra.status_code == 500, ra.text
        assert "injected fault in the forward pass" in ra.json()["error"]["message"]
        assert ra.json()["error"]["type"] == "server_error"
        assert rb.status_code == 200 and rb.json()["choices"][0]["text"] == alone.text
        assert engine.stats().kv_blocks["fp16"]["used"] == 0 and engine.stats().requests["error"] == errors + 1
        families = {f.name: f for f in text_string_to_metric_families(http.get(base + "/metrics").text)}
        reasons = {s.labels["finished_reason"]: s.value for s in families["bie_request_success"].samples
                   if s.name.endswith("_total")}
        assert reasons["error"] == errors + 1
        assert http.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_metrics_export_every_engine_number_under_vllm_names():
    stats = EngineStats(requests={"stop": 3, "length": 2, "error": 1}, prompt_tokens=40, generation_tokens=25,
                        preemptions=4, prefix_queried_tokens=64, prefix_hit_tokens=16,
                        kv_blocks={"fp16": {"used": 3, "cached": 1, "free": 4}, "quant": {"used": 1, "cached": 0,
                                                                                          "free": 7}},
                        running=2, waiting=5,
                        spec_decode={"num_drafts": 6, "num_draft_tokens": 18, "num_accepted_tokens": 11,
                                     "accepted_by_position": [6, 4, 1],
                                     "adaptive": {"gamma_max": 3, "steps_by_gamma": [9, 0, 2, 4], "probes": 2,
                                                  "acceptance": [0.8, 0.5, 0.25],
                                                  "step_costs": {"plain_ms": 20.0, "verify_ms": {"4": 30.0},
                                                                 "draft_step_ms": 5.0, "context": 150,
                                                                 "cost_per_1k_context": 0.4}},
                                     "draft_proposals": {"device": 17, "host": 1}},
                        cuda_graphs={"decode": {"graph": 9, "eager": 1}, "verify": {"graph": 5, "eager": 2}})
    metrics = Metrics(lambda: stats)
    metrics.ttft.observe(0.3)
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert values[("bie_request_success_total", (("finished_reason", "stop"),))] == 3
    assert values[("bie_request_success_total", (("finished_reason", "abort"),))] == 0
    assert values[("bie_request_success_total", (("finished_reason", "error"),))] == 1
    assert values[("bie_prompt_tokens_total", ())] == 40 and values[("bie_generation_tokens_total", ())] == 25
    assert values[("bie_num_preemptions_total", ())] == 4
    assert values[("bie_prefix_cache_queries_total", ())] == 64 and values[("bie_prefix_cache_hits_total", ())] == 16
    assert values[("bie_prefix_cache_hit_rate", ())] == 0.25
    assert values[("bie_num_requests_running", ())] == 2 and values[("bie_num_requests_waiting", ())] == 5
    assert values[("bie_kv_cache_usage_perc", ())] == 4 / 16
    assert values[("bie_kv_blocks", (("pool", "quant"), ("state", "free")))] == 7
    assert values[("bie_spec_decode_num_drafts_total", ())] == 6
    assert values[("bie_spec_decode_num_draft_tokens_total", ())] == 18
    assert values[("bie_spec_decode_num_accepted_tokens_total", ())] == 11
    assert [values[("bie_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
            for i in range(3)] == [6, 4, 1]
    assert {(step, result): values[("bie_cuda_graph_steps_total", (("result", result), ("step", step)))]
            for step in ("decode", "verify") for result in ("graph", "eager")} == {
        ("decode", "graph"): 9, ("decode", "eager"): 1, ("verify", "graph"): 5, ("verify", "eager"): 2}
    # adaptive γ: the γ taken and why (acceptance by position, the step costs weighed)
    assert [values[("bie_spec_decode_gamma_steps_total", (("gamma", str(g)),))] for g in range(4)] == [9, 0, 2, 4]
    assert values[("bie_spec_decode_gamma_probes_total", ())] == 2
    assert values[("bie_spec_decode_acceptance_rate", (("position", "1"),))] == 0.5
    assert values[("bie_spec_decode_step_seconds", (("rows", "1"), ("step", "plain")))] == 0.02
    assert values[("bie_spec_decode_step_seconds", (("rows", "4"), ("step", "verify")))] == 0.03
    assert values[("bie_spec_decode_step_seconds", (("rows", "0"), ("step", "draft_step")))] == 0.005
    assert values[("bie_spec_decode_step_context_tokens", ())] == 150
    assert values[("bie_spec_decode_step_cost_per_1k_context", ())] == 0.4
    assert values[("bie_spec_decode_draft_proposals_total", (("drawn", "host"),))] == 1
    assert values[("bie_time_to_first_token_seconds_count", ())] == 1
    assert values[("bie_time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 1
    assert values[("bie_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 0


def test_metrics_endpoint_parses_and_counts_what_it_served(engine):
    with serving(engine) as base:
        before = httpx.get(base + "/metrics")
        assert before.headers["content-type"] == CONTENT_TYPE
        httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}, timeout=60)
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(base + "/metrics").text)}
    samples = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    old = {s.name: s.value for f in text_string_to_metric_families(before.text) for s in f.samples if not s.labels}
    assert samples["bie_generation_tokens_total"] - old["bie_generation_tokens_total"] == 3
    assert samples["bie_time_to_first_token_seconds_count"] - old["bie_time_to_first_token_seconds_count"] == 1
    assert samples["bie_inter_token_latency_seconds_count"] - old["bie_inter_token_latency_seconds_count"] == 2
    assert samples["bie_e2e_request_latency_seconds_count"] - old["bie_e2e_request_latency_seconds_count"] == 1
    assert {"bie_spec_decode_num_drafts", "bie_spec_decode_num_accepted_tokens_per_pos"} <= set(families)
    assert {s.value for s in families["bie_cuda_graph_steps"].samples} == {0}   # the CPU captures no graphs


def _start_server(engine_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.Popen([sys.executable, "-m", "bie_trt.cli", "serve", str(engine_dir), "--port", str(port),
                             "--device", "cpu", "--max-model-len", "1024", "--log-level", "warning", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _up(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow   # kept out of the default suite's six minutes; CI runs it
def test_sigterm_stops_accepting_aborts_after_the_grace_period_and_exits_0(tiny_engine):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start_server(tiny_engine, port, "--shutdown-timeout", "2", "--served-model-name", "tiny")
    try:
        wait_until(lambda: _up(base) or proc.poll() is not None, "the server never came up", timeout=180)
        assert proc.poll() is None, proc.stdout.read()
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "tiny"
        lines: list[str] = []

        def read_stream() -> None:
            body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 1000, "ignore_eos": True,
                    "stream": True}
            try:
                with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                    lines.extend(line for line in r.iter_lines() if line)
            except httpx.TransportError:
                pass   # cut at the end of the grace period

        reader = threading.Thread(target=read_stream)
        reader.start()
        wait_until(lambda: len(lines) >= 2, "the stream never started", timeout=120)
        stopped = time.time()
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not _up(base), "still accepting after SIGTERM", timeout=5)
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
        took = time.time() - stopped
        reader.join(timeout=30)
        assert 1.5 < took < 20   # waited for the grace period, then aborted the 1000-token stream
        assert lines[-1] != "data: [DONE]" and len(lines) < 1000
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow   # a second server process: a minute of start-up on a busy 2-core machine
def test_sigterm_lets_a_short_request_finish(tiny_engine):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start_server(tiny_engine, port, "--shutdown-timeout", "60")
    try:
        wait_until(lambda: _up(base) or proc.poll() is not None, "the server never came up", timeout=180)
        lines: list[str] = []

        def read_stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=read_stream)
        reader.start()
        wait_until(lambda: len(lines) >= 1, "the stream never started", timeout=120)
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        assert lines[-1] == "data: [DONE]" and len(lines) == 21   # all 20 tokens, then [DONE]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
