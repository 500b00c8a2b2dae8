"""What rounding every projection's input to int8 (per row, per block of 32, symmetric: llama.cpp's Q8_0 activations)
would cost SmolLM2's int8 weights in fidelity: next-token KL against our bf16 and top-1 agreement over the bench text,
weight-only int8 beside it, with the LM head's input rounded too or left whole. The products are computed in fp32 on the
dequantized weights (a fake quantisation: the kernels have no such path), so only the rounding differs.

PYTHONPATH=src python scripts/activation_rounding_fidelity.py --positions 1024 --out results/engine/activation_rounding.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kakeya_runtime.bench.engine import (
    _ids_tensor,
    _logprobs_all,
    _text_ids,
    compare_logprobs,
    load_bench_model,
)
from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.engine.weights import Int8Linear, WeightFormat, quantize_model
from kakeya_runtime.models import native_layer

GROUP = 32


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x (R, K) with each row's blocks of 32 rounded to int8 codes times their fp32 scale (max |x| / 127)."""
    r, k = x.shape
    xf = x.float().view(r, k // GROUP, GROUP)
    d = xf.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, (xf / d).round(), torch.zeros_like(xf))
    return (q * d).view(r, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    native_layer.set_enabled(False)  # every projection through its module's forward (patched below)
    mode = {"round": False, "head": True}

    def forward(self: Int8Linear, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        head = self.out_features == vocab
        xin = round_rows(x2) if mode["round"] and (mode["head"] or not head) else x2.float()
        y = F.linear(xin, self.dequantize().float())
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(torch.bfloat16).view(*shape[:-1], self.out_features).to(dtype)

    Int8Linear.forward = forward
    bm = load_bench_model("smollm2", torch.bfloat16)
    vocab = bm.model.config.vocab_size
    ids = _ids_tensor(_text_ids(bm, args.positions))
    ref = _logprobs_all(Engine(bm.model, prefill_chunk=args.positions), ids)
    bm = load_bench_model("smollm2", torch.float32)
    quantize_model(bm.model, WeightFormat.INT8, head="int8")
    cases = {}
    for name, rnd, head in (("weight_only", False, True), ("inputs_rounded", True, True),
                            ("inputs_rounded_but_head", True, False)):
        mode.update(round=rnd, head=head)
        cases[name] = compare_logprobs(ref, _logprobs_all(Engine(bm.model, prefill_chunk=args.positions), ids))
        print(name, cases[name], flush=True)
    result = {"command": "python " + shlex.join(sys.argv), "machine": machine_info(), "positions": args.positions,
              "weights": "int8 per output channel, int8 head", "reference": "our bf16", "cases": cases}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
