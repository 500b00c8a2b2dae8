"""Speculation settings for sessions: validate a (proposer, max_draft_tokens) request against the served model
and the session's KV policy, and build the draft proposer a Generate uses.

A policy must be able to roll back `max_draft_tokens` positions, exactly: full (native sliding rings keep
kv.cache.SLIDING_SPARE spare slots) and restore (evicted positions are recomputed) always can; sink_window and
sparse can when their `spare` ring slots cover the draft and their resident store is lossless (a lossy codec
re-encodes K/V at each step's end, so a verifier chunk would see K/V a token-by-token decode does not: not exact).
Anything else is refused with a typed error, never silently decoded without speculation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kakeya_runtime.engine.drafts import DraftProposer, HistoryLookup
from kakeya_runtime.engine.self_draft import DraftHead, DraftHeadProposer, LayerSkipDraft
from kakeya_runtime.engine.speculative import MAX_DRAFT_TOKENS
from kakeya_runtime.kv.spec import PolicySpec
from kakeya_runtime.models.base import DecoderModel
from kakeya_runtime.sessions.errors import FailedPrecondition, InvalidArgument, quoted

DEFAULT_DRAFT_TOKENS = 4
PROPOSERS = ("history", "self", "draft_head")  # what a client may name (besides "" / "off")
OFF = ("", "off")


@dataclass(slots=True, frozen=True)
class SpeculationSpec:
    proposer: str  # one of PROPOSERS
    max_draft_tokens: int = DEFAULT_DRAFT_TOKENS


def parse_speculation(proposer: str, max_draft_tokens: int = 0,
                      available: tuple[str, ...] = PROPOSERS) -> SpeculationSpec | None:
    """The validated setting (None: off); InvalidArgument for an unknown proposer or a draft length out of range."""
    name = proposer.strip().lower()
    if name in OFF:
        return None
    if name not in available:
        raise InvalidArgument(f"unknown speculation proposer {quoted(proposer)} (available: off, "
                              f"{', '.join(available)})")
    k = max_draft_tokens or DEFAULT_DRAFT_TOKENS
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidArgument(f"max_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}] (0: {DEFAULT_DRAFT_TOKENS}), "
                              f"got {max_draft_tokens}")
    return SpeculationSpec(name, k)


def rollback_problem(policy: PolicySpec, max_draft_tokens: int) -> str | None:
    """Why a cache of this policy cannot roll back a rejected draft of max_draft_tokens exactly (None: it can)."""
    if policy.name in ("full", "restore") and (policy.name == "full" or policy.codec.kind == "identity"):
        return None
    if policy.name == "restore":
        return (f"the restore policy with the lossy {policy.codec.kind} codec cannot verify drafts exactly "
                "(use codec=identity)")
    if policy.codec.kind != "identity":
        return (f"the {policy.name} policy with the lossy {policy.codec.kind} codec cannot verify drafts exactly "
                "(use codec=identity)")
    if policy.spare < max_draft_tokens:
        return (f"the {policy.name} policy can roll back {policy.spare} positions (its spare ring slots); "
                f"speculation with max_draft_tokens={max_draft_tokens} needs spare >= {max_draft_tokens}")
    return None


def check_rollback(policy: PolicySpec, spec: SpeculationSpec | None, *, at_create: bool) -> None:
    if spec is None:
        return
    problem = rollback_problem(policy, spec.max_draft_tokens)
    if problem is not None:
        error = InvalidArgument if at_create else FailedPrecondition
        raise error(f"speculation refused: {problem}")


def make_proposer(spec: SpeculationSpec, model: DecoderModel, draft_head: Callable[[], DraftHead]) -> DraftProposer:
    """A fresh proposer for one session; `draft_head` gives the server's shared head (built on first use)."""
    if spec.proposer == "history":
        return HistoryLookup()
    if spec.proposer == "self":
        return LayerSkipDraft(model)
    if spec.proposer == "draft_head":
        return DraftHeadProposer(draft_head())
    raise InvalidArgument(f"unknown speculation proposer {quoted(spec.proposer)}")
