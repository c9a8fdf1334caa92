#!/usr/bin/env bash
# Fault injection on one H200 (issue 3), from the repo root on the device:
#   source .gpu/setup.sh && bash experiments/notebook/tuner_faults.sh
# Enqueued first: a config whose worker hangs, one whose worker segfaults, one that makes
# a real CUDA illegal memory access, and one the compiler rejects. The run is killed with
# SIGKILL mid-study, then resumed; tuner_faults_check.py verifies the outcome.
set -uo pipefail
OUT=${OUT:-experiments/notebook/faults}
mkdir -p "$OUT"
export DECAY_TUNER_STUDIES="$OUT/studies"
export DECAY_TUNER_INJECT="64/64/1/128/smem/1=hang,64/32/1/128/smem/1=segfault,64/64/2/128/smem/1=illegal_address"
DB="sqlite:///$OUT/faults.db"
args=(--dk 128 --dv 128 --storage "$DB" --study faults --trial-timeout 30 --no-progress
      --enqueue 64/64/1/128/smem --enqueue 64/32/1/128/smem --enqueue 64/64/2/128/smem --enqueue 32/32/2/128/regs)
setsid python3 -m tuner run "${args[@]}" --n-trials 40 > "$OUT/run1.log" 2>&1 &
pid=$!
python3 experiments/notebook/tuner_faults_check.py "$DB" wait 8 > "$OUT/before.json"   # >= 8 finished trials
kill -9 -- "-$pid"; wait "$pid"; echo "killed run 1 (exit $?)"
python3 -m tuner run "${args[@]}" --n-trials 6 > "$OUT/run2.log" 2>&1; echo "run 2 exit $?"
tail -3 "$OUT/run2.log"
python3 experiments/notebook/tuner_faults_check.py "$DB" check "$OUT/before.json" | tee "$OUT/check.json"
