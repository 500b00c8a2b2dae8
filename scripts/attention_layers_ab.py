"""The exact attention kernel on a long session's shapes (SmolLM2: 3 KV heads x 3 query rows, head_dim 64), over
30 layers of distinct K/V (so no layer's keys stay in L2 from the last): a decode row and a 21-token chunk over
S cached keys, per 30 layers; or, with --dump/--compare, the outputs of 117 shapes (lengths, chunk sizes, a window
with sinks) saved to / compared bit for bit against a file, to check a kernel change keeps the bits.

PYTHONPATH=src:sdks/python/src python scripts/attention_layers_ab.py --keys 7168 --tokens 1,21 --reps 30
PYTHONPATH=src python scripts/attention_layers_ab.py --keys 4096 --tokens 1 --distinct 1 --out r.json  # K/V in cache
PYTHONPATH=src python scripts/attention_layers_ab.py --keys 4096 --tokens 1 --library OLD.so --out r.json  # a build
PYTHONPATH=src:sdks/python/src python scripts/attention_layers_ab.py --dump /tmp/ref.pt   # before the change
PYTHONPATH=src:sdks/python/src python scripts/attention_layers_ab.py --compare /tmp/ref.pt  # after
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

H, G, D, LAYERS = 3, 3, 64, 30


def one_call(keys: int, tokens: int, seed: int, window: int, sink: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    kb = torch.randn(1, H, keys + 37, D, generator=gen).bfloat16()  # a cache with spare capacity, as the engine's
    vb = torch.randn(1, H, keys + 37, D, generator=gen).bfloat16()
    q = torch.randn(1, H, G * tokens, D, generator=gen).bfloat16()
    return native.cached_attention(q, kb[:, :, :keys], vb[:, :, :keys], torch.arange(keys - tokens, keys),
                                   torch.arange(keys), 0.125, window=window or None, sink=sink)


def shapes() -> list[tuple[int, int, int, int]]:
    out = [(s, t, 0, 0) for s in (1, 5, 31, 32, 33, 127, 128, 129, 200, 511, 512, 513, 700, 1024, 1500, 2049,
                                  4100, 7129)
           for t in (1, 2, 5, 16, 21, 29, 40) if t <= s]
    return out + [(2000, 1, 512, 4), (2000, 21, 512, 4), (3000, 7, 100, 0), (900, 3, 0, 0)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=7168)
    ap.add_argument("--tokens", default="1,21")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dump")
    ap.add_argument("--compare")
    ap.add_argument("--distinct", type=int, default=LAYERS,
                    help="distinct layers' K/V cycled through (30: read from memory as in a decode loop; 1: cached)")
    ap.add_argument("--out", type=Path, help="append the timings to this JSON list")
    ap.add_argument("--library", type=Path, help="a built cached_attention.so to load instead of this checkout's")
    args = ap.parse_args()
    if args.library:
        native.library_path = lambda: args.library  # this process's kernels: that build (read at the first call)
    if args.dump or args.compare:
        outs = {str(c): one_call(*c[:2], i, *c[2:]) for i, c in enumerate(shapes())}
        if args.dump:
            torch.save(outs, args.dump)
            print(f"dumped {len(outs)} shapes")
        else:
            ref = torch.load(args.compare)
            bad = [k for k in ref if not torch.equal(ref[k].view(torch.int16), outs[k].view(torch.int16))]
            print(f"shapes {len(ref)} differing {len(bad)} {bad[:10]}")
        return
    cap = args.keys + 64
    ks = [torch.randn(1, H, cap, D).bfloat16() for _ in range(args.distinct)]
    vs = [torch.randn(1, H, cap, D).bfloat16() for _ in range(args.distinct)]
    kpos = torch.arange(args.keys)
    for tokens in (int(x) for x in args.tokens.split(",")):
        q = torch.randn(1, H, G * tokens, D).bfloat16()
        qpos = torch.arange(args.keys - tokens, args.keys)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for layer in range(LAYERS):
                i = layer % args.distinct
                native.cached_attention(q, ks[i][:, :, :args.keys], vs[i][:, :, :args.keys], qpos, kpos, 0.125)
            times.append(time.perf_counter() - t0)
        print(f"keys={args.keys} tokens={tokens} {LAYERS} layers ({args.distinct} distinct): median "
              f"{statistics.median(times) * 1e3:.2f} ms  min {min(times) * 1e3:.2f} ms")
        if args.out:
            rows = json.loads(args.out.read_text()) if args.out.exists() else []
            rows.append({"command": " ".join(sys.argv), "library": str(native.library_path()), "keys": args.keys, "tokens": tokens,
                         "distinct_layers": args.distinct, "reps": args.reps, "threads": torch.get_num_threads(),
                         "ms_per_30_layers_median": round(statistics.median(times) * 1e3, 3),
                         "ms_per_30_layers_min": round(min(times) * 1e3, 3)})
            args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
