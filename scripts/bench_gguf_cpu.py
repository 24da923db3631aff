"""Prefill and decode speed on the CPU, bie-trt against llama.cpp (node-llama-cpp's CPU build) on the same
GGUF file, the same prompt token ids and the same number of threads; JSON on stdout (and --out).

Each engine continues one prompt of --prompt-tokens tokens (from a text) greedily for --tokens tokens,
--runs times: prefill is the time to the first new token (tokens/s: prompt tokens over it), decode the
time of the rest. bie-trt's prefill is a generate of one token; its decode the rest of a full generate.
The CPU is not this engine's target: reported side by side, no target.

    python scripts/bench_gguf_cpu.py --gguf FILE.gguf --engine engines/e --out benchmarks/results/x.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import llama_cpp
from report import emit


def _rates(prompt_tokens: int, tokens: int, prefill_s: list[float], decode_s: list[float]) -> dict:
    prefill, decode = statistics.median(prefill_s), statistics.median(decode_s)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "prefill_tok_s": prompt_tokens / prefill,
            "decode_tok_s": (tokens - 1) / decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--text", default="builtin:python-docs")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    from bie_trt.config import EngineConfig
    from bie_trt.eval_texts import load_eval_text, text_token_ids
    from bie_trt.executor.engine import BieEngine
    from bie_trt.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    prompt = text_token_ids(args.engine, load_eval_text(args.text))[:args.prompt_tokens]
    engine = BieEngine(EngineConfig(engine_dir=args.engine, device="cpu"))
    # the first generate pays one-off costs (the CPU path dequantises each weight once and keeps it)
    engine.generate(prompt[:16], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    prefill, decode = [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        first = time.perf_counter() - start
        start = time.perf_counter()
        engine.generate(prompt, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
        prefill.append(first)
        decode.append(time.perf_counter() - start - first)
    ours = _rates(len(prompt), args.tokens, prefill, decode)
    del engine
    theirs = llama_cpp.greedy(args.gguf, [prompt] * args.runs, args.tokens, context=len(prompt) + args.tokens + 16,
                              threads=args.threads)
    emit({"gguf": args.gguf.name, "engine": args.engine, "prompt_tokens": len(prompt), "tokens": args.tokens,
          "runs": args.runs, "threads": args.threads, "device": "cpu",
          "bie-trt": ours, "llama.cpp": {**_rates(len(prompt), args.tokens, theirs["prefill_s"], theirs["decode_s"]),
                                         "version": f"node-llama-cpp {llama_cpp.VERSION}"}}, args.out)


if __name__ == "__main__":
    main()
