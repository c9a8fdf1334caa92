#!/usr/bin/env bash
# The GPU suite on the H200 after the ops layer moved to kernel/ops/ and the kernels were
# folded (generated CUDA unchanged: experiments/codegen/). From the repo root, carry
# [".gpu"], one part per device call (each call has 600 s; the machine keeps TileLang's
# cache between calls while it stays warm):
#   source .gpu/setup.sh && OUT=$OUT bash experiments/ops_layer/run.sh PART
set -uo pipefail
export PYTHONUNBUFFERED=1
case ${1:-} in
kernels) files="tests/test_kernel_gpu.py tests/test_arch_gpu.py tests/test_refs.py" ;;
rest) files="tests/test_dkdv.py tests/test_cli.py tests/test_bench.py" ;;
ops) files="tests/test_attention_gpu.py tests/test_backward.py" ;;
*) echo "usage: run.sh kernels|ops|rest" >&2 && exit 2 ;;
esac
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 570 python3 -m pytest -o addopts="" -m gpu -q -p no:cacheprovider -rfE --durations=10 $files 2>&1 | tee "$OUT/gpu_$1.log"
