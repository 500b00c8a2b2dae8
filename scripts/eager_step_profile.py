"""Where an eager decode step's time goes: wall time per step against the time spent inside ops (our kakeya::
kernels, and aten ops that compute), the rest being Python, module calls and dispatch. SmolLM2 (bf16 and int4), one
row (`Engine.decode_step`) and N rows (`Engine.step_rows`, each row its own cache) at `--ctx` context, with each
layer's ops called from Python or the layer in one native call (models/native_layer.py), in the same process.

Wall: the median of `--steps` steps without the profiler (caches trimmed back, so each run decodes the same
positions). Op times: torch.profiler over the same steps, self CPU time per op name, summed (the profiler's own
cost lands outside the ops, so in-op sums are about right while its wall is not used).

PYTHONPATH=src python scripts/eager_step_profile.py --out results/engine/eager_step_profile.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import kakeya_runtime
from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.engine.weights import WeightFormat, quantize_model
from kakeya_runtime.models import native_layer
from kakeya_runtime.models.loader import load_model

COMPUTE_PREFIXES = ("kakeya::",)  # our kernels; aten ops are listed apart (some compute, most are glue)


def profile_case(engine: Engine, rows: int, ctx: int, steps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    caches = []
    for i in range(rows):
        cache = engine.new_cache(capacity=ctx + 64 * rows + steps + 8)
        cache.reserve(cache.capacity)
        engine.prefill(cache, torch.randint(0, 1000, (1, ctx + 16 * i), generator=gen))
        caches.append(cache)
    lengths = [c.length for c in caches]
    tokens = [5 + i for i in range(rows)]

    def step() -> None:
        if rows == 1:
            engine.decode_step(caches[0], torch.tensor([[5]]))
        else:
            engine.step_rows(caches, tokens)

    def reset() -> None:
        for cache, length in zip(caches, lengths, strict=True):
            cache.trim(length)

    for _ in range(3):
        step()
    reset()
    best: list[float] | None = None
    for _ in range(3):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        reset()
        if best is None or statistics.median(times) < statistics.median(best):
            best = times
    wall_ms = statistics.median(best) * 1e3

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    reset()
    ops: dict[str, dict] = {}
    for e in prof.key_averages():
        ops[e.key] = {"self_ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
    kakeya_ms = sum(v["self_ms_per_step"] for k, v in ops.items() if k.startswith(COMPUTE_PREFIXES))
    aten_ms = sum(v["self_ms_per_step"] for k, v in ops.items() if k.startswith("aten::"))
    calls = sum(v["calls_per_step"] for v in ops.values())
    kakeya_calls = sum(v["calls_per_step"] for k, v in ops.items() if k.startswith(COMPUTE_PREFIXES))
    top = sorted(ops.items(), key=lambda kv: -kv[1]["self_ms_per_step"])[:25]
    return {
        "rows": rows, "ctx": lengths, "steps": steps,
        "wall_ms": round(wall_ms, 3),
        "kakeya_ops_ms": round(kakeya_ms, 3),
        "aten_ops_ms": round(aten_ms, 3),
        "outside_ops_ms": round(wall_ms - kakeya_ms - aten_ms, 3),
        "outside_kakeya_ms": round(wall_ms - kakeya_ms, 3),
        "op_calls_per_step": round(calls, 1), "kakeya_calls_per_step": round(kakeya_calls, 1),
        "top_ops": {k: {"self_ms": round(v["self_ms_per_step"], 3), "calls": round(v["calls_per_step"], 1)}
                    for k, v in top},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--formats", default="int4,bf16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--paths", default="python,native", help="layer paths: python (each op from Python), "
                        "native (kakeya::decoder_layer, models/native_layer.py)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import psutil

    busy = round(psutil.cpu_percent(interval=0.5) / 100.0, 3)
    cases = []
    for fmt in args.formats.split(","):
        f = WeightFormat(fmt)
        model = load_model("smollm2", dtype=torch.bfloat16 if f is WeightFormat.BF16 else torch.float32).model
        quantize_model(model, f, **({"head": "int8"} if f.quantized else {}))  # decode: the int kernels
        engine = Engine(model)
        for rows in (int(r) for r in args.rows.split(",")):
            for layer_path in args.paths.split(","):
                native_layer.set_enabled(layer_path == "native")
                case = profile_case(engine, rows, args.ctx, args.steps)
                case["format"], case["layer_path"] = fmt, layer_path
                print(json.dumps({k: v for k, v in case.items() if k != "top_ops"}), flush=True)
                cases.append(case)
    src = Path(kakeya_runtime.__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"command": "python " + shlex.join(sys.argv), "commit": commit, "cpu_busy_before": busy,
              "torch_threads": torch.get_num_threads(), "cases": cases}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
