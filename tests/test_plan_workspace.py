"""The plan's activation workspace against the peak of tensors a real prefill chunk allocates."""
from __future__ import annotations

import collections
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bie_trt.config import EngineConfig
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.kernels import ops
from bie_trt.kernels.attention_ref import paged_attention_ref
from bie_trt.model.llama import SeqInput
from bie_trt.plan import activation_workspace_bytes


class PeakTensorBytes(TorchDispatchMode):
    """Live bytes of the storages created inside the mode (views share their base's), and the peak."""

    def __init__(self):
        super().__init__()
        self.refs: collections.Counter[int] = collections.Counter()
        self.size: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.live -= self.size.pop(ptr)
            del self.refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in inputs and ptr not in self.size:   # a view or in-place result of a pre-existing tensor
                continue
            if ptr not in self.size:
                self.size[ptr] = t.untyped_storage().nbytes()
                self.live += self.size[ptr]
                self.peak = max(self.peak, self.live)
            self.refs[ptr] += 1
            weakref.finalize(t, self._release, ptr)
        return out


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [512])
def test_activation_formula_matches_a_measured_chunk(smollm2_engine, monkeypatch, chunk):
    runner = ModelRunner(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_num_seqs=1))
    # one KV block per softmax step, as the GPU kernel walks the cache (the CPU runs dense tiles instead)
    monkeypatch.setattr(ops, "paged_prefill_attentions", lambda q, pools, layer, meta, scale, window=0, offset=None: [
        paged_attention_ref(q[s:s + n], pools, layer, table, meta.positions[s:s + n], scale, window=window,
                            offset=offset.rows(slice(s, s + n)) if offset is not None else None)
        for s, n, table in meta.prefills])
    ids = torch.randint(0, 1000, (chunk,))
    table = list(range(chunk // 16 + 1))
    runner.forward([SeqInput(ids, 0, table)])          # warm-up: the reference keeps dequantised weights
    with PeakTensorBytes() as meter:
        runner.forward([SeqInput(ids, 0, table)])
    formula = activation_workspace_bytes(runner.model_config, chunk, dtype_bytes=4)
    assert 0.9 * formula <= meter.peak <= 1.1 * formula, (meter.peak, formula)


def test_a_step_never_runs_more_tokens_than_the_plan_holds_activations_for(smollm2_engine):
    """The plan's workspace covers a 512-token chunk beside 4 decodes (the CPU profile, no draft): n-gram
    proposals it did not plan for get only what is left, and an explicit larger step is refused."""
    from bie_trt import BieEngine, EngineError, SpeculativeConfig
    from bie_trt.plan import planned_step_tokens

    runner = ModelRunner(EngineConfig(engine_dir=str(smollm2_engine), device="cpu"))
    planned = planned_step_tokens(runner.manifest.plan.inputs)
    assert planned == 512 + 4 * 1
    reserved = dict(runner.manifest.plan.items)["activations"]
    assert reserved == activation_workspace_bytes(runner.model_config, planned, block_size=runner.kv_config.block_size)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    engine = BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", speculative=ngram))
    assert engine.core.scheduler.max_num_batched_tokens == planned     # not 512 + 4 x 6
    with pytest.raises(EngineError, match=f"max_num_batched_tokens {planned + 1} is above the {planned} tokens"):
        BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_num_batched_tokens=planned + 1))
