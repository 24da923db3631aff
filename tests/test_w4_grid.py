"""The W4 GEMV's launch grid (`triton_w4.gemv_grid`): at every Llama-3-8B decode shape and on every
GPU the profiles name (and a few siblings), ≥ 2 waves or a whole number ≥ 2 of them within a small
tail, equal K-slices, whole tiles, and the residency model checked by hand."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from bie_trt.kernels.triton_w4 import (  # noqa: E402
    GEMV_TILES,
    GemvTile,
    default_config,
    gemv_grid,
    gemv_grid_for,
    resident_ctas,
    resident_programs,
    sm_limits,
)

# Llama-3-8B's fused linears (out features, in features), AWQ group 128.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# SM counts: RTX 3060 (GA106), 3060 Ti, 3070, 4060 (AD107), 4060 Ti, 4070 Laptop, 4070, 4090, H200.
GPUS = {"rtx3060": (28, 86), "rtx3060ti": (38, 86), "rtx3070": (46, 86), "rtx4060": (24, 89),
        "rtx4060ti": (34, 89), "rtx4070-laptop": (36, 89), "rtx4070": (46, 89), "rtx4090": (128, 89),
        "h200": (132, 90)}


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_llama_8b_grids_make_two_or_more_whole_waves(gpu: str, shape: str) -> None:
    sms, arch = GPUS[gpu]
    n, k = SHAPES[shape]
    g = gemv_grid_for(n, k, 128, sm_limits(sms, arch))
    bn, bk, split = g.tile.block_n, g.tile.block_k, g.split_k
    # whole tiles, BLOCK_K inside one group, equal slices of ≥ 2 steps
    assert n % bn == 0 and 128 % bk == 0 and (k // bk) % split == 0 and k // bk // split >= 2
    assert g.programs == n // bn * split
    assert g.resident >= 2
    waves = g.programs / (sms * g.resident)
    assert waves == pytest.approx(g.waves)
    assert round(waves) >= 2 and abs(waves - round(waves)) <= 0.15
    assert g.config() == {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": g.tile.num_warps}


def test_residency_by_hand() -> None:
    # 128 regs x 32 lanes = 4096 a warp: 16 warps fit 64K registers, two 8-warp programs
    assert resident_ctas(GemvTile(128, 128, 8, 128), sm_limits(132, 90)) == 2
    # 72 regs: 2304 a warp (a multiple of 256), 28 warps, seven 4-warp programs
    assert resident_ctas(GemvTile(64, 64, 4, 72), sm_limits(28, 86)) == 7
    # 65 regs are allocated as 72 (units of 256 a warp): 28 warps, fourteen 2-warp programs (not 15)
    assert resident_ctas(GemvTile(64, 32, 2, 65), sm_limits(132, 90)) == 14
    # few registers: the block limit (16 on sm_86, 32 on sm_90) or the warp limit (48 / 64) binds
    assert resident_ctas(GemvTile(64, 32, 2, 32), sm_limits(28, 86)) == 16
    assert resident_ctas(GemvTile(64, 32, 2, 32), sm_limits(132, 90)) == 32
    assert resident_ctas(GemvTile(64, 32, 8, 32), sm_limits(28, 86)) == 6


def test_residency_with_shared_memory_by_hand() -> None:
    # registers would let eight 4-warp programs of 64 regs in; 48 KB each (+1 KB reserved) fits twice
    # in sm_86's 100 KB and four times in sm_90's 228 KB
    assert resident_programs(64, 4, sm_limits(28, 86)) == 8
    assert resident_programs(64, 4, sm_limits(28, 86), shared=48 * 1024) == 2
    assert resident_programs(64, 4, sm_limits(132, 90), shared=48 * 1024) == 4
    # the attention decode's 8 warps at 224 registers: one program an SM, whatever its 30 KB
    assert resident_programs(224, 8, sm_limits(132, 90), shared=30720) == 1
    assert resident_programs(224, 4, sm_limits(132, 90), shared=30720) == 2


def test_the_fewest_programs_that_make_whole_waves() -> None:
    tile = GemvTile(128, 128, 8, 128)
    # 10 tiles, 32 K-steps, 20 slots: split 2 is one wave, split 4 is exactly two
    g = gemv_grid(1280, 4096, 128, 10, {tile: 2})
    assert (g.split_k, g.programs, g.waves) == (4, 40, 2.0)
    # 30 slots: 40 programs are 1.33 waves, 80 are 2.67: no whole waves; the most waves up to 2, fewest programs
    g = gemv_grid(1280, 4096, 128, 10, {tile: 3})
    assert (g.split_k, g.waves) == (8, pytest.approx(80 / 30))
    # a tile that fits no SM, or whose BLOCK_K does not divide the group, is never chosen
    big = GemvTile(64, 128, 8, 80)
    assert gemv_grid(1280, 4096, 128, 10, {tile: 2, big: 0}).tile == tile
    assert gemv_grid(1280, 4096, 64, 10, {tile: 2, GemvTile(64, 64, 4, 72): 7}).tile.block_k == 64
    with pytest.raises(ValueError, match="group size"):
        gemv_grid(1280, 4096, 16, 10, {t: 2 for t in GEMV_TILES})


def test_the_default_launch_is_the_grid() -> None:
    # off the GPU the default is an H200's grid (132 SMs of sm_90)
    for n, k in SHAPES.values():
        assert default_config(1, n, k, 128) == gemv_grid_for(n, k, 128, sm_limits(132, 90)).config()
