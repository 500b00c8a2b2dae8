"""KV policies chosen per session at CreateSession: a name plus parameters, passed to a cache factory.

The protocol carries `KvPolicy{name, params}` untouched; each policy validates its own parameters
(so the store and the server need no change when a policy is added) and builds the session's
cache on the engine thread. Only "full" (every position kept: the oracle) exists so far.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.kv.cache import ModelKV
from kakeya_runtime.sessions.errors import InvalidArgument

DEFAULT_POLICY = "full"


@dataclass(slots=True, frozen=True)
class PolicySpec:
    name: str
    params: dict[str, Any] = field(default_factory=dict)  # validated and normalised by the policy


class CachePolicy(Protocol):
    name: str

    def validate(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Normalised parameters (defaults filled in); raise InvalidArgument on unknown or bad keys."""
        ...

    def build(self, engine: Engine, params: Mapping[str, Any], capacity: int) -> ModelKV:
        """A fresh cache for one session; called on the engine thread (it allocates tensors)."""
        ...


class FullPolicy:
    """Every position of the history stays resident (preallocated storage that grows by doubling)."""

    name = "full"

    def validate(self, params: Mapping[str, Any]) -> dict[str, Any]:
        if params:
            raise InvalidArgument(f"KV policy 'full' takes no parameters, got {sorted(params)}")
        return {}

    def build(self, engine: Engine, params: Mapping[str, Any], capacity: int) -> ModelKV:
        return engine.new_cache(capacity=capacity)


class PolicyRegistry:
    def __init__(self, policies: Iterable[CachePolicy] = (FullPolicy(),)) -> None:
        self._policies: dict[str, CachePolicy] = {}
        for p in policies:
            self.register(p)

    def register(self, policy: CachePolicy) -> None:
        self._policies[policy.name] = policy

    def names(self) -> list[str]:
        return sorted(self._policies)

    def resolve(self, name: str, params: Mapping[str, Any] | None = None) -> PolicySpec:
        name = name or DEFAULT_POLICY
        policy = self._policies.get(name)
        if policy is None:
            raise InvalidArgument(f"unknown KV policy {name!r} (available: {', '.join(self.names())})")
        return PolicySpec(name, policy.validate(dict(params or {})))

    def build(self, engine: Engine, spec: PolicySpec, capacity: int) -> ModelKV:
        return self._policies[spec.name].build(engine, spec.params, capacity)
