"""SmolLM2 decode steps in a loop for a profiler to attach to: FORMAT weights (quantize_model's defaults), a cache
prefilled to CTX tokens, one decode step after another for SECONDS (trimmed back every 64), then the median step.
Writes its pid to /tmp/decode_loop.pid once warm. LIB=<built .so> loads another build of the kernels.

PYTHONPATH=src python results/engine/avx2_head_ab/decode_loop.py int8 1024 20
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.engine.weights import quantize_model
from kakeya_runtime.models import native
from kakeya_runtime.models.loader import load_model

if os.environ.get("LIB"):
    native.library_path = lambda: Path(os.environ["LIB"])
fmt, ctx, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
model = load_model("smollm2", dtype=torch.bfloat16 if fmt == "bf16" else torch.float32).model
quantize_model(model, fmt)
engine = Engine(model)
cache = engine.new_cache(capacity=ctx + 256)
cache.reserve(cache.capacity)
engine.prefill(cache, torch.randint(0, 1000, (1, ctx), generator=torch.Generator().manual_seed(0)))
length, token = cache.length, torch.tensor([[5]])
for _ in range(5):
    engine.decode_step(cache, token)
cache.trim(length)
Path("/tmp/decode_loop.pid").write_text(str(os.getpid()))
times: list[float] = []
end = time.time() + seconds
while time.time() < end:
    for _ in range(64):
        t0 = time.perf_counter()
        engine.decode_step(cache, token)
        times.append(time.perf_counter() - t0)
    cache.trim(length)
times.sort()
print(f"{fmt} ctx {ctx}: median {statistics.median(times) * 1e3:.2f} ms, p10 {times[len(times) // 10] * 1e3:.2f} ms "
      f"over {len(times)} steps")
