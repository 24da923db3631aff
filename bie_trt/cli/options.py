"""Options several commands share, defined once."""
from __future__ import annotations

import click

from ..config import SpeculativeConfig


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
