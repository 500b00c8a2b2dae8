#!/bin/bash
# A/B: base = 40ba62e (a worktree at /tmp/base), main = this change (few-row int4/int5/int8 linears: x packed by
# 16 x 16 transposes into per-thread scratch, the C tile transposed in registers); alternated, two rounds.
for rep in 1 2; do for tree in base main; do
  src=/tmp/base/src; [ $tree = main ] && src=/work/main/src
  echo "== $tree round $rep"
  OMP_NUM_THREADS=2 PYTHONPATH=$src /work/main/.venv/bin/python one_projection.py.txt 2>&1 | grep " us"
  OMP_NUM_THREADS=2 PYTHONPATH=$src /work/main/.venv/bin/python rows_step.py.txt 300 2>&1 | grep -v "Warn\|USDT"
done; done
