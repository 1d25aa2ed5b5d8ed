#!/usr/bin/env bash
# packed12 GPU check: the fused Triton dequantise-matmul against torch's bf16 matmul on Llama-8B-shaped
# matrices (rows 1, 8, 32, 64): correctness vs the reference, a small autotune, CUDA-event timings and a
# table printed last. Without a CUDA device it says so and exits 0. Runs from anywhere; uses the repo's
# .venv python when that one sees a GPU, else python3. Extra arguments go to kernels/bench/gpu.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

has_cuda() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

if ! command -v nvidia-smi >/dev/null 2>&1 && ! compgen -G "/dev/nvidia*" >/dev/null; then
    echo "no CUDA device: skipping packed12 GPU check"
    exit 0
fi
PY=""
for candidate in .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1 && has_cuda "$candidate"; then
        PY="$candidate"
        break
    fi
done
if [ -z "$PY" ]; then
    echo "no CUDA device: skipping packed12 GPU check"
    exit 0
fi

export PYTHONUNBUFFERED=1
exec timeout 290 "$PY" -m specpilot.kernels.bench.gpu "$@"
