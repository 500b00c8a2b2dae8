"""The `--dtype` names every command accepts: short (bf16, fp32) and torch's (bfloat16, float32). Not fp16: our
kernels (attention, projections) take bf16 and fp32 only, and a half model failed at its first forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
DTYPE_HELP = "bf16 (= bfloat16) or fp32 (= float32)"


def dtype_name(text: str) -> str:
    """torch's name for `text` (case-insensitive); ValueError listing the accepted names otherwise."""
    name = DTYPE_NAMES.get(text.strip().lower())
    if name is None:
        raise ValueError(f"--dtype must be {DTYPE_HELP}, got {text!r}")
    return name


def parse_dtype(text: str) -> torch.dtype:
    import torch

    return getattr(torch, dtype_name(text))
