#!/bin/bash
# A/B: base = 3cc323f (runs of 32+ tokens on the per-layer path; a worktree at /tmp/base), main = every run of one
# sequence's new tokens through the native stack; alternated, two rounds.
for rep in 1 2; do for tree in base main; do
  src=/tmp/base/src; [ $tree = main ] && src=/work/main/src
  TREE=$tree OMP_NUM_THREADS=2 PYTHONPATH=$src /work/main/.venv/bin/python prefill_run.py.txt 2>&1 | grep '^{'
done; done
