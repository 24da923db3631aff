"""Speculative decoding: what n-gram proposals buy, and what verifying γ + 1 tokens costs.

CPU part (always): one engine with speculation off and one with n-gram lookup, greedy, on
input-grounded tasks (quote a given passage, edit given code) and on free generation. For each:
acceptance rate (accepted ÷ proposed), mean tokens accepted per proposal, tokens per decode step,
decode tokens/s with and without, their ratio, and whether the tokens are identical.

Self-draft part (`--self-draft DEFAULT FULL`): two engines built from one checkpoint with itself as
the draft, one with the default draft settings and one with `--draft-vocab-size` covering the whole
vocabulary. Greedy, on short and long English prose, source code and technical text: acceptance
(accepted ÷ proposed) of each, side by side. A self-draft should accept nearly everything; what the
default loses against the full vocabulary is what its reduced head costs. Any two draft engines of
one target compare the same way (each row records the draft's K, R and window).

GPU part (`--gpu`), under an 8 GiB cap: at 4k / 32k / 64k context for Llama-3-8B shapes with an INT4
KV cache and a Llama-3.2-1B draft (random AWQ-shaped weights), each step replayed from its CUDA graph:
the verify cost T(γ+1) / T(1) of one sequence (also eager, and crossing a window block), one draft
proposal (its bounded-cache decode, its two heads, the logits to the host), a whole round of γ
proposals and the verify timed together, and the tokens/s a round gives at acceptance 0.6 / 0.7 / 0.8
against plain decoding's (the acceptance is assumed: random weights accept nothing). `--smoke` runs both parts small (a few
tokens; tiny shapes for the GPU part, on the CPU when there is no GPU) so the tests run the script.

    python scripts/bench_spec.py --engine engines/smollm2 --out benchmarks/results/spec_cpu.json
    python scripts/bench_spec.py --gpu --out benchmarks/results/spec_gpu.json
    python scripts/bench_spec.py --self-draft engines/smollm2-self engines/smollm2-self-full \
        --max-tokens 48 --out benchmarks/results/spec_self_draft.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.engine_format import read_manifest
from bie_trt.kernels.int8_rows import Int8Rows
from bie_trt.kv.pool import allocate_pools
from bie_trt.model.cuda_graphs import DecodeGraphs
from bie_trt.model.llama import LlamaModel, SeqInput
from bie_trt.model.synthetic import llama32_1b, llama3_8b, random_weights, tiny_llama
from bie_trt.plan import (DEFAULT_DRAFT_SINK_TOKENS, DEFAULT_DRAFT_WINDOW_TOKENS, draft_kv_blocks_per_seq,
                          draft_request_rows, draft_vocab_rows, kv_pool_blocks)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import GiB, cuda_peak_gib, fill_cache, sync  # noqa: E402

PASSAGE = Path(__file__).resolve().parents[2] / "shared" / "data" / "lee_background.txt"
FALLBACK = ("The river rises in the hills above the old mill and runs south through three villages before it "
            "meets the sea. In spring the water is high and fast; in late summer children walk across it on the "
            "stones below the bridge, and the miller's dog follows them as far as the second pool.")
CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def adults(users):
    return [u for u in users if u["age"] >= 18]
'''


def tasks(passage: str) -> dict[str, str]:
    return {
        "quote_passage": f"Repeat the following passage word for word.\n\nPassage:\n{passage}\n\nRepeated passage:\n",
        "edit_code": f"Rename the variable `users` to `people` everywhere in this code.\n\n{CODE}\nRenamed code:\n",
        "free_generation": "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\n",
    }


def self_draft_prompts(passage: str) -> dict[str, str]:
    """Short requests and long documents that are none of ours: an English news text, and the
    standard library's own code and technical prose (the running Python's, so any host has them)."""
    import email._header_value_parser as rfc5322
    import textwrap

    return {
        "prose_short": "Write a short story about a lighthouse keeper.\n\n",
        "prose_long": f"{passage}\n\nQuestion: Who is named in the text above, and what happened?\nAnswer:",
        "code_short": "# Python: read a CSV file of users and print the oldest one.\nimport csv\n\n",
        "code_long": inspect.getsource(textwrap)[:6000] + "\n\n# Tests for the functions above\nimport unittest\n",
        "technical_short": "Explain how a B-tree index speeds up lookups in a database.\n\n",
        "technical_long": f"{rfc5322.__doc__}\n\nIn short, the parser",
    }


def first_uses_outside(engine: BieEngine, prompt: str, output: list[int]) -> int:
    """Output tokens outside the draft's static ids that neither the prompt nor earlier output held:
    the proposals a draft over the static ids and the request's own can never get right."""
    static = set(json.loads((Path(engine.config.engine_dir) / "draft" / "vocab.json").read_text())["ids"])
    seen = set(engine.tokenizer(prompt)["input_ids"]) | static
    count = 0
    for t in output:
        count += t not in seen
        seen.add(t)
    return count


def run_self_draft_part(args: argparse.Namespace) -> dict:
    text = PASSAGE.read_text()[:args.self_draft_chars] if PASSAGE.exists() else FALLBACK
    spec = {"method": "draft_model", "num_speculative_tokens": args.num_speculative_tokens}
    engines = {name: BieEngine(EngineConfig(engine_dir=path, device="cpu", speculative=spec))
               for name, path in zip(("default", "full_vocab"), args.self_draft)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for task, prompt in list(self_draft_prompts(text).items())[:1 if args.smoke else None]:
        row: dict = {"task": task}
        for name, engine in engines.items():
            draft = engine.core.runner.manifest.draft
            out = engine.generate(prompt, params)
            s = out.spec_decode
            row["prompt_tokens"] = out.usage.prompt_tokens
            row[name] = {"draft_vocab_size": draft.vocab_size, "request_vocab": draft.request_vocab,
                         "draft_window": draft.window,
                         **s, "acceptance_rate": s["num_accepted_tokens"] / max(s["num_draft_tokens"], 1)}
            row.setdefault("tokens", out.token_ids)
            row[f"{name}_identical"] = out.token_ids == row["tokens"]
        row["first_uses_outside_static"] = first_uses_outside(engines["default"], prompt, row.pop("tokens"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    total = {name: sum(r[name]["num_accepted_tokens"] for r in rows) / max(sum(r[name]["num_draft_tokens"]
                                                                             for r in rows), 1)
             for name in engines}
    print(json.dumps({"acceptance_all_tasks": total}), flush=True)
    return {"gamma": args.num_speculative_tokens, "acceptance_all_tasks": total, "rows": rows}


def run_engine_part(args: argparse.Namespace) -> list[dict]:
    text = PASSAGE.read_text()[:args.passage_chars] if PASSAGE.exists() else FALLBACK
    configs = {"off": {"method": "none"},
               "ngram": {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}}
    engines = {name: BieEngine(EngineConfig(engine_dir=args.engine, device="cpu", speculative=spec))
               for name, spec in configs.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for engine in engines.values():   # warm-up: first-call costs out of the timings
        engine.generate("Hello", SamplingParams(temperature=0, max_tokens=4))
    rows = []
    chosen = list(tasks(text).items())[:1 if args.smoke else None]   # smoke: one task is enough to run the code
    for task, prompt in chosen:
        outs = {}
        for name, engine in engines.items():
            best = None
            for _ in range(args.repeats):   # the best of a few runs: the host is shared
                engine.reset_prefix_cache()
                out = engine.generate(prompt, params)
                if best is None or out.decode_tokens_per_s > best.decode_tokens_per_s:
                    best = out
            outs[name] = best
        off, spec = outs["off"], outs["ngram"]
        s = spec.spec_decode
        decode_tokens = spec.usage.completion_tokens - 1   # the first comes from the prefill
        steps = decode_tokens - s["num_accepted_tokens"]   # each verify step emits one token beyond its accepted
        row = {
            "task": task, "prompt_tokens": spec.usage.prompt_tokens, "completion_tokens": spec.usage.completion_tokens,
            "identical_tokens": spec.token_ids == off.token_ids, **s,
            "acceptance_rate": s["num_accepted_tokens"] / s["num_draft_tokens"] if s["num_draft_tokens"] else 0.0,
            "mean_accepted_per_proposal": s["num_accepted_tokens"] / s["num_drafts"] if s["num_drafts"] else 0.0,
            "tokens_per_decode_step": decode_tokens / steps if steps else 1.0,
            "tokens_per_s_off": off.decode_tokens_per_s, "tokens_per_s_ngram": spec.decode_tokens_per_s,
            "speedup": spec.decode_tokens_per_s / off.decode_tokens_per_s,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def expected_tokens_per_step(alpha: float, num_speculative_tokens: int) -> float:
    """Tokens one verify step emits when each proposal is accepted with probability alpha, independently."""
    return (1 - alpha ** (num_speculative_tokens + 1)) / (1 - alpha)


def timed(fn: Callable[[], object], steps: int, device: torch.device) -> float:
    """Seconds a call of `fn` takes, after two untimed calls."""
    for _ in range(2):
        fn()
    sync(device)
    begin = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - begin) / steps


class DraftStep:
    """One proposal of a draft model as `DraftModelProposer` makes it, its forward replayed from a CUDA
    graph: a decode of its bounded FP16 cache (sinks + window, at original positions past it), then its
    static head (K rows) and a request's own rows (R) over the hidden state, the logits brought to the host
    where the proposal is drawn."""

    def __init__(self, cfg: ModelConfig, group: int, device: torch.device, dtype: torch.dtype, context: int) -> None:
        self.model = LlamaModel(cfg, random_weights(cfg, group, seed=1, device=device), device, dtype,
                                embedding_on_host=True)
        kv = KVCacheConfig(dtype="fp16", sink_tokens=DEFAULT_DRAFT_SINK_TOKENS, window=DEFAULT_DRAFT_WINDOW_TOKENS)
        blocks = draft_kv_blocks_per_seq(kv.sink_tokens, kv.window, kv.block_size)
        self.pools = allocate_pools(cfg, kv, blocks, 0, dtype, device, scratch_block=True)
        tokens = blocks * kv.block_size
        self.graphs = DecodeGraphs(self.model, self.pools, [1], tokens, self.pools.scratch_block,
                                   capture=device.type == "cuda", head=False)
        self.step = [SeqInput(torch.ones(1, dtype=torch.long), tokens - 1, list(range(blocks)),
                              rope_offset=context - tokens)]
        k = draft_vocab_rows(cfg, "int8", None)
        head = self.model.lm_head
        self.heads = [Int8Rows(head.q[:n], head.scale[:n]) for n in (k, draft_request_rows(cfg, k, None))]

    def __call__(self) -> torch.Tensor:
        (row,) = self.graphs.run(self.step)
        return torch.cat([self.model.head_logits(row[None], h)[0] for h in self.heads]).float().cpu()


def run_verify_part(args: argparse.Namespace) -> dict:
    """Decode, verify and a draft's proposal, each replayed from its CUDA graph (run eagerly off the GPU),
    at each context; a whole round (γ proposals, then the verify) timed as one, and the tokens/s it gives
    at acceptance 0.6 / 0.7 / 0.8 beside plain decoding's."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gamma = args.num_speculative_tokens
    if args.smoke:
        cfg, draft_cfg, group = tiny_llama(hidden_size=128, num_heads=2, num_kv_heads=1), tiny_llama(), 64
    else:
        cfg, draft_cfg, group = llama3_8b(), llama32_1b(), 128
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total))
    model = LlamaModel(cfg, random_weights(cfg, group, device=device), device, dtype, embedding_on_host=True)
    kv = KVCacheConfig(dtype="int4_asym")
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        n_fp, n_q = kv_pool_blocks(cfg, kv, ctx + gamma + 1, 1, 512)
        pools = allocate_pools(cfg, kv, n_fp, n_q, dtype, device, scratch_block=True)
        table = fill_cache(pools, ctx + gamma + 1, kv)
        graphs = DecodeGraphs(model, pools, [1], ctx + gamma + 1, pools.scratch_block, capture=device.type == "cuda",
                              verify_rows=[gamma + 1])
        decode = [SeqInput(torch.ones(1, dtype=torch.long), ctx - 1, table)]
        verify = [SeqInput(torch.ones(gamma + 1, dtype=torch.long), ctx - 1, table, all_logits=True)]
        # rows crossing a window block: two runs, each reading the context through its own view
        crossing = [SeqInput(torch.ones(2, dtype=torch.long), ctx - 1, table, all_logits=True),
                    SeqInput(torch.ones(gamma - 1, dtype=torch.long), ctx + 1, table, all_logits=True)]
        draft = DraftStep(draft_cfg, group, device, dtype, ctx)

        def speculative_round() -> None:
            for _ in range(gamma):
                draft()
            graphs.run(verify)

        t1 = timed(lambda: graphs.run(decode), args.steps, device)
        tg = timed(lambda: graphs.run(verify), args.steps, device)
        row = {"context": ctx, "kv": kv.dtype, "gamma": gamma, "ms_verify_1": 1e3 * t1,
               f"ms_verify_{gamma + 1}": 1e3 * tg, "verify_cost_ratio": tg / t1,
               "ms_verify_crossing": 1e3 * timed(lambda: graphs.run(crossing), args.steps, device),
               f"ms_verify_{gamma + 1}_eager": 1e3 * timed(lambda: model.forward(verify, pools), args.steps, device),
               "ms_draft_step": 1e3 * timed(draft, args.steps, device),
               "ms_round": 1e3 * timed(speculative_round, max(1, args.steps // gamma), device),
               "peak_memory_gib": cuda_peak_gib(device)}
        row["tokens_per_s_plain"] = 1e3 / row["ms_verify_1"]
        row["tokens_per_s_speculative"] = {str(a): 1e3 * expected_tokens_per_step(a, gamma) / row["ms_round"]
                                           for a in (0.6, 0.7, 0.8)}
        row["implied_speedup"] = {a: t / row["tokens_per_s_plain"] for a, t in row["tokens_per_s_speculative"].items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del pools, graphs, draft
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "model": cfg.to_dict(),
            "draft": draft_cfg.to_dict(), "weight_group_size": group, "cap_gib": args.cap_gib,
            "graphs": device.type == "cuda", "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", help="engine directory for the CPU part (e.g. built from smollm2-135m)")
    ap.add_argument("--num-speculative-tokens", "--gamma", dest="num_speculative_tokens", type=int, default=5,
                    help="tokens proposed per step")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--passage-chars", type=int, default=700)
    ap.add_argument("--self-draft", nargs=2, metavar=("DEFAULT", "FULL"),
                    help="two self-draft engines: default draft settings, and the whole vocabulary")
    ap.add_argument("--self-draft-chars", type=int, default=4000, help="characters of the long prose prompt")
    ap.add_argument("--gpu", action="store_true", help="also time T(γ+1)/T(1) at 8B shapes (needs a CUDA GPU)")
    ap.add_argument("--contexts", default="4096,32768,65536")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="emulate a card of this size (the GPU part)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="a few tokens and tiny shapes: checks the script end to end")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/spec_cpu.json"))
    args = ap.parse_args()
    if args.smoke:
        args.max_tokens, args.repeats, args.contexts, args.steps = 6, 1, "256", 2
    elif args.gpu and not torch.cuda.is_available():
        print("bench_spec --gpu needs a CUDA GPU (none here; --smoke runs it small on the CPU).", file=sys.stderr)
        sys.exit(2)
    out = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "smoke": args.smoke, "gamma": args.num_speculative_tokens,
           "max_tokens": args.max_tokens, "engine": None, "tasks": None, "self_draft": None, "verify": None}
    if args.engine:
        manifest = read_manifest(args.engine)
        out["engine"] = {"model": manifest.model_name, "kv": manifest.kv.dtype}
        out["tasks"] = run_engine_part(args)
    if args.self_draft:
        out["self_draft"] = run_self_draft_part(args)
    if args.gpu or args.smoke:
        out["verify"] = run_verify_part(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
