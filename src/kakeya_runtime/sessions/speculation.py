"""Speculation settings for sessions: validate a (proposer, max_draft_tokens) request against the served model
and the session's KV policy, and build the draft proposer a Generate uses.

A policy must be able to roll back `max_draft_tokens` positions, exactly: full (native sliding rings keep
kv.cache.SLIDING_SPARE spare slots) and restore (evicted positions are recomputed) always can; sink_window and
sparse can when their `spare` ring slots cover the draft and their resident store is lossless (a lossy codec
re-encodes K/V at each step's end, so a verifier chunk would see K/V a token-by-token decode does not: not exact).
Anything else is refused with a typed error, never silently decoded without speculation.

`max_draft_tokens` 0 is the adaptive setting: each proposer's own cap (history lookup: up to 15 tokens, following
the match length; the model-based proposers: up to 4, grown from 1 while their drafts are accepted), never past
what the policy can roll back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kakeya_runtime.engine.drafts import DraftProposer, HistoryLookup
from kakeya_runtime.engine.self_draft import DraftHead, DraftHeadProposer, LayerSkipDraft
from kakeya_runtime.engine.speculative import MAX_DRAFT_TOKENS
from kakeya_runtime.kv.spec import PolicySpec
from kakeya_runtime.models.base import DecoderModel
from kakeya_runtime.sessions.errors import FailedPrecondition, InvalidArgument, quoted

DEFAULT_DRAFT_TOKENS = 0  # 0: adaptive (the proposer's own cap, `auto_draft_tokens`)
AUTO_DRAFT_TOKENS = {"history": HistoryLookup.auto_draft_tokens, "self": LayerSkipDraft.auto_draft_tokens,
                     "draft_head": DraftHeadProposer.auto_draft_tokens}
PROPOSERS = ("history", "self", "draft_head")  # what a client may name (besides "" / "off")
OFF = ("", "off")


@dataclass(slots=True, frozen=True)
class SpeculationSpec:
    proposer: str  # one of PROPOSERS
    max_draft_tokens: int = DEFAULT_DRAFT_TOKENS  # 0: adaptive


def parse_speculation(proposer: str, max_draft_tokens: int = 0,
                      available: tuple[str, ...] = PROPOSERS) -> SpeculationSpec | None:
    """The validated setting (None: off); InvalidArgument for an unknown proposer or a draft length out of range."""
    name = proposer.strip().lower()
    k = max_draft_tokens
    if not 0 <= k <= MAX_DRAFT_TOKENS:  # checked with speculation off too: a typo is not silently dropped
        raise InvalidArgument(f"max_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}] (0: adaptive), "
                              f"got {max_draft_tokens}")
    if name in OFF:
        return None
    if name not in available:
        raise InvalidArgument(f"unknown speculation proposer {quoted(proposer)} (available: off, "
                              f"{', '.join(available)})")
    return SpeculationSpec(name, k)


def draft_tokens(spec: SpeculationSpec, policy: PolicySpec) -> int:
    """The draft cap a Generate runs with: the one asked for, or (adaptive) the proposer's own cap, within what
    the policy can roll back."""
    if spec.max_draft_tokens:
        return spec.max_draft_tokens
    k = AUTO_DRAFT_TOKENS.get(spec.proposer, 4)
    if policy.name in ("full", "restore"):
        return k
    return max(1, min(k, policy.spare))


def rollback_problem(policy: PolicySpec, max_draft_tokens: int) -> str | None:
    """Why a cache of this policy cannot roll back a rejected draft of max_draft_tokens exactly (None: it can;
    0, adaptive, needs one position: its drafts are then capped at the policy's spare slots)."""
    need = max(1, max_draft_tokens)
    if policy.name in ("full", "restore") and (policy.name == "full" or policy.codec.kind == "identity"):
        return None
    if policy.name == "restore":
        return (f"the restore policy with the lossy {policy.codec.kind} codec cannot verify drafts exactly "
                "(use codec=identity)")
    if policy.codec.kind != "identity":
        fix = "codec=identity" if policy.spare >= need else f"codec=identity and spare >= {need}"
        return (f"the {policy.name} policy with the lossy {policy.codec.kind} codec cannot verify drafts exactly "
                f"(use {fix})")
    if policy.spare < need:
        asked = ("adaptive speculation (max_draft_tokens=0)" if max_draft_tokens == 0
                 else f"speculation with max_draft_tokens={max_draft_tokens}")
        return (f"the {policy.name} policy can roll back {policy.spare} positions (its spare ring slots); "
                f"{asked} needs spare >= {need}")
    return None


def check_rollback(policy: PolicySpec, spec: SpeculationSpec | None, *, at_create: bool) -> None:
    if spec is None:
        return
    problem = rollback_problem(policy, spec.max_draft_tokens)
    if problem is not None:
        error = InvalidArgument if at_create else FailedPrecondition
        raise error(f"speculation refused: {problem}")


RELATED_SESSIONS = 4  # history lookup also drafts from at most this many of the owner's other sessions


def make_proposer(spec: SpeculationSpec, model: DecoderModel, draft_head: Callable[[], DraftHead],
                  related: Callable[[], dict[str, Sequence[int]]] | None = None) -> DraftProposer:
    """A fresh proposer for one session; `draft_head` gives the server's shared head (built on first use);
    `related` the histories history lookup may also draft from (`owner_histories`: the same owner's other
    sessions, never another key's)."""
    if spec.proposer == "history":
        return HistoryLookup(related=related)
    if spec.proposer == "self":
        return LayerSkipDraft(model)
    if spec.proposer == "draft_head":
        return DraftHeadProposer(draft_head())
    raise InvalidArgument(f"unknown speculation proposer {quoted(spec.proposer)}")


def owner_histories(sessions: Callable[[], Sequence[Any]], session: Any,
                    limit: int = RELATED_SESSIONS) -> Callable[[], dict[str, Sequence[int]]]:
    """For history lookup: the histories of `session`'s owner's other live sessions (the `limit` most recently
    used), read when a Generate begins. Owner-scoped by construction: a session of another key is never included.
    `sessions()` lists the live sessions least recently used first (SessionStore.live_sessions)."""

    def histories() -> dict[str, Sequence[int]]:
        mine = [s for s in sessions() if s.owner == session.owner and s is not session]
        return {s.id: list(s.history) for s in mine[-limit:]}

    return histories
