"""Limits per API key through a real server: a key filling its quota evicts nothing of another key's, a full server
refuses rather than evict across keys, the KV byte budget refuses before allocating, windows past the context
are INVALID_ARGUMENT, and every refusal is typed and counted by the limit it names."""

from __future__ import annotations

import pytest
from kakeya import Client, InvalidArgument, KvPolicy, ResourceExhausted, SessionNotFound

from kakeya_runtime.server.testing import metric_value as sample
from kakeya_runtime.server.testing import running_server, tiny_served
from kakeya_runtime.server.testing import scrape_metrics as scrape

KEY_A, KEY_B = "key-alpha-0123456789", "key-bravo-0123456789"


def test_key_a_filling_its_quota_evicts_nothing_of_key_b():
    with (running_server(tiny_served(), api_keys=(KEY_A, KEY_B), max_sessions=8) as thread,
          Client(thread.address, api_key=KEY_A) as a, Client(thread.address, api_key=KEY_B) as b):
        assert thread.server.service.store.limits.key_sessions == 4  # an equal share of 8 between two keys
        info = a.model_info()  # what a client plans around: its key's share, beside the server's total
        assert (info.max_sessions, info.max_sessions_per_key) == (8, 4)
        assert info.kv_budget_per_key_bytes == info.kv_budget_bytes // 2 > 0
        b_sessions = [b.create_session(initial_tokens=[5, i]) for i in range(4)]
        a_sessions = [a.create_session(initial_tokens=[6, i]) for i in range(10)]  # 6 over A's quota
        assert [s.info().history_length for s in b_sessions] == [2] * 4  # B's are all there
        for s in a_sessions[:6]:
            with pytest.raises(SessionNotFound, match="evicted to make room"):
                s.info()
        assert [s.info().history_length for s in a_sessions[6:]] == [2] * 4
        assert sample(scrape(thread), "kakeya_session_evicted_total", '{reason="lru"}') == 6


def test_a_full_server_refuses_rather_than_evict_another_keys_sessions():
    with (running_server(tiny_served(), api_keys=(KEY_A, KEY_B), max_sessions=3, max_sessions_per_key=3) as thread,
          Client(thread.address, api_key=KEY_A) as a, Client(thread.address, api_key=KEY_B) as b):
        b_sessions = [b.create_session(initial_tokens=[5, i]) for i in range(3)]
        with pytest.raises(ResourceExhausted, match="limit of 3 sessions"):
            a.create_session(initial_tokens=[1])
        assert all(s.info().history_length == 2 for s in b_sessions)
        text = scrape(thread)
        assert sample(text, "kakeya_limit_refusals_total", '{limit="sessions"}') == 1
        assert sample(text, "kakeya_rpc_errors_total", '{rpc="CreateSession",code="RESOURCE_EXHAUSTED"}') == 1
        b_sessions[0].close()
        assert a.create_session(initial_tokens=[1]).info().history_length == 1  # room again


def test_the_kv_budget_refuses_before_allocating_and_windows_stay_within_the_context():
    served = tiny_served()
    cfg = served.model.config
    full_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * 512  # fp32, context 512
    window_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * (4 + 12)  # sink + window
    budget = full_bytes + window_bytes
    with (running_server(served, api_keys=(KEY_A, KEY_B), kv_budget=budget, kv_budget_per_key=budget) as thread,
          Client(thread.address, api_key=KEY_A) as a, Client(thread.address, api_key=KEY_B) as b):
        s = a.create_session(initial_tokens=[5, 6, 7])
        s.generate(max_tokens=4, ignore_eos=True).collect()
        with pytest.raises(ResourceExhausted, match="server's KV budget"):
            b.create_session(initial_tokens=[1])  # a second full session may need another full context
        text = scrape(thread)
        assert sample(text, "kakeya_limit_refusals_total", '{limit="kv_budget"}') == 1
        assert sample(text, "kakeya_session_kv_reserved_bytes") == full_bytes
        assert sample(text, "kakeya_kv_budget_bytes") == budget
        assert sample(text, "kakeya_session_active") == 1  # nothing was created for B, and A kept its session
        assert 0 < sample(text, "kakeya_session_kv_live_bytes") <= full_bytes
        assert s.info().history_length == 7
        with pytest.raises(InvalidArgument, match="exceeds the context of 512"):
            b.create_session(policy=KvPolicy("sink_window", {"window": 1_000_000}))
        window = b.create_session(initial_tokens=[1], policy=KvPolicy("sink_window", {"sink": 4, "window": 12}))
        assert sample(scrape(thread), "kakeya_session_kv_reserved_bytes") == budget  # fits exactly
        window.close()
        s.close()
        assert b.create_session(initial_tokens=[1]).info().history_length == 1  # A's bytes came back


def test_a_session_made_after_the_callers_deadline_passed_is_closed_again():
    """CreateSession whose deadline passes while the session is made answers DEADLINE_EXCEEDED and closes it: the
    caller never learns its id, so it would hold a slot (and the key's quota, evicting real sessions) until its TTL."""
    import time as _time

    from kakeya import DeadlineExceeded

    with running_server(tiny_served("llama")) as thread:
        service = thread.server.service
        real = service.create

        async def slow_create(*args, **kwargs):
            session = await real(*args, **kwargs)
            _time.sleep(0.4)  # the work outlives the caller's deadline (blocking, as journaling to a slow disk)
            return session

        service.create = slow_create
        with Client(thread.address, timeout=0.2) as client, pytest.raises(DeadlineExceeded):
            client.create_session(initial_tokens=[1, 2, 3])
        deadline = _time.monotonic() + 5
        while len(service.store) and _time.monotonic() < deadline:
            _time.sleep(0.02)
        assert len(service.store) == 0
        service.create = real
        with Client(thread.address, timeout=5) as client:  # a caller that waits keeps its session
            assert client.create_session(initial_tokens=[1, 2, 3]).info().history_length == 3
        assert len(service.store) == 1


def test_a_context_past_the_models_positions_is_refused_at_start():
    """--context beyond the model's positions was cut back to them without a word: a user who asked for 16k learned
    it only when requests were refused. Now the server refuses to start, naming both numbers."""
    from kakeya_runtime.server.grpc_app import RuntimeServer, ServerConfig

    served = tiny_served("llama")
    limit = served.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"--context {limit + 1} exceeds the model's {limit} positions"):
        RuntimeServer(served, ServerConfig(port=0, metrics_port=0, context_length=limit + 1))
    with running_server(served, context_length=limit) as thread:
        assert thread.server.service.context_length == limit


def test_imports_in_progress_share_a_byte_budget():
    """ImportSession buffers its archive before reading it: together the imports in progress hold at most twice the
    largest archive; one more answers RESOURCE_EXHAUSTED (limit "imports", on /metrics) instead of the server
    buffering without bound (16 at once once took 7 GB and kept it). A file that does not start as an archive is
    refused at its first bytes."""
    import contextlib
    import threading
    import time

    import grpc

    from kakeya_runtime._proto import runtime_pb2 as pb
    from kakeya_runtime._proto import runtime_pb2_grpc as pb_grpc
    from kakeya_runtime.sessions import records

    with running_server(tiny_served(context=128)) as thread:
        cap = thread.server.servicer.max_import_bytes
        piece = 256 * 1024  # under the per-message limit
        parts = [records.MAGIC + b"\0" * (piece - len(records.MAGIC))] + [b"\0" * piece] * (int(cap * 0.9) // piece - 1)
        total = sum(map(len, parts))
        release = threading.Event()
        channel = grpc.insecure_channel(thread.address)
        stub = pb_grpc.RuntimeServiceStub(channel)

        def holding():  # ~90% of the largest archive, then wait: its bytes stay buffered on the server
            yield from (pb.ImportSessionRequest(data=p) for p in parts)
            release.wait(30)

        futures = [stub.ImportSession.future(holding()) for _ in range(2)]
        try:
            deadline = time.monotonic() + 10
            while thread.server.servicer.imports.total < 2 * total and time.monotonic() < deadline:
                time.sleep(0.02)
            with pytest.raises(grpc.RpcError) as e:
                stub.ImportSession(pb.ImportSessionRequest(data=p) for p in parts)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "other imports" in e.value.details()
            assert sample(scrape(thread), "kakeya_limit_refusals_total", '{limit="imports"}') == 1
            with pytest.raises(grpc.RpcError) as e:
                stub.ImportSession(iter([pb.ImportSessionRequest(data=b"PK\x03\x04" + b"\0" * 100)]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad magic" in e.value.details()
        finally:
            release.set()
            for f in futures:
                with contextlib.suppress(grpc.RpcError):
                    f.result(30)
            channel.close()
        assert thread.server.servicer.imports.total == 0


def test_a_repeated_key_counts_once_in_the_shares():
    with running_server(tiny_served(), api_keys=(KEY_A, KEY_A), max_sessions=4) as thread, \
            Client(thread.address, api_key=KEY_A) as a:
        assert thread.server.service.store.limits.key_sessions == 4  # one key: the whole server, not half of it
        sessions = [a.create_session(initial_tokens=[5, i]) for i in range(4)]
        assert [s.info().history_length for s in sessions] == [2] * 4


def _import_stub(thread, options=()):
    import grpc

    from kakeya_runtime._proto import runtime_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(thread.address, options=list(options))
    return channel, pb_grpc.RuntimeServiceStub(channel)


def _archive_start(n: int) -> bytes:
    from kakeya_runtime.sessions import records

    return records.MAGIC + b"\0" * (n - len(records.MAGIC))


def test_a_stalled_import_is_refused_and_releases_its_bytes(monkeypatch):
    """An import that sent some bytes and then nothing held them (and the shared import budget) for as long as its
    client kept the stream open: one key's stalled streams refused every other key's imports."""
    import time

    import grpc

    from kakeya_runtime._proto import runtime_pb2 as pb
    from kakeya_runtime.server import grpc_app

    monkeypatch.setattr(grpc_app, "IMPORT_STALL_S", 0.5)
    with running_server(tiny_served(context=128)) as thread:
        channel, stub = _import_stub(thread)

        def stalling():
            yield pb.ImportSessionRequest(data=_archive_start(64 * 1024))
            time.sleep(5)

        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.ImportSession(stalling())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no data for 0.5 s" in e.value.details()
        assert time.monotonic() - t0 < 4 and thread.server.servicer.imports.total == 0
        channel.close()


def test_one_keys_imports_leave_room_for_another_keys():
    import contextlib
    import threading
    import time

    import grpc

    from kakeya_runtime._proto import runtime_pb2 as pb

    keys = ("key-a-0123456789abcdef", "key-b-0123456789abcdef")
    with running_server(tiny_served(context=128), api_keys=keys) as thread:
        servicer = thread.server.servicer
        piece = 64 * 1024
        n = int(servicer.max_import_bytes * 0.6) // piece  # 60% of one archive: two of them do not fit
        parts = [_archive_start(piece)] + [b"\0" * piece] * (n - 1)
        release = threading.Event()
        channel, stub = _import_stub(thread)

        def holding():
            yield from (pb.ImportSessionRequest(data=p) for p in parts)
            release.wait(30)

        meta = (("authorization", f"Bearer {keys[0]}"),)
        held = stub.ImportSession.future(holding(), metadata=meta)
        try:
            deadline = time.monotonic() + 10
            while servicer.imports.total < n * piece and time.monotonic() < deadline:
                time.sleep(0.02)
            with pytest.raises(grpc.RpcError) as e:  # key A's second: past one archive for the key
                stub.ImportSession((pb.ImportSessionRequest(data=p) for p in parts), metadata=meta)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "this key's" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:  # key B's gets as far as reading it (a damaged archive)
                stub.ImportSession((pb.ImportSessionRequest(data=p) for p in parts),
                                   metadata=(("authorization", f"Bearer {keys[1]}"),))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        finally:
            release.set()
            with contextlib.suppress(grpc.RpcError):
                held.result(30)
            channel.close()
        assert servicer.imports.total == 0 and servicer.imports.by_key == {}


def test_a_failed_import_frees_its_archive_without_a_collection():
    """A refused import's traceback kept its frame, and with it the whole buffered archive, in a cycle only a full
    collection frees (a server buffering failed imports grew by gigabytes). With the collector off, three failed
    4 MB imports must leave no more than one behind."""
    import gc
    import tracemalloc

    import grpc

    from kakeya_runtime._proto import runtime_pb2 as pb

    with running_server(tiny_served(context=4096)) as thread:
        channel, stub = _import_stub(thread)
        piece = 1024 * 1024
        parts = [_archive_start(piece)] + [b"\1" * piece] * 3  # 4 MB (the most is ~5), failing its checksum
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as e:
                    stub.ImportSession(pb.ImportSessionRequest(data=p) for p in parts)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            gc.enable()
            channel.close()
        assert grown < 5 * piece, f"{grown / piece:.0f} MB left behind by three failed imports"


def test_a_create_session_cancelled_by_its_caller_leaves_no_session_behind():
    """A CreateSession cancelled while the server made the session left it behind (the server answered before it saw
    the cancel, and the client dropped the answer): nobody knew its id, and it held a slot and the key's quota until
    its TTL. The AsyncClient now lets such a call finish and closes what it made (the server closes one whose cancel
    it does see). 30 creates, cancelled at various moments: nothing is left."""
    import asyncio
    import contextlib
    import time

    from kakeya import AsyncClient

    with running_server(tiny_served(context=512)) as thread:
        store = thread.server.service.store

        async def main() -> int:
            async with AsyncClient(thread.address) as client:
                await client.model_info()
                kept = 0
                for k in range(30):
                    task = asyncio.create_task(client.create_session([3 + i % 200 for i in range(400)]))
                    await asyncio.sleep(0.0005 * (k % 6))
                    task.cancel()
                    try:
                        await (await task).close()
                    except asyncio.CancelledError:
                        pass
                    else:
                        kept += 1
                return kept

        async def closing_at_once() -> None:  # the client closed right after the cancel: its channel went first
            for k in range(8):
                async with AsyncClient(thread.address) as client:
                    task = asyncio.create_task(client.create_session([3 + i % 200 for i in range(400)]))
                    await asyncio.sleep(0.0005 * (k % 4))
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await (await task).close()

        kept = asyncio.run(main())
        asyncio.run(closing_at_once())
        deadline = time.monotonic() + 5
        while len(store) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(store) == 0, f"{len(store)} sessions left behind by cancelled creates ({kept} got back and closed)"


def test_exports_in_progress_share_a_byte_budget():
    """An export holds its whole archive until the client has read it: stalled exports of one 3k-token session held
    more than the whole KV budget, counted nowhere. Exports now take from a byte budget as imports do; one past it
    is refused (RESOURCE_EXHAUSTED, limit "exports", on /metrics) and the session is untouched."""
    from kakeya import ResourceExhausted

    from kakeya_runtime.server.grpc_app import _HeldBytes

    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        session = client.create_session([3 + i % 250 for i in range(300)])
        session.generate(max_tokens=1).collect()  # a cache for the snapshot
        archive = session.export(include_kv=True)
        servicer = thread.server.servicer
        assert servicer.exports.total == 0  # given back once read
        servicer.exports = _HeldBytes("exports", len(archive) // 4, keys=0)  # 2 x a quarter: half an archive
        servicer.exports.take("another", 1)  # another export in progress, unread
        with pytest.raises(ResourceExhausted, match="other exports in progress"):
            session.export(include_kv=True)
        assert sample(scrape(thread), "kakeya_limit_refusals_total", '{limit="exports"}') == 1
        assert servicer.exports.total == 1 and session.info().history_length == 301
        assert len(session.export()) < len(archive) // 2  # without its KV snapshot it fits
        servicer.exports.give_back("another", 1)
        # alone, an archive past one share still goes (a session recovered with a longer context than this
        # server's: refused for ever, with "retry", before)
        assert len(session.export(include_kv=True)) == len(archive)


def test_an_export_its_client_stops_reading_is_ended_and_lets_its_bytes_go(monkeypatch):
    """An export whose client stops reading held its archive (and the shared export budget) for as long as the
    stream stayed open. Past the HTTP/2 windows (a 16 MB archive: the first MB are buffered by the transport) a
    write that waits EXPORT_STALL_S ends the call: RESOURCE_EXHAUSTED, limit "exports", bytes given back."""
    import dataclasses
    import time

    import grpc

    from kakeya_runtime._proto import runtime_pb2 as pb
    from kakeya_runtime.models.registry import build_model
    from kakeya_runtime.server import grpc_app
    from kakeya_runtime.server.testing import tiny_config

    monkeypatch.setattr(grpc_app, "EXPORT_STALL_S", 0.5)
    config = dataclasses.replace(tiny_config(context=4096), num_key_value_heads=4, head_dim=64)  # 4 KB a token
    with running_server(tiny_served(model=build_model(config).eval())) as thread, Client(thread.address) as client:
        session = client.create_session([3 + i % 250 for i in range(4000)])
        session.generate(max_tokens=1).collect()  # a cache for the snapshot
        # The client's receive window fixed: with bandwidth probing it may grow past the whole archive (seen under a
        # loaded full suite), and a client that paused after the transport took every byte holds nothing back.
        channel, stub = _import_stub(thread, [("grpc.http2.bdp_probe", 0)])
        stream = stub.ExportSession(pb.ExportSessionRequest(session_id=session.id, include_kv=True))
        read = len(next(stream).data)
        held = thread.server.servicer.exports.total
        assert held > 10 * 2**20  # the whole archive, held while it is sent
        time.sleep(3)  # the client pauses
        with pytest.raises(grpc.RpcError) as e:
            for chunk in stream:
                read += len(chunk.data)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "not read for 0.5 s" in e.value.details()
        assert read < held and thread.server.servicer.exports.total == 0
        assert sample(scrape(thread), "kakeya_limit_refusals_total", '{limit="exports"}') == 1
        assert session.info().history_length == 4001  # the session is untouched
        assert len(session.export(include_kv=True)) == held  # and a client that reads gets all of it
        channel.close()


def test_an_append_whose_deadline_passed_appends_nothing():
    """An AppendTokens whose caller's deadline passed while the server read it (a long list of ids on a busy
    server) was still appended after the caller was told DEADLINE_EXCEEDED: a retry appended the turn twice."""
    import time as _time

    from kakeya import DeadlineExceeded

    with running_server(tiny_served()) as thread, Client(thread.address, timeout=5) as client:
        session = client.create_session([5, 6, 7])
        service = thread.server.service
        real = service._check_tokens

        def slow_check(*args, **kwargs):
            _time.sleep(0.5)  # the work outlives the caller's deadline (blocking, as a busy server's read)
            return real(*args, **kwargs)

        service._check_tokens = slow_check
        try:
            with Client(thread.address, timeout=0.2) as hasty, pytest.raises(DeadlineExceeded):
                hasty.session(session.id).append([8, 9])
        finally:
            service._check_tokens = real
        _time.sleep(0.6)  # past the slow check: had it been appended, it would be by now
        assert session.info().history_length == 3
        assert session.append([8, 9]) == 5  # the retry appends once


def test_a_budget_smaller_than_one_default_session_is_warned_at_start():
    """--kv-budget 1MiB started without a word and refused every default create; the banner read 0.00 GiB."""
    from kakeya_runtime.server.cli import _size, small_budget_warning

    with running_server(tiny_served(), kv_budget=4096) as thread:
        warning = small_budget_warning(thread.server.service)
        assert warning is not None and "full session reserves" in warning and "4.0 KiB" in warning
        assert "per key" not in warning  # no keys: no per-key budget to name
    # a per-key budget above the server's: the server's is the one that refuses, warned and reported as the share
    with running_server(tiny_served(), kv_budget=4096, kv_budget_per_key=1 << 30,
                        api_keys=("key-one-12345678",)) as thread:
        warning = small_budget_warning(thread.server.service)
        assert warning is not None and "4.0 KiB" in warning and "per key" not in warning
        with Client(thread.address, api_key="key-one-12345678") as client:
            assert client.model_info().kv_budget_per_key_bytes == 4096
    with running_server(tiny_served()) as thread:
        assert small_budget_warning(thread.server.service) is None
    assert _size(1 << 20) == "1.0 MiB" and _size(0) == "none"


def test_every_key_has_room_for_one_transfer_of_its_own():
    """With three keys or more, two keys within their own shares held the whole total (twice one archive) and a
    third key's exports were refused: the total is now one archive per key when there are more keys than two."""
    from kakeya_runtime.server.grpc_app import _HeldBytes
    from kakeya_runtime.sessions.errors import ResourceExhausted as Refused

    held = _HeldBytes("exports", 10, keys=3)
    for key in ("a", "b", "c"):
        held.take(key, 10)
    with pytest.raises(Refused, match="this key's other exports"):
        held.take("a", 1)
    held.give_back("c", 10)
    two = _HeldBytes("imports", 10, keys=0)  # auth off: twice one archive in all
    two.take("", 10)
    two.take("", 10)
    with pytest.raises(Refused, match="other imports in progress"):
        two.take("", 1)
    assert (held.total, held.by_key) == (20, {"a": 10, "b": 10})
    # a transfer let through alone past one archive (a session recovered with a longer context) leaves the other
    # key its room: that key's export was refused until the large one ended
    trio = _HeldBytes("exports", 10, keys=3)
    trio.take("a", 28)  # alone
    trio.take("b", 10)
    trio.take("c", 10)
    with pytest.raises(Refused, match="this key's other exports"):
        trio.take("a", 1)
    assert trio.total == 48
