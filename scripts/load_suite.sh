#!/usr/bin/env bash
# `LLAMA_SERVER=PATH bash scripts/load_suite.sh OUT_DIR` (after `specpilot fetch qwen-coder`): the serving benchmark
# of docs/RESULTS.md. The same streamed load (scripts/load.py: coding_chat requests, 128 tokens, greedy, at
# concurrency 1, 4 and 16), plain and with a shared 200-token system prompt (workloads/system_prompt.txt), against
# `specpilot serve --numerics q8` on stock-gguf-b8 (the 0.5B drafter on its own blocks, in q8) under the budget
# batching policy and on plain decoding over the same blocks (16 rows, chunks of 512 tokens a step, the prefix
# cache), then llama.cpp's llama-server on the same GGUF files: plain, with its draft model (-md) and with
# --spec-type ngram-mod, `-np` equal to the concurrency and 1024 positions a slot. Every server gets 1 thread.
# Each output is compared with our own q8 plain decoding of the same request (written once per workload into
# OUT_DIR/ref-*.json). One JSON line per system, workload and level goes to OUT_DIR/load.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="$1"; mkdir -p "$dir"
PY="${PYTHON:-.venv/bin/python}"
SP="${SPECPILOT:-.venv/bin/specpilot}"
paths=$($SP fetch qwen-coder --json)
T=$(printf '%s' "$paths" | $PY -c 'import json,sys; print(json.load(sys.stdin)["target"])')
D=$(printf '%s' "$paths" | $PY -c 'import json,sys; print(json.load(sys.stdin)["drafter"])')
LS="${LLAMA_SERVER:-llama-server}"
RECIPE="${RECIPE:-stock-gguf-b8}"
LEVELS="${LEVELS:-1 4 16}"
$PY -c "import dataclasses as d, sys; from specpilot.core.recipe import builtin; r = builtin(sys.argv[1]);
print(d.replace(r, name=r.name + '-budget', batching=d.replace(r.batching, policy='budget')).to_toml())" "$RECIPE" \
  > "$dir/budget.toml"
ours="$SP serve --target $T --drafter $D --numerics q8 --threads 1 --max-batch 16 --max-model-len 1024"
llama="$LS -m $T -t 1 -tb 1 --log-disable"
for workload in plain system; do
  extra=(); [ "$workload" = system ] && extra=(--system workloads/system_prompt.txt)
  ref="$dir/ref-$workload.json"
  [ -f "$ref" ] || $PY scripts/load.py --make-reference "$T" --reference-numerics q8 --reference "$ref" \
    --requests 16 --max-tokens 128 "${extra[@]}"
  common=(--requests 8 --max-tokens 128 --json "$dir/load.jsonl" --reference "$ref" "${extra[@]}")
  for c in $LEVELS; do  # a fresh server per level, ours as the peer's: no level finds another's prompts cached
    $PY scripts/load.py --serve "$ours --recipe $dir/budget.toml --port 8431" --url http://127.0.0.1:8431/v1 \
      --name "specpilot q8 $RECIPE, budget policy" --concurrency "$c" "${common[@]}"
    $PY scripts/load.py --serve "$ours --recipe ar+$RECIPE --port 8432" --url http://127.0.0.1:8432/v1 \
      --name "specpilot q8 AR" --concurrency "$c" "${common[@]}"
    peer="$llama -np $c -c $((1024 * c)) --port 8433"
    $PY scripts/load.py --serve "$peer" --url http://127.0.0.1:8433/v1 --name "llama-server" --concurrency "$c" \
      "${common[@]}"
    $PY scripts/load.py --serve "$peer -md $D --spec-draft-n-max 4 --spec-draft-n-min 0 --draft-p-min 0.0 -td 1 -tbd 1" \
      --url http://127.0.0.1:8433/v1 --name "llama-server -md" --concurrency "$c" "${common[@]}"
    $PY scripts/load.py --serve "$peer --spec-type ngram-mod" --url http://127.0.0.1:8433/v1 \
      --name "llama-server ngram-mod" --concurrency "$c" "${common[@]}"
  done
done
