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


# When only top_p limits the support, the candidates first looked at: the most likely tokens, grown 4x until they hold
# the nucleus's mass (a sort of the whole vocabulary costs ~22 ms at Gemma 3's 262,144 tokens). Real nuclei are small:
# 5-31 tokens at the median, 201 at most, over 16 positions of the bench text at T 0.7 / top_p 0.95 and T 1 / 0.9 on
# both models. 64 and 256 sample 1.3-1.8x faster than 1,024 and within ~10% of each other; 256 needs fewer rounds on
# flatter distributions (results/engine/sampling_v1/nucleus_guess.json).
NUCLEUS_GUESS = 256
_TINY = torch.finfo(torch.float32).tiny / 2**23  # the smallest positive float32 (subnormal)


def support(row: Tensor, params: SamplingParams) -> tuple[Tensor | None, Tensor]:
    """`reference_support`'s tokens and weights; with our kernels, one row's passes in C++ (kakeya::sample_support:
    the same candidates and the same selection rules; its float64 sums run in another order, so a weight may
    differ from the reference's in the last bits)."""
    if not _native_row(row):
        return reference_support(row, params)
    top_k, top_p = _filters(params, row.numel())
    if not top_k and top_p is None:
        return None, native.sample_weights(row, params.temperature)
    return native.sample_support(row, params.temperature, top_k, 1.0 if top_p is None else top_p)


def _kernels() -> bool:
    """Whether sampling runs on our kernels (csrc/sampling.cpp) in this process."""
    return native.enabled()


def _native_row(row: Tensor) -> bool:
    return (row.dtype == torch.float32 and row.dim() == 1 and row.is_cpu and row.numel() > 0 and row.stride(0) == 1
            and _kernels())


def _filters(params: SamplingParams, vocab: int) -> tuple[int, float | None]:
    """(top_k, 0 when it keeps everything; top_p, None when it keeps everything)."""
    top_k = params.top_k if params.top_k and params.top_k < vocab else 0
    top_p = params.top_p if params.top_p is not None and params.top_p < 1.0 else None
    return top_k, top_p


def reference_support(row: Tensor, params: SamplingParams) -> tuple[Tensor | None, Tensor]:
    """The tokens one sampled row may draw and their weights (proportional to the probabilities): ids (n,) int64 and
    w (n,), or ids None and w over the whole vocabulary (nothing filtered). With top-p the ids come in descending
    probability (ties: the lower id first); otherwise in id order.

    Temperature, then top-k, then top-p, over the row's (V,) fp32 logits x:
    - e = exp((x - max x) / temperature) in fp32 (the max is subtracted before dividing, so any temperature in
      (0, 100] is exact and finite: dividing first overflows to inf - inf = NaN below ~1e-37);
    - top-k keeps the k highest logits and every logit equal to the k-th;
    - top-p drops a token once the mass before it (its probability among the tokens kept so far, in float64, in the
      order above) reaches top_p; the first always stays.
    Only candidates are ordered: the k of top-k, or for top-p alone the most likely NUCLEUS_GUESS tokens and
    everything tied with the last of them, grown until they hold top_p of the mass (every token past them has at
    least that much before it); a weight that underflowed to 0 is never a candidate. A function of the row alone: the same bits whatever rows share a step."""
    x = row.float()
    vocab = x.numel()
    peak = x.max()
    if not torch.isfinite(peak):
        raise RuntimeError(f"sampling: the logits' maximum is {float(peak)}")
    top_k, top_p = _filters(params, vocab)
    if top_k:
        ids = (x >= torch.topk(x, top_k).values[-1]).nonzero().flatten()
        e = x[ids].sub_(peak).div_(params.temperature).exp_()
        total = e.sum(dtype=torch.float64)
    else:
        e_all = x.sub(peak).div_(params.temperature).exp_()
        if top_p is None:
            return None, e_all
        total = e_all.sum(dtype=torch.float64)
        guess = min(vocab, NUCLEUS_GUESS)
        while True:
            # weights that underflowed to 0 (a low temperature) can never be drawn: not candidates, however many tie
            ids = (e_all >= torch.topk(e_all, guess, sorted=False).values.min().clamp_min(_TINY)).nonzero().flatten()
            if guess == vocab or e_all[ids].sum(dtype=torch.float64) >= top_p * total:
                break
            guess = min(vocab, 4 * guess)
        e = e_all[ids]
    if top_p is None:
        return ids, e
    p, order = torch.sort(e.double().div_(total), descending=True, stable=True)  # ids ascending: ties, lower id first
    before = p.cumsum(0) - p
    keep = max(1, int((before < top_p).sum()))  # `before` rises with the order: the kept ones are a prefix
    return ids[order[:keep]], p[:keep]


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One index drawn from nonnegative weights (n,) (any float dtype, not normalised): the first whose running sum
    passes u * total, u uniform in [0, 1) from `generator` in float64 (a zero weight is never drawn). With our
    kernels the sums run by blocks in C++ (kakeya::sample_draw: a whole vocabulary's weights are read twice, not
    copied and summed into a float64 copy)."""
    if (probs.dtype in (torch.float32, torch.float64) and probs.dim() == 1 and probs.is_cpu and probs.numel() > 0
            and probs.stride(0) == 1 and _kernels()):
        return native.sample_draw(probs, float(torch.rand((), dtype=torch.float64, generator=generator)))
    cdf = probs.double().cumsum(0)
    total = cdf[-1]
    if not (torch.isfinite(total) and total > 0):
        raise RuntimeError(f"sampling: the weights sum to {float(total)}")
    u = torch.rand((), dtype=torch.float64, generator=generator)
    return min(int(torch.searchsorted(cdf, u * total, right=True)), probs.numel() - 1)


def probs_from_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a sampled token is drawn from, (B, V) fp32: each row's `support` scattered over the
    vocabulary; one-hot argmax when greedy."""
    if params.greedy:
        return torch.nn.functional.one_hot(greedy(logits), logits.shape[-1]).to(logits.dtype)
    out = torch.zeros(logits.shape, dtype=torch.float32)
    for b in range(logits.shape[0]):
        ids, w = support(logits[b], params)
        p = (w.double() / w.sum(dtype=torch.float64)).float()
        if ids is None:
            out[b] = p
        else:
            out[b, ids] = p
    return out


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """(B, V) fp32 logits -> (B,) int64 token ids: argmax when greedy, else each row a `draw` from its `support`,
    rows in order from one generator."""
    if params.greedy:
        return greedy(logits)
    picked = []
    for b in range(logits.shape[0]):
        ids, w = support(logits[b], params)
        i = draw(w, generator)
        picked.append(i if ids is None else int(ids[i]))
    return torch.tensor(picked, dtype=torch.long)


def greedy(logits: Tensor) -> Tensor:
    """(N, V) -> (N,): each row's first highest logit, what `sample` gives a greedy row, whatever rows share the call
    (a batched step picks all its greedy rows in one argmax). With our kernels, fp32 CPU logits take
    kakeya::argmax_rows (the same answer; PyTorch's argmax reads a row one element at a time)."""
    if (logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_cpu and logits.shape[1] > 0
            and logits.stride(1) == 1 and native.enabled()):
        return native.argmax_rows(logits)
    return logits.argmax(dim=-1)
