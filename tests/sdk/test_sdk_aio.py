"""`AsyncClient.create_session` works as the sync one does: `async with` without `await`, and also awaited."""

from __future__ import annotations

import asyncio

import pytest
from kakeya import AsyncClient, InvalidArgument, SessionNotFound


def test_async_with_create_session_closes_it(server):
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            async with client.create_session(initial_tokens=[10, 11, 12]) as session:
                assert session.history_length == 3 and len(server.server.service.store) == 1
                gen = session.generate(max_tokens=3, ignore_eos=True)
                assert len(await gen.collect()) == 3
                assert (await session.info()).history_length == 6
            assert len(server.server.service.store) == 0  # closed on exit
            with pytest.raises(SessionNotFound):
                await session.info()

    asyncio.run(main())


def test_async_create_session_is_still_awaitable(server):
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            session = await client.create_session(initial_tokens=[5])
            async with session:
                assert (await session.info()).history_length == 1
            with pytest.raises(SessionNotFound):
                await session.info()
            async with await client.create_session(initial_tokens=[6]) as again:
                assert again.history_length == 1

    asyncio.run(main())


def test_async_create_session_is_a_coroutine_for_create_task(server):
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            tasks = [asyncio.create_task(client.create_session(initial_tokens=[i + 1])) for i in range(3)]
            sessions = await asyncio.gather(*tasks)
            assert sorted(s.history_length for s in sessions) == [1, 1, 1] and len({s.id for s in sessions}) == 3
            for s in sessions:
                await s.close()
            assert len(server.server.service.store) == 0

    asyncio.run(main())


def test_async_with_closes_the_session_when_the_body_raises(server):
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            with pytest.raises(RuntimeError, match="boom"):
                async with client.create_session(initial_tokens=[1, 2]) as session:
                    raise RuntimeError("boom")
            with pytest.raises(SessionNotFound):
                await session.info()
            with pytest.raises(InvalidArgument):  # a refused creation raises on entry, nothing to close
                async with client.create_session(initial_tokens=[10**6]):
                    pass
            assert len(server.server.service.store) == 0

    asyncio.run(main())


@pytest.fixture(scope="module")
def slow_server():
    from kakeya_runtime.server.testing import SlowModel, running_server, tiny_served

    served = tiny_served("llama")
    served.model = SlowModel(served.model, 0.01)  # every forward >= 10 ms: a Generate runs for seconds
    with running_server(served) as thread:
        yield thread


def _stops_when_dropped(history_length) -> None:
    """The history stops growing soon after the generation was dropped, well short of its max_tokens."""
    import time

    deadline, last = time.monotonic() + 10, -1
    while time.monotonic() < deadline:
        now = history_length()
        if now == last:
            assert now < 3 + 300
            return
        last = now
        time.sleep(0.5)
    raise AssertionError(f"the dropped generation kept running ({last} tokens)")


def test_a_dropped_generation_stops_the_servers_work(slow_server):
    """A Generation dropped without being iterated (or before its end) stops the Generate, sync and async alike:
    the async one ran every token for nobody."""
    import gc
    import time

    from kakeya import Client

    with Client(slow_server.address, timeout=10) as client:
        session = client.create_session([1, 2, 3])
        gen = session.generate(max_tokens=300, ignore_eos=True)
        while session.info().history_length < 6:
            time.sleep(0.02)
        del gen
        gc.collect()
        _stops_when_dropped(lambda: session.info().history_length)

    async def main() -> None:
        async with AsyncClient(slow_server.address, timeout=10) as client:
            session = await client.create_session([1, 2, 3])
            gen = session.generate(max_tokens=300, ignore_eos=True)
            while (await session.info()).history_length < 6:
                await asyncio.sleep(0.02)
            del gen
            gc.collect()
            lengths = []
            for _ in range(20):
                lengths.append((await session.info()).history_length)
                if len(lengths) > 1 and lengths[-1] == lengths[-2]:
                    break
                await asyncio.sleep(0.5)
            assert lengths[-1] == lengths[-2] and lengths[-1] < 3 + 300, lengths

    asyncio.run(main())
