"""The exact attention kernel on a 4k prefill's shapes (SmolLM2: 3 KV heads x 3 query heads, head_dim 64, 512-token
chunks each over the cache so far), one layer, timed against PyTorch's SDPA flash kernel on the same causal shapes;
or, with --dump/--compare, the outputs of 48 calls (head sizes 32-256, groups 1-4, fresh prompts, chunks, decode
rows, windows with sinks, scale 0) saved to / compared bit for bit against a file. `--library PATH` loads a given
build (a kernels/<key>/cached_attention.so from the cache dir, AMX routes) instead of this checkout's, so two
builds can be timed alternately.

PYTHONPATH=src:sdks/python/src python scripts/prefill_attention_ab.py --reps 15
PYTHONPATH=src:sdks/python/src python scripts/prefill_attention_ab.py --library OLD.so --reps 15
PYTHONPATH=src:sdks/python/src python scripts/prefill_attention_ab.py --dump /tmp/ref.pt   # before the change
PYTHONPATH=src:sdks/python/src python scripts/prefill_attention_ab.py --compare /tmp/ref.pt  # after
"""

from __future__ import annotations

import argparse
import time

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
    prefill_layer(q, k, v)
    ours = sorted(prefill_layer(q, k, v) for _ in range(args.reps))
    flash = []
    for _ in range(args.reps + 1):
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
        flash.append(time.perf_counter() - t0)
    flash = sorted(flash[1:])
    print(f"{args.library or native.library_path()}: ours best {ours[0] * 1e3:.2f} median {ours[len(ours) // 2] * 1e3:.2f}"
          f" ms per layer; SDPA flash best {flash[0] * 1e3:.2f} median {flash[len(flash) // 2] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
