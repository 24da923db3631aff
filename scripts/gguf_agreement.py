"""Greedy agreement of engines with references running a GGUF itself; JSON on stdout (and --out).

Five prompts of --prompt-tokens tokens from a text (evenly spaced windows, each led by the BOS token where the
tokenizer puts one before a text), each continued greedily for
--tokens tokens by each reference (--reference, repeatable: `transformers`, fp32 on the weights the `gguf`
package dequantises; `llama.cpp`, node-llama-cpp's CPU build on the file, scripts/llama_cpp.py) and by each
engine with an FP16 KV cache. `prefix` counts the tokens up to the first disagreement (after it the two
continue different texts); `same_position` counts positions that agree anyway. `forced` asks each engine for its
greedy next token after the prompt and each reference's own first i tokens, i = 0..--tokens-1 (teacher-forced:
one divergence does not carry over), and lists where it differs with the margin between the two tokens; for
llama.cpp, `llama_cpp_self` lists where its greedy tokens differ from its own top token over the same sequence
evaluated as one prompt (its decode path against its prompt path). Each engine must be built from the file
itself (`bie-trt build --checkpoint FILE.gguf`): one built from anything else, a conversion of the same file
included (a built-in name without `.gguf`), is refused unless --converted is given, and each engine's
`file_weights` in the JSON says which it is.

    python scripts/gguf_agreement.py --gguf FILE.gguf --engine engines/a --reference transformers \\
        --reference llama.cpp --out benchmarks/results/gguf_agreement_cpu.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import llama_cpp
from report import emit


def agreement(outs: list[list[int]], reference: list[list[int]], tokens: int) -> dict:
    prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, reference)]
    same = [sum(a == b for a, b in zip(o, r)) for o, r in zip(outs, reference)]
    return {"prefix": prefix, "prefix_total": sum(prefix), "same_position": same, "same_position_total": sum(same),
            "of": len(outs) * tokens}


def forced(engine, prompts: list[list[int]], reference: list[list[int]]) -> dict:
    """The engine's greedy next token after each prompt plus the reference's first i tokens, against the
    reference's token i: counts per prompt and, where they differ, [prompt, position, reference token, ours,
    our log-prob margin of ours over theirs] (None: theirs is not in our top 20)."""
    from bie_trt.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    same, differ = [], []
    for j, (p, ref) in enumerate(zip(prompts, reference)):
        same.append(0)
        for i, want in enumerate(ref):
            out = engine.generate(p + ref[:i], params)
            got, lp = out.token_ids[0], out.logprobs[0]
            if got == want:
                same[-1] += 1
            else:
                differ.append([j, i, want, got, round(lp[got] - lp[want], 4) if want in lp else None])
    return {"same": same, "same_total": sum(same), "of": sum(map(len, reference)), "differ": differ}


def llama_cpp_self(gguf: Path, prompts: list[list[int]], tokens: list[list[int]], context: int) -> list:
    """Where llama.cpp's greedy tokens (its decode path) differ from its own top token when the same sequence is
    evaluated as one prompt: [prompt, position, greedy token, its prompt-path top token, that top's margin]."""
    rows = llama_cpp.next_token_logprobs(gguf, [p + t[:-1] for p, t in zip(prompts, tokens)],
                                         [len(p) - 1 for p in prompts], context=context)
    differ = []
    for j, (seq_rows, toks) in enumerate(zip(rows, tokens)):
        for i, (row, tok) in enumerate(zip(seq_rows, toks)):
            top = max(row, key=row.get)
            if top != tok:
                differ.append([j, i, tok, top, round(row[top] - row[tok], 4) if tok in row else None])
    return differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--engine", action="append", required=True)
    ap.add_argument("--text", default="builtin:python-docs")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=700)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reference", action="append", choices=["transformers", "llama.cpp"])
    ap.add_argument("--converted", action="store_true",
                    help="also compare engines not built from the file itself (a conversion: bie-trt quantize, "
                         "a built-in name without .gguf)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from bie_trt.config import EngineConfig
    from bie_trt.engine_format import read_manifest
    from bie_trt.sampling_params import SamplingParams
    from bie_trt.eval_texts import load_eval_text, text_token_ids
    from bie_trt.executor.engine import BieEngine

    # checked before the references run (minutes): a conversion's tokens say nothing about the runtime
    file_weights = {e: read_manifest(e).source.is_file(args.gguf) for e in args.engine}
    for e, own in file_weights.items():
        if not own and not args.converted:
            ap.error(f"{e} was built from {read_manifest(e).source.checkpoint}, not from {args.gguf.name}: its "
                     f"weights are not the file's. Build it with `bie-trt build --checkpoint {args.gguf}`, or pass "
                     f"--converted to compare a conversion.")
    prompts = llama_cpp.prompt_windows(text_token_ids(args.engine[0], load_eval_text(args.text)),
                                       text_token_ids(args.engine[0], ""), args.prompts, args.prompt_tokens)
    references = {}
    for name in args.reference or ["transformers"]:
        if name == "llama.cpp":
            context = args.prompt_tokens + args.tokens + 16
            references[name] = llama_cpp.greedy(args.gguf, prompts, args.tokens, context=context)["tokens"]
            self_differ = llama_cpp_self(args.gguf, prompts, references[name], context)
            continue
        model = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        with torch.no_grad():
            references[name] = [model.generate(torch.tensor([p]), max_new_tokens=args.tokens,
                                               min_new_tokens=args.tokens, do_sample=False)[0, len(p):].tolist()
                                for p in prompts]
        del model
    result = {"gguf": args.gguf.name, "text": args.text, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
              "kv_cache": "fp16", "references": references, "engines": []}
    if "llama.cpp" in references:
        result["llama_cpp_self"] = self_differ
    for engine_dir in args.engine:
        engine = BieEngine(EngineConfig(engine_dir=engine_dir, device="cpu", kv_cache_dtype="fp16"))
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        outs = [engine.generate(p, params).token_ids for p in prompts]
        result["engines"].append({"engine": engine_dir, "source": engine.core.runner.manifest.source.checkpoint,
                                  "weight_group_size": engine.core.runner.manifest.source.weight_group_size,
                                  "file_weights": file_weights[engine_dir],
                                  "tokens": outs, "against": {name: agreement(outs, reference, args.tokens)
                                                              for name, reference in references.items()},
                                  "forced": {name: forced(engine, prompts, reference)
                                             for name, reference in references.items()}})
        del engine
    emit(result, args.out)


if __name__ == "__main__":
    main()
