"""Model-based draft proposers (seed 004): layer-skipping self-speculation and an EAGLE-style draft-head slot.

Both draft from the served checkpoint itself, so speculation needs no second model:

- `LayerSkipDraft`: the first `layers` decoder layers, then the final norm and the LM head (an early exit). Its
  K/V for the first layers are exactly the target's at the same positions (same weights, same inputs), so it
  drafts straight over the session's own cache: it appends its draft positions to those layers and trims them
  away after drafting (the verifier then writes the real ones). No extra weights, no extra cache.
- `DraftHead` + `DraftHeadProposer`: a small block on the target's final hidden states (EAGLE: the feature of
  position t and the embedding of token t+1 predict token t+2), sharing the target's frozen embeddings, final
  norm and LM head, optionally only the head's rows of a vocabulary subset (what it may draft: a draft token then
  costs a slice of the head's read, not all of it). `kakeya train draft-head` (engine.draft_training) fills it;
  randomly initialised it is already exact (the verifier checks everything), just rarely right.

When sampling, drafts are drawn from the draft's distribution after the sampler's own transform and that
distribution is handed to the verifier (q), which is what makes rejection sampling exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from kakeya_runtime.engine.drafts import Draft
from kakeya_runtime.engine.sampling import SamplingParams, draw, probs_from_logits
from kakeya_runtime.kv.cache import ModelKV
from kakeya_runtime.models.base import DecoderModel
from kakeya_runtime.models.layers import linear


class DraftHeadError(ValueError):
    """Draft-head weights that do not fit the served model (missing or unexpected tensors, wrong shapes), or a file
    that is not readable safetensors."""


def _weights(module: nn.Module) -> int:
    """Weights a forward through `module` multiplies by: its parameters and its quantized projections' (buffers)."""
    from kakeya_runtime.engine.weights import QuantLinear

    return sum(p.numel() for p in module.parameters()) + sum(
        m.in_features * m.out_features for m in module.modules() if isinstance(m, QuantLinear))


def _head_weights(model: DecoderModel) -> int:
    """The LM head's weights, counted from the config (a quantized head's `.weight` would dequantize it)."""
    return model.config.vocab_size * model.config.hidden_size


def _decode_weights(model: DecoderModel) -> int:
    """Weights a decode step reads (every layer plus the LM head): the unit of a draft's cost, the same in every
    weight format (int layers counted too: their weights are buffers, not parameters)."""
    return _weights(model.layers) + _head_weights(model)


def check_vocab(vocab: Tensor, vocab_size: int) -> Tensor:
    """A draft vocabulary: 1-D integer token ids, strictly increasing, each below `vocab_size` (as int64).
    DraftHeadError naming what is wrong otherwise."""
    if vocab.dim() != 1 or vocab.numel() == 0 or vocab.is_floating_point() or vocab.is_complex():
        raise DraftHeadError(f"vocab must be a non-empty 1-D tensor of token ids, got {vocab.dtype} "
                             f"{tuple(vocab.shape)}")
    v = vocab.to(torch.int64)
    if bool((v[1:] <= v[:-1]).any()):
        raise DraftHeadError("vocab token ids must be distinct and in increasing order")
    if int(v[0]) < 0 or int(v[-1]) >= vocab_size:
        raise DraftHeadError(f"vocab holds token ids outside 0..{vocab_size - 1} (from {int(v[0])} to {int(v[-1])})")
    return v


def _head_rows(model: DecoderModel, vocab: Tensor) -> Tensor:
    """The LM head's rows of `vocab` as the target multiplies by them (a quantized head's dequantized rows)."""
    head = model.lm_head
    if head is not None and hasattr(head, "dequantize_rows"):
        return head.dequantize_rows(vocab).contiguous()
    return model.head_weight().detach()[vocab].contiguous()


def _pick(logits: Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> tuple[int, Tensor | None]:
    """A draft token from (V,) fp32 logits: argmax when greedy (q not needed), else a draw from q (returned)."""
    if sampling.greedy:
        return int(logits.argmax()), None
    q = probs_from_logits(logits[None], sampling)[0]
    return draw(q, generator), q


class LayerSkipDraft:
    """Self-speculation: the first `layers` layers + final norm + head of the target, over the session's cache."""

    name = "self"
    wants_hidden = False
    auto_draft_tokens = 4

    def __init__(self, model: DecoderModel, layers: int | None = None) -> None:
        n = len(model.layers)
        self.layers = max(1, n // 4) if layers is None else layers
        if not 1 <= self.layers <= n:
            raise ValueError(f"layers must be in [1, {n}], got {self.layers}")
        self.model = model
        self.cache: ModelKV | None = None
        # A drafted token reads the first layers and the LM head: that share of a decode step (the off-switch's cost).
        first = sum(_weights(layer) for layer in model.layers[: self.layers])
        self.draft_cost = (first + _head_weights(model)) / _decode_weights(model)

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
    frozen and shared (not copied). With `vocab` (sorted distinct token ids, a buffer saved with the weights) it
    drafts only those tokens: its logits are the target head's rows for them (copied once, N*C), every other
    token's -inf, so a sampled draft's q is still a distribution over the whole vocabulary."""

    def __init__(self, model: DecoderModel, *, intermediate: int | None = None, seed: int = 0,
                 vocab: Tensor | None = None) -> None:
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
        self._rows: Tensor | None = None  # the target head's rows of `vocab` (not saved: the target's own)
        if vocab is not None:
            self.register_buffer("vocab", check_vocab(vocab, model.config.vocab_size))
            self._rows = _head_rows(model, self.vocab)

    @property
    def target(self) -> DecoderModel:
        return self._target[0]

    @property
    def head_weights(self) -> int:
        """LM-head weights a drafted token reads: the vocabulary's rows, or the whole head."""
        return _head_weights(self.target) if self._rows is None else self._rows.numel()

    def save(self, path: Path) -> None:
        """The head's own weights (fc, up, down, norm_scale) as safetensors, the format `from_file` loads."""
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path),
                  metadata={"format": "kakeya-draft-head", "hidden_size": str(self.fc.weight.shape[0])})

    @classmethod
    def from_file(cls, model: DecoderModel, path: Path | str) -> DraftHead:
        """A head with trained weights from a safetensors file (what a training pipeline writes: fc (C, 2C),
        up (I, C), down (C, I), norm_scale (C,), any float dtype), checked against the served model's hidden size
        C; the intermediate size I is the file's. DraftHeadError when the file does not fit."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as e:
            raise DraftHeadError(f"cannot read draft head weights {str(path)!r}: {e}") from None
        up = tensors.get("up.weight")
        if up is None or up.dim() != 2:
            raise DraftHeadError(f"draft head file {str(path)!r} has no 2-D 'up.weight' (tensors: "
                                 f"{', '.join(sorted(tensors)) or 'none'})")
        vocab = tensors.get("vocab")
        if vocab is not None:
            try:
                vocab = check_vocab(vocab, model.config.vocab_size)
            except DraftHeadError as e:
                raise DraftHeadError(f"{str(path)!r}: {e}") from None
        head = cls(model, intermediate=int(up.shape[0]), vocab=vocab)
        head.load_tensors(tensors, source=str(path))
        return head

    def load_tensors(self, tensors: dict[str, Tensor], *, source: str = "draft head weights") -> None:
        """Replace the head's weights, after checking every name and shape (nothing changes when one is wrong)."""
        want = self.state_dict()
        missing = sorted(set(want) - set(tensors))
        extra = sorted(set(tensors) - set(want))
        if missing or extra:
            raise DraftHeadError(f"{source}: missing tensors {missing}, unexpected tensors {extra} (a draft head has "
                                 f"{', '.join(sorted(want))})")
        for name in sorted(want, key=lambda n: (n != "fc.weight", n)):  # fc first: it carries the model's size
            t, got = want[name], tensors[name]
            if tuple(got.shape) != tuple(t.shape):
                raise DraftHeadError(f"{source}: {name} has shape {tuple(got.shape)}, the served model "
                                     f"(hidden size {self.fc.weight.shape[0]}) needs {tuple(t.shape)}")
            if name == "vocab":
                if not torch.equal(check_vocab(got, self.target.config.vocab_size), self.vocab):
                    raise DraftHeadError(f"{source}: vocab differs from this head's (build the head from the file)")
            elif not got.is_floating_point():
                raise DraftHeadError(f"{source}: {name} is {got.dtype}, not a float tensor")
        self.load_state_dict({k: v.to(want[k].dtype) for k, v in tensors.items()})

    @torch.inference_mode()
    def step(self, feature: Tensor, token: int) -> tuple[Tensor, Tensor]:
        """feature (C,) and the next token -> (fp32 logits (V,), the next feature (C,))."""
        t = self.target
        emb = t.embed(torch.tensor([[token]], dtype=torch.long, device=feature.device))[0, 0]
        h = self.fc(torch.cat([feature.to(emb.dtype), emb]))
        x = h * torch.rsqrt(h.float().pow(2).mean() + 1e-6).to(h.dtype) * self.norm_scale
        h = h + self.down(torch.nn.functional.silu(self.up(x)))
        if self._rows is None:
            return t.project(t.norm(h[None, None]))[0, 0], h
        logits = torch.full((t.config.vocab_size,), float("-inf"), device=h.device)
        logits[self.vocab] = linear(t.norm(h[None]), self._rows, out_fp32=True)[0]
        return logits, h


class DraftHeadProposer:
    """Per-generation state for a shared DraftHead: the target's feature of the newest position."""

    name = "draft_head"
    wants_hidden = True
    auto_draft_tokens = 4

    def __init__(self, head: DraftHead) -> None:
        self.head = head
        self.feature: Tensor | None = None
        own = sum(p.numel() for p in head.parameters())  # + the shared LM head (or its rows), per drafted token
        self.draft_cost = (own + head.head_weights) / _decode_weights(head.target)

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
