"""eval: KV-cache quality (perplexity, KL divergence from FP16 KV)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from . import main


@main.command("eval")
@click.option("--engine", "engine_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--text", "text_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="UTF-8 text file to score.")
@click.option("--context", default=2048, show_default=True, type=int, help="Tokens per window.")
@click.option("--stride", type=int, help="Window step (default: --context, non-overlapping).")
@click.option("--kv-cache-dtype", type=click.Choice(["fp16", "fp8", "int4_asym"]),
              help="KV format to score against FP16 (default: the engine's).")
@click.option("--kv-rotation", type=click.Choice(["hadamard", "hadamard_kv", "none"]))
@click.option("--kv-key-centering", type=click.Choice(["on", "off"]),
              help="Subtract the engine's calibrated mean key before quantising.")
@click.option("--kv-window", type=int)
@click.option("--kv-sink-tokens", type=int)
@click.option("--kv-group-size", type=int)
@click.option("--chunk", type=int, help="Tokens per forward (default: one KV block, exactly decode-equivalent).")
@click.option("--max-windows", type=int, help="Score at most this many windows (quick runs).")
@click.option("--first-window", default=0, show_default=True, type=int,
              help="Skip this many windows (split one long evaluation across processes).")
@click.option("--ablations", is_flag=True, help="Score the whole quality table: fp8, int4 and each ingredient removed.")
@click.option("--json", "as_json", is_flag=True)
def eval_cmd(engine_dir: str, text_file: str, context: int, stride: int | None, kv_cache_dtype: str | None,
             kv_rotation: str | None, kv_key_centering: str | None, kv_window: int | None,
             kv_sink_tokens: int | None, kv_group_size: int | None,
             chunk: int | None, max_windows: int | None, first_window: int, ablations: bool, as_json: bool) -> None:
    """Perplexity over a text in windows of --context tokens, and the mean KL divergence of each
    position's next-token distribution from the FP16-KV run, scored the way decode sees the cache.

    \b
    Example (the quality table in docs/kv-cache-quality.md):
      bie-trt eval --engine engines/smollm2 --text ../shared/data/lee_background.txt \\
                   --context 2048 --ablations --json
    """
    from ..config import EngineConfig
    from ..engine_format import read_manifest
    from ..config import KVCacheConfig
    from ..evaluate import ablation_variants, evaluate
    from transformers import AutoTokenizer

    base = KVCacheConfig(**read_manifest(engine_dir)["kv"])
    overrides = EngineConfig(engine_dir=engine_dir, kv_cache_dtype=kv_cache_dtype, kv_rotation=kv_rotation,
                             kv_key_centering=None if kv_key_centering is None else kv_key_centering == "on",
                             kv_window=kv_window, kv_sink_tokens=kv_sink_tokens,
                             kv_group_size=kv_group_size).kv_overrides()
    chosen = dataclasses.replace(base, **overrides)
    variants = ablation_variants(chosen) if ablations else {chosen.dtype: chosen}
    ids = AutoTokenizer.from_pretrained(engine_dir)(Path(text_file).read_text())["input_ids"]
    results = evaluate(engine_dir, ids, context, variants, stride=stride, chunk=chunk, max_windows=max_windows,
                       first_window=first_window, progress=not as_json)
    base_ppl = results[0].ppl
    if as_json:
        rows = [dict(r.to_dict(), ppl_change_pct=100 * (r.ppl / base_ppl - 1)) for r in results]
        last = rows[-1]
        click.echo(json.dumps({**{k: last[k] for k in ("ppl", "kld", "tokens", "context", "kv")},
                               "fp16_ppl": base_ppl, "rows": rows}, indent=2))
        return
    click.echo(f"{'variant':<26}{'PPL':>10}{'Δ%':>9}{'KLD':>11}{'KV B/token':>12}")
    for r in results:
        click.echo(f"{r.label:<26}{r.ppl:>10.4f}{100 * (r.ppl / base_ppl - 1):>+9.3f}{r.kld:>11.5f}"
                   f"{r.kv_bytes_per_token:>12,}")
    click.echo(f"({results[0].tokens} tokens scored, context {context})")
