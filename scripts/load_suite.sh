#!/usr/bin/env bash
# `LLAMA_SERVER=PATH bash scripts/load_suite.sh OUT.jsonl [REF.json]` (after `specpilot fetch qwen-coder`): the
# serving benchmark of docs/RESULTS.md. The same load (scripts/load.py: coding_chat requests, 128 tokens, greedy,
# streamed, concurrency 1, 4 and 16) against `specpilot serve` on the loop's recipe and on plain decoding over
# the same blocks, then llama.cpp's llama-server on the same GGUF files, plain and with its draft model. Every
# server gets 16 slots (rows) and 1 thread. REF.json (scripts/load.py --make-reference) counts mismatches.
set -euo pipefail
cd "$(dirname "$0")/.."
out="$1"; ref="${2:-}"
T=$(.venv/bin/specpilot fetch qwen-coder --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["target"])')
D=$(.venv/bin/specpilot fetch qwen-coder --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["drafter"])')
LS="${LLAMA_SERVER:-llama-server}"
RECIPE="${RECIPE:-stock-gguf-q4}"
common=(--concurrency 1,4,16 --requests 8 --max-tokens 128 --json "$out" ${ref:+--reference "$ref"})
ours=".venv/bin/specpilot serve --target $T --drafter $D --threads 1 --max-batch 16 --max-model-len 1024"
.venv/bin/python scripts/load.py --serve "$ours --recipe $RECIPE --port 8431" --url http://127.0.0.1:8431/v1 \
  --name "specpilot $RECIPE" "${common[@]}"
.venv/bin/python scripts/load.py --serve "$ours --recipe ar+$RECIPE --port 8432" --url http://127.0.0.1:8432/v1 \
  --name "specpilot ar+$RECIPE" "${common[@]}"
llama="$LS -m $T -t 1 -tb 1 -np 16 -c 16384 --log-disable"
.venv/bin/python scripts/load.py --serve "$llama --port 8433" --url http://127.0.0.1:8433/v1 \
  --name "llama-server" "${common[@]}"
.venv/bin/python scripts/load.py --serve "$llama -md $D --spec-draft-n-max 4 --spec-draft-n-min 0 --draft-p-min 0.0 -td 1 -tbd 1 --port 8434" \
  --url http://127.0.0.1:8434/v1 --name "llama-server -md" "${common[@]}"
