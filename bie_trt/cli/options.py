"""Options several commands share, spelled and checked the same way everywhere."""
from __future__ import annotations

from typing import Callable

import click

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
    """The KV-cache format options of `build` (defaults: the profile's) and `eval` (the engine's)."""
    d = f"[default: {default_from}]"
    rotation_d, centering_d = ("[default: hadamard]", "[default: off]") if build_defaults else (d, d)
    options = [
        click.option("--kv-cache-dtype", type=click.Choice(KV_DTYPES),
                     help=f"Storage of the KV body; sinks and the recent window stay fp16. {d}"),
        click.option("--kv-group-size", type=click.Choice(KV_GROUP_SIZES),
                     help=f"INT4 KV channels per scale/zero group; must divide head_dim. {d}"),
        click.option("--kv-sink-tokens", type=NON_NEGATIVE, help=f"First tokens kept fp16 for the sequence's life. {d}"),
        click.option("--kv-window", type=NON_NEGATIVE, help=f"Most recent tokens kept fp16. {d}"),
        click.option("--kv-rotation", type=click.Choice(KV_ROTATIONS),
                     help="Hadamard-rotate keys (hadamard), keys and values (hadamard_kv), or nothing (none) "
                          f"before quantising; tames outlier channels. {rotation_d}"),
        click.option("--kv-key-centering/--no-kv-key-centering", default=None,
                     help="Subtract the calibrated mean key before quantising: exact for attention, lower KL "
                          f"divergence, not lower perplexity (docs/kv-cache-quality.md). {centering_d}"),
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
