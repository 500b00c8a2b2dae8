"""A turn's message on a d4 sparse cache, in process: SmolLM2 bf16 prefilled to `--length` tokens of real text, then a
`--tokens`-token chunk (whose blocks outgrow the decoded-block cache, so layers take the scratch-cache step)
prefilled and trimmed back (`spare` = the chunk), `--rounds` times, alternating between the scratch step given the refused call's
selection (as the policy runs) and the scratch step running the indexer again (the previous behaviour). Both give
the same logits (checked). Reports each arm's chunk times (ms), the median of each and how many layers took the
scratch step.

PYTHONPATH=src python scripts/sparse_oversize_ab.py --length 6400 --tokens 20 --out results/sparse/oversize_selected/ab.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from kakeya_runtime.bench.engine import bench_text
from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.bench.sparse import cpu_busy
from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache
from kakeya_runtime.kv.sparse import SparseLayerKV
from kakeya_runtime.models.base import Logits
from kakeya_runtime.models.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=6400)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    busy = cpu_busy()
    loaded = load_model("smollm2", dtype=torch.bfloat16)
    engine = Engine(loaded.model, prefill_chunk=512)
    text = loaded.tokenizer.encode(bench_text()).ids
    ids = torch.tensor([text[: args.length + args.tokens]], dtype=torch.long)
    cache = make_policy_cache(loaded.config, PolicySpec.parse("sparse", {"codec": "d4", "spare": args.tokens}),
                              capacity=args.length + args.tokens + 8, dtype=engine.dtype)
    engine.prefill(cache, ids[:, : args.length])
    layers = [x for x in cache if isinstance(x, SparseLayerKV)]
    given = SparseLayerKV._fused_decoded_call

    def again(self, qg, hot, positions, scale, maps, step, decoded, selected=None):
        return given(self, qg, hot, positions, scale, maps, step, decoded, None)

    chunk = ids[:, args.length:]
    times: dict[str, list[float]] = {"given": [], "again": []}
    logits: dict[str, torch.Tensor] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for arm in ("given", "again") if r % 2 == 0 else ("again", "given"):
            SparseLayerKV._fused_decoded_call = given if arm == "given" else again
            before = sum(x.oversize_steps for x in layers)
            t0 = time.perf_counter()
            out = engine.prefill(cache, chunk, logits=Logits.LAST).logits
            dt = (time.perf_counter() - t0) * 1e3
            oversize = sum(x.oversize_steps for x in layers) - before
            if oversize == 0:
                raise SystemExit("no layer took the scratch-cache step: pick a longer --length")
            cache.trim(args.length)
            if r:
                times[arm].append(round(dt, 2))
            if arm in logits and not torch.equal(logits[arm], out):
                raise SystemExit("a round's logits differ from the first")
            logits.setdefault(arm, out)
    SparseLayerKV._fused_decoded_call = given
    if not torch.equal(logits["given"], logits["again"]):
        raise SystemExit("the two arms' logits differ")
    result = {"command": "python " + shlex.join(sys.argv), "machine": machine_info(), "cpu_busy_before": busy,
              "length": args.length, "tokens": args.tokens, "rounds": args.rounds, "chunk_ms": times,
              "median_ms": {k: statistics.median(v) for k, v in times.items()}, "same_logits": True,
              "oversize_layers": oversize, "layers": len(layers)}
    print(json.dumps({k: result[k] for k in ("median_ms", "chunk_ms", "oversize_layers")}))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
