#!/usr/bin/env bash
# Reasoning-length fidelity grid (issue 18): policies x budgets 128/256/512 x storage fp16/INT4/NVFP4, plus
# ThinKV variants (paper default, INT4, measured formats), 2,048 forced tokens per trace on SmolLM2.
# Usage: build_scripts/fidelity_2k.sh [OUT_DIR] [N_TRACES] [MAX_TOKENS] [BUDGETS]
#   e.g. build_scripts/fidelity_2k.sh results/fidelity-2k 4 2048 "128 256 512"
# Traces: the thought-anchors traces at least MAX_TOKENS long, topped up with AReaL rollouts
# (results/traces-2k.jsonl). Attention recall is off (--recall-layers none) to keep the run CPU-sized.
set -euo pipefail
OUT=${1:-results/fidelity-2k}
N=${2:-4}
TOKENS=${3:-2048}
BUDGETS=${4:-"128 256 512"}
T=${TRTKV:-trtkv}
E=engines/fidelity-2k
DATA=${TRTKV_DATA_DIR:-/work/shared/data}
mkdir -p "$E" results
python - "$DATA" "$N" "$TOKENS" > results/traces-2k.jsonl <<'PY'
import json, sys
data, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = []
for name in ("r1distill_traces_thought_anchors.jsonl", "r1distill_traces_areal_pr1340.jsonl"):
    try:
        rows += [json.loads(x) for x in open(f"{data}/{name}")]
    except FileNotFoundError:
        pass
text = lambda r: r.get("reasoning") or r.get("completion") or ""
long = [r for r in rows if len(text(r)) >= 4 * tokens]  # ~4 characters per token: comfortably long enough
for r in long[:n]:
    print(json.dumps(r))
PY
build() {  # name policy [args...]
  local name=$1; shift
  [ -f "$E/$name/engine.json" ] || $T build --model smollm2-135m "$@" --out "$E/$name" >/dev/null
  ENGINES+=("$E/$name")
}
ENGINES=()
build kivi-4 --policy kivi --set bits=4
build thinkv-tbq --policy thinkv-tbq
for b in $BUDGETS; do
  for f in fp16 int4 nvfp4; do
    build streamingllm-$b-$f --policy streamingllm --budget $b --set kv_format=$f
    build h2o-$b-$f          --policy h2o --budget $b --set kv_format=$f
    build snapkv-$b-$f       --policy snapkv --budget $b --set kv_format=$f --set decode_every=32
    build rkv-$b-$f          --policy rkv --budget $b --set kv_format=$f
  done
  build thinkv-$b          --policy thinkv --budget $b                        # the shipped default (R4E4T2)
  build thinkv-$b-int4     --policy thinkv --budget $b --set precision=R4aE4aT4a
  build thinkv-$b-auto     --policy thinkv --budget $b --set precision=auto   # formats chosen by measurement
  build thinkv-$b-auto6    --policy thinkv --budget $b --set precision=auto --set avg_bits=6
done
$T eval "${ENGINES[@]}" --task fidelity --data results/traces-2k.jsonl --limit "$N" --max-tokens "$TOKENS" \
  --batch "$N" --recall-layers none --out "$OUT"
