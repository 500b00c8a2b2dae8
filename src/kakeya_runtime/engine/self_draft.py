"""Model-based draft proposers (seed 004): layer-skipping self-speculation and an EAGLE-style draft-head slot.

Both draft from the served checkpoint itself, so speculation needs no second model:

- `LayerSkipDraft`: the first `layers` decoder layers, then the final norm and the LM head (an early exit). Its
  K/V for the first layers are exactly the target's at the same positions (same weights, same inputs), so it
  drafts straight over the session's own cache: it appends its draft positions to those layers and trims them
  away after drafting (the verifier then writes the real ones). No extra weights, no extra cache.
- `DraftHead` + `DraftHeadProposer`: a small block on the target's final hidden states (EAGLE: the feature of
  position t and the embedding of token t+1 predict token t+2), sharing the target's frozen embeddings, final
  norm and LM head. The head is a slot a training pipeline fills (`DraftHead.load`); randomly initialised it is
  already exact (the verifier checks everything), just rarely right.

When sampling, drafts are drawn from the draft's distribution after the sampler's own transform and that
distribution is handed to the verifier (q), which is what makes rejection sampling exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from kakeya_runtime.engine.drafts import Draft
from kakeya_runtime.engine.sampling import SamplingParams, probs_from_logits
from kakeya_runtime.kv.cache import ModelKV
from kakeya_runtime.models.base import DecoderModel


def _pick(logits: Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> tuple[int, Tensor | None]:
    """A draft token from (V,) fp32 logits: argmax when greedy (q not needed), else a draw from q (returned)."""
    if sampling.greedy:
        return int(logits.argmax()), None
    q = probs_from_logits(logits[None], sampling)[0]
    return int(torch.multinomial(q, 1, generator=generator)), q


class LayerSkipDraft:
    """Self-speculation: the first `layers` layers + final norm + head of the target, over the session's cache."""

    name = "self"
    wants_hidden = False

    def __init__(self, model: DecoderModel, layers: int | None = None) -> None:
        n = len(model.layers)
        self.layers = max(1, n // 4) if layers is None else layers
        if not 1 <= self.layers <= n:
            raise ValueError(f"layers must be in [1, {n}], got {self.layers}")
        self.model = model
        self.cache: ModelKV | None = None

    def attach(self, cache: ModelKV) -> None:
        self.cache = cache

    def begin(self, context: Sequence[int]) -> None:
        pass

    @torch.inference_mode()
    def propose(self, context: Sequence[int], max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        cache, model = self.cache, self.model
        if cache is None:
            raise RuntimeError("LayerSkipDraft.attach(cache) first")
        start = cache.length
        device = next(model.parameters()).device
        tokens: list[int] = []
        qs: list[Tensor] = []
        tok = context[-1]
        try:
            for j in range(max_tokens):
                ids = torch.tensor([[tok]], dtype=torch.long, device=device)
                positions = torch.arange(start + j, start + j + 1, device=device)
                cache.begin_step(ids, start + j)
                try:
                    h = model.embed(ids)
                    rope = model.rope_tables(positions, h.dtype)
                    for i in range(self.layers):
                        h, _ = model.layer_forward(i, h, positions, rope, cache[i], False)
                finally:
                    cache.end_step()
                logits = model.project(model.norm(h))[0, -1]
                tok, q = _pick(logits, sampling, generator)
                tokens.append(tok)
                if q is not None:
                    qs.append(q)
        finally:
            cache.trim(start)  # only the first layers moved; the verifier writes the real K/V
        return Draft(tokens, torch.stack(qs) if qs else None)

    def accepted(self, context: Sequence[int], n_accepted: int, hidden: Tensor | None) -> None:
        pass


class DraftHead(nn.Module):
    """EAGLE-style head: fc([feature; embedding]) -> a residual MLP block -> the target's final norm and LM head.

    Only `fc` and the block are its own weights (2C*C + 2*C*I + C); embeddings, norm and head are the target's,
    frozen and shared (not copied)."""

    def __init__(self, model: DecoderModel, *, intermediate: int | None = None, seed: int = 0) -> None:
        super().__init__()
        c = model.config.hidden_size
        i = intermediate or 2 * c
        param = next(model.parameters())
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(2 * c, c, bias=False)
        self.up = nn.Linear(c, i, bias=False)
        self.down = nn.Linear(i, c, bias=False)
        self.norm_scale = nn.Parameter(torch.ones(c))
        with torch.no_grad():
            for lin in (self.fc, self.up, self.down):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.weight.shape[1] ** 0.5)
        self.to(dtype=param.dtype, device=param.device).eval().requires_grad_(False)
        self._target = [model]  # a list: not registered as a submodule (its weights stay the target's)

    @property
    def target(self) -> DecoderModel:
        return self._target[0]

    def load(self, path: Path) -> None:
        """Trained weights (a state_dict of fc/up/down/norm_scale) from a later training pipeline."""
        self.load_state_dict(torch.load(path, map_location=self.fc.weight.device, weights_only=True))

    @torch.inference_mode()
    def step(self, feature: Tensor, token: int) -> tuple[Tensor, Tensor]:
        """feature (C,) and the next token -> (fp32 logits (V,), the next feature (C,))."""
        t = self.target
        emb = t.embed(torch.tensor([[token]], dtype=torch.long, device=feature.device))[0, 0]
        h = self.fc(torch.cat([feature.to(emb.dtype), emb]))
        x = h * torch.rsqrt(h.float().pow(2).mean() + 1e-6).to(h.dtype) * self.norm_scale
        h = h + self.down(torch.nn.functional.silu(self.up(x)))
        logits = t.project(t.norm(h[None, None]))[0, 0]
        return logits, h


class DraftHeadProposer:
    """Per-generation state for a shared DraftHead: the target's feature of the newest position."""

    name = "draft_head"
    wants_hidden = True

    def __init__(self, head: DraftHead) -> None:
        self.head = head
        self.feature: Tensor | None = None

    def attach(self, cache: ModelKV) -> None:
        pass

    def begin(self, context: Sequence[int]) -> None:
        self.feature = None

    def propose(self, context: Sequence[int], max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if self.feature is None:
            return Draft([])
        tokens: list[int] = []
        qs: list[Tensor] = []
        feature, tok = self.feature, context[-1]
        for _ in range(max_tokens):
            logits, feature = self.head.step(feature, tok)
            tok, q = _pick(logits, sampling, generator)
            tokens.append(tok)
            if q is not None:
                qs.append(q)
        return Draft(tokens, torch.stack(qs) if qs else None)

    def accepted(self, context: Sequence[int], n_accepted: int, hidden: Tensor | None) -> None:
        if hidden is not None:
            self.feature = hidden[-1]  # the position whose logits chose the newest token
