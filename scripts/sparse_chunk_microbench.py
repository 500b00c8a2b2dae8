"""Time the sparse step's native calls on one layer (SmolLM2-135M's shapes: 3 KV heads, 3 query heads each,
head_dim 64, bf16) at a given history: block_select (the indexer) and sparse_attention, for a chunk of T tokens
and for one decode token, with the default sparse spec (sink 4, window 512, block 32, topk 32, budget 0.125).
Queries of a chunk share a component (`--shared`), as a turn's tokens do, so their selections overlap.

PYTHONPATH=src:sdks/python/src python scripts/sparse_chunk_microbench.py --history 6400 --tokens 21
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kakeya_runtime.models import native


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--history", type=int, default=6400)
    ap.add_argument("--tokens", type=int, default=21)
    ap.add_argument("--shared", type=float, default=0.8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=1, help="cold tiers cycled through (30: out of cache, as a model)")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    B, H, G, D, sink, window, block, topk, budget = 1, 3, 3, 64, 4, 512, 32, 32, 0.125
    native.load()
    ring = window + block // 2
    n_hist = a.history
    n_blocks = (n_hist - ring - sink) // block
    dt = torch.bfloat16
    colds = [(torch.randn(B, H, n_blocks * block, D).to(dt), torch.randn(B, H, n_blocks * block, D).to(dt))
             for _ in range(a.layers)]
    cold_k, cold_v = colds[0]
    kb = cold_k.float().view(B, H, n_blocks, block, D)
    kmin, kmax = kb.amin(3).to(dt).contiguous(), kb.amax(3).to(dt).contiguous()
    slot = torch.arange(n_blocks, dtype=torch.long)
    cold_head = torch.arange(H, dtype=torch.long)
    hot_pos = torch.cat([torch.arange(sink), torch.arange(sink + n_blocks * block, sink + n_blocks * block + ring)])
    hot_k = torch.randn(B, H, hot_pos.numel(), D).to(dt)
    hot_v = torch.randn(B, H, hot_pos.numel(), D).to(dt)
    scale = D ** -0.5
    out = {}
    for name, T in (("chunk", a.tokens), ("decode", 1)):
        base = torch.randn(B, H, G, 1, D)
        q = (a.shared * base + (1 - a.shared) * torch.randn(B, H, G, T, D)).reshape(B, H, G * T, D).to(dt).contiguous()
        last = int(hot_pos[-1])
        q_pos = torch.arange(last - T + 1, last + 1, dtype=torch.long)
        t_sel = t_att = 0.0
        for i in range(a.reps + 3):
            t0 = time.perf_counter()
            sel, _ = native.block_select(q, kmin, kmax, q_pos, window=window, sink=sink, block=block, topk=topk,
                                         budget=budget)
            t1 = time.perf_counter()
            ck, cv = colds[i % a.layers]
            native.sparse_attention(q, (hot_k, hot_v, hot_pos), (ck, cv, slot), sel, q_pos, scale,
                                    window=window, sink=sink, block=block, cold_head=cold_head)
            t2 = time.perf_counter()
            if i >= 3:
                t_sel += t1 - t0
                t_att += t2 - t1
        t_hot = 0.0
        for i in range(a.reps + 3):  # the hot side alone: nothing selected
            t1 = time.perf_counter()
            native.sparse_attention(q, (hot_k, hot_v, hot_pos), (cold_k, cold_v, slot), torch.zeros_like(sel), q_pos,
                                    scale, window=window, sink=sink, block=block, cold_head=cold_head)
            if i >= 3:
                t_hot += time.perf_counter() - t1
        bits = torch.zeros(B, H, n_blocks, dtype=torch.bool)
        for j in range(n_blocks):
            bits[..., j] = ((sel[..., j // 64] >> (j % 64)) & 1).bool().any(-1)
        out[name] = {"tokens": T, "block_select_ms": 1e3 * t_sel / a.reps, "sparse_attention_ms": 1e3 * t_att / a.reps,
                     "hot_only_ms": 1e3 * t_hot / a.reps,
                     "union_blocks_per_head": bits.sum(-1).float().mean().item(), "cold_blocks": n_blocks}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
