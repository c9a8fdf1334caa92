#!/usr/bin/env bash
# What this checkout has not yet run on a GPU, in one device call (about 8 minutes on a fresh
# H100 with the bundle): from the repo root, `bash experiments/gpu_tests/pending.sh` with
# carry [".gpu"] (or a `git archive` copy of HEAD beside it). Logs go to $OUT.
set -u
source .gpu/setup.sh
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
# The backward's kept zero start; the gated forward's scan in registers; the gated decode step;
# the gated pool prefill and mixed call.
timeout 200 python3 -m pytest -o addopts="" -q -rf -m gpu -p no:cacheprovider tests/test_backward.py \
  tests/test_decode.py tests/test_pool.py \
  -k "final_state_no_gradient or gradients_match_autograd or gated or chained" 2>&1 | tail -15 | tee "$out/tests.log"
timeout 150 python3 -m pytest -o addopts="" -q -rf -m gpu -p no:cacheprovider tests/test_gated.py \
  -k "kernel_matches or goal_shape or packed_matches" 2>&1 | tail -15 | tee -a "$out/tests.log"
# Host time per call (20 calls queued after a sync) and fwd+bwd against fla, gradients set to None.
timeout 300 python3 experiments/host_path/measure.py 2>&1 | tail -12
