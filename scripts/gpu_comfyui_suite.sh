#!/usr/bin/env bash
# The pack inside a real ComfyUI on a CUDA GPU (tests/test_comfyui_gpu.py), in one command on a machine whose
# python3 already has CUDA torch. Nothing is downloaded: the Python packages that machine lacks come as wheels in
# .whl/ (installed with --no-deps into /tmp/site, put first on PYTHONPATH), and ComfyUI as the tarball
# .comfyui/comfyui.tar.gz (a ComfyUI v0.8.0 tree). Both are ignored by git and carried to the machine.
# Arguments go to pytest (-k to pick tests). Prints "GPU-SUITE {json}" measurement lines; the log goes to $OUT (when set) or /tmp.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site
COMFY_ROOT=/tmp/comfyui_tree
LOG_DIR="${OUT:-/tmp}"
[ -d .whl ] && [ -f .comfyui/comfyui.tar.gz ] || { echo "needs .whl/ and .comfyui/comfyui.tar.gz beside the repo" >&2; exit 2; }
python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$SITE" .whl/*.whl
rm -rf "$COMFY_ROOT" && mkdir -p "$COMFY_ROOT" && tar -xzf .comfyui/comfyui.tar.gz -C "$COMFY_ROOT"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export ERNIE_COMFYUI_DIR="$COMFY_ROOT/comfyui"
export ERNIE_COMFYUI_PYTHON="$(command -v python3)"
export ERNIE_GPU_MODELS_DIR="${ERNIE_GPU_MODELS_DIR:-/tmp/ernie_gpu_models}"
python3 -c "import torch, comfy_aimdo, diffusers, av, pytest_asyncio; assert torch.cuda.is_available(); print('torch', torch.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
df -h /tmp | tail -1
set +e
python3 -m pytest -q -s -rs -p no:cacheprovider --timeout 1200 tests/test_comfyui_gpu.py "$@" 2>&1 | tee "$LOG_DIR/gpu_comfyui_suite.log"
status=${PIPESTATUS[0]}
grep -h "^GPU-SUITE" "$LOG_DIR/gpu_comfyui_suite.log" > "$LOG_DIR/gpu_comfyui_measures.jsonl" || true
exit "$status"
