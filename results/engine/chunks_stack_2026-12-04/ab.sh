# Alternated twice: the tree before (d38daa3, /tmp/base) and after.
for i in 1 2; do
  OMP_NUM_THREADS=2 PYTHONPATH=/tmp/base/src TREE=d38daa3 /work/main/.venv/bin/python chunks_run.py.txt
  OMP_NUM_THREADS=2 PYTHONPATH=/work/main/src TREE=chunks_stack /work/main/.venv/bin/python chunks_run.py.txt
done
