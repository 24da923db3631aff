"""Open and validate an AutoAWQ gemm checkpoint directory.

Every malformed input raises one CheckpointError naming the file or tensor, what was
expected and what was found. Tensors are read lazily, one at a time, from safetensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ...config import ModelConfig
from ...errors import CheckpointError
from ...jsonio import read_json_object
from ...kv.recurrent import conv_channels
from ...plan import deltanet_shapes, linear_shapes
from .qwen35_weights import DENSE_LINEARS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


# Multimodal checkpoints whose text tower the engine runs (the vision tower is never read).
MULTIMODAL = ("Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration",
              "Gemma4UnifiedForConditionalGeneration")
# Where their text tower's tensors live: transformers >= 4.52 writes model.language_model.*, earlier
# releases language_model.model.* (and language_model.lm_head.*).
TEXT_TOWER_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                       "language_model.lm_head.": "lm_head."}

# The runtime's fused linears, by the Hugging Face linears they hold.
FUSED = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def text_tower_names(names) -> dict[str, str]:
    """The text model's name of each text-tower tensor among `names` -> its name in the checkpoint."""
    out = {}
    for name in names:
        for prefix, ours in TEXT_TOWER_PREFIXES.items():
            if name.startswith(prefix):
                out[ours + name[len(prefix):]] = name
    return out


def layer_norms(m: ModelConfig) -> dict[str, str]:
    """The engine's name of each of a layer's norms -> the checkpoint's. Gemma 3 has four: its
    post_attention_layernorm follows the attention; pre_feedforward_layernorm is the one in front of the MLP."""
    if m.sandwich_norms:
        return {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
    return {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


@dataclass(frozen=True)
class QuantConfig:
    bits: int
    group_size: int
    version: str
    zero_point: bool


def _read_json(path: Path) -> dict:
    return read_json_object(path, "re-download the checkpoint's file from its source.", CheckpointError)


def _open_safetensors(path: Path):
    try:
        return safe_open(path, "pt")
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); it is truncated or corrupt: "
                              f"download it again.") from None


def read_quant_config(ckpt: Path, hf: dict) -> QuantConfig:
    """AWQ settings live in config.json's quantization_config (or AutoAWQ's older quant_config.json)."""
    qc = hf.get("quantization_config")
    where = "config.json quantization_config"
    if qc is None and (ckpt / "quant_config.json").exists():
        qc, where = _read_json(ckpt / "quant_config.json"), "quant_config.json"
    if qc is None:
        raise CheckpointError(
            f"{ckpt}/config.json has no quantization_config: this is not an AWQ checkpoint. "
            f"Make one with `bie-trt quantize --model {ckpt} --out DIR`."
        )
    method = str(qc.get("quant_method", "awq")).lower()
    if method != "awq":
        raise CheckpointError(f"{where}: quant_method is {method!r}; bie-trt needs 'awq' (AutoAWQ gemm).")
    bits = int(qc.get("bits", qc.get("w_bit", 0)))
    group = int(qc.get("group_size", qc.get("q_group_size", 0)))
    version = str(qc.get("version", "gemm")).lower()
    zero_point = bool(qc.get("zero_point", True))
    if bits != 4:
        raise CheckpointError(f"{where}: bits is {bits}; bie-trt supports 4-bit AWQ only.")
    if version != "gemm":
        raise CheckpointError(f"{where}: version is {version!r}; bie-trt reads the 'gemm' packing only (re-export with version='gemm').")
    if not zero_point:
        raise CheckpointError(f"{where}: zero_point is false; bie-trt needs asymmetric AWQ (zero_point=true).")
    if group <= 0:
        raise CheckpointError(f"{where}: group_size is {group}; expected a positive group size such as 128.")
    return QuantConfig(bits, group, version, zero_point)


class Checkpoint:
    """A validated AWQ checkpoint: model config, quant config, lazy tensor access."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: no such checkpoint directory.")
        cfg_path = self.path / "config.json"
        if not cfg_path.exists():
            raise CheckpointError(f"{cfg_path}: missing; a checkpoint needs its Hugging Face config.json.")
        self.hf_config = _read_json(cfg_path)
        self.model = ModelConfig.from_hf(self.hf_config, str(cfg_path))
        self.quant = read_quant_config(self.path, self.hf_config)
        if not any((self.path / f).exists() for f in TOKENIZER_FILES):
            raise CheckpointError(
                f"{self.path}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})."
            )
        self._index = self._weight_index()
        # the text tower of a multimodal checkpoint, under the names of the text model
        self._source = text_tower_names(self._index) if self.model.architecture in MULTIMODAL else {}
        self._index.update({name: self._index[src] for name, src in self._source.items()})
        self._check_tensors()

    # -- weights -----------------------------------------------------------------
    def _weight_index(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            wm = _read_json(index).get("weight_map")
            if not isinstance(wm, dict):
                raise CheckpointError(f"{index}: has no 'weight_map' object.")
            out = {name: self.path / f for name, f in wm.items()}
            for f in sorted(set(out.values())):
                if not f.exists():
                    raise CheckpointError(f"{index} names shard {f.name}, which is missing.")
            return out
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no weights (no *.safetensors and no model.safetensors.index.json).")
        out = {}
        for f in files:
            with _open_safetensors(f) as h:
                out.update({k: f for k in h.keys()})
        return out

    def has(self, name: str) -> bool:
        return name in self._index

    def _meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        with _open_safetensors(self._index[name]) as h:
            sl = h.get_slice(self._source.get(name, name))
            dtype = {"I32": torch.int32, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}.get(
                sl.get_dtype(), sl.get_dtype())
            return dtype, tuple(sl.get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._index:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the weights.")
        with _open_safetensors(self._index[name]) as h:
            return h.get_tensor(self._source.get(name, name))

    def w4(self, name: str) -> dict[str, torch.Tensor]:
        """The linear `name` (`...q_proj.weight`) in the runtime's W4 layout, repacked from AWQ."""
        from ...kernels.w4_layout import awq_to_w4

        base = name.removesuffix(".weight")
        return awq_to_w4(*(self.tensor(base + s) for s in (".qweight", ".qzeros", ".scales")))

    def linear_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        """Layer `layer`'s AWQ linears: name -> (in_features, out_features), as the plan counts them (Qwen3.5's
        q_proj gives each head's query and its output gate; Gemma 4's layers differ in head width, in having k
        and v at all, and in MLP width). Qwen3.5's in_proj_b and in_proj_a stay dense (qwen35_weights)."""
        m = self.model
        deltanet = layer in m.linear_layers
        mixer = "linear_attn." if deltanet else "self_attn."
        shapes = deltanet_shapes(m) if deltanet else linear_shapes(m, layer)
        return {("mlp." if name in LINEARS["mlp"] else mixer) + name: (k, n)
                for name, k, n in shapes if name not in DENSE_LINEARS}

    def _float_tensors(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Layer `layer`'s unquantised tensors beside its norms: name -> shape."""
        m, p = self.model, f"model.layers.{layer}."
        out: dict[str, tuple[int, ...]] = {}
        if layer in m.linear_layers:
            a, hv = p + "linear_attn.", m.linear_num_value_heads
            out.update({a + f"{name}.weight": (hv, m.hidden_size) for name in DENSE_LINEARS})
            out.update({a + "conv1d.weight": (conv_channels(m), 1, m.linear_conv_kernel),
                        a + "A_log": (hv,), a + "dt_bias": (hv,), a + "norm.weight": (m.linear_value_head_dim,)})
            return out
        if m.qkv_bias:
            for sub, n in (("q_proj", m.q_size), ("k_proj", m.kv_size), ("v_proj", m.kv_size)):
                out[p + f"self_attn.{sub}.bias"] = (n,)
        if m.qk_norm:   # a KV-shared layer (Gemma 4) has no keys of its own, so no k norm
            for sub in ("q_norm", "k_norm")[:1 + (m.kv_source(layer) == layer)]:
                out[p + f"self_attn.{sub}.weight"] = (m.head_dim_of(layer),)
        if m.family == "gemma4":
            out[p + "layer_scalar"] = (1,)
        if m.per_layer_input_size:
            h, size = m.hidden_size, m.per_layer_input_size
            out.update({p + "per_layer_input_gate.weight": (size, h), p + "per_layer_projection.weight": (h, size),
                        p + "post_per_layer_input_norm.weight": (h,)})
        return out

    def _expect(self, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
        if name not in self._index:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing (expected shape {list(shape)}).")
        dtype, found = self._meta(name)
        if found != shape:
            raise CheckpointError(f"tensor {name!r} in {self._index[name].name}: expected shape {list(shape)}, found {list(found)}.")
        if dtype not in dtypes:
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise CheckpointError(f"tensor {name!r} in {self._index[name].name}: expected dtype {want}, found {str(dtype).replace('torch.', '')}.")

    def _check_tensors(self) -> None:
        m, G = self.model, self.quant.group_size
        floats = (torch.float16, torch.bfloat16, torch.float32)
        for i in range(m.num_layers):
            p = f"model.layers.{i}."
            for sub, (k, n) in self.linear_shapes(i).items():
                if k % G:
                    raise CheckpointError(
                        f"group_size {G} does not divide in_features {k} of {sub}; "
                        f"quantise with a group size that divides {k} (e.g. 64 or 32)."
                    )
                if n % 8:
                    raise CheckpointError(f"{sub}: out_features {n} is not a multiple of 8, which AWQ packing needs.")
                self._expect(p + sub + ".qweight", (torch.int32,), (k, n // 8))
                self._expect(p + sub + ".qzeros", (torch.int32,), (k // G, n // 8))
                self._expect(p + sub + ".scales", (torch.float16,), (k // G, n))
            for name, shape in self._float_tensors(i).items():
                self._expect(name, floats, shape)
            norms = ("input_layernorm", "post_attention_layernorm")
            if m.sandwich_norms:   # Gemma 3: a norm after attention and around the MLP too
                norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
            for norm in norms:
                self._expect(p + norm + ".weight", floats, (m.hidden_size,))
        self._expect("model.embed_tokens.weight", floats, (m.vocab_size, m.hidden_size))
        self._expect("model.norm.weight", floats, (m.hidden_size,))
        if m.per_layer_input_size:   # Gemma 4's per-layer embeddings: the table, and the embedding's share
            row = m.num_layers * m.per_layer_input_size
            self._expect("model.embed_tokens_per_layer.weight", floats, (m.per_layer_vocab_size, row))
            self._expect("model.per_layer_model_projection.weight", floats, (row, m.hidden_size))
            self._expect("model.per_layer_projection_norm.weight", floats, (m.per_layer_input_size,))
        if not m.tie_word_embeddings:
            self._expect("lm_head.weight", floats, (m.vocab_size, m.hidden_size))

    def digest_files(self) -> list[Path]:
        """Files whose bytes define the checkpoint (for the manifest's source digest)."""
        names = {"config.json", "quant_config.json", "model.safetensors.index.json", *TOKENIZER_FILES,
                 "special_tokens_map.json", "generation_config.json", "chat_template.jinja"}
        files = {p for p in set(self._index.values())}
        files |= {self.path / n for n in names if (self.path / n).exists()}
        return sorted(files)
