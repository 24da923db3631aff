"""transformers' own model class (LlamaForCausalLM, Qwen2ForCausalLM) on a checkpoint's dequantised weights:
the independent reference model."""
from __future__ import annotations

from bie_trt.checkpoint.awq import awq_dequantize
from bie_trt.checkpoint.loader import Checkpoint


def hf_model(ckpt: Checkpoint):
    import transformers

    arch = ckpt.model.architecture   # LlamaForCausalLM, Qwen2ForCausalLM, ...
    config_cls = getattr(transformers, arch.removesuffix("ForCausalLM") + "Config")
    cfg = {k: v for k, v in ckpt.hf_config.items() if k != "quantization_config"}
    model = getattr(transformers, arch)(config_cls(**cfg, attn_implementation="eager")).float().eval()
    sd = {"model.embed_tokens.weight": ckpt.tensor("model.embed_tokens.weight").float(),
          "model.norm.weight": ckpt.tensor("model.norm.weight").float()}
    G = ckpt.quant.group_size
    for i in range(ckpt.model.num_layers):
        p = f"model.layers.{i}."
        for sub in ckpt.linear_shapes():
            t = [ckpt.tensor(p + sub + s) for s in (".qweight", ".qzeros", ".scales")]
            sd[p + sub + ".weight"] = awq_dequantize(*t, G).t().contiguous()
            if ckpt.model.qkv_bias and sub in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                sd[p + sub + ".bias"] = ckpt.tensor(p + sub + ".bias").float()
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[p + norm + ".weight"] = ckpt.tensor(p + norm + ".weight").float()
    if not ckpt.model.tie_word_embeddings:
        sd["lm_head.weight"] = ckpt.tensor("lm_head.weight").float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model
