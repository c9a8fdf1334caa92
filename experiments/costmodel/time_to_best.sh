#!/usr/bin/env bash
# A GPU `run` from a cold process at each bench shape (128/128, bf16, 24 trials, the
# predicted-first configs queued): how soon it is within 2 % of its final best. One device
# call (carry: [".gpu"]); the JSON lines land in $OUT/time_to_best.jsonl. Each shape starts
# with an empty TileLang cache (a new user's machine) unless WARM_CACHE=1.
set -uo pipefail
source .gpu/setup.sh
export PYTHONUNBUFFERED=1
storage="journal:$OUT/time_to_best.journal"  # not a .log: a log redirected to it would corrupt it
for shape in ${SHAPES:-8x16x4096 16x16x2048 4x16x8192 2x16x16384 1x8x32768}; do
    IFS=x read -r b h s <<< "$shape"
    [ "${WARM_CACHE:-0}" = 1 ] || export TILELANG_CACHE_DIR="$(mktemp -d)"
    start=$(date +%s.%N)
    timeout "${RUN_S:-240}" python3 -m tuner run --batch "$b" --heads "$h" --seqlen "$s" --dk 128 --dv 128 \
        --dtype "${DTYPE:-bfloat16}" --n-trials 24 --storage "$storage" --study "tb-$shape-${DTYPE:-bfloat16}" --no-progress \
        >> "$OUT/time_to_best.out" 2>&1
    python3 experiments/costmodel/time_to_best.py --storage "$storage" --study "tb-$shape-${DTYPE:-bfloat16}" \
        --start "$start" | tee -a "$OUT/time_to_best.jsonl"
done
