"""Render the KV-cache quality table (markdown) from `bie-trt eval --ablations --json` outputs.

    python scripts/kv_quality_table.py benchmarks/results/kv_quality_ctx2048.json \
        benchmarks/results/kv_quality_ctx8192.json
"""
from __future__ import annotations

import json
import sys


def table(path: str) -> str:
    data = json.loads(open(path).read())
    rows = data["rows"]
    base = rows[0]
    out = [f"**Context {base['context']:,}** ({base['tokens']:,} tokens scored; FP16-KV perplexity {base['ppl']:.4f})", "",
           "| KV cache | PPL | Δ PPL | KLD vs FP16 | KV bytes/token |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['label']} | {r['ppl']:.4f} | {r['ppl_change_pct']:+.3f}% | {r['kld']:.5f} | "
                   f"{r['kv_bytes_per_token']:,} |")
    return "\n".join(out)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
