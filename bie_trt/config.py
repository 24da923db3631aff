"""Plain data classes for the model, the KV cache, the engine and sampling, with their validation."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError, RequestError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",   # the text tower of the multimodal releases
}
# Architectures with an RMSNorm over each q and k head (own weights, the model's eps) before RoPE.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# transformers' Qwen3Config: head_dim is its own field, 128 when config.json leaves it out.
DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128}
KV_DTYPES = ("fp16", "fp8", "int4_asym")
KV_ROTATIONS = ("hadamard", "hadamard_kv", "none")   # keys only, keys and values, neither
# Dividing (or multiplying) logits by a penalty further out overflows them to inf, and the softmax to NaN;
# the HTTP API checks the same range.
REPETITION_PENALTY_RANGE = (0.01, 10.0)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as config.json states it; `None` on ModelConfig means plain RoPE.

    "llama3" (Llama-3.1) uses low/high_freq_factor; "yarn" uses beta_fast/beta_slow and an attention
    factor on cos/sin, given directly or derived from factor, mscale and mscale_all_dim (model/rope.py).
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

    def window_of(self, layer: int) -> int:
        """How many positions layer `layer` attends back (its own included); 0 for the whole context."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window or 0)
        return 0

    @property
    def family(self) -> str:
        """"llama", "qwen2", "qwen3" or "gemma3"."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.window_of(i))

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
        gemma = {}
        if SUPPORTED_ARCHITECTURES[arch] == "gemma3":
            from .config_gemma3 import gemma3_fields, gemma3_text_config

            hf = gemma3_text_config(hf, source)
            gemma = gemma3_fields(hf, source)
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
        if not gemma:
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
            **gemma,
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
    # GiB of host memory for prefix blocks evicted from the device (0: off; None: a fraction of the
    # available host memory, see kv/host_pool.py)
    host_kv_cache_gb: float | None = None
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


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on what may be generated, as vLLM's `structured_outputs`: exactly one field set.

    json: a JSON Schema (a dict, or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: an EBNF grammar in
    the grammar library's dialect (GBNF-style `root ::= ...`).

    lenient (json and json_object only): the schema as JSON Schema reads it (undeclared keys, unbounded
    numbers) with flexible whitespace, instead of the closed form `closed_schema` makes of it.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    lenient: bool = False

    @property
    def kind(self) -> str:
        """The one field that is set; a RequestError naming the fields when not exactly one is (a bare
        next() would raise StopIteration, which an async route turns into a 500)."""
        set_ = self._set_kinds()
        if len(set_) != 1:
            raise RequestError(f"structured_outputs must set exactly one of {list(STRUCTURED_KINDS)}; "
                               f"got {set_ or 'none'}.")
        return set_[0]

    def _set_kinds(self) -> list[str]:
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    def key(self) -> str:
        """A canonical text of the constraint: equal constraints, equal keys (the compiled-grammar cache's)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        form = ":lenient" if self.lenient else ""
        return self.kind + form + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))

    def schema(self) -> dict | None:
        """The JSON Schema as a dict (json only)."""
        if self.json is None:
            return None
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def validate(self) -> None:
        """Cheap checks that need no tokenizer; the grammar compiler checks the rest (unsupported keywords)."""
        self.kind   # exactly one set
        if self.json_object is not True and self.json_object is not False:
            raise RequestError(f"structured_outputs.json_object must be true or false; got {self.json_object!r}.")
        if not isinstance(self.lenient, bool):
            raise RequestError(f"structured_outputs.lenient must be true or false; got {self.lenient!r}.")
        if self.json is not None:
            check_json_schema(self.json)
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise RequestError(f"structured_outputs.regex must be a non-empty string; got {self.regex!r}.")
            try:
                re.compile(self.regex)
            except re.error as e:
                raise RequestError(f"structured_outputs.regex does not compile ({e}); send a valid regular "
                                   f"expression.") from None
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise RequestError(f"structured_outputs.choice must be a non-empty list of non-empty strings; "
                                   f"got {self.choice!r}.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise RequestError(f"structured_outputs.grammar must be a non-empty grammar text; got {self.grammar!r}.")

    @classmethod
    def from_response_format(cls, response_format: dict) -> "StructuredOutputs | None":
        """OpenAI's `response_format` -> the constraint it asks for (None for "text")."""
        if not isinstance(response_format, dict):
            raise RequestError(f"response_format must be an object with a 'type'; got {response_format!r}.")
        kind = response_format.get("type")
        if kind not in RESPONSE_FORMAT_TYPES:
            raise RequestError(f"response_format.type {kind!r} is unknown; choose one of "
                               f"{list(RESPONSE_FORMAT_TYPES)}.")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError("response_format of type 'json_schema' needs json_schema: {\"name\": ..., "
                               "\"schema\": {...}}.")
        return cls(json=spec["schema"])


def check_json_schema(schema: object) -> dict:
    """A JSON Schema (dict or JSON text) -> the dict; RequestError naming the problem if it is not one."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"the JSON schema is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                               f"send a JSON object.") from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"the JSON schema must be an object; got {type(schema).__name__}.")
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise RequestError(f"the JSON schema cannot be written as JSON ({e}); send plain JSON values.") from None
    _check_schema_text(text)
    return schema


@functools.lru_cache(maxsize=256)
def _check_schema_text(text: str) -> None:
    """Against the JSON Schema meta-schema (milliseconds each): a request's schema is checked several times
    on its way in, and the same schemas come back request after request."""
    import jsonschema

    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/" + "/".join(str(p) for p in e.absolute_path)
        raise RequestError(f"the JSON schema is not valid JSON Schema (at {where}: {e.message}); "
                           f"fix the schema.") from None


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
    # a constraint on the output (vLLM's structured_outputs); OpenAI's response_format is turned into one
    structured_outputs: StructuredOutputs | None = None
    response_format: dict | None = None
    logit_bias: dict[int, float] | None = None   # token id -> bias in [-100, 100], added to the logits
    min_tokens: int = 0             # EOS and stop_token_ids masked, stop strings not searched, until this many tokens
    # reasoning tokens a thinking model may write before the engine closes its <think> block itself
    # (thinking_budget.py); None: unbounded. A reply without a block (or a prompt that closed it) ignores it.
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputs(**self.structured_outputs)
            except TypeError:
                raise RequestError(f"structured_outputs has unknown keys; known: {list(STRUCTURED_KINDS)}.") from None
        if isinstance(self.logit_bias, dict):   # JSON object keys arrive as strings
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise RequestError(f"logit_bias keys must be token ids (integers); got "
                                   f"{sorted(map(str, self.logit_bias))[:5]}.") from None
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
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0; got {self.min_tokens!r}.")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens {self.min_tokens} is above max_tokens {self.max_tokens}; make min_tokens <= "
                      f"max_tokens.")
        if self.thinking_budget is not None and (not isinstance(self.thinking_budget, int)
                                                 or isinstance(self.thinking_budget, bool) or self.thinking_budget < 0):
            raise bad(f"thinking_budget must be an integer >= 0 (0 closes the block at once); got "
                      f"{self.thinking_budget!r}.")
        self._validate_logit_bias()
        self._validate_structured()
        if self.thinking_budget is not None and self.structured_outputs is not None:
            raise bad("thinking_budget with structured_outputs: a constrained reply is shaped whole by its grammar "
                      "and has no reasoning block to bound; send one of them.")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise RequestError(f"logit_bias must map token ids to numbers; got {type(self.logit_bias).__name__}.")
        low, high = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise RequestError(f"logit_bias key {token!r} is not a token id (an integer >= 0).")
            if (not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias)
                    or not low <= bias <= high):
                raise RequestError(f"logit_bias[{token}] must be a number in [{low:g}, {high:g}]; got {bias!r}.")

    def _validate_structured(self) -> None:
        """Turn response_format into structured_outputs (once) and check the constraint."""
        if self.response_format is not None:
            converted = StructuredOutputs.from_response_format(self.response_format)
            if self.structured_outputs is None:
                self.structured_outputs = converted
            elif self.structured_outputs != converted:
                raise RequestError("both response_format and structured_outputs are set; send one of them.")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise RequestError(f"structured_outputs must be a StructuredOutputs (or a dict of its fields); got "
                                   f"{type(self.structured_outputs).__name__}.")
            self.structured_outputs.validate()
