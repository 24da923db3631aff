"""quantize, build, inspect, verify, generate."""
from __future__ import annotations

import json
import sys
import time

import click

from . import main

KV_DTYPE = click.Choice(["fp16", "fp8", "int4_asym"])


@main.command()
@click.option("--model", "src", required=True,
              help="HF checkpoint directory (fp16/bf16/fp32 safetensors) or a .gguf file.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory for the AWQ checkpoint.")
@click.option("--group-size", default=128, show_default=True, type=int,
              help="Channels per quantisation group; must divide hidden and intermediate sizes.")
def quantize(src: str, out: str, group_size: int) -> None:
    """Round-to-nearest asymmetric 4-bit quantisation into AutoAWQ "gemm" format.

    For users without AutoAWQ: the result is a checkpoint `bie-trt build` accepts.
    (Real AWQ calibration gives better quality; RTN is the no-data baseline.)
    """
    from ..checkpoint.quantize import quantize_checkpoint

    click.echo(f"wrote {quantize_checkpoint(src, out, group_size)}")


@main.command()
@click.option("--checkpoint", required=True,
              help="AWQ checkpoint directory, or a built-in name: smollm2-135m.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Engine directory to write.")
@click.option("--profile", default="auto", show_default=True,
              help="Build profile (GPU) name; `auto` picks by this machine's GPU. See `bie-trt plan --help`.")
@click.option("--max-model-len", type=int, help="Context length to plan for (default: the profile's).")
@click.option("--kv-cache-dtype", type=KV_DTYPE, help="KV body format (default: the profile's).")
@click.option("--kv-group-size", type=int, help="INT4 KV channels per group (32, 64, 128).")
@click.option("--kv-sink-tokens", type=int, help="First tokens kept FP16 for the sequence's life.")
@click.option("--kv-window", type=int, help="Most recent tokens kept FP16.")
@click.option("--kv-rotation", type=click.Choice(["hadamard", "none"]), default="hadamard", show_default=True,
              help="Rotate keys before quantising them (tames outlier channels).")
@click.option("--kv-key-centering/--no-kv-key-centering", default=False, show_default=True,
              help="Subtract the calibrated mean key before quantising: exact for attention, lower KL "
                   "divergence, not lower perplexity (docs/kv-cache-quality.md).")
@click.option("--max-num-seqs", type=int, help="Concurrent sequences the KV pool is sized for.")
@click.option("--draft-checkpoint", metavar="DIR|NAME",
              help="A draft model for speculative decoding (AWQ checkpoint sharing the tokenizer), "
                   "written to draft/ in the engine.")
@click.option("--draft-vocab-size", type=int,
              help="Token ids the draft's head covers: the K most frequent by the tokenizer's merge rank "
                   "(the target still verifies over all). [default: 16384]")
@click.option("--draft-window-tokens", type=int, default=1024, show_default=True,
              help="Most recent tokens the draft's bounded cache keeps (besides its sinks).")
@click.option("--force", is_flag=True, help="Replace an existing engine directory.")
def build(**kw) -> None:
    """Compile a checkpoint into an engine directory for one GPU profile.

    Validates the checkpoint, solves the memory plan (refusing a configuration that does
    not fit before any heavy work), repacks the AWQ weights into the kernel layout, measures
    each layer's mean key on a fixed text (for KV key centering), and writes manifest.json
    with the sha256 of every file.
    """
    from ..build import BuildOptions, build_engine

    build_engine(BuildOptions(**kw), log=lambda m: click.echo(m, err=True))


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(engine_dir: str, as_json: bool) -> None:
    """Summarise an engine directory: model, target GPU, KV format, memory plan."""
    from ..engine_format import read_manifest

    m = read_manifest(engine_dir)
    if as_json:
        click.echo(json.dumps(m, indent=2))
        return
    c = m["model"]["config"]
    click.echo(f"engine      {engine_dir}  (schema {m['schema_version']}, bie-trt {m['bie_trt_version']})")
    click.echo(f"model       {m['model']['name']}: {c['architecture']}, {c['num_layers']} layers, hidden "
               f"{c['hidden_size']}, {c['num_heads']}/{c['num_kv_heads']} heads, vocab {c['vocab_size']}")
    click.echo(f"target      {m['target']['gpu']} (profile {m['profile']['name']}, SM {m['target']['sm']})")
    kv = m["kv"]
    click.echo(f"context     {m['max_model_len']} tokens x {m['max_num_seqs']} sequences")
    click.echo(f"kv cache    {kv['dtype']} (group {kv['group_size']}, sinks {kv['sink_tokens']}, "
               f"window {kv['window']}, rotation {kv['rotation']}, key centering "
               f"{'on' if kv['key_centering'] else 'off'}, block {kv['block_size']})")
    plan = m["plan"]
    click.echo(f"plan        {plan['total_bytes'] / 2**30:.2f} GiB of {plan['budget_bytes'] / 2**30:.2f} GiB budget")
    for item in plan["items"]:
        click.echo(f"  {item['name']:<28} {item['bytes'] / 2**20:10.1f} MiB")
    if "draft" in m:
        d = m["draft"]
        click.echo(f"draft       {d['name']}: {d['config']['num_layers']} layers, head over {d['vocab_size']:,} of "
                   f"{d['config']['vocab_size']:,} token ids, cache {d['sink_tokens']} sinks + {d['window']:,} window")
    click.echo(f"files       {len(m['files'])} (sha256 in manifest.json)")


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--sm", type=int, help="Check against this SM (e.g. 89) instead of the present GPU; CI uses this.")
def verify(engine_dir: str, sm: int | None) -> None:
    """Check every file's sha256, the schema version, and the target GPU. Exit 1 on a problem."""
    from ..engine_format import verify_engine

    report = verify_engine(engine_dir, sm=sm)
    for n in report.notes:
        click.echo(f"note: {n}", err=True)
    for p in report.problems:
        click.echo(f"problem: {p}", err=True)
    click.echo("ok" if report.ok else "FAILED")
    sys.exit(0 if report.ok else 1)


@main.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="Engine directory made by `bie-trt build`.")
@click.option("--prompt", required=True, help="Prompt text, tokenised exactly as tokenizer(prompt) does.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message with the chat template.")
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 disables.")
@click.option("--seed", type=int, help="Same seed, same tokens.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate(engine_dir: str, prompt: str, chat: bool, max_tokens: int, temperature: float, top_p: float,
             top_k: int, seed: int | None, device: str, as_json: bool) -> None:
    """Generate from an engine, streaming text to the terminal as it decodes."""
    from .. import BieEngine, EngineConfig, SamplingParams

    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed)
    engine = BieEngine(EngineConfig(engine_dir=engine_dir, device=device))
    start, out = time.perf_counter(), None
    for event in engine.stream(prompt, params, chat=chat):
        if not as_json:
            click.echo(event.delta, nl=False)
        out = event.output or out
    elapsed = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps({
            "text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
            "finish_reason": out.finish_reason, "tokens_per_s": round(out.decode_tokens_per_s, 3),
            "time_to_first_token_s": round(out.time_to_first_token_s, 4), "elapsed_s": round(elapsed, 3),
            "usage": {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens},
        }))
    else:
        click.echo()
        click.echo(f"[{out.usage.completion_tokens} tokens, {out.decode_tokens_per_s:.1f} tok/s, "
                   f"finish: {out.finish_reason}]", err=True)
