"""One batched decode step of N sessions (Engine.step_rows, SmolLM2 bf16 or, with `--weights`, as `kakeya serve`
builds it; each row its own cache of 250 + 10 i
tokens) against one session's decode step, in process, for an A/B of the engine's per-row cost. Run it once on each
tree (PYTHONPATH picks the code), alternating, and compare `rows_ms`: the best of 3 timed runs of `--steps` steps
each, after a warm-up run; the caches are trimmed back after every run, so each run decodes the same positions.

PYTHONPATH=src:sdks/python/src python scripts/step_rows_ab.py --rows 8 --out results/concurrent/v6_step_ab/after.json
PYTHONPATH=/path/to/before/src:sdks/python/src python scripts/step_rows_ab.py --rows 8 --out .../before.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

import kakeya_runtime
from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.models.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="bf16",
                        help="bf16 (load_model), or a `kakeya serve --weights` value: the model as serve builds it")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import psutil

    busy = round(psutil.cpu_percent(interval=0.5) / 100.0, 3)
    if args.weights == "bf16":
        engine = Engine(load_model(args.model, dtype=torch.bfloat16).model)
    else:
        from rich.console import Console

        from kakeya_runtime.bench.long_session import load_served

        served = load_served(args.model, args.weights, None, Console(quiet=True))
        engine = Engine(served.model)
    gen = torch.Generator().manual_seed(0)
    caches = []
    for i in range(args.rows):
        cache = engine.new_cache(capacity=2048)
        cache.reserve(2048)
        engine.prefill(cache, torch.randint(0, 1000, (1, 250 + 10 * i), generator=gen))
        caches.append(cache)
    lengths = [c.length for c in caches]
    tokens = [5 + i for i in range(args.rows)]

    def reset() -> None:
        for cache, length in zip(caches, lengths, strict=True):
            cache.trim(length)

    def rows() -> None:
        for _ in range(args.steps):
            engine.step_rows(caches, tokens)
        reset()

    def solo() -> None:
        for _ in range(args.steps):
            engine.decode_step(caches[0], torch.tensor([[5]]))
        reset()

    runs: dict[str, list[float]] = {"rows": [], "solo": []}
    rows(), solo()  # warm-up
    for _ in range(3):
        for name, fn in (("rows", rows), ("solo", solo)):
            t0 = time.perf_counter()
            fn()
            runs[name].append(round((time.perf_counter() - t0) / args.steps * 1e3, 3))
    rows_ms, solo_ms = min(runs["rows"]), min(runs["solo"])
    src = Path(kakeya_runtime.__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"command": "python " + shlex.join(sys.argv), "source_tree": str(src), "commit": commit,
              "cpu_busy_before": busy, "torch_threads": torch.get_num_threads(), "rows": args.rows,
              "weights": args.weights, "steps": args.steps, "rows_ms": rows_ms, "solo_ms": solo_ms, "runs_ms": runs,
              "rows_over_solo": round(rows_ms / solo_ms, 3),
              "pure_decode_aggregate_ratio": round(args.rows * solo_ms / rows_ms, 3)}
    print(json.dumps(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
