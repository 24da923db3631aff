"""inspect-cache: what a KV cache directory (--kv-cache-dir) holds."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import click

from .group import main


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


@main.command("inspect-cache")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the listing as JSON.")
def inspect_cache(directory: str, as_json: bool) -> None:
    """List a KV cache directory: each engine's persisted prefix blocks (the disk tier of `serve`) and the
    cache files saved there with POST /v1/cache/save. Reads the files' headers only."""
    from ..cache_tiers.disk_cache import describe

    listing = describe(Path(directory))
    if as_json:
        click.echo(json.dumps(listing, indent=2))
        return
    lines = [f"{listing['directory']}: {len(listing['engines'])} engine(s), {_size(listing['bytes'])} of prefix blocks"]
    for e in listing["engines"]:
        when = (datetime.datetime.fromtimestamp(e["last_used"]).isoformat(timespec="seconds")
                if e["last_used"] else "never")
        engine = (e["engine"] or "?")[:12]
        lines.append(f"  {e['directory']}  {e['model'] or '?'} (engine {engine}, KV {e['kv_dtype'] or '?'}): "
                     f"{e['blocks']} blocks, {e['tokens']:,} tokens, {_size(e['bytes'])}, last used {when}"
                     + (f", {e['unreadable']} unreadable (deleted when next looked up)" if e["unreadable"] else ""))
    for f in listing["saved_files"]:
        lines.append(f"  {f['file']}  saved cache file: {f['tokens']:,} tokens, {f['blocks']} blocks, "
                     f"{_size(f['bytes'])} (engine {(f['engine'] or '?')[:12]})")
    click.echo("\n".join(lines))
