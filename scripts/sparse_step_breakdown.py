"""Where a sparse decode step goes at one context length, against sink_window's and full's steps in the same
process: per decode step, the governed layers' attention side (sparse: attend, split into the native calls —
the fused step or indexer / attention / tripwire — the decode of selected lattice blocks, the ring and cold-tier
writes, and the Python around them; sink_window/full: update_and_fetch plus the attention kernel), and the
step's total.

PYTHONPATH=src:sdks/python/src python scripts/sparse_step_breakdown.py --length 7680 --tokens 24 \
    --policies 'sink_window;sparse:codec=identity;sparse' --out results/sparse/decode_v5_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from kakeya_runtime.bench.engine import bench_text
from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.bench.sparse import cpu_busy
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.kv import sink_window as sw_mod
from kakeya_runtime.kv import sparse as sparse_mod
from kakeya_runtime.kv.cache import FullLayerKV
from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache
from kakeya_runtime.models import layers as layers_mod
from kakeya_runtime.models import native

TIMERS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[name] += time.perf_counter() - t0
            CALLS[name] += 1
    return wrapper


def instrument() -> None:
    cls = sparse_mod.SparseLayerKV
    for name in ("attend", "_complete_blocks", "_decode_blocks", "_write_hot"):
        setattr(cls, name, timed(f"sparse.{name}", getattr(cls, name)))
    for name in ("sparse_step", "sparse_step_decoded", "block_select", "sparse_attention", "sparse_check"):
        setattr(sparse_mod.native, name, timed(f"native.{name}", getattr(sparse_mod.native, name)))
    cls_sw = sw_mod.SinkWindowLayerKV
    cls_sw.update_and_fetch = timed("sink_window.update_and_fetch", cls_sw.update_and_fetch)
    FullLayerKV.update_and_fetch = timed("full.update_and_fetch", FullLayerKV.update_and_fetch)
    native.cached_attention_rows = timed("native.cached_attention_rows", native.cached_attention_rows)
    native.cached_attention = timed("native.cached_attention", native.cached_attention)
    layers_mod.Attention.forward = timed("Attention.forward", layers_mod.Attention.forward)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=7680)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--policies", default="full;sink_window;sparse:codec=identity;sparse")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    busy = cpu_busy()
    from kakeya_runtime.models.loader import load_model

    loaded = load_model(args.model, dtype=torch.bfloat16)
    cfg = loaded.config
    engine = Engine(loaded.model, prefill_chunk=512)
    ids = torch.tensor([loaded.tokenizer.encode(bench_text()).ids[: args.length]], dtype=torch.long)
    instrument()
    out = {}
    for policy in args.policies.split(";"):
        name, _, rest = policy.partition(":")
        params = dict(kv.split("=", 1) for kv in rest.split(",")) if rest else {}
        spec = PolicySpec.parse(name, params)
        cache = make_policy_cache(cfg, spec, capacity=args.length + args.tokens + 2, dtype=engine.dtype)
        engine.prefill(cache, ids[:, :-1])
        TIMERS.clear()
        CALLS.clear()
        step_s = []
        s = engine.stream(cache, ids[:, -1:], GenerateRequest(args.tokens, stop_ids=()))
        t0 = time.perf_counter()
        for _ in s:
            t1 = time.perf_counter()
            step_s.append(t1 - t0)
            t0 = t1
        steps = len(step_s) - 1  # the first yield follows the prompt's last token
        per_step = {k: 1000 * v / steps for k, v in TIMERS.items()}
        rec = {"ms_per_step_median": 1000 * statistics.median(step_s[1:]),
               "ms_per_step_mean": 1000 * statistics.fmean(step_s[1:]),
               "ms_per_token_engine": 1000 * s.result.decode_s / max(1, s.result.decode_tokens - 1),
               "per_step_ms": per_step, "calls_per_step": {k: v / steps for k, v in CALLS.items()}}
        if isinstance(cache, sparse_mod.SparseKV):
            hits, misses = cache.decoded_counts()
            rec["decoded_hits"], rec["decoded_misses"] = hits, misses
        out[policy] = rec
        print(policy, json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()
                                  if k != "per_step_ms"}))
        for k, v in sorted(per_step.items()):
            print(f"    {k:40s} {v:8.3f} ms/step")
        del cache
    result = {"command": " ".join(sys.argv), "machine": machine_info(), "cpu_busy_before": busy,
              "loadavg_1m_after": os.getloadavg()[0], "threads": torch.get_num_threads(), "model": args.model,
              "length": args.length, "tokens": args.tokens, "policies": out}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
