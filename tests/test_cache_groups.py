"""Each layer declares its cache kind, and the plan's cache groups are those declarations counted, with the
bytes of the items that hold each group: a dense model is one group, Gemma 3 two, Gemma 4 three (its shared
layers own nothing), Qwen3.5 two."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.plan import solve_plan
from bie_trt.profiles import load_profile

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def model(name: str) -> ModelConfig:
    path = EXAMPLES / f"{name}.config.json"
    return ModelConfig.from_hf(json.loads(path.read_text()), str(path))


@pytest.mark.parametrize("name,layers", [
    ("llama-3.1-8b-instruct-awq", {"full_attention": 32}),
    # every sixth layer attends the whole context
    ("gemma-3-4b-it-awq", {"full_attention": 34 // 6, "sliding_attention": 34 - 34 // 6}),
    # 35 layers, every fifth full; the last 20 read the cache of an earlier layer of their kind
    ("gemma-4-e2b-it", {"full_attention": 15 // 5, "sliding_attention": 15 - 15 // 5, "shared": 20}),
    ("qwen3.5-9b", {"full_attention": 8, "linear_attention": 24}),
])
def test_groups_count_each_layers_declared_kind(name, layers):
    cfg = model(name)
    plan = solve_plan(cfg, load_profile("rtx4060ti-8gb"), max_model_len=8192, kv=KVCacheConfig(dtype="int4_asym"))
    assert {g.kind: g.layers for g in plan.groups} == layers
    assert sum(g.layers for g in plan.groups) == cfg.num_layers
    sizes = {g.kind: g.bytes for g in plan.groups}
    assert sizes["full_attention"] == plan.bytes_of("kv_fp16_pool") + plan.bytes_of("kv_quant_pool")
    assert sizes.get("sliding_attention", 0) == plan.bytes_of("kv_sliding_pool")
    assert sizes.get("shared", 0) == 0
    # every byte of cache the plan holds is in exactly one group
    cache_items = [it.bytes for it in plan.items if it.name.startswith(("kv_fp16", "kv_quant", "kv_sliding",
                                                                          "recurrent"))]
    assert sum(sizes.values()) == sum(cache_items)
    assert "cache groups:" in plan.format_table()
