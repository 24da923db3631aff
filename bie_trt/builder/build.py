"""`bie-trt build`: checkpoint -> validated, planned, repacked, deterministic engine directory."""
from __future__ import annotations

import dataclasses
import json
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .. import engine_format as ef
from ..chat.templates import has_chat_template, read_chat_template
from ..config import KVCacheConfig, KVOverrides, ModelConfig, SpeculativeConfig
from ..errors import BieError, CheckpointError, PlanError
from ..kernels.int8_rows import quantize_rows_int8
from ..kernels.kernel_cache import KERNELS_DIR, forget_compiled_kernels, triton_cache_at
from ..model.llama import LlamaModel, fused_linear_shapes
from ..plan import DEFAULT_DRAFT_WINDOW_TOKENS, MemoryPlan, check_draft_vocab, solve_plan
from ..profiles import BuildProfile, resolve_profile
from ..spec_decode.draft_vocab import RANKING, reduced_vocabulary
from .checkpoint.gguf_checkpoint import GGUFCheckpoint, conversion_summary
from .checkpoint.loader import FUSED, TOKENIZER_FILES, Checkpoint, layer_norms
from .checkpoint import gemma4_weights, qwen35_weights
from .checkpoint.qwen35_weights import DENSE_LINEARS, FP32_TENSORS, dense_w4
from .checkpoint.registry import resolve_checkpoint
from .checkpoint.tokenizer_match import check_same_tokenizer
from .engine_docs import render
from .fused_linears import fused_linear, gguf_head
from .kv_choice import check_attention_bound, choose_key_transforms, pre_rope_mean

if TYPE_CHECKING:
    from .key_centering import Calibration

EXTRA_TOKENIZER_FILES = ("special_tokens_map.json", "chat_template.jinja", "generation_config.json")
# Families whose layers go through the conversion the tests check against transformers (checkpoint/*_weights.py).
CONVERTED_LAYERS = {"qwen3_5": qwen35_weights.layer_weights, "gemma4": gemma4_weights.layer_weights}


@dataclass
class BuildOptions(KVOverrides):
    """What `bie-trt build` takes. Its KV options (KVOverrides) lay over the profile's format with the
    family's defaults; kv_key_centering None is measured at build (builder/kv_choice.py)."""

    checkpoint: str
    out: str
    profile: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    chunked_prefill_size: int | None = None
    gpu_memory_utilization: float | None = None
    force: bool = False
    # Speculative decoding's draft model (a checkpoint sharing the tokenizer), written to draft/.
    draft_checkpoint: str | None = None
    draft_vocab_size: int | None = None     # None: the rows that fit DEFAULT_DRAFT_HEAD_BYTES
    draft_request_vocab: int | None = None  # None: DEFAULT_DRAFT_REQUEST_VOCAB
    draft_window_tokens: int = DEFAULT_DRAFT_WINDOW_TOKENS
    speculative: SpeculativeConfig | None = None   # the engine's default speculation (None: off, or its draft)
    state_snapshots: int | None = None   # linear-attention layers' states kept for prefix hits (None: the plan's)


def resolve_kv(opts: BuildOptions, profile: BuildProfile, model: ModelConfig) -> KVCacheConfig:
    """The options given, else the model family's defaults, else the profile's (as `plan` prices it)."""
    return profile.defaults.build_kv(model, opts)


def open_checkpoint(name_or_path: str | Path, log: Callable[[str], None] = lambda m: None
                    ) -> Checkpoint | GGUFCheckpoint:
    """An AWQ checkpoint directory (or a built-in name), or a .gguf file read directly."""
    path = resolve_checkpoint(name_or_path, log=log)
    return GGUFCheckpoint(path) if path.suffix == ".gguf" else Checkpoint(path)


def _repack_converted_layer(ckpt: Checkpoint, i: int) -> dict[str, torch.Tensor]:
    """A Qwen3.5 or Gemma 4 layer through the conversion the tests check against transformers (CONVERTED_LAYERS):
    its AWQ linears repacked (Qwen3.5's in_proj_b / in_proj_a rounded to W4 here); floats in fp16 but Qwen3.5's
    decay's fp32."""
    def linear(name: str) -> dict[str, torch.Tensor]:
        if name.rsplit(".", 1)[-1] in DENSE_LINEARS:
            return dense_w4(ckpt.tensor(name + ".weight"), ckpt.quant.group_size)
        return ckpt.w4(name + ".weight")

    weights = CONVERTED_LAYERS[ckpt.model.family](ckpt.model, i, ckpt.tensor, linear)
    return {name: (t.float() if name.endswith(FP32_TENSORS) else t.half()) if t.is_floating_point() else t
            for name, t in weights.items()}


def _repack_layer(ckpt: Checkpoint | GGUFCheckpoint, i: int) -> dict[str, torch.Tensor]:
    m, p = ckpt.model, f"model.layers.{i}."
    if m.family in CONVERTED_LAYERS:
        return _repack_converted_layer(ckpt, i)
    out = {f"layers.{i}.{name}": ckpt.tensor(p + f"{hf}.weight").half() for name, hf in layer_norms(m).items()}
    for fused, parts in FUSED.items():
        out.update(fused_linear(ckpt, tuple(p + part + ".weight" for part in parts), f"layers.{i}.{fused}"))
    if m.qk_norm:
        for x in "qk":
            out[f"layers.{i}.{x}_norm"] = ckpt.tensor(p + f"self_attn.{x}_norm.weight").half()
    if m.qkv_bias:
        out[f"layers.{i}.qkv.bias"] = torch.cat(
            [ckpt.tensor(p + f"self_attn.{x}_proj.bias") for x in "qkv"]).half()
    return out


def _lm_head(ckpt: Checkpoint | GGUFCheckpoint, dtype: str, rows: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The output head in the plan's dtype; a tied fp16 head is the embedding itself (nothing stored).
    `rows`: only those vocabulary rows, in that order (a draft's reduced vocabulary). A GGUF's quantised
    head stays in the file's blocks (`gguf_head`)."""
    if rows is None and (blocks := gguf_head(ckpt)):
        return blocks
    tied = ckpt.model.tie_word_embeddings
    head = ckpt.tensor("model.embed_tokens.weight" if tied else "lm_head.weight")
    if rows is not None:
        head = head[torch.tensor(rows)]
    if dtype == "int8":
        q, scale = quantize_rows_int8(head)
        return {"lm_head.q": q, "lm_head.scale": scale}
    return {} if tied and rows is None else {"lm_head": head.half()}


def _model_weights(ckpt: Checkpoint | GGUFCheckpoint, lm_head_dtype: str, head_rows: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Every weight the runtime's LlamaModel loads, repacked."""
    weights = {"embed_tokens": ckpt.tensor("model.embed_tokens.weight").half(),
               "norm": ckpt.tensor("model.norm.weight").half()}
    weights.update({name: t.half() for name, t in gemma4_weights.model_tensors(ckpt.model, ckpt.tensor).items()})
    weights.update(_lm_head(ckpt, lm_head_dtype, head_rows))
    for i in tqdm(range(ckpt.model.num_layers), desc="repack", unit="layer"):
        weights.update(_repack_layer(ckpt, i))
    return weights


def calibrate_keys(model: ModelConfig, weights: dict[str, torch.Tensor], tokenizer_dir: Path) -> Calibration:
    """Every layer's post-RoPE queries, keys and values on a fixed text (builder/key_centering.py): the keys' mean
    is what key centering subtracts, and kv_choice.py measures from them whether to, and which layers' keys to
    scale. The repacked model runs once on the CPU in fp32: the same on every host.

    Memory stays near one layer's dequantised weights: none is kept once used, and the lm_head is
    left out (only the keys are wanted; the model then reuses the embedding as its head). Keeping
    them would need 4 bytes a parameter, 28 GB for an 8B."""
    from transformers import AutoTokenizer

    from .key_centering import calibration_ids, calibration_pass

    ids = calibration_ids(AutoTokenizer.from_pretrained(tokenizer_dir))
    body = {name: t for name, t in weights.items() if not name.startswith("lm_head")}
    return calibration_pass(LlamaModel(model, body, torch.device("cpu"), torch.float32, keep_dense=False), ids)


def _choose_key_transforms(m: ModelConfig, weights: dict[str, torch.Tensor], tokenizer_dir: Path, kv: KVCacheConfig,
                           opts: KVOverrides, max_len: int, log: Callable[[str], None]) -> tuple[KVCacheConfig, dict]:
    """The KV config with key centering and the key scale decided, and the manifest's record of why (the bound
    checked at positions up to `max_len`); the calibrated mean key and scale go into `weights`. A model whose
    layers' keys differ in shape (Gemma 4's 512-wide full heads beside 256-wide sliding ones) gets neither: the
    one [layers, KV heads, head dim] tensor each, calibrated through one pool of one width, cannot hold them (not
    measured; its INT4 cache rounds unscaled, uncentred keys)."""
    if not m.keys_share_one_shape:
        for given, option in ((opts.kv_key_centering, "--kv-key-centering"), (opts.kv_key_scale, "--kv-key-scale")):
            if given:
                raise BieError(f"{option} is not supported for {m.architecture}: its layers' keys differ in shape "
                               f"{m.cache_shape()} and {m.cache_shape(sliding=True)} (KV heads, head dim), and the "
                               f"calibrated tensor has one. Build without the option.")
        why = (f"the layers' keys differ in shape ({m.cache_shape()} and {m.cache_shape(sliding=True)} KV heads x "
               f"head dim), and the calibrated tensors have one; not measured")
        log(f"KV key centering and key scale off: {why}")
        return (dataclasses.replace(kv, key_centering=False, key_scale=False),
                {"key_centering": False, "why": why, "key_scale": {"layers": [], "why": why}})
    log("calibrating the KV key mean and scale (one forward pass over a fixed text)")
    calibration = calibrate_keys(m, weights, tokenizer_dir)
    mean = pre_rope_mean(calibration, m)
    weights["kv.key_mean"] = mean.half()
    stored = mean.half().float()   # decided against the stored (fp16) mean: the one the runtime subtracts
    chosen, key_scale, choice = choose_key_transforms(calibration, m, stored, kv, opts.kv_key_centering,
                                                      opts.kv_key_scale)
    weights["kv.key_scale"] = key_scale.half()
    log(f"KV key centering {'on' if chosen.key_centering else 'off'}: {choice['why']}")
    log(f"KV key scale {'on' if chosen.key_scale else 'off'} (layers {choice['key_scale']['layers']}): "
        f"{choice['key_scale']['why']}")
    choice["attention_bound"] = check_attention_bound(calibration, m, stored, kv, opts.kv_key_centering,
                                                      opts.kv_key_scale, choice, key_scale.half().float(), max_len)
    if not choice["attention_bound"]["met"]:
        log(f"warning: {choice['attention_bound']['why']}")
    return chosen, choice


def tune_kernels(model: ModelConfig, profile: BuildProfile, group_size: int) -> dict:
    """On the target GPU, time each kernel's candidate configs at this engine's shapes; the winners
    go into the manifest and `run` uses them. Elsewhere (CPU builds, another GPU) nothing is tuned."""
    if profile.is_cpu or ef.present_gpu_sm() != profile.sm:
        return {}
    from ..kernels.triton_w4 import tune_w4

    return {"w4_gemv": {name: tune_w4(1, n, k, "cuda", group_size)
                        for name, (n, k) in fused_linear_shapes(model).items()}}


def compile_kernels(engine_dir: Path) -> None:
    """Load the finished engine on this GPU with Triton's cache pointed into it; loading warms the
    runner up (`ModelRunner.warm_up`), which compiles each kernel its steps launch."""
    from ..config import EngineConfig
    from ..executor.model_runner import ModelRunner

    with triton_cache_at(engine_dir / KERNELS_DIR):
        forget_compiled_kernels()   # tuning compiled the GEMVs in this process: compile them again, here
        runner = ModelRunner(EngineConfig(engine_dir=str(engine_dir), device="cuda", skip_verify=True))
    del runner
    torch.cuda.empty_cache()


def _toolchain() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "triton"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "absent"
    return versions


def plan_for(ckpt: Checkpoint | GGUFCheckpoint, profile: BuildProfile, kv: KVCacheConfig, max_model_len: int,
             max_num_seqs: int, chunked_prefill_size: int | None = None,
             gpu_memory_utilization: float | None = None, draft: Checkpoint | None = None,
             opts: BuildOptions | None = None, num_speculative_tokens: int | None = None) -> MemoryPlan:
    extra = {"state_snapshots": opts.state_snapshots} if opts is not None else {}
    if draft is not None and opts is not None:
        extra |= dict(draft=draft.model, draft_vocab_size=opts.draft_vocab_size,
                     draft_request_vocab=opts.draft_request_vocab,
                     draft_window_tokens=opts.draft_window_tokens, draft_weight_group_size=draft.quant.group_size)
    return solve_plan(ckpt.model, profile, max_model_len=max_model_len, kv=kv, max_num_seqs=max_num_seqs,
                      chunked_prefill_size=chunked_prefill_size or profile.defaults.chunked_prefill_size,
                      weight_group_size=ckpt.quant.group_size, gpu_memory_utilization=gpu_memory_utilization,
                      linear_bytes=getattr(ckpt, "linear_bytes", None), lm_head_bytes=getattr(ckpt, "head_bytes", None),
                      num_speculative_tokens=num_speculative_tokens, **extra)


def build_speculation(speculative: SpeculativeConfig | None, has_draft: bool, profile: BuildProfile
                      ) -> SpeculativeConfig:
    """The engine's default speculation, which its plan holds room for: the one asked for, else its draft
    proposing the profile's num_speculative_tokens, else none."""
    if speculative is not None:
        return speculative
    if has_draft:
        return SpeculativeConfig("draft_model", num_speculative_tokens=profile.defaults.num_speculative_tokens)
    return SpeculativeConfig()


def check_tokenizer(ckpt: Checkpoint | GGUFCheckpoint) -> None:
    """Load the checkpoint's tokenizer now: a missing or broken one must stop the build before the
    repack and calibration, not after them."""
    from transformers import AutoTokenizer

    if isinstance(ckpt, GGUFCheckpoint):
        ckpt.tokenizer   # noqa: B018 (loading it is the check; the build saves this one)
        return
    path = ckpt.path
    try:
        AutoTokenizer.from_pretrained(path)
    except Exception as e:   # transformers raises many types (OSError, ValueError, ...) for one cause
        raise CheckpointError(f"{path}: its tokenizer does not load ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); the checkpoint needs tokenizer.json "
                              f"(or tokenizer.model) from its source.") from None


def open_draft(opts: BuildOptions, target: Checkpoint | GGUFCheckpoint) -> Checkpoint | None:
    """The draft checkpoint, validated against the target (tokenizer, vocabulary) before heavy work."""
    if opts.draft_checkpoint is None:
        return None
    if isinstance(target, GGUFCheckpoint) or str(opts.draft_checkpoint).endswith(".gguf"):
        raise CheckpointError("--draft-checkpoint with a GGUF target or draft is not supported yet; convert the "
                              "GGUF with `bie-trt quantize --model FILE.gguf --out DIR` and build from DIR.")
    draft = Checkpoint(resolve_checkpoint(opts.draft_checkpoint))
    if draft.model.linear_layers:   # the draft's runner keeps no recurrent state slots
        raise CheckpointError(f"{opts.draft_checkpoint}: a {draft.model.architecture} draft is not supported (its "
                              f"linear-attention layers need state slots the draft does not keep); draft with a "
                              f"model of attention layers only.")
    check_draft_vocab(draft.model.vocab_size, target.model.vocab_size)
    check_same_tokenizer(target.path, draft.path, draft.model.vocab_size)
    return draft


def write_draft(draft: Checkpoint, plan: MemoryPlan, out: Path, source: str) -> dict:
    """draft/: the draft's repacked weights (head over the reduced vocabulary), that vocabulary's
    ids and, when a request may add ids of its own, the full head (read into host memory);
    returns the manifest's "draft" entry."""
    inputs = plan.inputs
    v = draft.model.vocab_size
    ids = reduced_vocabulary(draft.path, v, inputs["draft_vocab_size"])
    out.mkdir()
    weights = _model_weights(draft, inputs["lm_head_dtype"], ids if len(ids) < v else None)
    save_file(weights, str(out / ef.WEIGHTS))
    (out / ef.DRAFT_VOCAB).write_text(json.dumps({"ranking": RANKING, "ids": ids}) + "\n")
    if inputs["draft_request_vocab"]:   # every row, stored even when tied: the runtime gathers from it
        save_file(_lm_head(draft, inputs["lm_head_dtype"], list(range(v))), str(out / ef.DRAFT_HEAD))
    return {
        "config": draft.model.to_dict(),
        "name": Path(str(source)).name,
        "source": {"checkpoint": str(source), "digest": ef.digest_files(draft.digest_files(), draft.path),
                   "weight_group_size": draft.quant.group_size},
        "vocab_size": len(ids),
        "vocab_ranking": RANKING,
        "request_vocab": inputs["draft_request_vocab"],
        "sink_tokens": inputs["draft_sink_tokens"],
        "window": inputs["draft_window_tokens"],
    }


def write_tokenizer(ckpt: Checkpoint | GGUFCheckpoint, out: Path) -> None:
    """The tokenizer files (and chat template) into the engine: copied, or saved from a GGUF's metadata."""
    if isinstance(ckpt, GGUFCheckpoint):
        ckpt.tokenizer.save_pretrained(out)
        return
    for f in TOKENIZER_FILES + EXTRA_TOKENIZER_FILES:
        if (ckpt.path / f).exists():
            shutil.copyfile(ckpt.path / f, out / f)


def build_engine(opts: BuildOptions, log: Callable[[str], None] = print) -> Path:
    out = Path(opts.out)
    if out.exists() and any(out.iterdir()) and not opts.force:
        raise BieError(f"{out} exists and is not empty; pass --force to replace it, or choose another --out.")
    ckpt = open_checkpoint(opts.checkpoint, log=log)
    profile, how = resolve_profile(opts.profile)
    log(f"profile: {profile.name} ({how})")
    kv = resolve_kv(opts, profile, ckpt.model)
    max_len = opts.max_model_len or min(profile.defaults.max_model_len, ckpt.model.max_positions)
    max_seqs = opts.max_num_seqs or profile.defaults.max_num_seqs
    chunk = opts.chunked_prefill_size or profile.defaults.chunked_prefill_size
    draft = open_draft(opts, ckpt)
    speculative = build_speculation(opts.speculative, draft is not None, profile)
    # refuse before any heavy work
    plan = plan_for(ckpt, profile, kv, max_len, max_seqs, chunk, opts.gpu_memory_utilization, draft, opts,
                    speculative.num_speculative_tokens if speculative.enabled else 0)
    if not plan.fits:
        raise PlanError(
            f"the memory plan does not fit {profile.name}:\n{plan.format_table()}\n"
            f"Largest max_model_len that fits: {plan.max_model_len_that_fits}. Use --max-model-len "
            f"{plan.max_model_len_that_fits} or a smaller KV format (--kv-cache-dtype int4_asym).")
    check_tokenizer(ckpt)
    source = {"checkpoint": str(opts.checkpoint), "weight_group_size": ckpt.quant.group_size}
    if isinstance(ckpt, GGUFCheckpoint):
        source["gguf"] = ckpt.conversion(plan.inputs["lm_head_dtype"])
        log(f"GGUF tensors: {conversion_summary(source['gguf'])}")

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build into a sibling temp dir and rename: a failed build leaves nothing half-written.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        m = ckpt.model
        weights = _model_weights(ckpt, plan.inputs["lm_head_dtype"])
        write_tokenizer(ckpt, tmp)
        fallback = m.declared.chat_template   # Gemma's: its GGUF releases carry none
        if fallback is not None and not has_chat_template(tmp):
            (tmp / "chat_template.jinja").write_text(read_chat_template(fallback))
        kv, kv_choice = _choose_key_transforms(m, weights, tmp, kv, opts, max_len, log)
        save_file(weights, str(tmp / ef.WEIGHTS))
        manifest = {
            "schema_version": ef.SCHEMA_VERSION,
            "bie_trt_version": ef.bie_trt_version(),
            "model": {"architecture": m.architecture, "config": m.to_dict(),
                      "name": Path(str(opts.checkpoint)).name},
            "source": {**source, "digest": ef.digest_files(ckpt.digest_files(), ckpt.path.parent
                                                            if ckpt.path.is_file() else ckpt.path)},
            "profile": profile.to_dict(),
            "target": {"gpu": profile.description, "sm": profile.sm},
            "kv": dataclasses.asdict(kv),
            "kv_choice": kv_choice,
            "max_model_len": max_len,
            "max_num_seqs": max_seqs,
            "chunked_prefill_size": chunk,
            **({"speculative": speculative.to_dict()} if speculative.enabled or opts.speculative else {}),
            "plan": plan.to_dict(),
            "kernels": tune_kernels(m, profile, ckpt.quant.group_size),
            "toolchain": _toolchain(),
        }
        if draft is not None:
            log("repacking the draft model")
            manifest["draft"] = write_draft(draft, plan, tmp / ef.DRAFT_DIR, opts.draft_checkpoint)
        (tmp / "README.md").write_text(render("engine_README.md.j2", manifest=manifest, plan=plan))
        ef.write_manifest(tmp, manifest)
        if manifest["kernels"]:   # tuned, so on the target GPU: compile every kernel into the engine too
            log("compiling the kernels into the engine (a warm-up of each step on this GPU)")
            compile_kernels(tmp)
            ef.write_manifest(tmp, manifest)   # again: the digests now cover kernels/
        (tmp / "build-info.json").write_text(json.dumps({"host": platform.node()}, indent=2) + "\n")
        ef.set_umask_permissions(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"engine written to {out} ({plan.total_bytes / 2**30:.2f} GiB planned of {plan.budget_bytes / 2**30:.2f} GiB)")
    return out
