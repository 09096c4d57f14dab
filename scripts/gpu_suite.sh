#!/usr/bin/env bash
# The GPU suite under both of PyTorch's CUDA allocator backends: the default ("native") and cudaMallocAsync,
# which current ComfyUI selects on NVIDIA. Usage: scripts/gpu_suite.sh [LOG_DIR] [extra pytest args...]
# Wheels the machine lacks may be put in .whl/ (installed into /tmp/site, nothing else is touched).
set -uo pipefail
cd "$(dirname "$0")/.."
log_dir="${1:-/tmp/ernie-gpu-suite}"; shift || true
mkdir -p "$log_dir"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
for backend in native cudaMallocAsync; do
    echo "== backend:$backend"
    PYTORCH_CUDA_ALLOC_CONF="backend:$backend" python3 -m pytest -q -m gpu -p no:cacheprovider -rs "$@" \
        2>&1 | tee "$log_dir/gpu-$backend.log" | tail -n 25
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
