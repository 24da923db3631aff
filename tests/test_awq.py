"""AWQ gemm packing against an independent reading of the format, and RTN bounds."""
from __future__ import annotations

import numpy as np
import torch

from bie_trt.kernels.awq import awq_dequantize, awq_pack, awq_unpack, quantize_rtn
from bie_trt.kernels.w4_layout import W4Weight, awq_to_w4, pack_w4, unpack_w4

# "Nibble slot i (bits 4i..4i+3) of packed column c holds logical column 8c + ORDER[i]"
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def independent_unpack(packed: np.ndarray) -> np.ndarray:
    rows, cols8 = packed.shape
    out = np.zeros((rows, cols8 * 8), dtype=np.int64)
    for r in range(rows):
        for c in range(cols8):
            word = int(packed[r, c]) & 0xFFFFFFFF
            for i in range(8):
                out[r, 8 * c + ORDER[i]] = (word >> (4 * i)) & 0xF
    return out


def independent_dequant(qweight, qzeros, scales, g):
    q = independent_unpack(qweight.numpy())
    z = independent_unpack(qzeros.numpy())
    s = scales.float().numpy()
    k, n = q.shape
    w = np.zeros((k, n), dtype=np.float64)
    for kk in range(k):
        w[kk] = (q[kk] - z[kk // g]) * s[kk // g]
    return w


def test_hand_packed_word():
    # logical values 0..7 in columns 0..7: slot i holds column ORDER[i], i.e. value ORDER[i]
    q = torch.arange(8, dtype=torch.uint8)[None]
    assert awq_pack(q).item() == 0x75316420
    word = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert awq_unpack(word).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # a word with the top bit set (negative int32) unpacks its high nibble too
    neg = torch.tensor([[np.int32(np.uint32(0xF0000001).astype(np.int32))]], dtype=torch.int32)
    assert awq_unpack(neg).tolist() == [[1, 0, 0, 0, 0, 0, 0, 15]]


def test_unpack_matches_independent_reading():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-2**31, 2**31 - 1, (5, 3), dtype=torch.int32, generator=g)
    assert np.array_equal(awq_unpack(packed).numpy(), independent_unpack(packed.numpy()))


def test_dequantize_matches_independent_math():
    g = torch.Generator().manual_seed(1)
    k, n, G = 64, 24, 32
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=g)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // G, n // 8), dtype=torch.int32, generator=g)
    scales = (torch.rand(k // G, n, generator=g) * 0.1).half()
    ours = awq_dequantize(qweight, qzeros, scales, G).double().numpy()
    assert np.allclose(ours, independent_dequant(qweight, qzeros, scales, G), atol=1e-6)


def test_rtn_error_bound_and_format():
    g = torch.Generator().manual_seed(2)
    k, n, G = 128, 16, 64
    w = torch.randn(k, n, generator=g)
    w[3, 5] = 12.0  # an outlier only widens its own group's scale
    qweight, qzeros, scales = quantize_rtn(w, G)
    assert qweight.dtype == torch.int32 and qweight.shape == (k, n // 8)
    assert qzeros.shape == (k // G, n // 8) and scales.dtype == torch.float16 and scales.shape == (k // G, n)
    w_hat = torch.from_numpy(independent_dequant(qweight, qzeros, scales, G)).float()
    bound = scales.float().repeat_interleave(G, dim=0) / 2
    assert ((w - w_hat).abs() <= bound * 1.001 + 1e-6).all()
    # every code is a valid nibble and the group's extremes are represented
    q = independent_unpack(qweight.numpy())
    assert q.min() == 0 and q.max() == 15


def test_runtime_layout_is_the_same_matrix():
    g = torch.Generator().manual_seed(3)
    k, n, G = 128, 40, 32
    qweight, qzeros, scales = quantize_rtn(torch.randn(k, n, generator=g), G)
    w4 = W4Weight(**awq_to_w4(qweight, qzeros, scales))
    assert w4.group_size == G and w4.qweight.shape == (n, k // 8)
    assert torch.equal(w4.dequantize(), awq_dequantize(qweight, qzeros, scales, G).t())
    # sequential nibbles: word j of row r holds q[r, 8j..8j+7], lowest nibble first
    q = unpack_w4(w4.qweight)
    word = int(w4.qweight[0, 1]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == q[0, 8:16].tolist()
    assert torch.equal(pack_w4(q), w4.qweight)


def test_rtn_one_signed_groups_keep_zero_exact():
    # Each column's groups are all positive or all negative: the grid is still stretched to 0, so an
    # all-positive group has zero point 0 and scale max/15, an all-negative one zero point 15 and
    # scale -min/15, and a weight of exactly 0 (row 40, in the second group) dequantises to exactly 0.
    G = 32
    g = torch.Generator().manual_seed(4)
    mag = torch.rand(2 * G, 16, generator=g) * 3 + 0.5
    w = torch.cat([mag[:, :8], -mag[:, 8:]], dim=1)
    w[G + 8] = 0.0
    qweight, qzeros, scales = quantize_rtn(w, G)
    assert independent_unpack(qzeros.numpy()).tolist() == [[0] * 8 + [15] * 8] * 2
    groups = w.reshape(2, G, 16)
    extent = torch.cat([groups[..., :8].amax(1), -groups[..., 8:].amin(1)], dim=1)
    assert torch.equal(scales, (extent / 15).half())
    w_hat = independent_dequant(qweight, qzeros, scales, G)
    assert (w_hat[G + 8] == 0).all()
    assert (w_hat[:, :8] >= 0).all() and (w_hat[:, 8:] <= 0).all()
    bound = scales.double().numpy().repeat(G, axis=0) / 2
    assert (np.abs(w.double().numpy() - w_hat) <= bound * 1.001).all()
