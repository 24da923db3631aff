"""quantize, build, inspect, verify, generate."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import click

from ..errors import EngineError, RequestError
from ..plan import AWQ_GROUP_SIZES
from ..profiles import profiles_epilog
from ..sampling_params import SamplingParams, StructuredOutputs, check_json_schema
from .group import main
from .options import (DRAFT_REQUEST_VOCAB_HELP, DRAFT_VOCAB_SIZE_HELP, NON_NEGATIVE, POSITIVE,
                      chat_template_kwargs_option, chat_template_option, device_option, host_kv_cache_option,
                      kv_options, speculative_config)

if TYPE_CHECKING:
    from ..config import KVCacheConfig
    from ..engine_format import Manifest
    from ..executor.outputs import RequestOutput


@main.command()
@click.option("--model", "src", required=True,
              help="HF checkpoint directory (fp16/bf16/fp32 safetensors) or a .gguf file.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory for the AWQ checkpoint.")
@click.option("--group-size", type=POSITIVE,
              help="Channels per quantisation group; must divide the hidden, intermediate and attention sizes. "
                   f"[default: the largest of {', '.join(map(str, AWQ_GROUP_SIZES))} that does]")
@click.option("--force", is_flag=True, help="Replace an existing, non-empty --out directory.")
def quantize(src: str, out: str, group_size: int | None, force: bool) -> None:
    """Round-to-nearest asymmetric 4-bit quantisation into AutoAWQ "gemm" format.

    For users without AutoAWQ: the result is a checkpoint `bie-trt build` accepts.
    (Real AWQ calibration gives better quality; RTN is the no-data baseline.)
    """
    from ..builder.checkpoint.quantize import quantize_checkpoint

    written = quantize_checkpoint(src, out, group_size, force=force)
    click.echo(f"wrote {written}")


@main.command(epilog=profiles_epilog())
@click.option("--checkpoint", required=True, metavar="DIR|NAME",
              help="AWQ checkpoint directory, a .gguf file (read directly), or a built-in name: smollm2-135m "
                   "(converted once, cached), smollm2-135m.gguf (its GGUF file, read directly).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Engine directory to write.")
@click.option("--profile", default="auto", show_default=True,
              help="Build profile (GPU) name; `auto` picks by this machine's GPU. The profiles are listed below.")
@click.option("--max-model-len", type=POSITIVE, help="Context length to plan for, in tokens. [default: the profile's]")
@kv_options("the profile's", build_defaults=True)
@click.option("--max-num-seqs", type=POSITIVE,
              help="Concurrent sequences the KV pool is sized for. [default: the profile's]")
@click.option("--chunked-prefill-size", type=POSITIVE,
              help="Prompt tokens per prefill step; bounds the activation workspace. [default: the profile's]")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True),
              help="Fraction of the profile's VRAM the plan may use. [default: the profile's]")
@click.option("--draft-checkpoint", metavar="DIR|NAME",
              help="A draft model for speculative decoding (AWQ checkpoint sharing the tokenizer), "
                   "written to draft/ in the engine.")
@click.option("--draft-vocab-size", type=POSITIVE, help=DRAFT_VOCAB_SIZE_HELP)
@click.option("--draft-window-tokens", type=POSITIVE, default=1024, show_default=True,
              help="Most recent tokens the draft's bounded cache keeps (besides its sinks).")
@click.option("--draft-request-vocab", type=click.IntRange(min=0), help=DRAFT_REQUEST_VOCAB_HELP)
@click.option("--state-snapshots", type=click.IntRange(min=0),
              help="Recurrent states a model with linear-attention layers (Qwen3.5) keeps on the device for prefix hits, "
                   "each a sequence's whole state (0: prefix caching off for it). [default: 2 per sequence]")
@click.option("--force", is_flag=True, help="Replace an existing engine directory.")
@speculative_config
def build(**kw) -> None:
    """Compile a checkpoint into an engine directory for one GPU profile.

    Validates the checkpoint and its tokenizer, solves the memory plan (refusing a configuration
    that does not fit before any heavy work), repacks the AWQ weights into the kernel layout,
    measures each layer's mean key on a fixed text (for KV key centering), and writes
    manifest.json with the sha256 of every file.
    """
    from ..builder.build import BuildOptions, build_engine

    build_engine(BuildOptions(**kw), log=lambda m: click.echo(m, err=True))


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(engine_dir: str, as_json: bool) -> None:
    """Summarise an engine directory: model, target GPU, KV format, memory plan."""
    from ..engine_format import read_manifest

    m = read_manifest(engine_dir)
    if as_json:   # as written (checked by reading it)
        click.echo(m.path.read_text().rstrip("\n"))
        return
    try:
        lines = _summary(engine_dir, m)
    except (KeyError, TypeError, ValueError) as e:   # the GGUF conversion record is read here only
        raise EngineError(f"{engine_dir}/manifest.json: malformed ({type(e).__name__}: {e}); "
                          f"rebuild the engine with `bie-trt build`.") from None
    click.echo("\n".join(lines))


def _kv_summary(kv: KVCacheConfig) -> str:
    """Only what applies: an fp16 cache has no groups, sinks, window or rotation."""
    if kv.dtype == "fp16":
        return f"fp16 (block {kv.block_size})"
    parts = [f"sinks {kv.sink_tokens}", f"window {kv.window}", f"rotation {kv.rotation}",
             f"key centering {'on' if kv.key_centering else 'off'}", f"key scale {'on' if kv.key_scale else 'off'}",
             f"block {kv.block_size}"]
    if kv.dtype == "int4_asym":
        parts.insert(0, f"group {kv.group_size}")
    return f"{kv.dtype} ({', '.join(parts)})"


def _kv_choice_lines(choice: Mapping[str, Any] | None) -> list[str]:
    """Why the build chose key centering and which layers' keys it scales, and the errors per layer it measured
    (builder/kv_choice.py)."""
    if not choice:
        return []
    lines = [f"  key centering {'on' if choice['key_centering'] else 'off'}: {choice['why']}"]
    if per_layer := choice.get("key_error_per_layer"):   # none where nothing was measured (keys of several shapes)
        lines += [f"  key error per layer ({choice['measured_format']}), without centering: "
                  + " ".join(f"{x:.2f}" for x in per_layer["without_centering"]),
                  "  with centering: " + " ".join(f"{x:.2f}" for x in per_layer["with_centering"])]
    if scale := choice.get("key_scale"):   # engines built before the key scale have no record of it
        lines.append(f"  key scale in layers {scale['layers'] or 'none'}: {scale['why']}")
        if "attention_error_per_layer" in scale:
            errors = scale["attention_error_per_layer"]   # None: a layer whose keys are not quantised

            def row(i: int) -> str:
                return " ".join("-" if e is None else f"{e[i]:.3f}" for e in errors)
            lines += ["  attention error per layer without the key scale: " + row(0), "  with it: " + row(1)]
    bound = choice.get("attention_bound")   # none before the check existed, or where nothing was measured
    if bound is not None and "format" in bound:
        worst = bound["worst"]
        lines.append(f"  attention error bound {bound['bound']}: " +
                     (f"met (worst {worst['attention_error']:.3f}, layer {worst['layer']})" if bound["met"]
                      else f"NOT met: {bound['why']}"))
    return lines


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _summary(engine_dir: str, m: Manifest) -> list[str]:
    c, plan, t = m.model, m.plan, m.target
    target = (f"{t.gpu} (profile {m.profile_name})" if t.sm == 0 else
              f"{t.gpu} (profile {m.profile_name}, SM {t.sm})")
    lines = [
        f"engine      {engine_dir}  (schema {m.schema_version}, bie-trt {m.bie_trt_version})",
        f"model       {m.model_name}: {c.architecture}, {c.num_layers} layers, hidden "
        f"{c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads, vocab {c.vocab_size}",
        f"target      {target}",
        f"context     {m.max_model_len} tokens x {m.max_num_seqs} sequences",
        f"kv cache    {_kv_summary(m.kv)}",
        *_kv_choice_lines(m.kv_choice),
        f"plan        {plan.total_bytes / 2**30:.2f} GiB of {plan.budget_bytes / 2**30:.2f} GiB budget",
    ]
    if m.source.gguf is not None:
        from ..builder.checkpoint.gguf_checkpoint import conversion_summary

        lines.append(f"gguf        {conversion_summary(m.source.gguf)}")
    # items this engine does not have (a tied head, CUDA graphs on the CPU) are left out
    lines += [f"  {name:<28} {_size(size):>12}" for name, size in plan.items if size]
    if m.w4_gemv_configs:
        lines.append(f"kernels     tuned and compiled for SM {t.sm}")
    if (d := m.draft) is not None:
        lines.append(f"draft       {d.name}: {d.config.num_layers} layers, head over {d.vocab_size:,} of "
                     f"{d.config.vocab_size:,} token ids + {d.request_vocab:,} of each request's own, "
                     f"cache {d.sink_tokens} sinks + {d.window:,} window")
    lines.append(f"files       {len(m.files)} (sha256 in manifest.json)")
    return lines


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--sm", type=POSITIVE, help="Check against this SM (e.g. 89) instead of the present GPU; CI uses this.")
def verify(engine_dir: str, sm: int | None) -> None:
    """Check the manifest, every file's sha256, that no file is unlisted, the schema version and
    the target GPU.

    \b
    Exit status: 0 the engine is intact, 1 a problem (each printed), 2 a bad command line.
    """
    from ..engine_format import verify_engine

    report = verify_engine(engine_dir, sm=sm)
    for n in report.notes:
        click.echo(f"note: {n}", err=True)
    for p in report.problems:
        click.echo(f"problem: {p}", err=True)
    click.echo("ok" if report.ok else "FAILED")
    sys.exit(0 if report.ok else 1)


def _structured_option(json_schema: str | None, regex: str | None) -> StructuredOutputs | None:
    """--json-schema FILE / --regex -> the constraint (checked before the engine loads)."""
    if json_schema and regex:
        raise RequestError("--json-schema and --regex both constrain the output; pass one of them.")
    if regex is not None:
        return StructuredOutputs(regex=regex)
    if json_schema is None:
        return None
    try:
        schema = json.loads(Path(json_schema).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise RequestError(f"--json-schema {json_schema}: cannot be read ({e}); pass a JSON Schema file.") from None
    except json.JSONDecodeError as e:
        raise RequestError(f"--json-schema {json_schema}: not JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                           f"pass a JSON Schema file.") from None
    try:
        return StructuredOutputs(json=check_json_schema(schema))
    except RequestError as e:
        raise RequestError(f"--json-schema {json_schema}: {e}") from None


_SAMPLING = SamplingParams.__dataclass_fields__   # one set of defaults: the SDK's (and the server's)


@main.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="Engine directory made by `bie-trt build`.")
@click.option("--prompt", required=True, help="Prompt text, tokenised exactly as tokenizer(prompt) does.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message with the chat template.")
@chat_template_option("The chat template used instead of the checkpoint's own (with --chat).")
@chat_template_kwargs_option
@click.option("--echo", is_flag=True, help="Print the prompt before the completion (JSON: text starts with it).")
@click.option("--max-tokens", default=_SAMPLING["max_tokens"].default, show_default=True, type=POSITIVE,
              help="Tokens to generate at most; the prompt plus these must fit the engine's context.")
@click.option("--temperature", default=_SAMPLING["temperature"].default, show_default=True,
              type=click.FloatRange(min=0), help="Softmax temperature; 0 is greedy.")
@click.option("--top-p", default=_SAMPLING["top_p"].default, show_default=True,
              type=click.FloatRange(0, 1, min_open=True), help="Nucleus sampling: keep the smallest set of "
              "tokens whose probability reaches this.")
@click.option("--top-k", default=_SAMPLING["top_k"].default, show_default=True, type=NON_NEGATIVE,
              help="Keep only the k most likely tokens; 0 disables.")
@click.option("--seed", type=int, help="Same seed, same tokens. [default: fresh entropy on every run]")
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False),
              help="A JSON Schema file: the output is a JSON value that validates against it.")
@click.option("--regex", help="A regular expression the whole output matches.")
@click.option("--min-tokens", default=0, show_default=True, type=NON_NEGATIVE,
              help="End-of-sequence is held back until this many tokens were generated.")
@device_option
@click.option("--skip-verify", is_flag=True,
              help="Do not check each file's sha256 against the manifest before loading (it is remembered "
                   "per file once checked, so only the first load after a change pays for it).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@host_kv_cache_option
@click.option("--load-cache", type=click.Path(exists=True, dir_okay=False),
              help="Before generating, load a KV cache file saved by this engine (--save-cache, or the server's "
                   "/v1/cache/save) for this prompt: its prefill becomes a copy.")
@click.option("--save-cache", type=click.Path(dir_okay=False),
              help="After generating, save the prompt's KV cache to this file (written atomically).")
@speculative_config
def generate(engine_dir: str, prompt: str, chat: bool, chat_template: str | None, chat_template_kwargs: dict | None,
             echo: bool, max_tokens: int,
             temperature: float, top_p: float, top_k: int, seed: int | None, json_schema: str | None,
             regex: str | None, min_tokens: int, device: str, skip_verify: bool, as_json: bool,
             host_kv_cache_gb: float | None, load_cache: str | None, save_cache: str | None, speculative) -> None:
    """Generate from an engine, streaming text to the terminal as it decodes.

    Sampling defaults are the SDK's and the server's /v1/completions' (OpenAI's): temperature 1, top-p 1,
    no top-k, 16 tokens, a fresh seed each run; pass --temperature 0 for greedy decoding.
    """
    from .. import BieEngine, EngineConfig

    if not prompt.strip():
        raise RequestError("--prompt is empty or only whitespace; give the text to continue or answer.")
    for flag, value in (("--chat-template", chat_template), ("--chat-template-kwargs", chat_template_kwargs)):
        if value is not None and not chat:
            raise click.UsageError(f"{flag} applies only with --chat (the prompt is otherwise tokenised as "
                                   f"plain text); add --chat or drop {flag}.")
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
                            min_tokens=min_tokens, structured_outputs=_structured_option(json_schema, regex))
    engine = BieEngine(EngineConfig(engine_dir=engine_dir, device=device, skip_verify=skip_verify,
                                    chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                                    speculative=speculative,
                                    host_kv_cache_gb=host_kv_cache_gb))
    prompt_ids = engine.encode(prompt, chat=chat)
    # a prompt that leaves no room at all gets the SDK's advice (shorten it, or rebuild) from stream() below
    if len(prompt_ids) < engine.max_model_len and len(prompt_ids) + max_tokens > engine.max_model_len:
        raise RequestError(f"the prompt ({len(prompt_ids)} tokens) plus --max-tokens {max_tokens} exceeds this "
                           f"engine's context of {engine.max_model_len} tokens; lower --max-tokens to at most "
                           f"{engine.max_model_len - len(prompt_ids)}.")
    if load_cache:
        loaded = engine.load_cache(load_cache, prompt_ids)
        click.echo(f"loaded {loaded['tokens']} cached prompt tokens from {load_cache}", err=True)
    start, out = time.perf_counter(), None
    events = engine.stream(prompt_ids, params)
    if echo and not as_json:
        click.echo(prompt, nl=False)
    for event in events:
        if not as_json:
            click.echo(event.delta, nl=False)
        out = event.output or out
    elapsed = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps({
            "text": (prompt if echo else "") + out.text, "token_ids": out.token_ids,
            "prompt_token_ids": out.prompt_token_ids,
            "finish_reason": out.finish_reason, "tokens_per_s": round(out.decode_tokens_per_s, 3),
            "time_to_first_token_s": round(out.time_to_first_token_s, 4), "elapsed_s": round(elapsed, 3),
            "usage": {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": out.usage.cached_tokens}},
            **({"spec_decode": out.spec_decode} if out.spec_decode is not None else {}),
            # a chat reply's <think> block, as the server's reasoning_content (null: none, or not split)
            **({"reasoning_content": engine.split_reasoning(prompt_ids, out.text)[0]}
               if chat and params.structured_outputs is None else {}),
        }))
    else:
        click.echo()
        click.echo(stats_line(out), err=True)
    if save_cache:
        saved = engine.save_cache(prompt_ids, save_cache)
        click.echo(f"saved {saved['tokens']} prompt tokens of KV cache to {save_cache} ({saved['bytes']:,} bytes)",
                   err=True)


def stats_line(out: RequestOutput) -> str:
    """What `generate` prints after the text: tokens, decode rate, speculation's acceptance, why it ended."""
    n = out.usage.completion_tokens
    parts = [f"{n} token{'' if n == 1 else 's'}"]
    if n > 1:   # a rate needs two tokens: the first one's time is the prompt's
        parts.append(f"{out.decode_tokens_per_s:.1f} tok/s")
    spec = out.spec_decode or {}
    if spec.get("num_draft_tokens"):
        parts.append(f"{spec['num_accepted_tokens']} of {spec['num_draft_tokens']} speculated tokens accepted")
    parts.append(f"finish: {out.finish_reason}")
    return f"[{', '.join(parts)}]"
