#!/usr/bin/env bash
# Issue 16's last speed item on the H200: a dispatch table tuned at the bench's shapes,
# then the bench serving it (its "tuned" row is the table's pick), one step per device
# call, from the repo root (carry: [".gpu"]):
#   source .gpu/setup.sh && OUT=$OUT bash experiments/model/dispatch.sh dispatch
#   source .gpu/setup.sh && OUT=$OUT bash experiments/model/dispatch.sh bench DISPATCH_JSON
# (DISPATCH_JSON: the table the first call wrote, committed beside this script and carried.)
# The study's storage stays on the device: only the table and the logs come back.
set -uo pipefail
export PYTHONUNBUFFERED=1
SHAPES=8x16x4096,16x16x2048,4x16x8192,2x16x16384,1x8x32768  # the bench's default shapes
case ${1:-} in
dispatch)
    start=$(date +%s)
    timeout 540 python3 -m tuner dispatch --shapes "$SHAPES" --dtype float16 --n-trials 20 --timeout 80 \
        --storage "journal:/tmp/dispatch.journal" --out "$OUT/dispatch.json" --no-progress 2>&1 |
        tee "$OUT/dispatch.log" | grep -v WARNING | tail -15
    echo "dispatch: $(($(date +%s) - start)) s wall" | tee -a "$OUT/dispatch.log"
    ;;
bench)
    timeout 400 python3 -m tuner bench --shapes "$SHAPES" --dispatch "$2" --packed 64 --no-backward \
        --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -30
    ;;
*) echo "usage: dispatch.sh dispatch | bench DISPATCH_JSON" >&2 && exit 2 ;;
esac
