"""One sparse layer's decode step at one context length, cut into its native calls on fixed inputs (SmolLM2's
shape: 3 KV heads x 3 query heads, head_dim 64; random bf16 K/V, so the indexer's picks are arbitrary but their
count is the policy's): the fused step, the indexer alone, the attention over the hot set alone and with the
selected cold blocks, and cached_attention over sink_window's keys (its peer). Medians over `--reps` calls, µs.

PYTHONPATH=src python scripts/sparse_kernel_profile.py --length 7680 --codec identity
(`--stat min` reports the fastest call, steadier on a noisy host; `--library OLD.so` times another build.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kakeya_runtime.bench.sparse import cpu_busy
from kakeya_runtime.kv.compress import make_codec
from kakeya_runtime.kv.sparse import SparseLayerKV
from kakeya_runtime.models import native

ONLY = ""
STAT = statistics.median


def timed(fn, reps: int, name: str = "") -> float:
    if ONLY and name != ONLY:
        return 0.0
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return 1e6 * STAT(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=7680)
    ap.add_argument("--codec", default="identity")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--only", default="", help="time only this entry (for perf record)")
    ap.add_argument("--stat", choices=["median", "min"], default="median", help="of the timed calls")
    ap.add_argument("--library", type=Path, help="a built cached_attention.so to load instead of this checkout's")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    global ONLY, STAT
    ONLY = args.only
    STAT = min if args.stat == "min" else statistics.median
    if args.library:
        native.library_path = lambda: args.library  # this process's kernels: that build
    torch.set_num_threads(args.threads)
    busy = cpu_busy()
    torch.manual_seed(0)
    hk, g, d, dt = 3, 3, 64, torch.bfloat16
    layer = SparseLayerKV(1, hk, d, sink=4, window=512, block=32, topk=32, budget=0.125,
                          max_positions=args.length + 64, codec=make_codec(args.codec, 0, d, "cpu"), dtype=dt)
    scale = d ** -0.5
    with torch.inference_mode():
        for lo in range(0, args.length, 512):  # a prompt in chunks, as the engine prefills
            n = min(512, args.length - lo)
            pos = torch.arange(lo, lo + n)
            layer.attend(torch.randn(1, hk * g, n, d, dtype=dt), torch.randn(1, hk, n, d, dtype=dt),
                         torch.randn(1, hk, n, d, dtype=dt), pos, scale=scale)
        p = args.length
        q = torch.randn(1, hk * g, 1, d, dtype=dt)
        k1, v1 = torch.randn(1, hk, 1, d, dtype=dt), torch.randn(1, hk, 1, d, dtype=dt)
        layer.attend(q, k1, v1, torch.tensor([p]), scale=scale)  # the state a decode step at p reads
        qg = q.reshape(1, hk, g, d).contiguous()
        qpos = torch.tensor([p])
        hot = layer._hot_all
        w = dict(window=layer.window, sink=layer.sink, block=layer.block)
        kmin, kmax, nb = layer.kmin, layer.kmax, layer.n_blocks
        rec: dict[str, float] = {}
        if layer.codec.direct:
            cold = layer._decode_blocks(None)
            rec["sparse_step"] = timed(lambda: native.sparse_step(
                qg, hot, cold, kmin, kmax, nb, qpos, scale, topk=layer._topk_t, cold_head=layer._cold_head_t,
                counters=layer._counts, budget=layer.budget, **w), args.reps, "sparse_step")
            select, scored = native.block_select(qg, kmin[:, :, :nb], kmax[:, :, :nb], qpos, topk=layer._topk_t,
                                                 scale=scale, budget=layer.budget, **w)
            rec["block_select"] = timed(lambda: native.block_select(
                qg, kmin[:, :, :nb], kmax[:, :, :nb], qpos, topk=layer._topk_t, scale=scale, budget=layer.budget,
                **w), args.reps, "block_select")
            rec["sparse_attention"] = timed(lambda: native.sparse_attention(
                qg, hot, cold, select, qpos, scale, cold_head=layer._cold_head_t, **w), args.reps, "sparse_attention")
            none = torch.zeros_like(select)
            rec["sparse_attention_hot_only"] = timed(lambda: native.sparse_attention(
                qg, hot, cold, none, qpos, scale, cold_head=layer._cold_head_t, **w), args.reps,
                "sparse_attention_hot_only")
            _, seen = native.sparse_attention(qg, hot, cold, select, qpos, scale, cold_head=layer._cold_head_t, **w)
            rec["sparse_check"] = timed(lambda: native.sparse_check(
                seen, scored, qpos, topk=layer._topk_t, counters=layer._counts.clone(), budget=layer.budget, **w),
                args.reps, "sparse_check")
            rec["cold_keys_per_head"] = float(seen[0, :, 0, 1].float().mean())
        # sink_window's peer: the same hot keys (sinks + ring) through cached_attention with its window rule
        k_hot, v_hot, hot_pos = hot
        rec["cached_attention_window"] = timed(lambda: native.cached_attention(
            qg, k_hot, v_hot, qpos, hot_pos, scale, window=512, sink=4), args.reps, "cached_attention_window")
        step = [p + 1]

        def decode() -> None:  # a whole decode step through the layer (writes, Python, the native call)
            layer.attend(q, k1, v1, torch.tensor([step[0]]), scale=scale)
            step[0] += 1
        rec["attend_step"] = timed(decode, min(args.reps, 60), "attend_step")
    for k, v in rec.items():
        print(f"{k:32s} {v:9.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "cpu_busy_before": busy,
                                              "threads": args.threads, "length": args.length, "codec": args.codec,
                                              "stat": args.stat, "library": str(native.load()),
                                              f"us_{args.stat}": rec}, indent=1))


if __name__ == "__main__":
    main()
