"""One layer's fused sparse step timed alone, beside plain attention over as many in-order keys: SmolLM2 bf16 under
`sparse` (the defaults, or a codec given) prefilled to `--length` tokens of real text, one decode step (or, with
`--tokens T`, a T-token chunk, as a turn's message is read) run with `kakeya::sparse_step`'s arguments captured, then
that call repeated on 1 and 2 threads. The peer is plain attention (`kakeya::cached_attention_rows` for a decode
row, `kakeya::cached_attention` for a chunk's T tokens) over the same number of keys as a query attends (sinks +
window + top-k blocks), stored in position order. The gap between the two is what the fused call adds to the attention itself:
the indexer, the cold side's scattered 32-key blocks, the tripwire and the call's own setup. Also the same call's
time inside a decode loop (`--steps` steps, every layer's call timed), where the other layers' weights and caches
have evicted what it reads.

PYTHONPATH=src python scripts/sparse_step_call.py --length 7680 --out results/sparse/step_call_7680.json
PYTHONPATH=src python scripts/sparse_step_call.py --length 6400 --tokens 20 --steps 0 --out ...
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from kakeya_runtime.bench.engine import bench_text
from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.bench.sparse import cpu_busy
from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.kv import sparse as sparse_mod
from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache
from kakeya_runtime.models import native
from kakeya_runtime.models.loader import load_model


def per_call_us(fn, calls: int, reps: int = 3) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return round(best * 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=7680)
    ap.add_argument("--codec", default="identity")
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--steps", type=int, default=48, help="decode steps of the in-loop timing (0: skip it)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens of the captured step (1: a decode step)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    busy = cpu_busy()
    torch.set_num_threads(2)
    loaded = load_model("smollm2", dtype=torch.bfloat16)
    engine = Engine(loaded.model, prefill_chunk=512)
    ids = torch.tensor([loaded.tokenizer.encode(bench_text()).ids[: args.length]], dtype=torch.long)
    spec = PolicySpec.parse("sparse", {"codec": args.codec})
    cache = make_policy_cache(loaded.config, spec, capacity=args.length + 64, dtype=engine.dtype)
    engine.prefill(cache, ids[:, : -args.tokens])

    captured: list[tuple[tuple, dict]] = []
    real = native.sparse_step

    def capture(*a, **k):
        captured.append((a, k))
        return real(*a, **k)

    layer = cache.layers[args.layer]
    before = layer.counters
    sparse_mod.native.sparse_step = capture
    try:
        if args.tokens == 1:
            engine.decode_step(cache, ids[:, -1:])
        else:
            engine.prefill(cache, ids[:, -args.tokens:])
    finally:
        sparse_mod.native.sparse_step = real
    after = layer.counters
    if len(captured) <= args.layer:
        raise SystemExit(f"captured {len(captured)} sparse_step calls (codec {args.codec!r} takes another path?)")
    a, k = captured[args.layer]
    q = a[0]  # (1, Hk, G * T, D)
    # keys each (token, KV head) of the step attended: sinks, window and the selected blocks
    attended = (after.positions_attended - before.positions_attended) // (after.queries - before.queries)
    kh, d = q.shape[1], q.shape[3]
    gen = torch.Generator().manual_seed(0)
    t = args.tokens
    keys = [torch.randn(1, kh, attended + t - 1, d, generator=gen).bfloat16()]
    values = [torch.randn(1, kh, attended + t - 1, d, generator=gen).bfloat16()]
    pos = [torch.arange(attended + t - 1)]
    if t == 1:
        def plain() -> torch.Tensor:
            return native.cached_attention_rows(q, keys, values, pos, torch.full((1,), attended), 0.125, window=[0],
                                                sink=[0])
    else:  # token i sees attended + i keys, as many as its sparse step attends (the first) or a few more
        q_pos = torch.arange(attended - 1, attended - 1 + t)

        def plain() -> torch.Tensor:
            return native.cached_attention(q, keys[0], values[0], q_pos, pos[0], 0.125)
    result = {"command": "python " + shlex.join(sys.argv), "machine": machine_info(), "cpu_busy_before": busy,
              "length": args.length, "codec": args.codec, "layer": args.layer, "tokens": t,
              "keys_attended": attended, "q_shape": list(q.shape), "threads": {}}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        step_us = per_call_us(lambda: real(*a, **k), args.calls)
        plain_us = per_call_us(plain, args.calls)
        result["threads"][str(threads)] = {"sparse_step_us": step_us, "plain_attention_us": plain_us,
                                           "step_over_plain": round(step_us / plain_us, 2)}
    torch.set_num_threads(2)
    # the call inside a decode loop: every layer's sparse_step of `steps` steps, timed where it runs
    in_loop: list[float] = []

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            in_loop.append(time.perf_counter() - t0)

    sparse_mod.native.sparse_step = timed
    try:
        for _ in range(args.steps):
            engine.decode_step(cache, ids[:, -1:])
    finally:
        sparse_mod.native.sparse_step = real
    if in_loop:
        result["in_decode_loop_us_median_2_threads"] = round(1e6 * sorted(in_loop)[len(in_loop) // 2], 1)
        result["in_decode_loop_calls"] = len(in_loop)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
