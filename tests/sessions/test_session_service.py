"""SessionService without gRPC: events, validation before any change, cancellation through aclose."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kakeya_runtime.engine.generate import Engine, FinishReason
from kakeya_runtime.server.testing import SlowModel, tiny_model
from kakeya_runtime.sessions import (
    DoneEvent,
    GenerateParams,
    InvalidArgument,
    ServiceConfig,
    SessionService,
    TokensEvent,
)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _collect(service, sid, params):
    tokens, done = [], None
    async for ev in service.generate("", sid, params):
        if isinstance(ev, TokensEvent):
            tokens += ev.token_ids
        else:
            done = ev
    return tokens, done


def test_generate_events_and_incremental_prefill():
    async def main():
        svc = SessionService(Engine(tiny_model()), eos_ids=(2,))
        s = await svc.create("", [5, 6, 7])
        tokens, done = await _collect(svc, s.id, GenerateParams(max_tokens=4, ignore_eos=True))
        assert isinstance(done, DoneEvent) and done.finish_reason is FinishReason.LENGTH
        assert len(tokens) == 4 and done.history_length == 7 and done.stats.prefill_tokens == 3
        await svc.append("", s.id, [8, 9])
        _, done2 = await _collect(svc, s.id, GenerateParams(max_tokens=2, ignore_eos=True))
        assert done2.stats.prefill_tokens == 3
        snap = svc.info("", s.id)
        assert snap.cached_length == snap.history_length - 1 == 3 + 4 + 2 + 2 - 1
        assert not snap.generating and snap.generate_calls == 2
        await svc.shutdown()

    run(main())


@pytest.mark.parametrize(
    "params",
    [GenerateParams(max_tokens=0), GenerateParams(max_tokens=10**6), GenerateParams(max_tokens=2, top_k=-1),
     GenerateParams(max_tokens=2, temperature=-1), GenerateParams(max_tokens=2, top_p=2.0),
     GenerateParams(max_tokens=2, stop_token_ids=(10**6,))],
)
def test_generate_validation_happens_before_anything(params):
    async def main():
        svc = SessionService(Engine(tiny_model()))
        s = await svc.create("", [5])
        with pytest.raises(InvalidArgument):
            await _collect(svc, s.id, params)
        assert s.generate_calls == 0 and s.cache is None and s.busy_ops == 0
        await svc.shutdown()

    run(main())


def test_leaving_the_stream_cancels_the_engine_job():
    async def main():
        slow = SlowModel(tiny_model(), 0.02)
        svc = SessionService(Engine(slow), config=ServiceConfig(max_concurrent=1))
        s = await svc.create("", [5, 6])
        gen = svc.generate("", s.id, GenerateParams(max_tokens=300, ignore_eos=True))
        async with contextlib.aclosing(gen):
            async for ev in gen:
                assert isinstance(ev, TokensEvent)
                break
        await svc.append("", s.id, [1])  # waits for the job to stop
        assert len(s.history) < 2 + 10 + 1 and s.pending_length == 2 and not s.generating
        assert slow.forwards < 12
        await svc.shutdown()

    run(main())


def test_stop_token_finishes_with_stop():
    async def main():
        svc = SessionService(Engine(tiny_model()), eos_ids=(2,))
        s = await svc.create("", [5, 6])
        probe, _ = await _collect(svc, s.id, GenerateParams(max_tokens=3, ignore_eos=True))
        s2 = await svc.create("", [5, 6])
        out, done = await _collect(svc, s2.id, GenerateParams(max_tokens=3, stop_token_ids=(probe[0],)))
        assert out == probe[:1] and done.finish_reason is FinishReason.STOP
        await svc.shutdown()

    run(main())


def test_a_parked_turns_pause_is_filed_where_its_clock_was_running():
    """Parked before its prompt's first chunk, a turn's prefill clock has not started: the pause is queue time alone
    (it was also taken off a prefill and ttft that never held it). Parked while its prompt is read, it comes off
    prefill and ttft; after its first token, off decode."""
    from types import SimpleNamespace

    from kakeya_runtime.sessions.service import _Turn

    turn = _Turn(None, None)  # type: ignore[arg-type]
    turn.stream = SimpleNamespace(result=None)  # admitted, no chunk read yet
    turn.resumed(1.0)
    turn.stream = SimpleNamespace(result=SimpleNamespace(decode_tokens=0))  # reading its prompt
    turn.resumed(2.0)
    turn.stream = SimpleNamespace(result=SimpleNamespace(decode_tokens=3))  # decoding
    turn.resumed(4.0)
    assert (turn.parked_unread_s, turn.parked_before_first_s, turn.parked_after_first_s) == (1.0, 2.0, 4.0)
