#!/bin/bash
# Old tree (git worktree of ab3312d before the change, at /tmp/s64/old) and this tree alternated 3 times.
D=results/engine/decode_keys_in_place_xeon_2026-12-03
for i in 1 2 3; do for t in old new; do
  if [ $t = old ]; then P=/tmp/s64/old/src; else P=$PWD/src; fi
  for a in "350 8" "1000 8" "1000 1" "4096 1"; do
    TREE=$t PYTHONPATH=$P OMP_NUM_THREADS=2 .venv/bin/python $D/attention_step.py.txt $a
  done
done; done
