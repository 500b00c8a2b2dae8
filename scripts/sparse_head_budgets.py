"""Would per-head block budgets (more blocks for the KV heads whose attention is spread, fewer for the focused ones)
raise the sparse policy's oracle attention mass at the same blocks in total? The ceiling (blocks picked by their
true attention, as `kakeya bench sparse` reports it) per KV head and step, as a function of the blocks kept, on two
prompts of the bench text at different offsets: budgets fitted on the first (greedy on the mean curves, the same
total as `topk` for every head) and measured on the second, beside `topk` for every head; for each `topk` given.

PYTHONPATH=src python scripts/sparse_head_budgets.py --length 7680 --steps 16 --topk 32,48,64 \
    --out results/sparse/head_budgets/smollm2_7680.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kakeya_runtime.bench.engine import bench_text
from kakeya_runtime.bench.heads import fit_blocks
from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.bench.sparse import probed_prefill
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.kv.policy import PolicySpec
from kakeya_runtime.models.loader import load_model


def curves(engine: Engine, cfg, ids: torch.Tensor, params: dict, steps: int) -> list[torch.Tensor]:
    """Per governed layer: (steps, Hk, n + 1), the mean mass over a KV head's query heads with its k best blocks
    (OracleProbe.curves)."""
    cache, probed = probed_prefill(engine, cfg, PolicySpec.parse("sparse", params), ids[:, :-1],
                                   ids.shape[1] + steps + 2)
    layers = list(probed.values())
    list(engine.stream(cache, ids[:, -1:], GenerateRequest(steps, stop_ids=())))
    # the probe's per-step curves; a block sealed mid-run adds a column to later steps: each cut to the first's
    return [torch.stack([c[:, : layer.probe.curves[0].shape[1]] for c in layer.probe.curves]) for layer in layers]


def fit(mean_curves: list[torch.Tensor], total: int, floor: int) -> list[list[int]]:
    """Blocks per (layer, KV head), `floor` each at least, greedily to the largest gain in mean mass: `total` in all
    (kakeya calibrate heads' fit, every head sparse)."""
    heads = sum(c.shape[0] for c in mean_curves)
    curves = {str(i): c for i, c in enumerate(mean_curves)}
    modes = {str(i): ["sparse"] * c.shape[0] for i, c in enumerate(mean_curves)}
    blocks = fit_blocks(curves, modes, total // heads, floor)
    return [blocks[str(i)] for i in range(len(mean_curves))]


def score(step_curves: list[torch.Tensor], budget: list[list[int]]) -> dict:
    per_layer = []
    for c, b in zip(step_curves, budget, strict=True):
        k = torch.tensor(b).clamp(max=c.shape[2] - 1)
        per_layer.append(float(c.gather(2, k[None, :, None].expand(c.shape[0], -1, 1)).mean()))
    return {"mean": statistics.fmean(per_layer), "worst_layer": min(per_layer), "per_layer": per_layer}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=7680)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--topk", default="32", help="blocks per head on average (comma-separated: each compared)")
    ap.add_argument("--floor", type=int, default=2, help="blocks every head keeps at least")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    started = time.time()
    loaded = load_model(a.model, dtype=torch.bfloat16)
    engine = Engine(loaded.model, prefill_chunk=512)
    text = loaded.tokenizer.encode(bench_text()).ids
    topks = [int(k) for k in a.topk.split(",")]
    params = {"sink": 4, "window": 512, "block": 32, "topk": topks[0], "codec": "identity"}
    fitted, measured = (curves(engine, loaded.config, torch.tensor([text[o: o + a.length]]), params, a.steps)
                        for o in (0, a.length))
    heads = sum(c.shape[1] for c in fitted)
    rows = []
    for topk in topks:
        budget = fit([c.mean(0) for c in fitted], topk * heads, a.floor)
        uniform = [[topk] * c.shape[1] for c in fitted]
        row = {"topk": topk, "blocks_in_total": topk * heads,
               "uniform": {"fitted_prompt": score(fitted, uniform), "other_prompt": score(measured, uniform)},
               "per_head": {"fitted_prompt": score(fitted, budget), "other_prompt": score(measured, budget),
                            "budgets": budget}}
        rows.append(row)
        print(topk, {name: (round(row[name]["other_prompt"]["mean"], 4), round(row[name]["other_prompt"]["worst_layer"], 4))
                     for name in ("uniform", "per_head")})
    result = {"command": " ".join(sys.argv), "machine": machine_info(), "model": a.model, "length": a.length,
              "steps": a.steps, "params": {k: v for k, v in params.items() if k != "topk"}, "floor": a.floor,
              "selectable": int(measured[0].shape[2] - 1), "rows": rows,
              "wall_s": round(time.time() - started, 1), "method": __doc__}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
