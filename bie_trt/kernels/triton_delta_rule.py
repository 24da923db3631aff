"""Triton twin of `delta_rule.delta_rule_slots`: the gated delta rule over S sequences of T tokens, token by
token, each sequence's state read from and written back to its slot, held in registers in between (fla's
"fused recurrent" form). One program owns one sequence, one value head and a block of its value channels:
the columns S[:, v-block] evolve independently of the other columns. It serves the decode step (S
sequences of one token: one launch) and, until a chunked kernel lands, prefill (one sequence of T tokens:
correct, but serial in T).

Importing this module needs triton (`triton_ops.available()` says whether it can run).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, slot_ptr, o_ptr, T, H, K, V,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = offs_k < K, offs_v < V
    m2 = mk[:, None] & mv[None, :]
    s_off = (slot * H + h) * K * V + offs_k[:, None] * V + offs_v[None, :]
    s = tl.load(s_ptr + s_off, mask=m2, other=0.0)
    for t in range(T):
        row = (seq * T + t) * H + h
        q = tl.load(q_ptr + row * K + offs_k, mask=mk, other=0.0)
        k = tl.load(k_ptr + row * K + offs_k, mask=mk, other=0.0)
        v = tl.load(v_ptr + row * V + offs_v, mask=mv, other=0.0)
        decay = tl.exp(tl.load(g_ptr + row))
        beta = tl.load(b_ptr + row)
        s = s * decay
        u = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * u[None, :]
        tl.store(o_ptr + row * V + offs_v, tl.sum(s * q[:, None], axis=0), mask=mv)
    tl.store(s_ptr + s_off, s, mask=m2)


def delta_rule_slots_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Same arguments and result as `delta_rule_slots`; `states` must be contiguous fp32 (a layer of
    `RecurrentStates.delta`), updated in place."""
    S, T, H, K = q.shape
    V = v.shape[-1]
    if states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError("the delta-rule states must be a contiguous fp32 tensor")
    q, k, v = (x.float().contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.empty(S, T, H, V, dtype=torch.float32, device=q.device)
    block_v = min(64, triton.next_power_of_2(V))
    _delta_rule_kernel[(S, H, triton.cdiv(V, block_v))](
        q, k, v, g, beta, states, slots.to(device=q.device, dtype=torch.int32).contiguous(), out, T, H, K, V,
        BLOCK_K=triton.next_power_of_2(K), BLOCK_V=block_v)
    return out
