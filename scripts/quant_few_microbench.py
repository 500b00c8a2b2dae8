"""Few-row quantized projection microbench: kakeya::quant_linear (int4 / int8) against PyTorch's weight-only GEMV
(aten._weight_int4pack_mm_for_cpu / aten._weight_int8pack_mm) and bf16 kakeya::linear, per shape, row count and
thread count. Weights cycle through enough copies to leave L2 (as a decode step streams every layer), or one copy
(`--hot`). Median of `--reps` timed batches.

PYTHONPATH=src python scripts/quant_few_microbench.py --out results/quant/few_rows.json
PYTHONPATH=src python scripts/quant_few_microbench.py --bits 8 --shapes smollm2.qkv,smollm2.down --rows 1,8 ...
(`--library OLD.so` times another build of the kernels, so two can be alternated.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from kakeya_runtime.engine.weights import pack_scales, pack_tiles, quantize_int4, quantize_int8
from kakeya_runtime.models import native

SHAPES = {  # name: (N, K, bits)
    "smollm2.qkv": (960, 576, 4), "smollm2.o": (576, 576, 4), "smollm2.gate_up": (3072, 576, 4),
    "smollm2.down": (576, 1536, 4), "smollm2.head": (49152, 576, 8),
    "gemma3.qkv": (1536, 640, 4), "gemma3.o": (640, 1024, 4), "gemma3.gate_up": (4096, 640, 4),
    "gemma3.down": (640, 2048, 4), "gemma3.head": (262144, 640, 8),
}


def timed(fn, reps: int, inner: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter_ns() - t) / inner / 1e3)
    out.sort()
    return out[len(out) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--bits", type=int, choices=(4, 8), help="every shape at these bits (default: each shape's own)")
    p.add_argument("--hot", action="store_true")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--library", type=Path, help="a built cached_attention.so to load instead of this checkout's (A/B)")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    if a.library:
        native.library_path = lambda: a.library  # this process's kernels: that build
    import psutil

    busy = round(psutil.cpu_percent(interval=0.5) / 100.0, 3)
    native.load()
    res = []
    for name in a.shapes.split(","):
        n, k, bits = SHAPES[name]
        bits = a.bits or bits
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * k**-0.5
        copies = 1 if a.hot else max(1, min(16, (16 << 20) // (n * k // 2 * bits // 4)))
        if bits == 4:
            codes, sz = quantize_int4(w, dtype=torch.float32)
            ours = [(pack_tiles(codes, 4), pack_scales(sz)) for _ in range(copies)]
            _, szb = quantize_int4(w)
            peer = [] if a.no_peer else [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), szb.clone())
                                         for _ in range(copies)]
            wd = native.quant_dequant(*ours[0], 4)
        else:
            q, s = quantize_int8(w)
            ours = [(pack_tiles(q, 8), s.clone()) for _ in range(copies)]
            peer = [] if a.no_peer else [(q.clone(), s.clone()) for _ in range(copies)]
            wd = native.quant_dequant(*ours[0], 8)
        dense = [wd.clone() for _ in range(min(copies, max(1, (64 << 20) // (n * k * 2))))]
        for threads in map(int, a.threads.split(",")):
            torch.set_num_threads(threads)
            for m in map(int, a.rows.split(",")):
                x = torch.randn(m, k).bfloat16()
                cyc = itertools.cycle(ours), itertools.cycle(peer or [None]), itertools.cycle(dense)

                def ours_fn(x=x, it=cyc[0], bits=bits):
                    q, sz = next(it)
                    native.quant_linear(x, q, sz, bits)

                def peer_fn(x=x, it=cyc[1], bits=bits):
                    q, sz = next(it)
                    if bits == 4:
                        torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, 32, sz)
                    else:
                        torch.ops.aten._weight_int8pack_mm(x, q, sz)

                def dense_fn(x=x, it=cyc[2]):
                    native.linear(x, next(it))

                inner = max(2, int(3e5 // (n * k // 64 + 1000)))
                row = {"shape": name, "N": n, "K": k, "bits": bits, "rows": m, "threads": threads,
                       "ours_us": round(timed(ours_fn, a.reps, inner), 2),
                       "peer_us": None if a.no_peer else round(timed(peer_fn, a.reps, inner), 2),
                       "bf16_us": round(timed(dense_fn, a.reps, inner), 2)}
                if row["peer_us"]:
                    row["ours_over_peer"] = round(row["ours_us"] / row["peer_us"], 2)
                print(json.dumps(row), flush=True)
                res.append(row)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"command": shlex.join([sys.executable, *sys.argv]), "cpu_busy_before": busy,
                                     "hot": a.hot, "bits": a.bits, "torch": torch.__version__, "results": res}, indent=1))


if __name__ == "__main__":
    main()
