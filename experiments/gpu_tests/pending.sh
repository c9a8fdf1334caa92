#!/usr/bin/env bash
# What this checkout has not yet run on a GPU, as three device calls of under 600 s each (a
# fresh H100 with the bundle), in order of need: from the repo root (or a `git archive` copy of
# HEAD with .gpu beside it), `bash experiments/gpu_tests/pending.sh 1`, then `2`, then `3`,
# with carry [".gpu"]. A copy of HEAD beside the bundle (device `run` with carry [".gpu",
# ".snap"] and command `cd .snap && ln -s ../.gpu .gpu && bash experiments/gpu_tests/pending.sh 1`):
#   rm -rf .snap && mkdir .snap && git archive HEAD kernel refs tuner reports tests pyproject.toml \
#     README.md docs experiments/{decode,host_path,gated,serving,model,gpu_tests} | tar -x -C .snap
# Logs go to $OUT. The op's kernels the calls run are compiled first, in
# parallel (precompile.py); the kernels the backward-mode tests build alone compile as they run.
set -u
source .gpu/setup.sh
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python3 experiments/gpu_tests/precompile.py 2>&1 | tail -3
case "${1:-1}" in
1)
  # The gated backward: the op's (float32 torch) under torch.compile (its dense cases failed a
  # stride check on 06e9ba4, fixed since) and beside fla's; the same backward as three passes
  # of the gated kernel's backward modes (backward_by_passes, a40f75e). The constant-decay
  # backward's zero start; the gated pool. Which step of fwd+bwd waits (breakdown.py).
  timeout 280 python3 -m pytest -o addopts="" -q -rf -m gpu -p no:cacheprovider tests/test_gated_backward.py \
    2>&1 | tail -14 | tee "$out/tests.log"
  timeout 60 python3 -m pytest -o addopts="" -q -rf -m gpu -p no:cacheprovider tests/test_pool.py -k "gated or final_state_no_gradient" \
    tests/test_backward.py::test_a_final_state_no_gradient_reaches_runs_the_passes_warmup_compiled \
    2>&1 | tail -8 | tee -a "$out/tests.log"
  timeout 60 python3 experiments/host_path/breakdown.py 2>&1 | tail -5
  ;;
2)
  # The gated kernel's backward modes (reversed, float32 out) against fp64; the gated forward
  # at 1 to 3 stages, with its gates by TMA (gate_tma.py, box of 4 heads) beside, and fla's.
  timeout 250 python3 -m pytest -o addopts="" -q -rf -m gpu -p no:cacheprovider tests/test_gated.py \
    -k "reverse or fp32" 2>&1 | tail -10 | tee "$out/tests.log"
  timeout 170 python3 experiments/gated/bench.py --variants --boxes 4 2>&1 | tee "$out/bench.jsonl" | tail -4
  ;;
3)
  # Host time per call and fwd+bwd against fla; fla's SimpleGLA layer on our op; the gated
  # tuner's GPU tests (dispatch --gate token under the gated code key, 2e9ef00).
  timeout 300 python3 experiments/host_path/measure.py 2>&1 | tail -12
  timeout 100 python3 experiments/gated/layer.py --out "$out" 2>&1 | tail -30
  timeout 110 python3 -m pytest -o addopts="" -q -rf -m gpu -p no:cacheprovider tests/test_gated_tuner.py \
    2>&1 | tail -8 | tee "$out/tests.log"
  ;;
esac
