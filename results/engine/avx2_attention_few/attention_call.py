"""One decode row's attention call, as a layer of SmolLM2 makes it: cached_attention of 3 query rows per K/V head
(3 KV heads, head_dim 64, bf16) over S cached keys (SHAPE=gemma3: Gemma 3 270M's, 4 rows of one K/V head at 256). With L > 1 it cycles L layers' caches (from memory, as a decode
step reads them), with L = 1 it repeats one (from cache). Times the fastest of REPS passes (this host is noisy;
the fastest pass is the kernel's speed), per call and per key and K/V head. LIB=<built .so> loads another build.

PYTHONPATH=src python results/engine/avx2_attention_few/attention_call.py S L THREADS REPS OUT.json
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from kakeya_runtime.models import native

if os.environ.get("LIB"):
    native.library_path = lambda: Path(os.environ["LIB"])
s, layers, threads, reps, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
library = str(native.load())
torch.set_num_threads(threads)
torch.manual_seed(0)
hk, g, d = (1, 4, 256) if os.environ.get("SHAPE") == "gemma3" else (3, 3, 64)
ks = [torch.randn(1, hk, s, d, dtype=torch.bfloat16) for _ in range(layers)]
vs = [torch.randn(1, hk, s, d, dtype=torch.bfloat16) for _ in range(layers)]
q = torch.randn(1, hk, g, d, dtype=torch.bfloat16)
k_pos, q_pos = torch.arange(s), torch.tensor([s])
passes = []
for _ in range(reps):
    t0 = time.perf_counter()
    for i in range(layers):
        native.cached_attention(q, ks[i], vs[i], q_pos, k_pos, d**-0.5)
    passes.append((time.perf_counter() - t0) / layers)
best = min(passes)
row = {"command": " ".join(sys.argv), "library": library, "shape": {"kv_heads": hk, "rows": g, "head_dim": d}, "keys": s, "layers": layers, "threads": threads,
       "reps": reps, "us_per_call_min": 1e6 * best, "us_per_call_median": 1e6 * sorted(passes)[len(passes) // 2],
       "ns_per_key_head_min": 1e9 * best / (s * hk), "load_avg_1m": os.getloadavg()[0]}
print(json.dumps(row))
Path(out).parent.mkdir(parents=True, exist_ok=True)
Path(out).write_text(json.dumps(row, indent=1))
