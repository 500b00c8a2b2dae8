#!/bin/bash
# A/B: base = the tree before (HEAD 2d31483, a worktree at /tmp/base), main = this change; alternated, 2 rounds.
for rep in 1 2; do for tree in base main; do
  src=/tmp/base/src; [ $tree = main ] && src=/work/main/src
  for c in "350 8" "1024 8" "256 32" "1024 1" "4096 1" "8192 1"; do
    OFF=13 TREE=$tree OMP_NUM_THREADS=2 PYTHONPATH=$src /work/main/.venv/bin/python attention_step.py.txt $c
  done
done; done
