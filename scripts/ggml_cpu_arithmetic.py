"""llama.cpp's CPU arithmetic emulated in torch, to tell its rounding from a difference in weights.

ggml's CPU build (node-llama-cpp 3.22.1's x86 build, llama.cpp's flash attention on, an F16 KV cache) runs a
GGUF's own weights but rounds what it multiplies them with:

- every quantised matrix product first rounds its activation rows to 8 bits, in the weight type's
  `vec_dot_type`: Q8_0 (blocks of 32, an fp16 scale amax/127, codes rounded half to even, x86's
  `quantize_row_q8_0`) before Q4_0/Q5_0/Q8_0 weights, Q8_K (blocks of 256, an fp32 scale max/-127) before
  Q4_K/Q5_K/Q6_K, fp16 before F16;
- GELU is a lookup of fp16 values at fp16 inputs (GGML_GELU_FP16);
- K and V are stored as fp16; a prompt's attention is otherwise fp32 (the tiled kernel), but a decoded
  token's (`flash_attn_ext_f16_one_chunk`) takes q in fp16 and sums its V rows in an fp16 accumulator, over
  two halves of the keys (one a thread) joined in fp32.

`transformers` runs the file's weights (fp32, as the `gguf` package dequantises them) once as it is and once
with each of these roundings added (hooks on its linears, GELU and attention), greedily for --tokens tokens
after the same prompts as scripts/gguf_agreement.py. The emulation's tokens are compared with llama.cpp's
from that script's JSON, and at each prompt's first disagreement between transformers and llama.cpp the
plain run's log-probability margin between its token and llama.cpp's is written (a near-tie when small).

    python scripts/ggml_cpu_arithmetic.py --gguf FILE.gguf --engine ENGINE --prompt-tokens 1500 \\
        --agreement benchmarks/results/gguf_agreement_gemma_llama_cpp_cpu.json --out RESULT.json

Not emulated: ggml's summation order, its RoPE angles (fp32, by repeated multiplication), the sliding
layers' key order in its ring of cells (the halves here split keys in position order).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import llama_cpp
from report import emit

# ggml's vec_dot_type of each weight type: what the activations are rounded to before the product.
VEC_DOT_TYPE = {"Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "Q4_1": "Q8_0", "Q5_1": "Q8_0",
                "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K", "F16": "F16", "F32": "F32"}
THREADS = 2   # node-llama-cpp's threads here (os.cpu_count()): the decode attention's key halves


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, last dim a multiple of 32) as x86 ggml's quantize_row_q8_0 leaves it: each block of 32 scaled
    by 127/amax, rounded half to even, times the fp16 scale amax/127."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv)
    return (codes * (amax / 127.0).half().float()).reshape(x.shape)


def round_q8_k(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, last dim a multiple of 256) as ggml's quantize_row_q8_K leaves it: each block of 256 scaled by
    -127/max (max the element of largest magnitude, with its sign), rounded half to even, at most 127, times
    the fp32 scale 1/that."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 256)
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    iscale = torch.where(peak != 0, -127.0 / peak, torch.zeros_like(peak))
    codes = torch.round(iscale * blocks).clamp(max=127)
    d = torch.where(peak != 0, 1.0 / iscale, torch.zeros_like(peak))
    return (codes * d).reshape(x.shape)


ROUND = {"Q8_0": round_q8_0, "Q8_K": round_q8_k, "F16": lambda x: x.half().float(), "F32": lambda x: x}


def gelu_fp16_table(x: torch.Tensor) -> torch.Tensor:
    """ggml's GELU (tanh form) with GGML_GELU_FP16: the fp16 value of gelu at x rounded to fp16; 0 below -10,
    x above 10."""
    y = F.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


class GeluFP16Table(torch.nn.Module):
    """gelu_fp16_table where a model holds its activation as a module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_fp16_table(x)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query row a head ([heads, d]) over keys [heads, n, d] where `keep` [n]: ggml's one-chunk flash
    attention, fp16 q, an fp16 V accumulator rescaled on each new maximum, over THREADS halves of the
    kept keys (each with its own maximum and sum), joined in fp32."""
    idx = keep.nonzero().flatten()
    halves = [h for h in idx.tensor_split(THREADS) if len(h)]
    qh = q.half().float()
    parts = []
    for part in halves:
        s = torch.einsum("hd,hnd->hn", qh, k[:, part].half().float()) * scale
        vv = v[:, part].half().float()
        m = torch.full(s.shape[:1], -math.inf)
        total = torch.zeros(s.shape[:1])
        acc = torch.zeros(q.shape, dtype=torch.float16)
        for i in range(s.shape[1]):
            si = s[:, i]
            new = si > m
            ms = torch.where(new, torch.exp(m - si), torch.ones_like(si))
            vs = torch.where(new, torch.ones_like(si), torch.exp(si - m))
            m = torch.where(new, si, m)
            acc = torch.where(new[:, None], (acc.float() * ms[:, None]).half(), acc)
            acc = (acc.float() + vv[:, i] * vs[:, None]).half()
            total = total * ms + vs
        parts.append((m, total, acc.float()))
    top = torch.stack([p[0] for p in parts]).amax(0)
    num = sum(p[2] * torch.exp(p[0] - top)[:, None] for p in parts)
    den = sum(p[1] * torch.exp(p[0] - top) for p in parts)
    return num / den[:, None]


def ggml_attention(prescaled: bool):
    """transformers' eager attention as ggml computes it (see the module docstring). `prescaled`: the model
    multiplies q by its scale before attention (llama.cpp's Gemma 3), so the fp16 q is the scaled one."""
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        from transformers.models.llama.modeling_llama import repeat_kv

        scaling = module.head_dim ** -0.5 if scaling is None else scaling
        k = repeat_kv(key, module.num_key_value_groups).half().float()   # the F16 cache
        v = repeat_kv(value, module.num_key_value_groups).half().float()
        if query.shape[2] > 1:   # a prompt: the tiled kernel, fp32 but for the fp16 cache
            w = torch.matmul(query, k.transpose(2, 3)) * scaling + attention_mask
            return torch.matmul(torch.softmax(w.float(), -1), v).transpose(1, 2).contiguous(), None
        q, q_scale = (query * scaling, 1.0) if prescaled else (query, scaling)
        keep = attention_mask[0, 0, 0] == 0
        out = torch.stack([_decode_attention(q[b, :, 0], k[b], v[b], keep, q_scale) for b in range(q.shape[0])])
        return out[:, None].contiguous(), None
    return attention


@contextlib.contextmanager
def ggml_arithmetic(model, tensor_types: dict[str, str]):
    """Within the block, `model` (transformers, fp32, on the file's weights) computes as ggml's CPU build.
    `tensor_types`: each linear's module name -> its GGUF type name."""
    import transformers.models.gemma3.modeling_gemma3 as gemma3
    import transformers.models.qwen2.modeling_qwen2 as qwen2
    import transformers.models.llama.modeling_llama as llama

    hooks = []
    for name, module in model.named_modules():
        if name in tensor_types:
            fn = ROUND[VEC_DOT_TYPE[tensor_types[name]]]
            hooks.append(module.register_forward_pre_hook(lambda m, args, fn=fn: (fn(args[0]),)))
    prescaled = model.config.model_type.startswith("gemma3")
    saved = [(mod, mod.eager_attention_forward) for mod in (gemma3, qwen2, llama)]
    for mod, _ in saved:
        mod.eager_attention_forward = ggml_attention(prescaled)
    acts = [(m, m.act_fn) for m in model.modules() if hasattr(m, "act_fn") and "gelu" in type(m.act_fn).__name__.lower()]
    for m, _ in acts:
        m.act_fn = GeluFP16Table()
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for mod, fn in saved:
            mod.eager_attention_forward = fn
        for m, fn in acts:
            m.act_fn = fn


def linear_types(gguf_path: Path, model) -> dict[str, str]:
    """transformers' linear module names -> the GGUF type of the tensor each runs (the tied head: token_embd)."""
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(gguf_path).tensors}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if name == "lm_head":
            out[name] = types.get("output.weight", types["token_embd.weight"])
            continue
        layer = name.split(".")[2]
        part = name.split(".", 3)[3]
        out[name] = types[f"blk.{layer}.{parts[part]}.weight"]
    return out


def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def margins(model, prompt: list[int], theirs: list[int]) -> list[dict]:
    """Along `theirs` (teacher-forced): at each position, this model's top token and its log-probability margin
    over their token (0 where they agree)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs[:-1]])).logits[0, len(prompt) - 1:].float()
    logp = torch.log_softmax(logits, -1)
    top = logp.argmax(-1)
    return [{"top": int(t), "margin": float(lp[t] - lp[o])} for t, lp, o in zip(top, logp, theirs)]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--engine", required=True, help="an engine built from the file (its tokenizer makes the prompts)")
    ap.add_argument("--agreement", required=True, type=Path, help="scripts/gguf_agreement.py's JSON with llama.cpp")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from bie_trt.eval_texts import load_eval_text, text_token_ids

    agreement = json.loads(args.agreement.read_text())
    theirs = agreement["references"]["llama.cpp"]
    tokens, count = agreement["tokens"], len(theirs)
    prompts = llama_cpp.prompt_windows(text_token_ids(args.engine, load_eval_text(agreement["text"])),
                                       text_token_ids(args.engine, ""), count, agreement["prompt_tokens"])
    model = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    types = linear_types(args.gguf, model)
    rows = []
    with torch.no_grad():
        for prompt, llama in zip(prompts, theirs):
            plain = greedy(model, prompt, tokens)
            with ggml_arithmetic(model, types):
                emulated = greedy(model, prompt, tokens)
            at = first_difference(plain, llama)
            row = {"transformers": plain, "emulated": emulated, "llama.cpp": llama,
                   "prefix_transformers_llama_cpp": at, "prefix_emulated_llama_cpp": first_difference(emulated, llama),
                   "prefix_emulated_transformers": first_difference(emulated, plain)}
            if at < tokens:   # transformers' margin there, along llama.cpp's text
                m = margins(model, prompt, llama[:at + 1])[at]
                row["divergence"] = {"position": at, "transformers_token": plain[at], "llama_cpp_token": llama[at],
                                     "transformers_logprob_margin": m["margin"],
                                     "emulated_token": emulated[at] if first_difference(emulated, llama) >= at else None}
            rows.append(row)
    summary = {k: [r[k] for r in rows] for k in ("prefix_transformers_llama_cpp", "prefix_emulated_llama_cpp",
                                                  "prefix_emulated_transformers")}
    emit({"gguf": args.gguf.name, "agreement": args.agreement.name, "prompt_tokens": agreement["prompt_tokens"],
          "tokens": tokens, "threads": THREADS, "summary": summary, "prompts": rows}, args.out)


if __name__ == "__main__":
    main()
