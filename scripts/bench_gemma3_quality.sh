#!/usr/bin/env bash
# Long-context quality of the real Gemma-3-270M (the built-in gemma3-270m) with FP16, FP8 and INT4 KV:
# perplexity and KL divergence from FP16 (`bie-trt eval`, one window of each context over the Python
# reference's text) and passkey recall at five depths (scripts/needle.py, same text as the haystack).
# One command; results in benchmarks/results/gemma3_*.json, the tables printed at the end.
#
#   bash scripts/bench_gemma3_quality.sh                      # 2k, 8k and 32k
#   CONTEXTS="2048" bash scripts/bench_gemma3_quality.sh      # what a CPU run fits in minutes
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
CONTEXTS=${CONTEXTS:-"2048 8192 32768"}
OUT=${OUT:-benchmarks/results}
ENGINE=${ENGINE:-engines/gemma3-270m-fp16kv}
PROFILE=${PROFILE:-cpu}
mkdir -p "$OUT"
if [ ! -f "$ENGINE/manifest.json" ]; then
    $PY -m bie_trt.cli build --checkpoint gemma3-270m --out "$ENGINE" --profile "$PROFILE" \
        --max-model-len 32768 --kv-cache-dtype fp16 --force
fi
for C in $CONTEXTS; do
    for KV in fp8 int4_asym; do   # each run scores FP16 KV too: the baseline of its Δ and KL divergence
        $PY -m bie_trt.cli eval --engine "$ENGINE" --text builtin:python-docs --context "$C" --max-windows 1 \
            --kv-cache-dtype "$KV" --json > "$OUT/gemma3_kv_ctx${C}_${KV}.json"
    done
    $PY scripts/needle.py --engine "$ENGINE" --context "$C" --trials 5 --ending recall --kv fp16,fp8,int4_asym \
        --filler builtin:python-docs --out "$OUT/gemma3_needle_ctx${C}.json"
done
for C in $CONTEXTS; do
    $PY scripts/kv_quality_table.py "$OUT/gemma3_kv_ctx${C}_fp8.json" "$OUT/gemma3_kv_ctx${C}_int4_asym.json"
    $PY -c "import json, sys; print('passkey', sys.argv[1], json.load(open(sys.argv[2]))['summary'])" \
        "$C" "$OUT/gemma3_needle_ctx${C}.json"
done
