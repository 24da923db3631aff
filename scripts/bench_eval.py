"""How long `bie-trt eval` takes for one window, next to what the machine does in the same minute; JSON on
stdout (and --out).

The eval command runs as its own process (load included, as a user waits for it). Beside it, the reference:
transformers' fp32 forward of a Llama with the engine's shapes (random weights: the time depends on the
shapes only) over the same number of tokens, best of --reference-runs. Eval runs two such forwards (the FP16
baseline and the variant), so `ratio` (eval's wall time over one reference forward) compares machines of
different speeds.

    python scripts/bench_eval.py --engine engines/smollm2 --out benchmarks/results/eval_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from report import emit

ROOT = Path(__file__).resolve().parents[1]


def time_eval(engine: str, text: str, context: int) -> dict:
    cmd = [sys.executable, "-m", "bie_trt.cli", "eval", "--engine", engine, "--text", text, "--context", str(context),
           "--max-windows", "1", "--json"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"bench_eval: the eval command failed: {' '.join(cmd[1:])}\n{done.stderr.strip()}")
    result = json.loads(done.stdout)
    return {"seconds": round(seconds, 2), "command": " ".join(cmd[1:]),
            "rows": [{k: r[k] for k in ("label", "ppl", "kld")} for r in result["rows"]]}


def time_reference(engine: str, context: int, runs: int) -> dict:
    """transformers' fp32 forward over `context` tokens at the engine's shapes, best of `runs`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bie_trt.engine_format import read_manifest

    cfg = read_manifest(engine).model
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, max_position_embeddings=max(context, cfg.max_position_embeddings),
        tie_word_embeddings=cfg.tie_word_embeddings, rope_theta=cfg.rope_theta)).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, context))
    times = []
    with torch.inference_mode():
        for _ in range(runs):
            start = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - start)
    return {"seconds": round(min(times), 2), "all_seconds": [round(t, 2) for t in times],
            "attention": model.config._attn_implementation}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--text", default="builtin:python-docs")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reference-runs", type=int, default=2, help="transformers forwards to time (0: none)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = {"engine": args.engine, "text": args.text, "context": args.context, "cpus": os.cpu_count(),
              "eval": time_eval(args.engine, args.text, args.context)}
    if args.reference_runs:
        ref = time_reference(args.engine, args.context, args.reference_runs)
        result["reference_fp32_forward"] = ref
        result["ratio"] = round(result["eval"]["seconds"] / ref["seconds"], 2)
    emit(result, args.out)


if __name__ == "__main__":
    main()
