"""The fixed memory plan: every byte the engine will hold on the GPU, computed before loading anything.

Pure functions of the model's config.json, a build profile and the user's settings. The runtime
allocates exactly what the plan says (the KV pools through `kv_pool_blocks`), once, so that
nothing can spill to host memory during decode. See docs/memory-plan.md.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .config import KVCacheConfig, ModelConfig
from .errors import PlanError
from .kv.pool import quant_bytes_per_token_per_layer
from .kv.recurrent import conv_channels, recurrent_bytes_per_seq
from .kv.sizing import (check_max_model_len, fp16_kv_bytes_per_token, full_layers, kv_bytes_per_token, kv_pool_blocks,
                        kv_pool_bytes, sliding_pool_blocks, sliding_pool_bytes)
from .profiles import EMBEDDING_PLACEMENTS, LM_HEAD_DTYPES, BuildProfile

MIB = 2**20
GIB = 2**30
FP16 = 2
FP32 = 4
# A captured decode graph keeps its own memory pool for the step's intermediates; at decode
# shapes (a few tokens) those are a few MiB, so a flat 16 MiB per captured batch size is a
# generous bound rather than a measurement.
CUDA_GRAPH_BYTES_PER_BATCH_SIZE = 16 * MIB
# Speculative verify steps are captured per (batch, γ+1) bucket when each sequence's rows are at most a
# block (the tiled attention's inputs) and the int8 head takes the bucket's rows in a few launches.
TILED_INPUT_ROWS = 16
MAX_VERIFY_GRAPH_ROWS = 64
# Allocator fragmentation and small buffers nobody itemised (block tables, sampling state).
MARGIN_FRACTION = 0.02
MIN_MARGIN_BYTES = 64 * MIB
# The draft's bounded cache (sinks + a sliding window) and its reduced vocabulary (spec_decode/draft.py).
DEFAULT_DRAFT_SINK_TOKENS = 8
DEFAULT_DRAFT_WINDOW_TOKENS = 1024
# By default the draft's head covers the most frequent token ids whose weights fit this many bytes
# (int8: hidden_size bytes a row, fp16: twice that; int8's per-row scales come on top), at most the
# whole vocabulary. Bytes rather than rows because what an 8B + 1B pair can spare on 8 GB is bytes:
# a Llama-3.2-1B int8 head gets 32,768 of its 128,256 rows, SmolLM2 (49,152 x 576) all of its own.
DEFAULT_DRAFT_HEAD_BYTES = 64 * MIB
# Besides them, each sequence gets up to this many rows of the draft's full head for the ids of its
# own prompt and output (a document's names, identifiers and jargon): 8 MiB a sequence for a 1B int8 head.
DEFAULT_DRAFT_REQUEST_VOCAB = 4096
# A model with linear-attention layers keeps this many recurrent state snapshots per sequence slot for prefix
# hits (cache_tiers/state_snapshots.py): a returning prompt's boundary, and one more (the previous prompt's).
DEFAULT_STATE_SNAPSHOTS_PER_SEQ = 2


@dataclass
class PlanItem:
    name: str
    bytes: int
    note: str = ""


@dataclass
class CacheGroup:
    """One kind of per-layer cache, as data: which layers keep it, the plan items that hold it, their bytes."""
    kind: str          # full_attention | sliding_attention | linear_attention | shared
    layers: int
    items: list[str]   # the plan items of this group
    bytes: int
    note: str = ""


# What each cache kind holds, for the plan's "cache groups:" block.
GROUP_NOTES = {
    "full_attention": "paged KV over the whole context (FP16 sinks and window, the body in the KV format)",
    "sliding_attention": "FP16 KV blocks covering the window, given back as it slides",
    "linear_attention": "a fixed recurrent state per sequence, and snapshots saved for prefix hits",
    "shared": "read an earlier layer's cache, own none",
}
GROUP_ITEMS = {
    "full_attention": ("kv_fp16_pool", "kv_quant_pool"),
    "sliding_attention": ("kv_sliding_pool",),
    "linear_attention": ("recurrent_state", "recurrent_snapshots"),
    "shared": ("kv_shared_layers",),
}


def cache_groups(model: ModelConfig, items: list[PlanItem]) -> list[CacheGroup]:
    """The model's cache groups, from the kind each layer declares (ModelConfig.cache_kind), in GROUP_ITEMS'
    order; their bytes summed from the plan's `items`."""
    layers = Counter(model.cache_kind(i) for i in range(model.num_layers))
    size = {it.name: it.bytes for it in items}
    return [CacheGroup(kind, layers[kind], [name for name in names if name in size],
                       sum(size.get(name, 0) for name in names), GROUP_NOTES[kind])
            for kind, names in GROUP_ITEMS.items() if layers[kind]]


@dataclass
class MemoryPlan:
    items: list[PlanItem]
    budget_bytes: int
    kv_bytes_per_token: int
    max_model_len_that_fits: int
    num_fp_blocks: int
    num_quant_blocks: int
    inputs: dict[str, Any]
    num_sliding_blocks: int = 0   # a hybrid model's sliding-window layers' pool
    # a hybrid model's KV bytes and largest context if every layer attended the whole context (for comparison)
    all_full: dict[str, int] | None = None
    groups: list[CacheGroup] = dataclasses.field(default_factory=list)   # the cache groups, each layer in one

    @property
    def total_bytes(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    def bytes_of(self, name: str) -> int:
        """Bytes of the item called `name` (0 when the plan has no such item, e.g. no draft)."""
        return sum(i.bytes for i in self.items if i.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "total_bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_model_len_that_fits": self.max_model_len_that_fits,
            "num_fp_blocks": self.num_fp_blocks,
            "num_quant_blocks": self.num_quant_blocks,
            "num_sliding_blocks": self.num_sliding_blocks,
            "all_full": self.all_full,
            "cache_groups": [dataclasses.asdict(g) for g in self.groups],
            "items": [dataclasses.asdict(i) for i in self.items],
            "inputs": self.inputs,
        }

    def format_table(self) -> str:
        i = self.inputs
        kv = i["kv"]
        lines = [
            f"memory plan: {i['model']['architecture']} on profile {i['profile']}, "
            f"max_model_len {i['max_model_len']:,}, max_num_seqs {i['max_num_seqs']}",
            f"KV cache: {kv['dtype']} (group {kv['group_size']}, {kv['sink_tokens']} sink tokens, "
            f"window {kv['window']}, block {kv['block_size']}): {self.kv_bytes_per_token:,} bytes/token; "
            f"blocks: {self.num_fp_blocks:,} fp16 + {self.num_quant_blocks:,} quantised",
            "",
        ]
        width = max(len(it.name) for it in self.items)
        for it in self.items:
            lines.append(f"  {it.name:<{width}}  {format_bytes(it.bytes):>10}  {it.note}")
        rule = "  " + "-" * (width + 12)
        lines += [
            rule,
            f"  {'total':<{width}}  {format_bytes(self.total_bytes):>10}",
            f"  {'budget':<{width}}  {format_bytes(self.budget_bytes):>10}  "
            f"{format_bytes(i['vram_bytes'])} x {i['gpu_memory_utilization']}",
        ]
        spare = self.budget_bytes - self.total_bytes
        verdict = (f"fits, {format_bytes(spare)} spare" if self.fits
                   else f"DOES NOT FIT: {format_bytes(-spare)} over budget")
        lines.append(f"{verdict}; the largest max_model_len that fits is {self.max_model_len_that_fits:,}.")
        if self.groups:
            kind_width = max(len(g.kind) for g in self.groups)
            lines.append("cache groups:")
            lines += [f"  {g.kind:<{kind_width}}  {g.layers:>3} layers  {format_bytes(g.bytes):>10}  {g.note}"
                      for g in self.groups]
        m = i["model"]
        linear = sum(t == "linear_attention" for t in m["layer_types"])
        if linear:
            lines.append(f"linear-attention layers: {linear} of {m['num_layers']} keep a fixed state per sequence "
                         f"(recurrent_state); only the {m['num_layers'] - linear} full-attention layers' KV grows with "
                         f"the context.")
        if self.all_full is not None:
            sliding = sum(t == "sliding_attention" for t in m["layer_types"])
            kv_now = sum(it.bytes for it in self.items if it.name.startswith("kv_"))
            lines.append(f"sliding-window layers: {sliding} of {m['num_layers']} hold only their window; with all "
                         f"{m['num_layers']} layers full the KV cache would take {format_bytes(self.all_full['kv_bytes'])} "
                         f"(here {format_bytes(kv_now)}) and the largest max_model_len that fits would be "
                         f"{self.all_full['max_model_len_that_fits']:,}.")
        return "\n".join(lines)


DEFAULT_HOST_FRACTION = 0.2        # of the host memory available when the engine starts
DEFAULT_HOST_CAP_BYTES = 32 * GIB


def default_host_bytes(available: int | None) -> int:
    """The host tier's size when none is asked for: a fraction of the available host memory, capped."""
    if available is None:
        return 0
    return int(min(available * DEFAULT_HOST_FRACTION, DEFAULT_HOST_CAP_BYTES))


def host_bytes(gib: float | None, available: int | None) -> int:
    """`--host-kv-cache-gb` in bytes: None takes the default, 0 turns the tier off."""
    if gib is None:
        return default_host_bytes(available)
    if gib < 0:
        raise ValueError(f"host_kv_cache_gb must be >= 0 (0 turns the host tier off); got {gib}.")
    return int(gib * GIB)


def host_tier(model: ModelConfig, kv: KVCacheConfig, size: int) -> dict[str, Any]:
    """What a KV host tier of `size` bytes holds, in host RAM beside the device plan (not in its budget):
    blocks of the body's format (quantised, or FP16 for an FP16 cache) and the tokens they cover. Off for a
    hybrid model: its sliding-window layers' blocks stay on the device (cache_tiers/sliding_blocks.py)."""
    if model.sliding_layers:
        return {"bytes": 0, "block_bytes": 0, "blocks": 0, "tokens": 0,
                "off": "a hybrid model's sliding-window layers keep their blocks on the device"}
    if model.linear_layers:
        return {"bytes": 0, "block_bytes": 0, "blocks": 0, "tokens": 0,
                "off": "a prefix hit of a model with linear-attention layers resumes from their state snapshot, "
                       "which stays on the device"}
    per_token = (fp16_kv_bytes_per_token(model) if kv.dtype == "fp16"
                 else quant_bytes_per_token_per_layer(model, kv) * model.num_layers)
    block = per_token * kv.block_size
    blocks = size // block
    return {"bytes": size, "block_bytes": block, "blocks": blocks, "tokens": blocks * kv.block_size}


def format_host_tier(tier: dict[str, Any], kv_dtype: str) -> str:
    if not tier["bytes"]:
        return "host KV tier: off" + (f" ({tier['off']})" if "off" in tier else "")
    return (f"host KV tier: {format_bytes(tier['bytes'])} of host RAM (outside the budget): {tier['blocks']:,} "
            f"{kv_dtype} blocks of {format_bytes(tier['block_bytes'])}, {tier['tokens']:,} tokens of evicted "
            f"prefixes")


def format_bytes(n: int) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


# --- weights ---------------------------------------------------------------------------------

def linear_shapes(model: ModelConfig, layer: int = 0) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of attention layer `layer`'s linears (Qwen3.5's q_proj gives the output
    gate as well; Gemma 4's layers differ in head width, in having k/v at all, and in MLP width)."""
    h, i, d = model.hidden_size, model.intermediate_of(layer), model.head_dim_of(layer)
    q_size, kv_size = model.num_heads * d, model.kv_heads_of(layer) * d
    q_rows = q_size * (2 if model.attn_output_gate else 1)
    kv = [] if model.kv_source(layer) != layer else \
        [("k_proj", h, kv_size)] + ([] if model.k_eq_v_at(layer) else [("v_proj", h, kv_size)])
    return [("q_proj", h, q_rows), *kv, ("o_proj", q_size, h),
            ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]


def deltanet_shapes(model: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of a Gated DeltaNet layer's linears (Qwen3.5), its MLP's included."""
    h, i = model.hidden_size, model.intermediate_size
    value, heads = model.linear_num_value_heads * model.linear_value_head_dim, model.linear_num_value_heads
    return [("in_proj_qkv", h, conv_channels(model)), ("in_proj_z", h, value), ("in_proj_b", h, heads),
            ("in_proj_a", h, heads), ("out_proj", value, h),
            ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]


def layer_linear_shapes(model: ModelConfig) -> list[tuple[int, list[tuple[str, int, int]]]]:
    """(how many layers, their linears' shapes) for each kind of layer the model has."""
    linear = len(model.linear_layers)
    attention = Counter(tuple(linear_shapes(model, i)) for i in range(model.num_layers) if i not in model.linear_layers)
    kinds = [(n, list(shapes)) for shapes, n in attention.items()]
    return kinds + ([(linear, deltanet_shapes(model))] if linear else [])


def every_linear_shape(model: ModelConfig) -> list[tuple[str, int, int]]:
    return [shape for _, shapes in layer_linear_shapes(model) for shape in shapes]


def awq_linear_bytes(in_features: int, out_features: int, group_size: int) -> int:
    """AWQ storage: 4-bit weights, an fp16 scale and a 4-bit zero per group of inputs."""
    groups = in_features // group_size
    return in_features * out_features // 2 + groups * out_features * FP16 + groups * out_features // 2


def linear_weight_bytes(model: ModelConfig, group_size: int) -> int:
    return sum(n * sum(awq_linear_bytes(i, o, group_size) for _, i, o in shapes)
               for n, shapes in layer_linear_shapes(model))


AWQ_GROUP_SIZES = (128, 64, 32)   # the group sizes the W4 kernels take, the largest first


def default_weight_group_size(model: ModelConfig) -> int:
    """The largest AWQ group size that divides every linear's in_features (128 for 8B models)."""
    for g in AWQ_GROUP_SIZES:
        if all(i % g == 0 for _, i, _ in every_linear_shape(model)):
            return g
    raise PlanError(
        f"no AWQ group size (128, 64, 32) divides the model's in_features "
        f"{sorted({i for _, i, _ in every_linear_shape(model)})}; this model cannot be 4-bit AWQ-packed."
    )


def head_row_weight_bytes(model: ModelConfig, dtype: str) -> int:
    """The weights of one output-head row (one vocabulary entry): int8 one byte a weight, fp16 two."""
    return model.hidden_size * (1 if dtype == "int8" else FP16)


def lm_head_bytes(model: ModelConfig, dtype: str, rows: int | None = None) -> int:
    """The output head over `rows` vocabulary entries (all of them by default)."""
    rows = model.vocab_size if rows is None else rows
    scale = FP16 if dtype == "int8" else 0   # int8: a per-row (per vocab entry) fp16 scale
    return rows * (head_row_weight_bytes(model, dtype) + scale)


def _weights(model: ModelConfig, group_size: int, lm_head_dtype: str, embedding: str,
             head_rows: int | None = None, head_choice: str = "", linear_bytes: int | None = None,
             stored_head_bytes: int | None = None) -> list[PlanItem]:
    """The weight items; `head_rows` < vocab_size: a head over a reduced vocabulary (a draft's),
    whose rows `head_choice` explains. `linear_bytes`: the linears' real size where the checkpoint says
    (a GGUF's, most of them kept in the file's own block formats); `stored_head_bytes` likewise for the head."""
    h, v = model.hidden_size, model.vocab_size
    reduced = head_rows is not None and head_rows < v
    linear = len(model.linear_layers)
    layers = (f"q,k,v,o,gate,up,down x {model.num_layers} layers" if not linear else
              f"q(+gate),k,v,o,gate,up,down x {model.num_layers - linear} full-attention layers; "
              f"in_proj(qkv,z,b,a),out_proj,gate,up,down x {linear} DeltaNet layers")
    items = [PlanItem("linear_weights", linear_weight_bytes(model, group_size), f"4-bit AWQ, group {group_size}: {layers}")
             if linear_bytes is None else
             PlanItem("linear_weights", linear_bytes, f"as the GGUF stores them (W4 group {group_size} where "
                      f"Q4_0 or float): {layers}")]
    if linear:
        conv = conv_channels(model) * model.linear_conv_kernel * FP16
        heads = model.linear_num_value_heads * 2 * FP32 + model.linear_value_head_dim * FP16
        items.append(PlanItem("deltanet_params", linear * (conv + heads),
                              f"conv weights fp16, A_log and dt_bias fp32, gated norm fp16 x {linear} layers"))
    if model.qkv_bias:
        items.append(PlanItem("qkv_bias", model.num_layers * (model.q_size + 2 * model.kv_size) * FP16, "fp16"))
    choice = f"; {head_choice}" if head_choice else ""
    if stored_head_bytes is not None and not reduced:
        items.append(PlanItem("lm_head", stored_head_bytes, "as the GGUF stores it (its own block format)"))
    elif model.tie_word_embeddings and embedding == "gpu" and lm_head_dtype == "fp16" and not reduced:
        items.append(PlanItem("lm_head", 0, f"tied: shares the fp16 embedding table{choice}"))
    else:
        copy = "those rows of the tied embedding" if reduced else "the tied embedding"
        tied = f"; a GPU copy of {copy}" if model.tie_word_embeddings else ""
        scale = " + per-row fp16 scale" if lm_head_dtype == "int8" else ""
        items.append(PlanItem("lm_head", lm_head_bytes(model, lm_head_dtype, head_rows),
                              f"{lm_head_dtype}{scale}{choice}{tied}"))
    items += _per_layer_embedding(model, embedding)
    if embedding == "host":
        items.append(PlanItem(
            "embedding", 0, f"pinned host memory ({format_bytes(v * h * FP16)}); "
            f"only {h * FP16:,} bytes/token cross PCIe",
        ))
    else:
        items.append(PlanItem("embedding", v * h * FP16, "fp16 table in device memory"))
    head_norms = 2 * full_layers(model) * model.head_dim * FP16 if model.qk_norm else 0   # Qwen3's, Gemma 3's q/k norms
    per_layer = 4 if model.sandwich_norms else 2   # Gemma 3: a norm after attention and after the MLP too
    items.append(PlanItem("norms", (per_layer * model.num_layers + 1) * h * FP16 + head_norms, "fp16 RMSNorm weights"))
    return items


def _per_layer_embedding(model: ModelConfig, embedding: str) -> list[PlanItem]:
    """Gemma 4's per-layer embeddings: the table is only gathered from, so it lives where the token embedding
    does (pinned host memory on the 8 GB profiles); its projections are dense fp16 on the device."""
    if not model.per_layer_input_size:
        return []
    h, row = model.hidden_size, model.num_layers * model.per_layer_input_size
    table = model.per_layer_vocab_size * row * FP16
    item = (PlanItem("per_layer_embedding", 0, f"pinned host memory ({format_bytes(table)}); only {row * FP16:,} "
                     f"bytes/token cross PCIe") if embedding == "host" else
            PlanItem("per_layer_embedding", table, "fp16 table in device memory"))
    # the embedding's projection to every layer's vector, and each layer's gate, projection and norm
    dense = (row * h + model.num_layers * (2 * model.per_layer_input_size * h + h) + model.per_layer_input_size)
    return [item, PlanItem("per_layer_projections", dense * FP16,
                           f"fp16: the embedding's projection and a gate, projection and norm x {model.num_layers} "
                           f"layers")]


# --- KV cache (the pools' sizes per layer type: kv/sizing.py) -------------------------------

def verify_graph_buckets(batch_sizes: Sequence[int], rows: int) -> list[tuple[int, int]]:
    """The (batch, rows a sequence) of the verify graphs captured for γ+1 = `rows` at `batch_sizes`."""
    return [(b, rows) for b in sorted(set(batch_sizes)) if 1 < rows <= TILED_INPUT_ROWS and b * rows <= MAX_VERIFY_GRAPH_ROWS]


def cuda_graph_bytes(model: ModelConfig, batch_sizes: Sequence[int], num_speculative_tokens: int,
                     max_num_seqs: int) -> int:
    """The graphs' private pool: a bound per decode batch size (the target's; the draft's decodes capture
    into the same pool), and each verify bucket's fp32 logits, which it holds as its output, beyond the
    step's own `logits` item (at max_num_seqs 1 the one bucket's logits are that item)."""
    verify = sum(b * r * model.vocab_size * FP32 for b, r in verify_graph_buckets(batch_sizes, num_speculative_tokens + 1))
    step_logits = max_num_seqs * (1 + num_speculative_tokens) * model.vocab_size * FP32
    return len(batch_sizes) * CUDA_GRAPH_BYTES_PER_BATCH_SIZE + max(0, verify - step_logits)


def draft_kv_blocks_per_seq(sink_tokens: int, window: int, block_size: int) -> int:
    """FP16 blocks of one sequence's draft cache: bounded, never the whole context.

    The sinks in whole blocks, the window's blocks, and one more so that a full window plus the
    newest tokens fit; when they are all full the oldest window block is recycled (spec_decode/draft.py).
    Nothing for a prefill chunk: the draft reads a long prompt only through its last window.
    """
    return math.ceil(sink_tokens / block_size) + math.ceil(window / block_size) + 1


def draft_kv_blocks(kv: KVCacheConfig, draft_window_tokens: int, max_num_seqs: int,
                    draft_sink_tokens: int = DEFAULT_DRAFT_SINK_TOKENS) -> int:
    """FP16 blocks of the draft model's KV pool."""
    return max_num_seqs * draft_kv_blocks_per_seq(draft_sink_tokens, draft_window_tokens, kv.block_size)


def draft_vocab_rows(draft: ModelConfig, lm_head_dtype: str, draft_vocab_size: int | None) -> int:
    """Rows of the draft's static head (K): `draft_vocab_size` when given, else as many as fit
    DEFAULT_DRAFT_HEAD_BYTES of head weights; never more than the whole vocabulary."""
    if draft_vocab_size is None:
        draft_vocab_size = DEFAULT_DRAFT_HEAD_BYTES // head_row_weight_bytes(draft, lm_head_dtype)
    return min(draft_vocab_size, draft.vocab_size)


def draft_vocab_choice(draft: ModelConfig, vocab_rows: int, draft_vocab_size: int | None) -> str:
    """How the plan chose the draft head's rows, for its draft_lm_head line."""
    whole = vocab_rows == draft.vocab_size
    which = (f"all {vocab_rows:,} vocabulary rows" if whole
             else f"the {vocab_rows:,} most frequent of {draft.vocab_size:,} vocabulary rows")
    if draft_vocab_size is not None:
        return f"{which} (--draft-vocab-size {draft_vocab_size:,})"
    budget = format_bytes(DEFAULT_DRAFT_HEAD_BYTES)
    return f"{which} ({'their weights fit' if whole else 'as many as fit'} the {budget} draft head budget)"


def draft_request_rows(draft: ModelConfig, vocab_rows: int, request_vocab: int | None) -> int:
    """Extra head rows per sequence for its own ids outside the static ones: never more than
    there are such ids (none when the static head covers the whole vocabulary)."""
    r = DEFAULT_DRAFT_REQUEST_VOCAB if request_vocab is None else request_vocab
    return min(r, draft.vocab_size - vocab_rows)


# --- activations -----------------------------------------------------------------------------

def step_tokens(chunked_prefill_size: int, max_num_seqs: int, num_speculative_tokens: int) -> int:
    """Tokens one engine step runs at most (its default `max_num_batched_tokens`): a prefill chunk beside
    a decode of every running sequence, each with its speculative proposals."""
    return chunked_prefill_size + max_num_seqs * (1 + num_speculative_tokens)


def planned_step_tokens(inputs: dict[str, Any]) -> int:
    """`step_tokens` of a plan, from its `inputs` (an engine manifest's `plan.inputs`)."""
    chunk = inputs["chunked_prefill_size"] if "chunked_prefill_size" in inputs else inputs["chunk_tokens"]   # older key
    return step_tokens(int(chunk), int(inputs["max_num_seqs"]),
                       int(inputs.get("num_speculative_tokens") or 0))


def activation_workspace_bytes(
    model: ModelConfig, chunked_prefill_size: int, dtype_bytes: int = FP16, block_size: int = 16
) -> int:
    """Peak activation bytes of one decoder layer over a prefill chunk of T tokens.

    Layers run one after another and reuse the same buffers, so one layer's peak is the whole
    forward's. The residual stream (T*H) and the RoPE cos/sin tables (2*T*head_dim) live across
    the layers; on top of them the larger of:
      attention: normed T*H + qkv T*(q+2kv) + attention output T*q + o_proj output T*H
                 + the block-wise online-softmax scores T*heads*block_size in fp32
                 + centred keys' offset coefficients T*q in fp32 (kernels/key_offset.py)
      MLP:       normed T*H + gate_up T*2I + silu(gate)*up T*I + down output T*H
      DeltaNet:  `deltanet_workspace_bytes` (Qwen3.5's linear-attention layers)
    For 8B models the MLP phase dominates (the T*2I gate_up product); Qwen3.5-9B's DeltaNet phase is larger.
    (Qwen3.5's qkv also carries the output gate: T*q more.)
    """
    t, h = chunked_prefill_size, model.hidden_size
    # the widest layer's (Gemma 4's full layers have wider heads, its shared layers a wider MLP)
    i = max(model.intermediate_of(layer) for layer in range(model.num_layers))
    full_heads, full_dim = model.cache_shape()
    head_dim = max(model.head_dim, full_dim)
    q_size, kv_size = model.num_heads * head_dim, max(model.kv_size, full_heads * full_dim)
    residual = (t * h + 2 * t * head_dim) * dtype_bytes
    q_rows = q_size * (2 if model.attn_output_gate else 1)
    attention = (t * h + t * (q_rows + 2 * kv_size) + t * q_size + t * h) * dtype_bytes
    attention += t * model.num_heads * block_size * FP32 + t * q_size * FP32
    mlp = (t * h + 2 * t * i + t * i + t * h) * dtype_bytes
    deltanet = deltanet_workspace_bytes(model, t, dtype_bytes) if model.linear_layers else 0
    return residual + max(attention, mlp, deltanet)


def deltanet_workspace_bytes(model: ModelConfig, tokens: int, dtype_bytes: int = FP16) -> int:
    """A Gated DeltaNet sub-block's peak over T tokens, at its delta-rule call (model/gated_deltanet.py):
    in_proj's output T*(C + V + 2 H_v), the conv's output T*C, the decays and write strengths (fp32), q and k
    normalised and repeated to the value heads and v (fp32), and the rule's output and the block's (fp32)."""
    hv = model.linear_num_value_heads
    keys, values, conv = hv * model.linear_key_head_dim, hv * model.linear_value_head_dim, conv_channels(model)
    activations = tokens * (conv + values + 2 * hv) + tokens * conv
    fp32 = 2 * tokens * hv + 2 * tokens * keys + tokens * values + 2 * tokens * values
    return activations * dtype_bytes + fp32 * FP32


# --- validation ------------------------------------------------------------------------------

def _check_inputs(
    model: ModelConfig, kv: KVCacheConfig, max_model_len: int, max_num_seqs: int, chunked_prefill_size: int,
    weight_group_size: int, draft: ModelConfig | None, lm_head_dtype: str, embedding: str, utilisation: float,
) -> None:
    check_max_model_len(model, max_model_len)
    try:
        kv.validate(model.head_dim)
    except ValueError as e:
        raise PlanError(str(e)) from None
    bad = sorted({i for _, i, _ in every_linear_shape(model) if i % weight_group_size})
    if bad:
        raise PlanError(
            f"weight group size {weight_group_size} does not divide the in_features {bad}; "
            f"use a group size that does (e.g. {default_weight_group_size(model)})."
        )
    if draft is not None:
        check_draft_vocab(draft.vocab_size, model.vocab_size)
    if max_num_seqs < 1 or chunked_prefill_size < 1:
        raise PlanError(f"max_num_seqs and chunk size must be >= 1; got {max_num_seqs} and {chunked_prefill_size}.")
    if lm_head_dtype not in LM_HEAD_DTYPES:
        raise PlanError(f"lm_head dtype {lm_head_dtype!r} is unknown; use one of {LM_HEAD_DTYPES}.")
    if embedding not in EMBEDDING_PLACEMENTS:
        raise PlanError(f"embedding placement {embedding!r} is unknown; use one of {EMBEDDING_PLACEMENTS}.")
    if not 0 < utilisation <= 1:
        raise PlanError(f"gpu_memory_utilization must be in (0, 1]; got {utilisation}.")


def check_draft_vocab(draft_vocab: int, target_vocab: int) -> None:
    """A draft may have fewer rows than its target (Qwen2.5-7B pads its 151,936 ids to 152,064; its
    0.5B does not): the ids past the draft's end get no proposals, and rejection sampling stays exact
    for any proposal distribution. A draft with more rows could propose ids the target lacks."""
    if draft_vocab > target_vocab:
        raise PlanError(
            f"the draft's vocab_size {draft_vocab:,} is larger than the target's {target_vocab:,}: it could "
            f"propose ids the target does not have; use a draft from the target's family (e.g. Llama-3.2-1B "
            f"for Llama-3.1-8B, Qwen2.5-0.5B for Qwen2.5-7B) or n-gram speculation.")


def check_draft_settings(window: int, vocab_size: int | None, request_vocab: int | None = None) -> None:
    if window < 1:
        raise PlanError(f"the draft's window must be at least 1 token; got {window}.")
    if vocab_size is not None and vocab_size < 1:
        raise PlanError(f"the draft's vocabulary size must be at least 1 token id; got {vocab_size}.")
    if request_vocab is not None and request_vocab < 0:
        raise PlanError(f"the draft's request vocabulary must be 0 (off) or more rows; got {request_vocab}.")


# --- the plan --------------------------------------------------------------------------------

def solve_plan(
    model: ModelConfig,
    profile: BuildProfile,
    *,
    max_model_len: int,
    kv: KVCacheConfig,
    max_num_seqs: int = 1,
    chunked_prefill_size: int = 512,
    weight_group_size: int = 128,
    linear_bytes: int | None = None,
    lm_head_bytes: int | None = None,
    draft: ModelConfig | None = None,
    draft_window_tokens: int = DEFAULT_DRAFT_WINDOW_TOKENS,
    draft_vocab_size: int | None = None,
    draft_request_vocab: int | None = None,
    draft_weight_group_size: int | None = None,
    num_speculative_tokens: int | None = None,
    lm_head_dtype: str | None = None,
    embedding_placement: str | None = None,
    gpu_memory_utilization: float | None = None,
    cuda_graph_batch_sizes: Sequence[int] | None = None,
    state_snapshots: int | None = None,
) -> MemoryPlan:
    """Every GPU allocation of an engine serving `model` under `profile`, and whether it fits.

    Settings left as None take the profile's defaults. `num_speculative_tokens` defaults
    to the profile's when a draft is given, else 0 (pass it for n-gram speculation).
    `draft_vocab_size` (K): the draft's head covers the K most frequent token ids (when None,
    as many as fit DEFAULT_DRAFT_HEAD_BYTES; the whole vocabulary when K >= it), and
    `draft_request_vocab` (R) more rows per sequence for the ids of its own text
    (DEFAULT_DRAFT_REQUEST_VOCAB when None). The draft's AWQ group size is the target's unless
    `draft_weight_group_size` says otherwise. `state_snapshots`: recurrent states kept for prefix hits by a model
    with linear-attention layers (None: DEFAULT_STATE_SNAPSHOTS_PER_SEQ per sequence; 0 for other models).
    """
    d = profile.defaults
    lm_head_dtype = lm_head_dtype or d.lm_head_dtype
    embedding = embedding_placement or d.embedding_placement
    utilisation = gpu_memory_utilization if gpu_memory_utilization is not None else d.gpu_memory_utilization
    graph_sizes = d.cuda_graph_batch_sizes if cuda_graph_batch_sizes is None else tuple(cuda_graph_batch_sizes)
    if num_speculative_tokens is None:
        num_speculative_tokens = d.num_speculative_tokens if draft else 0
    _check_inputs(model, kv, max_model_len, max_num_seqs, chunked_prefill_size, weight_group_size, draft,
                  lm_head_dtype, embedding, utilisation)
    draft_group = draft_weight_group_size or weight_group_size
    if draft is not None:
        check_draft_settings(draft_window_tokens, draft_vocab_size, draft_request_vocab)
        _check_inputs(draft, kv, min(max_model_len, draft.max_positions), max_num_seqs, chunked_prefill_size,
                      draft_group, None, lm_head_dtype, embedding, utilisation)
    budget = int(profile.vram_bytes * utilisation)
    if not model.linear_layers:
        state_snapshots = 0
    elif state_snapshots is None:
        state_snapshots = DEFAULT_STATE_SNAPSHOTS_PER_SEQ * max_num_seqs
    elif state_snapshots < 0:
        raise PlanError(f"state_snapshots must be 0 (no prefix hits) or more; got {state_snapshots}.")

    # Everything except the KV pools is independent of max_model_len.
    weights = _weights(model, weight_group_size, lm_head_dtype, embedding, linear_bytes=linear_bytes,
                       stored_head_bytes=lm_head_bytes)
    weights.append(PlanItem("kv_key_mean", model.num_layers * model.kv_size * FP16,
                            "fp16 pre-RoPE mean key per layer and KV head, subtracted before RoPE")
                   if model.keys_share_one_shape else
                   PlanItem("kv_key_mean", 0, "none: key centering is off (the layers' keys differ in shape)"))
    weights.append(PlanItem("kv_key_scale", model.num_layers * model.kv_size * FP16,
                            "fp16 key scale per layer, KV head and channel (ones where a layer is unscaled)")
                   if model.keys_share_one_shape else
                   PlanItem("kv_key_scale", 0, "none: the key scale is off (the layers' keys differ in shape)"))
    draft_items: list[PlanItem] = []
    # A step runs a prefill chunk and every sequence's decode (and proposals) in one forward.
    step = step_tokens(chunked_prefill_size, max_num_seqs, num_speculative_tokens)
    workspace = activation_workspace_bytes(model, step, block_size=kv.block_size)
    vocab_rows = draft_vocab_rows(draft, lm_head_dtype, draft_vocab_size) if draft is not None else None
    request_rows = draft_request_rows(draft, vocab_rows, draft_request_vocab) if draft is not None else None
    if draft is not None:
        draft_items = _draft_items(draft, kv, draft_window_tokens, vocab_rows, request_rows,
                                   max_num_seqs, num_speculative_tokens, model.vocab_size, draft_group, lm_head_dtype, embedding,
                                   draft_vocab_choice(draft, vocab_rows, draft_vocab_size))
        # Draft and target run one after the other and share the workspace.
        workspace = max(workspace, activation_workspace_bytes(draft, step, block_size=kv.block_size))
    captured = [s for s in graph_sizes if s <= max_num_seqs]  # a bigger batch never runs
    runtime = [
        PlanItem("activations", workspace, f"one {step}-token step ({chunked_prefill_size}-token prefill chunk + "
                                           f"{max_num_seqs} x {1 + num_speculative_tokens} decode), peak of one layer"),
        PlanItem("logits", max_num_seqs * (1 + num_speculative_tokens) * model.vocab_size * FP32,
                 f"fp32, {max_num_seqs} seq(s) x {1 + num_speculative_tokens} position(s)"),
        *draft_items,
        PlanItem("cuda_graphs", cuda_graph_bytes(model, captured, num_speculative_tokens, max_num_seqs),
                 (f"decode graphs for batch sizes {captured}"
                  + (f", verify graphs of {num_speculative_tokens + 1} rows a sequence"
                     if verify_graph_buckets(captured, num_speculative_tokens + 1) else "")) if captured
                 else "no CUDA graphs"),
        PlanItem("cuda_context", profile.cuda_context_reserve_bytes, "CUDA context and library workspaces"),
        PlanItem("margin", max(int(MARGIN_FRACTION * budget), MIN_MARGIN_BYTES), "fragmentation and small buffers"),
    ]
    fixed_bytes = sum(it.bytes for it in weights + runtime)

    def kv_items(length: int, groups: ModelConfig = model) -> tuple[list[PlanItem], tuple[int, int, int]]:
        n_fp, n_q = kv_pool_blocks(groups, kv, length, max_num_seqs, chunked_prefill_size)
        n_sliding = sliding_pool_blocks(groups, kv, length, max_num_seqs, chunked_prefill_size)
        fp_bytes, q_bytes = kv_pool_bytes(groups, kv, n_fp, n_q)
        q_note = f"{kv.dtype}, {n_q:,} blocks" if kv.dtype != "fp16" else "fp16 KV: no quantised pool"
        items = [PlanItem("kv_fp16_pool", fp_bytes, f"{n_fp:,} blocks of {kv.block_size} tokens"),
                 PlanItem("kv_quant_pool", q_bytes, q_note)]
        if groups.linear_layers:   # Qwen3.5: a fixed state per sequence, whatever the context
            layers = f" x {full_layers(groups)} full-attention layers"
            items = [dataclasses.replace(it, note=it.note + layers) for it in items]
            per_seq = recurrent_bytes_per_seq(groups)
            items.append(PlanItem("recurrent_state", max_num_seqs * per_seq, (
                f"{max_num_seqs} seq(s) x {format_bytes(per_seq)}: conv inputs fp16 and delta state fp32 x "
                f"{len(groups.linear_layers)} linear-attention layers, the same at any context")))
            items.append(PlanItem("recurrent_snapshots", state_snapshots * per_seq, (
                f"{state_snapshots} saved state(s) at prompt block boundaries, for prefix hits" if state_snapshots
                else "none: prefix caching off")))
        if n_sliding:   # a hybrid model: the full layers above, the sliding ones bounded by their window
            layers = f" x {full_layers(groups)} full-attention layers"
            items = [dataclasses.replace(it, note=it.note + layers) for it in items]
            items.append(PlanItem("kv_sliding_pool", sliding_pool_bytes(groups, kv, n_sliding), (
                f"fp16, {n_sliding:,} blocks x {groups.cache_layers(sliding=True)} sliding layers: {max_num_seqs} "
                f"seq(s) x (window {groups.sliding_window:,} + a block + a {chunked_prefill_size}-token chunk)")))
        if groups.num_kv_shared_layers:   # Gemma 4: they read the cache of an earlier layer of their type
            items.append(PlanItem("kv_shared_layers", 0, f"{groups.num_kv_shared_layers} KV-shared layers own no "
                                  f"cache (they read the last earlier layer of their type)"))
        return items, (n_fp, n_q, n_sliding)

    def fits(length: int, groups: ModelConfig = model) -> bool:
        return fixed_bytes + sum(it.bytes for it in kv_items(length, groups)[0]) <= budget

    kv_list, (n_fp, n_q, n_sliding) = kv_items(max_model_len)
    all_full = None
    if n_sliding:   # what the same cache would need if every layer attended the whole context
        dense = dataclasses.replace(model, layer_types=(), num_kv_shared_layers=0)   # each layer its own cache
        all_full = {"kv_bytes": sum(it.bytes for it in kv_items(max_model_len, dense)[0]),
                    "max_model_len_that_fits": _largest_fitting_len(model.max_positions, kv.block_size,
                                                                    lambda n: fits(n, dense))}
    inputs = {
        "model": model.to_dict(),
        "profile": profile.name,
        "vram_bytes": profile.vram_bytes,
        "gpu_memory_utilization": utilisation,
        "max_model_len": max_model_len,
        "kv": dataclasses.asdict(kv),
        "max_num_seqs": max_num_seqs,
        "chunked_prefill_size": chunked_prefill_size,
        "weight_group_size": weight_group_size,
        "lm_head_dtype": lm_head_dtype,
        "embedding_placement": embedding,
        "cuda_graph_batch_sizes": captured,
        "draft": draft.to_dict() if draft is not None else None,
        "draft_window_tokens": draft_window_tokens if draft is not None else None,
        "draft_sink_tokens": DEFAULT_DRAFT_SINK_TOKENS if draft is not None else None,
        "draft_vocab_size": vocab_rows,
        "draft_request_vocab": request_rows,
        "num_speculative_tokens": num_speculative_tokens,
        "state_snapshots": state_snapshots,
    }
    return MemoryPlan(
        items=weights + kv_list + runtime,
        budget_bytes=budget,
        kv_bytes_per_token=kv_bytes_per_token(model, kv),
        max_model_len_that_fits=_largest_fitting_len(model.max_positions, kv.block_size, fits),
        num_fp_blocks=n_fp,
        num_quant_blocks=n_q,
        inputs=inputs,
        num_sliding_blocks=n_sliding,
        all_full=all_full,
        groups=cache_groups(model, kv_list),
    )


def _draft_items(
    draft: ModelConfig, kv: KVCacheConfig, window: int, vocab_rows: int, request_rows: int, max_num_seqs: int,
    num_speculative_tokens: int, target_vocab: int, group_size: int, lm_head_dtype: str, embedding: str,
    vocab_choice: str,
) -> list[PlanItem]:
    """The draft's own items, each named draft_*: its weights (head over `vocab_rows` ids, chosen as
    `vocab_choice` says, and `request_rows` more per sequence), its bounded FP16 KV and the
    distributions it proposes from (over the target's vocabulary, which verification compares)."""
    weights = [dataclasses.replace(it, name="draft_" + it.name)
               for it in _weights(draft, group_size, lm_head_dtype, embedding, head_rows=vocab_rows,
                                  head_choice=vocab_choice)]
    if vocab_rows < draft.vocab_size:
        weights.append(PlanItem(
            "draft_request_head", lm_head_bytes(draft, lm_head_dtype, max_num_seqs * request_rows),
            f"{lm_head_dtype}, {max_num_seqs} seq(s) x {request_rows:,} rows: the ids of each request's text "
            f"outside the {vocab_rows:,} (the full head stays in host memory, "
            f"{format_bytes(lm_head_bytes(draft, lm_head_dtype))})"))
    blocks = draft_kv_blocks(kv, window, max_num_seqs)
    sinks = math.ceil(DEFAULT_DRAFT_SINK_TOKENS / kv.block_size) * kv.block_size
    return [
        *weights,
        PlanItem("draft_kv", blocks * kv.block_size * fp16_kv_bytes_per_token(draft),
                 f"fp16, {blocks:,} blocks: {sinks} sink + {window:,} window tokens + one block, per seq"),
        PlanItem("draft_probs", max_num_seqs * num_speculative_tokens * target_vocab * FP32,
                 f"fp32 draft distributions for {num_speculative_tokens} proposed token(s), over the whole vocabulary"),
    ]


def _largest_fitting_len(limit: int, block_size: int, fits: Callable[[int], bool]) -> int:
    """Largest multiple of block_size <= limit for which `fits(length)` holds; 0 if none.

    Binary search: the plan grows monotonically with the context length.
    """
    lo, hi = 0, limit // block_size  # in blocks; lo always fits (or is 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * block_size):
            lo = mid
        else:
            hi = mid - 1
    return lo * block_size
