"""Attention over a KV cache, per layer: our invariant kernel against PyTorch's SDPA path (the peer) in the same run.

Shapes are SmolLM2's (3 K/V heads, 3 query heads each, head_dim 64) unless told otherwise: decode (one new
token), an appended chunk of `chunks` tokens over caches of `lengths` keys, and a fresh prompt of `chunks`
tokens (a chunk equal to the whole cache), in bf16 and fp32. K/V are
views into a preallocated buffer like the cache's, and a fresh buffer per repetition keeps them out of the
CPU's caches, as in a real model where 30 layers' K/V stream through per step.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

SCHEMA_VERSION = 1


def _time(fn, reps: int) -> float:
    fn(0)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(*, lengths: tuple[int, ...], chunks: tuple[int, ...], dtypes: tuple[str, ...], prompts: tuple[int, ...] = (),
            heads: int = 9, kv_heads: int = 3, head_dim: int = 64, reps: int = 30,
            buffers: int = 8) -> list[dict[str, Any]]:
    from kakeya_runtime.models import native
    from kakeya_runtime.models.layers import attend

    rows = []
    gen = torch.Generator().manual_seed(0)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        cases = [(s, t) for s in lengths for t in chunks] + [(p, p) for p in prompts]  # (keys, new tokens)
        for s in dict.fromkeys(s for s, _ in cases):
            # Several layers' worth of K/V, cycled, so each call reads memory the previous calls did not.
            kv = [torch.randn(2, 1, kv_heads, s + 64, head_dim, generator=gen).to(dtype) for _ in range(buffers)]
            for t in [t for keys, t in cases if keys == s]:
                q = torch.randn(1, t, heads, head_dim, generator=gen).transpose(1, 2).to(dtype)
                q_pos, k_pos = torch.arange(s - t, s), torch.arange(s)
                row: dict[str, Any] = {"dtype": dtype_name, "keys": s, "new_tokens": t}
                for backend in ("native", "sdpa"):
                    native.set_backend(backend)

                    def call(i, q=q, q_pos=q_pos, k_pos=k_pos, kv=kv, s=s):
                        k, v = kv[i % buffers][0][:, :, :s], kv[i % buffers][1][:, :, :s]
                        attend(q, k, v, q_pos, k_pos, scale=head_dim**-0.5, window=None)

                    row[f"{backend}_us"] = round(_time(call, reps) * 1e6, 1)
                native.set_backend("native")
                row["sdpa_over_native"] = round(row["sdpa_us"] / row["native_us"], 2)
                rows.append(row)
    return rows


def command(lengths: tuple[int, ...] = (1024, 4096, 7168), chunks: tuple[int, ...] = (1, 21, 128),
            dtypes: tuple[str, ...] = ("bfloat16", "float32"), prompts: tuple[int, ...] = (512,),
            threads: int | None = None,
            out: Path = Path("results/attention/attention.json")) -> dict[str, Any]:
    from rich.console import Console

    from kakeya_runtime.bench.machine import machine_info
    from kakeya_runtime.models import native

    if threads:
        torch.set_num_threads(threads)
    native.load()
    rows = measure(lengths=lengths, chunks=chunks, dtypes=dtypes, prompts=prompts,
                   reps=30 if max(prompts, default=0) <= 1024 else 5)
    doc = {"schema_version": SCHEMA_VERSION, "bench": "attention", "command": " ".join(sys.argv),
           "machine": machine_info(), "threads": torch.get_num_threads(), "native_bf16_dot": native.bf16_dot(),
           "native_bf16_amx": native.bf16_amx(),
           "shape": {"heads": 9, "kv_heads": 3, "head_dim": 64}, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    console = Console(stderr=True)
    for r in rows:
        console.print(f"{r['dtype']:9s} keys {r['keys']:5d} new {r['new_tokens']:4d}: native {r['native_us']:8.1f} us  "
                      f"sdpa {r['sdpa_us']:8.1f} us  x{r['sdpa_over_native']:.2f}")
    console.print(f"wrote {out}")
    return doc
