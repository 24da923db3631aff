"""`bie-trt` command line. Each sub-module registers its commands on `main`."""
from __future__ import annotations

import sys

import click

from ..errors import BieError


class _Group(click.Group):
    """Print BieError as one clear line (exit 2) instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BieError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="bie-trt")
def main() -> None:
    """bie-trt: build 4-bit AWQ Llama-family checkpoints into per-GPU engines and serve them
    with a fixed memory plan (64k context in 8 GB).

    \b
    Typical flow:
      bie-trt build --checkpoint smollm2-135m --out engines/smollm2
      bie-trt generate --engine engines/smollm2 --prompt "The capital of France is"
      bie-trt run --engine engines/smollm2 --port 8080
    """


# Registration: importing a module adds its commands to `main`.
from . import eval_cmds, model_cmds, plan_cmds, serve_cmds  # noqa: E402,F401
