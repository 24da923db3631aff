"""llama.cpp as a reference: greedy tokens (and their timings) from node-llama-cpp's prebuilt CPU build on
the same GGUF file and the same prompt token ids as bie-trt.

Installed once into a cache (no build; the package ships llama.cpp's binaries):

    npm install --prefix ~/.cache/bie-trt/llama-cpp node-llama-cpp@3.22.1 @node-llama-cpp/linux-x64@3.22.1

    python scripts/llama_cpp.py FILE.gguf --ids 1,2,3 --tokens 16
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

VERSION = "3.22.1"
INSTALL = (f"npm install --prefix ~/.cache/bie-trt/llama-cpp node-llama-cpp@{VERSION} "
           f"@node-llama-cpp/linux-x64@{VERSION}")
_SCRIPT = Path(__file__).with_name("llama_cpp_greedy.mjs")
_LOGITS_SCRIPT = Path(__file__).with_name("llama_cpp_logits.mjs")


def cache_dir() -> Path:
    return Path(os.environ.get("BIE_TRT_LLAMA_CPP", Path.home() / ".cache" / "bie-trt" / "llama-cpp"))


def module_path() -> Path:
    return cache_dir() / "node_modules" / "node-llama-cpp" / "dist" / "index.js"


def missing() -> str | None:
    """Why llama.cpp cannot run here (None when it can), naming the command that installs it."""
    if shutil.which("node") is None:
        return f"needs node (Node.js 20+) and node-llama-cpp: {INSTALL}"
    if not module_path().is_file():
        return f"needs node-llama-cpp in {cache_dir()}: {INSTALL}"
    return None


def prompt_windows(ids: list[int], lead: list[int], count: int, length: int) -> list[list[int]]:
    """`count` evenly spaced prompts of `length` tokens from a text's ids, each made as a tokenizer makes a prompt:
    `lead` (the ids a tokenizer puts before any text, `tokenizer("")`: Gemma's BOS, nothing for Qwen) and then a
    window of the text. Without it only the first window would carry a BOS and the others would start mid-text
    with none, a prompt no tokenizer makes (Gemma's continuations from such a prompt are near-ties everywhere)."""
    body = ids[len(lead):] if ids[:len(lead)] == lead else ids
    width = length - len(lead)
    step = (len(body) - width) // count
    return [lead + body[i * step:i * step + width] for i in range(count)]


def _node(script: Path, job: dict, timeout: float):
    why = missing()
    if why:
        raise RuntimeError(why)
    run = subprocess.run(["node", str(script)], input=json.dumps({"module": str(module_path()), **job}),
                         capture_output=True, text=True, timeout=timeout)
    if run.returncode:
        raise RuntimeError(f"node-llama-cpp failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def greedy(model: str | Path, prompts: list[list[int]], tokens: int, context: int = 4096,
           threads: int | None = None, timeout: float = 1800, options: dict | None = None) -> dict:
    """{"tokens": [[ids]] (each prompt's `tokens` greedy continuations), "prefill_s": [...], "decode_s": [...]}:
    prefill is the time to the first new token, decode the time of the rest. `options`: node-llama-cpp's
    createContext options (e.g. {"flashAttention": false}) over its defaults."""
    return _node(_SCRIPT, {"model": str(model), "prompts": prompts, "tokens": tokens, "context": context,
                           "threads": threads or os.cpu_count(), "options": options or {}}, timeout)


def next_token_logprobs(model: str | Path, sequences: list[list[int]], starts: list[int], top: int = 40,
                        context: int = 4096, threads: int | None = None, timeout: float = 1800,
                        options: dict | None = None) -> list[list[dict[int, float]]]:
    """llama.cpp's log-probabilities of its `top` likeliest next tokens at every position of each sequence from
    its start on, the sequence evaluated as one prompt (teacher-forced): [sequence][position] -> {id: logprob}."""
    return [[row for row, _ in seq] for seq in _logprob_rows(model, sequences, starts, top, context, threads,
                                                             timeout, options)]


def following_logprobs(model: str | Path, sequence: list[int], top: int = 40, context: int = 4096,
                       threads: int | None = None, timeout: float = 1800, options: dict | None = None
                       ) -> tuple[list[dict[int, float]], list[float]]:
    """llama.cpp over one sequence as one prompt (teacher-forced): at each position but the last, its `top`
    likeliest next tokens' log-probs and the log-prob of the token that does follow (what perplexity needs)."""
    rows = _logprob_rows(model, [sequence], [0], top, context, threads, timeout, options)[0][:-1]
    return [r for r, _ in rows], [f for _, f in rows]


def _logprob_rows(model, sequences, starts, top, context, threads, timeout, options):
    """[sequence][position] -> ({id: log-prob} of its top tokens, the following token's log-prob or None)."""
    rows = _node(_LOGITS_SCRIPT, {"model": str(model), "sequences": sequences, "starts": starts, "top": top,
                                  "context": context, "threads": threads or os.cpu_count(),
                                  "options": options or {}}, timeout)
    out = []
    for seq in rows:
        out.append([])
        for row in seq:
            logits = {int(i): float(v) for i, v in row["top"]}
            norm = max(logits.values()) + math.log(row["total"])   # total = sum(exp(logit - max)) over the vocabulary
            following = row.get("following")
            out[-1].append(({i: v - norm for i, v in logits.items()}, None if following is None else following - norm))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--ids", required=True, help="the prompt's token ids, comma-separated")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    print(json.dumps(greedy(args.model, [[int(i) for i in args.ids.split(",")]], args.tokens)))


if __name__ == "__main__":
    main()
