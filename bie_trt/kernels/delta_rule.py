"""The gated delta rule (Qwen3.5's Gated DeltaNet), plain torch: the reference twins of the Triton kernels.

Per value head the state S [K, V] (fp32) takes each token t as
    S <- exp(g_t) S                        decay (g_t <= 0)
    u_t = beta_t (v_t - S^T k_t)           the part of v_t the state does not yet predict
    S <- S + k_t u_t^T                     written back along k_t
    o_t = S^T q_t
`delta_rule_recurrent` runs that token by token (the decode step); `delta_rule_chunked` gives the same
outputs and state a chunk of tokens at a time with matrix products (the prefill), derived below.
Inputs are prepared once by `delta_rule_inputs`: q and k L2-normalised, q scaled by K^-1/2, both
repeated to the value heads (each q/k head serves num_v / num_k consecutive value heads).
"""
from __future__ import annotations

import torch

L2_EPS = 1e-6   # transformers' (and fla's) epsilon inside the L2 norm of q and k
CHUNK = 64


def l2_normalise(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_inputs(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H_k, K] -> fp32 [T, H_v, K]: normalised, q scaled, repeated to the value heads."""
    q, k = l2_normalise(q.float()), l2_normalise(k.float())
    q = q * q.shape[-1] ** -0.5
    rep = num_v_heads // k.shape[1]
    return q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k [T, H, K] and v [T, H, V] (fp32, from `delta_rule_inputs`), g and beta [T, H],
    state [H, K, V] fp32 -> (outputs [T, H, V] fp32, the state after the last token)."""
    s = state.float().clone()
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].float().exp()[:, None, None]
        u = beta[t].float()[:, None] * (v[t].float() - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same outputs and final state as `delta_rule_recurrent`, `chunk` tokens at a time.

    Inside a chunk starting from state S0, with G_t the running sum of g (so exp(G_t - G_s) is the decay
    between s and t), unrolling the recurrence gives
        u_t = beta_t v_t - beta_t exp(G_t) S0^T k_t - sum_{s<t} beta_t exp(G_t - G_s) (k_t . k_s) u_s
    i.e. (I + A) U = beta V - (beta exp(G) K) S0 with A strictly lower triangular: one triangular solve.
    Then o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s, and the state leaving the chunk
    is exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T."""
    s = state.float().clone()
    # [H, T, ...]: heads batch the matrix products
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))
    g, beta = g.float().t(), beta.float().t()
    out = []
    for a in range(0, q.shape[1], chunk):
        qc, kc, vc, bc = q[:, a:a + chunk], k[:, a:a + chunk], v[:, a:a + chunk], beta[:, a:a + chunk]
        cum = g[:, a:a + chunk].cumsum(-1)                                   # G_t  [H, C]
        n = cum.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # exp(G_t - G_s) for s <= t; above the diagonal the difference is positive (masked before exp)
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        system = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1) + torch.eye(n, device=q.device)
        rhs = bc[:, :, None] * vc - (bc * cum.exp())[:, :, None] * (kc @ s)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out.append(cum.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * decay) @ u)
        last = cum[:, -1:]
        s = last.exp()[:, :, None] * s + (kc * (last - cum).exp()[:, :, None]).transpose(1, 2) @ u
    return torch.cat(out, dim=1).transpose(0, 1), s


def delta_rule_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """S sequences of T tokens each, every one from and back into its own state: q, k [S, T, H, K], v [S, T, H, V],
    g and beta [S, T, H]; states [N, H, K, V] fp32, rows `slots` [S] read and updated in place. -> outputs
    [S, T, H, V] fp32. The sequences run as more heads of one sequence (heads never mix): one call for a
    whole decode batch (T = 1, token by token) or a prefill chunk (chunked)."""
    S, T, H, K = q.shape

    def as_heads(x: torch.Tensor) -> torch.Tensor:   # [S, T, H, ...] -> [T, S*H, ...]
        return x.transpose(0, 1).reshape(T, S * H, *x.shape[3:])

    rule = delta_rule_recurrent if T == 1 else delta_rule_chunked
    out, new = rule(as_heads(q), as_heads(k), as_heads(v), as_heads(g), as_heads(beta),
                    states[slots].reshape(S * H, K, -1))
    states[slots] = new.reshape(S, H, K, -1)
    return out.reshape(T, S, H, -1).transpose(0, 1)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d over tokens, then SiLU. x [T, C]; weight [C, W]; state [C, W-1]: the W-1 inputs
    before x (zeros for a new sequence), oldest first. -> (outputs [T, C], the state after x: its last W-1
    inputs), so a text conv'd in pieces equals it conv'd whole."""
    width, T = weight.shape[1], x.shape[0]
    xs = torch.cat([state.to(x.dtype), x.t()], dim=1)                      # [C, W-1+T]
    w = weight.to(x.dtype)
    out = xs[:, :T] * w[:, :1]
    for j in range(1, width):   # tap by tap: one [C, T] temporary rather than a [C, T, W] one
        out += xs[:, j:j + T] * w[:, j:j + 1]
    return torch.nn.functional.silu(out.t()), xs[:, xs.shape[1] - (width - 1):]


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of each of S sequences (a decode batch): x [S, C]; states [N, C, W-1], rows `slots` read and
    advanced in place by the new input. -> outputs [S, C], as `causal_conv` gives each sequence."""
    window = torch.cat([states[slots].to(x.dtype), x[:, :, None]], dim=2)    # [S, C, W]
    states[slots] = window[:, :, 1:].to(states.dtype)
    return torch.nn.functional.silu((window * weight.to(x.dtype)).sum(-1))
