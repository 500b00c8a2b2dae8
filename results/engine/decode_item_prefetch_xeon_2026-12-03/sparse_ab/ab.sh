#!/bin/bash
# A/B of the sparse decode bench: base tree (HEAD) vs working tree, alternated
for rep in 1 2; do for tree in base main; do
  root=/tmp/base; [ $tree = main ] && root=/work/main
  (cd $root && OMP_NUM_THREADS=2 PYTHONPATH=$root/src /work/main/.venv/bin/python -c "from kakeya_runtime.cli import app; app()" bench sparse --lengths 7680 --threads 2 --codec identity --repeats 3 --heads all --oracle-steps 1 --out /tmp/s65/sparse_${tree}_$rep > /tmp/s65/sparse_${tree}_$rep.log 2>&1)
done; done
