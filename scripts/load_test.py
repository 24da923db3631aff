"""Load test of the OpenAI-compatible server through the real `openai` client, on loopback only.

N clients send requests back to back for a fixed duration: streamed completions and chats with random
prompt lengths and max_tokens, 10% hanging up mid-stream and 5% invalid (each must get a 4xx). It
prints and writes JSON: requests by outcome, p50/p95/p99 time to first token and inter-token latency,
the number of 5xx answers (must be 0), the KV blocks in use before and after (must return to idle)
and the most the KV cache's host tier held, sampled through the run (must stay within its bound).
Exits 1 when any check fails. A small device pool (--num-kv-blocks) with a small host tier
(--host-kv-cache-gb) drives evictions to the host, restores and drops from a full host tier.

    python scripts/load_test.py --engine engines/smollm2 --clients 16 --duration 300 \\
        --out benchmarks/results/load_test_cpu_16clients_300s.json
    python scripts/load_test.py --base-url http://127.0.0.1:8080 --clients 8 --duration 30

With --engine it starts the server in this process on a free 127.0.0.1 port (CPU by default).
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

FALLBACK_TEXT = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill and the "
                 "children count the boats that drift toward the harbour in the evening light. ")

# Invalid bodies a careless client sends; each must be refused with a 4xx, never a 5xx.
INVALID = [
    {"prompt": "Hi", "max_tokens": "4"},
    {"prompt": "Hi", "max_tokens": True},
    {"prompt": "Hi", "temperature": 7},
    {"prompt": ["Hi", 3]},
    {"prompt": "Hi", "max_tokens": -1},   # (10 ** 9 is valid: clamped to what the context leaves)
    {"messages": [{"role": "robot", "content": "hi"}]},
    {"messages": [{"role": "user", "content": None}]},
    {"messages": []},
]


@dataclass
class Tally:
    """What every client saw; appended to under one lock."""

    outcomes: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, outcome: str, status: int | None = None, ttft: float | None = None,
              gaps: list[float] | None = None, tokens: int = 0) -> None:
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if status is not None:
                self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
            if ttft is not None:
                self.ttft.append(ttft)
            self.itl.extend(gaps or [])
            self.tokens += tokens


def percentiles(values: list[float]) -> dict[str, float | None]:
    """Nearest-rank p50/p95/p99 (None without samples)."""
    ordered = sorted(values)

    def rank(p: float) -> float | None:
        return ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * p // 100) - 1))] if ordered else None

    return {"p50": rank(50), "p95": rank(95), "p99": rank(99)}


def kv_blocks_used(base_url: str) -> int:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return int(sum(s.value for f in text_string_to_metric_families(text) if f.name == "bie_kv_blocks"
                   for s in f.samples if s.labels.get("state") == "used"))


def host_tier(base_url: str) -> tuple[float, float]:
    """(bytes the KV host tier holds, its bound)."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    values = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
              if f.name in ("bie_host_kv_cache_used_bytes", "bie_host_kv_cache_capacity_bytes")}
    return values.get("bie_host_kv_cache_used_bytes", 0.0), values.get("bie_host_kv_cache_capacity_bytes", 0.0)


def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        sys.exit(f"error: {base_url} is not a loopback address; this load test only targets 127.0.0.1 or localhost.")


def kind_of(turn: int) -> str:
    """Every 20th request is invalid (5%), two in 20 hang up mid-stream (10%), the rest complete. Spread by
    turn (request number plus client number), so that even a short run has each kind from its first round."""
    return {0: "invalid", 5: "hang_up", 15: "hang_up"}.get(turn % 20, "complete")


def one_request(client: openai.OpenAI, model: str, kind: str, rng: random.Random, words: list[str], tally: Tally,
                max_prompt_words: int, max_tokens: int) -> None:
    if kind == "invalid":   # must be a 4xx
        body = dict(rng.choice(INVALID))
        try:
            if "messages" in body:
                client.chat.completions.create(model=model, messages=body.pop("messages"), extra_body=body)
            else:
                client.completions.create(model=model, prompt=body.pop("prompt"), extra_body=body)
            tally.count("invalid_accepted", 200)
        except openai.APIStatusError as e:
            tally.count("invalid_refused" if e.status_code < 500 else "server_error", e.status_code)
        return
    start = rng.randrange(len(words))
    prompt = " ".join(words[start:start + rng.randint(1, max_prompt_words)]) or "Hello"
    chat, hang_up = rng.random() < 0.5, kind == "hang_up"
    kw = {"model": model, "max_tokens": rng.randint(1, max_tokens), "stream": True,
          "temperature": rng.choice([0.0, 0.7, 1.0])}
    sent = time.perf_counter()
    try:
        stream = (client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw) if chat
                  else client.completions.create(prompt=prompt, **kw))
        first, last, gaps, chunks = None, None, [], 0
        with stream:
            for chunk in stream:
                if not chunk.choices:
                    continue
                piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
                if not piece and chunk.choices[0].finish_reason is None:
                    continue   # the role-only first chat chunk
                now = time.perf_counter()
                if first is None:
                    first = now - sent
                else:
                    gaps.append(now - last)
                last, chunks = now, chunks + 1
                if hang_up and chunks >= 2:
                    break   # leaving the `with` closes the connection mid-stream
        tally.count("disconnected" if hang_up else "completed", 200, first, gaps, chunks)
    except openai.APIStatusError as e:
        tally.count("server_error" if e.status_code >= 500 else "refused", e.status_code)
    except openai.APIConnectionError:
        tally.count("connection_error")


def run_load(base_url: str, clients: int, duration: float, seed: int, max_prompt_words: int,
             max_tokens: int, text: str) -> dict:
    check_loopback(base_url)
    http = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = http.models.list().data[0].id
    words = text.split()
    tally, deadline = Tally(), time.perf_counter() + duration
    before = kv_blocks_used(base_url)

    def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        turn = i
        while time.perf_counter() < deadline:
            one_request(client, model, kind_of(turn), rng, words, tally, max_prompt_words, max_tokens)
            turn += 1

    host_held, host_bound = [], host_tier(base_url)[1]
    running = threading.Event()
    running.set()

    def sample_host_tier() -> None:
        while running.is_set():
            host_held.append(host_tier(base_url)[0])
            time.sleep(0.2)

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    sampler = threading.Thread(target=sample_host_tier)
    for t in threads + [sampler]:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    running.clear()
    sampler.join()
    after, settle = kv_blocks_used(base_url), time.perf_counter() + 30
    while after != before and time.perf_counter() < settle:   # aborts land within a step or two
        time.sleep(0.2)
        after = kv_blocks_used(base_url)
    server_errors = sum(n for status, n in tally.statuses.items() if int(status) >= 500)
    return {
        "clients": clients, "duration_s": duration, "elapsed_s": round(elapsed, 2), "seed": seed,
        "max_prompt_words": max_prompt_words, "max_tokens": max_tokens,
        "requests": sum(tally.outcomes.values()), "outcomes": tally.outcomes, "statuses": tally.statuses,
        "server_errors_5xx": server_errors, "streamed_tokens": tally.tokens,
        "tokens_per_s": round(tally.tokens / elapsed, 2),
        "ttft_s": percentiles(tally.ttft), "inter_token_latency_s": percentiles(tally.itl),
        "kv_blocks_used_before": before, "kv_blocks_used_after": after,
        "host_kv_capacity_bytes": host_bound, "host_kv_used_max_bytes": max(host_held, default=0.0),
        "host_kv_samples": len(host_held),
        "ok": server_errors == 0 and after == before and not tally.outcomes.get("invalid_accepted")
        and not tally.outcomes.get("connection_error") and max(host_held, default=0.0) <= host_bound,
    }


def serve_in_process(engine_dir: str, device: str, max_model_len: int | None, **config):
    """The server on a free loopback port in a daemon thread; returns (base_url, stop). `config`: more
    EngineConfig fields."""
    import uvicorn

    from bie_trt import BieEngine, EngineConfig
    from bie_trt.server.app import create_app

    engine = BieEngine(EngineConfig(engine_dir=engine_dir, device=device, max_model_len=max_model_len, **config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            sys.exit("error: the server did not start")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)

    return f"http://127.0.0.1:{port}", stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--engine", help="Engine directory: serve it in this process on 127.0.0.1.")
    where.add_argument("--base-url", help="A running server on loopback, e.g. http://127.0.0.1:8080.")
    ap.add_argument("--device", default="cpu", help="With --engine: cpu, cuda or auto.")
    ap.add_argument("--max-model-len", type=int, default=512, help="With --engine: the context to serve.")
    ap.add_argument("--num-kv-blocks", type=int, help="With --engine: FP16 KV blocks (default: the plan's).")
    ap.add_argument("--chunked-prefill-size", type=int, help="With --engine: prompt tokens per step.")
    ap.add_argument("--host-kv-cache-gb", type=float, help="With --engine: the KV host tier's size (0: off).")
    ap.add_argument("--clients", type=int, default=8, help="Concurrent clients.")
    ap.add_argument("--duration", type=float, default=30.0, help="Seconds the clients keep sending.")
    ap.add_argument("--max-prompt-words", type=int, default=120, help="Prompts have 1..this many words.")
    ap.add_argument("--max-tokens", type=int, default=48, help="Requests ask for 1..this many tokens.")
    ap.add_argument("--text", type=Path, help="Prompt words from this text (default: a built-in sentence).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="Write the JSON here too.")
    args = ap.parse_args()
    if args.clients < 1 or args.duration <= 0 or args.max_tokens < 1 or args.max_prompt_words < 1:
        sys.exit("error: --clients, --duration, --max-tokens and --max-prompt-words must be positive.")
    text = args.text.read_text(encoding="utf-8") if args.text else FALLBACK_TEXT * 20
    stop = None
    base_url = args.base_url.rstrip("/") if args.base_url else None
    if args.engine:
        config = {"num_kv_blocks": args.num_kv_blocks, "chunked_prefill_size": args.chunked_prefill_size,
                  "host_kv_cache_gb": args.host_kv_cache_gb}
        base_url, stop = serve_in_process(args.engine, args.device, args.max_model_len,
                                          **{k: v for k, v in config.items() if v is not None})
    try:
        result = run_load(base_url, args.clients, args.duration, args.seed, args.max_prompt_words,
                          args.max_tokens, text)
    finally:
        if stop is not None:
            stop()
    out = json.dumps(result, indent=2)
    print(out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(out + "\n")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
