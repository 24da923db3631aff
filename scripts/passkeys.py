"""Passkeys at five depths of one haystack, asked one by one after it, through each KV cache format; JSON out.

One haystack carries a different secret number at each depth, each labelled as a different fact ("the pass
key", "the launch code", ...), so a question names one plainly; each question is asked after the whole
haystack. The prefix cache serves the shared haystack, so the CPU prefills it once per format and each question
costs a few tokens. A format counts a depth as found when the greedy answer contains its number.

    python scripts/passkeys.py --engine engines/coder-int4 --context 8192 --kv fp16,fp8,int4_asym \\
        --out benchmarks/results/passkeys_coder_ctx8192.json

`--kv` takes scripts/needle.py's specs (`int4_asym`, `int4_asym/key_scale=off`): the engine's own settings
(centering, key scale, window) apply to every quantised format unless a spec overrides one.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from bie_trt.eval_texts import load_eval_text

from needle import engine_config
from report import emit

# (depth, the fact, its number): different facts, so each question names one plainly
FACTS = ((0.1, "pass key", 48213), (0.3, "launch code", 27954), (0.5, "locker number", 70596),
         (0.7, "room number", 63148), (0.9, "vault code", 31862))
INTRO = "Secret numbers are hidden inside a lot of irrelevant text. Find them and remember them.\n\n"
NEEDLE = "\nThe {what} is {key}. Remember it. {key} is the {what}.\n"
QUESTION = "\n\nWhat is the {what}? The {what} is"


def haystack(tokenizer, text: str, context: int, facts=FACTS) -> list[int]:
    """INTRO, then `context` tokens of `text` with each fact's sentence at its depth."""
    def encode(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    body = encode(text)[:context]
    if len(body) < context:
        raise SystemExit(f"the haystack text has {len(body):,} tokens; {context:,} were asked for")
    ids, done = tokenizer(INTRO)["input_ids"], 0
    for depth, what, key in facts:
        cut = int(context * depth)
        ids += body[done:cut] + encode(NEEDLE.format(what=what, key=key))
        done = cut
    return ids + body[done:]


def ask(engine, prefix: list[int], facts=FACTS, max_tokens: int = 6) -> list[dict]:
    """Each fact's question after `prefix`, greedy: [{depth, key, answer, found}]."""
    from bie_trt.sampling_params import SamplingParams

    rows = []
    for depth, what, key in facts:
        question = engine.tokenizer(QUESTION.format(what=what), add_special_tokens=False)["input_ids"]
        answer = engine.generate(prefix + question, SamplingParams(temperature=0, max_tokens=max_tokens)).text
        rows.append({"depth": depth, "what": what, "key": key, "answer": answer, "found": str(key) in answer})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--context", type=int, default=8192, help="haystack tokens (the facts and questions come on top)")
    ap.add_argument("--kv", default="fp16,fp8,int4_asym", help="comma-separated KV specs (scripts/needle.py's)")
    ap.add_argument("--text", default="builtin:python-docs", help="the haystack: a file or builtin:NAME")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from bie_trt.executor.engine import BieEngine

    text = load_eval_text(args.text)
    result = {"engine": args.engine, "context": args.context, "text": args.text, "formats": {}}
    for spec in args.kv.split(","):
        start = time.time()
        engine = BieEngine(engine_config(args.engine, spec))
        prefix = haystack(engine.tokenizer, text, args.context)
        rows = ask(engine, prefix)
        result["formats"][spec] = {"kv": dataclasses.asdict(engine.core.runner.kv_config),
                                   "found": f"{sum(r['found'] for r in rows)}/{len(rows)}",
                                   "prompt_tokens": len(prefix), "seconds": round(time.time() - start, 1),
                                   "rows": rows}
        print(f"{spec}: {result['formats'][spec]['found']} ({result['formats'][spec]['seconds']} s)", flush=True)
        del engine
    fp16 = result["formats"].get("fp16")
    if fp16:   # what the acceptance asks: every depth FP16 finds, each quantised format finds too
        result["missed_where_fp16_found"] = {
            spec: [r["depth"] for r, f in zip(fmt["rows"], fp16["rows"]) if f["found"] and not r["found"]]
            for spec, fmt in result["formats"].items() if spec != "fp16"}
    emit(result, args.out)


if __name__ == "__main__":
    main()
