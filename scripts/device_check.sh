#!/usr/bin/env bash
# The one prepared GPU run (see the device tool's README): GPU tests, kernel benchmarks, decode
# benchmark; JSON and logs under $OUT (default: benchmarks/results/<date>). At most 565 s (the
# steps' timeouts); each step's JSON is saved as it goes, so a step cut short keeps what it measured.
#   through the device tool:  run(command="bash scripts/device_check.sh", timeout_s=590)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/$(date +%Y-%m-%d)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

# 1. correctness on the GPU: kernels vs their reference twins, CUDA-graph decode vs eager decode, and a
#    GPU build whose engine carries every kernel the runtime then launches.
#    Not the slow tests: those force Triton onto CPU tensors, which needs the interpreter.
#    pytest-xdist (in the lent machine's image) spreads the Triton compiles over 8 processes.
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 190 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" $XDIST \
    tests/test_triton_attention.py tests/test_triton_w4.py tests/test_triton_ops.py tests/test_triton_int8.py \
    tests/test_decode_graphs.py \
    tests/test_kernel_cache.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -30

# 2. kernels at Llama-3-8B shapes (µs, GB/s, roofline fraction), then decode and prefill
# (timeouts sum to 565 s: the device tool kills a command at 600 s, and the lease is 15 min with the start)
timeout 130 python3 scripts/bench_kernels.py --no-attention --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -40
# attention: sweep partitions x tile_blocks x warps (INT4 decode sits at 230-255 registers, 2 programs
# an SM: is a smaller tile with more programs faster?), with short do_bench windows to fit
timeout 60 python3 scripts/bench_attention.py --tune --warmup 10 --rep 40 --out "$OUT/attention.json" 2>&1 \
    | tee -a "$OUT/kernels.log" | tail -12
# the INT4 nibbles converted without inline PTX, for comparison (and as the fallback should the PTX be wrong)
BIE_TRT_INT4_PTX=0 timeout 25 python3 scripts/bench_attention.py --kv int4_asym --contexts 65536 --warmup 10 --rep 40 \
    --out "$OUT/attention_noptx.json" 2>&1 | tee -a "$OUT/kernels.log" | tail -4
timeout 160 python3 scripts/bench_decode.py --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | tail -20
ls -la "$OUT"
