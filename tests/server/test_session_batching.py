"""Continuous batching through the real gRPC server and the SDK (sessions.batch).

INV-3 extended to batch composition: a seeded session's stream is bit-identical alone and decoded beside other
sessions of other lengths, policies, sampling, stop strings and speculation (a long prompt arriving meanwhile is
prefilled in chunks between their decode steps). An engine error in a batched step ends only the failing session
(rolled back); a Generate cancelled while its prompt is still being prefilled leaves its session untouched.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kakeya import Client, InternalError, KvPolicy, Speculation

from kakeya_runtime.kv.cache import FullLayerKV
from kakeya_runtime.server.testing import SlowModel, running_server, tiny_model, tiny_served
from kakeya_runtime.sessions.chunk_budget import ChunkBudget
from kakeya_runtime.sessions.policy import PolicyRegistry

DELAY = 0.003  # per forward: rows overlap for sure, tests stay fast
TARGET = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 20240601, "ignore_eos": True}


def _history(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 90 + 3 for i in range(n)]


# (history length, policy, generate kwargs): the target first, then its neighbours
ROWS: list[tuple[int, KvPolicy | None, dict[str, Any]]] = [
    (37, None, {"max_tokens": 24, **TARGET}),
    (300, KvPolicy("sink_window", {"sink": 4, "window": 32}), {"max_tokens": 30, "ignore_eos": True}),
    (5, KvPolicy("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2}),
     {"max_tokens": 40, "temperature": 0.7, "seed": 3, "ignore_eos": True}),
    (120, KvPolicy("restore", {"sink": 4, "window": 32, "granularity": "per_turn"}),
     {"max_tokens": 20, "temperature": 1.1, "top_k": 5, "seed": 99, "ignore_eos": True}),
    (60, None, {"max_tokens": 30, "ignore_eos": True, "speculation": Speculation("history", 4)}),
]


def _run(client: Client, n: int, policy: KvPolicy | None, kw: dict[str, Any], seed: int) -> list[int]:
    with client.create_session(initial_tokens=_history(n, seed), policy=policy) as s:
        return s.generate(**kw).collect()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_streams_are_bit_identical_alone_and_batched(kind):
    slow = SlowModel(tiny_model(kind), DELAY)
    with running_server(tiny_served(kind, model=slow), step_tokens=16) as thread:
        with Client(thread.address) as client:
            alone = [_run(client, n, p, kw, i) for i, (n, p, kw) in enumerate(ROWS)]
        stats = thread.server.service.scheduler.stats
        batched_before = stats.batched_steps
        got: dict[int, list[int]] = {}
        start = threading.Barrier(len(ROWS))

        def run(i: int) -> None:
            n, p, kw = ROWS[i]
            with Client(thread.address) as c:
                start.wait()
                got[i] = _run(c, n, p, kw, i)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ROWS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(got) == list(range(len(ROWS)))
        for i in range(len(ROWS)):
            assert got[i] == alone[i], f"row {i} ({ROWS[i][1]}) changed when batched"
        assert stats.batched_steps > batched_before  # they really were decoded together
        assert slow.max_rows >= 3


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_decode_steps():
    slow = SlowModel(tiny_model("llama"), DELAY)
    with running_server(tiny_served(model=slow), step_tokens=16, short_prompt=64) as thread, \
            Client(thread.address) as client:
        sched = thread.server.service.scheduler
        busy = client.create_session(initial_tokens=_history(10, 1))
        ref_busy = None
        with client.create_session(initial_tokens=_history(10, 1)) as solo:
            ref_busy = solo.generate(max_tokens=60, ignore_eos=True).collect()
        gen = busy.generate(max_tokens=60, ignore_eos=True)
        it = iter(gen)
        first = [next(it)]
        chunks_before = sched.stats.prefill_chunks
        long = client.create_session(initial_tokens=_history(400, 2))
        out = long.generate(max_tokens=4, ignore_eos=True)
        long_tokens = out.collect()
        during = sched.stats.prefill_chunks - chunks_before
        rest = list(it)
        assert first + rest == ref_busy  # the busy session never noticed
        assert during >= 400 // 15  # at most step_tokens - 1 prompt tokens per step while the other decodes
        assert sched.stats.fused_chunks >= 400 // 15 - 1  # riding the busy row's decode forwards
        with client.create_session(initial_tokens=_history(400, 2)) as fresh:
            assert fresh.generate(max_tokens=4, ignore_eos=True).collect() == long_tokens


@pytest.mark.parametrize(("token_s", "settles"), [(0.002, "small"), (0.0, "large")])
def test_a_long_prompts_chunk_is_sized_by_the_decoders_measured_steps(token_s, settles, monkeypatch):
    """The default budget times the steps: where each prompt token costs a step 2 ms (a decode step ~15 ms), the
    chunk shrinks to what keeps a step within 1.5x a decode step; where tokens cost nothing it grows past the start.
    The decoding session's stream and the prompt's tokens are the same bits either way."""
    sizes: list[int] = []  # the budget after each timed chunk step
    chunk_step = ChunkBudget.chunk_step

    def recorded(budget: ChunkBudget, rows: int, tokens: int, seconds: float) -> None:
        chunk_step(budget, rows, tokens, seconds)
        sizes.append(budget.size)

    monkeypatch.setattr(ChunkBudget, "chunk_step", recorded)
    slow = SlowModel(tiny_model("llama"), 0.01, token_s=token_s)
    with running_server(tiny_served(model=slow), step_slowdown=1.5, short_prompt=64) as thread, \
            Client(thread.address) as client:
        sched = thread.server.service.scheduler
        assert sched.budget is not None and sched.step_tokens is None  # the default: sized by measurement
        with client.create_session(initial_tokens=_history(10, 1)) as solo:
            ref_busy = solo.generate(max_tokens=120, ignore_eos=True).collect()
        with client.create_session(initial_tokens=_history(300, 2)) as solo:
            ref_long = solo.generate(max_tokens=4, ignore_eos=True).collect()
        busy = client.create_session(initial_tokens=_history(10, 1))
        it = iter(busy.generate(max_tokens=120, ignore_eos=True))
        first = [next(it), next(it)]  # a decode step of one row timed
        chunks_before = sched.stats.fused_chunks
        with client.create_session(initial_tokens=_history(300, 2)) as long:
            assert long.generate(max_tokens=4, ignore_eos=True).collect() == ref_long
        fused = sched.stats.fused_chunks - chunks_before
        assert first + list(it) == ref_busy  # the busy session never noticed
        size = sched.budget.tokens()
        if settles == "small":  # 1 + 2 ms x T / ~15 ms <= 1.5: T <= ~4 (a slow chunk step only makes it smaller)
            assert size <= 6 and fused >= 300 // 8
        else:  # grown past the start, in fewer chunks than where tokens cost (a step slowed by the host, a GC pause
            # on a 2-core CI machine, cuts it at once: its last size is the host's noise, its peak is not)
            assert max(sizes) > 16 and fused < 300 // 8, (sizes, fused)
        assert sched.budget.resized >= 1


def test_a_short_prompt_is_read_whole_in_one_step_beside_the_decoders():
    slow = SlowModel(tiny_model("llama"), DELAY)
    with running_server(tiny_served(model=slow), step_tokens=16, short_prompt=100) as thread, \
            Client(thread.address) as client:
        sched = thread.server.service.scheduler
        prompt = _history(100, 3)
        with client.create_session(initial_tokens=prompt) as solo:
            ref = solo.generate(max_tokens=6, ignore_eos=True).collect()
        busy = client.create_session(initial_tokens=_history(10, 1))
        it = iter(busy.generate(max_tokens=200, ignore_eos=True))
        next(it)
        chunks, fused = sched.stats.prefill_chunks, sched.stats.fused_chunks
        with client.create_session(initial_tokens=prompt) as s:
            got = s.generate(max_tokens=6, ignore_eos=True).collect()
        assert got == ref  # the same bits as alone
        assert sched.stats.prefill_chunks - chunks == 1  # 100 tokens in one step, not 15 a step
        assert sched.stats.fused_chunks - fused == 1  # riding the busy row's decode forward
        it.close()


def test_a_short_prompt_is_read_before_a_long_prompts_remaining_chunks():
    slow = SlowModel(tiny_model("llama"), 0.01)
    with running_server(tiny_served(model=slow), step_tokens=16, short_prompt=64) as thread, \
            Client(thread.address) as client:
        sched = thread.server.service.scheduler
        busy = client.create_session(initial_tokens=[4, 5, 6])
        it = iter(busy.generate(max_tokens=300, ignore_eos=True))
        next(it)  # decoding: the long prompt below is chunked 15 tokens a step
        first_long = threading.Event()

        def long_turn() -> None:
            with Client(thread.address) as c, c.create_session(initial_tokens=_history(400, 5)) as s:
                for _ in s.generate(max_tokens=2, ignore_eos=True):
                    first_long.set()

        before = sched.stats.prefill_chunks
        t = threading.Thread(target=long_turn)
        t.start()
        deadline = time.time() + 10
        while sched.stats.prefill_chunks < before + 3 and time.time() < deadline:
            time.sleep(0.002)
        with client.create_session(initial_tokens=_history(30, 6)) as s:
            short = s.generate(max_tokens=1, ignore_eos=True).collect()
        assert len(short) == 1 and not first_long.is_set()  # it did not wait for the long prompt's ~27 chunks
        t.join(60)
        assert first_long.is_set()
        it.close()


@pytest.mark.parametrize("policy", [("full", {}), ("sink_window", {"sink": 4, "window": 64}),
                                    ("restore", {"sink": 4, "window": 16}),
                                    ("sparse", {"sink": 4, "window": 16, "block": 8, "topk": 2, "codec": "int8"})],
                         ids=lambda p: p[0])
def test_cancel_between_prefill_chunks_keeps_the_chunks_read_and_the_history_untouched(policy):
    slow = SlowModel(tiny_model("llama"), 0.01)
    with running_server(tiny_served(model=slow), step_tokens=16, short_prompt=64) as thread, \
            Client(thread.address) as client:
        sched = thread.server.service.scheduler
        busy = client.create_session(initial_tokens=[4, 5, 6])
        it = iter(busy.generate(max_tokens=300, ignore_eos=True))
        next(it)  # decoding: the long prompt below is chunked 15 tokens a step
        prompt = _history(400, 5)
        s = client.create_session(initial_tokens=prompt, policy=KvPolicy(*policy))
        before = sched.stats.prefill_chunks
        gen = s.generate(max_tokens=5, ignore_eos=True)
        deadline = time.time() + 10
        while sched.stats.prefill_chunks < before + 3 and time.time() < deadline:
            time.sleep(0.002)
        gen.cancel()
        deadline = time.time() + 10
        while s.info().generating and time.time() < deadline:
            time.sleep(0.01)
        assert sched.stats.prefill_chunks - before < 400 // 15  # it stopped before its prompt was read
        info = s.info(include_history=True)
        assert list(info.history_token_ids) == prompt and not info.generating
        assert 0 < info.cached_length < len(prompt)  # the chunks it read are kept, not read again
        gen = s.generate(max_tokens=5, ignore_eos=True)
        again = gen.collect()
        assert gen.stats.prefill_tokens == len(prompt) - info.cached_length
        with client.create_session(initial_tokens=prompt, policy=KvPolicy(*policy)) as fresh:
            assert fresh.generate(max_tokens=5, ignore_eos=True).collect() == again  # the same bits as one prefill
        it.close()


class _Broken(FullLayerKV):
    """Raises at its `fail_at`-th write and at the next (the batched step, then its replay alone), then heals."""

    fail_at = 0
    writes = 0

    def update_and_fetch(self, k, v, positions):
        self.writes += 1
        if self.fail_at <= self.writes < self.fail_at + 2:
            raise RuntimeError("injected engine fault")
        return super().update_and_fetch(k, v, positions)


class _FaultyRegistry(PolicyRegistry):
    """The first "full" cache with idle codec e8 (the marker) breaks in its last layer."""

    armed = True

    def build(self, engine, spec, capacity):
        cache = super().build(engine, spec, capacity)
        if self.armed and spec.name == "full" and spec.idle_codec is not None and spec.idle_codec.kind == "e8":
            self.armed = False
            layer = cache.layers[-1]
            layer.__class__ = _Broken
            layer.fail_at, layer.writes = 6, 0  # the prefill and 4 decode steps write; the 5th step fails
        return cache


def test_an_engine_error_in_a_batched_step_rolls_back_only_its_session():
    slow = SlowModel(tiny_model("llama"), DELAY)
    healthy = [(_history(20 + 9 * i, i), 30) for i in range(3)]
    with running_server(tiny_served(model=slow), policies=_FaultyRegistry(), step_tokens=32) as thread, \
            Client(thread.address) as client:
        sched = thread.server.service.scheduler
        refs = []
        for h, n in healthy:
            with client.create_session(initial_tokens=h) as s:
                refs.append(s.generate(max_tokens=n, ignore_eos=True, seed=7, temperature=0.8).collect())
        sessions = [client.create_session(initial_tokens=h) for h, _ in healthy]
        iters = [iter(s.generate(max_tokens=n, ignore_eos=True, seed=7, temperature=0.8))
                 for s, (_, n) in zip(sessions, healthy, strict=True)]
        firsts = [[next(it)] for it in iters]  # all three are decoding now
        faulty_history = _history(20, 9)  # one prefill chunk (the budget leaves 29 tokens beside 3 decoders)
        faulty = client.create_session(initial_tokens=faulty_history, policy=KvPolicy("full", {"idle_codec": "e8"}))
        got = []
        with pytest.raises(InternalError, match="rolled back"):
            for tok in faulty.generate(max_tokens=20, ignore_eos=True):
                got.append(tok)
        outs = [f + list(it) for f, it in zip(firsts, iters, strict=True)]
        assert outs == refs  # the others went on, bit for bit
        assert len(got) == 5 and sched.stats.isolated_errors >= 1
        info = faulty.info(include_history=True)
        assert list(info.history_token_ids) == faulty_history + got
        # the session goes on like a fresh one with its history
        after = faulty.generate(max_tokens=6, ignore_eos=True).collect()
        with client.create_session(initial_tokens=faulty_history + got) as fresh:
            assert fresh.generate(max_tokens=6, ignore_eos=True).collect() == after


def test_max_batch_one_is_serial_and_gives_the_same_streams():
    slow = SlowModel(tiny_model("llama"), DELAY)
    with running_server(tiny_served(model=slow), max_concurrent=1) as thread:
        got: dict[int, list[int]] = {}

        def run(i: int) -> None:
            n, p, kw = ROWS[i]
            with Client(thread.address) as c:
                got[i] = _run(c, n, p, kw, i)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert slow.max_rows == 1 and thread.server.service.scheduler.stats.batched_steps == 0
        with Client(thread.address) as client:
            assert [got[i] for i in range(3)] == [_run(client, *ROWS[i], i) for i in range(3)]


def test_batch_metrics_are_exported():
    from kakeya_runtime.server.testing import metric_value, scrape_metrics

    slow = SlowModel(tiny_model("llama"), DELAY)
    with running_server(tiny_served(model=slow)) as thread, Client(thread.address) as client:
        text = scrape_metrics(thread)
        assert metric_value(text, "kakeya_engine_queue_depth") == 0
        assert metric_value(text, "kakeya_engine_batch_size") == 0
        assert metric_value(text, "kakeya_engine_prompt_chunk_tokens") == thread.server.service.scheduler.budget.tokens()
        with client.create_session(initial_tokens=[3, 4]) as a, client.create_session(initial_tokens=[5, 6]) as b:
            ia = iter(a.generate(max_tokens=40, ignore_eos=True))
            next(ia)
            ib = iter(b.generate(max_tokens=40, ignore_eos=True))
            next(ib)
            text = scrape_metrics(thread)
            assert metric_value(text, "kakeya_engine_batch_size") == 2
            list(ia), list(ib)
        text = scrape_metrics(thread)
        assert metric_value(text, "kakeya_engine_decode_batch_rows_count") > 0
        assert metric_value(text, "kakeya_engine_decode_batch_rows_bucket", '{le="1.0"}') < \
            metric_value(text, "kakeya_engine_decode_batch_rows_count")  # some steps carried both
        # every step's time by what it carried: a's prompt alone, b's prompt beside a's decode row, decode rows
        steps = {kind: metric_value(text, "kakeya_engine_step_seconds_count", f'{{kind="{kind}"}}')
                 for kind in ("decode", "mixed", "prefill")}
        assert steps["prefill"] >= 1 and steps["mixed"] >= 1 and steps["decode"] >= 40, steps
        assert sum(steps.values()) == thread.server.service.scheduler.stats.steps
        for kind in steps:
            assert metric_value(text, "kakeya_engine_step_seconds_sum", f'{{kind="{kind}"}}') > 0


def test_a_speculative_rows_prompt_counts_as_prompt_time():
    """A speculative Generate's prompt steps are prompt time in kakeya_engine_step_seconds: alone they are
    prefill steps, beside a decoding row mixed ones; its verifier steps are decode steps."""
    from kakeya_runtime.server.testing import metric_value, scrape_metrics

    def kinds(thread) -> dict[str, float]:
        text = scrape_metrics(thread)
        return {kind: metric_value(text, "kakeya_engine_step_seconds_count", f'{{kind="{kind}"}}')
                for kind in ("decode", "mixed", "prefill")}

    slow = SlowModel(tiny_model("llama"), DELAY)
    with running_server(tiny_served(model=slow), step_tokens=16, short_prompt=64) as thread, \
            Client(thread.address) as client:
        with client.create_session(initial_tokens=_history(300, 7)) as s:  # alone: one 512-token chunk a step
            before = kinds(thread)
            s.generate(max_tokens=4, ignore_eos=True, speculation=Speculation("history", 2)).collect()
            after = kinds(thread)
        assert after["prefill"] - before["prefill"] >= 1 and after["decode"] - before["decode"] >= 1, (before, after)
        assert after["mixed"] == before["mixed"]
        busy = client.create_session(initial_tokens=[4, 5, 6])
        it = iter(busy.generate(max_tokens=400, ignore_eos=True))
        next(it)  # decoding: the speculative prompt below reads 128 tokens a step beside it
        with client.create_session(initial_tokens=_history(300, 8)) as s:
            before = kinds(thread)
            s.generate(max_tokens=2, ignore_eos=True, speculation=Speculation("history", 2)).collect()
            after = kinds(thread)
        it.close()
        assert after["mixed"] - before["mixed"] >= 2, (before, after)  # 300 tokens: at least 3 steps of prompt


@pytest.mark.real_model
def test_smollm2_greedy_streams_batched_equal_solo(english_text):
    import torch

    from kakeya_runtime.models.loader import ModelLoadError, load_model
    from kakeya_runtime.server.grpc_app import ServedModel

    try:
        served = ServedModel.from_loaded(load_model("smollm2", dtype=torch.bfloat16), "smollm2")
    except ModelLoadError as e:
        pytest.skip(f"smollm2 unavailable: {e}")
    with running_server(served, step_tokens=32, short_prompt=64) as thread, Client(thread.address) as client:
        from kakeya.tokenization import Tokenizer

        ids = list(Tokenizer.from_model_info(client.model_info()).encode(english_text))
        prompts = [ids[:40], ids[10:310], ids[5:12], ids[50:170]]  # 40 and 7 read whole, 300 and 120 chunked
        alone = []
        for p in prompts:
            with client.create_session(initial_tokens=p) as s:
                alone.append(s.generate(max_tokens=16, ignore_eos=True).collect())
        got: dict[int, list[int]] = {}

        def run(i: int) -> None:
            with Client(thread.address) as c, c.create_session(initial_tokens=prompts[i]) as s:
                got[i] = s.generate(max_tokens=16, ignore_eos=True).collect()

        before = thread.server.service.scheduler.stats.batched_steps
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [got[i] for i in range(len(prompts))] == alone
        assert thread.server.service.scheduler.stats.batched_steps > before


def _ascii_run(text: str, width: int = 1) -> str | None:
    for i in range(2, len(text) - width + 1):
        s = text[i:i + width]
        if all(ch.isascii() and ch.isprintable() for ch in s):
            return s
    return None


def test_stop_strings_end_each_batched_row_where_it_ends_alone():
    from kakeya import FinishReason
    from kakeya.tokenization import Tokenizer

    slow = SlowModel(tiny_model("llama"), DELAY)
    with running_server(tiny_served(model=slow), step_tokens=16) as thread, Client(thread.address) as client:
        tok = Tokenizer.from_model_info(client.model_info())
        rows = []
        for i in range(3):
            h = list(tok.encode("Once upon a time" + " there was" * i))
            with client.create_session(initial_tokens=h) as s:
                stop = _ascii_run(tok.decode(s.generate(max_tokens=60, ignore_eos=True).collect()))
            assert stop is not None
            with client.create_session(initial_tokens=h) as s:
                g = s.generate(max_tokens=60, ignore_eos=True, stop=[stop])
                ref = g.collect()
                assert g.finish_reason is FinishReason.STOP and len(ref) < 60
            rows.append((h, stop, ref))
        got: dict[int, tuple[list[int], str | None]] = {}

        def run(i: int) -> None:
            h, stop, _ = rows[i]
            with Client(thread.address) as c, c.create_session(initial_tokens=h) as s:
                g = s.generate(max_tokens=60, ignore_eos=True, stop=[stop])
                got[i] = (g.collect(), g.result.stop_string)
                assert list(s.info(include_history=True).history_token_ids) == h + got[i][0]

        with client.create_session(initial_tokens=[7, 8, 9]) as busy:
            it = iter(busy.generate(max_tokens=200, ignore_eos=True))
            next(it)
            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rows))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            it.close()
        assert {i: got[i] for i in range(len(rows))} == {i: (ref, stop) for i, (_, stop, ref) in enumerate(rows)}
