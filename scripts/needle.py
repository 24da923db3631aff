"""Passkey retrieval ("needle in a haystack") with FP16 vs quantised KV caches.

A random 5-digit passkey is hidden at depths 10-90% of a long context made of news text; the
model is asked for it (greedy). Prints a table and writes JSON.

    python scripts/needle.py --engine engines/smollm2 --context 8192 --trials 20 \
        --out benchmarks/results/needle_ctx8192.json
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from bie_trt import BieEngine, EngineConfig, SamplingParams

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "lee_background.txt"
INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n\n"
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


def haystack_prompt(tokenizer, filler_ids: list[int], context: int, depth: float, key: int) -> list[int]:
    head = tokenizer(INTRO)["input_ids"]
    needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    tail = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    room = context - len(head) - len(needle) - len(tail) - 8   # leave room for the answer
    body = filler_ids[:room]
    cut = int(len(body) * depth)
    return head + body[:cut] + needle + body[cut:] + tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--kv", default="fp16,int4_asym", help="comma-separated KV dtypes to compare")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    trials = [(0.1 + 0.8 * i / max(1, args.trials - 1), rng.randint(10000, 99999)) for i in range(args.trials)]
    rng.shuffle(trials)   # results are written after every trial: a partial run still covers all depths
    engines = {d: BieEngine(EngineConfig(engine_dir=args.engine, device="cpu", max_num_seqs=1, kv_cache_dtype=d))
               for d in args.kv.split(",")}
    tokenizer = next(iter(engines.values())).tokenizer
    filler = tokenizer(DATA.read_text(), add_special_tokens=False)["input_ids"]
    rows = {d: [] for d in engines}
    start = time.time()
    for depth, key in trials:
        ids = haystack_prompt(tokenizer, filler, args.context, depth, key)
        for dtype, engine in engines.items():   # the same prompt through every cache, back to back
            out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=8))
            rows[dtype].append({"depth": round(depth, 3), "key": key, "answer": out.text, "found": str(key) in out.text})
            print(f"{dtype:>10} depth {depth:.2f} key {key} -> {out.text!r}", flush=True)
        summary = {d: f"{sum(r['found'] for r in rs)}/{len(rs)}" for d, rs in rows.items()}
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({
                "context": args.context, "prompt_tokens": len(ids), "summary": summary,
                "kv": {d: e.runner.kv_config.__dict__ for d, e in engines.items()},
                "seconds": round(time.time() - start, 1), "results": rows}, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
