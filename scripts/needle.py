"""Passkey retrieval ("needle in a haystack") with FP16 vs quantised KV caches.

A random 5-digit passkey is hidden at depths 10-90% of a long context made of news text; the
model is asked for it (greedy). Prints a table and writes JSON.

    python scripts/needle.py --engine engines/smollm2 --context 8192 --trials 20 \
        --kv fp16,int4_asym,int4_asym/key_centering=off --out benchmarks/results/needle_ctx8192.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.eval_texts import load_eval_text

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "lee_background.txt"
INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n\n"
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
# "question" asks for the key; "recall" only restarts the needle's sentence, so the model has to
# find that sentence 8k tokens back and copy what followed (the plainest retrieval, which a small
# model can do even where it misreads the question).
ENDINGS = {"question": "\n\nWhat is the pass key? The pass key is", "recall": "\n\nThe pass key is"}


def haystack_prompt(tokenizer, filler_ids: list[int], context: int, depth: float, key: int,
                    ending: str = "question") -> list[int]:
    head = tokenizer(INTRO)["input_ids"]
    needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    tail = tokenizer(ENDINGS[ending], add_special_tokens=False)["input_ids"]
    room = context - len(head) - len(needle) - len(tail) - 8   # leave room for the answer
    body = filler_ids[:room]
    cut = int(len(body) * depth)
    return head + body[:cut] + needle + body[cut:] + tail


def engine_config(engine_dir: str, spec: str) -> EngineConfig:
    """`int4_asym` or `int4_asym/key_centering=off/window=256`: a KV dtype and overrides of its settings."""
    dtype, *settings = spec.split("/")
    overrides = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        overrides["kv_" + name] = {"on": True, "off": False}.get(value, int(value) if value.isdigit() else value)
    return EngineConfig(engine_dir=engine_dir, device="cpu", max_num_seqs=1, kv_cache_dtype=dtype, **overrides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--kv", default="fp16,int4_asym",
                    help="comma-separated KV variants: a dtype, optionally with /setting=value overrides "
                         "(e.g. int4_asym/key_centering=off)")
    ap.add_argument("--ending", choices=sorted(ENDINGS), default="question",
                    help="how the prompt asks for the key (see ENDINGS)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--filler", default=str(DATA),
                    help="the haystack's text: a file or builtin:NAME as `bie-trt eval --text` takes (default: the "
                         "news text)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--resume", action="store_true",
                    help="keep the results already in --out, run only the missing (trial, variant) pairs, "
                         "in depth order (faster: prompts share prefixes)")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    trials = [(round(0.1 + 0.8 * i / max(1, args.trials - 1), 3), rng.randint(10000, 99999))
              for i in range(args.trials)]
    rng.shuffle(trials)   # results are written after every trial: a partial run still covers all depths
    variants = args.kv.split(",")
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    previous: dict = {}
    if args.resume:
        if args.out and args.out.exists():
            previous = json.loads(args.out.read_text())
            rows.update(previous["results"])
        # In depth order: each prompt then shares its head and the filler before the shallower needle
        # with the trial before it, and the prefix cache serves that part.
        trials.sort()
    engines = {v: BieEngine(engine_config(args.engine, v)) for v in variants}
    tokenizer = next(iter(engines.values())).tokenizer
    filler = tokenizer(load_eval_text(args.filler), add_special_tokens=False)["input_ids"]
    start = time.time() - previous.get("seconds", 0.0)
    for depth, key in trials:
        todo = [v for v in variants if not any((r["depth"], r["key"]) == (depth, key) for r in rows[v])]
        if not todo:
            continue
        ids = haystack_prompt(tokenizer, filler, args.context, depth, key, args.ending)
        for v in todo:   # the same prompt through every cache, back to back
            out = engines[v].generate(ids, SamplingParams(temperature=0, max_tokens=8))
            rows[v].append({"depth": depth, "key": key, "answer": out.text, "found": str(key) in out.text})
            print(f"{v:>28} depth {depth:.2f} key {key} -> {out.text!r}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            kv = {**previous.get("kv", {}),
                  **{v: dataclasses.asdict(e.core.runner.kv_config) for v, e in engines.items()}}
            args.out.write_text(json.dumps({
                "context": args.context, "ending": ENDINGS[args.ending], "prompt_tokens": len(ids),
                "summary": summary(rows), "kv": kv,
                "seconds": round(time.time() - start, 1), "results": rows}, indent=2))
    print(json.dumps(summary(rows)))


def summary(rows: dict[str, list[dict]]) -> dict[str, str]:
    return {v: f"{sum(r['found'] for r in rs)}/{len(rs)}" for v, rs in rows.items()}


if __name__ == "__main__":
    main()
