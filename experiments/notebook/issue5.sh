#!/usr/bin/env bash
# Issue 5 on one H200, from the repo root on the device, in seven stages (each under the
# device tool's 10-minute limit):
#   source .gpu/setup.sh && bash experiments/notebook/issue5.sh tests|dispatch|sweep|retune|bench|retable|seeds|oos
# tests:    the GPU tests of the sequence-split variant, the fp32-underflow fix, the
#           dispatch table end to end and the GPU study;
# dispatch: one TPE study per shape over both variants, then the dispatch table;
# sweep:    the same studies resumed with a grid of split configs enqueued;
# retune:   fresh TPE studies at the two small-B*H shapes (failures told as values);
# bench:    tuned (the dispatch table's pick), seed config, fla and torch, in one process.
# retable:  the table re-ranked with the current kernel over the sweep's best configs,
#           4x16x8192 added; then the bench on it.
# seeds:    fresh studies at the same four shapes with the default flags: the seed config
#           and the one-wave seeds (tuner.space.wave_seeds) first, 8 trials per shape.
# oos:      the one-wave seeds out of sample (shapes and head sizes the prior was not
#           drawn from): fresh 8-trial studies with the default flags, then the same
#           studies resumed with the 64/bDV/{2,3}/256/smem x segments ladder enqueued.
# Results land in experiments/notebook/issue5/; on the device they come back as $OUT/<stage>.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1
DEST=${DEST:-experiments/notebook/issue5}  # another folder for a later re-ranking
mkdir -p "$DEST"
export DECAY_TUNER_STUDIES="$DEST/studies"
SHAPES=8x16x4096,2x16x16384,1x8x32768
case "${1:?stage: tests, dispatch, sweep, retune, bench, retable, seeds or oos}" in
tests)
    python3 -m pytest -m gpu -q -p no:cacheprovider \
        "tests/test_kernel_gpu.py::test_sequence_split_variant_matches_c" \
        "tests/test_kernel_gpu.py::test_decay_underflowing_fp32_keeps_the_state_finite" \
        "tests/test_kernel_gpu.py::test_exported_config_loads_into_a_ready_kernel" \
        "tests/test_tuner.py::test_gpu_dispatch_end_to_end" \
        "tests/test_tuner.py::test_gpu_study_end_to_end" 2>&1 | tee "$DEST/gpu_tests.log" | tail -20
    ;;
dispatch)
    start=$(date +%s)
    python3 -m tuner dispatch --shapes "$SHAPES" --storage "sqlite:///$DEST/dispatch.db" \
        --n-trials 40 --timeout "${TIMEOUT:-120}" --enqueue 64/128/2/256/smem \
        --out "$DEST/dispatch.json" --no-progress 2>&1 | tee "$DEST/dispatch.log" | tail -12
    echo "dispatch: $(( $(date +%s) - start )) s wall" | tee -a "$DEST/dispatch.log"
    ;;
sweep)
    # The studies resumed with the split's main axes enqueued (segments x block_dv x
    # stages at 64-token chunks and 256 threads); the table is rewritten from all trials.
    ENQ=()
    for b in 64 128; do for st in 1 2; do for seg in 4 8 16 32 64; do
        ENQ+=(--enqueue "64/$b/$st/256/smem/$seg")
    done; done; done
    python3 -m tuner dispatch --shapes "$SHAPES" --storage "sqlite:///$DEST/dispatch.db" \
        --n-trials 20 --timeout 240 "${ENQ[@]}" \
        --out "$DEST/dispatch.json" --no-progress 2>&1 | tee "$DEST/sweep.log" | grep -v WARNING | tail -12
    ;;
retune)
    # Fresh TPE studies at the two small-B*H shapes after compile failures and restricted
    # configs became COMPLETE trials with value inf (TPE learns from them), as in "dispatch".
    mkdir -p "$DEST/retune"
    DECAY_TUNER_STUDIES="$DEST/retune" python3 -m tuner dispatch --shapes 2x16x16384,1x8x32768 \
        --storage "sqlite:///$DEST/retune/retune.db" \
        --n-trials 40 --timeout 120 --enqueue 64/128/2/256/smem \
        --out "$DEST/retune/dispatch.json" --no-progress 2>&1 | tee "$DEST/retune/retune.log" | tail -12
    ;;
bench)
    # The table predates the kernel-source hash in its environment: --allow-mismatch.
    python3 -m tuner bench --dispatch "$DEST/dispatch.json" --allow-mismatch --out "$DEST/bench" \
        --shapes "$SHAPES,16x16x2048,4x16x8192" 2>&1 | tee "$DEST/bench.log" | grep -v "^{" | tail -40
    ;;
retable)
    R="$DEST/retable"; rm -rf "$R"; mkdir -p "$R"  # fresh: a changed kernel re-ranks from scratch
    ENQ=()
    for st in 2 3; do for seg in 1 2 4 8 16 32; do ENQ+=(--enqueue "64/128/$st/256/smem/$seg"); done; done
    start=$(date +%s)
    DECAY_TUNER_STUDIES="$R/studies" python3 -m tuner dispatch --shapes "$SHAPES,4x16x8192" \
        --storage "sqlite:///$R/retable.db" --n-trials 14 --timeout 55 "${ENQ[@]}" \
        --out "$R/dispatch.json" --no-progress 2>&1 | grep -v WARNING | tee "$R/retable.log" | tail -8
    echo "retable: $(( $(date +%s) - start )) s wall" | tee -a "$R/retable.log"
    timeout 240 python3 -m tuner bench --dispatch "$R/dispatch.json" --out "$R/bench" \
        --shapes "$SHAPES,16x16x2048,4x16x8192" 2>&1 | tee "$R/bench.log" | grep -v "^{" | tail -12
    ;;
seeds)
    R="$DEST/seeds"; mkdir -p "$R"
    start=$(date +%s)
    DECAY_TUNER_STUDIES="$R/studies" python3 -m tuner dispatch --shapes "$SHAPES,4x16x8192" \
        --storage "sqlite:///$R/seeds.db" --n-trials 8 --timeout 50 \
        --out "$R/dispatch.json" --no-progress 2>&1 | grep -v WARNING | tee "$R/seeds.log" | tail -8
    echo "seeds: $(( $(date +%s) - start )) s wall" | tee -a "$R/seeds.log"
    ;;
oos)
    R="$DEST/oos"; rm -rf "$R"; mkdir -p "$R"
    start=$(date +%s)
    for spec in "128:1x16x16384,4x8x8192,1x4x65536" "64:2x16x16384"; do
        d=${spec%%:*}; shapes=${spec#*:}; b=$(( d < 128 ? d : 128 ))
        common=(--shapes "$shapes" --dk "$d" --dv "$d" --storage "sqlite:///$R/oos.db" --no-progress)
        DECAY_TUNER_STUDIES="$R/studies" python3 -m tuner dispatch "${common[@]}" --n-trials 8 \
            --timeout 50 --out "$R/seeds-dk$d.json" 2>&1 | grep -v WARNING | tee -a "$R/oos.log" | tail -5
        ENQ=()
        for st in 2 3; do for seg in 1 2 4 8 16 32 64; do ENQ+=(--enqueue "64/$b/$st/256/smem/$seg"); done; done
        DECAY_TUNER_STUDIES="$R/studies" python3 -m tuner dispatch "${common[@]}" --n-trials 15 \
            --timeout 90 --no-wave-seeds "${ENQ[@]}" --out "$R/ladder-dk$d.json" 2>&1 | grep -v WARNING \
            | tee -a "$R/oos.log" | tail -5
    done
    echo "oos: $(( $(date +%s) - start )) s wall" | tee -a "$R/oos.log"
    ;;
esac
if [ -n "${OUT:-}" ]; then tar czf "$OUT/$1.tgz" --exclude bench.html "$DEST"; fi
