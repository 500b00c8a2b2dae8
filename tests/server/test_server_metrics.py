"""/metrics: only that path, loopback by default, an optional bearer key; every metric `kakeya_*` with the model as
a label; requests and errors counted per RPC; generated tokens counted."""

from __future__ import annotations

import contextlib
import re
import time
import urllib.error
import urllib.request

import grpc
import pytest
from kakeya import Client, InvalidArgument, SessionNotFound

from kakeya_runtime.server.grpc_app import ServerConfig
from kakeya_runtime.server.testing import metric_value as sample
from kakeya_runtime.server.testing import running_server, tiny_served
from kakeya_runtime.server.testing import scrape_metrics as scrape

METRICS_KEY = "metrics-key-0123456789"


def _get(thread, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{thread.server.metrics_port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_serve_warns_when_metrics_are_open_beyond_this_machine():
    from kakeya_runtime.server.cli import open_metrics_warning

    assert open_metrics_warning(ServerConfig()) is None  # loopback
    assert open_metrics_warning(ServerConfig(metrics_host="::1")) is None
    assert "--metrics-key" in open_metrics_warning(ServerConfig(metrics_host="0.0.0.0"))
    assert open_metrics_warning(ServerConfig(metrics_host="0.0.0.0", metrics_key="k" * 16)) is None


def test_only_the_metrics_path_is_served_on_loopback_by_default():
    assert ServerConfig().metrics_host == "127.0.0.1"
    with running_server(tiny_served()) as thread:
        assert thread.server.metrics._http.server_address[0] == "127.0.0.1"
        status, text = _get(thread, "/metrics")
        assert status == 200 and "kakeya_session_active" in text
        assert _get(thread, "/metrics?name[]=x")[0] == 200
        for path in ("/", "/metrics/", "/metricsx", "/favicon.ico", "/../metrics"):
            status, text = _get(thread, path)
            assert status == 404 and "kakeya_" not in text, path


def test_a_metrics_key_is_required_when_configured():
    with running_server(tiny_served(), metrics_key=METRICS_KEY) as thread:
        for headers in ({}, {"Authorization": "Bearer wrong-key-0000000"}, {"Authorization": METRICS_KEY},
                        {"Authorization": f"Basic {METRICS_KEY}"}):
            status, text = _get(thread, "/metrics", headers)
            assert status == 401 and "kakeya_" not in text, headers
        assert _get(thread, "/nowhere", {"Authorization": f"Bearer {METRICS_KEY}"})[0] == 404
        assert "kakeya_session_active" in scrape(thread, key=METRICS_KEY)


def test_every_series_is_prefixed_and_carries_the_model():
    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        with client.create_session(initial_tokens=[5, 6, 7]) as s:
            s.generate(max_tokens=2, ignore_eos=True).collect()
        text = scrape(thread)
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(samples) > 100
    for line in samples:
        assert line.startswith("kakeya_") and 'model="tiny-llama"' in line, line
    for line in text.splitlines():
        if line.startswith(("# HELP", "# TYPE")):
            assert line.split()[2].startswith("kakeya_"), line


def test_requests_errors_and_generated_tokens_are_counted_per_rpc():
    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        text = scrape(thread)
        assert sample(text, "kakeya_rpc_requests_total", '{rpc="Generate"}') == 0
        assert sample(text, "kakeya_rpc_errors_total", '{rpc="GetSessionInfo",code="NOT_FOUND"}') == 0
        s = client.create_session(initial_tokens=[5, 6, 7])
        got = s.generate(max_tokens=4, ignore_eos=True).collect() + s.generate(max_tokens=3, ignore_eos=True).collect()
        with pytest.raises(SessionNotFound):
            client.session("ses_nope").info()
        with grpc.insecure_channel(thread.address) as channel:  # a method the server does not serve
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary("/kakeya.v1.RuntimeService/Nope")(b"")
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        text = scrape(thread)
        assert len(got) == 7 and sample(text, "kakeya_generated_tokens_total") == 7
        assert sample(text, "kakeya_rpc_requests_total", '{rpc="CreateSession"}') == 1
        assert sample(text, "kakeya_rpc_requests_total", '{rpc="Generate"}') == 2
        assert sample(text, "kakeya_rpc_requests_total", '{rpc="GetSessionInfo"}') == 1
        assert sample(text, "kakeya_rpc_errors_total", '{rpc="GetSessionInfo",code="NOT_FOUND"}') == 1
        assert sample(text, "kakeya_rpc_errors_total", '{rpc="Generate"}') == 0
        assert sample(text, "kakeya_rpc_requests_total", '{rpc="unknown"}') == 1
        assert sample(text, "kakeya_rpc_errors_total", '{rpc="unknown",code="UNIMPLEMENTED"}') == 1
        assert not re.search(r'rpc="Nope"', text)  # a client's method name never becomes a label
        # ImportSession streams its request: its refusals are counted too (they once were requests only)
        with pytest.raises(InvalidArgument):
            client.import_session(b"garbage")
        assert client.import_session(s.export()).history_length == 3 + 7
        text = scrape(thread)
        assert sample(text, "kakeya_rpc_requests_total", '{rpc="ImportSession"}') == 2
        assert sample(text, "kakeya_rpc_errors_total", '{rpc="ImportSession",code="INVALID_ARGUMENT"}') == 1


def test_sparse_counters_are_labelled_by_the_models_layer_index():
    """A model whose policy governs only some layers (Gemma 3: its global layers) labels kakeya_sparse_*_total by
    the model's layer index, not by the layer's place among the governed ones (0, 1, 2 read as the wrong layers)."""
    from prometheus_client import generate_latest

    from kakeya_runtime.server.metrics import RuntimeMetrics
    from kakeya_runtime.sessions.service import GenerateStats

    metrics = RuntimeMetrics("m", sparse_layers=[5, 11, 17])
    counts = {"blocks_scored": 4, "blocks_selected": 2, "positions_attended": 9, "positions_visible": 20}
    layers = [{k: v * (i + 1) for k, v in counts.items()} for i in range(3)]
    metrics.generate_finished(GenerateStats(decode_tokens=1, sparse={"total": {}, "layers": layers}), 10)
    text = generate_latest(metrics.registry).decode()
    assert [sample(text, "kakeya_sparse_blocks_selected_total", f'{{layer="{i}"}}') for i in (5, 11, 17)] == [2, 4, 6]
    assert 'layer="0"' not in text


def test_generates_are_counted_by_finish_reason():
    from kakeya_runtime.server.testing import TINY_VOCAB

    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        text = scrape(thread)
        assert [sample(text, "kakeya_generate_finished_total", f'{{reason="{r}"}}') for r in
                ("stop", "length", "cancelled")] == [0, 0, 0]
        s = client.create_session(initial_tokens=[5, 6, 7])
        s.generate(max_tokens=3, ignore_eos=True).collect()
        assert s.generate(max_tokens=9, stop_tokens=range(TINY_VOCAB)).collect()  # stops at its first token
        gen = s.generate(max_tokens=400, ignore_eos=True)
        next(iter(gen))
        gen.cancel()
        with pytest.raises(InvalidArgument):  # refused before it began: an error, not a finish
            s.generate(max_tokens=3, temperature=-1.0).collect()
        s.append([9])  # waits for the cancelled turn to end (its turn is taken after it)
        text = scrape(thread)
        assert [sample(text, "kakeya_generate_finished_total", f'{{reason="{r}"}}') for r in
                ("stop", "length", "cancelled")] == [1, 1, 1]


def test_a_call_past_its_deadline_is_counted_as_deadline_exceeded_not_cancelled():
    from kakeya_runtime._proto import runtime_pb2 as pb
    from kakeya_runtime._proto import runtime_pb2_grpc as pb_grpc
    from kakeya_runtime.server.testing import SlowModel, tiny_model

    with running_server(tiny_served(model=SlowModel(tiny_model(), 0.03))) as thread, \
            Client(thread.address) as client, grpc.insecure_channel(thread.address) as channel:
        s = client.create_session(initial_tokens=[5, 6, 7])
        calls = pb_grpc.RuntimeServiceStub(channel).Generate(
            pb.GenerateRequest(session_id=s.id, max_tokens=300, ignore_eos=True), timeout=0.5)
        with pytest.raises(grpc.RpcError) as e:
            list(calls)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        s.append([9])  # after the turn ended
        text = scrape(thread)
        assert sample(text, "kakeya_rpc_errors_total", '{rpc="Generate",code="DEADLINE_EXCEEDED"}') == 1
        assert 'rpc="Generate",code="CANCELLED"' not in text
        # the client's own cancel of a call with a short deadline is a cancel (within 0.25 s of the deadline, every
        # such cancel counted as one)
        calls = pb_grpc.RuntimeServiceStub(channel).Generate(
            pb.GenerateRequest(session_id=s.id, max_tokens=300, ignore_eos=True), timeout=0.3)
        time.sleep(0.08)
        calls.cancel()
        s.append([9])
        text = scrape(thread)
        assert sample(text, "kakeya_rpc_errors_total", '{rpc="Generate",code="CANCELLED"}') == 1
        assert sample(text, "kakeya_rpc_errors_total", '{rpc="Generate",code="DEADLINE_EXCEEDED"}') == 1


def test_idle_connections_to_metrics_are_bounded_and_closed(monkeypatch):
    """Connections that never send a request held a thread each for ever: at most METRICS_CONNECTIONS are served
    at once (more are closed unread), and one idle past the handler's timeout is closed."""
    import socket
    import threading

    from kakeya_runtime.server import metrics as metrics_module

    monkeypatch.setattr(metrics_module._MetricsHandler, "timeout", 0.5)
    with running_server(tiny_served()) as thread:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", thread.server.metrics_port)) for _ in range(50)]
        time.sleep(0.2)
        assert threading.active_count() - before <= 2 * metrics_module.METRICS_CONNECTIONS  # each with its deadline
        time.sleep(1.0)  # past the idle timeout: every one closed by the server
        for sock in idle:
            sock.settimeout(2)
            assert sock.recv(1) == b""
            sock.close()
        assert threading.active_count() <= before + 1
        assert _get(thread, "/metrics")[0] == 200


def test_metrics_stay_reachable_while_every_slot_trickles_headers(monkeypatch, capfd):
    """32 clients each sending a header line every few seconds (never idle for the idle timeout) held every slot,
    and no scrape got through: a request must now arrive whole within METRICS_READ_S of its connection."""
    import socket
    import threading

    from kakeya_runtime.server import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "METRICS_READ_S", 0.5)
    with running_server(tiny_served()) as thread:
        stop = threading.Event()
        socks = [socket.create_connection(("127.0.0.1", thread.server.metrics_port))
                 for _ in range(metrics_module.METRICS_CONNECTIONS)]

        def trickle():
            for s in socks:
                s.sendall(b"GET /metrics HTTP/1.0\r\n")
            while not stop.wait(0.2):
                for s in socks:
                    with contextlib.suppress(OSError):
                        s.sendall(b"X-Slow: 1\r\n")

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        try:
            time.sleep(1.0)  # past the read deadline: the tricklers were closed, their slots free
            assert _get(thread, "/metrics")[0] == 200
            # a cut request is not answered (its headers' read ended at the cut as if whole: the answer went into a
            # dead socket, a BrokenPipeError traceback each)
            assert "BrokenPipeError" not in capfd.readouterr().err
        finally:
            stop.set()
            t.join(5)
            for s in socks:
                s.close()


def test_a_request_over_the_receive_limit_is_not_counted_as_a_request_that_never_finished():
    """gRPC refuses a request larger than the receive limit before any handler runs: it was counted as a request
    with no finish, so /metrics read it as a success. Requests are now counted where their finish is."""
    from kakeya_runtime._proto import runtime_pb2 as pb
    from kakeya_runtime._proto import runtime_pb2_grpc as pb_grpc

    with running_server(tiny_served(context=128)) as thread, grpc.insecure_channel(thread.address) as channel:
        stub = pb_grpc.RuntimeServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.AppendTokens(pb.AppendTokensRequest(session_id="ses_x", token_ids=[200] * 1_000_000))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError):
            stub.AppendTokens(pb.AppendTokensRequest(session_id="ses_x", token_ids=[5]))  # answered: NOT_FOUND
        text = scrape(thread)
        assert sample(text, "kakeya_rpc_requests_total", '{rpc="AppendTokens"}') == 1
        assert sample(text, "kakeya_rpc_errors_total", '{rpc="AppendTokens"}') == 1
