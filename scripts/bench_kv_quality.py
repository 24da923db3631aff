"""KV-cache quality of one engine, FP16 / FP8 / INT4 side by side: perplexity and KL divergence against the FP16
cache at each --contexts length, and passkey recall at five depths of --needle-context tokens. Writes JSON.

The INT4 row is the engine's own format (what its build chose: centering, window, groups); the FP8 row is the
same settings with FP8 codes. Every context length scores one window from the start of --text, all formats in
one run sharing one FP16 pass (bie_trt.evaluate).

    python scripts/bench_kv_quality.py --engine engines/coder-int4 --contexts 2048,8192 \
        --out benchmarks/results/kv_quality_coder.json
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import random
import time
from pathlib import Path

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.engine_format import read_manifest
from bie_trt.eval_texts import load_eval_text, text_token_ids
from bie_trt.evaluate import evaluate

_spec = importlib.util.spec_from_file_location("needle", Path(__file__).parent / "needle.py")
needle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(needle)

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
FORMATS = ("fp16", "fp8", "int4_asym")


def quality(engine: str, text: str, contexts: list[int]) -> list[dict]:
    """Per context: each format's PPL, Δ PPL and KLD against the FP16 cache."""
    int4 = read_manifest(engine).kv   # the engine's format as built
    variants = {"fp8": dataclasses.replace(int4, dtype="fp8"), "int4_asym": dataclasses.replace(int4, dtype="int4_asym")}
    ids = text_token_ids(engine, load_eval_text(text))
    rows = []
    for context in contexts:
        start = time.time()
        results = evaluate(engine, ids, context, variants, max_windows=1, progress=False)
        base = results[0].ppl
        rows.append({"context": context, "seconds": round(time.time() - start, 1),
                     "rows": [{**r.to_dict(), "ppl_change_pct": round(100 * (r.ppl / base - 1), 3)} for r in results]})
        print(json.dumps(rows[-1]["rows"]), flush=True)
    return rows


def passkey(engine: str, filler: str, context: int, seed: int) -> dict:
    """Each format's answers at DEPTHS (the `recall` ending, needle.py's prompt); the same prompts for every one."""
    rng = random.Random(seed)
    keys = [rng.randint(10000, 99999) for _ in DEPTHS]
    out = {}
    for fmt in FORMATS:
        start = time.time()
        eng = BieEngine(EngineConfig(engine_dir=engine, device="cpu", max_num_seqs=1, kv_cache_dtype=fmt))
        filler_ids = eng.tokenizer(load_eval_text(filler), add_special_tokens=False)["input_ids"]
        answers = []
        for depth, key in zip(DEPTHS, keys):
            ids = needle.haystack_prompt(eng.tokenizer, filler_ids, context, depth, key, "recall")
            text = eng.generate(ids, SamplingParams(temperature=0, max_tokens=8)).text
            answers.append({"depth": depth, "key": key, "answer": text, "found": str(key) in text})
            print(fmt, depth, key, repr(text), flush=True)
        out[fmt] = {"found": f"{sum(a['found'] for a in answers)}/{len(answers)}", "answers": answers,
                    "kv": dataclasses.asdict(eng.core.runner.kv_config), "seconds": round(time.time() - start, 1)}
        del eng
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--text", default="builtin:python-docs", help="what perplexity is scored on (eval's --text)")
    ap.add_argument("--contexts", default="2048,8192", help="comma-separated window lengths ('' skips perplexity)")
    ap.add_argument("--needle-context", type=int, default=8192, help="0 skips the passkey")
    ap.add_argument("--filler", default="builtin:python-docs", help="the passkey's haystack")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    result: dict = {"engine": args.engine, "text": args.text, "filler": args.filler}
    result["quality"] = quality(args.engine, args.text, [int(c) for c in args.contexts.split(",") if c])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if args.needle_context:
        result["passkey"] = {"context": args.needle_context, "ending": needle.ENDINGS["recall"],
                             **passkey(args.engine, args.filler, args.needle_context, args.seed)}
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
