"""Engine loop and per-session ordering: max batch, one Generate per session, prompt cancellation.

Design under test: a Generate or AppendTokens on a session with a Generate in flight WAITS for it
(FIFO); it is never refused. Cancelling leaves history and KV consistent, and the next Generate
continues exactly as the engine would from that history.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from kakeya import AsyncClient, Client, FinishReason, KakeyaError, SessionNotFound

from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.server.testing import SlowModel, running_server, tiny_model, tiny_served

DELAY = 0.03  # seconds per forward: long enough to observe, short enough to keep tests fast


@pytest.fixture
def slow_server(request):
    max_concurrent = getattr(request, "param", 1)
    slow = SlowModel(tiny_model(), DELAY)
    with running_server(tiny_served(model=slow), max_concurrent=max_concurrent) as thread:
        thread.slow = slow
        yield thread


def _reference(model, pieces: list[tuple[list[int], int]]) -> list[list[int]]:
    """The engine driven by hand: prefill each piece (after the previous last sample), greedy."""
    engine = Engine(model)
    cache = engine.new_cache(capacity=512)
    out, carry = [], []
    for appended, n in pieces:
        r = engine.generate(cache, torch.tensor([carry + appended]), GenerateRequest(n))
        out.append(r.token_ids[0])
        carry = [r.token_ids[0][-1]]
    return out


@pytest.mark.parametrize("slow_server", [1, 2], indirect=True)
def test_max_batch_bounds_the_sessions_decoded_together(slow_server):
    max_concurrent = slow_server.server.config.max_concurrent
    results = {}

    def run(i):
        with Client(slow_server.address) as c, c.create_session(initial_tokens=[3 + i, 4]) as s:
            results[i] = s.generate(max_tokens=6, ignore_eos=True).collect()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [0, 1, 2] and all(len(v) == 6 for v in results.values())
    assert slow_server.slow.max_rows == max_concurrent  # sessions decoded in one forward: up to the max batch
    assert slow_server.slow.max_active == 1  # one engine loop: forwards never overlap


def test_second_generate_on_a_session_waits_for_the_first(slow_server):
    with Client(slow_server.address) as client:
        s = client.create_session(initial_tokens=[5, 6, 7])
        gens = {}

        def run(name):
            with Client(slow_server.address) as c:
                g = c.session(s.id).generate(max_tokens=5, ignore_eos=True)
                g.collect()
                gens[name] = g

        t1 = threading.Thread(target=run, args=("a",))
        t1.start()
        time.sleep(DELAY * 2)
        t2 = threading.Thread(target=run, args=("b",))
        t2.start()
        t1.join(30)
        t2.join(30)
        first, second = sorted(gens.values(), key=lambda g: g.result.history_length)
        assert first.stats.prefill_tokens == 3
        assert second.stats.prefill_tokens == 1  # it ran after the first: only the first's last sample
        assert second.stats.queue_s > 0.05  # it waited for the first to finish
        hist = s.info(include_history=True).history_token_ids
        assert list(hist) == [5, 6, 7, *first.token_ids, *second.token_ids]
        assert slow_server.slow.max_active == 1


def test_append_during_generate_waits_and_lands_after_it(slow_server):
    with Client(slow_server.address) as client:
        s = client.create_session(initial_tokens=[5, 6])
        gen = s.generate(max_tokens=8, ignore_eos=True)
        it = iter(gen)
        first = next(it)
        with Client(slow_server.address) as other:
            other.session(s.id).append([42])  # blocks until the Generate is done
        rest = list(it)
        hist = list(s.info(include_history=True).history_token_ids)
        assert hist == [5, 6, first, *rest, 42]


def test_cancel_stops_promptly_and_the_next_generate_continues_correctly(slow_server):
    model = slow_server.server.served.model.inner
    with Client(slow_server.address) as client:
        prompt = [10, 11, 12, 13]
        s = client.create_session(initial_tokens=prompt)
        received = []
        t0 = time.perf_counter()
        for tok in s.generate(max_tokens=200, ignore_eos=True):  # ~6 s if not cancelled
            received.append(tok)
            if len(received) == 3:
                break  # leaving the loop cancels the RPC
        s.append([77])  # queues behind the cancelled Generate, which stops after its current step
        assert time.perf_counter() - t0 < 2.0
        info = s.info(include_history=True)
        generated = list(info.history_token_ids[len(prompt):-1])
        assert generated[:3] == received and len(generated) < 10
        assert info.cached_length == info.history_length - 2  # last sample and 77 are pending
        assert not info.generating
        cont = s.generate(max_tokens=4, ignore_eos=True)
        out = cont.collect()
        assert cont.stats.prefill_tokens == 2
    ref = _reference(model, [(prompt, len(generated)), ([77], 4)])
    assert ref == [generated, out]


def test_cancel_while_queued_touches_nothing(slow_server):
    with Client(slow_server.address) as client:
        busy = client.create_session(initial_tokens=[1, 2])
        waiting = client.create_session(initial_tokens=[3, 4])
        g_busy = busy.generate(max_tokens=20, ignore_eos=True)
        it = iter(g_busy)
        next(it)  # the only engine slot is taken
        g_wait = waiting.generate(max_tokens=5, ignore_eos=True)
        scheduler = slow_server.server.service.scheduler
        deadline = time.time() + 5
        while scheduler.queued == 0 and time.time() < deadline:
            time.sleep(0.005)
        assert scheduler.queued == 1
        g_wait.cancel()
        g_busy.cancel()
        busy.append([9])  # wait for the busy one to wind down
        deadline = time.time() + 5
        while waiting.info().generating and time.time() < deadline:
            time.sleep(0.01)
        info = waiting.info(include_history=True)
        assert list(info.history_token_ids) == [3, 4]
        assert info.cached_length == 0 and info.kv_live_bytes == 0  # never ran: no cache was built
        assert len(waiting.generate(max_tokens=3, ignore_eos=True).collect()) == 3


@pytest.mark.parametrize("durable", [False, True])
def test_close_during_generate_cancels_it_and_frees_the_cache(durable, tmp_path):
    # With a state dir the close deletes the journal while the engine still commits its current step's token: that
    # step ends the stream as cancelled, never as a journal write that failed (once UNAVAILABLE).
    state = {"state_dir": str(tmp_path / "state")} if durable else {}
    with running_server(tiny_served(model=SlowModel(tiny_model(), DELAY)), **state) as slow_server, \
            Client(slow_server.address) as client:
        s = client.create_session(initial_tokens=[1, 2, 3])
        gen = s.generate(max_tokens=100, ignore_eos=True)
        it = iter(gen)
        next(it)
        with Client(slow_server.address) as other:
            other.session(s.id).close()
        rest = list(it)
        assert gen.finish_reason is FinishReason.CANCELLED
        assert len(rest) < 10
        with pytest.raises(SessionNotFound, match="closed"):
            s.info()
        deadline = time.time() + 5
        while slow_server.server.service.store.kv_live_bytes() and time.time() < deadline:
            time.sleep(0.01)
        assert slow_server.server.service.store.kv_live_bytes() == 0


@pytest.mark.parametrize("how", ["close", "client_gone"])
def test_a_queued_generate_that_is_abandoned_leaves_the_queue_at_once(slow_server, how):
    # Not when the engine reaches it: a closed session's reservation would be held for another turn's whole length.
    store, scheduler = slow_server.server.service.store, slow_server.server.service.scheduler
    with Client(slow_server.address) as client:
        busy = client.create_session(initial_tokens=[1, 2])
        running = iter(busy.generate(max_tokens=80, ignore_eos=True))
        next(running)
        s = client.create_session(initial_tokens=[3, 4])
        reserved = store.kv_reserved_bytes()
        with Client(slow_server.address) as other:
            queued = other.session(s.id).generate(max_tokens=5, ignore_eos=True)  # the call starts here
            waited = threading.Thread(target=lambda: list(queued))
            waited.start()
            deadline = time.time() + 5
            while scheduler.queued == 0 and time.time() < deadline:
                time.sleep(0.005)
            assert scheduler.queued == 1
            if how == "close":
                client.session(s.id).close()
            else:
                queued.cancel()
            waited.join(5)
            assert not waited.is_alive()
            if how == "close":
                assert queued.finish_reason is FinishReason.CANCELLED
        deadline = time.time() + 5
        while scheduler.queued and time.time() < deadline:
            time.sleep(0.005)
        assert scheduler.queued == 0 and scheduler.backlog == 0
        if how == "close":
            assert store.kv_reserved_bytes() < reserved  # freed while the other turn still runs
        assert scheduler.running == 1  # the other session's turn still decodes
        rest = list(running)
        assert len(rest) == 79


def test_async_client_cancellation(slow_server):
    async def main():
        async with AsyncClient(slow_server.address) as client:
            s = await client.create_session(initial_tokens=[4, 5, 6])
            got = []
            async with s.generate(max_tokens=200, ignore_eos=True) as gen:
                async for tok in gen:
                    got.append(tok)
                    if len(got) == 2:
                        break
            await s.append([8])  # waits for the cancelled job
            info = await s.info()
            assert info.history_length < 3 + 10 + 1
            assert info.cached_length == info.history_length - 2
            more = await s.generate(max_tokens=3, ignore_eos=True).collect()
            assert len(more) == 3
            await s.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_shutdown_with_generations_in_flight_is_prompt():
    slow = SlowModel(tiny_model(), DELAY)
    with running_server(tiny_served(model=slow), grace_s=0.2) as thread:
        client = Client(thread.address)
        s1 = client.create_session(initial_tokens=[1, 2])
        s2 = client.create_session(initial_tokens=[3, 4])
        running = s1.generate(max_tokens=300, ignore_eos=True)
        it = iter(running)
        next(it)
        queued = s2.generate(max_tokens=300, ignore_eos=True)
        t0 = time.perf_counter()
        thread.stop()
        assert time.perf_counter() - t0 < 3.0
        for gen in (it, queued):
            with pytest.raises(KakeyaError):
                list(gen)
        client.close()


def test_a_free_row_goes_to_the_key_running_the_fewest_before_another_turn_of_a_busy_key():
    """FIFO would hand the row to key A's third turn (queued first); A runs one row already, B none: B's goes first."""
    keys = ("key-a-0123456789abcdef", "key-b-0123456789abcdef")
    slow = SlowModel(tiny_model(), DELAY)
    with running_server(tiny_served(model=slow), max_concurrent=2, api_keys=keys) as thread, \
            Client(thread.address, api_key=keys[0]) as a, Client(thread.address, api_key=keys[1]) as b:
        scheduler = thread.server.service.scheduler
        a1, a2, a3 = (a.create_session(initial_tokens=[1 + i, 2]) for i in range(3))
        b1 = b.create_session(initial_tokens=[7, 8])
        first = iter(a1.generate(max_tokens=12, ignore_eos=True))
        long = iter(a2.generate(max_tokens=60, ignore_eos=True))
        next(first), next(long)
        ended: dict[str, float] = {}

        def run(name, session):
            session.generate(max_tokens=3, ignore_eos=True).collect()
            ended[name] = time.perf_counter()

        waiters = [threading.Thread(target=run, args=("a3", a3))]
        waiters[0].start()
        deadline = time.time() + 5
        while scheduler.queued < 1 and time.time() < deadline:
            time.sleep(0.002)
        waiters.append(threading.Thread(target=run, args=("b1", b1)))
        waiters[1].start()
        while scheduler.queued < 2 and time.time() < deadline:
            time.sleep(0.002)
        assert scheduler.queued == 2  # a3 queued before b1
        list(first)  # a1 ends: its row is free
        for w in waiters:
            w.join(30)
        assert ended["b1"] < ended["a3"]
        list(long)


def test_a_speculative_turns_long_prompt_is_read_in_chunks_between_the_others_steps():
    """A speculative Generate read its whole prompt in one step: every session batched beside it stalled for the
    read (seconds at a few thousand tokens) and a cancel or close waited for it. Now one chunk a step: the other
    session's tokens go on arriving, and a cancel lands between chunks, keeping the chunks read."""
    slow = SlowModel(tiny_model(), DELAY)
    with running_server(tiny_served(model=slow), short_prompt=32) as thread, Client(thread.address) as client:
        busy = client.create_session(initial_tokens=[1, 2])
        running = iter(busy.generate(max_tokens=60, ignore_eos=True))
        next(running)
        long_prompt = [3 + i % 50 for i in range(420)]
        s = client.create_session(initial_tokens=long_prompt)
        gen = s.generate(max_tokens=5, ignore_eos=True, speculation="history")
        reader = threading.Thread(target=lambda: list(gen))
        reader.start()
        (session,) = [x for x in thread.server.service.store.live_sessions() if x.id == s.id]

        def read() -> int:  # positions its cache holds now (the engine thread writes them)
            cache = session.cache
            return 0 if cache is None else cache.length

        deadline = time.time() + 10
        while not 0 < read() < 420 and time.time() < deadline:
            time.sleep(0.002)
        gen.cancel()
        reader.join(10)
        s.append([9])  # after the cancelled turn ended
        info = s.info()
        assert 0 < info.cached_length < 420 and info.history_length == 421  # chunks kept, nothing generated
        more = s.generate(max_tokens=4, ignore_eos=True, speculation="history").collect()
        with client.create_session(initial_tokens=[*long_prompt, 9]) as fresh:
            assert more == fresh.generate(max_tokens=4, ignore_eos=True).collect()
        assert len(list(running)) == 59


KEYS = ("key-a-0123456789abcdef", "key-b-0123456789abcdef")


def test_a_key_holding_every_row_yields_one_to_another_keys_turn():
    """Key A runs both rows with long turns; key B's turn used to wait for one of them to end. Now A's newest row is
    parked (kept, not restarted), B's turn runs at once, and A's parked turn resumes with the tokens it would have
    produced anyway."""
    slow = SlowModel(tiny_model(), DELAY)
    with running_server(tiny_served(model=slow), max_concurrent=2, api_keys=KEYS) as thread, \
            Client(thread.address, api_key=KEYS[0]) as a, Client(thread.address, api_key=KEYS[1]) as b:
        sessions = [a.create_session(initial_tokens=[1 + i, 2]) for i in range(2)]
        streams, firsts = [], []
        for s, speculation in zip(sessions, (None, "history"), strict=True):  # the newest (parked) one speculates
            streams.append(iter(s.generate(max_tokens=80, ignore_eos=True, speculation=speculation)))
            firsts.append(next(streams[-1]))
        with b.create_session(initial_tokens=[7, 8]) as quick:
            t0 = time.perf_counter()
            quick.generate(max_tokens=3, ignore_eos=True).collect()
            waited = time.perf_counter() - t0
        got = [[first, *it] for first, it in zip(firsts, streams, strict=True)]
        assert waited < 80 * DELAY / 2, waited  # far less than A's turns (80 steps each)
        assert thread.server.service.scheduler.stats.parked >= 1
        assert thread.server.metrics.engine_parked_total._value.get() >= 1
        for i in range(2):  # the parked turn as well as the other: as if each had run alone (speculation is exact)
            assert got[i] == _reference(slow.inner, [([1 + i, 2], 80)])[0], i
        # its pause is a wait for a row (queue_s), not decode time: it read as a third of the decode rate
        parked, ran = sessions[1].last_result.stats, sessions[0].last_result.stats
        assert parked.queue_s >= 3 * DELAY > ran.queue_s
        assert parked.decode_tokens_per_s > 0.5 * ran.decode_tokens_per_s, (parked, ran)


def _park_one(thread, a, b, speculation=None) -> tuple[list, list]:
    """Key A's two 300-token turns fill both rows, then key B's turn parks A's newest (speculating as asked): (A's
    sessions, the three generations) with each having delivered its first token."""
    s1, s2 = (a.create_session(initial_tokens=[1 + i, 2]) for i in range(2))
    s3 = b.create_session(initial_tokens=[7, 8])
    streams = []  # kept: a dropped iterator cancels its Generate
    for s in (s1, s2, s3):  # one after the other (generate() sends at once): A's two turns run, then B's arrives
        streams.append(iter(s.generate(max_tokens=300, ignore_eos=True, speculation=speculation if s is s2 else None)))
        next(streams[-1])
    scheduler = thread.server.service.scheduler
    assert scheduler.stats.parked == 1 and scheduler.queued == 1
    return [s1, s2], streams


@pytest.mark.parametrize("speculation", [None, "history"])
def test_a_parked_turn_can_be_cancelled_and_goes_on_from_what_it_kept(speculation):
    slow = SlowModel(tiny_model(), DELAY)
    with running_server(tiny_served(model=slow), max_concurrent=2, api_keys=KEYS) as thread, \
            Client(thread.address, api_key=KEYS[0]) as a, Client(thread.address, api_key=KEYS[1]) as b:
        (s1, s2), (g1, g2, g3) = _park_one(thread, a, b, speculation)  # (iterators: cancelled by closing them)
        scheduler, most = thread.server.service.scheduler, []
        g2.close()  # the parked one: A's newest
        deadline = time.time() + 5
        most.append(scheduler.batch_size)  # (its turn may end before the first look)
        while s2.info().generating and time.time() < deadline:
            most.append(scheduler.batch_size)
            time.sleep(0.002)
        assert max(most) <= 2  # a parked speculative turn ended outside the batch (it went back in, one over)
        assert not s2.info().generating and thread.server.service.scheduler.queued == 0
        g1.close()  # a row for s2's next turn
        history = s2.info(include_history=True).history_token_ids
        with b.create_session(initial_tokens=history) as twin:  # s2 goes on from the history it kept
            assert s2.generate(max_tokens=4, ignore_eos=True).collect() == \
                twin.generate(max_tokens=4, ignore_eos=True).collect()
        g3.close()


def test_a_server_stops_promptly_with_a_parked_turn():
    slow = SlowModel(tiny_model(), DELAY)
    with running_server(tiny_served(model=slow), max_concurrent=2, api_keys=KEYS, grace_s=0.2) as thread, \
            Client(thread.address, api_key=KEYS[0]) as a, Client(thread.address, api_key=KEYS[1]) as b:
        _, gens = _park_one(thread, a, b)
        t0 = time.perf_counter()
        thread.stop()
        assert time.perf_counter() - t0 < 3.0
        for g in gens:
            with pytest.raises(KakeyaError):
                list(g)
