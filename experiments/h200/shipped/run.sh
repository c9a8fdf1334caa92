#!/usr/bin/env bash
# The studies behind the shipped sm_90a tables, on the H200, one device call per line
# (carry: [".gpu"]; each step's JSON lines land in $OUT):
#   bash experiments/h200/shipped/run.sh sweep 128x128,128x256 bfloat16
#   bash experiments/h200/shipped/run.sh sweep 64x64,256x256 bfloat16
set -uo pipefail
source .gpu/setup.sh
export PYTHONUNBUFFERED=1
case ${1:-} in
sweep)
    start=$(date +%s)
    name="sweep-${2//,/_}-$3"
    timeout "${SWEEP_S:-560}" python3 experiments/h200/shipped/sweep.py "$2" "$3" 2> "$OUT/$name.err" |
        tee "$OUT/$name.jsonl" | grep -v '"kind": "\(time\|probe\|check\)"'
    grep -c '"kind": "time"' "$OUT/$name.jsonl"
    tail -5 "$OUT/$name.err"
    echo "sweep: $(($(date +%s) - start)) s wall"
    ;;
*) echo "usage: run.sh sweep HEADS DTYPE" >&2 && exit 2 ;;
esac
