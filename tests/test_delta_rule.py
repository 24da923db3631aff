"""The gated delta rule's twins (chunked prefill = token-by-token recurrence, whatever the chunking and the
starting state), its Triton kernel against them (interpreted), the causal conv's carried state, and the
recurrent state slots a sequence holds."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bie_trt.config import ModelConfig
from bie_trt.kernels import triton_ops
from bie_trt.kernels.delta_rule import (causal_conv, causal_conv_step, delta_rule_chunked, delta_rule_inputs,
                                        delta_rule_recurrent, delta_rule_slots)
from bie_trt.kv.recurrent import allocate_recurrent, recurrent_bytes_per_seq
from qwen35_tiny import TINY_QWEN35


def inputs(T: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, hk, dk, generator=g), torch.randn(T, hk, dk, generator=g)
    v = torch.randn(T, hv, dv, generator=g)
    decay = -torch.rand(T, hv, generator=g) * 2      # log decays, <= 0
    beta = torch.rand(T, hv, generator=g)
    state = torch.randn(hv, dk, dv, generator=g)
    q, k = delta_rule_inputs(q, k, hv)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("T, chunk", [(1, 64), (37, 16), (64, 64), (100, 64)])
def test_chunked_equals_recurrent(T, chunk):
    q, k, v, g, beta, state = inputs(T)
    want_out, want_state = delta_rule_recurrent(q, k, v, g, beta, state)
    out, new = delta_rule_chunked(q, k, v, g, beta, state, chunk)
    assert (out - want_out).abs().max() < 1e-5
    assert (new - want_state).abs().max() < 1e-5


def test_one_step_by_hand():
    """One token from a known state, written out: the state decays by exp(g) (g < 0 shrinks it), the
    prediction error along k is written back with weight beta, and the output reads the new state along q."""
    q, k, v, g, beta, state = inputs(1, hk=1, hv=1)
    out, new = delta_rule_recurrent(q, k, v, g, beta, state)
    decayed = state[0] * torch.exp(g[0, 0])
    update = beta[0, 0] * (v[0, 0] - decayed.t() @ k[0, 0])
    want = decayed + torch.outer(k[0, 0], update)
    assert torch.allclose(new[0], want, atol=1e-6) and torch.allclose(out[0, 0], want.t() @ q[0, 0], atol=1e-6)
    assert g[0, 0] < 0 and (state[0] * torch.exp(g[0, 0])).norm() < state[0].norm()


def test_conv_in_pieces_equals_the_whole():
    """A text conv'd in pieces with the carried state equals it conv'd at once, and equals a zero-padded
    causal depthwise conv1d (torch's own)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 5, generator=g), torch.randn(5, 4, generator=g)
    whole, _ = causal_conv(x, w, torch.zeros(5, 3))
    want = F.silu(F.conv1d(x.t()[None], w[:, None, :], padding=3, groups=5)[0, :, :11].t())
    assert torch.allclose(whole, want, atol=1e-6)
    state, parts = torch.zeros(5, 3), []
    for piece in (x[:4], x[4:5], x[5:6], x[6:]):
        out, state = causal_conv(piece, w, state)
        parts.append(out)
    assert torch.allclose(torch.cat(parts), whole, atol=1e-6)
    assert torch.equal(state, x[-3:].t())


def test_a_decode_batch_convs_each_sequence_from_its_slot():
    g = torch.Generator().manual_seed(0)
    w, states = torch.randn(5, 4, generator=g), torch.randn(4, 5, 3, generator=g)
    x, slots = torch.randn(2, 5, generator=g), torch.tensor([2, 0])
    before = states.clone()
    out = causal_conv_step(x, w, states, slots)
    for s, slot in enumerate(slots.tolist()):
        want, want_state = causal_conv(x[s:s + 1], w, before[slot])
        assert torch.allclose(out[s], want[0], atol=1e-6) and torch.equal(states[slot], want_state)
    assert torch.equal(states[[1, 3]], before[[1, 3]])


def batch(S: int, T: int, dk: int = 8, dv: int = 6):
    """S sequences of T tokens, and states in 5 slots of which they use `slots`."""
    parts = [inputs(T, dk=dk, dv=dv, seed=s) for s in range(S)]
    q, k, v, g, beta = (torch.stack([p[i] for p in parts]) for i in range(5))
    states = torch.randn(5, 4, dk, dv, generator=torch.Generator().manual_seed(9))
    return q, k, v, g, beta, states, torch.tensor([3, 0, 4][:S])


@pytest.mark.parametrize("S, T", [(3, 1), (1, 37), (2, 20)])
def test_sequences_in_their_slots_equal_each_alone(S, T):
    """A decode batch (or a chunk) over state slots: each sequence gets what it gets alone from its own
    state, its slot ends at its own final state, and slots no sequence names are untouched."""
    q, k, v, g, beta, states, slots = batch(S, T)
    before = states.clone()
    out = delta_rule_slots(q, k, v, g, beta, states, slots)
    for s, slot in enumerate(slots.tolist()):
        want_out, want_state = delta_rule_recurrent(q[s], k[s], v[s], g[s], beta[s], before[slot])
        assert (out[s] - want_out).abs().max() < 1e-5 and (states[slot] - want_state).abs().max() < 1e-5
    untouched = [i for i in range(5) if i not in slots.tolist()]
    assert torch.equal(states[untouched], before[untouched])


@pytest.mark.skipif(not triton_ops.available(), reason="triton not importable")
@pytest.mark.parametrize("S, T, dv", [(3, 1, 16), (1, 5, 24)])
def test_triton_kernel_equals_its_twin(S, T, dv):
    """Interpreted on the CPU: a decode batch over slots, and one sequence's tokens (value channels not a
    power of two: masked)."""
    from bie_trt.kernels.triton_delta_rule import delta_rule_slots_triton

    q, k, v, g, beta, states, slots = batch(S, T, dk=16, dv=dv)
    want_states = states.clone()
    want = delta_rule_slots(q, k, v, g, beta, want_states, slots)
    out = delta_rule_slots_triton(q, k, v, g, beta, states, slots)
    assert (out - want).abs().max() < 1e-5 and (states - want_states).abs().max() < 1e-5


def test_slots_are_never_shared_and_come_back_zeroed():
    cfg = ModelConfig.from_hf(TINY_QWEN35)
    states = allocate_recurrent(cfg, 3, torch.float32)
    slots = [states.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="in use"):
        states.allocate()
    states.delta[:, slots[1]] = 1.0
    states.conv[:, slots[1]] = 1.0
    snap = states.snapshot(slots[1])
    states.release(slots[1])
    with pytest.raises(RuntimeError, match="not in use"):
        states.release(slots[1])
    again = states.allocate()
    assert again == slots[1] and not states.delta[:, again].any() and not states.conv[:, again].any()
    states.restore(again, snap)
    assert (states.delta[:, again] == 1).all() and (states.conv[:, again] == 1).all()
    assert states.nbytes() == 3 * recurrent_bytes_per_seq(cfg, act_bytes=4)
