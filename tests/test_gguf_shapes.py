"""GGUF files shaped as real releases (header and tensor table by the `gguf` package, the weights a sparse
hole: scripts/shaped_gguf.py): their config read as llama.cpp reads it, and their memory plan counting
each tensor's own bytes."""
from __future__ import annotations

import pytest

from bie_trt.builder.build import BuildOptions, open_checkpoint, plan_for, resolve_kv
from bie_trt.builder.checkpoint.gguf_checkpoint import GGUFCheckpoint
from bie_trt.profiles import resolve_profile
from scripts_dir import load_script

shaped = load_script("shaped_gguf")


@pytest.mark.parametrize("name, scalar", [("gemma-3-27b", 5376 // 32), ("gemma-3-1b", 256)])
def test_gemma3s_attention_scale_is_llama_cpps(name, scalar, tmp_path):
    """llama.cpp scales a Gemma 3's scores by 1/sqrt(head size), except the 27B's (62 layers): 1/sqrt(hidden /
    heads), 168 there against a head size of 128. The 1B's hidden / heads (288) is not its 256."""
    m = GGUFCheckpoint(shaped.write_shaped_gguf(name, tmp_path / f"{name}.gguf")).model
    assert m.query_pre_attn_scalar == scalar
    assert (m.rope_theta, m.local_rope_theta, m.sliding_layers[:6]) == (1e6, 1e4, (0, 1, 2, 3, 4, 6))


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b"])
def test_an_8b_q4_k_m_plans_at_64k_on_8_gb_with_its_own_bytes(name, tmp_path):
    ckpt = open_checkpoint(shaped.write_shaped_gguf(name, tmp_path / f"{name}.gguf"))
    linears = sum(int(t.n_bytes) for t in ckpt.reader.tensors
                  if t.name.startswith("blk.") and t.name.split(".")[2] in
                  ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down") and
                  t.name.endswith(".weight"))
    assert ckpt.conversion("int8")["linear_blocks"].keys() == {"Q4_K", "Q6_K"}
    profile, _ = resolve_profile("rtx4060ti-8gb")
    kv = resolve_kv(BuildOptions(checkpoint="", out=""), profile, ckpt.model)
    plan = plan_for(ckpt, profile, kv, 65536, 1)
    assert plan.bytes_of("linear_weights") == linears and plan.fits, plan.format_table()
