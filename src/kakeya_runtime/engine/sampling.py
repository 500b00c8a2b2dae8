"""Sampling as pure functions over fp32 logits; plain and speculative decoding share them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kakeya_runtime.models import native


class SamplingError(ValueError):
    """Invalid sampling parameters."""


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int | None = None  # keep the k most likely tokens (None or 0: all)
    top_p: float | None = None  # keep the smallest set with this much mass (None or 1: all)
    seed: int | None = None  # seeds the torch.Generator; None draws fresh entropy

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.temperature <= 100.0):
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p over (B, V) fp32 logits; removed entries become -inf.

    The max is subtracted before dividing by the temperature, so any temperature in (0, 100] is exact and
    finite: the best logit maps to 0 and the rest to at most 0 (-inf when a tiny temperature underflows them),
    where dividing first overflows to inf - inf = NaN below ~1e-37."""
    x = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = x.shape[-1]
    if params.top_k and params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def probs_from_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a sampled token is drawn from, (B, V); one-hot argmax when greedy."""
    if params.greedy:
        return torch.nn.functional.one_hot(greedy(logits), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(filter_logits(logits, params), dim=-1)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """(B, V) fp32 logits -> (B,) int64 token ids."""
    if params.greedy:
        return greedy(logits)
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def greedy(logits: Tensor) -> Tensor:
    """(N, V) -> (N,): each row's first highest logit, what `sample` gives a greedy row, whatever rows share the call
    (a batched step picks all its greedy rows in one argmax). With our kernels, fp32 CPU logits take
    kakeya::argmax_rows (the same answer; PyTorch's argmax reads a row one element at a time)."""
    if (logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_cpu and logits.shape[1] > 0
            and logits.stride(1) == 1 and native.enabled()):
        return native.argmax_rows(logits)
    return logits.argmax(dim=-1)
