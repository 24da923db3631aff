"""The `bie-trt` command group: each command module registers its commands on `main`; a bad input exits
with one line."""
from __future__ import annotations

import json
import sys

import click

from ..errors import BieError

EXIT_ERROR = 2   # a bad input or option: one line naming the problem and the fix


class _Group(click.Group):
    """Print a BieError or a bad option as one clear line (exit 2) instead of a traceback or a usage
    block; when the command line asks for --json, as {"error": ...} on stdout so scripts can parse it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["json_errors"] = "--json" in args
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BieError as e:
            self._fail(ctx, str(e))
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else ctx.command_path
            self._fail(ctx, f"{e.format_message()} (see `{where} --help`)")
        except click.ClickException as e:   # e.g. a --text file that does not exist
            self._fail(ctx, e.format_message())

    @staticmethod
    def _fail(ctx: click.Context, message: str) -> None:
        if ctx.meta.get("json_errors"):
            click.echo(json.dumps({"error": message}))
        else:
            click.echo(f"error: {message}", err=True)
        sys.exit(EXIT_ERROR)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="bie-trt")
def main() -> None:
    """bie-trt: build 4-bit AWQ Llama-family checkpoints into per-GPU engines and serve them
    with a fixed memory plan (64k context in 8 GB).

    \b
    Typical flow (the bundled SmolLM2-135M, INT4 KV cache, on the CPU):
      bie-trt build --checkpoint smollm2-135m --kv-cache-dtype int4_asym --out engines/smollm2
      bie-trt generate --engine engines/smollm2 --prompt "The capital of France is" --temperature 0
      bie-trt serve --engine engines/smollm2 --port 8080
    """
