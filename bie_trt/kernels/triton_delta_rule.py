"""Triton twin of `delta_rule.delta_rule_recurrent`: the gated delta rule over a sequence's tokens, token by
token, with the state in registers (fla's "fused recurrent" form). One program owns one value head and a
block of its value channels: the columns S[:, v-block] evolve independently of the other columns, so the
state never leaves the program between tokens. It serves the decode step (one token) and, until a chunked
kernel lands, prefill too (correct, but serial in T).

Importing this module needs triton (`triton_ops.available()` says whether it can run).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, T, H, K, V,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = offs_k < K, offs_v < V
    m2 = mk[:, None] & mv[None, :]
    s_off = h * K * V + offs_k[:, None] * V + offs_v[None, :]
    s = tl.load(s_ptr + s_off, mask=m2, other=0.0)
    for t in range(T):
        row = t * H + h
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


def delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and results as `delta_rule_recurrent`; the returned state is `state` itself, updated in
    place when it is a contiguous fp32 tensor (a slot of `RecurrentStates.delta`), else a new one."""
    T, H, K = q.shape
    V = v.shape[-1]
    q, k, v = (x.float().contiguous() for x in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    s = state if state.dtype == torch.float32 and state.is_contiguous() else state.float().contiguous()
    out = torch.empty(T, H, V, dtype=torch.float32, device=q.device)
    block_v = min(64, triton.next_power_of_2(V))
    _delta_rule_kernel[(H, triton.cdiv(V, block_v))](q, k, v, g, beta, s, out, T, H, K, V,
                                                    BLOCK_K=triton.next_power_of_2(K), BLOCK_V=block_v)
    return out, s
