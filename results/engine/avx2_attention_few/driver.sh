#!/bin/bash
# alternate the few-row attention change (485fb77) and its parent for the int8 engine bench (decode at 1k and 4k)
cd /work/main
C=src/kakeya_runtime/models/csrc/cached_attention.cpp
AFTER=485fb77
run() {  # $1 label $2 run
  /work/main/.venv/bin/kakeya bench engine --models smollm2 --contexts 1024,4096 --formats int8 --prefill-mode kernel --no-compile --no-peers --previous '' --long-prefill '' --decode-steps 64 --idle-wait 5 --out /tmp/s59/ab/$1_run$2.json > /tmp/s59/ab/$1_run$2.log 2>&1
}
for r in 1 2 3 4; do
  for t in after before; do
    if [ $t = before ]; then git checkout -q $AFTER~1 -- $C; else git checkout -q $AFTER -- $C; fi
    run $t $r
  done
done
git checkout -q $AFTER -- $C
echo done
