"""Would a smaller LM head keep a model faithful? Next-token fidelity against bf16 (the serving calibration's
measure: KL mean and max, top-1 agreement over its 1,024 bench-text positions) of int4-mixed projections with the
LM head (and the tied embedding served from it) in int8 (what int4-mixed serves), int5 (a Q5_0-style grid) or
int4, with each variant's weight bytes. Gemma 3's head is 262,144 x 640, most of a decode step's reads.

PYTHONPATH=src python scripts/head_format_fidelity.py --model gemma3-270m --out results/quant/head_fidelity_gemma3.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from kakeya_runtime.engine import serving
from kakeya_runtime.engine.weights import Int5Linear, Prefill, QuantEmbedding, quantize_model, weight_bytes
from kakeya_runtime.models.loader import load_model


def _encode(tokenizer):
    def encode(text: str) -> list[int]:
        out = tokenizer.encode(text)
        return list(getattr(out, "ids", out))
    return encode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--heads", default="int8,int5,int4")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ref = load_model(args.model, dtype=torch.bfloat16)
    ids = serving.bench_text_ids(_encode(ref.tokenizer), serving.FIDELITY_POSITIONS)
    rows = []
    for head in args.heads.split(","):
        model = load_model(args.model, dtype=torch.float32).model  # fp32: GGUF values exactly
        tied = model.embed_tokens.weight.detach().clone() if getattr(model, "lm_head", None) is None else None
        source = tied if tied is not None else model.lm_head.weight.detach().clone()
        quantize_model(model, "int4-mixed", head="int4" if head == "int4" else "int8", prefill=Prefill.KERNEL)
        if head == "int5":
            model.lm_head = Int5Linear(source, None, prefill=Prefill.KERNEL)
            if tied is not None:
                model.embed_tokens = QuantEmbedding(model.lm_head)
            model.to(torch.bfloat16)
        f = serving.measure_fidelity(ref.model.eval(), model.eval(), ids)
        row = {"projections": "int4-mixed", "head": head, "weight_bytes": weight_bytes(model),
               "head_bytes": sum(b.numel() * b.element_size() for b in model.lm_head.buffers()),
               "kl_mean": f.kl_mean, "kl_max": f.kl_max, "top1_agree": f.top1_agree, "positions": f.positions,
               "faithful": f.kl_mean <= 0.01 and f.top1_agree >= 0.95}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del model
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": shlex.join(["python", *sys.argv]), "model": args.model,
                                    "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
