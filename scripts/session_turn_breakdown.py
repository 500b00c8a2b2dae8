"""Where a long session's turn time goes, per turn, straight on the engine (no server): the append's prefill
chunk and the reply's decode steps, and inside them the sparse layers' own work (attend: ring/cold-tier writes,
d4 encoding of completed blocks, decoding of selected blocks, the fused kernel). The same turn shape as
`kakeya bench session` (12..28 appended tool-output tokens, a 4-token greedy reply).

PYTHONPATH=src:sdks/python/src python scripts/session_turn_breakdown.py --policies 'sparse;sparse:codec=identity' \
    --turns 300 --out results/session/turn_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from rich.console import Console

from kakeya_runtime.bench.long_session import load_served, parse_policy, tool_output
from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.kv import sparse as sparse_mod
from kakeya_runtime.sessions.policy import PolicyRegistry

TIMERS: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[name] += time.perf_counter() - t0
    return wrapper


def instrument() -> None:
    cls = sparse_mod.SparseLayerKV
    for name in ("attend", "_complete_blocks", "_decode_blocks", "_write_hot"):
        setattr(cls, name, timed(name, getattr(cls, name)))
    sparse_mod.native.sparse_step = timed("sparse_step", sparse_mod.native.sparse_step)
    sparse_mod.native.block_select = timed("block_select", sparse_mod.native.block_select)
    sparse_mod.native.sparse_attention = timed("sparse_attention", sparse_mod.native.sparse_attention)
    sparse_mod.native.cached_attention = timed("cached_attention", sparse_mod.native.cached_attention)
    sparse_mod.native.cached_attention_rows = timed("cached_attention", sparse_mod.native.cached_attention_rows)


class Tok:
    def __init__(self, tokenizer_json: str) -> None:
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_str(tokenizer_json)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def snapshot() -> dict[str, float]:
    return dict(TIMERS)


def delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in TIMERS.items()}


def run_policy(engine: Engine, tok: Tok, policy: str, turns: int, seed: int) -> list[dict]:
    registry = PolicyRegistry()
    p = parse_policy(policy)
    spec = registry.resolve(p["name"], p.get("params") or {}, engine.config, 8192)
    cache = registry.build(engine, spec, 8192)
    rng = random.Random(seed)
    rows = []
    ids = tok.encode("You are a coding agent. Tool outputs follow.\n")
    pending: list[int] = []
    for turn in range(turns):
        n = rng.randint(12, 28)
        new = pending + (ids if turn == 0 else []) + tool_output(rng, tok, n)
        hist = cache.length
        layers = [lay for lay in getattr(cache, "layers", []) if isinstance(lay, sparse_mod.SparseLayerKV)]
        miss0 = sum(lay.decoded_misses for lay in layers)
        s0 = snapshot()
        t0 = time.perf_counter()
        out = engine.prefill(cache, torch.tensor([new]))
        t1 = time.perf_counter()
        pre = delta(s0)
        layers = [lay for lay in getattr(cache, "layers", []) if isinstance(lay, sparse_mod.SparseLayerKV)]
        miss1 = sum(lay.decoded_misses for lay in layers)
        token = int(out.logits[0, -1].argmax())
        s1 = snapshot()
        t2 = time.perf_counter()
        for _ in range(3):  # the reply: 4 tokens, the first from the prefill; the last is appended next turn
            out = engine.decode_step(cache, torch.tensor([[token]]))
            token = int(out.logits[0, -1].argmax())
        t3 = time.perf_counter()
        dec = delta(s1)
        miss2 = sum(lay.decoded_misses for lay in layers)
        pending = [token]
        rows.append({"turn": turn, "history_before": hist, "prefill_tokens": len(new), "prefill_s": t1 - t0,
                     "decode3_s": t3 - t2, "prefill_parts_s": pre, "decode_parts_s": dec,
                     "prefill_misses": miss1 - miss0, "decode_misses": miss2 - miss1,
                     "cold_blocks": max((lay.n_blocks for lay in layers), default=0)})
    return rows


def buckets(rows: list[dict], k: int = 10) -> list[dict]:
    rows = rows[1:]
    n = len(rows)
    out = []
    for i in range(k):
        part = rows[i * n // k:(i + 1) * n // k]
        med = {"history_first": part[0]["history_before"], "prefill_s": statistics.median(r["prefill_s"] for r in part),
               "decode3_s": statistics.median(r["decode3_s"] for r in part),
               "turn_s": statistics.median(r["prefill_s"] + r["decode3_s"] for r in part),
               "prefill_misses": statistics.median(r["prefill_misses"] for r in part),
               "decode_misses": statistics.median(r["decode_misses"] for r in part),
               "cold_blocks_last": part[-1]["cold_blocks"]}
        for side in ("prefill", "decode"):
            keys = part[0][f"{side}_parts_s"].keys()
            med[f"{side}_parts_s"] = {key: statistics.median(r[f"{side}_parts_s"].get(key, 0.0) for r in part)
                                      for key in keys}
        out.append(med)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="sparse;sparse:codec=identity")
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    served = load_served("smollm2", "auto", None, Console(quiet=True))
    engine = Engine(served.model)
    tok = Tok(served.tokenizer_json)
    instrument()
    result = {"command": "PYTHONPATH=src:sdks/python/src python scripts/session_turn_breakdown.py "
                         f"--policies '{args.policies}' --turns {args.turns} --seed {args.seed}"
                         + (f" --out {args.out}" if args.out else ""),
              "load_avg_1m_before": load, "torch_threads": torch.get_num_threads(), "runs": {}}
    for policy in args.policies.split(";"):
        TIMERS.clear()
        rows = run_policy(engine, tok, policy, args.turns, args.seed)
        b = buckets(rows)
        result["runs"][policy] = {"buckets": b, "turns": rows,
                                  "last_over_first_turn_p50": b[-1]["turn_s"] / b[0]["turn_s"]}
        print(policy)
        for i, x in enumerate(b):
            pp, dp = x["prefill_parts_s"], x["decode_parts_s"]
            print(f" b{i} hist={x['history_first']:5d} blocks={x['cold_blocks_last']:4d} turn={x['turn_s']*1e3:6.1f}"
                  f" prefill={x['prefill_s']*1e3:6.1f} (attend {pp.get('attend', 0)*1e3:5.1f}"
                  f" complete {pp.get('_complete_blocks', 0)*1e3:4.1f} decblk {pp.get('_decode_blocks', 0)*1e3:4.1f}"
                  f" kern {(pp.get('sparse_step', 0) + pp.get('sparse_attention', 0) + pp.get('block_select', 0))*1e3:5.1f}"
                  f" miss {x['prefill_misses']:.0f} exact {pp.get('cached_attention', 0)*1e3:5.1f})"
                  f" decode3={x['decode3_s']*1e3:6.1f} (attend {dp.get('attend', 0)*1e3:5.1f}"
                  f" decblk {dp.get('_decode_blocks', 0)*1e3:4.1f}"
                  f" kern {(dp.get('sparse_step', 0) + dp.get('sparse_attention', 0) + dp.get('block_select', 0))*1e3:5.1f}"
                  f" miss {x['decode_misses']:.0f} exact {dp.get('cached_attention', 0)*1e3:5.1f})")
        print(f" last/first turn p50 {result['runs'][policy]['last_over_first_turn_p50']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
