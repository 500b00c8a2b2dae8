"""Our projection kernels against torch's on this machine, one process per tree (run it from each tree's src with
PYTHONPATH, alternating): kakeya::linear (bf16, fp32) and the int4 / int8 modules (their default prefill, and as
`kakeya serve` builds them, every row count on kakeya::quant_linear: `_served`) at SmolLM2's projection shapes, 1 / 64 / 512 rows, beside torch's F.linear in bf16 and fp32 (the peers, same process). Medians of timed
calls, ms.

    PYTHONPATH=<tree>/src python scripts/avx2_kernels_ab.py --label <tree> --out results/engine/avx2_kernels/<tree>_<n>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def timed(f, repeats: int) -> float:
    f()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def main() -> None:
    from kakeya_runtime.bench.machine import machine_info
    from kakeya_runtime.engine.weights import Int4Linear, Int8Linear, Prefill
    from kakeya_runtime.models import native

    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import psutil

    busy_before = psutil.cpu_percent(interval=1.0) / 100.0  # another process's load would read as our time
    native.load()
    torch.manual_seed(0)
    rows = []
    for n, k in ((1536, 576), (576, 1536), (192, 576)):
        w = torch.randn(n, k) * 0.05
        wb = w.to(torch.bfloat16)
        i4, i8 = Int4Linear(w.clone(), None), Int8Linear(w.clone(), None)
        # as served: many rows through the int kernel too (the default dequantizes and calls torch's GEMM)
        i4k = Int4Linear(w.clone(), None, prefill=Prefill.KERNEL)
        i8k = Int8Linear(w.clone(), None, prefill=Prefill.KERNEL)
        for m in (1, 64, 512):
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            reps = 50 if m == 1 else 10 if m == 64 else 3
            calls = {"kakeya_bf16": (native.linear, xb, wb), "kakeya_fp32": (native.linear, x, w),
                     "kakeya_int4": (i4, xb[None]), "kakeya_int8": (i8, xb[None]),
                     "kakeya_int4_served": (i4k, xb[None]), "kakeya_int8_served": (i8k, xb[None]),
                     "torch_bf16": (F.linear, xb, wb), "torch_fp32": (F.linear, x, w)}
            row = {"n": n, "k": k, "m": m}
            with torch.inference_mode():
                for name, (f, *operands) in calls.items():
                    row[name] = round(timed(lambda f=f, operands=operands: f(*operands), reps), 4)
            rows.append(row)
            print(row, flush=True)
    doc = {"schema": "kakeya.avx2_kernels", "label": args.label, "threads": args.threads, "unit": "ms, median",
           "cpu_busy_before": round(busy_before, 3),
           "machine": machine_info(), "platform": platform.platform(), "rows": rows,
           "command": f"PYTHONPATH=<tree>/src python scripts/avx2_kernels_ab.py --label {args.label} --out {args.out}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
