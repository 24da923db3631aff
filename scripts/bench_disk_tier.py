"""The KV cache's disk tier across a restart, through the real server; JSON on stdout (and --out).

`bie-trt serve` is started on an empty --kv-cache-dir, sent a long prompt (streamed, greedy), stopped with
SIGTERM, started again on the same directory and sent the same prompt: the time to first token (measured by
the client, from sending to the first streamed token) of the cold prefill and of the return, the cached
tokens the return reports, and whether both replies are the same. A third server with the disk tier off
(`--disk-kv-cache-gb 0`) gives the restart's time without it.

    python scripts/bench_disk_tier.py --engine engines/smollm2 --prompt-tokens 3000 \\
        --out benchmarks/results/disk_tier_cpu_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from report import emit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, kv_dir: Path, device: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bie_trt.cli", "serve", engine, "--port", str(port), "--device",
                             device, "--kv-cache-dir", str(kv_dir), "--log-level", "warning", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("the server did not start in 10 minutes")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM, as a service manager stops it; -> what it logged."""
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return err


def ask(base: str, ids: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: time to first token, the text, the usage."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, first = "", None, None
    start_s = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                first = first or time.perf_counter() - start_s
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft_s": round(first, 4), "text": text, "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def metric(base: str, name: str) -> float:
    line = next(line for line in httpx.get(base + "/metrics").text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


def bench(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    ids = [rng.randrange(100, 20000) for _ in range(args.prompt_tokens)]
    warm = [rng.randrange(100, 20000) for _ in range(32)]   # not a prefix of ids: the first run stays cold
    with tempfile.TemporaryDirectory(prefix="bie-disk-bench-") as tmp:
        kv_dir = Path(tmp)
        runs = {}
        for name, extra in [("first", []), ("restarted", []), ("restarted_without_disk_tier",
                                                                 ["--disk-kv-cache-gb", "0"])]:
            proc, base = start(args.engine, kv_dir, args.device, extra)
            try:
                ask(base, warm, 2)   # first-call costs (imports, allocator) out of the way
                runs[name] = ask(base, ids, args.max_tokens)
                runs[name]["disk_hit_tokens"] = metric(base, "bie_disk_kv_cache_hits_total")
                runs[name]["disk_written_bytes"] = metric(base, 'bie_disk_kv_bytes_total{direction="written"}')
            finally:
                stop(proc)
        tier_bytes = sum(f.stat().st_size for f in kv_dir.glob("bie-kv-*/*.kvb"))
    first, back, without = runs["first"], runs["restarted"], runs["restarted_without_disk_tier"]
    return {"engine": args.engine, "device": args.device, "machine": args.machine,
            "command": "python scripts/bench_disk_tier.py " + shlex.join(sys.argv[1:]),
            "prompt_tokens": args.prompt_tokens, "runs": runs,
            "disk_tier_bytes": tier_bytes,
            "cached_fraction": round(back["cached_tokens"] / args.prompt_tokens, 4),
            "same_text": first["text"] == back["text"] == without["text"],
            "ttft_speedup": round(without["ttft_s"] / back["ttft_s"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="Engine directory.")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto.")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--machine", default="", help="What it ran on, for the record (CPU figures are CPU figures).")
    ap.add_argument("--out", type=Path, help="Write the JSON here too.")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    emit(bench(args), args.out)


if __name__ == "__main__":
    main()
