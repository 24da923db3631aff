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
    return rows


@needs_ptxas
@pytest.mark.slow
def test_the_runtimes_kernels_compile_for_sm86(tmp_path):
    rows = compile_check(tmp_path, [86], runtime_only=True)
    assert not any(r["tuning_only"] for r in rows)


@needs_ptxas
@pytest.mark.slow
def test_every_kernel_and_tuning_config_compiles_for_sm86_89_90(tmp_path):
    rows = compile_check(tmp_path, [86, 89, 90], runtime_only=False)
    assert any(r["tuning_only"] for r in rows)
