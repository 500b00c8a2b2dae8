"""KV policies per session, through the real in-process server and the real SDK client (tiny fp32 model):
sink_window keeps its memory flat past sink + window, restore reproduces full's greedy tokens, bad specs
create nothing, the position limit is RESOURCE_EXHAUSTED with the session intact, and the info/metrics
fields report what each policy holds."""

from __future__ import annotations

import random

import pytest
import torch
from kakeya import Client, InvalidArgument, KvPolicy, ResourceExhausted

from kakeya_runtime.server.testing import metric_value as sample
from kakeya_runtime.server.testing import running_server, tiny_served
from kakeya_runtime.server.testing import scrape_metrics as scrape

# tiny llama (server.testing.tiny_config): 2 layers, 2 K/V heads, head_dim 16, fp32, context 512.
LAYERS, KV_HEADS, HEAD_DIM, FP32 = 2, 2, 16, 4
BYTES_PER_POSITION = LAYERS * 2 * KV_HEADS * HEAD_DIM * FP32  # K and V of one position, every layer


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]  # bytes only: no EOS (id 2) in the history


def _store(thread):
    return thread.server.service.store


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread for the engine thread too (set before the servers start): on this shared
    2-core machine two OpenMP threads stall whenever the other core is busy (~50x slower tiny steps)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def small():
    """A 64-position model: the position limit is cheap to reach."""
    with running_server(tiny_served("llama", context=64)) as thread:
        yield thread


def test_sink_window_is_flat_past_sink_plus_window_while_full_grows(client, server):
    sw_policy = KvPolicy("sink_window", {"sink": 4, "window": 32})
    sw_rows, full_rows = [], []
    with client.create_session(policy=sw_policy) as sw, client.create_session(policy="full") as full:
        assert sw.policy == KvPolicy("sink_window", {"sink": 4, "window": 32, "spare": 0, "codec": "identity"})
        assert sw.info().policy_label == "sink_window(4+32)"
        assert sw.info().effective_attention_fraction == 1.0  # nothing attended to yet, nothing evicted
        for turn in range(6):
            chunk = _tokens(40, seed=turn)
            for s, rows in ((sw, sw_rows), (full, full_rows)):
                s.append(chunk)
                assert len(s.generate(max_tokens=8, ignore_eos=True).collect()) == 8
                rows.append(s.info())
        for a, b in zip(sw_rows, full_rows, strict=True):
            assert a.history_length == b.history_length and a.cached_length == b.cached_length
        n = sw_rows[-1].history_length
        assert n == 6 * 48 > 256 > 4 + 32  # far past the window; past full's first allocation too
        # sink_window: sink + window slots from the first Generate on, whatever the history length.
        assert {r.kv_live_bytes for r in sw_rows} == {(4 + 32) * BYTES_PER_POSITION}
        assert all(r.kv_resident_bytes == r.kv_live_bytes and r.kv_history_bytes == 0 for r in sw_rows)
        # The newest query (position cached_length - 1) sees its 4 sinks and the last 32 positions.
        for r in sw_rows:
            assert r.effective_attention_fraction == pytest.approx(36 / r.cached_length)
        # full: every position resident (storage doubles past 256), attends to everything.
        assert full_rows[-1].kv_live_bytes > full_rows[0].kv_live_bytes
        assert full_rows[-1].kv_live_bytes >= full_rows[-1].cached_length * BYTES_PER_POSITION
        assert all(r.effective_attention_fraction == 1.0 for r in full_rows)
        assert full_rows[-1].kv_live_bytes > 5 * sw_rows[-1].kv_live_bytes
        # INV-1/INV-2 hold under eviction: every layer's length counts all positions seen.
        last = sw_rows[-1]
        assert last.inv1_checks >= 6 * 8 and last.inv2_checks >= 6 * 8
        assert last.inv1_violations == last.inv2_violations == 0
        cache = _store(server)._sessions[sw.id].cache
        assert cache.layer_lengths() == [last.cached_length] * LAYERS
        assert cache.layers[0].held_positions().numel() == 36  # what is actually resident


@pytest.mark.parametrize("granularity", ["per_step", "per_turn"])
def test_restore_gives_full_greedy_tokens(client, server, granularity):
    policy = KvPolicy("restore", {"sink": 4, "window": 16, "granularity": granularity, "chunk": 24})
    turns = [_tokens(60, seed=10), _tokens(20, seed=11), _tokens(7, seed=12)]
    outputs: dict[str, list[list[int]]] = {}
    infos = []
    for name, p in (("full", KvPolicy("full")), ("restore", policy)):
        with client.create_session(policy=p) as s:
            outputs[name] = []
            for chunk in turns:
                s.append(chunk)
                outputs[name].append(s.generate(max_tokens=12, ignore_eos=True).collect())
                if name == "restore":
                    infos.append(s.info())
            if name == "restore":
                cache = _store(server)._sessions[s.id].cache
                assert cache.restored_positions > 0  # evicted K/V really were recomputed
                # per_turn: once per turn that starts past the window (turns 2 and 3); per_step: every step.
                assert cache.proposer_calls == 2 if granularity == "per_turn" else cache.proposer_calls >= 24
    assert outputs["restore"] == outputs["full"]
    resident = (4 + 16) * BYTES_PER_POSITION
    for info in infos:
        assert info.policy.params["granularity"] == granularity and info.policy.params["chunk"] == 24
        assert info.policy_label == f"restore(4+16, {granularity})"
        assert info.kv_resident_bytes == resident  # flat: the restored K/V live only during a step/turn
        assert info.kv_live_bytes == resident  # nothing transient once the Generate is over
        assert info.kv_history_bytes >= info.cached_length * 4  # int32 token ids, for the proposer
        assert info.effective_attention_fraction == 1.0
        assert info.inv1_violations == info.inv2_violations == 0 and info.inv1_checks > 0


@pytest.mark.parametrize("name, params, match", [
    ("sliding", {}, "unknown KV policy"),
    ("", {"window": 8}, "no parameter"),  # "" is full, which takes no window
    ("full", {"bogus": 1}, "bogus"),
    ("sink_window", {"window": 0}, "window"),
    ("sink_window", {"sink": "four"}, "sink"),
    ("sink_window", {"window": 2.5}, "window"),
    ("sink_window", {"codec": "zip"}, "codec"),
    ("sink_window", {"codec": "d4", "q": 100000}, "q="),
    ("restore", {"granularity": "per_token"}, "granularity"),
    ("restore", {"chunk": 0}, "chunk"),
    ("restore", {"idle_codec": "gzip"}, "idle_codec"),
])
def test_invalid_policies_are_refused_and_create_nothing(client, server, name, params, match):
    before = len(_store(server))
    with pytest.raises(InvalidArgument, match=match):
        client.create_session(initial_tokens=[5, 6, 7], policy=KvPolicy(name, params))
    assert len(_store(server)) == before


@pytest.mark.parametrize("policy", [
    KvPolicy("full"),
    KvPolicy("sink_window", {"sink": 2, "window": 8}),
    KvPolicy("restore", {"sink": 2, "window": 8, "granularity": "per_step"}),
    KvPolicy("restore", {"sink": 2, "window": 8, "granularity": "per_turn"}),
], ids=["full", "sink_window", "restore-per_step", "restore-per_turn"])
def test_position_limit_is_resource_exhausted_and_the_session_survives(small, policy):
    with Client(small.address) as client, client.create_session(initial_tokens=_tokens(50, 1), policy=policy) as s:
        assert client.model_info().context_length == 64
        s.generate(max_tokens=6, ignore_eos=True).collect()  # 56, past sink + window
        with pytest.raises(ResourceExhausted, match="context length 64"):
            s.generate(max_tokens=9, ignore_eos=True).collect()  # 56 + 9 > 64: refused before any work
        with pytest.raises(ResourceExhausted):
            s.append(_tokens(9, 2))
        info = s.info(include_history=True)
        assert (info.history_length, info.cached_length, info.generate_calls) == (56, 55, 1)
        s.append([40])
        assert len(s.generate(max_tokens=7, ignore_eos=True).collect()) == 7  # exactly up to the limit
        with pytest.raises(ResourceExhausted):
            s.append([41])
        with pytest.raises(ResourceExhausted):
            s.generate(max_tokens=1).collect()
        after = s.info(include_history=True)
        assert after.history_length == 64 == after.context_length and after.remaining == 0
        assert after.history_token_ids[:57] == (*info.history_token_ids, 40)
        assert after.cached_length == 63 and after.inv1_violations == after.inv2_violations == 0
        assert _store(small)._sessions[s.id].cache.layer_lengths() == [63] * LAYERS


def test_per_policy_metrics_and_attention_histogram():
    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        text = scrape(thread)
        for name in ("full", "sink_window", "restore"):
            assert sample(text, "kakeya_session_active_by_policy", f'{{policy="{name}"}}') == 0
            assert sample(text, "kakeya_session_kv_live_bytes_by_policy", f'{{policy="{name}"}}') == 0
        sw = client.create_session(initial_tokens=_tokens(40, 3), policy=KvPolicy("sink_window", {"window": 8}))
        full = client.create_session(initial_tokens=_tokens(40, 3))
        full2 = client.create_session(initial_tokens=_tokens(4, 3))
        sw.generate(max_tokens=4, ignore_eos=True).collect()
        full.generate(max_tokens=4, ignore_eos=True).collect()
        text = scrape(thread)
        assert sample(text, "kakeya_session_active_by_policy", '{policy="sink_window"}') == 1
        assert sample(text, "kakeya_session_active_by_policy", '{policy="full"}') == 2
        assert sample(text, "kakeya_session_active_by_policy", '{policy="restore"}') == 0
        by_policy = sum(sample(text, "kakeya_session_kv_live_bytes_by_policy", f'{{policy="{n}"}}')
                        for n in ("full", "sink_window", "restore"))
        assert by_policy == sample(text, "kakeya_session_kv_live_bytes") == sw.info().kv_live_bytes + full.info().kv_live_bytes
        assert sample(text, "kakeya_session_kv_live_bytes_by_policy", '{policy="sink_window"}') == sw.info().kv_live_bytes
        # One observation per Generate: sink_window's (4 + 8) / 43 lands below 0.3, full's 1.0 at the top.
        assert sample(text, "kakeya_generate_effective_attention_fraction_count") == 2
        assert sample(text, "kakeya_generate_effective_attention_fraction_bucket", '{le="0.3"}') == 1
        assert sample(text, "kakeya_generate_effective_attention_fraction_bucket", '{le="0.99"}') == 1
        assert sample(text, "kakeya_generate_effective_attention_fraction_bucket", '{le="1.0"}') == 2
        for s in (sw, full, full2):
            s.close()
        assert sample(scrape(thread), "kakeya_session_active_by_policy", '{policy="full"}') == 0


def test_kv_a_packed_codec_cannot_store_is_a_typed_error_and_rolls_back():
    """K/V past what a codec's fp16 scales hold were stored shrunk (lattice) or as NaN (int8); now the Generate
    fails FAILED_PRECONDITION naming the fix, and the session is as it was."""
    from kakeya import FailedPrecondition

    from kakeya_runtime.server.testing import tiny_model

    model = tiny_model()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.qkv_proj.weight.mul_(1e7)  # V (and Q, K) ~1e7: an int8 scale past 65504
    with running_server(tiny_served(model=model)) as thread, Client(thread.address) as client:
        s = client.create_session(_tokens(20, 1), policy=KvPolicy("sink_window", {"window": 16, "codec": "int8"}))
        with pytest.raises(FailedPrecondition, match="codec identity"):
            s.generate(max_tokens=3, ignore_eos=True).collect()
        info = s.info()
        assert info.history_length == 20 and info.cached_length == 0 and not info.generating
        plain = client.create_session(_tokens(20, 1), policy=KvPolicy("sink_window", {"window": 16}))
        assert len(plain.generate(max_tokens=3, ignore_eos=True).collect()) == 3  # identity stores them as they are
