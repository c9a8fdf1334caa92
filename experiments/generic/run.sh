#!/usr/bin/env bash
# Shape-generic kernels on the H200, one device call (see run.py). From the repo root, with
# .base/kernel_static made here first (the tree before the change, its package renamed):
#   rm -rf .base && mkdir -p .base/kernel_static && git archive BASE kernel | tar -x -C .base \
#     && cp -r .base/kernel/* .base/kernel_static/ && rm -rf .base/kernel \
#     && grep -rl kernel .base/kernel_static | xargs sed -i "s/\bkernel\./kernel_static./g; s/from kernel import/from kernel_static import/"
# device: carry [".gpu", ".base"], command: bash experiments/generic/run.sh
set -uo pipefail
source .gpu/setup.sh
export PYTHONUNBUFFERED=1
run() { timeout "$1" python3 experiments/generic/run.py "$2" 2>&1 | tee -a "$OUT/$2.jsonl" | grep -v '^{"kind": "check"' ; }
steps=${*:-check cost warmup shapes shapes tests}  # each a step below, in order
for step in $steps; do
    case $step in
        check | cost) run 200 "$step" ;;
        warmup) run 150 warmup ;;
        shapes) run 60 shapes ;;  # a fresh process after the warm-up: the disk cache is warm
        tests)  # GPU tests of the kernels and ops the generic kernels serve, as time allows
            timeout "${TESTS_S:-150}" python3 -m pytest -o addopts="" -q -m gpu tests/test_dkdv.py \
                tests/test_backward.py -k "not fla" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    esac
done
