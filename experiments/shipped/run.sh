#!/usr/bin/env bash
# The studies behind the shipped sm_90a tables, on the H200, one device call per line
# (carry: [".gpu"]; each step's JSON lines land in $OUT):
#   bash experiments/shipped/run.sh sweep 128x128,128x256 bfloat16
#   bash experiments/shipped/run.sh sweep 64x64,256x256 bfloat16
#   bash experiments/shipped/run.sh outofbox bfloat16   (after table.py wrote the table)
#   bash experiments/shipped/run.sh sweep 128x128 bfloat16 1x8x256,4x8x8192   (other shapes)
set -uo pipefail
source .gpu/setup.sh
export PYTHONUNBUFFERED=1
case ${1:-} in
sweep)
    start=$(date +%s)
    name="sweep-${2//,/_}-$3${4:+-heldout}"
    timeout "${SWEEP_S:-560}" python3 experiments/shipped/sweep.py "$2" "$3" ${4:-} 2> "$OUT/$name.err" |
        tee "$OUT/$name.jsonl" | grep -v '"kind": "\(time\|probe\|check\)"'
    grep -c '"kind": "time"' "$OUT/$name.jsonl"
    tail -5 "$OUT/$name.err"
    echo "sweep: $(($(date +%s) - start)) s wall"
    ;;
outofbox)
    name="outofbox${3:+-$3}"
    timeout "${OUTOFBOX_S:-560}" python3 experiments/shipped/outofbox.py "${2:-bfloat16}" ${3:-} \
        2> "$OUT/$name.err" | tee "$OUT/$name.jsonl"
    tail -5 "$OUT/$name.err"
    ;;
*) echo "usage: run.sh sweep HEADS DTYPE [SHAPES] | outofbox [DTYPE [forward]]" >&2 && exit 2 ;;
esac
