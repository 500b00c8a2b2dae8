"""What a verifier step over k drafts costs in decode steps on this machine (engine.speculative.measure_verify_cost,
the price `kakeya serve` gives speculation's off-switch), with a given kernel build, so two builds can be
alternated. SmolLM2 as `--weights` gives it (bf16 by default).

PYTHONPATH=src python scripts/verify_cost_ab.py --library OLD.so --threads 1 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.engine.serving import apply_format, load_dtype
from kakeya_runtime.engine.speculative import measure_verify_cost
from kakeya_runtime.models import native
from kakeya_runtime.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--library", type=Path, help="a built cached_attention.so to load instead of this checkout's")
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="append the result to this JSON list")
    args = ap.parse_args()
    if args.library:
        native.library_path = lambda: args.library  # this process's kernels: that build
    torch.set_num_threads(args.threads)
    engine = Engine(apply_format(load_model(dtype=load_dtype(args.weights)).model, args.weights))
    t0 = time.perf_counter()
    cost = measure_verify_cost(engine, repeats=5)
    library = str(native.library_path())
    print(f"{library}: extra decode steps for 1 / 4 / 8 / 16 drafts: {cost[1]} / {cost[4]} / {cost[8]} / {cost[16]}")
    if args.out:
        out = json.loads(args.out.read_text()) if args.out.exists() else []
        out.append({"command": " ".join(sys.argv), "library": library, "threads": args.threads,
                    "weights": args.weights, "verify_cost": list(cost),
                    "seconds": round(time.perf_counter() - t0, 1)})
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
