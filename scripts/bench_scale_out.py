"""Scale-out on Ray Serve, measured; JSON on stdout (and --out).

The same load on three set-ups, each a fresh local Ray instance behind the same ingress: 1 replica,
2 replicas with prefix-affinity routing, 2 replicas with Ray Serve's default power-of-two routing. The
load: D documents, each asked once (cold), then R more rounds in which every document is asked again
with another question, in a shuffled order, C requests at a time through the openai client. Reported:
requests/s over the whole load, and the cache-hit fraction of the returning requests (cached prompt
tokens over prompt tokens, from each response's usage), with the router's decisions. A few short
requests warm the replicas up first, untimed.

    python scripts/bench_scale_out.py --engine engines/tiny --out benchmarks/results/scale_out_cpu.json
"""
from __future__ import annotations

import argparse
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from report import emit

WORDS = ("river", "stone", "lamp", "orbit", "maple", "cable", "ember", "quartz", "harbor", "violet", "tundra",
         "signal", "copper", "meadow", "lantern", "glacier")


def document(i: int, words: int) -> str:
    return f"Document {i}. " + " ".join(random.Random(i).choices(WORDS, k=words))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_load(base: str, args: argparse.Namespace) -> dict:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    order = [(0, d) for d in range(args.documents)]
    for r in range(1, args.rounds + 1):
        docs = list(range(args.documents))
        random.Random(r).shuffle(docs)
        order += [(r, d) for d in docs]

    def ask(round_doc: tuple[int, int]) -> tuple[int, int, int]:
        r, d = round_doc
        reply = client.chat.completions.create(
            model="bench", max_tokens=args.max_tokens, temperature=0,
            messages=[{"role": "user", "content": f"{document(d, args.words)}\n\nQuestion {r}: what comes next?"}])
        return r, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens

    with ThreadPoolExecutor(args.concurrency) as pool:   # each replica's first requests, untimed
        list(pool.map(lambda i: client.completions.create(model="bench", prompt=f"Warm-up {i}.", max_tokens=2),
                      range(2 * args.concurrency)))
    start = time.perf_counter()
    results = []
    for r in range(args.rounds + 1):   # a round waits for the one before: returns are returns
        with ThreadPoolExecutor(args.concurrency) as pool:
            results += list(pool.map(ask, [o for o in order if o[0] == r]))
    seconds = time.perf_counter() - start
    returning = [(p, c) for r, p, c in results if r > 0]
    return {"requests": len(results), "seconds": round(seconds, 2), "requests_per_s": round(len(results) / seconds, 3),
            "returning_prompt_tokens": sum(p for p, _ in returning),
            "returning_cached_tokens": sum(c for _, c in returning),
            "returning_cache_hit_fraction": round(sum(c for _, c in returning) / sum(p for p, _ in returning), 4)}


def one_setup(args: argparse.Namespace, replicas: int, router: str) -> dict:
    import uvicorn

    from bie_trt.config import EngineConfig
    from bie_trt.scale_out.cluster import DEPLOYMENT, ScaleOut, ScaleOutOptions
    from bie_trt.scale_out.router import router_of
    from bie_trt.server.state import ServerOptions

    cluster = ScaleOut(EngineConfig(engine_dir=args.engine, device=args.device),
                       ServerOptions(served_model_name="bench"), ScaleOutOptions(replicas, router=router))
    started = time.perf_counter()
    try:
        app = cluster.start()
        ready_s = time.perf_counter() - started
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.1)
        result = run_load(f"http://127.0.0.1:{port}", args)
        server.should_exit = True
        thread.join()
        decisions = router_of(DEPLOYMENT).counts()
    finally:
        cluster.stop()
    return {"replicas": replicas, "router": router, "start_s": round(ready_s, 1), **result,
            "router_decisions": decisions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="Engine directory.")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="Rounds of returning requests after the cold one.")
    ap.add_argument("--words", type=int, default=300, help="Words per document.")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, help="Write the JSON here too.")
    args = ap.parse_args()
    setups = [one_setup(args, 1, "prefix-affinity"), one_setup(args, 2, "prefix-affinity"),
              one_setup(args, 2, "power-of-two")]
    one, affinity, pow2 = setups
    emit({"engine": args.engine, "device": args.device, "documents": args.documents, "rounds": args.rounds,
          "words": args.words, "concurrency": args.concurrency, "max_tokens": args.max_tokens, "setups": setups,
          "requests_per_s_2_over_1": round(affinity["requests_per_s"] / one["requests_per_s"], 3),
          "returning_cache_hit_fraction": {"prefix-affinity": affinity["returning_cache_hit_fraction"],
                                           "power-of-two": pow2["returning_cache_hit_fraction"]}}, args.out)


if __name__ == "__main__":
    main()
