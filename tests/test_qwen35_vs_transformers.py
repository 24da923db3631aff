"""A tiny random Qwen3.5 (Gated DeltaNet and gated full-attention layers, partial rotary, (1 + w) norms) through
the engine's one decoder forward: its logits over a prompt of several prefill chunks (and several of the
delta rule's own 64-token chunks) and over a greedy continuation equal transformers' Qwen3_5ForCausalLM on
the same weights within fp32 rounding (the delta rule's state carries its rounding from token to token, and
the two sides order its sums differently: 1e-4 of the largest logit), and so do its greedy tokens."""
from __future__ import annotations

import random

import pytest
import torch

from bie_trt.kernels import triton_ops
from bie_trt.kernels.step_inputs import SeqInput
from qwen35_tiny import CHUNK, engine_model
MAX_LOGIT_DIFF = 1e-4     # of the largest |logit| (about 30 here)


@pytest.fixture(scope="module")
def reference(qwen35_reference):
    return qwen35_reference


def run(model, pools, ids: list[int], continuation: list[int], slot: int, table: list[int]) -> torch.Tensor:
    """Prefill `ids` in chunks (every position's logits), then decode `continuation`: [rows, V]."""
    rows = []
    for start in range(0, len(ids), CHUNK):
        part = ids[start:start + CHUNK]
        rows.append(model.forward([SeqInput(torch.tensor(part), start, table, all_logits=True, state_slot=slot)],
                                  pools)[0])
    for i, t in enumerate(continuation):
        rows.append(model.forward([SeqInput(torch.tensor([t]), len(ids) + i, table, state_slot=slot)], pools)[0][None])
    return torch.cat(rows)


def scattered_table(blocks: int, seed: int) -> list[int]:
    table = list(range(blocks))
    random.Random(seed).shuffle(table)
    return table


def test_config_reads_the_hybrid_layout():
    from bie_trt.config import ModelConfig
    from qwen35_tiny import TINY_QWEN35

    cfg = ModelConfig.from_hf(TINY_QWEN35)
    assert cfg.family == "qwen3_5" and cfg.linear_layers == (0, 2) and cfg.rotary_dim == 8
    assert cfg.norm_offset == 1.0 and cfg.attn_output_gate and cfg.qk_norm


@pytest.mark.parametrize("kernels", ["reference", pytest.param("triton", marks=pytest.mark.slow)])
def test_logits_and_greedy_tokens_equal_transformers(reference, kernels, monkeypatch):
    if kernels == "triton" and not triton_ops.available():
        pytest.skip("triton not importable")
    monkeypatch.setenv("BIE_TRT_KERNELS", kernels)
    hf_model, ids, continuation, hf_logits = reference
    model, pools = engine_model(hf_model)
    slot = pools.recurrent.allocate()
    ours = run(model, pools, ids, continuation, slot, scattered_table(64, 0))
    hf_logits = hf_logits[: len(ids) + len(continuation)]
    assert ours.shape == hf_logits.shape
    diff = (ours - hf_logits).abs().max().item() / hf_logits.abs().max().item()
    assert diff <= MAX_LOGIT_DIFF, f"max |Δlogit| = {diff} of the largest"
    # greedy: each position's argmax is the next token transformers chose
    assert ours[len(ids) - 1:-1].argmax(-1).tolist() == continuation


def test_two_sequences_in_one_step_keep_their_own_state(reference):
    """Steps of two sequences (their prefill chunks, then a decode batch, then a decode beside a chunk; different
    slots, different lengths) give each the logits it gets alone: the slots do not mix."""
    hf_model, ids, _, hf_logits = reference
    model, pools = engine_model(hf_model, slots=2)
    a, b = pools.recurrent.allocate(), pools.recurrent.allocate()
    other = ids[::-1][:40]
    ta, tb = list(range(0, 16)), list(range(16, 32))
    out = model.forward([SeqInput(torch.tensor(ids[:CHUNK]), 0, ta, all_logits=True, state_slot=a),
                         SeqInput(torch.tensor(other), 0, tb, all_logits=True, state_slot=b)], pools)
    scale = hf_logits.abs().max().item()
    assert (out[0] - hf_logits[:CHUNK]).abs().max().item() <= MAX_LOGIT_DIFF * scale
    step = model.forward([SeqInput(torch.tensor([ids[CHUNK]]), CHUNK, ta, state_slot=a),
                          SeqInput(torch.tensor([other[0]]), len(other), tb, state_slot=b)], pools)
    assert (step[0] - hf_logits[CHUNK]).abs().max().item() <= MAX_LOGIT_DIFF * scale
    # a decode beside another sequence's prefill chunk
    mixed = model.forward([SeqInput(torch.tensor([ids[CHUNK + 1]]), CHUNK + 1, ta, state_slot=a),
                           SeqInput(torch.tensor(other[1:6]), len(other) + 1, tb, state_slot=b)], pools)
    assert (mixed[0] - hf_logits[CHUNK + 1]).abs().max().item() <= MAX_LOGIT_DIFF * scale


def test_a_sequence_cut_into_several_inputs_of_a_step_runs_through_them_in_order(reference):
    """A step may cut one sequence's rows into runs (read through different views of its KV blocks): its
    state goes through a chunk and then a one-row run in that order, the row not taken for the decode batch
    (which runs before the chunks)."""
    hf_model, ids, _, hf_logits = reference
    model, pools = engine_model(hf_model)
    slot, table = pools.recurrent.allocate(), list(range(16))
    model.forward([SeqInput(torch.tensor(ids[:CHUNK]), 0, table, state_slot=slot)], pools)
    out = model.forward([SeqInput(torch.tensor(ids[CHUNK:CHUNK + 5]), CHUNK, table, all_logits=True, state_slot=slot),
                         SeqInput(torch.tensor([ids[CHUNK + 5]]), CHUNK + 5, table, state_slot=slot)], pools)
    scale = hf_logits.abs().max().item()
    assert (torch.cat([out[0], out[1][None]]) - hf_logits[CHUNK:CHUNK + 6]).abs().max().item() <= \
        MAX_LOGIT_DIFF * scale


def test_a_preempted_sequence_resumes_from_its_snapshot_in_another_slot(reference):
    """Preemption: the state after a chunk is copied out, the slot released and reused by another sequence;
    the first resumes in whichever slot it gets next, from the copy, as if never stopped."""
    hf_model, ids, _, hf_logits = reference
    model, pools = engine_model(hf_model, slots=2)
    states = pools.recurrent
    a = states.allocate()
    table = list(range(16))
    model.forward([SeqInput(torch.tensor(ids[:CHUNK]), 0, table, all_logits=True, state_slot=a)], pools)
    saved = states.snapshot(a)
    states.release(a)
    b = states.allocate()   # the same slot, now another sequence's
    model.forward([SeqInput(torch.tensor(ids[::-1][:30]), 0, list(range(16, 32)), state_slot=b)], pools)
    a = states.allocate()
    assert a != b
    states.restore(a, saved)
    out = model.forward([SeqInput(torch.tensor(ids[CHUNK:2 * CHUNK]), CHUNK, table, all_logits=True,
                                  state_slot=a)], pools)[0]
    assert (out - hf_logits[CHUNK:2 * CHUNK]).abs().max().item() <= MAX_LOGIT_DIFF * hf_logits.abs().max().item()


@pytest.mark.slow   # about 80 s of CPU: a thousand one-token steps
def test_the_recurrent_state_stays_the_same_size_over_1000_generated_tokens(reference):
    """1,000 greedy tokens: the full-attention layers' KV blocks grow with the text, the recurrent state is
    the same tensors, the same bytes, throughout."""
    hf_model, ids, _, _ = reference
    model, pools = engine_model(hf_model, slots=1, blocks=80)
    states = pools.recurrent
    slot, table = states.allocate(), list(range(80))
    before = (states.nbytes(), states.delta.data_ptr(), states.conv.data_ptr())
    logits = model.forward([SeqInput(torch.tensor(ids[:16]), 0, table, state_slot=slot)], pools)[0]
    for pos in range(16, 1016):
        token = int(logits.argmax())
        logits = model.forward([SeqInput(torch.tensor([token]), pos, table, state_slot=slot)], pools)[0]
    assert torch.isfinite(logits).all() and states.delta[:, slot].abs().sum() > 0
    assert (states.nbytes(), states.delta.data_ptr(), states.conv.data_ptr()) == before
    assert pools.k[:, 1016 // 16 - 1].abs().sum() > 0 and not pools.k[:, 1016 // 16 + 1].any()


def test_a_rejected_proposal_is_rolled_back(reference):
    """A speculative verify: the last accepted token and four proposals in one logged step, of which the first
    two are right. Rolled back to the three accepted rows, the sequence goes on exactly as transformers'."""
    hf_model, ids, continuation, hf_logits = reference
    model, pools = engine_model(hf_model)
    slot, table, n = pools.recurrent.allocate(), list(range(64)), len(ids)
    run(model, pools, ids, [], slot, table)
    wrong = [(continuation[3] + 1) % 256, continuation[0]]
    verify = [continuation[0], continuation[1], continuation[2], *wrong]
    rows = model.forward([SeqInput(torch.tensor(verify), n, table, all_logits=True, state_slot=slot,
                                   log_state=True)], pools)[0]
    scale = hf_logits.abs().max().item()
    assert (rows[:3] - hf_logits[n:n + 3]).abs().max().item() <= MAX_LOGIT_DIFF * scale
    assert rows[:3].argmax(-1).tolist() == continuation[1:4] != verify[1:4]   # the third proposal is rejected
    model.roll_back_recurrent(pools, slot, keep=3)
    assert not pools.recurrent.logs.get(slot)
    after = model.forward([SeqInput(torch.tensor([continuation[3]]), n + 3, table, state_slot=slot)], pools)[0]
    assert (after - hf_logits[n + 3]).abs().max().item() <= MAX_LOGIT_DIFF * scale
