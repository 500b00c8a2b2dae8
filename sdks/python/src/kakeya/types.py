"""Plain data returned by the client (no protobuf objects leak into user code)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class FinishReason(enum.Enum):
    STOP = "stop"  # an EOS / stop token was generated (it is the last token and is in the history)
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the session was closed while generating
    UNSPECIFIED = "unspecified"


@dataclass(slots=True, frozen=True)
class KvPolicy:
    """A per-session KV policy: name plus parameters, passed through to the server's cache factory.

    Server policies: "full" (every position kept), "sink_window" (sink + window positions, fixed
    memory), "restore" (sink + window resident, evicted K/V recomputed so attention sees everything),
    "sparse" (an exact hot window plus packed cold blocks, each query attending to the top-k blocks an
    indexer picks for it).
    E.g. `KvPolicy("sink_window", {"sink": 4, "window": 1024})`. Responses carry normalised params.
    """

    name: str = "full"
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Speculation:
    """Exact speculative decoding: a proposer drafts up to `max_draft_tokens` tokens per step and the model
    verifies them in one forward. It changes speed, never what is generated (greedy output is identical; sampled
    output has the same distribution). With "history" a seeded sampled stream is the one without speculation;
    with "self" and "draft_head" (random drafts) it repeats with the same seed AND the same speculation setting. Proposers: "history" (copies from the session's own history: fast when the model
    quotes or re-emits earlier text), "self" (a layer-skipping draft from the served model itself), "draft_head"
    (an EAGLE-style head; untrained unless the server has one: exact but slow), "off". `max_draft_tokens` in
    [1, 16]; 0: adaptive (history drafts up to 15 tokens, more the longer its match; self and draft_head up to
    4, grown from 1 while accepted). The session's KV policy must be able to roll a draft back (full and
    restore can; sink_window and sparse need spare >= max_draft_tokens and the identity codec), else
    InvalidArgument as a session's default (create_session) and FailedPrecondition for one Generate (the
    session's policy is set; the call does not fit it)."""

    proposer: str = "history"
    max_draft_tokens: int = 0


@dataclass(slots=True, frozen=True)
class GenerateStats:
    prefill_tokens: int  # only the history not yet cached: the incremental prefill
    prefill_s: float
    ttft_s: float
    decode_s: float
    decode_tokens: int
    decode_tokens_per_s: float
    queue_s: float
    resume_s: float = 0.0  # decompressing an idle-compressed cache before the prefill (part of ttft_s)
    speculation: str = ""  # the draft proposer used ("" when off)
    draft_tokens: int = 0  # drafts the verifier checked
    accepted_draft_tokens: int = 0
    acceptance_rate: float = 0.0  # accepted / drafted
    tokens_per_verifier_step: float = 0.0  # tokens emitted per verifier forward (accepted drafts + 1)
    verifier_steps: int = 0
    speculation_pauses: int = 0  # times speculation paused because acceptance was too low to pay


@dataclass(slots=True, frozen=True)
class GenerateResult:
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    stats: GenerateStats
    history_length: int
    stop_string: str | None = None  # the stop string that ended the generation (finish_reason STOP), if one did

    def text_before_stop(self, text: str) -> str:
        """`text` (these tokens, decoded) cut before the stop string that ended the generation; unchanged when
        none did. The tokens themselves (and the session history) keep the stop string."""
        if self.stop_string is None:
            return text
        at = text.find(self.stop_string)
        return text if at < 0 else text[:at]


@dataclass(slots=True, frozen=True)
class SparseStats:
    """What the sparse policy did so far: counters summed over steps, query tokens and KV heads (in total and
    per governed layer: steps, queries, blocks_scored, blocks_selected, positions_attended, positions_visible),
    and the bytes of its hot set, packed cold blocks and index."""

    total: dict[str, int]
    layers: tuple[dict[str, int], ...]
    hot_bytes: int
    cold_bytes: int
    index_bytes: int

    @property
    def attended_fraction(self) -> float:
        """Keys attended over keys full attention would have read."""
        return self.total["positions_attended"] / max(1, self.total["positions_visible"])


@dataclass(slots=True, frozen=True)
class SessionInfo:
    session_id: str
    history_length: int
    cached_length: int  # history tokens whose K/V are resident; the rest prefill at the next Generate
    kv_live_bytes: int
    policy: KvPolicy
    inv1_checks: int
    inv2_checks: int
    inv1_violations: int
    inv2_violations: int
    generate_calls: int
    idle_s: float
    context_length: int
    generating: bool
    history_token_ids: tuple[int, ...] | None  # only when asked for
    policy_label: str = ""  # e.g. "sink_window(4+1024)"
    kv_resident_bytes: int = 0  # kept between steps; kv_live_bytes adds what a step holds transiently
    kv_history_bytes: int = 0  # token ids the cache keeps besides K/V (restore)
    effective_attention_fraction: float = 1.0  # share of the prefix the newest query attended to
    kv_compressed: bool = False  # compressed while idle; the next generate decompresses it
    idle_compressions: int = 0
    sparse: SparseStats | None = None  # the sparse policy's counters and memory split (None under others)
    speculation: Speculation | None = None  # the session's default speculation (None: off)

    @property
    def remaining(self) -> int:
        """Tokens the session can still take (appends plus max_tokens)."""
        return self.context_length - self.history_length


@dataclass(slots=True, frozen=True)
class ModelInfo:
    model_name: str
    model_type: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    context_length: int
    tokenizer_json: str
    chat_template: str | None
    max_sessions: int
    max_concurrent: int
    session_idle_ttl_s: float
    kv_policies: tuple[str, ...]
    idle_compress_after_s: float | None = None  # None: the server never compresses idle sessions
    idle_codec: str | None = None  # the server's default idle codec, e.g. "d4/q38"
    # The served configuration (kakeya serve --weights/--compile); "" from servers older than these fields.
    weight_format: str = ""  # bf16, fp32, int8, int4 or int4-mixed
    weight_format_source: str = ""  # auto, flag or "as loaded"
    compiled_decode: bool = False
    fidelity_kl: float | None = None  # next-token KL vs bf16 on the bench text; None for bf16 / not measured
    fidelity_top1: float | None = None  # top-1 agreement with bf16 on the bench text
    invariant_numerics: bool = False  # INV-3: bit-exact whatever the step shapes
    measured_decode_tok_s: float | None = None  # decode rate measured at the server's start-up
    # The caller's share (every key has the same; max_sessions is the server's total): sessions one key holds at
    # once (a new one beyond it evicts that key's least recently used idle session), KV bytes all sessions and one
    # key's may reserve. None from servers older than these fields.
    max_sessions_per_key: int | None = None
    kv_budget_bytes: int | None = None
    kv_budget_per_key_bytes: int | None = None
    runtime_version: str | None = None  # the server's kakeya-runtime version; None from servers older than it
