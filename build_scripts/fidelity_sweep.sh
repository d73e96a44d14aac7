#!/usr/bin/env bash
# Fidelity of every policy at budgets 128/256/512 on SmolLM2 (docs/benchmarks.md, "Fidelity").
# Usage: build_scripts/fidelity_sweep.sh [OUT_DIR] [LIMIT] [MAX_TOKENS]
set -euo pipefail
OUT=${1:-results/fidelity-smollm2}
LIMIT=${2:-4}
TOKENS=${3:-1024}
T=${TRTKV:-trtkv}
E=engines/fidelity
mkdir -p "$E"
build() {  # name policy [args...]
  local name=$1; shift
  [ -f "$E/$name/engine.json" ] || $T build --model smollm2-135m "$@" --out "$E/$name" >/dev/null
  ENGINES+=("$E/$name")
}
ENGINES=()
build full-fp16 --policy full --set kv_format=fp16
build kivi-4 --policy kivi --set bits=4
build kivi-2 --policy kivi --set bits=2
build thinkv-tbq --policy thinkv-tbq
for b in 128 256 512; do
  build streamingllm-$b --policy streamingllm --budget $b --set kv_format=fp16
  build h2o-$b          --policy h2o --budget $b --set kv_format=fp16
  build tova-$b         --policy tova --budget $b --set kv_format=fp16
  build snapkv-$b       --policy snapkv --budget $b --set kv_format=fp16 --set decode_every=32
  build rkv-$b          --policy rkv --budget $b --set kv_format=fp16
  build lazyeviction-$b --policy lazyeviction --budget $b --set kv_format=fp16
  build ams-$b          --policy ams --budget $b --set kv_format=fp16 --set interval=128
  build thinkv-tbe-$b   --policy thinkv-tbe --budget $b
  build thinkv-$b       --policy thinkv --budget $b
done
$T eval "${ENGINES[@]}" --task fidelity --limit "$LIMIT" --max-tokens "$TOKENS" --out "$OUT"
