#!/usr/bin/env bash
# Sets up what the tests need (CPU torch, the pack and its test extras) and runs the CPU test suite.
# GPU tests (-m gpu) run on a CUDA machine; ComfyUI and SGLang end-to-end tests run when
# ERNIE_COMFYUI_DIR / ERNIE_SGLANG_PYTHON point at those installs, and are skipped with a reason otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
exec python3 -m pytest -q -rs "$@"
