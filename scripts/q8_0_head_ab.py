"""The LM head (a tied Q8_0 tensor in both bundled models) as grouped int8, kept exactly, against per-row int8 (how it
was served before): next-token fidelity vs bf16 (serving.measure_fidelity, the --weights auto gate's measure), the
head's matvec alone, and SmolLM2 int4 decode, the two alternated in one process.

    PYTHONPATH=src python scripts/q8_0_head_ab.py --out results/engine/q8_0_head/ab.json
    PYTHONPATH=src python scripts/q8_0_head_ab.py --speed-model gemma3-270m:int4-mixed --no-fidelity \
        --out results/engine/q8_0_head/ab_gemma3.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.engine import serving
from kakeya_runtime.engine import weights as W
from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.models.loader import load_model


def served(name: str, fmt: str, grouped: bool) -> torch.nn.Module:
    real = W.int8_grid
    W.int8_grid = real if grouped else (lambda *a, **k: None)  # per-row: as before grouped int8 existed
    try:
        return serving.apply_format(load_model(name, dtype=serving.load_dtype(fmt)).model, fmt)
    finally:
        W.int8_grid = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/engine/q8_0_head/ab.json")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--speed-model", default="smollm2:int4", help="model:format whose head and decode are timed")
    ap.add_argument("--fidelity", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    out = {"command": "PYTHONPATH=src python scripts/q8_0_head_ab.py " + f"--out {args.out} --rounds {args.rounds} "
           f"--speed-model {args.speed_model}" + ("" if args.fidelity else " --no-fidelity"),
           "machine": machine_info(), "fidelity": [], "head_matvec_ms": {}, "decode_tok_s": {},
           "speed_model": args.speed_model}
    for name, fmt in (("smollm2", "int4"), ("gemma3-270m", "int4-mixed")) if args.fidelity else ():
        ref = load_model(name, dtype=torch.bfloat16)
        ids = serving.bench_text_ids(lambda t, tok=ref.tokenizer: tok.encode(t).ids, 1024)
        for grouped in (False, True):
            f = serving.measure_fidelity(ref.model, served(name, fmt, grouped), ids)
            out["fidelity"].append({"model": name, "format": fmt, "head": "grouped" if grouped else "per-row",
                                    "positions": f.positions, "kl_mean": f.kl_mean, "kl_max": f.kl_max,
                                    "top1_agree": f.top1_agree})
            print(out["fidelity"][-1], flush=True)
    name, fmt = args.speed_model.split(":")
    tok = load_model(name, dtype=torch.bfloat16).tokenizer
    ids = serving.bench_text_ids(lambda t: tok.encode(t).ids, 1100)
    models = {g: served(name, fmt, g) for g in (False, True)}
    x = torch.randn(1, models[True].lm_head.in_features).to(torch.bfloat16)
    heads = {"per-row": [], "grouped": []}
    decode = {"per-row": [], "grouped": []}
    for _ in range(args.rounds):
        for g in (False, True):
            key = "grouped" if g else "per-row"
            head = models[g].lm_head
            for _ in range(5):
                head.kernel_mm(x)
            t = time.perf_counter()
            for _ in range(50):
                head.kernel_mm(x)
            heads[key].append(round((time.perf_counter() - t) / 50 * 1e3, 4))
            decode[key].append(round(serving.measure_speed(Engine(models[g]), ids).decode_tok_s, 2))
    out["head_matvec_ms"] = {k: {"runs": v, "median": sorted(v)[len(v) // 2]} for k, v in heads.items()}
    out["decode_tok_s"] = {k: {"runs": v, "median": sorted(v)[len(v) // 2]} for k, v in decode.items()}
    out["load_avg_after"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("head_matvec_ms", "decode_tok_s")}))


if __name__ == "__main__":
    main()
