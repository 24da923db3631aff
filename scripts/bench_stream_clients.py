"""Many streamed clients on one server: its thread count before, during and after, tokens/s, time to first token.

Starts `bie-trt serve` on a free 127.0.0.1 port in a child process (CPU), then runs rounds of N concurrent
streamed completions over real HTTP (httpx, server-sent events), each asking for the same number of tokens
(ignore_eos). The server's threads are read from /proc/PID/task: before the first round, every 20 ms during
the rounds (the most seen), and a second after the last. Tokens/s is all rounds' completion tokens over their
wall time (on a shared machine it moves with the load: the server's CPU seconds per token do not, and are
reported beside it); time to first token is per request, from sending it to its first streamed token.

    python scripts/bench_stream_clients.py --label after --out benchmarks/results/stream_clients_cpu.json

Without --engine it builds the tiny random model the tests use (the SmolLM2 tokenizer) once into --work.
--label names the run inside --out, so that runs of two versions of the code land side by side.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench_scale_out import free_port

ROOT = Path(__file__).resolve().parents[1]


def tiny_engine(work: Path) -> Path:
    """The tests' tiny engine (random 2-layer Llama, SmolLM2's tokenizer), built once."""
    out = work / "engine"
    if (out / "manifest.json").exists():
        return out
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_model import write_tiny_hf

    from bie_trt.builder.build import BuildOptions, build_engine
    from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
    from bie_trt.builder.checkpoint.registry import resolve_checkpoint

    hf = write_tiny_hf(work / "hf", resolve_checkpoint("smollm2-135m"), num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=8192)
    awq = quantize_checkpoint(hf, work / "awq", group_size=32)
    return build_engine(BuildOptions(checkpoint=str(awq), out=str(out), profile="cpu", max_model_len=1024,
                                     force=True), log=lambda m: None)


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ThreadWatch:
    """The most threads the server held while the rounds ran, read every 20 ms."""

    def __init__(self, pid: int):
        self.pid, self.most, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.most = max(self.most, threads_of(self.pid))

    def __enter__(self) -> "ThreadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def one_stream(client: httpx.AsyncClient, base: str, max_tokens: int) -> tuple[float, int]:
    """-> (seconds to the first streamed token, completion tokens)."""
    body = {"prompt": "Once upon a time there was", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, tokens


async def rounds(base: str, clients: int, max_tokens: int, count: int) -> dict:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_stream(client, base, 4)   # warm: the first request's one-off costs are not the clients'
        ttft, tokens, walls = [], 0, []
        for _ in range(count):
            start = time.perf_counter()
            results = await asyncio.gather(*(one_stream(client, base, max_tokens) for _ in range(clients)))
            walls.append(time.perf_counter() - start)
            ttft += [t for t, _ in results]
            tokens += sum(n for _, n in results)
    ttft.sort()
    return {"tokens": tokens, "seconds": round(sum(walls), 3), "tokens_per_s": round(tokens / sum(walls), 2),
            "round_seconds": [round(w, 3) for w in walls],
            "ttft_s": {"p50": round(statistics.median(ttft), 4), "max": round(ttft[-1], 4),
                       "mean": round(statistics.fmean(ttft), 4)}}


def run(engine: Path, clients: int, max_tokens: int, count: int) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "bie_trt.cli", "serve", str(engine), "--port", str(port),
                               "--device", "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {server.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("the server did not start within 300 s")
            time.sleep(0.2)
        before, cpu = threads_of(server.pid), cpu_seconds(server.pid)
        with ThreadWatch(server.pid) as watch:
            result = asyncio.run(rounds(base, clients, max_tokens, count))
        cpu = cpu_seconds(server.pid) - cpu
        time.sleep(1.0)
        after = threads_of(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {"clients": clients, "max_tokens": max_tokens, "rounds": count,
            "server_threads": {"before": before, "during_max": watch.most, "after": after},
            # the server's CPU time per token: what the request path costs, whatever else loads the machine
            "server_cpu_s": round(cpu, 3), "tokens_per_server_cpu_s": round(result["tokens"] / cpu, 2), **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, help="engine directory (default: build the tests' tiny engine)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bie-trt-bench-stream"))
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--label", default="run", help="the key this run is stored under in --out")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    engine = args.engine or tiny_engine(args.work)
    result = run(engine, args.clients, args.max_tokens, args.rounds)
    print(json.dumps(result, indent=1))
    if args.out:
        runs = json.loads(args.out.read_text()) if args.out.exists() else {}
        runs[args.label] = {"command": " ".join(["python", "scripts/bench_stream_clients.py", *sys.argv[1:]]),
                            **result}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
