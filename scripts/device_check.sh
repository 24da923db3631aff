#!/usr/bin/env bash
# The one prepared GPU run (see the device tool's README): GPU tests, kernel benchmarks, decode
# benchmark; JSON and logs under $OUT (default: benchmarks/results/<date>-<gpu>). Budget ~8 minutes.
#   run on the lent machine:  bash scripts/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/$(date +%Y-%m-%d)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

# 1. correctness on the GPU: kernels vs their reference twins, CUDA-graph decode vs eager decode.
#    Not the slow tests: those force Triton onto CPU tensors, which needs the interpreter.
#    pytest-xdist (in the lent machine's image) spreads the Triton compiles over 8 processes.
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" $XDIST \
    tests/test_triton_attention.py tests/test_triton_w4.py tests/test_triton_ops.py tests/test_decode_graphs.py \
    2>&1 | tail -30 | tee "$OUT/gpu_tests.log"

# 2. kernels at Llama-3-8B shapes (µs, GB/s, roofline fraction), then decode and prefill
timeout 200 python3 scripts/bench_kernels.py --out "$OUT/kernels.json" 2>&1 | tail -40 | tee "$OUT/kernels.log"
timeout 200 python3 scripts/bench_decode.py --out "$OUT/decode.json" 2>&1 | tail -20 | tee "$OUT/decode.log"
ls -la "$OUT"
