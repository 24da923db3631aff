"""What the target's step costs, by rows a sequence and by context: the figures adaptive γ estimates from its
own steps, measured here directly (one sequence, the same step repeated, the median of the repeats).

For each context (tokens already in the cache) and each r = 1 .. --rows (a plain decode, then a verify of
r - 1 proposals), the forward over r tokens at that position is timed --repeats times after --warmup
untimed runs. Reported: milliseconds a step, and each r relative to the plain step at the same context.
On a CPU the clock is the process's CPU seconds (one torch thread by default); on a GPU, wall seconds
with the device synchronised.

    python scripts/bench_step_costs.py --engine engines/smollm2-draft --out benchmarks/results/step_costs_cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bie_trt import EngineConfig, SamplingParams
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.executor.sequence import Sequence
from bie_trt.kernels.step_inputs import SeqInput
from bie_trt.sampling import make_generator
from bie_trt.spec_decode.adaptive import step_clock


def step_seconds(runner: ModelRunner, seq: Sequence, context: int, rows: int, repeats: int, warmup: int) -> float:
    """The median time of the forward over `rows` tokens at position `context` (its K/V rewritten each run)."""
    ids = torch.tensor(seq.prompt_ids[context:context + rows])
    cuda, clock = runner.device.type == "cuda", step_clock(runner.device.type)   # adaptive γ's own clock
    times = []
    for i in range(warmup + repeats):
        start = clock()
        runner.forward([SeqInput(ids, context, seq.block_table, all_logits=rows > 1)])
        if cuda:
            torch.cuda.synchronize(runner.device)
        if i >= warmup:
            times.append(clock() - start)
    return statistics.median(times)


def measure(runner: ModelRunner, contexts: list[int], max_rows: int, repeats: int, warmup: int) -> list[dict]:
    blocks, vocab, chunk = runner.block_manager(), runner.model_config.vocab_size, 256
    out = []
    for context in contexts:
        tokens = [(17 * t + 5) % vocab for t in range(context + max_rows)]
        seq = Sequence(tokens, SamplingParams(), make_generator(SamplingParams(), 0))
        blocks.grow(seq, len(tokens))
        for start in range(0, context, chunk):   # the context, prefilled in chunks
            runner.forward([SeqInput(torch.tensor(tokens[start:min(context, start + chunk)]), start, seq.block_table)])
        ms = [1e3 * step_seconds(runner, seq, context, r, repeats, warmup) for r in range(1, max_rows + 1)]
        row = {"context": context, "ms": {str(r): round(m, 3) for r, m in enumerate(ms, 1)},
               "per_plain": {str(r): round(m / ms[0], 3) for r, m in enumerate(ms, 1)}}
        print(json.dumps(row), flush=True)
        out.append(row)
        blocks.free(seq)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="an engine directory (bie-trt build)")
    ap.add_argument("--contexts", default="64,400,1000,1800", help="tokens in the cache before the step")
    ap.add_argument("--rows", type=int, default=6, help="the most rows a sequence (γ_max + 1)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/step_costs_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(EngineConfig(engine_dir=args.engine, device=args.device, speculative={"method": "none"}))
    runner.capture_verify_graphs(args.rows - 1)   # as the engine does (CUDA graphs at the widest verify only)
    contexts = [int(c) for c in args.contexts.split(",")]
    if max(contexts) + args.rows > runner.max_model_len:
        raise SystemExit(f"--contexts up to {max(contexts)} with {args.rows} rows need {max(contexts) + args.rows} "
                         f"tokens; the engine holds {runner.max_model_len} (build with a larger --max-model-len)")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "engine": args.engine, "device": args.device,
              "torch": torch.__version__, "torch_threads": args.threads, "repeats": args.repeats,
              "clock": "wall, synchronised" if args.device.startswith("cuda") else "process CPU seconds",
              "steps": measure(runner, contexts, args.rows, args.repeats, args.warmup)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
