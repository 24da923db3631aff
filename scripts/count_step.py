"""Count what one graph-captured decode step launches, per decoder layer and outside the layers,
and the bytes those launches move, against the roofline bytes (weights + KV a token must read).

No GPU needed. The step is `cuda_graphs._StaticStep`'s own (the code a CUDA graph records), run
eagerly with the Triton kernels forced (`BIE_TRT_KERNELS=triton`):

* **launches**: every Triton kernel launch (a hook on the launcher), and every torch op that would
  be a CUDA kernel (a `TorchDispatchMode`: views, empty allocations and the interpreter's own host
  copies are not kernels, in-place and out-of-place math is);
* **per layer / outside**: the step of a 1-layer and a 2-layer model of the same shapes; the
  difference is one layer, the rest is outside the layers;
* **bytes** at the real shapes (Llama-3-8B, and Qwen3-8B beside it) on the `meta` device, where nothing is
  computed or allocated and each Triton launch is recorded instead of run: a torch op moves its
  inputs and outputs; a Triton launch moves its tensor arguments, except the KV pools, of which
  an attention launch reads the context's K/V (`plan.kv_bytes_per_token` a layer) and write_kv
  writes the step's rows. Outputs are the arguments a kernel writes (`*out*`, partials, workspaces).

    python scripts/count_step.py --out benchmarks/results/count_step.json          # 8B shapes, 64k, batch 1
    python scripts/count_step.py --batch 8 --context 8192 --tiny                     # also run the tiny model
    python scripts/count_step.py --verify-rows 6 --out benchmarks/results/count_verify_b1.json   # and a γ=5 verify
    python scripts/count_step.py --spec --out benchmarks/results/count_spec.json   # verify γ=4,5 b=1,4 ± crossing; draft

**host syncs of a draft round** (`--draft-syncs ENGINE_DIR`): a real `DraftModelProposer` on the CPU proposing
γ = 5 tokens for batch 1 and 4, with every op that makes a host wait for the device's results recorded
between its draft steps: a value read (`item`, `int`, `bool`: `_local_scalar_dense`), an output shaped by
values (`nonzero`, `unique`, `masked_select`), and a whole tensor read on the host (`tolist`, `numpy`,
`cpu`, hooked: on the CPU they dispatch nothing). The round hands its proposals over after its last step
with one `tolist`.

**host syncs of a decode step** (`--step-syncs ENGINE_DIR`): one `EngineCore` step of four decoding rows on
the CPU, the same reads recorded outside the forward (`ModelRunner.execute`): sampling every row (constraints,
penalties, filters, the draw, logprobs) and the step's bookkeeping. All rows are sampled in one batch and
read back with one `tolist`.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bie_trt.config import KVCacheConfig, ModelConfig  # noqa: E402
from bie_trt.cache_tiers.exact_rows import runs  # noqa: E402
from bie_trt.kernels.int8_rows import Int8Rows  # noqa: E402
from bie_trt.kernels.step_inputs import SeqInput, StepTiles  # noqa: E402
from bie_trt.kernels.triton_w4 import gemv_grid_for, sm_limits  # noqa: E402
from bie_trt.kv.pool import allocate_pools  # noqa: E402
from bie_trt.model.cuda_graphs import DecodeGraphs, _StaticStep  # noqa: E402
from bie_trt.model.llama import LlamaModel, fused_linear_shapes  # noqa: E402
from report import emit  # noqa: E402
from bie_trt.model.synthetic import llama32_1b, llama3_8b, qwen3_8b, random_weights, tiny_llama  # noqa: E402
from bie_trt.plan import (DEFAULT_DRAFT_SINK_TOKENS, DEFAULT_DRAFT_WINDOW_TOKENS, draft_kv_blocks_per_seq,  # noqa: E402
                          draft_request_rows, draft_vocab_rows, kv_bytes_per_token, lm_head_bytes, linear_weight_bytes)

# Where a counted draft step's tokens sit in the text: far past its cache (only the RoPE offset sees it).
DRAFT_POSITION = 65536

# Ops that allocate without touching memory, or only look at metadata.
_NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
                "is_same_size", "_unsafe_view", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_has_compatible_shallow_copy_type"}
# Triton arguments a kernel writes; every other tensor argument is read.
_WRITTEN = re.compile(r"(^out|_out|part|_ws|sum|^kc_|^vc_)")
# Triton arguments that are whole KV pools: only what the step touches counts.
_POOL_ARGS = {"k_ptr", "v_ptr", "kq_ptr", "vq_ptr", "ks_ptr", "vs_ptr", "kz_ptr", "vz_ptr", "kc_ptr", "vc_ptr"}


# (SMs, compute capability) of the GPUs the build profiles name, and siblings of theirs.
GPUS = {"rtx3060": (28, 86), "rtx3060ti": (38, 86), "rtx3070": (46, 86), "rtx4060": (24, 89),
        "rtx4060ti": (34, 89), "rtx4070-laptop": (36, 89), "rtx4070": (46, 89), "rtx4090": (128, 89),
        "h200": (132, 90)}


@dataclasses.dataclass
class Launch:
    name: str
    triton: bool
    read: int
    written: int


@dataclasses.dataclass
class StepShape:
    """What the byte model needs to know about the step beyond the arguments' shapes."""

    model: ModelConfig
    kv: KVCacheConfig
    rows: int              # rows the step writes K/V for
    context: int
    attention_reads: int   # contexts the attention launch reads: one a decode row, one a verify's query tile


def _is_view(op: Any) -> bool:
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class _TorchOps(TorchDispatchMode):
    """Records every dispatched op that would be a kernel, unless a Triton launch is running."""

    def __init__(self, sink: list[Launch]):
        super().__init__()
        self.sink, self.paused = sink, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        tensors_out = [a for a in torch.utils._pytree.tree_leaves(out) if isinstance(a, torch.Tensor)]
        if not self.paused and tensors_out and name not in _NOT_KERNELS and not _is_view(func):
            flat_in = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            mutated = {id(a) for i, a in enumerate(args) if i < len(func._schema.arguments)
                       and func._schema.arguments[i].alias_info is not None
                       and func._schema.arguments[i].alias_info.is_write}
            read = sum(_nbytes(a) for a in flat_in if id(a) not in mutated)
            written = sum(_nbytes(a) for a in tensors_out)
            if mutated and not name.endswith("_"):   # out= variants
                written = sum(_nbytes(a) for a in flat_in if id(a) in mutated)
            self.sink.append(Launch(name, False, read, written))
        return out


def _triton_bytes(name: str, arg_names: list[str], args: tuple, shape: StepShape) -> tuple[int, int]:
    read = written = 0
    for arg_name, a in zip(arg_names, args):
        if not isinstance(a, torch.Tensor) or arg_name in _POOL_ARGS:
            continue
        if _WRITTEN.search(arg_name):
            written += _nbytes(a)
        else:
            read += _nbytes(a)
    m, kv = shape.model, shape.kv
    if "attention" in name:
        read += shape.attention_reads * shape.context * kv_bytes_per_token(m, kv) // m.num_layers
    if "write_kv" in name:
        written += shape.rows * 2 * m.num_kv_heads * m.head_dim * 2
    return read, written


def _triton_hook(sink: list[Launch], mode: _TorchOps, shape: StepShape, execute: bool) -> Callable:
    """A replacement for the Triton launcher's `run`: records the launch, then runs it (or not)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(fn, *args, grid, warmup, **kwargs):
        name = fn.fn.__name__
        sink.append(Launch(name, True, *_triton_bytes(name, fn.arg_names, args, shape)))
        if not execute:
            return None
        mode.paused = True
        try:
            return original(fn, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            mode.paused = False

    return run


def launches_of_step(cfg: ModelConfig, kv: KVCacheConfig, batch: int, context: int, device: str,
                     rows: int = 1, draft_heads: tuple[int, int] | None = None) -> list[Launch]:
    """Every launch of one step of `batch` sequences at `context` tokens each (shapes only on meta), as a
    CUDA graph records it (`cuda_graphs._StaticStep`, its buffers filled on the host before the count):
    a decode (`rows` = 1), or a speculative verify of `rows` = γ+1 tokens a sequence, whose rows are cut
    into runs where they cross a window block, as the engine cuts them (each run reads its own block-table
    view; which pool a block sits in changes no launch). `draft_heads` = (K, R): a draft's step instead, a
    decode of its bounded cache (`context` tokens, kept at later original positions), its hidden states
    then through its two int8 heads a sequence (K static rows, R rows of the sequence's own ids)."""
    from triton.runtime.interpreter import InterpretedFunction

    dtype = torch.float16 if device == "meta" else torch.float32
    weights = random_weights(cfg, group_size=min(128, cfg.hidden_size // 2), device=device)
    model = LlamaModel(cfg, weights, torch.device(device), dtype)
    blocks_per_seq = -(-context // kv.block_size)
    num_blocks = batch * blocks_per_seq   # every block FP16: which pool a block sits in changes no launch
    pools = allocate_pools(cfg, kv, num_blocks, num_blocks, dtype, torch.device(device), scratch_block=True)
    rope = 0 if draft_heads is None else DRAFT_POSITION - context
    seqs = [SeqInput(torch.arange(rows)[row:row + n] + 1 + i, context - rows + row,
                     list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), all_logits=rows > 1, rope_offset=rope)
            for i in range(batch) for row, n, _ in runs(context - rows, rows, kv)]
    step = _StaticStep(model, pools, batch, blocks_per_seq, pools.scratch_block, capture=False, rows=rows,
                       head=draft_heads is None)
    run = step._step
    if draft_heads is not None:
        heads = [Int8Rows(model.lm_head.q[:n], model.lm_head.scale[:n]) for n in draft_heads]

        def run() -> None:   # as DraftModelProposer._logits: each sequence's row through both heads
            for row in step._step()[:batch]:
                for head in heads:
                    model.head_logits(row[None], head)
    tiles = batch if rows == 1 else len(StepTiles.layout([len(s.token_ids) for s in seqs]))
    sink: list[Launch] = []
    mode = _TorchOps(sink)
    real_run, kernels = InterpretedFunction.run, os.environ.get("BIE_TRT_KERNELS")
    InterpretedFunction.run = _triton_hook(sink, mode, StepShape(cfg, kv, batch * rows, context, tiles),
                                           execute=device != "meta")
    # The Triton kernels on CPU tensors, for this step only: an importer's other work keeps its kernels.
    os.environ["BIE_TRT_KERNELS"] = "triton"
    try:
        step.run(seqs)   # fills the static buffers; compiles nothing on meta
        sink.clear()
        with mode:
            run()
    finally:
        InterpretedFunction.run = real_run
        if kernels is None:
            del os.environ["BIE_TRT_KERNELS"]
        else:
            os.environ["BIE_TRT_KERNELS"] = kernels
    return sink


def _tally(launches: list[Launch]) -> collections.Counter:
    return collections.Counter(("triton" if x.triton else "torch", x.name) for x in launches)


def _bytes(launches: list[Launch]) -> tuple[int, int]:
    return sum(x.read for x in launches), sum(x.written for x in launches)


def roofline_bytes(cfg: ModelConfig, kv: KVCacheConfig, batch: int, context: int, group_size: int = 128,
                   draft_heads: tuple[int, int] | None = None) -> int:
    """What a step must read at least: every weight once (W4 layers, int8 lm_head) and each sequence's K/V.
    A draft's heads: its K static rows once and each sequence's own R rows (int8 and a scale a row)."""
    head = (lm_head_bytes(cfg, "int8") if draft_heads is None
            else (draft_heads[0] + batch * draft_heads[1]) * (cfg.hidden_size + 2))
    return linear_weight_bytes(cfg, group_size) + head + batch * context * kv_bytes_per_token(cfg, kv)


def split_layers(cfg: ModelConfig, kv: KVCacheConfig, batch: int, context: int, device: str, rows: int = 1,
                 draft_heads: tuple[int, int] | None = None) -> dict:
    """Launches of one layer (2-layer step minus 1-layer step) and outside the layers."""
    one, two = (launches_of_step(dataclasses.replace(cfg, num_layers=n), kv, batch, context, device, rows, draft_heads)
                for n in (1, 2))
    layer = _tally(two) - _tally(one)
    outside = _tally(one) - layer
    layer_bytes = [b - a for a, b in zip(_bytes(one), _bytes(two))]
    outside_bytes = [a - b for a, b in zip(_bytes(one), layer_bytes)]
    return {"layer": layer, "outside": outside, "layer_bytes": layer_bytes, "outside_bytes": outside_bytes}


def _listing(counts: collections.Counter) -> list[dict]:
    return [{"kind": kind, "name": name, "count": n} for (kind, name), n in sorted(counts.items())]


def count(cfg: ModelConfig, kv: KVCacheConfig, batch: int, context: int, device: str = "meta", rows: int = 1,
          draft_heads: tuple[int, int] | None = None) -> dict:
    """The launch and byte accounting of one step (`launches_of_step`); bytes are judged against a decode's
    roofline, which a verify step of the same batch shares (the weights are read once; each query tile
    reads its sequence's K/V, so a verify crossing a window block reads it twice)."""
    parts = split_layers(cfg, kv, batch, context, device, rows, draft_heads)
    L = cfg.num_layers
    read = L * parts["layer_bytes"][0] + parts["outside_bytes"][0]
    written = L * parts["layer_bytes"][1] + parts["outside_bytes"][1]
    roof = roofline_bytes(cfg, kv, batch, context, draft_heads=draft_heads)
    per_layer, outside = sum(parts["layer"].values()), sum(parts["outside"].values())
    return {
        "device": device, "batch": batch, "rows": rows, "context": context, "kv": dataclasses.asdict(kv),
        "model": dataclasses.asdict(cfg), "draft_heads": draft_heads,
        "launches_per_layer": per_layer, "launches_outside": outside, "launches_total": L * per_layer + outside,
        "triton_per_layer": sum(n for (k, _), n in parts["layer"].items() if k == "triton"),
        "per_layer": _listing(parts["layer"]), "outside": _listing(parts["outside"]),
        "bytes_read": read, "bytes_written": written, "roofline_bytes": roof,
        "bytes_over_roofline": (read + written) / roof,
    }


def verify_context(rows: int, crossing: bool, kv: KVCacheConfig, near: int = 65536) -> int:
    """The first context from `near` on whose last `rows` positions do (or do not) cross a window block."""
    context = near
    while (len(runs(context - rows, rows, kv)) > 1) != crossing:
        context += 1
    return context


def draft_step(batch: int, group_size: int = 128) -> dict:
    """One step of the Llama-3.2-1B draft as built by default: its FP16 cache of sinks and window (the
    plan's blocks a sequence, all of them read), its default static head and request rows."""
    draft = llama32_1b()
    kv = KVCacheConfig(dtype="fp16", sink_tokens=DEFAULT_DRAFT_SINK_TOKENS, window=DEFAULT_DRAFT_WINDOW_TOKENS)
    tokens = draft_kv_blocks_per_seq(kv.sink_tokens, kv.window, kv.block_size) * kv.block_size
    k = draft_vocab_rows(draft, "int8", None)
    return count(draft, kv, batch, tokens, "meta", draft_heads=(k, draft_request_rows(draft, k, None)))


def speculation(kv: KVCacheConfig) -> dict:
    """Verify steps of the 8B at γ = 4, 5, batch 1 and 4, crossing a window block and not, near 64k; and
    one draft step of the 1B at batch 1 and 4."""
    out = {}
    for gamma in (4, 5):
        for batch in (1, 4):
            for crossing in (False, True):
                context = verify_context(gamma + 1, crossing, kv)
                name = f"verify_g{gamma}_b{batch}{'_crossing' if crossing else ''}"
                out[name] = count(llama3_8b(), kv, batch, context, "meta", gamma + 1)
    for batch in (1, 4):
        out[f"draft_b{batch}"] = draft_step(batch)
    return out


# Ops whose result the host must wait for on a GPU: a value read, or an output shaped by the values.
_HOST_READ_OPS = {"_local_scalar_dense", "nonzero", "unique_dim", "_unique2", "_unique", "masked_select",
                  "unique_consecutive"}
_HOST_READ_METHODS = ("tolist", "numpy", "cpu")


class _HostReads(TorchDispatchMode):
    """Records each op that waits for the device's results (see the module docstring) into `events`, except
    while `paused` (inside a static step: on a GPU a CUDA graph's replay, which cannot hold a sync)."""

    def __init__(self, events: list[tuple[str, str]]):
        super().__init__()
        self.events, self.paused = events, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _HOST_READ_OPS and not self.paused:
            self.events.append(("sync", name))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads(events: list[tuple[str, str]]) -> Iterator[_HostReads]:
    """Record every host read into `events` while inside (the mode, and the hooked tensor methods, which on the
    CPU dispatch nothing); the mode's `paused` turns recording off (see `paused`)."""
    mode = _HostReads(events)
    methods = {m: getattr(torch.Tensor, m) for m in _HOST_READ_METHODS}

    def hook(method: str) -> Callable:
        def read(self, *args, **kwargs):
            if not mode.paused:
                events.append(("sync", method))
            return methods[method](self, *args, **kwargs)
        return read

    for m in methods:
        setattr(torch.Tensor, m, hook(m))
    try:
        with mode:
            yield mode
    finally:
        for m, f in methods.items():
            setattr(torch.Tensor, m, f)


def paused(mode: _HostReads, fn: Callable) -> Callable:
    """`fn` with recording off: on a GPU its work is a CUDA graph's replay, which cannot hold a sync."""
    def run(*args, **kwargs):
        mode.paused = True
        try:
            with _disable_current_modes():   # (and no dispatch through the mode: thousands of ops)
                return fn(*args, **kwargs)
        finally:
            mode.paused = False
    return run


def draft_round_syncs(proposer: Any, requests: list) -> dict:
    """One `proposer.propose(requests)` round, its draft steps and host reads recorded in order: how many reads
    fall after the first draft step's forward and up to the end of the last one's (0 when each proposal is
    drawn on the device and fed to the next step there), and after it (the hand-over). What a static step
    computes is a graph replay on a GPU, so only what the host does around it counts (staging its inputs,
    the heads, drawing, feeding the next step)."""
    events: list[tuple[str, str]] = []
    hidden, replay = proposer._hidden, _StaticStep._step

    def step(inputs):
        out = hidden(inputs)
        events.append(("step", str(len(inputs))))
        return out

    with host_reads(events) as mode:
        proposer._hidden, _StaticStep._step = step, paused(mode, replay)
        try:
            proposals = proposer.propose(requests)
        finally:
            _StaticStep._step = replay
            del proposer._hidden
    steps = [i for i, (kind, _) in enumerate(events) if kind == "step"]
    between = [name for kind, name in events[steps[0]:steps[-1]] if kind == "sync"]
    after = [name for kind, name in events[steps[-1]:] if kind == "sync"]
    return {"batch": len(requests), "draft_steps": len(steps), "graph_steps": proposer.steps["graph"],
            "proposals": [len(p.token_ids) for p in proposals],
            "syncs_between_steps": len(between), "syncs_between_steps_ops": sorted(set(between)),
            "syncs_after_last_step": len(after), "syncs_after_last_step_ops": sorted(set(after))}


def draft_syncs(engine_dir: Path, gamma: int = 5, batches: tuple[int, ...] = (1, 4),
                temperatures: tuple[float, ...] = (0.0, 1.0)) -> dict:
    """`draft_round_syncs` of the engine's draft on the CPU at each batch size and temperature, its decode steps
    from static steps as on a GPU (run eagerly, as the CPU tests check them): the first round (the prompts run
    through the draft first), then one after a rejection."""
    from bie_trt.config import EngineConfig
    from bie_trt.sampling_params import SamplingParams
    from bie_trt.executor.model_runner import ModelRunner
    from bie_trt.executor.sequence import Sequence
    from bie_trt.sampling import make_generator
    from bie_trt.spec_decode.draft import DraftModelProposer

    runner = ModelRunner(EngineConfig(engine_dir=str(engine_dir), device="cpu", max_num_seqs=max(batches)))
    proposer = DraftModelProposer(engine_dir, runner)
    # the GPU's draft: its pools with a scratch block for padding rows, decode steps from static buffers
    proposer.pools = allocate_pools(proposer.cfg, proposer.pools.cfg, runner.max_num_seqs * proposer.blocks_per_seq, 0,
                                    runner.dtype, runner.device, scratch_block=True)
    proposer.graphs = DecodeGraphs(proposer.model, proposer.pools, list(batches),
                                   proposer.blocks_per_seq * proposer.block_size, proposer.pools.scratch_block,
                                   capture=False, head=False)
    out = {}
    for temperature in temperatures:
        for batch in batches:
            params = SamplingParams(temperature=temperature, seed=3)
            seqs = [Sequence([5 + i, 17, 300 + i, 42, 7], params, make_generator(params, i)) for i in range(batch)]
            first = draft_round_syncs(proposer, [s.proposal_request(gamma) for s in seqs])
            for s in seqs:   # the target took other tokens than the proposals: the draft rolls back
                s.output_ids += [11, 12]
            second = draft_round_syncs(proposer, [s.proposal_request(gamma) for s in seqs])
            out[f"{'greedy' if temperature == 0 else 'sampled'}_b{batch}"] = {"first_round": first,
                                                                               "second_round": second}
            for s in seqs:
                proposer.free(s)
    return out


# The decode batches `step_syncs` counts: four plain sampled rows, and four rows each with another knob.
STEP_BATCHES = {
    "sampled": [dict(temperature=1.0, top_p=0.9, seed=i) for i in range(4)],
    "mixed": [dict(temperature=0.0, repetition_penalty=1.2),
              dict(temperature=0.8, top_k=20, presence_penalty=0.5, frequency_penalty=0.5, seed=1),
              dict(temperature=1.0, top_p=0.9, min_p=0.05, logprobs=3, seed=2),
              dict(temperature=0.7, logit_bias={5: 2.0}, min_tokens=50, seed=3)],
}


def decode_step_syncs(runner: Any, step: Callable[[], Any]) -> dict:
    """The host reads of one engine step outside the model runner's device work (`runner.execute`, a CUDA
    graph's replay for a decode on a GPU): what sampling and the step's bookkeeping make the host wait for."""
    events: list[tuple[str, str]] = []
    execute = runner.execute
    with host_reads(events) as mode:
        runner.execute = paused(mode, execute)
        try:
            step()
        finally:
            runner.execute = execute
    reads = [name for _, name in events]
    return {"syncs": len(reads), "ops": dict(collections.Counter(reads))}


def step_syncs(engine_dir: Path, batches: dict[str, list[dict]] = STEP_BATCHES) -> dict:
    """`decode_step_syncs` of an `EngineCore` on the CPU for each batch of `batches` (sampling parameters per
    row), its rows all decoding (their prompts in)."""
    from bie_trt.config import EngineConfig
    from bie_trt.executor.engine_core import EngineCore
    from bie_trt.sampling_params import SamplingParams

    out = {}
    for name, rows in batches.items():
        core = EngineCore(EngineConfig(engine_dir=str(engine_dir), device="cpu", max_num_seqs=len(rows),
                                       speculative={"method": "none"}))
        for i, params in enumerate(rows):
            core.add_request([5 + i, 17, 300 + i, 42, 7], SamplingParams(max_tokens=64, ignore_eos=True, **params))
        while any(not r.seq.output_ids for r in core.live.values()):
            core.step()
        out[name] = {"batch": len(rows), **decode_step_syncs(core.runner, core.step)}
    return out


def gemv_grids(cfg: ModelConfig, group_size: int = 128) -> dict:
    """The default M = 1 W4 grid of each fused linear on each GPU, with its waves (`triton_w4.gemv_grid`)."""
    out = {}
    for gpu, (sms, arch) in GPUS.items():
        out[gpu] = {"sms": sms, "arch": arch}
        for name, (n, k) in fused_linear_shapes(cfg).items():
            g = gemv_grid_for(n, k, group_size, sm_limits(sms, arch))
            out[gpu][name] = {**g.config(), "programs": g.programs, "resident_per_sm": g.resident,
                              "waves": round(g.waves, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--kv", default="int4_asym", choices=["int4_asym", "fp16", "fp8"])
    ap.add_argument("--verify-rows", type=int, default=0,
                    help="also count a speculative verify step of this many rows a sequence (γ+1)")
    ap.add_argument("--spec", action="store_true",
                    help="also count the speculative steps: 8B verify at γ = 4, 5, batch 1, 4, crossing a window block "
                         "and not, and a Llama-3.2-1B draft step")
    ap.add_argument("--tiny", action="store_true",
                    help="also run the tiny model of the same structure through the interpreted kernels")
    ap.add_argument("--draft-syncs", type=Path, metavar="ENGINE_DIR",
                    help="also count the host syncs of a draft round (γ = 5, batch 1 and 4) of this engine's draft, on the CPU")
    ap.add_argument("--step-syncs", type=Path, metavar="ENGINE_DIR",
                    help="also count the host syncs of one decode step of this engine at batch 4 (sampling and "
                         "bookkeeping, outside the forward), on the CPU")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    kv = KVCacheConfig(dtype=args.kv)
    result = {"llama3_8b": count(llama3_8b(), kv, args.batch, args.context, "meta"),
              "llama3_8b_w4_gemv_grids": gemv_grids(llama3_8b()),
              # its q/k head norms ride in the qkv epilogue: the same launches a layer
              "qwen3_8b": count(qwen3_8b(), kv, args.batch, args.context, "meta")}
    if args.verify_rows > 1:
        result["llama3_8b_verify"] = count(llama3_8b(), kv, args.batch, args.context, "meta", args.verify_rows)
    if args.spec:
        result["speculation"] = speculation(kv)
    if args.draft_syncs:
        result["draft_syncs"] = draft_syncs(args.draft_syncs)
    if args.step_syncs:
        result["step_syncs"] = step_syncs(args.step_syncs)
    if args.tiny:
        tiny_kv = dataclasses.replace(kv, group_size=32, sink_tokens=4, window=16) if args.kv != "fp16" else kv
        result["tiny"] = count(tiny_llama(), tiny_kv, args.batch, 64, "cpu")
    emit(result, args.out, indent=1)


if __name__ == "__main__":
    main()
