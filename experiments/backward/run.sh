#!/usr/bin/env bash
# Issue 18 on the H200, from the repo root (carry: [".gpu"]), one step per device call
# (each call has 600 s):
#   source .gpu/setup.sh && OUT=$OUT bash experiments/backward/run.sh STEP...
# tests: the backward's GPU tests; bench: the bench's backward rows against fla; train: 200
# training steps of a small RetNet with fla's kernels and with ours; overhead: where the
# forward plus backward's time goes beyond its kernels (overhead.py); gradients: one
# step's gradients of that RetNet, ours and fla's in bf16 against fla's in fp32
# (train_retnet.py --check-only); layers: that, and each layer's attention gradients
# against fp64 (--layers: 348 s in all on the H200); tune: a table with the backward tuned
# (dispatch --backward: the forward's and the fused dk+dv sweep's studies at the bench's two
# backward shapes), its log and the table in $OUT; tuned: the bench serving that table
# (DISPATCH=path of the table tune wrote, committed and carried). Each step has its own time
# limit, so that one hang leaves the others' results in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
steps=("$@")
for step in ${steps[@]}; do
    case $step in
    tests) timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_backward.py 2>&1 | tee "$OUT/backward_gpu.log" ;;
    bench) timeout 240 python3 -m tuner bench --shapes 8x16x4096,2x16x16384 --packed 0 --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" ;;
    overhead) git show 41a6308:experiments/backward/overhead.py > /tmp/overhead.py && timeout 300 python3 /tmp/overhead.py --out "$OUT" 2>&1 | tail -40 ;;  # deleted: README, "Deleted forks"
    gradients) timeout 540 python3 experiments/backward/train_retnet.py --check-only --out "$OUT" 2>&1 | tee "$OUT/gradients.log" | tail -20 ;;
    layers) timeout 540 python3 experiments/backward/train_retnet.py --check-only --layers --out "$OUT" 2>&1 | tee "$OUT/gradients.log" | tail -20 ;;
    tune) timeout 400 python3 -m tuner dispatch --backward --shapes 8x16x4096,2x16x16384 --n-trials 8 --timeout 70 \
        --storage "journal:/tmp/backward.journal" --out "$OUT/dispatch.json" --no-progress 2>&1 | grep -v WARNING |
        tee "$OUT/dispatch.log" | tail -12 ;;
    tuned) timeout 400 python3 -m tuner bench --shapes 8x16x4096,2x16x16384 --packed 0 --dispatch "$DISPATCH" \
        --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -30 ;;
    train) timeout 540 python3 experiments/backward/train_retnet.py --out "$OUT" 2>&1 | tee "$OUT/train.log" | tail -40 ;;
    *) echo "unknown step $step (tests, bench, tune, tuned, train, overhead, gradients, layers)" >&2 && exit 2 ;;
    esac
done
