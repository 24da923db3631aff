"""How far llama.cpp's next-token distribution is from transformers' on a GGUF's weights, beside how far
llama.cpp moves from itself under its own context options (flash attention off, a full-size sliding-window
cache) and how far transformers moves with its sliding window one position shorter or longer.

Each prompt of scripts/gguf_agreement.py's JSON (run with both references) is followed by transformers' greedy
tokens and evaluated as one sequence (teacher-forced) by llama.cpp under each option set and by transformers
(fp32, the file's weights as the `gguf` package dequantises them) as loaded and with the window changed by one;
at each of the continuation's positions, over llama.cpp's 40 likeliest tokens: the KL divergence of the two
(each renormalised over those 40), the mean |difference| of their log-probabilities over its 10 likeliest, and where the
top tokens differ, both margins. llama.cpp also continues each prompt greedily under each option set (its
decode path), counted against transformers' tokens as scripts/gguf_agreement.py counts.

    python scripts/llama_cpp_spread.py --gguf FILE.gguf --engine ENGINE \\
        --agreement benchmarks/results/gguf_agreement_gemma_llama_cpp_cpu.json --out RESULT.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import llama_cpp
from gguf_agreement import agreement
from report import emit

OPTIONS = {"default": {}, "flash attention off": {"flashAttention": False},
           "full-size sliding-window cache": {"swaFullCache": True}}


def distance(theirs: list[list[dict[int, float]]], ours: list[list[dict[int, float]]]) -> dict:
    """`theirs` (llama.cpp's top tokens' log-probs) against `ours`, position by position, over their tokens that
    `ours` holds too (all of them for transformers): mean and largest KL, mean |log-prob difference| over their
    10 likeliest, and [prompt, position, their margin, our margin] wherever the two top tokens differ."""
    kl, spread, differ = [], [], []
    for p, (rows_a, rows_b) in enumerate(zip(theirs, ours)):
        for i, (a, b) in enumerate(zip(rows_a, rows_b)):
            ids = sorted((t for t in a if t in b), key=a.get, reverse=True)
            pa = torch.tensor([a[t] for t in ids], dtype=torch.float64)
            pb = torch.tensor([b[t] for t in ids], dtype=torch.float64)
            qa, qb = pa.log_softmax(0), pb.log_softmax(0)   # both renormalised over the shared tokens
            kl.append(float((qa.exp() * (qa - qb)).sum()))
            spread.append(float((pa[:10] - pb[:10]).abs().mean()))
            top_b = max(b, key=b.get)
            if top_b != ids[0]:
                differ.append([p, i, round(a[ids[0]] - a.get(top_b, float("-inf")), 4), round(b[top_b] - b[ids[0]], 4)])
    return {"kl_mean": sum(kl) / len(kl), "kl_max": max(kl), "top10_logprob_diff_mean": sum(spread) / len(spread),
            "top1_differs": differ}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--engine", required=True, help="an engine built from the file (its tokenizer makes the prompts)")
    ap.add_argument("--agreement", required=True, type=Path,
                    help="scripts/gguf_agreement.py's JSON with the transformers reference")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from bie_trt.eval_texts import load_eval_text, text_token_ids

    run = json.loads(args.agreement.read_text())
    forced = run["references"]["transformers"]
    tokens = run["tokens"]
    prompts = llama_cpp.prompt_windows(text_token_ids(args.engine, load_eval_text(run["text"])),
                                       text_token_ids(args.engine, ""), len(forced), run["prompt_tokens"])
    sequences = [p + f[:-1] for p, f in zip(prompts, forced)]
    starts = [len(p) - 1 for p in prompts]
    context = run["prompt_tokens"] + tokens + 16
    llama = {name: llama_cpp.next_token_logprobs(args.gguf, sequences, starts, context=context, options=opts)
             for name, opts in OPTIONS.items()}
    greedy = {name: agreement(llama_cpp.greedy(args.gguf, prompts, tokens, context=context, options=opts)["tokens"],
                              forced, tokens) for name, opts in OPTIONS.items()}

    model = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    window = getattr(model.config, "sliding_window", None)
    variants = {"as loaded": window} | ({f"sliding window {w}": w for w in (window - 1, window + 1)} if window else {})
    ours = {}
    with torch.no_grad():
        for name, w in variants.items():
            model.config.sliding_window = w
            ours[name] = []
            for j, (seq, start) in enumerate(zip(sequences, starts)):
                logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, start:].double(), -1)
                # every llama.cpp run's top tokens at that position
                ours[name].append([{t: float(logp[i, t]) for t in set().union(*(run[j][i] for run in llama.values()))}
                                   for i in range(len(logp))])
    model.config.sliding_window = window
    emit({"gguf": args.gguf.name, "agreement": args.agreement.name, "prompt_tokens": run["prompt_tokens"],
          "tokens": tokens, "llama_cpp_options": OPTIONS, "sliding_window": window,
          "llama_cpp_vs_transformers": {f"{a} / {b}": distance(llama[a], ours[b]) for a in llama for b in ours},
          "llama_cpp_vs_its_default": {a: distance(llama["default"], llama[a])
                                       for a in llama if a != "default"},
          "llama_cpp_greedy_vs_transformers": greedy}, args.out)


if __name__ == "__main__":
    main()
