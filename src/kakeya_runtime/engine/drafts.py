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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kakeya_runtime.engine.sampling import SamplingParams
from kakeya_runtime.kv.cache import ModelKV

CHEAP_VERIFY_TOKENS = 16  # a verifier chunk of up to this many rows costs about one decode step (one AMX row tile)


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


class NgramIndex:
    """A growing token sequence and, for every n-gram (n in 1..max_ngram) in it, the end of its most recent
    occurrence that has a continuation. Indexing is incremental: each token is indexed once, O(max_ngram)."""

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self._indexed = 0  # n-grams ending before positions < _indexed are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def index_upto(self, end: int) -> None:
        """Index every n-gram ending just before position e, for e < end (so a continuation toks[e] exists)."""
        toks, index = self.tokens, self._index
        for e in range(self._indexed, end):
            for n in range(1, min(self.max_ngram, e) + 1):
                index[n][tuple(toks[e - n : e])] = e
        self._indexed = max(self._indexed, end)

    def find(self, suffix: Sequence[int], min_match: int, max_extend: int) -> tuple[int, int] | None:
        """The most recent occurrence of the longest suffix of `suffix` (at least min_match tokens) found here:
        (e, m), e the position right after the occurrence and m the true match length (extended backwards up to
        max_extend tokens); None when nothing matches."""
        toks, t = self.tokens, len(suffix)
        for n in range(min(self.max_ngram, t), min_match - 1, -1):
            e = self._index[n].get(tuple(suffix[t - n :]))
            if e is None:
                continue
            m = n
            while m < max_extend and e - m - 1 >= 0 and m < t and toks[e - m - 1] == suffix[t - m - 1]:
                m += 1
            return e, m
        return None


class HistoryLookup:
    """Prompt-lookup / SuffixDecoding-style drafts from the context itself.

    An index maps every n-gram (n in 1..max_ngram) of the context to the end of its most recent occurrence. To
    propose, the longest suffix of the context (at least `min_match` tokens) that occurred before is found (the
    most recent occurrence), the match is extended backwards to measure its true length m, and the tokens that
    followed it are the draft, of length min(max_tokens, draft_factor * m) (SuffixDecoding's adaptive length): a
    long match (copying a file, quoting a tool output) drafts far, a one-token match drafts a little. Drafting is
    free next to the verifier (a dictionary lookup), so the adaptive cap (`auto_draft_tokens`) is the longest
    draft a verifier step checks at about the cost of a decode step.

    `related` (optional) gives other token histories to draft from when the context itself has no match: the
    same owner's other sessions (sessions.speculation builds it owner-scoped; it never sees another key's).
    Each related history is indexed once and kept while it stays an extension of what was indexed.
    """

    name = "history"
    wants_hidden = False
    draft_cost = 0.0  # in decode steps per drafted token
    auto_draft_tokens = CHEAP_VERIFY_TOKENS - 1

    def __init__(self, *, max_ngram: int = 6, min_match: int = 1, max_extend: int = 64, draft_factor: int = 4,
                 related: Callable[[], Mapping[str, Sequence[int]]] | None = None) -> None:
        if not 1 <= min_match <= max_ngram:
            raise ValueError(f"need 1 <= min_match <= max_ngram, got {min_match}, {max_ngram}")
        if draft_factor < 1:
            raise ValueError(f"draft_factor must be >= 1, got {draft_factor}")
        self.max_ngram, self.min_match, self.max_extend = max_ngram, min_match, max_extend
        self.draft_factor = draft_factor
        self.related = related
        self._own = NgramIndex(max_ngram)
        self._others: dict[str, NgramIndex] = {}  # related history's key -> its index (kept while it extends)

    def attach(self, cache: ModelKV) -> None:
        pass

    def begin(self, context: Sequence[int]) -> None:
        """A context extending the one indexed keeps the index (a session's next turn indexes only its new tokens)."""
        self._own = _synced(self._own, context, self.max_ngram)
        if self.related is not None:
            others: dict[str, NgramIndex] = {}
            for key, h in self.related().items():
                if len(h) < 2:
                    continue
                index = _synced(self._others.get(key, NgramIndex(self.max_ngram)), h, self.max_ngram)
                index.index_upto(len(index.tokens))
                others[key] = index
            self._others = others

    def propose(self, context: Sequence[int], max_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        own = self._own = _synced(self._own, context, self.max_ngram)
        toks = own.tokens
        t = len(toks)
        own.index_upto(t)  # continuation starts at e <= t - 1: never the suffix itself
        hit = own.find(toks, self.min_match, self.max_extend)
        source = toks
        if hit is None or hit[1] < self.max_ngram:  # a short or no match: the same owner's other histories
            for other in self._others.values():
                found = other.find(toks, max(self.min_match, 1 if hit is None else hit[1] + 1), self.max_extend)
                if found is not None and (hit is None or found[1] > hit[1]):
                    hit, source = found, other.tokens
        if hit is None:
            return Draft([])
        e, m = hit
        k = min(max_tokens, self.draft_factor * m)
        if source is toks:
            period = t - e  # the match recurs every `period` tokens: a continuation past t repeats the cycle
            return Draft([toks[e + i % period] for i in range(k)])
        return Draft(list(source[e : e + k]))

    def accepted(self, context: Sequence[int], n_accepted: int, hidden: Tensor | None) -> None:
        pass


def _synced(index: NgramIndex, tokens: Sequence[int], max_ngram: int) -> NgramIndex:
    """`index` brought up to `tokens` when they extend what it holds, else a fresh index over them."""
    held = index.tokens
    n = len(held)
    if len(tokens) < n or (n and (tokens[n - 1] != held[-1] or tokens[0] != held[0])):
        index = NgramIndex(max_ngram)
        n = 0
    index.extend(tokens[n:])
    return index


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
