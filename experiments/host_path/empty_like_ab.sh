#!/usr/bin/env bash
# The op's outputs made by empty_like (3323800) against empty(shape, dtype=, device=) (its parent,
# 5fb25b9), on this project's 2-core CPU: python_only.py (HEAD's) on each commit's kernel
# package, alternating, three runs each; the 1x16x64 rows. From the repo root:
#   bash experiments/host_path/empty_like_ab.sh > experiments/host_path/empty_like_ab.txt
set -eu
for commit in 5fb25b9 3323800; do git worktree add -q "/tmp/ab_$commit" "$commit"; done
trap 'for c in 5fb25b9 3323800; do git worktree remove --force "/tmp/ab_$c"; done' EXIT
for run in 1 2 3; do
  for commit in 5fb25b9 3323800; do
    echo "run $run, kernel of $commit:"
    PYTHONPATH="/tmp/ab_$commit" python3 experiments/host_path/python_only.py 2>&1 \
      | grep -A3 "1x16x64" | grep "us/call"
  done
done
