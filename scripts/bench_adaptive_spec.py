"""Adaptive γ against plain decoding and fixed γ: does speculation pay where it can, and step aside where
it cannot, by itself?

One engine directory (with a draft), one BieEngine per configuration: plain decoding; for each method
(the draft model, n-gram lookup) each fixed γ of `--gammas` and the adaptive γ (up to the largest).
Greedy, on two kinds of prompt: prose (the opening of a news article, which the reply continues
rather than copies) and quoting / code-edit prompts (repeat a passage, rename a variable in code).
The configurations run interleaved, round-robin within each repeat, so the noise of a shared host
falls on all of them alike; each configuration's tokens/s over a kind of prompt is its decode tokens
over its decode seconds, summed over the prompts and repeats. Reported, from this one run:

* prose: adaptive tokens/s ÷ plain tokens/s, per method (fixed γ beside it);
* quoting: adaptive speed-up ÷ the best fixed γ's speed-up (speed-up: tokens/s ÷ plain's), per method;
* the same ratios from each repeat alone (their spread says how far one run's ratio can be trusted);
* whether every configuration emitted plain decoding's tokens, the γ the adaptive engines chose, and
  each speculative step's expected tokens (at its choice) against the tokens it emitted.

Every engine first decodes a warm-up request long enough for an adaptive engine to finish measuring
its step costs (a one-off of an engine's first steps), so the timed requests see the steady state.

Each decode is timed by two clocks: wall seconds, and the process's CPU seconds (one torch thread by
default), which the other tenants of a shared host do not inflate; ratios are given for both.

The prose comes from a bundled pair of news-style paragraphs, or with `--prose-file` from a text of
one article a line (e.g. ../shared/data/lee_background.txt).

    python scripts/bench_adaptive_spec.py --engine engines/smollm2-draft --prose-file ../shared/data/lee_background.txt \\
        --out benchmarks/results/adaptive_spec_cpu.json
    python scripts/bench_adaptive_spec.py --engine engines/smollm2-draft-h200 --device cuda --cap-gib 8   # a GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.spec_decode.adaptive import AdaptiveGamma

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec import FALLBACK, tasks  # noqa: E402

GiB = 1 << 30
# Original news-style openings, so that the benchmark needs no file beside the project.
NEWS = [
    "Heavy rain has forced the closure of several roads in the north of the state, and emergency crews spent the "
    "night helping residents whose homes were cut off by rising water. The weather bureau says more storms are "
    "expected before the weekend.",
    "The city council has voted to build a new library on the site of the old bus depot, ending a debate that has "
    "run for almost three years. Construction is due to begin in the spring, and the mayor says the project will "
    "create about two hundred jobs.",
]


def prose_prompts(path: Path | None, count: int, words: int) -> list[str]:
    """The openings of `count` articles (one a line) spread through the file, or the bundled ones."""
    articles = [line for line in path.read_text().splitlines() if len(line.split()) > words] if path else NEWS
    step = max(1, len(articles) // count)
    return [" ".join(a.split()[:words]) for a in articles[::step][:count]]


def configurations(methods: list[str], gammas: list[int]) -> dict[str, dict]:
    configs = {"plain": {"method": "none"}}
    for method in methods:
        short = "draft" if method == "draft_model" else method
        for g in gammas:
            configs[f"{short}_fixed_{g}"] = {"method": method, "num_speculative_tokens": g, "adaptive": False}
        configs[f"{short}_adaptive"] = {"method": method, "num_speculative_tokens": max(gammas), "adaptive": True}
    return configs


def cap(device: str, gib: float) -> None:
    """The per-process memory cap (each engine sets its plan's own when it loads: put this one back)."""
    if device.startswith("cuda"):
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GiB / torch.cuda.get_device_properties(0).total_memory))


def timed_generate(engine: BieEngine, prompt: str, params: SamplingParams) -> dict:
    """One request, streamed: its decode (from the first token to the last) in wall seconds and in the process's
    CPU seconds (what other tenants of a shared host do not inflate; all of it is the engine's while it runs)."""
    events = engine.stream(prompt, params)
    first = next(events)
    wall, cpu = time.perf_counter(), time.process_time()
    for event in events:
        pass
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    out = event.output if event.output is not None else first.output
    n = len(out.token_ids) - len(first.token_ids)   # the first step's tokens come with the prefill
    return {"tokens": out.token_ids, "decode_tokens": n, "decode_s": wall, "decode_cpu_s": cpu,
            "spec_decode": out.spec_decode}


def bookkeeping_seconds(gamma_max: int, steps: int = 20000) -> float:
    """What adaptive γ's own work costs a plain step of one request, in CPU seconds: the choice (`room`, which
    for a draft decides every step), the step's record and its timing, as the engine calls them."""
    g = AdaptiveGamma(gamma_max, per_token=True, clock=time.process_time)
    for rows in [1] * 3 + [gamma_max + 1] * 3:
        g.record_step([rows], 0.05 * (1 + 0.1 * (rows - 1)))
        g.record_proposal(0.05, 1, 1)
    for _ in range(5):
        g.record_verify("request", gamma_max, 0)
    start = time.process_time()
    for _ in range(steps):
        t = g.clock()
        g.record_decode("request", g.room("request"))
        g.record_step([1], 0.05 + (g.clock() - t))
    return (time.process_time() - start) / steps


def run(args: argparse.Namespace) -> dict:
    configs = configurations(args.methods, args.gammas)
    quoting = tasks(Path(args.prose_file).read_text()[:args.passage_chars] if args.prose_file else FALLBACK)
    prompts = {**{f"prose_{i}": p for i, p in enumerate(prose_prompts(args.prose_file and Path(args.prose_file),
                                                                        args.prose_prompts, args.prose_words))},
               "quote_passage": quoting["quote_passage"], "edit_code": quoting["edit_code"]}
    cap(args.device, args.cap_gib)
    engines = {}
    for name, spec in configs.items():
        engines[name] = BieEngine(EngineConfig(engine_dir=args.engine, device=args.device, speculative=spec,
                                               max_num_seqs=1))
        cap(args.device, args.cap_gib)
        # first-call costs out of the timings; the adaptive engines measure their step costs here
        engines[name].generate("The weather today", SamplingParams(temperature=0, max_tokens=args.warmup_tokens,
                                                                    ignore_eos=True))
        if engines[name].core.spec.adaptive is not None:
            engines[name].core.spec.adaptive.trace = []
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = {name: {task: [] for task in prompts} for name in configs}
    # the tokens each draft ran before the timed requests
    forwarded = {name: getattr(engine.core.spec.proposer, "tokens_forwarded", 0) for name, engine in engines.items()}
    for repeat in range(args.repeats):
        for task, prompt in prompts.items():
            for name, engine in engines.items():   # round-robin: the host's noise falls on all alike
                engine.reset_prefix_cache()
                runs[name][task].append(timed_generate(engine, prompt, params))
                if engine.core.spec.adaptive is not None:
                    runs[name][task][-1]["trace"], engine.core.spec.adaptive.trace = engine.core.spec.adaptive.trace, []
            print(json.dumps({"repeat": repeat, "task": task, "tokens_per_s": {
                name: round(r[task][-1]["decode_tokens"] / max(r[task][-1]["decode_s"], 1e-9), 2)
                for name, r in runs.items()}}), flush=True)
    return summarise(args, configs, prompts, engines, runs, forwarded)


def ratios_of(table: dict, configs: dict, methods: list[str]) -> dict:
    """The target ratios, per method, from a table of tokens/s by configuration and kind of prompt."""
    out = {}
    for method in methods:
        short = "draft" if method == "draft_model" else method
        fixed = [n for n in configs if n.startswith(f"{short}_fixed_")]
        speedup = {n: table[n]["quoting"] / table["plain"]["quoting"] for n in fixed + [f"{short}_adaptive"]}
        best = max(fixed, key=lambda n: speedup[n])
        out[short] = {
            "prose_adaptive_over_plain": table[f"{short}_adaptive"]["prose"] / table["plain"]["prose"],
            "prose_fixed_over_plain": {n: table[n]["prose"] / table["plain"]["prose"] for n in fixed},
            "quoting_speedup": speedup, "best_fixed": best,
            "quoting_adaptive_over_best_fixed": speedup[f"{short}_adaptive"] / speedup[best],
        }
    return out


def expected_vs_emitted(trace: list) -> list[tuple[float, int]]:
    """(expected tokens at the choice, tokens emitted) of each speculative step in an adaptive engine's trace."""
    return [(choice[2], emitted) for choice, emitted in zip(trace, trace[1:])
            if isinstance(choice, list) and choice[0] > 0 and isinstance(emitted, int)]


def summarise(args: argparse.Namespace, configs: dict, prompts: dict, engines: dict, runs: dict,
              forwarded: dict[str, int]) -> dict:
    kinds = {"prose": [t for t in prompts if t.startswith("prose")], "quoting": ["quote_passage", "edit_code"]}
    clocks = (("cpu", "decode_cpu_s"), ("wall", "decode_s"))

    def tps(name: str, tasks_: list[str], clock: str, repeats: range) -> float:
        rs = [runs[name][t][i] for t in tasks_ for i in repeats]
        return sum(r["decode_tokens"] for r in rs) / max(sum(r[clock] for r in rs), 1e-9)

    def table(key: str, repeats: range) -> dict:
        return {name: {kind: tps(name, ts, key, repeats) for kind, ts in kinds.items()} for name in configs}

    tables = {clock: table(key, range(args.repeats)) for clock, key in clocks}
    plain = runs["plain"]
    identical = {name: all(r["tokens"] == plain[t][0]["tokens"] for t in prompts for r in runs[name][t])
                 for name in configs}
    ratios = {clock: ratios_of(t, configs, args.methods) for clock, t in tables.items()}
    # each repeat alone (every prompt once, all configurations interleaved): the spread of the ratios
    per_repeat = {clock: [ratios_of(table(key, range(i, i + 1)), configs, args.methods) for i in range(args.repeats)]
                  for clock, key in clocks}
    spread = {clock: {short: {ratio: [min(rs), max(rs)] for ratio in ("prose_adaptive_over_plain",
                                                                     "quoting_adaptive_over_best_fixed")
                              for rs in [[r[short][ratio] for r in per_repeat[clock]]]}
                      for short in per_repeat[clock][0]} for clock in per_repeat}
    gamma = {name: {t: [r["spec_decode"].get("gamma") for r in runs[name][t]] for t in prompts}
             for name in configs if name.endswith("_adaptive")}
    steps = {name: {kind: [pair for t in ts for r in runs[name][t] for pair in expected_vs_emitted(r["trace"])]
                    for kind, ts in kinds.items()} for name in gamma}
    realised = {name: {kind: {"speculative_steps": len(pairs),
                              "expected_tokens": round(sum(e for e, _ in pairs), 1),
                              "emitted_tokens": sum(n for _, n in pairs)} for kind, pairs in by_kind.items()}
                for name, by_kind in steps.items()}
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "device": args.device, "torch": torch.__version__,
            "engine": engines["plain"].model_name,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "prompts": prompts,
            "torch_threads": torch.get_num_threads(),
            "note": "configurations interleaved round-robin within each repeat; a shared host's load varies, so the "
                    "cpu clock (decode tokens per CPU second of this process) is the steadier one, wall beside it",
            "warmup_tokens": args.warmup_tokens,
            "adaptive_bookkeeping_us_per_step": round(1e6 * bookkeeping_seconds(max(args.gammas)), 2),
            "draft_tokens_forwarded_timed": {n: e.core.spec.proposer.tokens_forwarded - forwarded[n]
                                             for n, e in engines.items()
                                             if hasattr(e.core.spec.proposer, "tokens_forwarded")},
            "tokens_per_s": tables, "ratios": ratios, "ratio_spread_over_repeats": spread,
            "ratios_per_repeat": per_repeat, "identical_to_plain": identical,
            "adaptive_expected_vs_emitted": realised,
            "adaptive_trace": {n: {t: [r["trace"] for r in runs[n][t]] for t in prompts} for n in gamma},
            "adaptive_choices": gamma, "engine_stats": {n: e.stats().spec_decode for n, e in engines.items()},
            "peak_memory_gib": torch.cuda.max_memory_allocated() / GiB if args.device.startswith("cuda") else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="an engine directory with a draft (bie-trt build --draft-checkpoint)")
    ap.add_argument("--methods", default="draft_model,ngram", type=lambda v: v.split(","))
    ap.add_argument("--gammas", default="2,5", type=lambda v: [int(g) for g in v.split(",")],
                    help="the fixed γ measured beside the adaptive one (up to the largest)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--prose-file", help="news text, one article a line (default: two bundled paragraphs)")
    ap.add_argument("--prose-prompts", type=int, default=4)
    ap.add_argument("--prose-words", type=int, default=40, help="words of each article's opening")
    ap.add_argument("--passage-chars", type=int, default=700, help="characters of the passage to quote")
    ap.add_argument("--warmup-tokens", type=int, default=32,
                    help="tokens of each engine's untimed first request (an adaptive engine measures its costs)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU clock counts all of them)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="the GPU memory cap (cuda only)")
    ap.add_argument("--smoke", action="store_true", help="a few tokens, one repeat: checks the script end to end")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/adaptive_spec_cpu.json"))
    args = ap.parse_args()
    if args.smoke:
        args.max_tokens, args.repeats, args.prose_prompts, args.warmup_tokens = 6, 1, 1, 8
    torch.set_num_threads(args.threads)
    result = run(args)
    print(json.dumps({"tokens_per_s": result["tokens_per_s"], "ratios": result["ratios"],
                      "spread": result["ratio_spread_over_repeats"],
                      "expected_vs_emitted": result["adaptive_expected_vs_emitted"],
                      "identical_to_plain": result["identical_to_plain"]}, indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
