#!/usr/bin/env bash
# The tuner's acceptance run on one H200 (issue 3), from the repo root on the device:
#   source .gpu/setup.sh && bash experiments/notebook/tuner_acceptance.sh
# 1. the headline run exactly as README's first command runs it (TPE, defaults), timed;
# 2. the exhaustive grid over the same space, the yardstick;
# 3. the comparison, with both best configs timed again alternately in one process.
set -uo pipefail
OUT=${OUT:-experiments/notebook/tuner}
mkdir -p "$OUT"
export DECAY_TUNER_STUDIES="$OUT/studies"
DB="sqlite:///$OUT/acceptance.db"
start=$(date +%s)
python3 -m tuner run --dk 128 --dv 128 --storage "$DB" 2>&1 | tr '\r' '\n' | grep -v "^\s*$" | tail -4
echo "headline run: $(( $(date +%s) - start )) s wall"
start=$(date +%s)
python3 -m tuner run --dk 128 --dv 128 --storage "$DB" --study grid --sampler grid --n-trials 192 --no-progress 2>&1 | tail -3
echo "grid run: $(( $(date +%s) - start )) s wall"
python3 -m tuner compare --dk 128 --dv 128 --storage "$DB" --against grid --remeasure --out "$OUT/compare.json" | tail -30
