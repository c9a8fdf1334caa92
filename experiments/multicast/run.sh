#!/usr/bin/env bash
# The cluster-multicast prototype checked, then timed beside the served forward, on the
# H200 (carry: [".gpu"]):
#   bash experiments/multicast/run.sh > $OUT/cluster_fwd.jsonl
set -uo pipefail
source .gpu/setup.sh
export PYTHONUNBUFFERED=1
timeout "${CLUSTER_S:-420}" python3 experiments/multicast/cluster_fwd.py \
    4x16x8192:128x128 4x8x8192:128x256 8x16x4096:128x128 2x16x16384:128x128 3x12x6000:128x128 \
    2>"$OUT/cluster_fwd.err"
echo "cluster_fwd: exit $?" >&2
tail -3 "$OUT/cluster_fwd.err" >&2
