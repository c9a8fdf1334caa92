#!/usr/bin/env bash
# What this checkout has not yet run on a GPU, as four device calls of under 600 s each (a
# fresh H100 with the bundle), in order of need: from the repo root (or a `git archive` copy of
# HEAD with .gpu beside it), `bash experiments/gpu_tests/pending.sh 1`, then `2`, `3` and `4`,
# with carry [".gpu"] (the bundle: `bash ../shared/gpu/make-bundle.sh flash-linear-attention==0.6.0
# pytest-xdist execnet`, 47 MB). A copy of HEAD beside the bundle (device `run` with carry [".gpu",
# ".snap"] and command `cd .snap && ln -s ../.gpu .gpu && bash experiments/gpu_tests/pending.sh 1`):
#   rm -rf .snap && mkdir .snap && git archive HEAD kernel refs tuner reports tests pyproject.toml \
#     README.md docs experiments/{decode,host_path,gated,serving,model,gpu_tests} | tar -x -C .snap
# Work that waits on a GPU run before it merges lives on branches next/*, and next/all merges
# them onto main: archive next/all instead of HEAD to run it. Logs go to $OUT. The op's
# kernels a call runs are compiled first, in parallel (precompile.py's groups, the gated
# backward's passes too); those tests/test_gated.py and the bench build compile as they run.
set -u
source .gpu/setup.sh
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
case "${1:-1}" in  # each call compiles first, in parallel, what its op calls run (precompile.py)
1)
  timeout 150 python3 experiments/gpu_tests/precompile.py gated-backward host-path 2>&1 | tail -3
  # The op's gated backward on kernel passes, the final state's gradient summed forwards
  # (8d94afd): it failed in bf16 at strong gates on d7de51f (gated_backward_d7de51f.log); the
  # passes open through kernel.loader (PassCall). Then which step of fwd+bwd costs the host
  # its time, beside torch's autograd floor on the same host (breakdown.py).
  timeout 300 python3 -m pytest -o addopts="" -q -rf -s -m gpu -p no:cacheprovider tests/test_gated_backward.py \
    --tb=line > "$out/tests.log" 2>&1; grep -a "rel L2\|passed\|failed\|Error" "$out/tests.log" | tail -40
  timeout 120 python3 experiments/host_path/breakdown.py 2>&1 | grep -a "queued\| us  \|waited\|synchroniz\|(host)\|dlpack\|failed"
  ;;
2)
  # The gated kernel against fp64, every GPU case of tests/test_gated.py (forward, packed,
  # configs of 1 to 3 stages and 32 to 128 rows, reversed, fp32 out: the gate scan changed in
  # each, cf81882); its forward with the gates by TMA boxes (the product's since 643639d), by
  # scalar loads (before) and [B, H, S] beside, and fla's.
  # 8 test processes where the bundle has pytest-xdist: its kernels compile 8 at a time (the
  # cases check values, none times a kernel, so they may share the GPU)
  workers=$(python3 -c "import xdist, pytest; assert int(pytest.__version__.split('.')[0]) >= 7" 2>/dev/null && echo "-n 8")
  timeout 300 python3 -m pytest -o addopts="" ${workers:-} -v -rf -m gpu -p no:cacheprovider tests/test_gated.py \
    --tb=line > "$out/tests.log" 2>&1; grep -ac PASSED "$out/tests.log"; grep -a "FAILED\|Error\|passed\|failed" "$out/tests.log" | tail -30
  timeout 200 python3 experiments/gated/bench.py --variants 2>&1 | tee "$out/bench.jsonl" | tail -4
  ;;
3)
  # Host time per call and fwd+bwd against fla, ours and fla's in one process.
  timeout 150 python3 experiments/gpu_tests/precompile.py host-path 2>&1 | tail -3
  timeout 330 python3 experiments/host_path/measure.py 2>&1 | tail -12
  ;;
4)
  # fwd+bwd of the gated op against fla's; fla's SimpleGLA layer on our op; the gated
  # tuner's GPU tests.
  timeout 200 python3 experiments/gpu_tests/precompile.py gated-scripts 2>&1 | tail -3
  timeout 150 python3 experiments/gated/training.py > "$out/training.jsonl" 2>&1; tail -8 "$out/training.jsonl"
  timeout 100 python3 experiments/gated/layer.py --out "$out" 2>&1 | tail -30
  timeout 110 python3 -m pytest -o addopts="" -q -rf -m gpu -p no:cacheprovider tests/test_gated_tuner.py \
    2>&1 | tail -8 | tee "$out/tests.log"
  ;;
esac
