"""sessions.budget: the worst-case KV bytes a session reserves are never exceeded by a real cache filled to its
context, under every policy and codec, on both model families (Gemma 3 has native sliding layers)."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.server.testing import tiny_model
from kakeya_runtime.sessions.budget import (
    default_kv_budget,
    device_memory_bytes,
    kv_worst_case_bytes,
    model_bytes,
)
from kakeya_runtime.sessions.policy import PolicyRegistry

CONTEXT = 96
POLICIES = [
    ("full", {}),
    ("sink_window", {"sink": 4, "window": 16, "spare": 3}),
    ("sink_window", {"sink": 4, "window": 16, "codec": "d4"}),
    ("restore", {"sink": 4, "window": 16, "granularity": "per_step", "chunk": 24}),
    ("restore", {"sink": 2, "window": 12, "granularity": "per_turn", "codec": "d4"}),
    ("sparse", {"sink": 4, "window": 16, "block": 8, "topk": 2}),
    ("sparse", {"sink": 4, "window": 16, "block": 8, "topk": 2, "codec": "identity", "spare": 2}),
]


def _fill(engine: Engine, cache, turns: list[tuple[int, int]]) -> int:
    """Run Generate-like turns (prefill n new tokens, sample m) and return the peak K/V bytes seen."""
    g = torch.Generator().manual_seed(0)
    peak_resident = 0
    last: list[int] = []
    for n, m in turns:
        ids = torch.tensor([last + torch.randint(3, 200, (n,), generator=g).tolist()])  # (1, T)
        stream = engine.stream(cache, ids, GenerateRequest(max_new_tokens=m))
        for token in stream:
            last = [token[0]]
            peak_resident = max(peak_resident, cache.resident_nbytes + cache.history_nbytes)
    return peak_resident + cache.peak_transient_bytes


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize(("name", "params"), POLICIES, ids=lambda x: x if isinstance(x, str) else "-".join(
    f"{k}{v}" for k, v in x.items() if k in ("codec", "granularity", "spare")) or "default")
def test_a_cache_filled_to_its_context_stays_within_the_worst_case(kind, name, params):
    torch.set_num_threads(1)
    model = tiny_model(kind, context=CONTEXT)
    engine = Engine(model, prefill_chunk=32)  # several chunks per prefill
    registry = PolicyRegistry()
    spec = registry.resolve(name, params, model.config, CONTEXT)
    cache = registry.build(engine, spec, CONTEXT)
    # Two turns reach position 95: the last context slot (the final sample is never fed back).
    measured = _fill(engine, cache, [(60, 16), (19, 1)])
    assert cache.length == CONTEXT - 1
    worst = kv_worst_case_bytes(model.config, spec, CONTEXT, engine.dtype)
    assert measured <= worst
    if name == "full":
        assert worst == measured  # full holds exactly the context: the bound is exact
    else:
        assert worst < 2 * measured  # and not a bound so loose it would waste the budget


def test_bounded_policies_reserve_less_than_full_at_a_long_context():
    model = tiny_model("llama", context=8192)
    cfg, dtype = model.config, torch.bfloat16
    registry = PolicyRegistry()
    full = kv_worst_case_bytes(cfg, registry.resolve("full"), 8192, dtype)
    assert full == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2 * 8192
    window = kv_worst_case_bytes(cfg, registry.resolve("sink_window", {"sink": 4, "window": 1024}), 8192, dtype)
    assert window == full * 1028 // 8192
    restore = kv_worst_case_bytes(cfg, registry.resolve("restore", {"sink": 4, "window": 1024}), 8192, dtype)
    assert restore > full  # its overlay restores the whole context during a step: it is not cheaper to admit


def test_the_default_budget_is_half_of_what_the_weights_leave():
    model = tiny_model("llama")
    total = device_memory_bytes("cpu")
    assert total > 2**27  # a real machine's RAM
    assert default_kv_budget(model) == int((total - model_bytes(model)) * 0.5)
    assert model_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
