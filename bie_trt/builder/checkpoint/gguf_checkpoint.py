"""A GGUF file read directly as a checkpoint: metadata and tensor table checked first, weights converted
one tensor at a time into the runtime's layout.

Opening reads only the header (the `gguf` package memory-maps the file): the architecture, the config
it implies, every tensor's name, shape and type are checked before a weight is touched. Conversion
(`w4`, `tensor`) then dequantises or repacks one tensor per call, so the host holds one tensor's floats
besides the output.

A fused linear (qkv, gate_up) whose parts are all Q4_0 (32 weights, one fp16 scale, codes 0..15 around 8)
is the runtime's W4 at group 32 with zero point 8: copied bit for bit. One with any other quantised part
(Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) keeps every part's bytes as the file stores them
(`kernels/gguf_blocks.py`; a float part beside them too): exact. Only a linear that is all float is
rounded to W4 (asymmetric, the engine's group size).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...config import ModelConfig, RopeScaling
from ...errors import CheckpointError
from ...kernels.awq import quantize_rtn
from ...kernels.gguf_blocks import BlockPart
from ...kernels.w4_layout import awq_to_w4, pack_w4
from ...plan import awq_linear_bytes, default_weight_group_size
from .gguf_config import GGUFMeta, hf_config_from_gguf
from .loader import FUSED, QuantConfig, layer_norms

# GGUF names of the tensors the engine reads, by their Hugging Face names.
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Gemma 3's four norms a layer: GGUF's ffn_norm is the one in front of the MLP, as in a Llama, but the
# Hugging Face name of that one is pre_feedforward_layernorm (post_attention_layernorm follows attention).
_GEMMA3_LAYER = _LAYER | {"post_attention_layernorm": "post_attention_norm",
                          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# llama.cpp's converter stores a Gemma norm's (1 + w) as its weight; the engine (as transformers) wants w.
_NORM_SHIFT = {"gemma3": 1.0}
# Linear types: Q4_0 is the engine's W4 itself; the others are kept in their blocks; floats beside
# blocks are kept too, and a linear of floats only is rounded to W4. Anything else is refused by name.
W4_TYPES = ("Q4_0",)
BLOCK_TYPES = ("Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
GGUF_GROUP_SIZE = 32
# Llama 3.1 / 3.3 (factor 8) and 3.2 (factor 32): the RoPE scalings a rope_freqs tensor is matched against.
_LLAMA3_FACTORS = (8.0, 32.0)
_LLAMA3_ORIGINAL = 8192


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight (and the global tensors)."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    base, _, leaf = rest.rpartition(".")
    return f"blk.{layer}.{(_GEMMA3_LAYER if arch == 'gemma3' else _LAYER)[base]}.{leaf}"


def _q4_0_w4(raw: np.ndarray, n: int) -> dict[str, torch.Tensor]:
    """A Q4_0 tensor's bytes [N, ...] -> the W4 layout, bit for bit: a block of 32 weights is one fp16 scale d
    and codes 0..15 around 8 (W = (q - 8) * d), byte j holding code j low and code j + 16 high."""
    blocks = torch.from_numpy(raw).reshape(n, -1, 18)
    scales = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    q = torch.cat([blocks[..., 2:] & 0xF, blocks[..., 2:] >> 4], dim=-1).reshape(n, -1)
    return {"qweight": pack_w4(q), "scales": scales, "zeros": torch.full_like(scales, 8, dtype=torch.uint8)}


def _field_value(field: Any) -> Any:
    """A scalar or string header value (arrays, such as the vocabulary, are skipped: None)."""
    import gguf

    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
        return None
    return field.contents()


def _llama_rows(n: int, heads: int) -> torch.Tensor:
    """llama.cpp stores a Llama q/k projection with each head's rows interleaved for its RoPE; this is the
    row order that undoes it (transformers' reverse_permute_weights)."""
    return torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


def conversion_summary(conv: dict[str, Any]) -> str:
    """One line of a manifest's GGUF record: the file's types, what was carried bit for bit, what rounded."""
    def counts(d: dict[str, int]) -> str:
        return ", ".join(f"{n} {t}" for t, n in d.items()) or "none"

    return (f"{conv['file']}: {counts(conv['tensor_types'])}; linears bit for bit: W4 {counts(conv['linear_exact'])}, "
            f"GGUF blocks {counts(conv['linear_blocks'])}; re-quantised to W4 group "
            f"{conv['weight_group_size']}: {counts(conv['linear_requantised'])}; embedding {conv['embedding']}, "
            f"lm_head {conv['lm_head']}")


class GGUFCheckpoint:
    """A checked GGUF file: `model`, `quant`, `hf_config`, the tensor types found, lazy conversion."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file.")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except ValueError as e:
            # the reader views each tensor's bytes in place: a view it cannot shape ran past the file's end
            problem = ("not a GGUF file (no GGUF magic)" if "magic" in str(e) else
                       "truncated: its tensor data ends before the tensor table says" if "reshape" in str(e) else
                       f"not a readable GGUF file ({e})")
            raise CheckpointError(f"{self.path}: {problem}; it is truncated or corrupt: download it again.") from None
        except Exception as e:  # numpy raises IndexError/TypeError/OverflowError on a cut or garbled header
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e}); it is "
                                  f"truncated or corrupt: download it again.") from None
        fields = {k: _field_value(f) for k, f in self.reader.fields.items()}
        self.meta = GGUFMeta(fields, str(self.path))
        self.hf_config = hf_config_from_gguf(self.meta)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._fill_vocab()
        self.model = ModelConfig.from_hf(self.hf_config, str(self.path))
        if "rope_freqs.weight" in self.tensors:
            self._read_rope_freqs()
        self._check_tensors()
        linear_types = {self._kind(n) for n in self._linear_names()}
        group = GGUF_GROUP_SIZE if linear_types & set(W4_TYPES) else default_weight_group_size(self.model)
        self.quant = QuantConfig(4, group, "gguf", True)

    def _gguf(self, name: str) -> str:
        return gguf_name(name, self.meta.arch)

    # -- checks, before any weight is read --------------------------------------------------------
    def _fill_vocab(self) -> None:
        """The vocabulary is the embedding's row count; a header that says otherwise is refused."""
        embed = self.tensors.get("token_embd.weight")
        if embed is None:
            raise CheckpointError(f"{self.path}: no token_embd.weight tensor; the file is incomplete.")
        rows = int(embed.shape[1])
        if self.hf_config.setdefault("vocab_size", rows) != rows:
            raise CheckpointError(f"{self.path}: token_embd.weight has {rows:,} rows but the metadata says "
                                  f"vocab_size {self.hf_config['vocab_size']:,}; the file is inconsistent.")
        self.hf_config["tie_word_embeddings"] = "output.weight" not in self.tensors

    def _read_rope_freqs(self) -> None:
        """Llama 3.1+ GGUFs carry their RoPE scaling as a tensor of per-frequency divisors, not as metadata:
        the scaling (of the published Llama 3 parameters) that reproduces it is the model's, else refused."""
        import gguf

        from ...kernels.rope import inverse_frequencies

        t = self.tensors["rope_freqs.weight"]
        divisors = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        plain = inverse_frequencies(self.model)
        for factor in _LLAMA3_FACTORS:
            scaling = RopeScaling(factor=factor, original_max_position_embeddings=_LLAMA3_ORIGINAL,
                                  low_freq_factor=1.0, high_freq_factor=4.0)
            scaled = dataclasses.replace(self.model, rope_scaling=scaling)
            if divisors.shape == plain.shape and torch.allclose(plain / inverse_frequencies(scaled), divisors,
                                                                rtol=1e-4):
                self.model = scaled
                self.hf_config["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(scaling)}
                return
        raise CheckpointError(f"{self.path}: rope_freqs.weight matches no Llama 3 RoPE scaling bie-trt knows "
                              f"(factor {' or '.join(map(str, _LLAMA3_FACTORS))} over {_LLAMA3_ORIGINAL:,} positions, "
                              f"frequency factors 1 and 4).")

    def _linear_names(self) -> list[str]:
        return [f"model.layers.{i}.{sub}.weight" for i in range(self.model.num_layers)
                for sub in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> [out, in] (nn.Linear orientation) of every tensor the engine reads."""
        m = self.model
        lin = {"self_attn.q_proj": (m.q_size, m.hidden_size), "self_attn.k_proj": (m.kv_size, m.hidden_size),
               "self_attn.v_proj": (m.kv_size, m.hidden_size), "self_attn.o_proj": (m.hidden_size, m.q_size),
               "mlp.gate_proj": (m.intermediate_size, m.hidden_size),
               "mlp.up_proj": (m.intermediate_size, m.hidden_size),
               "mlp.down_proj": (m.hidden_size, m.intermediate_size)}
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m.vocab_size, m.hidden_size),
                                           "model.norm.weight": (m.hidden_size,)}
        if not m.tie_word_embeddings:
            out["lm_head.weight"] = (m.vocab_size, m.hidden_size)
        for i in range(m.num_layers):
            p = f"model.layers.{i}."
            out.update({p + sub + ".weight": shape for sub, shape in lin.items()})
            out.update({p + norm + ".weight": (m.hidden_size,) for norm in layer_norms(m).values()})
            if m.qkv_bias:
                for x, n in (("q", m.q_size), ("k", m.kv_size), ("v", m.kv_size)):
                    out[p + f"self_attn.{x}_proj.bias"] = (n,)
            if m.qk_norm:
                out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = (m.head_dim,)
        return out

    def _check_tensors(self) -> None:
        allowed = W4_TYPES + BLOCK_TYPES + FLOAT_TYPES
        for name, shape in self.expected_shapes().items():
            t = self.tensors.get(self._gguf(name))
            if t is None:
                raise CheckpointError(f"{self.path}: tensor {self._gguf(name)!r} is missing (the metadata implies "
                                      f"shape {list(shape)}).")
            found = tuple(int(d) for d in reversed(t.shape.tolist()))   # GGUF lists dims innermost first
            if found != shape:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} has shape {list(found)} but the metadata "
                                      f"implies {list(shape)}; the file is inconsistent.")
            if t.tensor_type.name not in allowed:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} is {t.tensor_type.name}, a type bie-trt does "
                                      f"not convert (it reads {', '.join(allowed)}).")

    # -- what was found and how it is converted -----------------------------------------------------
    def tensor_types(self) -> dict[str, int]:
        """GGUF type -> how many of the tensors the engine reads have it."""
        return dict(sorted(Counter(self.tensors[self._gguf(n)].tensor_type.name
                                   for n in self.expected_shapes()).items()))

    def _kind(self, name: str) -> str:
        return self.tensors[self._gguf(name)].tensor_type.name

    def in_blocks(self, names: tuple[str, ...]) -> bool:
        """Whether the fused linear of these Hugging Face linears is kept in GGUF blocks: any part quantised
        in a format other than the engine's own W4 (a fused linear is one layout)."""
        return any(self._kind(n) in BLOCK_TYPES for n in names)

    def _fused_names(self) -> list[tuple[str, ...]]:
        return [tuple(f"model.layers.{i}.{part}.weight" for part in parts)
                for i in range(self.model.num_layers) for parts in FUSED.values()]

    def conversion(self, lm_head_dtype: str) -> dict[str, Any]:
        """The manifest's record of what was carried exactly and what was rounded, by GGUF type."""
        blocks, w4 = Counter(), Counter()
        for names in self._fused_names():
            (blocks if self.in_blocks(names) else w4).update(self._kind(n) for n in names)
        G = self.quant.group_size
        return {
            "file": self.path.name,
            "tensor_types": self.tensor_types(),
            "linear_exact": {k: v for k, v in sorted(w4.items()) if k in W4_TYPES},
            "linear_blocks": dict(sorted(blocks.items())),
            "linear_requantised": {k: v for k, v in sorted(w4.items()) if k not in W4_TYPES},
            "linear_bytes": self.linear_bytes,
            "weight_group_size": G,
            "embedding": f"{self._type(self.tensors['token_embd.weight'])} -> fp16",
            "lm_head": self._head_record(lm_head_dtype),
        }

    def _head_record(self, lm_head_dtype: str) -> str:
        kind = self._type(self.tensors[self._gguf(self.head_name)])
        if self.head_bytes is not None:
            return f"{kind} kept in its blocks"
        return f"{kind} -> {lm_head_dtype}" + (" (per-row scale)" if lm_head_dtype == "int8" else "")

    @staticmethod
    def _type(t: Any) -> str:
        return t.tensor_type.name

    # -- weights, one tensor per call ------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return self._gguf(name) in self.tensors

    def _rows(self, name: str, n: int) -> torch.Tensor | None:
        """The row order undoing llama.cpp's q/k interleave (Llama GGUFs only), or None."""
        if self.meta.arch != "llama":
            return None
        if name.endswith("q_proj.weight"):
            return _llama_rows(n, self.model.num_heads)
        if name.endswith("k_proj.weight"):
            return _llama_rows(n, self.model.num_kv_heads)
        return None

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` (Hugging Face naming) as float32, dequantised by the `gguf` package."""
        import gguf

        t = self.tensors[self._gguf(name)]
        # a copy: an F32 tensor dequantises to a read-only view of the memory-mapped file
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        if name.endswith("norm.weight") and self.meta.arch in _NORM_SHIFT:
            w -= _NORM_SHIFT[self.meta.arch]
        rows = self._rows(name, w.shape[0])
        return w if rows is None else w[rows]

    def w4(self, name: str) -> dict[str, torch.Tensor]:
        """A linear weight `name` in the runtime's W4 layout (w4_layout.py): Q4_0 blocks carried bit for bit,
        a float tensor rounded at the engine's group size."""
        t = self.tensors[self._gguf(name)]
        if t.tensor_type.name not in W4_TYPES:   # self.tensor puts the rows in order itself
            return awq_to_w4(*quantize_rtn(self.tensor(name).t().contiguous(), self.quant.group_size))
        out = _q4_0_w4(np.array(t.data), int(t.shape[1]))
        if (rows := self._rows(name, out["qweight"].shape[0])) is not None:
            out = {k: v[rows] for k, v in out.items()}
        return {k: v.contiguous() for k, v in out.items()}

    def blocks(self, name: str) -> BlockPart:
        """A linear weight `name` as the file stores it: its bytes, one row of blocks per output feature
        (a Llama's q/k rows put back in order: a row of blocks moves whole)."""
        t = self.tensors[self._gguf(name)]
        raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(int(t.shape[1]), -1))
        rows = self._rows(name, raw.shape[0])
        return BlockPart(t.tensor_type.name, (raw if rows is None else raw[rows]).contiguous())

    @property
    def head_name(self) -> str:
        return "model.embed_tokens.weight" if self.model.tie_word_embeddings else "lm_head.weight"

    @cached_property
    def head_bytes(self) -> int | None:
        """The head's bytes when the engine keeps it in the file's blocks (any quantised type), else None."""
        t = self.tensors[self._gguf(self.head_name)]
        return int(t.n_bytes) if t.tensor_type.name in W4_TYPES + BLOCK_TYPES else None

    @cached_property
    def linear_bytes(self) -> int:
        """What the engine's linears take, each as it is kept: the file's own bytes, or W4 at the group size."""
        total = 0
        for names in self._fused_names():
            for n in names:
                t = self.tensors[self._gguf(n)]
                out, k = (int(d) for d in reversed(t.shape.tolist()))
                total += int(t.n_bytes) if self.in_blocks(names) else awq_linear_bytes(k, out, self.quant.group_size)
        return total

    @cached_property
    def tokenizer(self):
        """The tokenizer (and chat template) from the file's metadata, through transformers' GGUF support."""
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except Exception as e:  # transformers raises many kinds; the file's tokenizer is what is wrong
            raise CheckpointError(f"{self.path}: its tokenizer does not load ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}).") from None

    def digest_files(self) -> list[Path]:
        return [self.path]
