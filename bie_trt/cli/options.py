"""Options several commands share, spelled and checked the same way everywhere."""
from __future__ import annotations

from typing import Callable

import click

from ..chat.reasoning import PARSERS
from ..chat.templates import parse_template_kwargs, read_chat_template, shipped_chat_templates
from ..config import KV_DTYPES, KV_ROTATIONS, SpeculativeConfig
from ..devices import DEVICE_HELP, check_device_name
from ..errors import BieError
from ..plan import (DEFAULT_DRAFT_HEAD_BYTES, DEFAULT_DRAFT_REQUEST_VOCAB, DEFAULT_HOST_CAP_BYTES, DEFAULT_HOST_FRACTION,
                    MIB)

POSITIVE = click.IntRange(min=1)
NON_NEGATIVE = click.IntRange(min=0)
KV_GROUP_SIZES = (32, 64, 128)


class DeviceType(click.ParamType):
    name = "auto|cpu|cuda|cuda:N"

    def convert(self, value, param, ctx):
        try:
            return check_device_name(str(value))
        except BieError as e:
            self.fail(str(e), param, ctx)


def device_option(f: Callable) -> Callable:
    return click.option("--device", default="auto", show_default=True, type=DeviceType(),
                        help=f"Where to run: {DEVICE_HELP}")(f)


def kv_options(default_from: str, build_defaults: bool) -> Callable[[Callable], Callable]:
    """The KV-cache format options of `build` and `plan` (defaults: the profile's) and `eval` (the engine's), read
    by every one of them through config.KVOverrides."""
    d = f"[default: {default_from}]"
    # Gemma 3 takes key centering and a 512-token window by default (config_gemma3.FAMILY.kv_defaults)
    window_d, rotation_d, centering_d, scale_d = (
        (f"[default: {default_from}; 512 for Gemma 3]", "[default: hadamard]",
         "[default: measured at build; on for Gemma 3]", "[default: measured at build, per layer]")
        if build_defaults else (d, d, d, d))
    options = [
        click.option("--kv-cache-dtype", type=click.Choice(KV_DTYPES),
                     help=f"Storage of the KV body; sinks and the recent window stay fp16. {d}"),
        click.option("--kv-group-size", type=click.Choice(KV_GROUP_SIZES),
                     help=f"INT4 KV channels per scale/zero group; must divide head_dim. {d}"),
        click.option("--kv-sink-tokens", type=NON_NEGATIVE, help=f"First tokens kept fp16 for the sequence's life. {d}"),
        click.option("--kv-window", type=NON_NEGATIVE, help=f"Most recent tokens kept fp16. {window_d}"),
        click.option("--kv-rotation", type=click.Choice(KV_ROTATIONS),
                     help="Hadamard-rotate keys (hadamard), keys and values (hadamard_kv), or nothing (none) "
                          f"before quantising; tames outlier channels. {rotation_d}"),
        click.option("--kv-key-centering/--no-kv-key-centering", default=None,
                     help="Subtract the calibrated pre-RoPE mean key from each key before RoPE, attention adding "
                          "its turned image back: exact for attention, and INT4/FP8 then spend their range on what "
                          "varies (Qwen2's k_proj bias, Gemma 3's k-normed keys) at every position "
                          f"(docs/kv-cache-quality.md). {centering_d}"),
        click.option("--kv-key-scale/--no-kv-key-scale", default=None,
                     help="Divide keys by a calibrated per-channel scale before quantising (queries multiplied by "
                          "it, so q·k is unchanged), in the layers where the build measured that it lowers the "
                          f"INT4 attention error (docs/kv-cache-quality.md). {scale_d}"),
    ]

    def apply(f: Callable) -> Callable:
        for option in reversed(options):
            f = option(f)
        return f

    return apply


def _parse_speculative(ctx: click.Context, param: click.Parameter, value: str | None) -> SpeculativeConfig | None:
    if value is None:
        return None
    try:
        return SpeculativeConfig.parse(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


speculative_config = click.option(
    "--speculative-config", "speculative", callback=_parse_speculative, metavar="JSON",
    help='Speculative decoding, as vLLM spells it: \'{"method": "ngram", "num_speculative_tokens": 5, '
         '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\', {"method": "draft_model"} or {"method": "none"}. '
         "[default: the engine's]")


host_kv_cache_option = click.option(
    "--host-kv-cache-gb", type=click.FloatRange(min=0), metavar="GIB",
    help="Host memory (GiB) for prefix-cache blocks evicted from the device, kept in their own layout (a "
         "quantised body as it is): a later request with the same prefix copies them back instead of "
         "recomputing them. 0 turns the host tier off. [default: "
         f"{DEFAULT_HOST_FRACTION:.0%} of the host memory available at start, at most "
         f"{DEFAULT_HOST_CAP_BYTES // 2**30} GiB]")


# The draft's vocabulary options of `build` and `plan`, which must state the same rule.
DRAFT_VOCAB_SIZE_HELP = (
    "Token ids the draft's head covers (K), as a row count: the K most frequent by the tokenizer's merge "
    "rank (the target still verifies over all). [default: the most frequent ids whose head weights fit "
    f"{DEFAULT_DRAFT_HEAD_BYTES // MIB} MiB (int8: hidden_size bytes a row, fp16: twice that), at most the "
    f"whole vocabulary: {DEFAULT_DRAFT_HEAD_BYTES // 2048:,} rows of a 2,048-wide int8 head (Llama-3.2-1B)]")
DRAFT_REQUEST_VOCAB_HELP = (
    "Head rows each sequence's draft gets for the ids of its own prompt and output outside the K "
    "(the most recently seen kept; 0: off; none when the K cover the vocabulary). "
    f"[default: {DEFAULT_DRAFT_REQUEST_VOCAB:,}]")


def _check_chat_template(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        read_chat_template(value)   # a missing file or a syntax error fails now, before the engine loads
    return value


def chat_template_option(help_text: str) -> Callable[[Callable], Callable]:
    return click.option("--chat-template", metavar="FILE|NAME", callback=_check_chat_template,
                        help=f"{help_text} A jinja2 file, or a shipped template by name: "
                             f"{', '.join(shipped_chat_templates())}.")


def _parse_template_kwargs(ctx: click.Context, param: click.Parameter, value: str | None) -> dict | None:
    if value is None:
        return None
    try:
        return parse_template_kwargs(value, "--chat-template-kwargs")
    except BieError as e:
        raise click.BadParameter(str(e).removeprefix("--chat-template-kwargs ")) from None


chat_template_kwargs_option = click.option(
    "--chat-template-kwargs", "chat_template_kwargs", callback=_parse_template_kwargs, metavar="JSON",
    help='Extra variables for the chat template, as vLLM spells them: \'{"enable_thinking": false}\' turns '
         "Qwen3's thinking off. [default: none]")


reasoning_parser_option = click.option(
    "--reasoning-parser", type=click.Choice(PARSERS), default="auto", show_default=True,
    help="Return a chat reply's <think> block apart from the answer, as message.reasoning_content (streamed "
         "as delta.reasoning_content). qwen3: the reply may open the block; deepseek_r1: the reply starts "
         "inside it; either way a prompt that ends inside an open block starts the reply inside it, and one "
         "that closed it (thinking switched off) is not split. auto: the one the model family declares (qwen3 "
         "for Qwen3.5), else the one the chat template declares: qwen3's when it mentions <think>, deepseek_r1's when it mentions only </think>, else none. The engine's thinking "
         "budgets find the block with the same parser.")
