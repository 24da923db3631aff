"""Every Triton kernel compiles to a cubin without a GPU and fits its registers and shared memory:
`scripts/compile_check.py` (its JSON for sm_86/89/90 under Triton 3.6 and 3.9 is in benchmarks/results/).
Only FP8 attention may fail on sm_86: it needs sm_89.

By default every launch the runtime makes, for an RTX 3060 (sm_86). A W4 config at M >= 2 that only the
tuner times (it skips what does not launch, and M >= 2 runs the default) cannot fail the check by
exceeding a limit, yet it is two thirds of the compile time: those, and sm_89 and sm_90, run under
`-m slow`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
needs_ptxas = pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel carries no ptxas")

# compile_check.py with the tuner-only W4 launches left out
RUNTIME_LAUNCHES_ONLY = """
import sys
sys.path.insert(0, "scripts")
import compile_check
every = compile_check.w4_launches
compile_check.w4_launches = lambda: [launch for launch in every() if not launch.tuning_only]
sys.exit(compile_check.main())
"""


def compile_check(tmp_path: Path, archs: list[int], runtime_only: bool) -> list[dict]:
    out = tmp_path / "compile.json"
    script = ["-c", RUNTIME_LAUNCHES_ONLY] if runtime_only else ["scripts/compile_check.py"]
    # compile for real: under the interpreter (which conftest turns on) there is no code generation
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)   # this tree's bie_trt, not an installed one
    res = subprocess.run([sys.executable, *script, "--arch", *map(str, archs), "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=1800, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    for arch in archs:
        kernels = {r["kernel"] for r in rows if r["status"] == "ok" and r["arch"] == arch}
        assert {"_paged_attention_kernel", "_qkv_epilogue_kernel", "_w4_gemv_kernel", "_w4_mma_kernel"} <= kernels
        unsupported = [r for r in rows if r["status"] == "unsupported" and r["arch"] == arch]
        if arch < 89:
            assert unsupported and all("fp8" in v for r in unsupported for v in r["variants"])
        else:
            assert not unsupported
    # the runtime's defaults spill little: at most the INT4 prefill's 84 B a thread under Triton 3.9
    # (1 KB before its tiles were halved)
    for r in rows:
        if r["status"] == "ok" and not r["tuning_only"]:
            assert r["spill_stores"] <= 128, r
    # v1's tile loop over a quantised pool reads each tile's table entries, codes and records ahead: no
    # iteration waits for a load it issued itself (before, six loads a tile: two table reads, four records)
    quantised_v1 = [r for r in rows if r["status"] == "ok" and r["kernel"] == "_paged_attention_kernel"
                    and any(re.search(r"(int4_asym|fp8) v1", v) for v in r["variants"])]
    assert quantised_v1
    for r in quantised_v1:
        assert r["loop"]["waited"] == 0 and r["loop"]["read_ahead"] > 0, r
    # the W4 linears read each K-step's scales and zeros (and the GEMV its x) a step ahead too
    w4 = [r for r in rows if r["status"] == "ok" and r["kernel"] in ("_w4_gemv_kernel", "_w4_mma_kernel")]
    assert w4 and all(r["loop"]["waited"] == 0 for r in w4), [r for r in w4 if r["loop"]["waited"]][:1]
    return rows


# A tile loop as Triton's TTGIR prints it (trimmed): a load the iteration uses, one handed to the next
# iteration, one carried two iterations (through %far into %ahead, which the body uses), one in a branch,
# a pipelined copy; then a loop reading fewer bytes, which is not the main loop.
TTGIR = """
    %r:3 = scf.for %t = %lo to %hi step %c1 iter_args(%acc = %z, %ahead = %a0, %far = %f0) -> (tensor<16x64xf32, #mma>, tensor<64xi32, #blocked>, tensor<64x2x32xi8, #blocked>)  : i32 {
      %used = tt.load %p0, %m0 : tensor<64x!tt.ptr<f16>, #blocked> loc(#loc1)
      %next = tt.load %p1, %m1 : tensor<64x!tt.ptr<i32>, #ttg.slice<{dim = 1, parent = #blocked}>> loc(#loc2)
      %codes = tt.load %p4, %m4 : tensor<64x2x32x!tt.ptr<i8>, #blocked> loc(#loc4)
      %c = ttg.async_copy_global_to_local %p2, %buf : tensor<64x!tt.ptr<i8>, #blocked> -> <64xi8, #shared, #smem, mutable>
      %w = arith.mulf %used, %used : tensor<64xf16, #blocked>
      %x = arith.sitofp %ahead : tensor<64x2x32xi8, #blocked> to tensor<64x2x32xf16, #blocked>
      %s = tt.dot %q, %k, %acc : tensor<16x64xf16> * tensor<64x64xf16> -> tensor<16x64xf32, #mma>
      %b = scf.if %cond -> (tensor<16x64xf32, #mma>) {
        %rare = tt.load %p3, %m3 : tensor<64x!tt.ptr<f16>, #blocked> loc(#loc3)
        scf.yield %s : tensor<16x64xf32, #mma>
      } else {
        scf.yield %s : tensor<16x64xf32, #mma>
      }
      scf.yield %b, %far, %codes : tensor<16x64xf32, #mma>, tensor<64x2x32xi8, #blocked>, tensor<64x2x32xi8, #blocked>
    }
    %merge = scf.for %p = %c0 to %n step %c1 iter_args(%m = %x) -> (tensor<16xf32, #blocked>)  : i32 {
      %part = tt.load %ws, %ok : tensor<16x!tt.ptr<f32>, #blocked>
      scf.yield %part : tensor<16xf32, #blocked>
    }
"""


def test_loop_waits_counts_what_the_iteration_waits_for():
    sys.path.insert(0, str(ROOT / "scripts"))
    from compile_check import loop_waits

    # in flight: the codes' 4096 B for two iterations, the entries' 256 B (yielded, never used: one), the copy's
    # 64 B, and the 128 B the iteration waits for
    assert loop_waits(TTGIR) == {"waited": 1, "read_ahead": 2, "in_branches": 1, "async_copies": 1,
                                 "in_flight_bytes": 2 * 4096 + 256 + 64 + 128, "bytes": 128 + 256 + 4096 + 64}
    # an iteration that converts what it read ahead waits for it after all
    converted = TTGIR.replace("%s = tt.dot", "%n2 = arith.extsi %next : tensor<64xi32, #blocked>\n      %s = tt.dot")
    assert loop_waits(converted)["waited"] == 2
    # codes used one iteration after their load (yielded straight into %ahead) are in flight once
    direct = TTGIR.replace("scf.yield %b, %far, %codes", "scf.yield %b, %codes, %far")
    assert loop_waits(direct)["in_flight_bytes"] == 4096 + 256 + 64 + 128
    # the main loop: of the loops with a tl.dot (else of all), the one that reads the most
    small = TTGIR.replace("64x2x32x!tt.ptr<i8>", "1x!tt.ptr<i8>").replace("tensor<64x", "tensor<1x")
    assert loop_waits(small)["waited"] == 1 and loop_waits(small)["bytes"] == 2 + 4 + 1 + 1
    merge = loop_waits(small.replace(" tt.dot ", " arith.addf "))
    assert merge["waited"] == 0 and merge["read_ahead"] == 1 and merge["bytes"] == 16 * 4
    assert loop_waits(TTGIR.split("%merge")[0].replace("scf.for", "scf.while")) is None   # no loop at all
