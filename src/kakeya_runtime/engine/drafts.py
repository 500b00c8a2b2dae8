"""Draft proposers for speculative decoding (seed 000 §11.5, seed 004): what guesses the next tokens.

Not to be confused with engine.proposers (K/V *restoration* proposers). A draft proposer only guesses; the
verifier (engine.speculative) checks every guess against the target model, so a proposer can change speed,
never what is generated. Every proposer sits behind `DraftProposer`:

- `attach(cache)` once per generation with the cache it runs over;
- `begin(context)` once per generation with the whole token context (prompt/history so far);
- `propose(context, max_tokens, sampling, generator)` -> a `Draft`: up to max_tokens token ids, and, for
  proposers that sample, the distributions q they were drawn from (k, V) (None: a deterministic guess, q is
  one-hot on each token);
- `accepted(context, n_accepted, hidden)` after each verifier step (proposers that carry state use it).

Shipped here: `HistoryLookup` (a suffix/n-gram index over the session's own history; the draft length follows the
match length), `RandomDraft` (uniformly random tokens: a deliberately bad proposer for exactness tests).
engine.self_draft has the model-based ones (layer-skipping self-speculation and the EAGLE-style draft head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kakeya_runtime.engine.sampling import SamplingParams
from kakeya_runtime.kv.cache import ModelKV


@dataclass(slots=True)
class Draft:
    tokens: list[int]
    q: Tensor | None = None  # (len(tokens), V) fp32: the distribution each token was sampled from; None: one-hot


class DraftProposer(Protocol):
    name: str
    wants_hidden: bool  # accepted() gets the target's final hidden states (costs nothing extra in the forward)

    def attach(self, cache: ModelKV) -> None:
        """The cache the generation runs over (a proposer that drafts over it, like self-speculation, keeps it)."""
        ...

    def begin(self, context: Sequence[int]) -> None:
        """A generation starts over this context (every token before the first one to generate)."""
        ...

    def propose(self, context: Sequence[int], max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        """Up to `max_tokens` guesses for the tokens after `context` (which ends with the last sampled token)."""
        ...

    def accepted(self, context: Sequence[int], n_accepted: int, hidden: Tensor | None) -> None:
        """After a verifier step: the context now ends with the step's tokens; `hidden` (T, C) are the target's
        final hidden states of the step's positions when the proposer asked for them (`wants_hidden`)."""
        ...


class HistoryLookup:
    """Prompt-lookup / SuffixDecoding-style drafts from the context itself.

    An index maps every n-gram (n in 1..max_ngram) of the context to the end of its most recent occurrence. To
    propose, the longest suffix of the context (at least `min_match` tokens) that occurred before is found, the
    match is extended backwards to measure its true length m, and the tokens that followed it are the draft, of
    length min(max_tokens, m): a long match (copying a file, quoting a tool output) drafts far, a short one
    drafts little. Indexing is incremental: each token is indexed once, O(max_ngram) per token.
    """

    name = "history"
    wants_hidden = False

    def __init__(self, *, max_ngram: int = 6, min_match: int = 2, max_extend: int = 64) -> None:
        if not 1 <= min_match <= max_ngram:
            raise ValueError(f"need 1 <= min_match <= max_ngram, got {min_match}, {max_ngram}")
        self.max_ngram, self.min_match, self.max_extend = max_ngram, min_match, max_extend
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self._indexed = 0  # n-grams ending at positions < _indexed are in the index
        self._tokens: list[int] = []

    def attach(self, cache: ModelKV) -> None:
        pass

    def begin(self, context: Sequence[int]) -> None:
        """A context extending the one indexed keeps the index (a session's next turn indexes only its new tokens)."""
        self._sync(context)

    def _sync(self, context: Sequence[int]) -> list[int]:
        """Keep our copy of the context; a context that is not an extension of it restarts the index."""
        toks = self._tokens
        n = len(toks)
        if len(context) < n or (n and (context[n - 1] != toks[-1] or context[0] != toks[0])):
            self._index = [{} for _ in range(self.max_ngram + 1)]
            self._indexed = 0
            self._tokens = toks = []
            n = 0
        toks.extend(context[n:])
        return toks

    def _index_upto(self, toks: list[int], end: int) -> None:
        """Index every n-gram whose last token is at a position < end - 1 (so a continuation exists)."""
        for e in range(self._indexed, end):  # n-grams ending just before position e map to e
            for n in range(1, min(self.max_ngram, e) + 1):
                self._index[n][tuple(toks[e - n : e])] = e
        self._indexed = max(self._indexed, end)

    def propose(self, context: Sequence[int], max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        toks = self._sync(context)
        t = len(toks)
        self._index_upto(toks, t)  # continuation starts at e <= t - 1: never the suffix itself
        for n in range(min(self.max_ngram, t - 1), self.min_match - 1, -1):
            e = self._index[n].get(tuple(toks[t - n :]))
            if e is None:
                continue
            m = n
            while m < self.max_extend and e - m - 1 >= 0 and toks[e - m - 1] == toks[t - m - 1]:
                m += 1
            k = min(max_tokens, m)
            period = t - e  # the match recurs every `period` tokens: a continuation past t repeats the cycle
            return Draft([toks[e + i % period] for i in range(k)])
        return Draft([])

    def accepted(self, context: Sequence[int], n_accepted: int, hidden: Tensor | None) -> None:
        pass


class RandomDraft:
    """Uniformly random drafts from its own seeded generator: almost always wrong, which is the point (tests)."""

    name = "random"
    wants_hidden = False

    def __init__(self, vocab_size: int, *, seed: int = 0, sampled: bool = False) -> None:
        self.vocab_size = vocab_size
        self.sampled = sampled  # report q (uniform) instead of claiming a deterministic guess
        self._gen = torch.Generator().manual_seed(seed)

    def attach(self, cache: ModelKV) -> None:
        pass

    def begin(self, context: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        tokens = torch.randint(0, self.vocab_size, (max_tokens,), generator=self._gen).tolist()
        q = torch.full((max_tokens, self.vocab_size), 1.0 / self.vocab_size) if self.sampled else None
        return Draft(tokens, q)

    def accepted(self, context: Sequence[int], n_accepted: int, hidden: Tensor | None) -> None:
        pass
