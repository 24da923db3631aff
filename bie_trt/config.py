"""Plain data classes for the model, the KV cache, the engine and sampling, with their validation."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError, RequestError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
KV_DTYPES = ("fp16", "fp8", "int4_asym")
KV_ROTATIONS = ("hadamard", "hadamard_kv", "none")   # keys only, keys and values, neither
# Dividing (or multiplying) logits by a penalty further out overflows them to inf, and the softmax to NaN;
# the HTTP API checks the same range.
REPETITION_PENALTY_RANGE = (0.01, 10.0)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling ("llama3"); `None` on ModelConfig means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
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
                head_dim=int(hf.get("head_dim") or hidden // heads),
                vocab_size=int(hf["vocab_size"]),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: required field {e.args[0]!r} is missing.") from None
        # transformers 5 moved rope_theta/rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or {})
        rope.update(hf.get("rope_scaling") or {})
        theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type != "default":
            raise CheckpointError(
                f"{source}: rope scaling type {rope_type!r} is not supported; supported: default, llama3."
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        cfg = cls(
            **kwargs,
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads={cfg.num_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_kv_heads}."
            )
        return cfg


@dataclass(frozen=True)
class KVCacheConfig:
    """How the KV cache is stored: see DESIGN §5."""

    dtype: str = "fp16"
    group_size: int = 64
    sink_tokens: int = 8
    window: int = 128
    rotation: str = "hadamard"
    # Subtract the engine's calibrated mean key before quantising (kv/centering.py); exact for attention.
    # Off by default: it lowers KL divergence but not perplexity (docs/kv-cache-quality.md).
    key_centering: bool = False
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
        if self.sink_tokens < 0 or self.window < 0:
            raise ValueError("kv sink tokens and window must be non-negative.")


SPEC_METHODS = ("ngram", "draft_model", "none")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, spelled as vLLM's `--speculative-config` JSON.

    "ngram" proposes by prompt lookup (the longest match of the last prompt_lookup_max ..
    prompt_lookup_min tokens earlier in prompt + output); "draft_model" runs the engine's draft;
    "none" decodes one token per step.
    """

    method: str = "none"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

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
                             f"prompt_lookup_max, prompt_lookup_min.")
        return cls(**value)


@dataclass
class EngineConfig:
    """What `BieEngine` needs to load and serve an engine directory."""

    engine_dir: str
    device: str = "auto"            # auto | cpu | cuda[:N]
    dtype: str = "auto"             # activations: auto = fp16 on CUDA, fp32 on CPU (exact reference)
    max_model_len: int | None = None  # None: the engine's
    max_num_seqs: int = 8
    chunked_prefill_size: int | None = None   # None: the engine's (the chunk its memory plan was solved for)
    max_num_batched_tokens: int | None = None  # tokens per step; None: chunked_prefill_size + max_num_seqs
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # None: from the memory plan
    enforce_eager: bool = False       # True: no CUDA graphs (debugging)
    skip_verify: bool = False         # True: serve without checking each file's sha256 against the manifest
    chat_template: str | None = None  # a jinja2 chat template file replacing the checkpoint's own
    seed: int | None = None         # None: each unseeded request draws fresh entropy; an int: they repeat per run
    # KV-cache overrides (None: the engine's). Used by `bie-trt eval` for ablations; a larger
    # format than the engine was planned for may not fit the GPU budget.
    kv_cache_dtype: str | None = None
    kv_group_size: int | None = None
    kv_sink_tokens: int | None = None
    kv_window: int | None = None
    kv_rotation: str | None = None
    kv_key_centering: bool | None = None
    # Speculative decoding: a SpeculativeConfig or a dict in vLLM's spelling; None: the engine's default
    # (its manifest's "speculative", else a draft if it has one, else off).
    speculative: SpeculativeConfig | dict[str, Any] | None = None

    def kv_overrides(self) -> dict[str, Any]:
        names = {"kv_cache_dtype": "dtype", "kv_group_size": "group_size", "kv_sink_tokens": "sink_tokens",
                 "kv_window": "window", "kv_rotation": "rotation", "kv_key_centering": "key_centering"}
        return {field: getattr(self, name) for name, field in names.items() if getattr(self, name) is not None}


@dataclass
class SamplingParams:
    """OpenAI/vLLM-style sampling knobs. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 or -1: off
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None     # return the top-N log-probabilities of each sampled token (0..20)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> RequestError:
            return RequestError(msg)

        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0 (0 is greedy); got {self.temperature!r}.")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1]; got {self.top_p!r}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= 0 (0 or -1 disables it); got {self.top_k!r}.")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1]; got {self.min_p!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1; got {self.max_tokens!r}.")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:   # NaN fails the comparison too
            raise bad(f"repetition_penalty must be in [{low:g}, {high:g}] (1 is off); got {self.repetition_penalty!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(f"{name} must be in [-2, 2]; got {getattr(self, name)!r}.")
        # torch.Generator.manual_seed's range: beyond it the request would fail inside the engine
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            raise bad(f"seed must be an integer in [-2**63, 2**64); got {self.seed!r}.")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad(f"logprobs must be an integer in [0, 20]; got {self.logprobs!r}.")
