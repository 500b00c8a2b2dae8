"""KV policy specs (name + parameters, validated) and the model-level cache base every policy shares.

The policy protocol the engine, sessions and benchmarks use is ModelKV's (per-layer update_and_fetch,
`length`, `capacity`, `trim`, `nbytes`, `state`/`load_state`) plus the hooks defined on `PolicyKV`:
`begin_step(input_ids, start)` / `end_step()` around every forward the engine runs,
`end_turn()` when a generation ends, and `effective_attention_fraction`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kakeya_runtime.kv.cache import ModelKV
from kakeya_runtime.kv.heads import DIGEST_CHARS
from kakeya_runtime.kv.lattice import LatticeError, check_lattice

POLICIES = ("full", "sink_window", "restore", "sparse")
GRANULARITIES = ("per_step", "per_turn")
CODEC_KINDS = ("identity", "d4", "e8", "int8")
LATTICE_KINDS = ("d4", "e8")  # the codecs that take a range q
RANGELESS_KINDS = tuple(k for k in CODEC_KINDS if k not in LATTICE_KINDS)  # ... and those that take none
HEADS = ("all", "profile")
DEFAULT_Q = 38  # D4 at head_dim 64: 54 bytes/vector = 0.42x bf16 (tests/kv/test_lattice.py)


class PolicyError(ValueError):
    """An unknown KV policy or invalid policy parameters (maps to INVALID_ARGUMENT)."""


def stored_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A policy's params as an earlier Kakeya stored them (a journal, an archive): until 2026-12-01 it wrote q and
    idle_q beside int8 too, which a request is now refused for; what a codec does not use is dropped here."""
    out = dict(params or {})
    if "q" in out and str(out.get("codec", "")).strip().lower() in RANGELESS_KINDS:
        del out["q"]
    if "idle_q" in out and str(out.get("idle_codec", "")).strip().lower() in RANGELESS_KINDS:
        del out["idle_q"]
    return out


def _refuse_unused_q(given: Mapping[str, Any], key: str, codec_key: str, kind: str) -> None:
    """A range for a codec that takes none would be silently dropped: refuse it instead."""
    if key in given and kind in RANGELESS_KINDS:
        raise PolicyError(f"KV policy parameter {key!r} sets the range of a lattice {codec_key} "
                          f"({', '.join(LATTICE_KINDS)}); {codec_key} {kind!r} takes none")


@dataclass(slots=True, frozen=True)
class CodecSpec:
    kind: str = "identity"  # identity | d4 | e8 | int8; as an idle codec also "none": never compressed
    q: int = DEFAULT_Q  # lattice range (ignored by the others)

    @property
    def label(self) -> str:
        return f"{self.kind}/q{self.q}" if self.kind in LATTICE_KINDS else self.kind


SPARSE_BUDGET = 0.125  # sparse: at >= 8k a query then reads <= 25% of the history (defaults)
_KEYS: dict[str, dict[str, Any]] = {
    "full": {"idle_codec": "none", "idle_q": DEFAULT_Q},
    "sink_window": {"sink": 4, "window": 1024, "spare": 0, "codec": "identity", "q": DEFAULT_Q,
                    "idle_codec": "none", "idle_q": DEFAULT_Q},
    "restore": {"sink": 4, "window": 1024, "granularity": "per_step", "chunk": 512, "codec": "identity",
                "q": DEFAULT_Q, "idle_codec": "none", "idle_q": DEFAULT_Q},
    "sparse": {"sink": 4, "window": 512, "block": 32, "topk": 32, "spare": 0, "codec": "d4", "q": DEFAULT_Q,
               "heads": "all", "idle_codec": "none", "idle_q": DEFAULT_Q, "budget": SPARSE_BUDGET},
}


@dataclass(slots=True, frozen=True)
class PolicySpec:
    """A validated policy: `PolicySpec.parse(name, params)`; `params` gives the normalised dict back."""

    name: str = "full"
    sink: int = 0
    window: int = 0
    spare: int = 0  # sink_window, sparse: extra ring slots, so a trim may roll back that many positions
    block: int = 0  # sparse: positions per cold block
    topk: int = 0  # sparse: cold blocks each query attends to (at least)
    budget: float = 0.0  # sparse: share of its selectable cold blocks a query attends to when that exceeds topk
    heads: str = "all"  # sparse: "all" heads use the cold tier, or per head as the model's profile says (kv.heads):
    # "profile", bound at the session's creation to "profile:<digest>" of the profile it was built with
    granularity: str = "per_step"  # restore: recompute every decode step, or once per generation
    chunk: int = 512  # restore: proposer forward chunk (bounds its activations)
    codec: CodecSpec = CodecSpec()  # resident-cache codec (sink_window, restore)
    idle_codec: CodecSpec | None = None  # codec for compress_idle(); None: the server's; kind "none": never

    @classmethod
    def parse(cls, name: str | None, params: Mapping[str, Any] | None = None) -> PolicySpec:
        name = name or "full"
        if name not in _KEYS:
            raise PolicyError(f"unknown KV policy {name!r} (available: {', '.join(POLICIES)})")
        given = dict(params or {})
        unknown = sorted(set(given) - set(_KEYS[name]))
        if unknown:
            raise PolicyError(f"KV policy {name!r} has no parameter(s) {unknown} (known: {sorted(_KEYS[name])})")
        p = {**_KEYS[name], **given}
        idle_kind = _choice(p, "idle_codec", ("none", *CODEC_KINDS))
        idle_q = _int(p, "idle_q", 1)
        if idle_kind == "none" and "idle_q" in given:  # it would change nothing: the server's idle codec has its own
            raise PolicyError("KV policy parameter 'idle_q' sets the q of the session's idle_codec, and none is set "
                              "(the server's default idle codec takes `kakeya serve --idle-q`)")
        _refuse_unused_q(given, "idle_q", "idle_codec", idle_kind)
        if idle_kind == "none":  # asked for: this session is never compressed; not given: the server's default
            idle = CodecSpec("none") if "idle_codec" in given else None
        else:
            idle = CodecSpec(idle_kind, idle_q)
            check_codec(idle, "idle_codec")
        if name == "full":
            return cls(name, idle_codec=idle)
        codec = CodecSpec(_choice(p, "codec", CODEC_KINDS), _int(p, "q", 1))
        _refuse_unused_q(given, "q", "codec", codec.kind)
        check_codec(codec, "codec")
        common = dict(sink=_int(p, "sink", 0), window=_int(p, "window", 1), codec=codec, idle_codec=idle)
        if name == "sink_window":
            return cls(name, spare=_int(p, "spare", 0), **common)
        if name == "sparse":
            return cls(name, spare=_int(p, "spare", 0), block=_int(p, "block", 1), topk=_int(p, "topk", 1),
                       heads=_heads(p), budget=_fraction(p, "budget"), **common)
        return cls(name, granularity=_choice(p, "granularity", GRANULARITIES), chunk=_int(p, "chunk", 1), **common)

    @property
    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.name != "full":
            out.update(sink=self.sink, window=self.window, codec=self.codec.kind)
            if self.codec.kind in LATTICE_KINDS:  # a lattice codec's q; the others have none
                out["q"] = self.codec.q
        if self.name in ("sink_window", "sparse"):
            out["spare"] = self.spare
        if self.name == "sparse":
            out.update(block=self.block, topk=self.topk, heads=self.heads, budget=self.budget)
        if self.name == "restore":
            out.update(granularity=self.granularity, chunk=self.chunk)
        if self.idle_codec is not None:
            out["idle_codec"] = self.idle_codec.kind
            if self.idle_codec.kind in LATTICE_KINDS:
                out["idle_q"] = self.idle_codec.q
        return out

    @property
    def label(self) -> str:
        """Short human form, e.g. `restore(4+64, per_turn, d4/q38)`."""
        if self.name == "full":
            inner = ""
        else:
            parts = [f"{self.sink}+{self.window}"]
            if self.name == "restore":
                parts.append(self.granularity)
            if self.name == "sparse":
                parts.append(f"top {self.topk} x {self.block}" + (f" or {self.budget:g} of them" if self.budget else "")
                             + (", per-head profile" if self.heads.startswith("profile") else ""))
            if self.codec.kind != "identity":
                parts.append(self.codec.label)
            inner = ", ".join(parts)
        idle = f" idle:{self.idle_codec.label}" if self.idle_codec else ""
        return f"{self.name}({inner}){idle}"


_INT_TEXT = re.compile(r"-?[0-9]+", re.ASCII)  # what a string integer may be (not "²", "--5" or other scripts' digits)


def _int(p: Mapping[str, Any], key: str, minimum: int) -> int:
    """Integers may arrive as JSON/Struct numbers (floats) or strings of ASCII digits; bools are refused."""
    raw = p[key]
    value: int | None = None
    if isinstance(raw, bool):
        value = None
    elif isinstance(raw, int):
        value = raw
    elif (isinstance(raw, float) and raw.is_integer()) or (  # a string of thousands of digits: refused, not parsed
            isinstance(raw, str) and len(raw) <= 40 and _INT_TEXT.fullmatch(raw.strip())):
        value = int(raw)
    if value is None:
        raise PolicyError(f"KV policy parameter {key!r} must be an integer, got {raw!r}")
    if value < minimum:
        raise PolicyError(f"KV policy parameter {key!r} must be >= {minimum}, got {value}")
    if value > 1 << 24:
        raise PolicyError(f"KV policy parameter {key!r} is too large: {value}")
    return value


def _fraction(p: Mapping[str, Any], key: str) -> float:
    """A share in [0, 1]: a JSON/Struct number or a numeric string; bools, NaN and out-of-range are refused."""
    raw = p[key]
    value: float | None = None
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw)
        except ValueError:
            value = None
    if value is None or not 0.0 <= value <= 1.0:  # NaN fails both comparisons
        raise PolicyError(f"KV policy parameter {key!r} must be a number in [0, 1], got {raw!r}")
    return value


def _heads(p: Mapping[str, Any]) -> str:
    """"all", "profile" (the model's profile, bound to its digest when the session is made: kv.policy), or
    "profile:<digest>" (a session's, as journaled and archived)."""
    raw = p["heads"]
    if isinstance(raw, str) and raw.lower().startswith("profile:"):
        digest = raw[len("profile:"):].lower()
        if len(digest) == DIGEST_CHARS and all(c in "0123456789abcdef" for c in digest):
            return "profile:" + digest
        raise PolicyError(f"KV policy parameter 'heads' names a profile by {DIGEST_CHARS} hex digits "
                          f"(profile:<digest>), got {raw!r}")
    return _choice(p, "heads", HEADS)


def _choice(p: Mapping[str, Any], key: str, options: tuple[str, ...]) -> str:
    raw = p[key]
    if not isinstance(raw, str) or raw.lower() not in options:
        raise PolicyError(f"KV policy parameter {key!r} must be one of {list(options)}, got {raw!r}")
    return raw.lower()


def check_codec(codec: CodecSpec, key: str, head_dim: int | None = None) -> None:
    if codec.kind not in LATTICE_KINDS:
        return
    try:
        check_lattice(codec.kind, codec.q, head_dim)
    except LatticeError as e:
        raise PolicyError(f"KV policy parameter {key!r}: {e}") from None


class PolicyKV(ModelKV):
    """ModelKV plus the policy hooks. As a class of its own it is the full cache (every position kept)."""

    def __init__(self, layers: list, *, batch: int, capacity: int, dtype: torch.dtype, spec: PolicySpec,
                 governed: list[int]) -> None:
        super().__init__(layers, batch=batch, capacity=capacity, dtype=dtype)
        self.spec = spec
        self.governed = governed  # layers the policy decides (not Gemma's native sliding layers)
        self.peak_transient_bytes = 0  # K/V held only during a step, at its largest since reset_stats()

    # begin_step / end_step / end_turn / effective_attention_fraction: ModelKV's no-ops (full keeps all).

    @property
    def resident_nbytes(self) -> int:
        """K/V bytes kept between steps (the sustained footprint)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def transient_nbytes(self) -> int:
        """K/V bytes held right now only for the current step or turn (restored K/V)."""
        return 0

    @property
    def nbytes(self) -> int:
        return self.resident_nbytes + self.transient_nbytes

    @property
    def history_nbytes(self) -> int:
        """Token ids the policy keeps (restore needs the history to recompute; O(T) int32)."""
        return 0

    def reset_stats(self) -> None:
        self.peak_transient_bytes = self.transient_nbytes

    def memory_stats(self) -> dict[str, int]:
        return {"resident_bytes": self.resident_nbytes, "transient_bytes": self.transient_nbytes,
                "peak_transient_bytes": self.peak_transient_bytes, "history_bytes": self.history_nbytes}
