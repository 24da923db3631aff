"""Compile every Triton kernel of bie_trt ahead of time, without a GPU, and check it would launch.

What it proves: each kernel, specialised exactly as its Python wrapper launches it at Llama-3-8B
shapes, goes through Triton's full code generation (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the
ptxas bundled in the triton wheel) for each target architecture, and its resources fit that
architecture: shared memory per block (opt-in maximum), at most 255 registers per thread and
registers x threads <= 65536 per block; a W4 GEMV, at most the registers its tile is assumed to
need by the grid choice's occupancy model (`triton_w4.GEMV_TILES`). A kernel that passes cannot fail to launch for lack of
registers or shared memory (the usual "out of resources" errors); it says nothing about speed or
numerical correctness, which the GPU tests cover. Two proxies for speed are reported, not checked: the
`wait/ahead` column counts an attention tile loop's global loads that the same iteration waits for
against those read one iteration ahead (`loop_waits`), and `KB/SM` what one SM keeps in flight for the
loop (its resident programs, `triton_w4.resident_programs`, times the bytes each has on its way).

How: the wrappers (`paged_decode_attention`, `paged_prefill_attention`, `w4_linear_triton` for
every config of `candidate_configs`, the small ops) run on CPU tensors of the real dtypes and
strides while `JITFunction.run` is replaced by a recorder, so grids, constexprs and argument
specialisations are the wrappers' own. Each recorded launch is then bound and compiled the way
`JITFunction.run` does it, but for a `GPUTarget` of our choosing. Registers and spills come from
the log of Triton's own ptxas run, shared memory from the compiled kernel's metadata. Launches
that specialise identically are compiled once (the row lists how many configs share it).

FP8 (float8e4nv) attention needs sm_89 or newer: on sm_86 its failure is recorded as
"unsupported", not as an error. A W4 config only the tuner ever times (M >= 2 runs the default)
that exceeds a limit is "tuning-only": `tune_w4` skips what does not launch. Exit status 1 when
any other kernel fails to compile or exceeds a limit.

    .venv/bin/python scripts/compile_check.py --out benchmarks/results/compile_check_triton3.9.json
    PYTHONPATH=/tmp/tri36 .venv/bin/python scripts/compile_check.py \
        --out benchmarks/results/compile_check_triton3.6.json      # Triton 3.6 unpacked in /tmp/tri36
    options: --arch 86 89 90 (default); --match REGEX (a subset: kernel name or variant)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.kernels import triton_attention as attn
from bie_trt.kernels import triton_int8 as int8
from bie_trt.kernels import triton_ops as ops
from bie_trt.kernels import triton_w4 as w4
from bie_trt.kernels.int8_rows import Int8Rows
from bie_trt.kernels.key_offset import KeyOffset
from bie_trt.kernels.reference import QKNorm
from bie_trt.kernels.step_inputs import TILE_ROWS, StepTiles
from bie_trt.kernels.w4_layout import W4Weight
from bie_trt.kv.pool import allocate_pools
from bie_trt.model.llama import fused_linear_shapes
from bie_trt.model.synthetic import llama3_8b

# Per-block limits by compute capability: the opt-in shared memory maximum (what Triton's
# launcher checks `metadata.shared` against), and the register file of one block.
MAX_SHARED = {86: 101376, 89: 101376, 90: 232448}
MAX_REGS_PER_THREAD = 255
MAX_REGS_PER_BLOCK = 65536
FP8_MIN_ARCH = 89
W4_GROUP = 128
CONTEXT = 8192          # tokens of cached context the attention launches see
PREFILL_CHUNK = 512     # the largest chunk any profile plans for (an engine runs with its own)
H200_SMS = 132


@dataclasses.dataclass
class Launch:
    """One kernel launch as a wrapper made it."""

    fn: JITFunction
    args: tuple
    kwargs: dict[str, Any]
    variant: str
    needs_fp8: bool
    # Only timed by a tuner that skips what does not launch, never used otherwise: too big is no error.
    tuning_only: bool


def record_launches(call: Callable[[], Any], variant: str, needs_fp8: bool = False,
                    tuning_only: bool = False) -> list[Launch]:
    """Run a wrapper with kernel launches replaced by recording them."""
    launches: list[Launch] = []

    def record(fn: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(fn, args, kwargs, variant, needs_fp8, tuning_only))

    with mock.patch.object(JITFunction, "run", record):
        call()
    return launches


VERIFY_ROWS = 6         # γ + 1 of the verify launch


def attention_launches() -> list[Launch]:
    """Decode (batch 1 and 8), a 512-token prefill chunk and a batch-4 verify's tiled launch, for each KV cache dtype and, over a
    quantised pool, each tile loop (v1, v2; over FP16 v2 runs v1's). Over a quantised pool the keys are centred
    (what the build chooses for offset-carrying models, and the variant with more to hold in registers)."""
    model = dataclasses.replace(llama3_8b(), num_layers=1)
    scale = model.head_dim ** -0.5
    # Off the GPU the wrappers pick interpreter-friendly tiles and one partition, so pass what
    # they would pick on an H200.
    group_pad = triton.next_power_of_2(model.num_heads // model.num_kv_heads)
    out: list[Launch] = []
    for dtype in ("fp16", "int4_asym", "fp8"):
        kv = KVCacheConfig(dtype=dtype)
        pools = allocate_pools(model, kv, num_fp_blocks=4, num_quant_blocks=4)
        width = CONTEXT // kv.block_size
        for variant in attn.VARIANTS if dtype != "fp16" else ("v1",):
            tag = f" {variant}" if dtype != "fp16" else ""
            decode = attn.default_config(True, group_pad, quantised=dtype != "fp16", variant=variant)
            for batch in (1, 8):
                q = torch.empty(batch, model.num_heads, model.head_dim, dtype=torch.float16)
                offset = centred(q, model, dtype)
                table = torch.zeros(batch, width, dtype=torch.int32)
                lens = torch.full((batch,), CONTEXT, dtype=torch.int32)
                parts = attn.default_num_partitions(batch * model.num_kv_heads, width // decode["tile_blocks"],
                                                    H200_SMS)
                out += record_launches(
                    lambda: attn.paged_decode_attention(q, pools, 0, table, lens, scale, num_partitions=parts,
                                                        config=decode, offset=offset),
                    f"decode {dtype}{tag} batch {batch}", needs_fp8=dtype == "fp8")
            q = torch.empty(PREFILL_CHUNK, model.num_heads, model.head_dim, dtype=torch.float16)
            offset = centred(q, model, dtype)
            pos = torch.arange(CONTEXT - PREFILL_CHUNK, CONTEXT, dtype=torch.int32)
            config = attn.default_config(True, group_pad, quantised=dtype != "fp16", prefill=True, variant=variant)
            config["num_partitions"] = attn.default_num_partitions(
                PREFILL_CHUNK // config["block_m"] * model.num_kv_heads, width // config["tile_blocks"], H200_SMS)
            out += record_launches(
                lambda: attn.paged_prefill_attention(q, pools, 0, torch.zeros(width, dtype=torch.int32), pos, scale,
                                                     config=config, offset=offset),
                f"prefill {dtype}{tag} chunk {PREFILL_CHUNK}", needs_fp8=dtype == "fp8")
            # a verify graph's tiled launch: batch 4, γ + 1 = 6 rows a sequence, a tile per sequence and
            # one more each for rows crossing a window block (empty here)
            tiles = torch.tensor(StepTiles.layout([VERIFY_ROWS] * 4) + [(0, 0, 0)] * 4, dtype=torch.int32)
            q = torch.empty(4 * VERIFY_ROWS, model.num_heads, model.head_dim, dtype=torch.float16)
            offset = centred(q, model, dtype)
            pos = torch.full((4 * VERIFY_ROWS,), CONTEXT - 1, dtype=torch.int32)
            config = attn.default_config(True, group_pad, quantised=dtype != "fp16", prefill=True, variant=variant)
            config["num_partitions"] = attn.default_num_partitions(len(tiles) * model.num_kv_heads,
                                                                   width // config["tile_blocks"], H200_SMS)
            out += record_launches(
                lambda: attn.paged_tile_attention(q, pools, 0, tiles, torch.zeros(len(tiles), width, dtype=torch.int32),
                                                  pos, scale, TILE_ROWS, config=config, offset=offset),
                f"verify {dtype}{tag} batch 4 rows {VERIFY_ROWS}", needs_fp8=dtype == "fp8")
    return out


def centred(q: torch.Tensor, model: ModelConfig, dtype: str) -> KeyOffset | None:
    """The centred keys' offset a launch over a quantised pool reads (kernels/key_offset.py), None over FP16."""
    if dtype == "fp16":
        return None
    return KeyOffset(torch.empty(q.shape, dtype=torch.float32), torch.empty(model.head_dim // 2))


def w4_launches() -> list[Launch]:
    """Every config `candidate_configs` lists (the default first) for each linear, at M = 1, 5 and 512."""
    short = {"BLOCK_M": "BM", "BLOCK_N": "BN", "BLOCK_K": "BK", "SPLIT_K": "SK", "num_warps": "w", "num_stages": "s"}
    out: list[Launch] = []
    for name, (n, k) in fused_linear_shapes(llama3_8b()).items():
        # Empty tensors of the layout's dtypes and shapes: only strides and alignment matter.
        w = W4Weight(torch.empty(n, k // 8, dtype=torch.int32), torch.empty(n, k // W4_GROUP, dtype=torch.float16),
                     torch.empty(n, k // W4_GROUP, dtype=torch.uint8))
        for m in (1, 5, PREFILL_CHUNK):
            x = torch.empty(m, k, dtype=torch.float16)
            default = w4.default_config(m, n, k, W4_GROUP)
            for cfg in w4.candidate_configs(m, n, k, W4_GROUP):
                tag = " ".join(f"{short[key]}{val}" for key, val in cfg.items())
                # M >= 2 always runs the default; a tuned GEMV config is stored in the engine and
                # may run on another GPU than the one that tuned it, so every M = 1 candidate counts.
                out += record_launches(lambda: w4.w4_linear_triton(x, w, cfg), f"{name} M={m} {tag}",
                                       tuning_only=m > 1 and cfg != default)
        # What the decoder layer launches: the norm folded in front of qkv and gate_up, SiLU·mul
        # behind gate_up, the residual add behind o and down (decode and verify-sized M).
        fused = {"qkv": {"norm_weight": torch.empty(k, dtype=torch.float16), "eps": 1e-5},
                 "gate_up": {"norm_weight": torch.empty(k, dtype=torch.float16), "eps": 1e-5, "silu_mul": True},
                 "o": {"residual": None}, "down": {"residual": None}}[name]
        for m in (1, 6):
            x = torch.empty(m, k, dtype=torch.float16)
            kw = {key: (torch.empty(m, n, dtype=torch.float16) if key == "residual" else v) for key, v in fused.items()}
            out += record_launches(lambda: w4.w4_linear_triton(x, w, None, **kw), f"{name} M={m} fused")
    return out


def lm_head_launches() -> list[Launch]:
    """The int8 lm_head of the 8 GB plans: decode at batch 1 (FMA) and 5 (tl.dot), alone and with the
    model's final norm in front (what the decode step launches)."""
    model = llama3_8b()
    head = Int8Rows(torch.empty(model.vocab_size, model.hidden_size, dtype=torch.int8),
                    torch.empty(model.vocab_size, dtype=torch.float16))
    norm_w = torch.empty(model.hidden_size, dtype=torch.float16)
    out: list[Launch] = []
    for m in (1, 5):
        x = torch.empty(m, model.hidden_size, dtype=torch.float16)
        out += record_launches(lambda: int8.int8_rows_linear_triton(x, head), f"lm_head int8 M={m}")
        out += record_launches(lambda: int8.int8_rows_linear_triton(x, head, norm_weight=norm_w, eps=1e-5),
                               f"lm_head int8 M={m} + norm")
    return out


def ops_launches() -> list[Launch]:
    """rms_norm with and without the residual, silu_mul, write_kv, the qkv epilogue and both block quantisers."""
    model = dataclasses.replace(llama3_8b(), num_layers=1)
    h = torch.empty(PREFILL_CHUNK, model.hidden_size, dtype=torch.float16)
    norm_w = torch.empty(model.hidden_size, dtype=torch.float16)
    gate_up = torch.empty(PREFILL_CHUNK, 2 * model.intermediate_size, dtype=torch.float16)
    kv_new = torch.empty(PREFILL_CHUNK, model.num_kv_heads, model.head_dim, dtype=torch.float16)
    slots = torch.zeros(PREFILL_CHUNK, dtype=torch.int32)
    out = record_launches(lambda: ops.rms_norm_triton(h, norm_w, 1e-5), "hidden 4096")
    out += record_launches(lambda: ops.rms_norm_triton(h, norm_w, 1e-5, residual=h), "hidden 4096 + residual")
    out += record_launches(lambda: ops.silu_mul_triton(gate_up), "intermediate 14336")
    fp16_pools = allocate_pools(model, KVCacheConfig(dtype="fp16"), num_fp_blocks=4, num_quant_blocks=0)
    out += record_launches(lambda: ops.write_kv_triton(fp16_pools, 0, kv_new, kv_new, slots, slots),
                           "8 kv heads x 128")
    qkv = torch.empty(PREFILL_CHUNK, model.q_size + 2 * model.kv_size, dtype=torch.float16)
    inv_freq = torch.empty(model.head_dim // 2, dtype=torch.float32)
    mean = torch.empty(model.num_kv_heads, model.head_dim, dtype=torch.float16)
    long_slots = torch.zeros(PREFILL_CHUNK, dtype=torch.long)
    head_w = torch.empty(model.head_dim, dtype=torch.float16)
    qk_norm = QKNorm(head_w, head_w, 1e-6)   # Qwen3-8B's epilogue: its heads are Llama-3-8B's
    for centre, rotate_v, norms in ((False, False, None), (True, True, None), (False, False, qk_norm)):
        out += record_launches(lambda: ops.qkv_epilogue_triton(qkv, model.num_heads, model.num_kv_heads, long_slots,
                                                               inv_freq, mean if centre else None, True, rotate_v,
                                                               fp16_pools, 0, long_slots, long_slots, norms),
                               f"qkv epilogue centre={centre} rotate_v={rotate_v}"
                               + (" qk_norm" if norms is not None else ""))
    for dtype in ("int4_asym", "fp8"):
        pools = allocate_pools(model, KVCacheConfig(dtype=dtype), num_fp_blocks=4, num_quant_blocks=4)
        # Writes raw bytes, no fp8 arithmetic: must compile on sm_86 too.
        out += record_launches(lambda: ops.quantize_block_triton(pools, 0, 0), f"quantise {dtype}")
    return out


def specialise(launch: Launch, target: GPUTarget) -> tuple[ASTSource, dict[str, Any]]:
    """Bind a launch's arguments as `JITFunction.run` does, for `target` instead of the current GPU."""
    fn = launch.fn
    backend = make_backend(target)
    kwargs = dict(launch.kwargs, debug=launch.kwargs.get("debug", fn.debug) or knobs.runtime.debug)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    # `_pack_args` is private, but it is exactly what run() uses to turn the specialisation into
    # the signature, constexprs and attributes, in 3.6 and 3.9 alike; re-deriving it would drift.
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options.__dict__


def ptxas_resources(log: str) -> dict[str, int]:
    """Registers, spills and static shared memory from a `ptxas -v` log."""
    def grab(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {"regs": grab(r"Used (\d+) registers"), "stack": grab(r"(\d+) bytes stack frame"),
            "spill_stores": grab(r"(\d+) bytes spill stores"), "spill_loads": grab(r"(\d+) bytes spill loads"),
            "static_smem": grab(r"(\d+) bytes smem")}


def shared_traffic(asm: dict[str, str]) -> dict[str, Any]:
    """Static counts of shared-memory traffic in a kernel's PTX (instructions, not how often they run):
    stores by the threads themselves (st.shared), asynchronous copies from global memory (cp.async:
    what software pipelining stages), and the reads back (ld.shared, ldmatrix). `staged` lists the
    tensors the TTGIR moves from registers into shared memory (a `local_alloc` of a value: tl.dot
    operands made in registers, such as a dequantised K/V tile), by shape, wherever they sit."""
    ptx = asm["ptx"]
    return {"st_shared": len(re.findall(r"\bst\.shared\.", ptx)),
            "cp_async": len(re.findall(r"\bcp\.async\.c[ag]\.shared", ptx)),
            "ld_shared": len(re.findall(r"\bld\.shared\.", ptx)),
            "ldmatrix": len(re.findall(r"\bldmatrix\.", ptx)),
            "staged": re.findall(r"ttg\.local_alloc %\S+ : \(tensor<([0-9x]+x\w+),", asm.get("ttgir", ""))}


_ELEMENT_BYTES = {"i1": 1, "i8": 1, "i16": 2, "f16": 2, "bf16": 2, "i32": 4, "f32": 4, "i64": 8, "f64": 8}


def tensor_bytes(line: str) -> int:
    """Bytes of the first tensor of pointers in a TTGIR line (`tensor<64x2x32x!tt.ptr<i8>, ...>`: 4096)."""
    found = re.search(r"tensor<([0-9x]+)x!tt\.ptr<(\w+)>", line)
    if not found:
        return 0
    numel = 1
    for dim in found.group(1).split("x"):
        numel *= int(dim)
    element = found.group(2)
    return numel * _ELEMENT_BYTES.get(element, 1 if element.startswith("f8") else 4)


def _split_operands(text: str) -> list[str]:
    """Top-level comma-separated parts of an operand list (commas inside <...> or (...) do not split)."""
    parts, depth, word = [], 0, ""
    for ch in text:
        depth += ch in "<([{"
        depth -= ch in ">)]}"
        if ch == "," and depth == 0:
            parts.append(word.strip())
            word = ""
        else:
            word += ch
    return parts + [word.strip()] if word.strip() else parts


def _loop_body(lines: list[str], start: int) -> list[tuple[int, str]]:
    """The lines of the scf.for opened at lines[start], each with its depth of nesting in the body (1: the
    body itself, more: inside a region of it, such as an scf.if)."""
    body, depth = [], 1
    for line in lines[start + 1:]:
        depth += line.count("{") - line.count("}")
        if depth <= 0:
            break
        body.append((depth, line))
    return body


def _loop_reads(head: str, body: list[tuple[int, str]]) -> dict[str, int]:
    """`loop_waits` of one loop, with `bytes`: what the body's unconditional loads and copies read."""
    # the loop's carried values: iter_args(%a = %init, ...) in order, and what the body yields for each
    carried = re.search(r"iter_args\((.*?)\) ->", head)
    names = [part.split(" = ")[0] for part in _split_operands(carried.group(1))] if carried else []
    final = next((line for level, line in reversed(body) if level == 1 and "scf.yield" in line), "")
    yielded = _split_operands(final.split("scf.yield", 1)[1].split(" : ")[0]) if final else []

    def used(name: str, after: int) -> bool:
        use = re.compile(re.escape(name) + r"(?![\w#])")
        return any(use.search(later) and not later.lstrip().startswith("scf.yield") for _, later in body[after:])

    def carried_for(name: str) -> int:
        """Iterations a value yielded by the body travels through the carried values before use."""
        steps = 0
        while name in yielded and steps < len(names):
            steps += 1
            name = names[yielded.index(name)]
            if used(name, 0):
                break
        return steps

    counts = {"waited": 0, "read_ahead": 0, "in_branches": 0, "async_copies": 0, "in_flight_bytes": 0,
              "bytes": 0}
    for k, (level, line) in enumerate(body):
        if "ttg.async_copy_global_to_local" in line and level == 1:
            counts["async_copies"] += 1
            counts["in_flight_bytes"] += tensor_bytes(line)
            counts["bytes"] += tensor_bytes(line)
        found = re.match(r"\s*(%[\w.]+) = tt\.load ", line)
        if not found:
            continue
        if level > 1:   # inside a region of the body (an scf.if)
            counts["in_branches"] += 1
            continue
        counts["bytes"] += tensor_bytes(line)
        if used(found.group(1), k + 1):
            counts["waited"] += 1
            counts["in_flight_bytes"] += tensor_bytes(line)
        else:
            counts["read_ahead"] += 1
            counts["in_flight_bytes"] += tensor_bytes(line) * max(1, carried_for(found.group(1)))
    return counts


def loop_waits(ttgir: str) -> dict[str, int] | None:
    """What a kernel's main loop (of its scf.for loops holding a tl.dot, or else of all, the one whose body
    reads the most bytes: an attention kernel's tile loop, a GEMV's weight loop) waits for, from the TTGIR: the global loads of its body
    (`tt.load`; outside any branch of it) whose result the same iteration uses, against those only handed
    on to later iterations (read ahead), loads inside a branch of the body, and the asynchronous copies
    Triton's pipeliner made. Each waited load puts a whole memory latency on the iteration unless other
    warps cover it; a loop that waits for none keeps its reads in flight while it computes.
    `in_flight_bytes`: what one program can have on its way at once: every load of an iteration (a waited
    one is on its way while the iteration waits, though one that waits for another's address is not on its
    way with it), a read-ahead load times the iterations it is carried before use (followed through the
    loop's yields), and one stage of the asynchronous copies. None when the kernel has no loop that reads."""
    lines = ttgir.splitlines()
    bodies = [(head, _loop_body(lines, start)) for start, head in enumerate(lines) if " = scf.for " in head]
    # a loop with a tl.dot is the work; a partition merge's loop can read more bytes an iteration
    dots = [(head, body) for head, body in bodies if any(" tt.dot " in line or "warp_group_dot" in line
                                                         for _, line in body)]
    loops = [_loop_reads(head, body) for head, body in dots or bodies]
    main = max(loops, key=lambda loop: loop["bytes"], default=None)
    return main if main and main["bytes"] else None


def gemv_register_budget(launch: Launch) -> int | None:
    """The registers `triton_w4.gemv_grid` assumes a W4 GEMV launch's tile needs (None: not a GEMV)."""
    if launch.fn is not w4._w4_gemv_kernel:
        return None
    kw = launch.kwargs
    return next((t.regs for t in w4.GEMV_TILES
                 if (t.block_n, t.block_k, t.num_warps) == (kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"])), 0)


def check_one(launch: Launch, target: GPUTarget, src: ASTSource, options: dict[str, Any]) -> dict[str, Any]:
    """Compile one specialised launch for `target` and measure it against the architecture's limits."""
    arch = target.arch
    row: dict[str, Any] = {"kernel": launch.fn.__name__, "arch": arch, "variants": [launch.variant],
                           "tuning_only": launch.tuning_only,
                           "num_warps": options["num_warps"], "num_stages": options["num_stages"]}
    log = io.StringIO()
    try:
        # Triton prints its ptxas log when asked to; its own run is the one that made the cubin.
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=target, options=options)
    except Exception as e:  # noqa: BLE001 - each Triton stage raises its own type
        expected = launch.needs_fp8 and arch < FP8_MIN_ARCH
        row.update(status="unsupported" if expected else "failed", error=f"{type(e).__name__}: {e}"[:3000])
        return row
    res = ptxas_resources(log.getvalue())
    meta = kernel.metadata
    threads = meta.num_warps * 32
    smem = meta.shared + res["static_smem"]
    problems = []
    if smem > MAX_SHARED[arch]:
        problems.append(f"shared memory {smem} B > {MAX_SHARED[arch]} B")
    if res["regs"] > MAX_REGS_PER_THREAD:
        problems.append(f"{res['regs']} registers/thread > {MAX_REGS_PER_THREAD}")
    if res["regs"] * threads > MAX_REGS_PER_BLOCK:
        problems.append(f"{res['regs']} registers x {threads} threads > {MAX_REGS_PER_BLOCK}")
    if not res["regs"]:
        problems.append("no register count in the ptxas log")
    budget = gemv_register_budget(launch)
    if budget is not None and res["regs"] > budget:
        problems.append(f"{res['regs']} registers/thread > the {budget} the GEMV grid's occupancy assumes "
                        f"(triton_w4.GEMV_TILES)")
    # Global scratch is allocated at launch through triton.set_allocator, which bie_trt never sets.
    scratch = getattr(meta, "global_scratch_size", 0)
    if scratch:
        problems.append(f"needs {scratch} B of global scratch (triton.set_allocator)")
    loop = loop_waits(kernel.asm.get("ttgir", ""))
    if loop and res["regs"]:
        # what one SM keeps in flight for the loop: its resident programs times each one's next-tile reads
        resident = w4.resident_programs(res["regs"], meta.num_warps, w4.sm_limits(1, arch), smem)
        loop.update(resident_per_sm=resident, in_flight_per_sm=resident * loop["in_flight_bytes"])
    row.update(res, problems=problems, smem=smem, num_warps=meta.num_warps, num_stages=meta.num_stages,
               global_scratch=scratch, hash=kernel.hash, ptx=shared_traffic(kernel.asm), loop=loop)
    return row


def run(archs: list[int], match: str | None = None) -> list[dict[str, Any]]:
    launches = attention_launches() + w4_launches() + lm_head_launches() + ops_launches()
    if match:   # a subset, e.g. the decoder layer's launches: "fused|epilogue|decode|lm_head"
        launches = [l for l in launches if re.search(match, f"{l.fn.__name__} {l.variant}")]
    rows: list[dict[str, Any]] = []
    for arch in archs:
        seen: dict[str, dict[str, Any]] = {}
        target = GPUTarget("cuda", arch, 32)
        for launch in launches:
            src, options = specialise(launch, target)
            key = f"{src.hash()}{sorted(options.items())}"
            if key in seen:  # same specialisation as an earlier launch: same binary
                seen[key]["variants"].append(launch.variant)
                seen[key]["tuning_only"] &= launch.tuning_only
                continue
            row = check_one(launch, target, src, options)
            seen[key] = row
            rows.append(row)
            print(f"  sm_{arch} {row['kernel']:<32} {launch.variant}", file=sys.stderr, flush=True)
    for row in rows:
        if "status" not in row:  # compiled: the verdict waits until every launch sharing it is known
            row["status"] = "ok" if not row["problems"] else "tuning-only" if row["tuning_only"] else "exceeds"
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'arch':<6}{'kernel':<33}{'regs':>5}{'spill st/ld':>12}{'smem':>8}{'st.sh/cp.as':>12}{'wait/ahead':>11}"
            f"{'KB/SM':>8}{'warps':>6}{'stg':>4}  {'status':<12}variant")
    print(head)
    print("-" * len(head))
    for r in rows:
        more = f" (+{len(r['variants']) - 1} more)" if len(r["variants"]) > 1 else ""
        if "regs" in r:
            spill = f"{r['spill_stores']}/{r['spill_loads']}"
            shared = f"{r['ptx']['st_shared']}/{r['ptx']['cp_async']}"
            loop = f"{r['loop']['waited']}/{r['loop']['read_ahead']}" if r.get("loop") else "-"
            flight = f"{r['loop']['in_flight_per_sm'] / 1024:.1f}" if r.get("loop") else "-"
            res = f"{r['regs']:>5}{spill:>12}{r['smem']:>8}{shared:>12}{loop:>11}{flight:>8}"
        else:
            res = f"{'-':>5}{'-':>12}{'-':>8}{'-':>12}{'-':>11}{'-':>8}"
        print(f"sm_{r['arch']:<3}{r['kernel']:<33}{res}{r['num_warps']:>6}{r['num_stages']:>4}  "
              f"{r['status']:<12}{r['variants'][0]}{more}")
        # An error's last line is its cause; the lines above locate it in the kernel source.
        for text in r.get("problems", []) + ([r["error"].strip().splitlines()[-1]] if "error" in r else []):
            print(f"{'':<6}! {text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON report path")
    parser.add_argument("--arch", type=int, nargs="+", default=[86, 89, 90], choices=sorted(MAX_SHARED))
    parser.add_argument("--match", help="only launches whose kernel name or variant matches this regex")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as cache:
        # A fresh cache makes every compile run ptxas (so its log exists) and leaves ~/.triton alone.
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        rows = run(args.arch, args.match)
    print_table(rows)
    bad = [r for r in rows if r["status"] in ("failed", "exceeds")]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "unsupported", "tuning-only", "failed", "exceeds")}
    print(f"\ntriton {triton.__version__}: {len(rows)} compiled specialisations, {counts}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"triton_version": triton.__version__, "torch_version": torch.__version__, "archs": args.arch,
                  "match": args.match,
                  "limits": {"max_shared_bytes": MAX_SHARED, "max_regs_per_thread": MAX_REGS_PER_THREAD,
                             "max_regs_per_block": MAX_REGS_PER_BLOCK},
                  "summary": counts, "results": rows}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
