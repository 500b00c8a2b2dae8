#!/bin/bash
# alternate the few-row attention change (485fb77) and its parent for the sparse bench at 7,680 tokens
cd /work/main
C=src/kakeya_runtime/models/csrc/cached_attention.cpp
AFTER=485fb77
for r in 1 2; do
  for t in after before; do
    if [ $t = before ]; then git checkout -q $AFTER~1 -- $C; else git checkout -q $AFTER -- $C; fi
    /work/main/.venv/bin/kakeya bench sparse --lengths 7680 --threads 2 --codec identity --repeats 3 --out /tmp/s59/sp/${t}_run$r > /tmp/s59/sp/${t}_run$r.log 2>&1
  done
done
git checkout -q HEAD -- $C
echo done
