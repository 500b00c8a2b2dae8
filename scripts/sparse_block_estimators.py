"""Which cheap per-block summary picks the cold blocks that hold the most attention: on real text (the sparse bench's
prompt), every governed layer's newest query of a few decode steps, each estimator keeping as many blocks per KV head
as the policy's indexer did, scored by the attention mass (full fp32 attention, exact keys) on sinks + hot range +
its blocks. Estimators, each a logit per (query head, block), turned into blocks as the indexer does (a softmax per
query head over the blocks, summed over the heads sharing the KV head, top k):
- indexer: the policy's own selection (kakeya::block_select);
- box c: q . mid + c |q| . half of the block's per-channel key min/max box (c = 0.5 is indexer v3's, 1 Quest's bound);
- max of box 0.5, 1.0 shares (indexer v4's rule), and half the blocks by each;
- mean, mean + var: q . mu, plus q^2 . var / 2 at the attention's scale (a log-normal block);
- sub s box c: the box of each s-position sub-block, combined by log-sum-exp (32 / s times the summary bytes);
- oracle: the blocks' true mass (the ceiling).

PYTHONPATH=src python scripts/sparse_block_estimators.py --model smollm2 --length 7680 --out results/sparse/estimators/smollm2_7680.json
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

from kakeya_runtime.bench.engine import bench_text
from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache
from kakeya_runtime.kv.sparse import OracleProbe, SparseLayerKV
from kakeya_runtime.models.loader import load_model


def estimators(layer: SparseLayerKV, q: torch.Tensor, keys: torch.Tensor, probs: torch.Tensor,
               picked: torch.Tensor, scale: float) -> dict[str, float]:
    """Each estimator's attention mass for one step of one layer (mean over its query heads)."""
    hk, g, _ = q.shape
    p = keys.shape[1] - 1
    pos = torch.arange(p + 1)
    hot = (pos < layer.sink) | (pos >= layer.hot_lo(p))
    hot_mass = (probs * hot).sum(-1)  # (Hk, G)
    n, b = picked.shape[1], layer.block
    cold = probs[:, :, layer.sink: layer.sink + n * b].reshape(hk, g, n, b).sum(-1)  # (Hk, G, n)
    kb = keys[:, layer.sink: layer.sink + n * b].reshape(hk, n, b, -1)  # (Hk, n, B, D)
    kept = int(picked[0].sum())

    def mass(sel: torch.Tensor) -> float:
        return (hot_mass + (cold * sel[:, None, :]).sum(-1)).mean().item()

    def pick(logit: torch.Tensor) -> torch.Tensor:  # (Hk, G, n) -> (Hk, n) the top `kept` of the summed shares
        share = torch.softmax(logit, -1).sum(1)
        sel = torch.zeros(hk, n, dtype=torch.bool)
        return sel.scatter_(1, share.topk(kept, -1).indices, True)

    def box(lo: torch.Tensor, hi: torch.Tensor, c: float) -> torch.Tensor:  # lo, hi (Hk, ..., D) -> logits
        mid, half = (lo + hi) / 2, (hi - lo) / 2
        return scale * (torch.einsum("hgd,h...d->hg...", q, mid) + c * torch.einsum("hgd,h...d->hg...", q.abs(), half))

    mu, var = kb.mean(2), kb.var(2, unbiased=False)
    out = {"indexer": mass(picked), "oracle": pick(torch.log(cold + 1e-30))}
    for c in (0.25, 0.5, 1.0):
        out[f"box {c}"] = pick(box(kb.amin(2), kb.amax(2), c))
    # the shares of the shrunk and of the whole box: their larger (indexer v4), or half the blocks by each
    shrunk = torch.softmax(box(kb.amin(2), kb.amax(2), 0.5), -1).sum(1)
    whole = torch.softmax(box(kb.amin(2), kb.amax(2), 1.0), -1).sum(1)
    out["max of box 0.5, 1.0 shares"] = torch.zeros(hk, n, dtype=torch.bool).scatter_(
        1, torch.maximum(shrunk, whole).topk(kept, -1).indices, True)
    first = torch.zeros(hk, n, dtype=torch.bool).scatter_(1, shrunk.topk((kept + 1) // 2, -1).indices, True)
    out["half by box 0.5, half by 1.0"] = first.scatter(
        1, whole.masked_fill(first, -1.0).topk(kept - (kept + 1) // 2, -1).indices, True)
    out["mean"] = pick(scale * torch.einsum("hgd,hnd->hgn", q, mu))
    out["mean + var"] = pick(scale * torch.einsum("hgd,hnd->hgn", q, mu)
                             + 0.5 * scale ** 2 * torch.einsum("hgd,hnd->hgn", q * q, var))
    for s in (16, 8):
        sub = kb.reshape(hk, n, b // s, s, -1)
        out[f"sub {s} box 0.5"] = pick(torch.logsumexp(box(sub.amin(3), sub.amax(3), 0.5), -1))
    return {k: (v if isinstance(v, float) else mass(v)) for k, v in out.items()}


def _record(layer: SparseLayerKV, steps: list[dict[str, float]], *step) -> None:
    steps.append(estimators(layer, *step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--length", type=int, default=7680)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model(args.model, dtype=torch.bfloat16)
    cfg = loaded.config
    engine = Engine(loaded.model, prefill_chunk=512)
    ids = torch.tensor([loaded.tokenizer.encode(bench_text()).ids[: args.length]], dtype=torch.long)
    spec = PolicySpec.parse("sparse", {"codec": "identity"})
    cache = make_policy_cache(cfg, spec, capacity=args.length + args.steps + 2, dtype=engine.dtype)
    layers = [layer for layer in cache if isinstance(layer, SparseLayerKV)]
    per_layer: list[list[dict[str, float]]] = [[] for _ in layers]
    for layer, steps in zip(layers, per_layer, strict=True):
        layer.probe = OracleProbe.new()
        layer.probe.on_step = functools.partial(_record, layer, steps)
    engine.prefill(cache, ids[:, :-1])
    for layer in layers:
        layer.probe.active = True
    for _ in engine.stream(cache, ids[:, -1:], GenerateRequest(args.steps, stop_ids=())):
        pass
    names = list(per_layer[0][0])
    layer_means = {k: [statistics.fmean(step[k] for step in steps) for steps in per_layer] for k in names}
    result = {"command": "python " + shlex.join(sys.argv), "machine": machine_info(), "model": args.model,
              "length": args.length, "steps": args.steps, "policy": spec.params,
              "estimators": {k: {"mean": statistics.fmean(v), "worst_layer": min(v), "per_layer": v}
                             for k, v in layer_means.items()}}
    for k, v in result["estimators"].items():
        print(f"{k:16s} mass {v['mean']:.4f}  worst layer {v['worst_layer']:.4f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
