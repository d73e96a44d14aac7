#!/usr/bin/env bash
# Issue 14's done-when runs (docs/benchmarks.md, "Compressed caches at reasoning length"): SmolLM2-135M
# engines side by side in one `trtkv bench` run each.
#   long:  batch 16, 128-token prompts, 4,096 generated tokens (the KV cache, not the weights, dominates)
#   short: batch 1, 128-token prompts, 256 generated tokens, every storage format against fp16
# Usage: build_scripts/bench_long_cpu.sh [long|short|both] [OUT_DIR] [GEN_LEN]
set -euo pipefail
WHICH=${1:-both}
OUT=${2:-results/bench-long-cpu}
GEN=${3:-4096}
T=${TRTKV:-trtkv}
E=engines/bench-long
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
build() {  # name policy [args...]
  local name=$1; shift
  [ -f "$E/$name/engine.json" ] || $T build --model smollm2-135m "$@" --out "$E/$name" >/dev/null
  ENGINES+=("$E/$name")
}
if [ "$WHICH" != short ]; then
  ENGINES=()
  build full-fp16   --policy full --set kv_format=fp16
  build full-nvfp4  --policy full --set kv_format=nvfp4
  build thinkv-256  --policy thinkv --budget 256
  build h2o-256     --policy h2o --budget 256
  build tova-256    --policy tova --budget 256
  build rkv-256     --policy rkv --budget 256
  $T bench "${ENGINES[@]}" --batch-sizes 16 --prompt-len 128 --gen-len "$GEN" --repeat 1 --out "$OUT/long"
fi
if [ "$WHICH" != long ]; then
  ENGINES=()
  for f in fp16 fp32 bf16 fp8 nvfp4 nvfp4o int4 int2 ternary; do
    build "full-$f" --policy full --set kv_format=$f
  done
  $T bench "${ENGINES[@]}" --batch-sizes 1 --prompt-len 128 --gen-len 256 --repeat 2 --out "$OUT/short"
fi
