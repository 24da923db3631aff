"""Streamed responses need no thread per client: the engine's loop thread posts each step's events onto the
server's event loop, and requests are prepared (tokenised, started) in at most PREPARE_THREADS threads.
Many concurrent streams over real HTTP (127.0.0.1) leave the server's thread count bounded."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from bie_trt import BieEngine, EngineConfig
from bie_trt.server.state import PREPARE_THREADS
from test_server import serving

STREAMS = 16


@pytest.fixture(scope="module")
def server(tiny_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=256))
    with serving(engine) as base:
        yield engine, base


async def stream(client: httpx.AsyncClient, base: str, i: int) -> tuple[str, int]:
    body = {"prompt": f"Count to {i}:", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, tokens = "", 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
                tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
    return text, tokens


async def streams_with_thread_count(base: str) -> tuple[list[tuple[str, int]], int]:
    """All streams at once, on this thread's event loop (the client adds no thread), and the most threads the
    process held meanwhile, read every 5 ms."""
    most, done = threading.active_count(), asyncio.Event()

    async def watch() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, threading.active_count())
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=STREAMS)) as client:
        results = await asyncio.gather(*(stream(client, base, i) for i in range(STREAMS)))
    done.set()
    await watcher
    return results, most


def test_concurrent_streams_hold_no_thread_each(server):
    engine, base = server
    before = threading.active_count()
    results, most = asyncio.run(streams_with_thread_count(base))
    assert all(tokens == 6 and text for text, tokens in results)
    # the engine's loop thread and the preparing threads, however many streams are in flight
    assert most - before <= PREPARE_THREADS + 1, (before, most)
    assert engine.stats().kv_blocks["fp16"]["used"] == 0
