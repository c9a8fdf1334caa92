#!/usr/bin/env bash
# Issue 17 on two H200s of one host: `dispatch --gpus` over four shapes on a journal file,
# first with one worker, then with two, in the same session; wall times, both tables and
# both runs' trials to $OUT (8 files). From the repo root on the device (nvidia-h200-x2):
#   source .gpu/setup.sh && bash experiments/scaleout/run.sh
# Each run starts from nothing: its own journal, studies folder and TileLang cache (cold,
# so both pay the same compiles). The four shapes move the same bytes (B*H*S = 2^19), so
# whole shapes handed to two GPUs balance. ~4 min of the 2-GPU machine with 8 trials a shape.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-experiments/scaleout/out}
TRIALS=${TRIALS:-8}
SHAPES=${SHAPES:-8x16x4096,16x16x2048,4x16x8192,2x16x16384}
WORK=$(mktemp -d /tmp/scaleout.XXXXXX)
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.csv"
: > "$OUT/walls.jsonl"
for n in 1 2; do
    gpus=$(seq -s, 0 $((n - 1)))
    export DECAY_TUNER_STUDIES="$WORK/w$n" TILELANG_CACHE_DIR="$WORK/cache$n"
    start=$EPOCHREALTIME
    python3 -m tuner dispatch --gpus "$gpus" --shapes "$SHAPES" --n-trials "$TRIALS" \
        --storage "journal:$WORK/w$n/studies.journal" --out "$OUT/dispatch_w$n.json" \
        > "$OUT/dispatch_w$n.log" 2>&1
    rc=$?
    end=$EPOCHREALTIME
    echo "{\"workers\": $n, \"gpus\": \"$gpus\", \"rc\": $rc, \"trials_per_shape\": $TRIALS, \"wall_s\": $(python3 -c "print(round($end - $start, 1))")}" \
        | tee -a "$OUT/walls.jsonl"
done
python3 experiments/scaleout/summary.py "$OUT" "$WORK" | tee "$OUT/summary.txt"
