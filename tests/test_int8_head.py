"""The int8 lm_head and host-side embedding of the 8 GB plans."""
from __future__ import annotations

import json

import torch
from safetensors import safe_open

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.kernels.int8_rows import Int8Rows, quantize_rows_int8


def test_int8_rows_against_independent_math():
    w = torch.tensor([[0.5, -1.27, 0.0, 0.254], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, -2.0, 0.01]])
    q, scale = quantize_rows_int8(w)
    assert torch.allclose(scale.float(), torch.tensor([0.01, 6.1035e-05, 3 / 127]), rtol=1e-3)
    assert q[0].tolist() == [50, -127, 0, 25] and q[1].tolist() == [0, 0, 0, 0]
    assert q[2, 0] == 127 and q[2, 2] == round(-2 / (3 / 127))
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 32, generator=g) * torch.rand(64, 1, generator=g) * 10
    q, scale = quantize_rows_int8(big)
    err = (big - q.float() * scale.float()[:, None]).abs()
    assert (err <= scale.float()[:, None] / 2 + 1e-6).all()
    x = torch.randn(3, 32, generator=g)
    assert torch.allclose(Int8Rows(q, scale).linear(x), x @ (q.float() * scale.float()[:, None]).T, atol=1e-5)


def test_8gb_profile_engine_uses_int8_head_with_the_plans_bytes(build, smollm2_engine):
    engine_dir = build(profile="rtx4060ti-8gb", max_model_len=4096)
    plan = json.loads((engine_dir / "manifest.json").read_text())["plan"]
    assert plan["inputs"]["lm_head_dtype"] == "int8" and plan["inputs"]["embedding_placement"] == "host"
    with safe_open(engine_dir / "weights.safetensors", "pt") as f:
        head_bytes = sum(f.get_tensor(n).nbytes for n in f.keys() if n.startswith("lm_head"))
    assert head_bytes == next(i["bytes"] for i in plan["items"] if i["name"] == "lm_head")
    int8 = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu"))
    fp16 = BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu"))
    assert isinstance(int8.core.runner.model.lm_head, Int8Rows)
    prompt = "The Eiffel Tower is in"
    a = int8.generate(prompt, SamplingParams(temperature=0, max_tokens=6))
    b = fp16.generate(prompt, SamplingParams(temperature=0, max_tokens=6))
    assert a.token_ids[:3] == b.token_ids[:3]
