"""The `kakeya` SDK surface, sync and asyncio, against a real in-process runtime."""

from __future__ import annotations

import asyncio

import grpc
import kakeya
import pytest
from kakeya import (
    AsyncClient,
    Client,
    FailedPrecondition,
    FinishReason,
    InvalidArgument,
    KakeyaError,
    KvPolicy,
    ResourceExhausted,
    SessionNotFound,
    Unavailable,
)


def test_model_info(client):
    info = client.model_info()
    assert info.model_name == "tiny-llama" and info.model_type == "llama"
    assert info.vocab_size == 259 and info.eos_token_ids == (2,) and info.bos_token_id is None
    assert info.context_length == 512
    assert info.tokenizer_json.startswith("{") and "<|im_start|>" in info.chat_template
    assert info.kv_policies == ("full", "sink_window", "restore", "sparse")
    assert info.idle_compress_after_s is None and info.idle_codec is None  # idle compression is off by default
    assert info.max_sessions == 64 and info.max_concurrent == 8 and info.session_idle_ttl_s == 1800
    assert client.model_info() is info  # cached


def test_session_roundtrip_and_stats(client):
    with client.create_session(initial_tokens=[10, 11, 12], policy="full") as s:
        assert s.id.startswith("ses_") and len(s.id) >= 4 + 32  # >= 192 bits, url-safe
        assert s.history_length == 3 and s.policy == KvPolicy("full", {})
        assert s.append([13, 14]) == 5
        gen = s.generate(max_tokens=6, ignore_eos=True)
        assert gen.result is None and gen.stats is None
        tokens = list(gen)
        assert tokens == gen.token_ids and len(tokens) == 6
        assert gen.finish_reason is FinishReason.LENGTH
        st = gen.stats
        assert st.prefill_tokens == 5 and st.decode_tokens == 6
        assert 0 < st.prefill_s <= st.ttft_s and st.decode_s > 0 and st.decode_tokens_per_s > 0
        assert st.queue_s >= 0
        assert gen.result.history_length == 11 == s.history_length
        assert s.last_result is gen.result
        info = s.info(include_history=True)
        assert info.history_token_ids == (10, 11, 12, 13, 14, *tokens)
        assert info.cached_length == 10 and info.kv_live_bytes > 0 and info.remaining == 512 - 11
        assert info.generate_calls == 1 and not info.generating and info.idle_s >= 0
        assert s.info().history_token_ids is None
        with pytest.raises(RuntimeError, match="once"):
            iter(gen)
    with pytest.raises(SessionNotFound):
        s.info()


def test_stop_tokens_and_eos(client):
    with client.create_session(initial_tokens=[20, 21]) as s:
        probe = s.generate(max_tokens=4, ignore_eos=True).collect()
    stop = probe[2]
    with client.create_session(initial_tokens=[20, 21]) as s:
        gen = s.generate(max_tokens=4, stop_tokens=[stop], ignore_eos=True)
        out = gen.collect()
        assert gen.finish_reason is FinishReason.STOP
        assert out[-1] == stop and out == probe[: len(out)] and len(out) <= 3
        assert s.info().history_length == 2 + len(out)  # the stop token joined the history


def test_reattach_by_id(client, server):
    s = client.create_session(initial_tokens=[1, 2])
    with Client(server.address) as other:
        again = other.session(s.id)
        assert again.append([3]) == 3
        again.close()
    with pytest.raises(SessionNotFound):
        s.append([4])


def test_seeded_sampling_is_reproducible_and_seed_matters(client):
    kw = {"max_tokens": 10, "temperature": 1.0, "top_k": 50, "ignore_eos": True}
    runs = []
    for seed in (1, 1, 2):
        with client.create_session(initial_tokens=[30, 31, 32]) as s:
            runs.append(s.generate(seed=seed, **kw).collect())
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_typed_errors_carry_grpc_codes(client):
    with pytest.raises(InvalidArgument) as e:
        client.create_session(initial_tokens=[10**6])
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and isinstance(e.value, KakeyaError)
    with pytest.raises(ResourceExhausted) as e:
        client.create_session(initial_tokens=[1] * 513)
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    with client.create_session() as s, pytest.raises(FailedPrecondition):
        s.generate(max_tokens=1).collect()
    assert set(kakeya.__all__) >= {"SessionNotFound", "InvalidArgument", "ResourceExhausted", "FailedPrecondition",
                                   "Unauthenticated", "Unavailable"}


def test_argument_types_are_checked_before_anything_is_sent(client, server):
    import numpy as np

    with client.create_session(np.array([0])) as s:  # a one-token array is not "no tokens"
        assert s.history_length == 1 and list(s.info(include_history=True).history_token_ids) == [0]
        assert s.append(np.array([3, 4], dtype=np.int64)) == 3
        for bad in ([1.9], ["7"], [True], [2.5, 3]):  # once truncated or coerced: history (1, 7, 1)
            with pytest.raises(InvalidArgument, match="integer token ids"):
                s.append(bad)
            with pytest.raises(InvalidArgument, match="integer token ids"):
                s.generate(max_tokens=1, stop_tokens=bad)
        with pytest.raises(InvalidArgument, match="True or False"):
            s.info(include_history="x")
        with pytest.raises(InvalidArgument, match="True or False"):
            s.export(include_kv="yes")
        assert s.info().history_length == 3  # nothing appended
    with pytest.raises(InvalidArgument, match="integer token ids"):
        client.create_session([1.9, "7", True])
    with pytest.raises(InvalidArgument, match="policy must be"):
        client.create_session([1], policy=5)
    with pytest.raises(InvalidArgument, match="policy must be"):
        client.create_session([1], policy={"name": "full"})
    with pytest.raises(InvalidArgument, match="speculation must be"):
        client.create_session([1], speculation=3)
    with pytest.raises(InvalidArgument, match="session id is a string"):
        client.session(123)
    for key in ("ключ-ключ-1", "key-with\nnewline", " spaced-key"):  # gRPC itself said INTERNAL "Invalid metadata"
        with pytest.raises(InvalidArgument, match="printable ASCII"):
            Client(server.address, api_key=key)
    assert len(server.server.service.store) == 0


def test_a_closed_client_raises_a_typed_error(server):
    client = Client(server.address)
    session = client.create_session([1, 2])
    client.close()
    for call in (client.model_info, lambda: client.create_session([1]), session.info, lambda: session.append([3]),
                 lambda: session.generate(max_tokens=1), session.export, lambda: client.import_session(b"x")):
        with pytest.raises(FailedPrecondition, match="client is closed"):
            call()

    async def main() -> None:
        aclient = AsyncClient(server.address)
        asession = await aclient.create_session([1, 2])
        gen = asession.generate(max_tokens=200, ignore_eos=True)
        got = []
        with pytest.raises(kakeya.Cancelled):  # once asyncio.CancelledError in a task nobody cancelled
            async for t in gen:
                got.append(t)
                if len(got) == 2:
                    await aclient.close()
        with pytest.raises(FailedPrecondition, match="client is closed"):
            await asession.info()
        with pytest.raises(FailedPrecondition, match="client is closed"):
            await aclient.create_session([1])

    asyncio.run(main())


def test_unreachable_server_is_unavailable():
    with Client("127.0.0.1:1", timeout=2) as c, pytest.raises(Unavailable):
        c.model_info()


def test_generation_context_manager_cancels(client):
    with client.create_session(initial_tokens=[5, 6]) as s:
        s.generate(max_tokens=2).collect()
        assert s.last_result is not None
        with s.generate(max_tokens=50, ignore_eos=True) as gen:
            it = iter(gen)
            next(it)
        assert gen.result is None
        assert s.last_result is None  # not the turn before: a cancelled Generate has no result
        s.append([9])  # waits for the cancelled Generate to stop
        info = s.info()
        assert info.cached_length == info.history_length - 2


def test_async_client_same_surface(server):
    async def main():
        async with AsyncClient(server.address) as client:
            info = await client.model_info()
            assert info.vocab_size == 259
            tok = await client.tokenizer()
            assert tok.vocab_size == 259
            async with await client.create_session(initial_tokens=[10, 11, 12], policy=KvPolicy("full")) as s:
                assert await s.append([13]) == 4
                gen = s.generate(max_tokens=5, ignore_eos=True)
                got = [t async for t in gen]
                assert got == gen.token_ids and gen.finish_reason is FinishReason.LENGTH
                assert gen.stats.prefill_tokens == 4 and s.last_result is gen.result
                assert (await s.info(include_history=True)).history_token_ids == (10, 11, 12, 13, *got)
                with pytest.raises(InvalidArgument):
                    await s.append([])
                with pytest.raises(InvalidArgument):
                    await s.generate(max_tokens=0).collect()
            with pytest.raises(SessionNotFound):
                await s.info()
            with pytest.raises(SessionNotFound):
                await client.session("ses_nope").append([1])

    asyncio.run(main())


def test_sync_and_async_agree(server):
    kw = {"max_tokens": 8, "temperature": 0.8, "seed": 99, "top_p": 0.9, "ignore_eos": True}
    with Client(server.address) as c, c.create_session(initial_tokens=[40, 41, 42]) as s:
        sync_out = s.generate(**kw).collect()

    async def main():
        async with AsyncClient(server.address) as c:
            s = await c.create_session(initial_tokens=[40, 41, 42])
            out = await s.generate(**kw).collect()
            await s.close()
            return out

    assert asyncio.run(main()) == sync_out


def test_export_keeps_the_client_wide_deadline(server):
    """An export is a finite call like an import: the client's `timeout` bounds it whole (it ran unbounded, so a
    stalled server hung the caller however short a timeout it had set)."""
    import asyncio

    from kakeya import AsyncClient, DeadlineExceeded

    service = server.server.service
    real = service.export

    async def slow_export(*args, **kwargs):
        await asyncio.sleep(1.0)
        return await real(*args, **kwargs)

    with Client(server.address, timeout=5) as client:
        session = client.create_session([1, 2, 3])
    service.export = slow_export
    try:
        with Client(server.address, timeout=0.3) as client, pytest.raises(DeadlineExceeded):
            client.session(session.id).export()

        async def main() -> None:
            async with AsyncClient(server.address, timeout=0.3) as aclient:
                with pytest.raises(DeadlineExceeded):
                    await aclient.session(session.id).export()

        asyncio.run(main())
    finally:
        service.export = real
    with Client(server.address, timeout=5) as client:  # a caller that waits gets its archive
        archive = client.session(session.id).export()
        assert client.import_session(archive).info().history_length == 3
        client.session(session.id).close()
