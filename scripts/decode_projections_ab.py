"""SmolLM2's bf16 decode projections on our kernel (kakeya::linear): q/k/v fused (960 x 576), o (576 x 576),
gate/up fused (3072 x 576) and down (576 x 1536), over 30 layers of distinct weights (read from memory, as a decode
step reads them), for calls of `--rows` rows each (1: a decode step; k + 1: a verifier step over k drafts; N: a
batched step of N sessions); `--head` adds the tied LM head (49152 x 576, fp32 out). Median and best of --reps steps,
ms; `--library` loads a given build, so two can be alternated.

PYTHONPATH=src python scripts/decode_projections_ab.py --library OLD.so --reps 40 --rows 1,5,8 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kakeya_runtime.models import native

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--library", type=Path, help="a built cached_attention.so to load instead of this checkout's")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1", help="comma-separated row counts, each timed on its own")
    ap.add_argument("--head", action="store_true", help="the LM head too, as a verifier step runs it")
    ap.add_argument("--out", type=Path, help="append the timings to this JSON list")
    args = ap.parse_args()
    if args.library:
        native.library_path = lambda: args.library  # this process's kernels: that build
    torch.set_num_threads(args.threads)
    native.load()
    gen = torch.Generator().manual_seed(0)
    layers = [[(torch.randn(n, k, generator=gen) * k**-0.5).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]
    head = (torch.randn(49152, 576, generator=gen) * 576**-0.5).bfloat16() if args.head else None
    library = str(native.library_path())
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES}

        def step(xs: dict[int, torch.Tensor] = xs) -> float:
            t0 = time.perf_counter()
            for ws in layers:
                for w in ws:
                    native.linear(xs[w.shape[1]], w)
            if head is not None:
                native.linear(xs[576], head, out_fp32=True)
            return time.perf_counter() - t0

        for _ in range(3):
            step()
        times = [step() for _ in range(args.reps)]
        print(f"{library}: {rows} rows: median {statistics.median(times) * 1e3:.3f} ms  best {min(times) * 1e3:.3f} ms")
        if args.out:
            out = json.loads(args.out.read_text()) if args.out.exists() else []
            out.append({"command": " ".join(sys.argv), "library": library, "threads": args.threads, "reps": args.reps,
                        "rows": rows, "head": args.head, "ms_per_step_median": round(statistics.median(times) * 1e3, 3),
                        "ms_per_step_best": round(min(times) * 1e3, 3)})
            args.out.write_text(json.dumps(out, indent=1))

if __name__ == "__main__":
    main()
