#!/usr/bin/env bash
# The CPU numbers of docs/benchmarks.md ("ThinKV vs full", "NVFP4 storage", "in-place reuse vs compaction"):
# SmolLM2-135M engines measured side by side in one `trtkv bench` run.
# Usage: build_scripts/bench_cpu.sh [OUT_DIR] [GEN_LEN]
set -euo pipefail
OUT=${1:-results/bench-cpu-thinkv}
GEN=${2:-512}
T=${TRTKV:-trtkv}
E=engines/bench-cpu
build() {  # name policy [args...]
  local name=$1; shift
  $T build --model smollm2-135m "$@" --out "$E/$name" >/dev/null
  ENGINES+=("$E/$name")
}
ENGINES=()
build full-fp16       --policy full --set kv_format=fp16
build full-nvfp4      --policy full --set kv_format=nvfp4
build thinkv-256      --policy thinkv --budget 256
build thinkv-256-3types --policy thinkv --budget 256 --set thought_types=3
build thinkv-256-compact --policy thinkv --budget 256 --set eviction=compact
$T bench "${ENGINES[@]}" --batch-sizes 1,4 --prompt-len 128 --gen-len "$GEN" --repeat 1 --kv-memory 2GiB --out "$OUT"
