"""Plain data classes for the model, the KV cache, speculation and the engine, with their validation.
What a request asks for (sampling, output constraints) is sampling_params.py."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from . import config_gemma3, config_gemma4, config_qwen35
from .config_text import PLAIN_DECODER, QWEN2_DECODER, QWEN3_DECODER
from .errors import CheckpointError
from .families import ModelFamily

# Every family the engine runs, by name, as each declares itself (families.py).
FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (
    PLAIN_DECODER, QWEN2_DECODER, QWEN3_DECODER, config_gemma3.FAMILY, config_qwen35.FAMILY, config_gemma4.FAMILY)}
# architecture -> family name (the ...ForConditionalGeneration ones: the text tower of the multimodal releases)
SUPPORTED_ARCHITECTURES = {arch: f.name for f in FAMILIES.values() for arch in f.architectures}
# Architectures with an RMSNorm over each q and k head (own weights, the model's eps) before RoPE.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
                         "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Gemma4ForCausalLM",
                         "Gemma4ForConditionalGeneration", "Gemma4UnifiedForCausalLM",
                         "Gemma4UnifiedForConditionalGeneration")
# transformers' Qwen3Config: head_dim is its own field, 128 when config.json leaves it out.
DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128}
KV_DTYPES = ("fp16", "fp8", "int4_asym")
KV_ROTATIONS = ("hadamard", "hadamard_kv", "none")   # keys only, keys and values, neither


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as config.json states it; `None` on ModelConfig means plain RoPE.

    "llama3" (Llama-3.1) uses low/high_freq_factor; "yarn" uses beta_fast/beta_slow and an attention
    factor on cos/sin, given directly or derived from factor, mscale and mscale_all_dim (kernels/rope.py).
    None keeps a field unset, as transformers reads it."""

    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    rope_type: str = "llama3"
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, rope: dict[str, Any], max_position_embeddings: int, source: str) -> "RopeScaling":
        """config.json's rope_scaling (or rope_parameters) of type llama3 or yarn -> RopeScaling."""
        kind = rope.get("rope_type") or rope.get("type")
        # transformers' defaults: the original context is max_position_embeddings when unset, and
        # a YaRN factor left null is the ratio of the two.
        original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
        try:
            if kind == "linear":   # every frequency divided by factor (Gemma 3's full layers)
                return cls(factor=float(rope["factor"]), original_max_position_embeddings=original, rope_type="linear")
            if kind == "llama3":
                return cls(factor=float(rope["factor"]), original_max_position_embeddings=original,
                           low_freq_factor=float(rope["low_freq_factor"]),
                           high_freq_factor=float(rope["high_freq_factor"]))
            factor = rope.get("factor")
            factor = float(factor) if factor is not None else max_position_embeddings / original
            if factor < 1:
                raise CheckpointError(f"{source}: YaRN's factor must be >= 1 (how many times the original context "
                                      f"the model reads); got {factor:g}.")

            def number(key: str) -> float | None:
                return None if rope.get(key) is None else float(rope[key])

            return cls(factor=factor, original_max_position_embeddings=original, rope_type="yarn",
                       beta_fast=number("beta_fast"), beta_slow=number("beta_slow"), mscale=number("mscale"),
                       mscale_all_dim=number("mscale_all_dim"), attention_factor=number("attention_factor"),
                       truncate=bool(rope.get("truncate", True)))
        except KeyError as e:
            raise CheckpointError(f"{source}: rope_scaling of type {kind!r} needs {e.args[0]!r}.") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: rope_scaling of type {kind!r} has a value that is not a number "
                                  f"({e}).") from None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3's differences from the Llama decoder (config_gemma3.py reads them); the defaults are Llama's.
    hidden_act: str = "silu"                 # the MLP gate: "silu" or "gelu_tanh"
    norm_offset: float = 0.0                 # RMSNorm scales by (norm_offset + w): Gemma's (1 + w)
    sandwich_norms: bool = False             # a norm after attention and after the MLP too (four a layer)
    embed_scale: float = 1.0                 # embeddings multiplied by it (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None   # the softmax scale is its -1/2 power (None: head_dim's)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    sliding_window: int | None = None        # the positions a sliding layer sees, its own included
    layer_types: tuple[str, ...] = ()        # "sliding_attention" / "full_attention" per layer; () all full
    local_rope_theta: float | None = None    # sliding layers' RoPE base (plain RoPE; rope_scaling is the full layers')
    # Qwen3.5's differences (config_qwen35.py reads them): "linear_attention" layers in layer_types are Gated
    # DeltaNet, with these head counts, head dims and causal-conv kernel; the full layers gate their output.
    partial_rotary_factor: float = 1.0       # RoPE turns the first head_dim x factor channels of each head
    attn_output_gate: bool = False           # q_proj also gives a gate: attention output x sigmoid(gate)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # Gemma 4's differences (config_gemma4.py reads them). The full layers' heads: their own width and KV head
    # count (0: head_dim's, num_kv_heads'), keys reused as values where attention_k_eq_v, RoPE turning the
    # first global_rope_proportion of each head's frequency pairs. The last num_kv_shared_layers layers read
    # the cache of the last earlier layer of their type and own none; double_wide_mlp doubles their MLP.
    global_head_dim: int = 0
    global_num_kv_heads: int = 0
    attention_k_eq_v: bool = False
    value_norm: bool = False                 # V RMS-normalised per head, without a weight
    global_rope_proportion: float = 1.0
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_input_size: int = 0            # per-layer embedding width a layer (0: none)
    per_layer_vocab_size: int = 0

    def head_dim_of(self, layer: int) -> int:
        if self.global_head_dim and not self.window_of(layer):
            return self.global_head_dim
        return self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        if self.global_num_kv_heads and not self.window_of(layer):
            return self.global_num_kv_heads
        return self.num_kv_heads

    def k_eq_v_at(self, layer: int) -> bool:
        """Gemma 4: a full layer without v_proj, whose values are its keys' projection."""
        return self.attention_k_eq_v and not self.window_of(layer)

    @property
    def first_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def kv_source(self, layer: int) -> int:
        """The layer whose cache `layer` reads: itself, or for a KV-shared layer the last layer before the
        shared ones of its type."""
        first = self.first_shared_layer
        if layer < first:
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(first) if self.layer_types[i] == kind)

    def cache_kind(self, layer: int) -> str:
        """The cache group `layer` belongs to (plan.CacheGroup.kind): "linear_attention" (a recurrent state a
        sequence), "shared" (reads another layer's cache, owns none), "sliding_attention" (window-bounded KV
        blocks) or "full_attention" (the paged KV over the whole context)."""
        if layer in self.linear_layers:
            return "linear_attention"
        if layer >= self.first_shared_layer:
            return "shared"
        return "sliding_attention" if self.window_of(layer) else "full_attention"

    def cache_layers(self, sliding: bool = False) -> int:
        """Layers owning a cache in the sliding (or the full-attention) group: KV-shared layers and Qwen3.5's
        linear-attention layers own none."""
        return sum(1 for i in range(self.first_shared_layer)
                   if bool(self.window_of(i)) == sliding and i not in self.linear_layers)

    def cache_shape(self, sliding: bool = False) -> tuple[int, int]:
        """(KV heads, head dim) of the sliding (or the full-attention) cache group's layers."""
        if sliding:
            return self.num_kv_heads, self.head_dim
        return self.global_num_kv_heads or self.num_kv_heads, self.global_head_dim or self.head_dim

    @property
    def keys_share_one_shape(self) -> bool:
        """Whether every cache-owning layer's keys have one (KV heads, head dim), as the calibrated mean key
        (one [layers, KV heads, head dim] tensor, measured through one pool) needs: not Gemma 4's, whose full
        layers have wider heads of their own count."""
        return not self.sliding_layers or self.cache_shape() == self.cache_shape(sliding=True)

    def intermediate_of(self, layer: int) -> int:
        wide = self.double_wide_mlp and layer >= self.first_shared_layer
        return self.intermediate_size * (2 if wide else 1)

    def window_of(self, layer: int) -> int:
        """How many positions layer `layer` attends back (its own included); 0 for the whole context."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window or 0)
        return 0

    @property
    def family(self) -> str:
        """"llama", "qwen2", "qwen3", "gemma3", "qwen3_5" or "gemma4"."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def declared(self) -> ModelFamily:
        """What the model's family declares (its stop tokens, parsers, KV defaults, model class)."""
        return FAMILIES[self.family]

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.window_of(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Qwen3.5's Gated DeltaNet layers: a recurrent state per sequence, no KV cache."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def rotary_dim(self) -> int:
        """Channels of each q/k head that RoPE turns (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_positions(self) -> int:
        """The longest context the model's positions reach: YaRN stretches the original context by its
        factor (vLLM derives the limit the same way); otherwise max_position_embeddings."""
        s = self.rope_scaling
        if s is not None and s.rope_type == "yarn":
            return max(self.max_position_embeddings, int(s.factor * s.original_max_position_embeddings))
        return self.max_position_embeddings

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["layer_types"] = tuple(d.get("layer_types") or ())
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Read a Hugging Face `config.json` dict (transformers 4.x and 5.x spellings)."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; "
                f"bie-trt supports {sorted(SUPPORTED_ARCHITECTURES)} (Llama-family decoders)."
            )
        family = {}   # a family's own fields (Gemma 3's, Qwen3.5's, Gemma 4's)
        read = FAMILIES[SUPPORTED_ARCHITECTURES[arch]].read_config
        if read is not None:
            hf, family = read(hf, source)
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            kwargs = dict(
                architecture=arch,
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or DEFAULT_HEAD_DIM.get(arch, hidden // heads)),
                vocab_size=int(hf["vocab_size"]),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: required field {e.args[0]!r} is missing.") from None
        if not family:
            _refuse_sliding_window(hf, source)
        # transformers 5 moved rope_theta/rope_scaling into rope_parameters. A rope_scaling block added
        # to such a config (as Qwen documents YaRN) replaces its type, whichever key spells it.
        rope = dict(hf.get("rope_parameters") or {})
        if hf.get("rope_scaling"):
            rope = {k: v for k, v in rope.items() if k not in ("rope_type", "type")} | hf["rope_scaling"]
        theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(
                f"{source}: rope scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}."
            )
        scaling = None
        if rope_type != "default":
            scaling = RopeScaling.from_hf(rope, kwargs["max_position_embeddings"], source)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        cfg = cls(
            **kwargs,
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **family,
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads={cfg.num_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_kv_heads}."
            )
        return cfg


def _refuse_sliding_window(hf: dict[str, Any], source: str) -> None:
    """Qwen2/Qwen3 configs carry `sliding_window` but use it only with `use_sliding_window` (or sliding
    layer_types); the engine attends over the whole context, so such a model would be read wrongly."""
    sliding = bool(hf.get("use_sliding_window")) or "sliding_attention" in (hf.get("layer_types") or ())
    if sliding and hf.get("sliding_window") is not None:
        raise CheckpointError(
            f"{source}: use_sliding_window is on (sliding_window={hf.get('sliding_window')}); bie-trt attends over "
            f"the whole context in every layer. Set use_sliding_window to false (the published Qwen configs do).")


@dataclass(frozen=True)
class KVCacheConfig:
    """How the KV cache is stored: the two pools, the quantised format, the window and the rotation."""

    dtype: str = "fp16"
    group_size: int = 64
    sink_tokens: int = 8
    window: int = 128
    rotation: str = "hadamard"
    # Subtract the engine's calibrated mean key before quantising (builder/key_centering.py); exact for attention.
    # Off by default: it lowers KL divergence but not perplexity on SmolLM2; on for Gemma 3 (its kv_defaults).
    key_centering: bool = False
    # Divide keys by the engine's calibrated per-channel scale before quantising and multiply queries by it
    # (builder/kv_choice.py): q·k unchanged; on where the build measured that it lowers INT4's attention error.
    key_scale: bool = False
    block_size: int = 16
    # "group": a scale and zero per group of channels per token per head (the format).
    # "block": one scale and zero for a whole block of a layer -- an ablation for the quality table.
    scale_scope: str = "group"

    def validate(self, head_dim: int | None = None) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"kv cache dtype {self.dtype!r} is unknown; choose one of {KV_DTYPES}.")
        if self.rotation not in KV_ROTATIONS:
            raise ValueError(f"kv rotation {self.rotation!r} is unknown; choose one of {KV_ROTATIONS}.")
        if self.scale_scope not in ("group", "block"):
            raise ValueError(f"kv scale scope {self.scale_scope!r} is unknown; choose 'group' or 'block'.")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"kv group size {self.group_size} is not allowed; use 32, 64 or 128.")
        if head_dim is not None and self.dtype == "int4_asym" and head_dim % self.group_size:
            raise ValueError(
                f"kv group size {self.group_size} does not divide head_dim {head_dim}; "
                f"use a group size that divides it (32 or 64)."
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"kv block size {self.block_size} must be a power of two.")
        if not isinstance(self.key_centering, bool):
            raise ValueError(f"kv key centering must be true or false; got {self.key_centering!r}.")
        if not isinstance(self.key_scale, bool):
            raise ValueError(f"kv key scale must be true or false; got {self.key_scale!r}.")
        if self.sink_tokens < 0 or self.window < 0:
            raise ValueError("kv sink tokens and window must be non-negative.")


SPEC_METHODS = ("ngram", "draft_model", "none")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, spelled as vLLM's `--speculative-config` JSON.

    "ngram" proposes by prompt lookup (the longest match of the last prompt_lookup_max ..
    prompt_lookup_min tokens earlier in prompt + output); "draft_model" runs the engine's draft;
    "none" decodes one token per step. `adaptive` (bie-trt's own key): each request's γ is chosen every
    step in 0..num_speculative_tokens from its acceptance and the engine's measured step costs
    (spec_decode/adaptive.py); false: always num_speculative_tokens, as vLLM does. On by default for both
    methods (docs/speculative.md, "Adaptive γ", has what it was measured to keep and save).
    """

    method: str = "none"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method {self.method!r} is unknown; choose one of {SPEC_METHODS}.")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1; got {value!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min {self.prompt_lookup_min} is above prompt_lookup_max "
                             f"{self.prompt_lookup_max}; make min <= max.")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative adaptive must be true or false; got {self.adaptive!r}.")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str") -> "SpeculativeConfig":
        """A SpeculativeConfig, a dict or a JSON object in vLLM's spelling -> SpeculativeConfig (ValueError
        naming the problem otherwise)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON ({e.msg}); write e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 5}\'.') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object; got {type(value).__name__}.")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative config has unknown keys {unknown}; known: method, num_speculative_tokens, "
                             f"prompt_lookup_max, prompt_lookup_min, adaptive.")
        return cls(**value)


# Each KV-cache option as build, plan, eval and EngineConfig spell it -> the KVCacheConfig field it sets.
_KV_OPTION_FIELDS = {"kv_cache_dtype": "dtype", "kv_group_size": "group_size", "kv_sink_tokens": "sink_tokens",
                     "kv_window": "window", "kv_rotation": "rotation", "kv_key_centering": "key_centering",
                     "kv_key_scale": "key_scale"}


@dataclass(kw_only=True)
class KVOverrides:
    """The KV-cache options a caller gave (None: not given), and the one way they are laid over a base
    format -- a profile's with its model family's defaults (build, plan), or an engine's (the runtime):
    each given value replaces its field, the others stay the base's. The base class of the options that
    carry them (EngineConfig, builder.build.BuildOptions), so each is declared once; keyword-only, so a
    subclass's own fields keep their order."""

    kv_cache_dtype: str | None = None
    kv_group_size: int | None = None
    kv_sink_tokens: int | None = None
    kv_window: int | None = None
    kv_rotation: str | None = None
    kv_key_centering: bool | None = None
    kv_key_scale: bool | None = None

    @classmethod
    def of(cls, options: dict[str, Any]) -> "KVOverrides":
        """The options among a command's keyword arguments (a missing one is not given)."""
        return cls(**{name: options.get(name) for name in _KV_OPTION_FIELDS})

    def given(self) -> dict[str, Any]:
        """The KVCacheConfig fields the caller set, with their values."""
        return {field: getattr(self, name) for name, field in _KV_OPTION_FIELDS.items()
                if getattr(self, name) is not None}

    def apply(self, base: KVCacheConfig) -> KVCacheConfig:
        return dataclasses.replace(base, **self.given())


@dataclass
class EngineConfig(KVOverrides):
    """What `BieEngine` needs to load and serve an engine directory. Its KV-cache overrides (KVOverrides:
    None, the engine's) are used by `bie-trt eval` for ablations; a larger format than the engine was planned
    for may not fit the GPU budget."""

    engine_dir: str
    device: str = "auto"            # auto | cpu | cuda[:N]
    dtype: str = "auto"             # activations: auto = fp16 on CUDA, fp32 on CPU (exact reference)
    max_model_len: int | None = None  # None: the engine's
    max_num_seqs: int | None = None   # None: the engine's
    chunked_prefill_size: int | None = None   # None: the engine's (the chunk its memory plan was solved for)
    max_num_batched_tokens: int | None = None  # tokens per step; None: chunked_prefill_size + max_num_seqs
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # None: from the memory plan
    # GiB of host memory for prefix blocks evicted from the device (0: off; None: a fraction of the
    # available host memory, see kv/host_pool.py)
    host_kv_cache_gb: float | None = None
    # A model with linear-attention layers: besides each prompt's last block boundary, save their state every
    # this many tokens of a prompt for prefix hits (a multiple of the KV block size; 0: only there). The plan
    # fixes how many snapshots are kept (the least recently used is overwritten).
    state_snapshot_interval: int = 0
    # A directory for the prefix cache's disk tier (None: none; `serve` defaults it under the user cache), and
    # its bound in GiB over every engine's files there (0: off; None: 8 GiB, at most a quarter of the free space)
    kv_cache_dir: str | None = None
    disk_kv_cache_gb: float | None = None
    enforce_eager: bool = False       # True: no CUDA graphs (debugging)
    skip_verify: bool = False         # True: serve without checking each file's sha256 against the manifest
    chat_template: str | None = None  # a jinja2 chat template file replacing the checkpoint's own
    # extra variables for every chat template render ({"enable_thinking": False}); a request's own override
    # them key by key
    chat_template_kwargs: dict[str, Any] | None = None
    # how a chat reply's reasoning block is found, by the thinking budget and the reply's split alike: auto (the
    # model family's, else qwen3's when the chat template mentions <think>, else none), qwen3, deepseek_r1 or
    # none (reasoning.PARSERS)
    reasoning_parser: str = "auto"
    seed: int | None = None         # None: each unseeded request draws fresh entropy; an int: they repeat per run
    # Speculative decoding: a SpeculativeConfig or a dict in vLLM's spelling; None: the engine's default
    # (its manifest's "speculative", else a draft if it has one, else off).
    speculative: SpeculativeConfig | dict[str, Any] | None = None
