"""Structured outputs under fire: the shapes agent frameworks send (tests/structured_cases.py's
FRAMEWORK_SCHEMAS: no additionalProperties, unbounded integers and numbers) x seeds at temperature 1,
decoded plain, with n-gram speculation and with the engine's draft model, each schema read in the
lenient form (as JSON Schema reads it) and the closed one (the server's default). Every reply must
parse and validate against the schema as sent (`jsonschema`); under tool_choice "required", every call's
arguments must hold only the keys its tool declares. Prints a table, writes JSON: per form and mode,
replies validated, cut by max_tokens, and tokens per reply (mean, max).

A tiny random model is the hardest case (its near-flat logits take any path the grammar leaves open):

    python scripts/fuzz_structured.py --engine /path/to/tiny-engine --draft-engine /path/to/tiny-draft-engine \\
        --out benchmarks/results/fuzz_structured_cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bie_trt.chat.tool_calls import parse_required  # noqa: E402
from structured_cases import FRAMEWORK_SCHEMAS, FRAMEWORK_TOOLS  # noqa: E402

PROMPT = "Answer in JSON:"
FORMS = ("lenient", "closed")
MODES = ("plain", "ngram", "draft")


def check_reply(name: str, schema: dict, text: str) -> str | None:
    """None when the reply is valid JSON matching the schema (and, for tool calls, declared keys only);
    else what is wrong with it."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg})"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"invalid: {e.message[:80]}"
    if name == "required_tools":
        declared = {t["function"]["name"]: set(t["function"]["parameters"]["properties"]) for t in FRAMEWORK_TOOLS}
        for call in parse_required(text, set(declared)) or []:
            if extra := set(json.loads(call.arguments)) - declared[call.name]:
                return f"undeclared arguments {sorted(extra)}"
    return None


def run(engine_dir: str, mode: str, form: str, names: list[str], seeds: list[int], max_tokens: int) -> dict:
    """One engine (speculating as `mode` says), every schema x seed in one batch."""
    from bie_trt import BieEngine, EngineConfig, SamplingParams, StructuredOutputs

    speculative = {"plain": {"method": "none"}, "ngram": {"method": "ngram"}, "draft": {"method": "draft_model"}}[mode]
    engine = BieEngine(EngineConfig(engine_dir=engine_dir, device="auto", speculative=speculative))
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                             structured_outputs=StructuredOutputs(json=FRAMEWORK_SCHEMAS[name], lenient=form == "lenient"))
              for name in names for seed in seeds]
    t0 = time.perf_counter()
    outs = engine.generate([PROMPT] * len(params), params)
    seconds = time.perf_counter() - t0
    failures, tokens = [], []
    for i, out in enumerate(outs):
        name = names[i // len(seeds)]
        tokens.append(len(out.token_ids))
        if (why := check_reply(name, FRAMEWORK_SCHEMAS[name], out.text)) is not None:
            failures.append({"schema": name, "seed": seeds[i % len(seeds)], "finish_reason": out.finish_reason,
                             "why": why, "text": out.text[:120]})
    per_schema = {name: {"tokens_mean": statistics.mean(tokens[j * len(seeds):(j + 1) * len(seeds)]),
                         "tokens_max": max(tokens[j * len(seeds):(j + 1) * len(seeds)])}
                  for j, name in enumerate(names)}
    return {"replies": len(outs), "validated": len(outs) - len(failures),
            "cut_by_max_tokens": sum(o.finish_reason == "length" for o in outs),
            "tokens_mean": statistics.mean(tokens), "tokens_max": max(tokens), "seconds": seconds,
            "per_schema": per_schema, "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="engine directory for the plain and n-gram runs")
    ap.add_argument("--draft-engine", help="engine built with a draft model, for the draft runs (omit to skip them)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--schemas", default=",".join(FRAMEWORK_SCHEMAS), help="comma list of FRAMEWORK_SCHEMAS names")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="fuzz_structured.json")
    args = ap.parse_args()
    names, seeds = args.schemas.split(","), list(range(args.seeds))
    result = {"engine": args.engine, "draft_engine": args.draft_engine, "prompt": PROMPT, "temperature": 1.0,
              "max_tokens": args.max_tokens, "schemas": names, "seeds": len(seeds), "runs": {}}
    for form in args.forms.split(","):
        for mode in args.modes.split(","):
            engine = args.draft_engine if mode == "draft" else args.engine
            if engine is None:
                print(f"{form:8s} {mode:6s} skipped (no --draft-engine)")
                continue
            r = result["runs"][f"{form}/{mode}"] = run(engine, mode, form, names, seeds, args.max_tokens)
            print(f"{form:8s} {mode:6s} validated {r['validated']:3d}/{r['replies']}  cut {r['cut_by_max_tokens']:3d}  "
                  f"tokens mean {r['tokens_mean']:6.1f} max {r['tokens_max']:4d}  ({r['seconds']:.0f} s)")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
