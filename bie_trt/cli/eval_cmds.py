"""eval: KV-cache quality (perplexity, KL divergence from FP16 KV)."""
from __future__ import annotations

import dataclasses
import json

import click

from ..eval_texts import BUILTIN_PREFIX, BUILTIN_TEXTS, load_eval_text, text_token_ids
from .group import main
from .options import NON_NEGATIVE, POSITIVE, kv_options


@main.command("eval")
@click.option("--engine", "engine_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="Engine directory made by `bie-trt build`; its model and tokenizer score the text.")
@click.option("--text", "text_file", default=BUILTIN_PREFIX + "python-docs", show_default=True,
              metavar="FILE|builtin:NAME",
              help="UTF-8 text file to score, or a text an installed package ships: "
                   + "; ".join(f"{BUILTIN_PREFIX}{name}: {what}" for name, what in BUILTIN_TEXTS.items()) + ".")
@click.option("--context", default=2048, show_default=True, type=POSITIVE, help="Tokens per window.")
@click.option("--stride", type=POSITIVE, help="Window step, at most --context. [default: --context, non-overlapping]")
@kv_options("the engine's", build_defaults=False)
@click.option("--max-windows", type=POSITIVE, help="Score at most this many windows (quick runs).")
@click.option("--first-window", default=0, show_default=True, type=NON_NEGATIVE,
              help="Skip this many windows (split one long evaluation across processes).")
@click.option("--ablations", is_flag=True, help="Score the whole quality table: fp8, int4 and each ingredient removed.")
@click.option("--reference", metavar="FILE.gguf",
              help="Score against this GGUF's own weights (or smollm2-135m.gguf, the bundled model's file) (dequantised by the gguf package, run by transformers "
                   "in fp32) instead of the engine with an FP16 cache: what the engine's conversion and cache cost.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def eval_cmd(engine_dir: str, text_file: str, context: int, stride: int | None, kv_cache_dtype: str | None,
             kv_group_size: int | None, kv_sink_tokens: int | None, kv_window: int | None, kv_rotation: str | None,
             kv_key_centering: bool | None, kv_key_scale: bool | None, max_windows: int | None, first_window: int,
             ablations: bool, reference: str | None, as_json: bool) -> None:
    """Perplexity over a text in windows of --context tokens, and the mean KL divergence of each
    position's next-token distribution from the FP16-KV run, scored the way decode sees the cache.

    Without a KV option the engine's own cache format is scored against FP16; an engine built
    with an FP16 cache is scored as INT4 (int4_asym), so the comparison always says something.
    With --reference FILE.gguf the baseline is that file's own model instead, and the engine is
    scored with an FP16 cache and with its own (or the chosen) cache format.

    \b
    Examples (the second scores the text of the quality table in docs/kv-cache-quality.md):
      bie-trt eval --engine engines/smollm2 --max-windows 1
      bie-trt eval --engine engines/smollm2 --text builtin:lee-background \\
                   --context 2048 --ablations --json
      bie-trt eval --engine engines/smollm2-gguf --reference smollm2-135m.gguf
    """
    from ..config import EngineConfig
    from ..engine_format import read_manifest
    from ..evaluate import ablation_variants, evaluate
    from ..resolve import resolve

    text = load_eval_text(text_file)
    manifest = read_manifest(engine_dir)
    if manifest.kv.dtype == "fp16" and kv_cache_dtype is None and reference is None:
        kv_cache_dtype = "int4_asym"   # FP16 against FP16 would measure nothing
    chosen = resolve(EngineConfig(engine_dir=engine_dir, kv_cache_dtype=kv_cache_dtype, kv_rotation=kv_rotation,
                                  kv_key_centering=kv_key_centering, kv_key_scale=kv_key_scale,
                                  kv_window=kv_window,
                                  kv_sink_tokens=kv_sink_tokens, kv_group_size=kv_group_size), manifest).kv
    variants = ablation_variants(chosen) if ablations else {chosen.dtype: chosen}
    against = None
    if reference is not None:
        from ..builder.eval_reference import gguf_reference

        from ..builder.checkpoint.registry import resolve_checkpoint

        path = resolve_checkpoint(reference)
        against = (f"reference {path.name}", gguf_reference(path, manifest.model))
        if chosen.dtype != "fp16":   # the weights' cost alone, then with the cache
            variants = {"engine, fp16 KV": dataclasses.replace(chosen, dtype="fp16"), **variants}
    ids = text_token_ids(engine_dir, text)
    results = evaluate(engine_dir, ids, context, variants, stride=stride, max_windows=max_windows,
                       first_window=first_window, progress=not as_json, reference=against)
    base_ppl = results[0].ppl
    if as_json:
        rows = [dict(r.to_dict(), ppl_change_pct=100 * (r.ppl / base_ppl - 1)) for r in results]
        last = rows[-1]
        click.echo(json.dumps({**{k: last[k] for k in ("ppl", "kld", "tokens", "context", "kv")},
                               "fp16_ppl": base_ppl, "baseline": results[0].label, "rows": rows}, indent=2))
        return
    width = max(26, max(len(r.label) for r in results) + 2)
    click.echo(f"{'variant':<{width}}{'PPL':>10}{'Δ%':>9}{'KLD':>11}{'KV B/token':>12}")
    for r in results:
        click.echo(f"{r.label:<{width}}{r.ppl:>10.4f}{100 * (r.ppl / base_ppl - 1):>+9.3f}{r.kld:>11.5f}"
                   f"{r.kv_bytes_per_token:>12,}")
    click.echo(f"({results[0].tokens} tokens scored, context {context})")
