#!/bin/bash
# alternate the int8 loads change (1d29608) and its parent for the int8 engine bench
cd /work/main
run() {  # $1 label $2 run
  /work/main/.venv/bin/kakeya bench engine --models smollm2 --contexts 1024,4096 --formats int8 --prefill-mode kernel --no-compile --no-peers --previous '' --long-prefill '' --decode-steps 64 --idle-wait 5 --out /tmp/s58/ab2/$1_run$2.json > /tmp/s58/ab2/$1_run$2.log 2>&1
}
for r in 1 2; do
  for t in after before; do
    if [ $t = before ]; then git checkout -q 1d29608~1 -- src/kakeya_runtime/models/csrc/quant_linear.cpp; else git checkout -q 1d29608 -- src/kakeya_runtime/models/csrc/quant_linear.cpp; fi
    run $t $r
  done
done
git checkout -q 1d29608 -- src/kakeya_runtime/models/csrc/quant_linear.cpp
echo done
