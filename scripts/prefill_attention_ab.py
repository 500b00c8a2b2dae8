"""The exact attention kernel on a 4k prefill's shapes (SmolLM2: 3 KV heads x 3 query heads, head_dim 64, 512-token
chunks each over the cache so far), one layer, timed against PyTorch's SDPA flash kernel on the same causal shapes;
or, with --dump/--compare, the outputs of 48 calls (head sizes 32-256, groups 1-4, fresh prompts, chunks, decode
rows, windows with sinks, scale 0) saved to / compared bit for bit against a file. `--library PATH` loads a given
build (a kernels/<key>/cached_attention.so from the cache dir, AMX routes) instead of this checkout's, so two
builds can be timed alternately.

PYTHONPATH=src:sdks/python/src python scripts/prefill_attention_ab.py --reps 15
PYTHONPATH=src:sdks/python/src python scripts/prefill_attention_ab.py --library OLD.so --reps 15 --out ab.json
PYTHONPATH=src:sdks/python/src python scripts/prefill_attention_ab.py --dump /tmp/ref.pt   # before the change
PYTHONPATH=src:sdks/python/src python scripts/prefill_attention_ab.py --compare /tmp/ref.pt  # after
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kakeya_runtime.models import native

T, CHUNK, H, HK, D = 4096, 512, 9, 3, 64


def prefill_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Seconds for one layer's chunks: chunk c's 3 x 512 query rows per KV head over keys 0 .. 512 (c + 1)."""
    pos, ops = torch.arange(T), torch.ops.kakeya
    t0 = time.perf_counter()
    for c0 in range(0, T, CHUNK):
        qc = q[:, :, c0 : c0 + CHUNK].contiguous().reshape(1, HK, H // HK * CHUNK, D)
        ops.cached_attention(qc, k[:, :, : c0 + CHUNK], v[:, :, : c0 + CHUNK], pos[c0 : c0 + CHUNK],
                             pos[: c0 + CHUNK], 0, 0, 0.125)
    return time.perf_counter() - t0


def calls() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for hk, g, d in [(3, 3, 64), (1, 4, 256), (2, 2, 128), (1, 1, 32), (4, 1, 96)]:
        for t0, t, window, sink in [(0, 700, 0, 0), (0, 1, 0, 0), (300, 257, 0, 0), (1023, 1, 0, 0), (0, 900, 200, 4),
                                    (600, 33, 128, 0), (2000, 77, 0, 0), (1500, 5, 300, 16)]:
            s = t0 + t
            q = (torch.randn(1, hk, g * t, d, generator=gen) * 2).bfloat16()
            k = (torch.randn(1, hk, s, d, generator=gen) * 2).bfloat16()
            v = torch.randn(1, hk, s, d, generator=gen).bfloat16()
            for scale in (d**-0.5, 0.0) if d == 64 else (d**-0.5,):
                out.append(torch.ops.kakeya.cached_attention(q, k, v, torch.arange(t0, s), torch.arange(s), window,
                                                             sink, scale))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--library", default="", help="a built cached_attention.so to load instead of this checkout's")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dump", default="", help="save the outputs of the bit-check calls here")
    ap.add_argument("--compare", default="", help="compare the bit-check calls against this file")
    ap.add_argument("--out", type=Path, help="append the timings to this JSON list")
    args = ap.parse_args()
    if args.library:
        torch.ops.load_library(args.library)
        torch.ops.kakeya.set_amx(True, True)
    else:
        native.load()
    if args.dump or args.compare:
        got = calls()
        if args.dump:
            torch.save(got, args.dump)
            print(f"saved {len(got)} outputs to {args.dump}")
        else:
            ref = torch.load(args.compare)
            bad = [i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if not torch.equal(a.view(torch.int16),
                                                                                             b.view(torch.int16))]
            print(f"{len(got)} calls, {len(bad)} differ: {bad}")
        return
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, T, D, generator=gen).bfloat16() for n in (H, HK, HK))
    def flash_layer() -> float:
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
        return time.perf_counter() - t0

    prefill_layer(q, k, v), flash_layer()
    ours, flash = [], []
    for _ in range(args.reps):  # alternated, so both see the same machine (this VM's speed drifts by tens of %)
        ours.append(prefill_layer(q, k, v))
        flash.append(flash_layer())
    ratio = statistics.median(a / b for a, b in zip(ours, flash, strict=True))
    library = args.library or str(native.library_path())
    print(f"{library}: ours best {min(ours) * 1e3:.2f} median {statistics.median(ours) * 1e3:.2f}"
          f" ms per layer; SDPA flash best {min(flash) * 1e3:.2f} median {statistics.median(flash) * 1e3:.2f} ms;"
          f" ours / SDPA median of the pairs {ratio:.3f}")
    if args.out:
        rows = json.loads(args.out.read_text()) if args.out.exists() else []
        rows.append({"command": " ".join(sys.argv), "library": library, "threads": torch.get_num_threads(),
                     "reps": args.reps, "ours_ms": [round(x * 1e3, 2) for x in ours],
                     "sdpa_ms": [round(x * 1e3, 2) for x in flash],
                     "ours_over_sdpa_median": round(ratio, 4)})
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
