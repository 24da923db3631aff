"""Structured-output costs: grammar compile time and token-mask time per schema, at the bundled model's
vocabulary (SmolLM2, 49,152 tokens) and at Llama-3's size (128,256 tokens), for the grammar library the
engine uses (llguidance) and, when installed, xgrammar beside it; then decode tokens/s on the bundled
engine with and without a schema.

The 128,256-token vocabulary is synthetic (the Llama-3 tokenizer is not bundled): SmolLM2's 49,152
tokens, then concatenations of two of them drawn at random (seeded) until the size is reached. Mask
times are measured along a real path: each schema's example instance, tokenised, then EOS; "apply" is
setting the masked logits of one row to -inf on the CPU.

    python scripts/bench_structured.py --engine /path/to/smollm2-engine --out bench_structured.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bie_trt.logits_constraint import apply_bitmask, grammar_text  # noqa: E402
from bie_trt.sampling_params import StructuredOutputs  # noqa: E402
from structured_cases import SCHEMAS  # noqa: E402

LLAMA3_VOCAB = 128_256


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte -> the byte: printable Latin-1 bytes stand for
    themselves, the other bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def token_bytes(tokenizer) -> list[bytes]:
    """Each id's bytes (byte-level BPE's alphabet undone; special tokens as their text)."""
    decode = byte_alphabet()
    special = set(tokenizer.all_special_tokens)
    out = []
    for tok in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        out.append(tok.encode() if tok in special or any(c not in decode for c in tok)
                   else bytes(decode[c] for c in tok))
    return out


def synthetic_vocab(base: list[bytes], size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    vocab, seen = list(base), set(base)
    while len(vocab) < size:
        t = rng.choice(base[256:]) + rng.choice(base[256:])
        if t not in seen:
            seen.add(t)
            vocab.append(t)
    return vocab


class _Wrapped:
    """What llguidance.TokenizerWrapper asks of a tokenizer: its token bytes, EOS, and encoding."""

    def __init__(self, hf, tokens: list[bytes]):
        self.tokens, self._hf = tokens, hf
        self.eos_token_id, self.bos_token_id = hf.eos_token_id, hf.bos_token_id
        self.special_token_ids = list(hf.all_special_ids)

    def __call__(self, text: str) -> list[int]:
        return self._hf(text, add_special_tokens=False)["input_ids"]


def llguidance_backend(hf, tokens: list[bytes] | None, vocab: int):
    import llguidance
    import llguidance.hf

    if tokens is None:
        tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=hf.eos_token_id)
    else:
        tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(hf, tokens)), n_vocab=vocab,
                                     eos_token=hf.eos_token_id)

    def fill(m, bitmask):
        row = bitmask[0]
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def compile_(schema):
        """As GrammarCompiler.compile: build, then one mask (which builds the lexer states copies share)."""
        m = llguidance.LLMatcher(tok, grammar_text(StructuredOutputs(json=schema)), log_level=0)
        assert not m.is_error(), m.get_error()
        fill(m, torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32))
        return m

    def accept(m, token):
        return m.consume_token(token)

    return compile_, lambda compiled: compiled.deep_copy(), fill, accept


def xgrammar_backend(hf, tokens: list[bytes] | None, vocab: int):
    import xgrammar as xgr

    if tokens is None:
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[hf.eos_token_id])
    else:
        info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[hf.eos_token_id])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile_(schema):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def fill(m, bitmask):
        m.fill_next_token_bitmask(bitmask)

    def accept(m, token):
        return m.accept_token(token)

    return compile_, xgr.GrammarMatcher, fill, accept


BACKENDS = {"llguidance": llguidance_backend, "xgrammar": xgrammar_backend}


def walk(backend, compiled, path: list[int], bitmask: torch.Tensor, logits: torch.Tensor
         ) -> tuple[list[float], list[float]]:
    """One request's masks along path -> (mask µs, apply µs) per token."""
    _, new_matcher, fill, accept = backend
    matcher = new_matcher(compiled)
    mask_us, apply_us = [], []
    for token in path:
        t0 = time.perf_counter()
        fill(matcher, bitmask)
        t1 = time.perf_counter()
        apply_bitmask(logits.clone(), bitmask[0])
        t2 = time.perf_counter()
        mask_us.append((t1 - t0) * 1e6)
        apply_us.append((t2 - t1) * 1e6)
        if not accept(matcher, token):
            raise RuntimeError(f"the grammar refused its own example at token {token}")
    return mask_us, apply_us


def measure_masks(backend, hf, vocab: int, repeats: int) -> dict:
    """Per schema: compile time (fresh compiles), then masks of the first request on a compiled grammar
    ("first") and of later requests on the same cached grammar ("cached")."""
    compile_ = backend[0]
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    logits = torch.randn(vocab)
    rows = {}
    for name, (schema, instance) in SCHEMAS.items():
        path = hf(json.dumps(instance), add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
        compile_ms = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = compile_(schema)
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        first, _ = walk(backend, compiled, path, bitmask, logits)
        cached, apply_us = [], []
        for _ in range(repeats):
            m, a = walk(backend, compiled, path, bitmask, logits)
            cached += m
            apply_us += a
        rows[name] = {"compile_ms_p50": statistics.median(compile_ms), "tokens": len(path),
                      "first_mask_us_p50": percentile(first, 0.5), "first_mask_us_max": max(first),
                      "mask_us_p50": percentile(cached, 0.5), "mask_us_p99": percentile(cached, 0.99),
                      "apply_us_p50": percentile(apply_us, 0.5), "apply_us_p99": percentile(apply_us, 0.99)}
        r = rows[name]
        print(f"  {name:22s} compile {r['compile_ms_p50']:7.2f} ms  first request: mask max "
              f"{r['first_mask_us_max']:8.1f}"
              f" us  cached: mask p50 {r['mask_us_p50']:7.1f} p99 {r['mask_us_p99']:7.1f} us  apply p50"
              f" {r['apply_us_p50']:6.1f} p99 {r['apply_us_p99']:6.1f} us")
    return rows


def decode_rates(engine_dir: str, tokens: int) -> dict:
    from bie_trt import BieEngine, EngineConfig, SamplingParams, StructuredOutputs

    engine = BieEngine(EngineConfig(engine_dir=engine_dir, device="auto", speculative={"method": "none"}))
    prompt = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "hobbies": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age", "hobbies"]}
    out = {}
    for label, so in (("no_schema", None), ("schema", StructuredOutputs(json=schema))):
        engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0, structured_outputs=so))   # warm
        result = engine.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=so is None,
                                                        structured_outputs=so))
        out[label] = {"tokens": len(result.token_ids), "tokens_per_s": result.decode_tokens_per_s}
        print(f"  decode {label:10s} {len(result.token_ids):3d} tokens  {result.decode_tokens_per_s:7.2f} tokens/s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", help="engine directory for the decode rates (omit to skip them)")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: the engine's, else the SmolLM2 checkpoint)")
    ap.add_argument("--libraries", default="llguidance,xgrammar", help="grammar libraries to measure (comma list)")
    ap.add_argument("--repeats", type=int, default=3, help="compiles and walks per schema")
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the loop thread applies masks)")
    ap.add_argument("--out", default="bench_structured.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    source = args.tokenizer or args.engine
    if source is None:
        from bie_trt.builder.checkpoint.registry import resolve_checkpoint
        source = str(resolve_checkpoint("smollm2-135m"))
    hf = AutoTokenizer.from_pretrained(source)
    base = token_bytes(hf)
    vocabs = {len(hf): None, LLAMA3_VOCAB: synthetic_vocab(base, LLAMA3_VOCAB)}
    result = {"machine": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
              "tokenizer": source, "synthetic_vocab": LLAMA3_VOCAB, "libraries": {}}
    for lib in args.libraries.split(","):
        try:
            __import__(lib)
        except ImportError:
            print(f"{lib}: not installed, skipped")
            continue
        result["libraries"][lib] = {}
        for vocab, tokens in vocabs.items():
            print(f"{lib} at vocabulary {vocab}{' (synthetic)' if tokens else ''}:")
            t0 = time.perf_counter()
            backend = BACKENDS[lib](hf, tokens, vocab)
            setup_s = time.perf_counter() - t0
            rows = measure_masks(backend, hf, vocab, args.repeats)
            result["libraries"][lib][str(vocab)] = {"tokenizer_setup_s": setup_s, "schemas": rows,
                                                   "mask_us_p99_max": max(r["mask_us_p99"] for r in rows.values())}
    if args.engine:
        result["decode"] = decode_rates(args.engine, args.decode_tokens)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
