"""Render the KV-cache quality table (markdown) from `bie-trt eval --ablations --json` outputs.

    python scripts/kv_quality_table.py benchmarks/results/kv_quality_ctx2048.json \
        benchmarks/results/kv_quality_ctx8192.json
    python scripts/kv_quality_table.py --pool RUN.json RUN2.json   # rows shared by runs, pooled
"""
from __future__ import annotations

import json
import math
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


def pooled(paths: list[str]) -> str:
    """Rows that several runs share (the same KV settings), pooled over all their scored tokens."""
    runs = [json.loads(open(p).read())["rows"] for p in paths]

    def key(row: dict) -> str:
        return json.dumps(row["kv"], sort_keys=True)

    out = ["| KV cache | tokens | PPL | Δ PPL | KLD vs FP16 |", "| --- | ---: | ---: | ---: | ---: |"]
    base_nll = None
    for first in runs[0]:
        rows = [next((x for x in run if key(x) == key(first)), None) for run in runs]
        if None in rows:
            continue
        n = sum(r["tokens"] for r in rows)
        nll = sum(math.log(r["ppl"]) * r["tokens"] for r in rows) / n
        kld = sum(r["kld"] * r["tokens"] for r in rows) / n
        base_nll = nll if base_nll is None else base_nll
        out.append(f"| {first['label']} | {n:,} | {math.exp(nll):.4f} | {100 * (math.exp(nll - base_nll) - 1):+.3f}% "
                   f"| {kld:.5f} |")
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1] == "--pool":
        print(pooled(sys.argv[2:]))
    else:
        print("\n\n".join(table(p) for p in sys.argv[1:]))
