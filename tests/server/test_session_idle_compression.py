"""Idle compression through the real server and SDK: a session idle past the threshold is packed in place
on the engine thread (GetSessionInfo shows it, live bytes drop), appends still work, and the next Generate
decompresses it first. Identity resumes bit-identically to an uncompressed twin session on a second server
sharing the same weights; d4 cuts live bytes to ~0.27x fp32 and the test reports token agreement."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from kakeya import Client, KvPolicy

from kakeya_runtime.models.registry import build_model
from kakeya_runtime.server.grpc_app import RuntimeServer, ServerConfig
from kakeya_runtime.server.testing import metric_value as sample
from kakeya_runtime.server.testing import running_server, tiny_config, tiny_model, tiny_served
from kakeya_runtime.server.testing import scrape_metrics as scrape

# tiny llama: 2 layers, 2 K/V heads, head_dim 16, fp32 (every layer is governed by the policy).
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
FP32_PER_POSITION = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # K and V, every layer
D4_PER_POSITION = LAYERS * 2 * KV_HEADS * 17  # d4/q38 at head_dim 16: 4 blocks x 25 bits + 2 fp16 = 17 bytes
AFTER_S = 0.2


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread, engine thread included (see test_session_policies)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def servers():
    """(compressing server with the d4 default, twin server that never compresses), same weights."""
    model = tiny_model("llama")
    with running_server(tiny_served(model=model), idle_compress_after_s=AFTER_S, sweep_interval_s=0.05,
                        idle_codec="d4") as comp, running_server(tiny_served(model=model)) as twin:
        yield comp, twin


def _wait_compressed(thread, count: int, timeout: float = 10.0) -> None:
    """Poll /metrics (GetSessionInfo would count as activity and keep the sessions awake)."""
    deadline = time.time() + timeout
    while sample(scrape(thread), "kakeya_session_idle_compressed_total") < count:
        assert time.time() < deadline, "sessions were not compressed in time"
        time.sleep(0.05)


IDENTITY_POLICIES = {
    "full": KvPolicy("full", {"idle_codec": "identity"}),
    "sink_window": KvPolicy("sink_window", {"sink": 4, "window": 16, "idle_codec": "identity"}),
    "restore": KvPolicy("restore", {"sink": 4, "window": 16, "granularity": "per_turn", "idle_codec": "identity"}),
}


def test_identity_idle_compression_resumes_bit_identically(servers):
    comp, twin = servers
    start = sample(scrape(comp), "kakeya_session_idle_compressed_total")
    with Client(comp.address) as cc, Client(twin.address) as tc:
        info = cc.model_info()
        assert info.idle_compress_after_s == pytest.approx(AFTER_S) and info.idle_codec == "d4/q38"
        assert tc.model_info().idle_compress_after_s is None
        pairs, live = {}, {}
        for i, (name, policy) in enumerate(IDENTITY_POLICIES.items()):
            a = cc.create_session(initial_tokens=_tokens(70, i), policy=policy)
            b = tc.create_session(initial_tokens=_tokens(70, i), policy=policy)
            assert a.generate(max_tokens=10, ignore_eos=True).collect() == \
                b.generate(max_tokens=10, ignore_eos=True).collect()
            pairs[name] = (a, b)
            live[name] = a.info()  # at once: idle since its Generate, well under AFTER_S
            assert not live[name].kv_compressed
        _wait_compressed(comp, start + len(pairs))
        for name, (a, b) in pairs.items():
            packed = a.info()
            assert packed.kv_compressed and packed.idle_compressions == 1, name
            assert packed.kv_live_bytes <= live[name].kv_live_bytes
            assert packed.cached_length == live[name].cached_length == 79  # INV-1: lengths kept
            assert packed.inv1_violations == packed.inv2_violations == 0
            assert b.info().kv_compressed is False
        # full allocates 256 positions up front; identity packing keeps exactly the 79 cached ones.
        assert live["full"].kv_live_bytes == 256 * FP32_PER_POSITION
        assert pairs["full"][0].info().kv_live_bytes == 79 * FP32_PER_POSITION
        for name, (a, b) in pairs.items():
            more = _tokens(9, 100)
            assert a.append(more) == b.append(more) == 89  # appends work on a packed cache
            assert a.info().kv_compressed  # still packed: only Generate unpacks
            ga, gb = a.generate(max_tokens=16, ignore_eos=True), b.generate(max_tokens=16, ignore_eos=True)
            assert ga.collect() == gb.collect(), name  # bit-exact round trip: the same greedy tokens
            assert ga.stats.resume_s > 0 and gb.stats.resume_s == 0
            assert ga.stats.ttft_s >= ga.stats.resume_s
            after = a.info(include_history=True)
            assert not after.kv_compressed and after.history_token_ids == b.info(include_history=True).history_token_ids
            a.close()
            b.close()
        assert sample(scrape(comp), "kakeya_session_idle_resume_seconds_count") >= len(pairs)


def test_d4_idle_compression_shrinks_live_bytes_and_reports_agreement(servers):
    comp, twin = servers
    start = sample(scrape(comp), "kakeya_session_idle_compressed_total")
    history = _tokens(120, 7)
    with Client(comp.address) as cc, Client(twin.address) as tc, \
            cc.create_session(initial_tokens=history) as a, tc.create_session(initial_tokens=history) as b:
        assert a.generate(max_tokens=4, ignore_eos=True).collect() == b.generate(max_tokens=4, ignore_eos=True).collect()
        before = a.info()
        assert before.policy_label == "full()" and before.kv_live_bytes == 256 * FP32_PER_POSITION
        _wait_compressed(comp, start + 1)
        packed = a.info()
        n = packed.cached_length
        assert packed.kv_compressed and n == 123
        fp32_equivalent = n * FP32_PER_POSITION  # every layer is governed (no native sliding layers)
        assert packed.kv_live_bytes == n * D4_PER_POSITION  # server default codec: d4/q38
        ratio = packed.kv_live_bytes / fp32_equivalent
        assert ratio <= 0.45
        assert sample(scrape(comp), "kakeya_session_kv_live_bytes") == packed.kv_live_bytes
        ta = a.generate(max_tokens=32, ignore_eos=True).collect()
        tb = b.generate(max_tokens=32, ignore_eos=True).collect()
        agreement = sum(x == y for x, y in zip(ta, tb, strict=True)) / len(ta)
        print(f"\nd4/q38 idle compression: live bytes {ratio:.3f}x fp32, greedy token agreement "
              f"{agreement:.2f} over {len(ta)} tokens")
        assert agreement >= 0.5  # lossy; the tiny random model is far less robust than a trained one
        assert not a.info().kv_compressed


def test_sparse_bytes_while_compressed_are_the_bytes_held(servers):
    """A compressed sparse session reports its hot set as packed (it read the pre-compression bytes), its cold tier
    and index as kept, and the three add up to what its cache holds."""
    comp, _ = servers
    start = sample(scrape(comp), "kakeya_session_idle_compressed_total")
    policy = KvPolicy("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2, "codec": "identity"})
    with Client(comp.address) as cc, cc.create_session(initial_tokens=_tokens(90, 3), policy=policy) as a:
        a.generate(max_tokens=4, ignore_eos=True).collect()
        live = a.info().sparse
        _wait_compressed(comp, start + 1)
        packed = a.info()
        assert packed.kv_compressed and packed.sparse is not None
        got = packed.sparse
        assert (got.cold_bytes, got.index_bytes) == (live.cold_bytes, live.index_bytes) and got.cold_bytes > 0
        assert 0 < got.hot_bytes < live.hot_bytes / 3  # fp32 hot set packed with d4/q38: ~0.27x
        assert got.hot_bytes + got.cold_bytes + got.index_bytes == packed.kv_live_bytes  # every layer sparse here
        assert got.total == live.total  # counters as they were
        a.generate(max_tokens=2, ignore_eos=True).collect()
        assert a.info().sparse.hot_bytes == live.hot_bytes  # unpacked again


def test_sessions_without_a_codec_or_a_cache_are_not_compressed():
    model = tiny_model("llama")
    with running_server(tiny_served(model=model), idle_compress_after_s=0.1, sweep_interval_s=0.03,
                        idle_codec="none") as thread, Client(thread.address) as client:
        assert client.model_info().idle_codec is None
        plain = client.create_session(initial_tokens=_tokens(30, 1))
        opted = client.create_session(initial_tokens=_tokens(30, 1), policy=KvPolicy("full", {"idle_codec": "d4"}))
        never_generated = client.create_session(initial_tokens=_tokens(30, 1))  # no cache yet: nothing to pack
        for s in (plain, opted):
            s.generate(max_tokens=2, ignore_eos=True).collect()
        _wait_compressed(thread, 1)
        time.sleep(0.3)  # several more sweeps
        assert sample(scrape(thread), "kakeya_session_idle_compressed_total") == 1
        assert opted.info().kv_compressed and not plain.info().kv_compressed
        assert never_generated.info().kv_live_bytes == 0 and not never_generated.info().kv_compressed
        assert sample(scrape(thread), "kakeya_session_idle_compressed_bytes_saved_total") > 0


def test_a_session_asking_for_no_idle_codec_is_never_compressed(servers):
    """idle_codec "none" on a session was taken as "the server's default", so it was compressed anyway."""
    comp, _ = servers
    start = sample(scrape(comp), "kakeya_session_idle_compressed_total")
    with Client(comp.address) as cc:
        never = cc.create_session(initial_tokens=_tokens(30, 2), policy=KvPolicy("full", {"idle_codec": "none"}))
        default = cc.create_session(initial_tokens=_tokens(30, 2))
        assert never.info().policy.params == {"idle_codec": "none"} and never.info().policy_label == "full() idle:none"
        for s in (never, default):
            s.generate(max_tokens=2, ignore_eos=True).collect()
        _wait_compressed(comp, start + 1)
        time.sleep(5 * AFTER_S)  # several more sweeps
        assert default.info().kv_compressed and not never.info().kv_compressed
        assert sample(scrape(comp), "kakeya_session_idle_compressed_total") == start + 1


def test_a_session_used_while_queued_for_compression_is_left_alone():
    """Compression queues on the engine behind other work (here a job the test holds); the owner comes back
    meanwhile: its Generate waits for the turn, the compression job sees the session is no longer idle and
    skips it."""
    with running_server(tiny_served(), idle_compress_after_s=0.15, sweep_interval_s=0.03,
                        idle_codec="identity") as thread, Client(thread.address) as client:
        x = client.create_session(initial_tokens=_tokens(20, 1))
        x.generate(max_tokens=1).collect()
        service = thread.server.service
        engine_free, engine_held = threading.Event(), threading.Event()

        def hold_engine() -> None:
            engine_held.set()
            engine_free.wait(10)

        held = service.scheduler.submit(hold_engine)
        try:
            assert engine_held.wait(5)
            deadline = time.time() + 5
            while not service._compressions:  # x claimed; its job waits behind the held engine
                assert time.time() < deadline
                time.sleep(0.005)
            session = next(s for s in service.store.live_sessions() if s.id == x.id)
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(lambda: x.generate(max_tokens=3, ignore_eos=True))
                while session.busy_ops < 2:  # the Generate has registered and waits for x's turn
                    assert time.time() < deadline
                    time.sleep(0.005)
                engine_free.set()
                gen = pending.result(10)
                assert len(gen.collect()) == 3 and gen.stats.resume_s == 0
        finally:
            engine_free.set()
            held.result(10)
        assert x.info().idle_compressions == 0


def test_bad_idle_settings_are_refused_at_startup():
    served = tiny_served()
    with pytest.raises(ValueError, match="idle_codec"):
        RuntimeServer(served, ServerConfig(port=0, idle_codec="zip"))
    with pytest.raises(ValueError, match="idle_compress_after_s"):
        RuntimeServer(served, ServerConfig(port=0, idle_compress_after_s=0))
    with pytest.raises(ValueError, match="q="):
        RuntimeServer(served, ServerConfig(port=0, idle_codec="e8", idle_q=10**6))
    odd = tiny_served(model=build_model(replace(tiny_config("llama"), head_dim=12)))
    with pytest.raises(ValueError, match="head_dim"):  # checked against the served model
        RuntimeServer(odd, ServerConfig(port=0, idle_compress_after_s=60, idle_codec="d4"))
    RuntimeServer(odd, ServerConfig(port=0, idle_compress_after_s=60, idle_codec="identity"))  # any head_dim
    RuntimeServer(odd, ServerConfig(port=0, idle_codec="d4"))  # compression off: the default is never used
