"""Oracle attention mass of the sparse policy on the bench's real text (kakeya bench sparse's probe, no timing)."""
import json
import statistics
import sys

import torch

from kakeya_runtime.bench.engine import bench_text
from kakeya_runtime.bench.sparse import _mass_stats, cpu_busy
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache
from kakeya_runtime.kv.sparse import OracleProbe, SparseLayerKV
from kakeya_runtime.models.loader import load_model

model, lengths, budgets, out = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], [float(x) for x in sys.argv[3].split(",")], sys.argv[4]
torch.set_num_threads(2)
busy = cpu_busy()
loaded = load_model(model, dtype=torch.bfloat16)
cfg = loaded.config
text = loaded.tokenizer.encode(bench_text()).ids
engine = Engine(loaded.model, prefill_chunk=512)
rows = []
for n in lengths:
    ids = torch.tensor([text[:n]])
    for b in budgets:
        spec = PolicySpec.parse("sparse", {"codec": "identity", "budget": b})
        cache = make_policy_cache(cfg, spec, capacity=n + 12, dtype=engine.dtype)
        layers = [layer for layer in cache if isinstance(layer, SparseLayerKV)]
        for layer in layers:
            layer.probe = OracleProbe.new()
        engine.prefill(cache, ids[:, :-1])
        for layer in layers:
            layer.probe.active = True
        for _ in engine.stream(cache, ids[:, -1:], GenerateRequest(8, stop_ids=())):
            pass
        per = [_mass_stats(layer.probe.masses) for layer in layers]
        row = {"length": n, "budget": b, "label": spec.label, "mean": statistics.fmean(x["mean"] for x in per),
               "worst_layer_mean": min(x["mean"] for x in per), "per_layer_mean": [x["mean"] for x in per],
               "attended_fraction": cache.effective_attention_fraction}
        print(json.dumps({k: v for k, v in row.items() if k != "per_layer_mean"}), flush=True)
        rows.append(row)
with open(out, "w") as f:
    json.dump({"command": " ".join(sys.argv), "model": model, "cpu_busy_before": busy, "oracle_steps": 8,
               "text": "pydoc_data.topics (the bench sparse text)", "codec": "identity", "rows": rows,
               "indexer": "box shrunk by 0.5 about its centre, per-head softmax shares summed over the group"},
              f, indent=1)
