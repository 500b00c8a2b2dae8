#!/bin/bash
# the previous build (OLD) and this one (NEW), alternated: one layer's decode attention call over 4,096 keys from
# cache and from memory, the sparse layer's native calls at 7,680 (fastest call), and decode steps at 4k (decode_loop)
cd /work/main
OLD=${OLD:?built .so of 485fb77~1}
NEW=${NEW:?built .so of 485fb77}
D=results/engine/avx2_attention_few
for r in 1 2 3; do
  for t in before after; do
    L=$OLD; [ $t = after ] && L=$NEW
    LIB=$L PYTHONPATH=src .venv/bin/python $D/attention_call.py 4096 1 1 500 $D/call_cache_${t}_run$r.json
    LIB=$L PYTHONPATH=src .venv/bin/python $D/attention_call.py 4096 30 2 40 $D/call_memory_${t}_run$r.json
    # (Gemma 3's shape, two alternations run after the others: 4 rows of one K/V head at head_dim 256)
    [ $r -le 2 ] && SHAPE=gemma3 LIB=$L PYTHONPATH=src .venv/bin/python $D/attention_call.py 4096 1 1 300 $D/call_gemma3_cache_${t}_run$r.json
    PYTHONPATH=src .venv/bin/python scripts/sparse_kernel_profile.py --length 7680 --codec identity --stat min --library $L --out $D/sparse_calls_${t}_run$r.json > /dev/null
    LIB=$L PYTHONPATH=src .venv/bin/python results/engine/avx2_head_ab/decode_loop.py int8 4096 12 | tail -1 | sed "s/^/$t run $r: /" >> $D/decode_loop_4k.txt
  done
done
