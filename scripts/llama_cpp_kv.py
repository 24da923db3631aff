"""llama.cpp's own quantised KV caches on a GGUF file, as the anchor for bie-trt's: perplexity and KL divergence
from its F16 cache over one window of a text, for each cache type it offers (node-llama-cpp's CPU build); JSON out.

The window is the one `bie-trt eval --engine E --text T --context N --max-windows 1` scores (the engine's
tokenizer, the text's first N tokens), so the two tables sit side by side: llama.cpp's Q8_0 and Q4_0 caches
against its F16, bie-trt's FP8 and INT4 against its FP16. llama.cpp exposes only the next-token log-probs of its
likeliest tokens, so its divergence is measured over the F16 run's 40 likeliest at each position, both
renormalised over them (a lower bound on the full one); perplexity uses the log-prob of the token that follows.

    python scripts/llama_cpp_kv.py --gguf ~/.cache/bie-trt/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --engine engines/coder-int4 --context 2048 --out benchmarks/results/llama_cpp_kv_coder_ctx2048.json
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import llama_cpp
from report import emit

CACHE_TYPES = ("F16", "Q8_0", "Q4_0")


def kl_over_top(reference: list[dict[int, float]], other: list[dict[int, float]]) -> float:
    """Mean KL(reference ‖ other) over positions, each over the reference's listed tokens that `other` lists
    too, both renormalised over them (positions where none is shared left out)."""
    def normalised(logp: list[float]) -> list[float]:
        top = max(logp)
        z = top + math.log(sum(math.exp(x - top) for x in logp))
        return [x - z for x in logp]

    kl = []
    for a, b in zip(reference, other):
        ids = [t for t in a if t in b]
        if ids:   # none only where the two runs' 40 likeliest tokens are disjoint
            la, lb = normalised([a[t] for t in ids]), normalised([b[t] for t in ids])
            kl.append(sum(math.exp(x) * (x - y) for x, y in zip(la, lb)))
    return sum(kl) / len(kl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--engine", required=True, help="an engine built from the file (its tokenizer makes the window)")
    ap.add_argument("--text", default="builtin:python-docs")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--cache-types", default=",".join(CACHE_TYPES),
                    help="llama.cpp's KV cache types (GGML type names), the first the reference")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from bie_trt.eval_texts import load_eval_text, text_token_ids

    ids = text_token_ids(args.engine, load_eval_text(args.text))[:args.context]
    rows, result = {}, {"gguf": args.gguf.name, "text": args.text, "context": len(ids), "caches": {}}
    for kind in args.cache_types.split(","):
        start = time.time()
        options = {"experimentalKvCacheKeyType": kind, "experimentalKvCacheValueType": kind}
        rows[kind], following = llama_cpp.following_logprobs(args.gguf, ids, context=args.context + 16,
                                                             options=options)
        scored = [f for f in following if f is not None]
        result["caches"][kind] = {"ppl": math.exp(-sum(scored) / len(scored)), "tokens_scored": len(scored),
                                  "seconds": round(time.time() - start, 1)}
    reference = args.cache_types.split(",")[0]
    for kind, entry in result["caches"].items():
        entry["ppl_delta_pct"] = 100 * (entry["ppl"] / result["caches"][reference]["ppl"] - 1)
        entry["kld_over_top40"] = kl_over_top(rows[reference], rows[kind])
    emit(result, args.out)


if __name__ == "__main__":
    main()
