"""Llama-family forward (Llama, Mistral, Qwen2, Qwen3, Gemma 3) over the paged KV cache, written against `kernels.ops`.

Gemma 3 is the same decoder with a few switches from its config: embeddings scaled, RMSNorm weights
(1 + w), a norm after attention and after the MLP too, GELU-tanh gating, its own softmax scale, sliding-window
layers with their own RoPE base, and logit soft-capping. Qwen3.5 too: (1 + w) norms, Gated DeltaNet layers
(model/gated_deltanet.py) in place of attention in most layers, and in the others a gate on the attention
output and RoPE over part of each head. Gemma 4 too: Gemma 3's switches with plain-weight norms, unit-RMS
values, wider full-layer heads (keys reused as values where set), KV-shared layers reading an earlier layer's
cache (model/shared_kv.py), per-layer embeddings (model/per_layer.py) and a scalar on each layer's output."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..config import KVCacheConfig, ModelConfig
from ..kernels import ops
from ..kernels.gguf_blocks import BlockWeight, from_tensors, is_stored
from ..kernels.int8_rows import Int8Rows
from ..kernels.key_offset import KeyOffset
from ..kernels.reference import QKNorm
from ..kernels.rope import Rope
from ..kernels.step_inputs import SeqInput, StepMetadata
from ..kv.pool import KVPools
from ..kv.rotation import rotate
from .gated_deltanet import LINEARS as DELTANET_LINEARS
from .gated_deltanet import DeltaNetWeights, deltanet_block, roll_back
from .linears import Linear, load_linear
from .per_layer import PerLayerEmbedding, PerLayerGate
from .shared_kv import shared_query, with_normed_values

LINEARS = ("qkv", "o", "gate_up", "down")


def fused_linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out features, in features) of each of a layer's fused linears, as stored in the engine."""
    # Qwen3.5's output gate: q_size more rows at the end of qkv
    q_rows = cfg.q_size * (2 if cfg.attn_output_gate else 1)
    return {"qkv": (q_rows + 2 * cfg.kv_size, cfg.hidden_size), "o": (cfg.hidden_size, cfg.q_size),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}


def rotates_keys(kv: KVCacheConfig) -> bool:
    """Keys are stored Hadamard-rotated whenever they may be quantised; FP16-only caches stay exact."""
    return kv.dtype != "fp16" and kv.rotation in ("hadamard", "hadamard_kv")


def centres_keys(kv: KVCacheConfig) -> bool:
    """The calibrated mean key is subtracted whenever keys may be quantised (builder/key_centering.py)."""
    return kv.dtype != "fp16" and kv.key_centering


def scales_keys(kv: KVCacheConfig) -> bool:
    """Keys divided by the calibrated per-channel scale (queries multiplied by it) whenever keys may be quantised
    (builder/kv_choice.py); a layer the build left unscaled stores ones."""
    return kv.dtype != "fp16" and kv.key_scale


def rotates_values(kv: KVCacheConfig) -> bool:
    """Values rotated too: attention then returns rotated outputs, rotated back (H is its own inverse)."""
    return kv.dtype != "fp16" and kv.rotation == "hadamard_kv"


@dataclass
class Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    linears: dict[str, Linear] = field(default_factory=dict)
    qk_norm: QKNorm | None = None   # Qwen3's and Gemma 3's per-head q/k RMSNorm (in the qkv epilogue)
    # Gemma 3's sandwich norms: the attention's and the MLP's output normalised before the residual add
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    deltanet: DeltaNetWeights | None = None   # a Qwen3.5 linear-attention layer's own tensors (in place of attention)
    per_layer: PerLayerGate | None = None     # Gemma 4: the layer's per-layer embedding gate
    scalar: torch.Tensor | None = None        # Gemma 4: the layer's output multiplied by it


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 embedding_on_host: bool = False, gemv_configs: dict[str, dict] | None = None,
                 keep_dense: bool = True):
        self.cfg, self.device, self.dtype = cfg, device, dtype

        def t(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            # Gemma's (1 + w), added in the activation dtype as transformers adds it in fp32 on the CPU
            return weights[name].to(device=device, dtype=dtype) + cfg.norm_offset if cfg.norm_offset else t(name)

        # On the host, only the gathered rows (2·hidden bytes a token) cross the bus each step.
        self.embed_on_host = embedding_on_host and device.type != "cpu"
        embed = weights["embed_tokens"]
        self.embed = (embed.half().pin_memory() if torch.cuda.is_available() else embed.half()) \
            if self.embed_on_host else t("embed_tokens")
        if is_stored(weights, "lm_head"):   # a GGUF's head in the file's own blocks
            self.lm_head: Int8Rows | BlockWeight | torch.Tensor = BlockWeight(
                from_tensors(weights, "lm_head", device), keep_dense=keep_dense)
        elif "lm_head.q" in weights:
            self.lm_head = Int8Rows(weights["lm_head.q"].to(device),
                                                             weights["lm_head.scale"].to(device))
        elif "lm_head" in weights:
            self.lm_head = t("lm_head")
        else:  # tied, fp16: share the table, or keep a device copy when the table lives on the host
            self.lm_head = embed.to(device=device, dtype=dtype) if self.embed_on_host else self.embed
        self.norm = norm("norm")
        self.key_mean = t("kv.key_mean") if "kv.key_mean" in weights else None   # [L, Hkv, D]
        self.key_scale = t("kv.key_scale") if "kv.key_scale" in weights else None   # [L, Hkv, D]
        # li -> the q [T, H, D] layer li attended with, when set (the build's calibration reads them)
        self.recorded_queries: dict[int, torch.Tensor] | None = None
        self.layers = []
        linear_attention = set(cfg.linear_layers)
        # a KV-shared layer (Gemma 4) reads an earlier layer's cache and writes none; decided once, not per step
        self.owns_cache = [cfg.kv_source(i) == i for i in range(cfg.num_layers)]
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            attends = i not in linear_attention
            lin = {name: load_linear(weights, p + name, device, dtype, (gemv_configs or {}).get(name), keep_dense)
                   for name in (LINEARS if attends else (*DELTANET_LINEARS, "gate_up", "down"))}
            # a KV-shared layer has a q norm only
            qk_norm = (QKNorm(norm(p + "q_norm"), norm(p + "k_norm") if self.owns_cache[i] else None,
                              cfg.rms_norm_eps) if cfg.qk_norm and attends else None)
            post = (norm(p + "post_attn_norm"), norm(p + "post_mlp_norm")) if cfg.sandwich_norms else (None, None)
            deltanet = None if attends else DeltaNetWeights.load(weights, p, device, dtype)
            gate = PerLayerGate.load(weights, p, device, dtype) if cfg.per_layer_input_size else None
            scalar = t(p + "layer_scalar") if p + "layer_scalar" in weights else None
            self.layers.append(Layer(norm(p + "attn_norm"), norm(p + "mlp_norm"), lin, qk_norm, *post, deltanet,
                                     gate, scalar))
        self.per_layer = (PerLayerEmbedding.load(cfg, weights, device, dtype, embedding_on_host)
                          if cfg.per_layer_input_size else None)
        self.rope = Rope(cfg, device)
        # Each layer's index inside its cache group (kv/pool.py, kv/recurrent.py): among the layers of its type.
        kinds = cfg.layer_types or ("full_attention",) * cfg.num_layers
        # A KV-shared layer (Gemma 4) has the index of the layer whose cache it reads.
        self.group_index = [kinds[:cfg.kv_source(i)].count(kinds[i]) for i in range(cfg.num_layers)]
        # Over a single pool (no sliding group: a dense model, Qwen3.5, any model's key calibration) every layer
        # owning a cache has its own index there; linear-attention and KV-shared layers own none.
        owners = [j for j in range(cfg.num_layers) if j not in linear_attention and self.owns_cache[j]]
        self.pool_index = [sum(j < cfg.kv_source(i) for j in owners) for i in range(cfg.num_layers)]
        # YaRN multiplies cos and sin by its attention factor; rotation is linear, so every q·k grows by the
        # factor squared: folded into the softmax scale, the same for the torch and Triton paths.
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5 * self.rope.attention_factor ** 2

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], pools: KVPools,
                quantise: list[tuple[int, int]] = ()) -> list[torch.Tensor]:
        """Returns each sequence's logits: [V] for its last token, or [T, V] when all_logits.

        `quantise` lists (FP16 block, quantised block) pairs that this step writes and some of its
        sequences read quantised (consecutive chunks of one text as sequences of one step): each
        layer quantises them between writing K/V and attention."""
        meta = self._step_meta(seqs, pools, quantise)
        ids = torch.cat([s.token_ids for s in seqs])
        logits = self.forward_hidden(self.embed_ids(ids), meta, pools, per_layer=self.per_layer_rows(ids))
        return [rows if s.all_logits else rows[0] for rows, s in zip(logits.split(meta.logit_counts), seqs)]

    @torch.inference_mode()
    def final_hidden(self, seqs: list[SeqInput], pools: KVPools,
                     quantise: list[tuple[int, int]] = ()) -> torch.Tensor:
        """The rows `forward` takes logits of, before the final norm, stacked [rows, H]: for heads
        other than the model's own, or the model's own a few rows at a time (`head_logits(rows)`: a
        [rows, V] logit matrix of a long text is gigabytes). `quantise` as in `forward`."""
        meta = self._step_meta(seqs, pools, quantise)
        ids = torch.cat([s.token_ids for s in seqs])
        return self.forward_hidden(self.embed_ids(ids), meta, pools, head=False, per_layer=self.per_layer_rows(ids))

    def per_layer_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Gemma 4's per-layer table rows of the step's tokens (gathered outside forward_hidden, as the token
        embedding is: the table may live in host memory, and a CUDA graph reads them from a static buffer);
        None for other models."""
        return self.per_layer.rows(ids) if self.per_layer is not None else None

    def _step_meta(self, seqs: list[SeqInput], pools: KVPools, quantise: list[tuple[int, int]]) -> StepMetadata:
        meta = StepMetadata.build(seqs, pools.cfg.block_size, self.device)
        meta.quantise = tuple(list(ids) for ids in zip(*quantise)) or None
        return meta

    def forward_hidden(self, h: torch.Tensor, meta: StepMetadata, pools: KVPools, head: bool = True,
                       per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """Embedded rows [T, H] -> logits of meta.logit_rows (without `head`: their last hidden state, before
        the final norm). Device work only (no host syncs in decode-only steps), so CUDA graphs can capture
        it; the embedding gather stays outside because its table may live in host memory. One function,
        not a body and a head around it: a caller frame holding `h` would keep the embedded rows alive
        through every layer. `per_layer`: Gemma 4's per-layer table rows of the tokens, gathered outside too
        (mixed here with the embedded rows)."""
        cfg = self.cfg
        if pools.sliding is not None and meta.sliding is None:
            raise ValueError("the sliding-window layers have a cache group of their own: every input needs its "
                             "sliding_table")
        if (per_layer is None) != (self.per_layer is None):
            raise ValueError("per-layer embeddings are given exactly when the model has them (Gemma 4's E models)")
        if per_layer is not None:
            per_layer = self.per_layer.mix(per_layer, h)
        # h is the residual stream: each linear that ends a sub-block adds into it, and the norm
        # in front of a sub-block is folded into the linear that starts it.
        for li, layer in enumerate(self.layers):
            if layer.deltanet is not None:
                h = deltanet_block(cfg, self.group_index[li], layer.deltanet, layer.linears, layer.attn_norm, h, meta,
                                   pools.recurrent)
            else:
                h = self._attention(li, layer, h, meta, pools)
            act = ops.norm_linear(h, layer.mlp_norm, cfg.rms_norm_eps, layer.linears["gate_up"], glu=cfg.hidden_act)
            h = self._residual(act, layer.linears["down"], h, layer.post_mlp_norm)
            if layer.per_layer is not None:
                h = layer.per_layer(h, per_layer[:, li], cfg.rms_norm_eps)
            if layer.scalar is not None:
                h = h * layer.scalar
        if meta.logit_rows.numel() != h.shape[0]:   # build() lists rows in order: as many means all of them
            h = h[meta.logit_rows]
        return self.head_logits(h).float() if head else h

    def roll_back_recurrent(self, pools: KVPools, slot: int, keep: int) -> None:
        """After a logged verify (SeqInput.log_state) of which only the first `keep` rows were accepted: the
        linear-attention layers' state of `slot` as after those rows (gated_deltanet.roll_back)."""
        for li, layer in enumerate(self.layers):
            if layer.deltanet is not None:
                roll_back(self.cfg, self.group_index[li], layer.deltanet, pools.recurrent, slot, keep)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_on_host:
            rows = self.embed[ids.cpu()].to(self.device, self.dtype, non_blocking=True)
        else:
            rows = F.embedding(ids.to(self.device), self.embed)
        return rows * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else rows

    def _residual(self, x: torch.Tensor, w: Linear, h: torch.Tensor, post_norm: torch.Tensor | None) -> torch.Tensor:
        """h + w4_linear(x) (one launch on the GPU), or with Gemma's sandwich norm h + norm(w4_linear(x))."""
        if post_norm is None:
            return ops.linear_residual(x, w, h)
        return h + ops.rms_norm(ops.w4_linear(x, w), post_norm, self.cfg.rms_norm_eps)[0]

    def head_logits(self, rows: torch.Tensor, head: Int8Rows | BlockWeight | torch.Tensor | None = None) -> torch.Tensor:
        """The final norm, then `head` (the model's own by default; any rows of it, in its dtype): one
        launch when the head is int8 (the norm rides in front)."""
        eps, head, cap = self.cfg.rms_norm_eps, self.lm_head if head is None else head, self.cfg.final_logit_softcapping
        if isinstance(head, Int8Rows):
            logits = ops.norm_int8_rows_linear(rows, self.norm, eps, head)
        elif isinstance(head, BlockWeight):
            logits = ops.block_linear(ops.rms_norm(rows, self.norm, eps)[0], head)
        else:
            logits = F.linear(ops.rms_norm(rows, self.norm, eps)[0], head)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _group(self, li: int, meta: StepMetadata, pools: KVPools) -> tuple[KVPools, int, StepMetadata]:
        """The cache group layer `li` reads and writes: its pools, its index in them, the step's metadata for
        its tables. One group (a dense model, or any model over a single pool) holds every layer."""
        if pools.sliding is None:
            return pools, self.pool_index[li], meta
        if self.rope.windows[li]:
            return pools.sliding, self.group_index[li], meta.sliding
        return pools, self.group_index[li], meta

    def _key_mean_of(self, li: int) -> torch.Tensor:
        """Layer li's pre-RoPE mean key [its KV heads, its head_dim] (stored padded to the widest layer's)."""
        return self.key_mean[li, :self.cfg.kv_heads_of(li), :self.cfg.head_dim_of(li)]

    def _key_scale_of(self, li: int) -> torch.Tensor:
        """Layer li's key scale [its KV heads, its head_dim] (the stored one is padded to the widest layer's)."""
        return self.key_scale[li, :self.cfg.kv_heads_of(li), :self.cfg.head_dim_of(li)]

    def _attention(self, li: int, layer: Layer, h: torch.Tensor, meta: StepMetadata, pools: KVPools) -> torch.Tensor:
        """h + o_proj(attention(norm(h))): the residual stream after the attention sub-block."""
        cfg = self.cfg
        pools, gi, meta = self._group(li, meta, pools)
        qkv = ops.norm_linear(h, layer.attn_norm, cfg.rms_norm_eps, layer.linears["qkv"])
        gate = None
        if cfg.attn_output_gate:   # Qwen3.5: qkv's last q_size columns gate the attention output
            qkv, gate = qkv[:, :-cfg.q_size].contiguous(), qkv[:, -cfg.q_size:]
        if not self.owns_cache[li]:   # Gemma 4's KV-shared layer: q only, reading the source layer's cache
            source = cfg.kv_source(li)
            q, offset = shared_query(qkv, cfg.num_heads, layer.qk_norm.q, cfg.rms_norm_eps, meta.rope_positions,
                                     self.rope.inv_freq_of(li), rotates_keys(pools.cfg),
                                     self._key_scale_of(source) if scales_keys(pools.cfg) else None,
                                     self._key_mean_of(source) if centres_keys(pools.cfg) else None)
        else:
            heads = cfg.kv_heads_of(li)
            if cfg.value_norm:
                qkv = with_normed_values(qkv, cfg.num_heads * cfg.head_dim_of(li), heads, cfg.head_dim_of(li),
                                         cfg.k_eq_v_at(li), cfg.rms_norm_eps)
            # The q/k head norms (Qwen3), RoPE, the calibrated key centering and key scale, and the Hadamard
            # rotation of q and k (v too with hadamard_kv), K/V into the FP16 tail: one launch (the runner checked
            # key_mean and key_scale exist).
            q, offset = ops.qkv_epilogue(qkv, cfg.num_heads, heads, meta.rope_positions, self.rope.inv_freq_of(li),
                                         self.key_mean[li] if centres_keys(pools.cfg) else None,
                                         rotates_keys(pools.cfg), rotates_values(pools.cfg), pools, gi,
                                         meta.slot_blocks, meta.slot_offsets, layer.qk_norm,
                                         self.key_scale[li] if scales_keys(pools.cfg) else None)
        if self.recorded_queries is not None:
            self.recorded_queries[li] = q.float()
        if meta.quantise and self.owns_cache[li]:
            ops.quantize_layer_blocks(pools, gi, *meta.quantise)
        window = self.rope.windows[li]
        if meta.all_decode:   # a decode-only step (the graphs'): no gather and scatter of rows
            out = ops.paged_decode_attention(q, pools, gi, meta.decode_tables, meta.decode_lens, self.scale, window,
                                             offset)
        elif meta.tiles is not None:   # short inputs (a verify): one launch, each through its own table
            out = ops.paged_tile_attention(q, pools, gi, meta.tiles, self.scale, window, offset)
        else:
            out = self._mixed_attention(gi, q, meta, pools, window, offset)
        if rotates_values(pools.cfg):
            out = rotate(out)
        out = out.flatten(1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self._residual(out, layer.linears["o"], h, layer.post_attn_norm)

    def _mixed_attention(self, gi: int, q: torch.Tensor, meta: StepMetadata, pools: KVPools,
                         window: int, offset: KeyOffset | None) -> torch.Tensor:
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            out[rows] = ops.paged_decode_attention(q[rows], pools, gi, meta.decode_tables, meta.decode_lens,
                                                   self.scale, window, offset.rows(rows) if offset is not None else None)
        chunks = ops.paged_prefill_attentions(q, pools, gi, meta, self.scale, window, offset)
        for (start, n, _), rows in zip(meta.prefills, chunks):
            out[start:start + n] = rows
        return out


def model_class(cfg: ModelConfig) -> type[LlamaModel]:
    """The class that runs `cfg`, as its family declares it (ModelFamily.model_class): every family the engine
    runs so far is the Llama decoder with its family's switches."""
    classes = {"LlamaModel": LlamaModel}
    name = cfg.declared.model_class
    if name not in classes:
        raise ValueError(f"{cfg.architecture}: its family declares model class {name!r}; this build has "
                         f"{sorted(classes)}.")
    return classes[name]
