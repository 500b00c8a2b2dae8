"""How close the decode step's two big kernels run to this machine's memory stream, in one run: a plain fp32 sum
(torch, the stream a prefetcher likes best) against our attention kernel over SmolLM2-shaped caches (30 layers of
3 KV heads x 3 query heads, head_dim 64, bf16: a decode step's reads; hot: one layer's caches, 30 times) and our
int4 projections over SmolLM2's 30 layers of weights at one row (cold: every layer its own weights, as a decode step
reads them; hot: one layer's, 30 times). GB/s counts the bytes each must read once. Best of `--reps` timed loops per
case.

PYTHONPATH=src python scripts/memory_roofline.py --out results/engine/memory_roofline.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.bench.sparse import cpu_busy
from kakeya_runtime.engine.weights import Int4Linear
from kakeya_runtime.models import native

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64
PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down (N, K)


def best_ms(fn: Callable[[], None], reps: int, loops: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best * 1e3


def stream(reps: int) -> dict[str, float]:
    x = torch.ones(600_000_000 // 4)
    ms = best_ms(lambda: x.sum(), reps, 3)
    return {"bytes": x.nbytes, "ms": round(ms, 3), "gb_s": round(x.nbytes / ms / 1e6, 2)}


def attention(keys: int, rows: int, reps: int, hot: bool = False) -> dict[str, float]:
    """One decode step's attention over LAYERS layers: `rows` sequences of `keys` keys each (rows > 1: one
    cached_attention_rows call per layer, as a batched step makes). `hot`: every layer reads the first layer's
    caches (small ones then stay in the core's L2), against each its own (a decode step's reads)."""
    gen = torch.Generator().manual_seed(0)
    shape = (1, KV_HEADS, keys, HEAD_DIM)
    distinct = 1 if hot else LAYERS

    def caches() -> list[list[torch.Tensor]]:
        made = [[torch.randn(shape, generator=gen).bfloat16() for _ in range(rows)] for _ in range(distinct)]
        return made * (LAYERS // distinct)

    k, v = caches(), caches()
    pos = [torch.arange(keys)] * rows
    q = torch.randn(rows, KV_HEADS, GROUP, HEAD_DIM, generator=gen).bfloat16()
    q_pos = torch.full((rows,), keys)

    def step() -> None:
        for layer in range(LAYERS):
            native.cached_attention_rows(q, k[layer], v[layer], pos, q_pos, 0.125, window=[0] * rows,
                                         sink=[0] * rows)

    ms = best_ms(step, reps, 10)
    read = 2 * LAYERS * rows * keys * KV_HEADS * HEAD_DIM * 2
    return {"keys": keys, "rows": rows, "hot": hot, "ms": round(ms, 3), "bytes": read,
            "gb_s": round(read / ms / 1e6, 2), "us_per_row_layer": round(ms * 1e3 / (rows * LAYERS), 2),
            "ns_per_key_head_thread": round(ms * 1e6 * torch.get_num_threads() / (LAYERS * rows * keys * KV_HEADS), 1)}


def projections(reps: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    mods = [[Int4Linear(torch.randn(n, k) * 0.02, None) for n, k in PROJECTIONS] for _ in range(LAYERS)]
    args = [[(m.packed, m.scales_zeros.view(torch.float32)) for m in layer] for layer in mods]
    xs = {k: torch.randn(1, k).bfloat16() for _, k in PROJECTIONS}
    read = sum(p.nbytes + s.nbytes for layer in args for p, s in layer)

    def run(layers: list) -> None:
        for layer in layers:
            for (packed, sz), (_, k) in zip(layer, PROJECTIONS, strict=True):
                native.quant_linear(xs[k], packed, sz, 4)

    out = {}
    for name, layers in (("cold", args), ("hot", [args[0]] * LAYERS)):
        ms = best_ms(lambda layers=layers: run(layers), reps, 10)
        out[name] = {"ms": round(ms, 3), "bytes": read, "gb_s": round(read / ms / 1e6, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = {"command": "python " + shlex.join(sys.argv), "machine": machine_info(), "cpu_busy_before": cpu_busy(),
              "runs": {}}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        run = {"stream_fp32_sum": stream(args.reps),
               "attention": [attention(keys, 1, args.reps) for keys in (512, 2048, 6400)]
               + [attention(335, 8, args.reps)],
               "attention_hot": [attention(keys, 1, args.reps, hot=True) for keys in (512, 2048)],
               "int4_projections_one_row": projections(args.reps)}
        result["runs"][str(threads)] = run
        print(json.dumps({"threads": threads, **run}))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
