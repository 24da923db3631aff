"""Long-context retrieval through the default INT4 cache on a real model whose keys carry a large shared offset:
Qwen2.5-Coder-0.5B (Qwen2's k_proj bias). Before the build measured its keys, the INT4 cache lost a passkey at
every depth of ~10k tokens; with the settings the build now chooses (key centering, and the per-channel key
scale in the layers where it measured one helps) it must find every one the FP16 cache finds, and those at 10%,
50% and 90% (slow: a real build and two ~10k-token prefills on the CPU; skipped, naming the install command,
without the model's pieces).

One haystack carries a different secret number at each of five depths (scripts/passkeys.py, which measures
the same at other lengths and formats), and each question is asked after it: the prefix cache serves the ~10k
shared tokens, so the CPU prefills them once per format, not five times. At 30% the 0.5B model answers the
launch code's question with the vault code's number in FP16 as in INT4: a miss of the model, not of the cache."""
from __future__ import annotations

import json

import pytest

from bie_trt.builder.checkpoint.registry import resolve_checkpoint
from bie_trt.config import EngineConfig
from bie_trt.errors import CheckpointError
from bie_trt.eval_texts import load_eval_text
from bie_trt.executor.engine import BieEngine
from scripts_dir import load_script

passkeys = load_script("passkeys")
CONTEXT = 10_240


@pytest.mark.slow
def test_the_default_int4_cache_finds_a_passkey_at_five_depths_of_10k_tokens(build):
    try:
        checkpoint = resolve_checkpoint("qwen2.5-coder-0.5b")
    except CheckpointError as e:
        pytest.skip(f"needs the Qwen2.5-Coder-0.5B pieces: {e}")
    # Every KV option but the dtype at its default: the build decides centering and the scale from the keys.
    engine_dir = build(checkpoint=str(checkpoint), max_model_len=CONTEXT + 1024, kv_cache_dtype="int4_asym")
    kv = json.loads((engine_dir / "manifest.json").read_text())["kv"]
    assert (kv["dtype"], kv["key_centering"], kv["key_scale"]) == ("int4_asym", True, True)
    found = {}
    for dtype in ("int4_asym", "fp16"):
        engine = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu", max_num_seqs=1, kv_cache_dtype=dtype))
        rows = passkeys.ask(engine, passkeys.haystack(engine.tokenizer, load_eval_text("builtin:python-docs"), CONTEXT))
        found[dtype] = {r["depth"] for r in rows if r["found"]}
        del engine
    assert found["fp16"] <= found["int4_asym"] and {0.1, 0.5, 0.9} <= found["int4_asym"], found
