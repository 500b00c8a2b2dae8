"""KV policies chosen per session at CreateSession: resolved with kv.spec, built with kv.policy.

The protocol carries `KvPolicy{name, params}` untouched. `PolicyRegistry.resolve` validates it with
`kv.spec.PolicySpec.parse` (plus the checks that depend on the served model, e.g. a lattice codec's
head_dim, and on the session's context: no window, sink or block larger than it), so an unknown name or a
bad parameter is refused with INVALID_ARGUMENT before a session exists. `build` makes the session's cache
with `kv.policy.make_policy_cache` on the engine thread (it allocates tensors): capacity is the session's
context length, dtype and device the engine's, and restore gets a same-checkpoint proposer (proposer = the
served model, identity projection).

Policies (kv.policy has the table): full (every position kept: the oracle), sink_window (sink + last
window, fixed memory), restore (sink + window resident, evicted K/V recomputed per step or turn) and
sparse (an exact hot window, packed cold blocks, the top-k blocks per query by an indexer).
Every governed layer's `length` counts all positions seen, evicted or not, so the store's INV-1/INV-2
checks read the same numbers under every policy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.engine.proposers import ModelProposer, same_checkpoint_proposer
from kakeya_runtime.kv.policy import PolicyKV, check_fits, check_head_profile, make_policy_cache
from kakeya_runtime.kv.spec import LATTICE_KINDS, POLICIES, CodecSpec, PolicyError, PolicySpec, check_codec
from kakeya_runtime.models.config import ModelConfig
from kakeya_runtime.sessions.errors import InvalidArgument, quoted

DEFAULT_POLICY = "full"

__all__ = ["DEFAULT_POLICY", "POLICIES", "CodecSpec", "PolicyRegistry", "PolicySpec", "parse_codec"]


class PolicyRegistry:
    """The policies a server accepts (all of kv.spec.POLICIES by default, the default policy first)."""

    def __init__(self, names: Iterable[str] = POLICIES) -> None:
        names = list(dict.fromkeys(names))
        unknown = [n for n in names if n not in POLICIES]
        if unknown:
            raise ValueError(f"unknown KV policies {unknown} (available: {', '.join(POLICIES)})")
        if DEFAULT_POLICY not in names:
            raise ValueError(f"the default policy {DEFAULT_POLICY!r} must stay available")
        self._names = names
        self._proposers: dict[tuple[int, int], ModelProposer] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self._names)

    def resolve(self, name: str | None, params: Mapping[str, Any] | None = None,
                config: ModelConfig | None = None, context_length: int | None = None) -> PolicySpec:
        """The validated spec (normalised params); InvalidArgument for unknown names or bad params.
        With `config`, codec parameters are also checked against the model (lattice head_dim); with
        `context_length`, sizes against the session's context."""
        name = name or DEFAULT_POLICY
        if name not in self._names:
            raise InvalidArgument(f"unknown KV policy {quoted(name)} (available: {', '.join(self._names)})")
        try:
            spec = PolicySpec.parse(name, params)
            if config is not None:
                if spec.name != "full":
                    check_codec(spec.codec, "codec", config.head_dim)
                if spec.idle_codec is not None:
                    check_codec(spec.idle_codec, "idle_codec", config.head_dim)
                spec = check_head_profile(config, spec)  # heads=profile: bound to the profile's digest
            if context_length is not None:
                check_fits(spec, context_length)
                _check_window_fits(spec, context_length)
        except PolicyError as e:
            raise InvalidArgument(str(e)) from None
        return spec

    def build(self, engine: Engine, spec: PolicySpec, capacity: int) -> PolicyKV:
        """A fresh cache for one session; called on the engine thread."""
        proposer = self._proposer(engine, spec.chunk) if spec.name == "restore" else None
        try:
            return make_policy_cache(engine.config, spec, capacity=capacity, dtype=engine.dtype,
                                     device=engine.device, proposer=proposer)
        except PolicyError as e:  # resolve() checked everything a build checks; belt and braces
            raise InvalidArgument(str(e)) from None

    def _proposer(self, engine: Engine, chunk: int) -> ModelProposer:
        """Proposers hold no state between calls: one per (engine, chunk), shared by sessions."""
        key = (id(engine), chunk)
        with self._lock:
            proposer = self._proposers.get(key)
            if proposer is None or proposer.model is not engine.model:
                proposer = self._proposers[key] = same_checkpoint_proposer(engine.model, chunk=chunk)
            return proposer


def _check_window_fits(spec: PolicySpec, context: int) -> None:
    """sink_window and restore preallocate sink + window (+ spare) slots per layer at the first Generate: sizes past
    the session's context would allocate slots no position can fill (kv.policy.check_fits does this for sparse)."""
    if spec.name not in ("sink_window", "restore"):
        return
    too_big = [f"{k} = {v}" for k, v in (("sink + window", spec.sink + spec.window), ("spare", spec.spare))
               if v > context]
    if too_big:
        raise PolicyError(f"{', '.join(too_big)} exceeds the context of {context} positions")


def parse_codec(kind: str | None, q: int, config: ModelConfig | None = None) -> CodecSpec | None:
    """A server-wide idle codec from its CLI/config form ("none"/None: no default); ValueError when bad."""
    if kind is None or kind.lower() == "none":
        return None
    try:
        lattice = kind.lower() in LATTICE_KINDS  # --idle-q has a default: given to the codecs that take one
        spec = PolicySpec.parse("full", {"idle_codec": kind, **({"idle_q": q} if lattice else {})}).idle_codec
        if config is not None and spec is not None:
            check_codec(spec, "idle_codec", config.head_dim)
    except PolicyError as e:
        raise ValueError(f"idle codec: {e}") from None
    return spec
