"""`bie-trt serve --replicas 2` on Ray Serve, as a user runs it (a subprocess, the real openai client):
returning documents land on the replica that cached them, /metrics shows both replicas and the router,
a replica killed mid-stream costs only that stream (a clean 503 error, the next requests succeed, Ray
brings the replica back), and SIGTERM leaves the port free and no Ray process behind."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_concurrency import wait_until
from test_server import free_port

pytestmark = pytest.mark.slow   # a Ray instance and two engine processes: about two minutes on 2 cores


def _samples(base: str) -> list:
    text = httpx.get(base + "/metrics", timeout=30).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _replicas(base: str) -> dict[str, int]:
    """replica id -> pid, of the replicas that answered a scrape."""
    return {s.labels["replica"]: int(s.labels["pid"]) for s in _samples(base) if s.name == "bie_replica_info"}


def _up(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _document(i: int) -> str:
    words = random.Random(i).choices(["river", "stone", "lamp", "orbit", "maple", "cable", "ember", "quartz",
                                      "harbor", "violet", "tundra", "signal"], k=240)
    return f"Document {i}. " + " ".join(words)


def _ask(client: openai.OpenAI, doc: int, question: str):
    return client.chat.completions.with_raw_response.create(
        model="tiny", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": f"{_document(doc)}\n\nQuestion: {question}"}])


def test_two_replicas_route_by_prefix_survive_a_killed_replica_and_stop_cleanly(tiny_engine, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")   # Ray logs a lot: a file, not a pipe that could fill
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "bie_trt.cli", "serve", "--engine", str(tiny_engine), "--replicas",
                             "2", "--port", str(port), "--device", "cpu", "--max-model-len", "1024",
                             "--served-model-name", "tiny", "--shutdown-timeout", "5", "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    ours: list[psutil.Process] = []
    try:
        wait_until(lambda: _up(base) or proc.poll() is not None, "the server never came up", timeout=150)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")

        # 12 requests over 8 documents: each document once, then four of them again after all the others
        first = [_ask(client, d, "What comes first?") for d in range(8)]
        again = [_ask(client, d, "And what comes last?") for d in range(4)]
        assert all(r.http_response.status_code == 200 for r in first + again)
        for r in again:
            usage = r.parse().usage
            assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, usage
        samples = _samples(base)
        replicas = {s.labels["replica"] for s in samples if s.name == "bie_replica_info"}
        assert len(replicas) == 2
        served: dict[str, float] = {}
        for s in samples:
            if s.name == "bie_request_success_total":
                served[s.labels["replica"]] = served.get(s.labels["replica"], 0) + s.value
        assert set(served) == replicas and all(n >= 1 for n in served.values()) and sum(served.values()) == 12
        decisions = {s.labels["reason"]: s.value for s in samples if s.name == "bie_router_decisions_total"}
        assert decisions["affinity"] >= 4 and decisions["overflow"] == 0

        # a replica killed mid-stream: that stream ends with a clean, retryable error within seconds
        chunks: list[str] = []
        failure: list[BaseException] = []

        def stream() -> None:
            try:
                for chunk in client.completions.create(model="tiny", prompt="Tell me a long story", max_tokens=1000,
                                                       stream=True, extra_body={"ignore_eos": True}):
                    chunks.append(chunk.choices[0].text if chunk.choices else "")
            except BaseException as e:
                failure.append(e)

        reader = threading.Thread(target=stream)
        reader.start()
        wait_until(lambda: len(chunks) >= 3, "the stream never started", timeout=60)
        running = {s.labels["replica"] for s in _samples(base)
                   if s.name == "bie_num_requests_running" and s.value >= 1}
        assert len(running) == 1
        victim = _replicas(base)[running.pop()]
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        reader.join(timeout=30)
        assert not reader.is_alive(), "the stream hung after its replica died"
        assert time.time() - killed < 15 and len(chunks) < 1000
        assert failure and isinstance(failure[0], openai.APIError), failure
        assert (failure[0].body or {}).get("code") == "replica_unavailable"

        # the next requests succeed (the survivor takes them), and Ray brings the dead replica back
        after = [_ask(client, d, "Once more?") for d in range(3)]
        assert all(r.http_response.status_code == 200 for r in after)
        wait_until(lambda: len(_replicas(base)) == 2 and victim not in _replicas(base).values(),
                   "the killed replica never came back", timeout=120)

        # SIGTERM: every process this server started gone, and the port free, within 60 s
        ours = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in ours)   # it did start its own Ray instance
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(ours, timeout=max(1, 60 - (time.time() - killed)))
        assert not alive, [p.cmdline() for p in alive]
        with pytest.raises(ConnectionRefusedError):   # nothing listens there
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.socket() as sock:   # and a server can take it again (past this test's own TIME_WAITs)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in ours:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
        log.close()
