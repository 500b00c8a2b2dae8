"""Nothing a client sends fails a session or the server (issue 16, part 1), seen from a raw gRPC client built
only from the generated stubs: undecodable bytes, bad UTF-8, deep nesting, NaN/infinities and out-of-range
numbers answer INVALID_ARGUMENT with a short message (never UNKNOWN with Python's exception text); status
details never echo long input; a temperature below the sampler's floor decodes greedily; requests over the
receive limit (sized to the context) answer RESOURCE_EXHAUSTED and the server goes on; /metrics counts every
refusal by status code."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import struct_pb2

from kakeya_runtime._proto import runtime_pb2 as pb
from kakeya_runtime._proto import runtime_pb2_grpc as pb_grpc
from kakeya_runtime.server import grpc_app
from kakeya_runtime.server.boundary import MAX_DETAILS_CHARS, details
from kakeya_runtime.server.grpc_app import REQUEST_HEADROOM_BYTES, TOKEN_ID_WIRE_BYTES, ServerThread
from kakeya_runtime.server.testing import metric_value, running_server, scrape_metrics, tiny_served
from kakeya_runtime.sessions.service import MIN_TEMPERATURE

CONTEXT = 512  # tiny_served's context
SERVICE = "/kakeya.v1.RuntimeService/"
UNARY_RPCS = ("CreateSession", "AppendTokens", "CloseSession", "GetSessionInfo", "GetModelInfo")
SESSION_RPCS = ("AppendTokens", "Generate", "CloseSession", "GetSessionInfo")  # field 1 is the session id
KEY = "boundary-key-0123456789"


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.RuntimeServiceStub:
    return pb_grpc.RuntimeServiceStub(channel)


def _raw_call(channel: grpc.Channel, rpc: str, payload: bytes, metadata=()) -> None:
    """Send `payload` as the request bytes of `rpc` (identity serializers); raises the RpcError."""
    if rpc == "Generate":
        list(channel.unary_stream(SERVICE + rpc)(payload, metadata=metadata, timeout=30))
    else:
        channel.unary_unary(SERVICE + rpc)(payload, metadata=metadata, timeout=30)


def _status(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _assert_short(error: grpc.RpcError, code: grpc.StatusCode) -> str:
    assert error.code() == code, (error.code(), error.details())
    text = error.details()
    assert len(text) <= MAX_DETAILS_CHARS
    assert "Traceback" not in text and "<class" not in text and "Unexpected" not in text
    return text


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _nested_params(depth: int) -> bytes:
    """A Struct {"a": {"a": ... {}}} `depth` Structs deep, encoded by hand (the encoder would refuse it)."""
    struct = b""
    for _ in range(depth):
        entry = _field(1, b"a") + _field(2, _field(5, struct))  # key, Value{struct_value}
        struct = _field(1, entry)  # Struct.fields
    return struct


def _history(stub, session_id: str) -> list[int]:
    return list(stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=session_id, include_history=True))
                .history_token_ids)


def _generate(stub, session_id: str, max_tokens: int, **sampling) -> list[int]:
    req = pb.GenerateRequest(session_id=session_id, max_tokens=max_tokens, ignore_eos=True,
                             sampling=pb.SamplingParams(**sampling))
    out: list[int] = []
    for msg in stub.Generate(req, timeout=60):
        if msg.HasField("tokens"):
            out.extend(msg.tokens.token_ids)
    return out


# ---- undecodable requests --------------------------------------------------------------------------------------

GARBAGE = {
    "corrupt": b"\xff\xff\xff\xff",  # field number 0 / a truncated varint
    "truncated": b"\x0a\x10ses_",  # a length prefix longer than what follows
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
@pytest.mark.parametrize("rpc", [*UNARY_RPCS, "Generate"])
def test_undecodable_bytes_are_invalid_argument(channel, rpc, kind):
    error = _status(lambda: _raw_call(channel, rpc, GARBAGE[kind]))
    assert _assert_short(error, grpc.StatusCode.INVALID_ARGUMENT).startswith(f"could not decode the {rpc} request")


@pytest.mark.parametrize("rpc", SESSION_RPCS)
def test_a_session_id_that_is_not_utf8_is_invalid_argument(channel, rpc):
    error = _status(lambda: _raw_call(channel, rpc, _field(1, b"ses_\xc3\x28\xff")))
    assert "UTF-8" in _assert_short(error, grpc.StatusCode.INVALID_ARGUMENT)


def test_params_nested_past_the_recursion_limit_are_invalid_argument(channel, stub, server):
    sessions = len(server.server.service.store)
    for depth in (40, 1000):  # 3 messages per level (Struct, map entry, Value): both pass protobuf's 100
        request = _field(2, _field(1, b"full") + _field(2, _nested_params(depth)))  # CreateSession{policy}
        error = _status(lambda request=request: _raw_call(channel, "CreateSession", request))
        assert "recursion limit" in _assert_short(error, grpc.StatusCode.INVALID_ARGUMENT)
    shallow = _field(2, _field(1, b"sink_window") + _field(2, _nested_params(3)))  # decodes; "a" is no parameter
    assert "no parameter" in _assert_short(_status(lambda: _raw_call(channel, "CreateSession", shallow)),
                                           grpc.StatusCode.INVALID_ARGUMENT)
    assert len(server.server.service.store) == sessions
    stub.GetModelInfo(pb.GetModelInfoRequest())  # the server goes on


@pytest.mark.parametrize(("params", "expect"), [
    ({"window": math.nan}, "finite"),
    ({"window": math.inf}, "finite"),
    ({"sink": -math.inf}, "finite"),
    ({"idle_q": [1.0, math.nan]}, "finite"),  # inside a list
    ({"window": {"deep": math.inf}}, "finite"),  # inside a nested Struct
    ({"window": 1e300}, "out of range"),
    ({"sink": -1e300}, "out of range"),
    ({"window": 2.0**60}, "out of range"),
    ({"window": -5}, ">= 1"),
    ({"sink": -1}, ">= 0"),
    ({"window": 2**30}, "too large"),
    ({"window": 1.5}, "integer"),
])
def test_non_finite_and_out_of_range_policy_params_are_invalid_argument(stub, server, params, expect):
    struct = struct_pb2.Struct()
    struct.update(params)
    sessions = len(server.server.service.store)
    error = _status(lambda: stub.CreateSession(pb.CreateSessionRequest(
        initial_token_ids=[1, 2], policy=pb.KvPolicy(name="sink_window", params=struct))))
    assert expect in _assert_short(error, grpc.StatusCode.INVALID_ARGUMENT)
    assert len(server.server.service.store) == sessions


@pytest.mark.parametrize(("fields", "expect"), [
    ({"sampling": {"temperature": math.inf}}, "temperature"),
    ({"sampling": {"temperature": -math.inf}}, "temperature"),
    ({"sampling": {"temperature": math.nan}}, "temperature"),
    ({"sampling": {"temperature": -1e-40}}, "temperature"),
    ({"sampling": {"temperature": 1.0, "top_p": math.inf}}, "top_p"),
    ({"sampling": {"temperature": 1.0, "top_p": -math.inf}}, "top_p"),
    ({"sampling": {"temperature": 1.0, "top_p": math.nan}}, "top_p"),
    ({"sampling": {"temperature": 1.0, "top_k": -(2**31)}}, "top_k"),
    ({"sampling": {"temperature": 1.0, "seed": 2**64 - 1}}, "seed"),
    ({"max_tokens": -(2**31)}, "max_tokens"),
    ({"max_tokens": 2**31 - 1}, "max_tokens"),
    ({"stop_token_ids": [-1]}, "vocabulary"),
])
def test_bad_generate_numbers_are_invalid_argument_and_change_nothing(stub, fields, expect):
    sid = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[5, 6, 7])).session_id
    _generate(stub, sid, 2)
    before = _history(stub, sid)
    request = pb.GenerateRequest(session_id=sid, max_tokens=fields.get("max_tokens", 4),
                                 sampling=pb.SamplingParams(**fields.get("sampling", {})),
                                 stop_token_ids=fields.get("stop_token_ids", ()))
    error = _status(lambda: list(stub.Generate(request, timeout=30)))
    assert expect in _assert_short(error, grpc.StatusCode.INVALID_ARGUMENT)
    assert _history(stub, sid) == before
    assert len(_generate(stub, sid, 2)) == 2  # still usable
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


# ---- the temperature floor -------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-300, MIN_TEMPERATURE / 2])
def test_a_temperature_below_the_floor_decodes_greedily_and_the_session_goes_on(stub, server, temperature):
    history = [(11 * i) % 200 + 3 for i in range(20)]
    tiny = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=history)).session_id
    greedy = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=history)).session_id
    got = _generate(stub, tiny, 8, temperature=temperature, seed=3)
    assert got == _generate(stub, greedy, 8)  # exactly temperature 0
    assert _history(stub, tiny) == history + got
    more = _generate(stub, tiny, 4, temperature=0.8, seed=1)  # the session goes on
    assert len(more) == 4 and _history(stub, tiny) == history + got + more
    text = scrape_metrics(server)
    assert metric_value(text, "kakeya_cache_invariant_violations_total", '{kind="inv1"}') == 0
    assert metric_value(text, "kakeya_cache_invariant_violations_total", '{kind="inv2"}') == 0
    for sid in (tiny, greedy):
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_the_floor_itself_samples(stub):
    sid = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[9, 8, 7])).session_id
    assert len(_generate(stub, sid, 4, temperature=MIN_TEMPERATURE, seed=5)) == 4
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


# ---- status details stay short ---------------------------------------------------------------------------------

@pytest.mark.parametrize("long_id", ["x" * 10_240, "é" * 10_240, "\x00\n" * 5_000], ids=["ascii", "utf8", "control"])
@pytest.mark.parametrize("rpc", SESSION_RPCS)
def test_not_found_for_a_10kb_id_is_not_found_with_short_details(stub, rpc, long_id):
    requests = {
        "AppendTokens": lambda: stub.AppendTokens(pb.AppendTokensRequest(session_id=long_id, token_ids=[1])),
        "Generate": lambda: list(stub.Generate(pb.GenerateRequest(session_id=long_id, max_tokens=1))),
        "CloseSession": lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=long_id)),
        "GetSessionInfo": lambda: stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=long_id)),
    }
    text = _assert_short(_status(requests[rpc]), grpc.StatusCode.NOT_FOUND)  # not the transport's RESOURCE_EXHAUSTED
    assert f"({len(long_id)} characters)" in text and len(text) < 200


def test_a_long_policy_name_is_invalid_argument_with_short_details(stub):
    error = _status(lambda: stub.CreateSession(pb.CreateSessionRequest(policy=pb.KvPolicy(name="p" * 20_000))))
    text = _assert_short(error, grpc.StatusCode.INVALID_ARGUMENT)
    assert "unknown KV policy" in text and "(20000 characters)" in text


def test_many_unknown_param_keys_are_clipped(stub):
    struct = struct_pb2.Struct()
    struct.update({f"key{i:05d}-" + "k" * 40: 1 for i in range(500)})
    error = _status(lambda: stub.CreateSession(pb.CreateSessionRequest(policy=pb.KvPolicy(name="full",
                                                                                          params=struct))))
    assert "no parameter" in _assert_short(error, grpc.StatusCode.INVALID_ARGUMENT)


def test_details_are_clipped_to_the_limit_saying_how_long_they_were():
    assert details("short") == "short"
    clipped = details("ü" * 100_000)
    assert len(clipped) == MAX_DETAILS_CHARS and clipped.endswith("… (100000 characters)")


# ---- the receive limit -----------------------------------------------------------------------------------------

def test_the_receive_limit_is_sized_to_the_context(server):
    assert server.server.max_request_bytes == CONTEXT * TOKEN_ID_WIRE_BYTES + REQUEST_HEADROOM_BYTES


def test_a_request_over_the_receive_limit_is_resource_exhausted_and_the_server_goes_on(stub, server):
    sid = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[1, 2, 3])).session_id
    over = server.server.max_request_bytes + 1  # ids < 128 are one byte each
    error = _status(lambda: stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[5] * over)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Under the limit but past the context: the service refuses by length before copying the ids.
    under = server.server.max_request_bytes - 1024
    error = _status(lambda: stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[5] * under)))
    assert "exceed the context length" in _assert_short(error, grpc.StatusCode.RESOURCE_EXHAUSTED)
    error = _status(lambda: stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[5] * under)))
    assert "exceeds the context length" in _assert_short(error, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert _history(stub, sid) == [1, 2, 3]
    assert stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[4])).history_length == 4
    assert len(_generate(stub, sid, 3)) == 3
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_the_receive_limit_is_configurable():
    with running_server(tiny_served(), max_request_bytes=4096) as thread, \
            grpc.insecure_channel(thread.address) as channel:
        stub = pb_grpc.RuntimeServiceStub(channel)
        sid = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[200] * 500)).session_id  # ~1 KB
        error = _status(lambda: stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[7] * 5000)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, token_ids=[7] * 10)).history_length == 510


# ---- refusals in /metrics, and bugs answer INTERNAL ------------------------------------------------------------

def test_refusals_are_counted_by_status_code_and_bugs_answer_internal():
    with running_server(tiny_served(), api_keys=(KEY,)) as thread, grpc.insecure_channel(thread.address) as channel:
        auth = (("authorization", f"Bearer {KEY}"),)
        stub = pb_grpc.RuntimeServiceStub(channel)

        def counts() -> dict[str, float]:
            text = scrape_metrics(thread)
            return {code: metric_value(text, "kakeya_rpc_errors_total", f'{{code="{code}"}}')
                    for code in ("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                 "UNAUTHENTICATED", "INTERNAL")}

        before = counts()
        assert set(before.values()) == {0.0}
        # Without a key even undecodable bytes are UNAUTHENTICATED: auth answers before anything is decoded.
        for payload in (GARBAGE["corrupt"], b""):
            error = _status(lambda payload=payload: _raw_call(channel, "GetModelInfo", payload))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        _assert_short(_status(lambda: _raw_call(channel, "Generate", GARBAGE["corrupt"], auth)),
                      grpc.StatusCode.INVALID_ARGUMENT)
        _assert_short(_status(lambda: stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id="ses_x"),
                                                          metadata=auth)), grpc.StatusCode.NOT_FOUND)
        empty = stub.CreateSession(pb.CreateSessionRequest(), metadata=auth).session_id
        _assert_short(_status(lambda: list(stub.Generate(pb.GenerateRequest(session_id=empty, max_tokens=1),
                                                         metadata=auth))), grpc.StatusCode.FAILED_PRECONDITION)
        _assert_short(_status(lambda: stub.AppendTokens(
            pb.AppendTokensRequest(session_id=empty, token_ids=[1] * (CONTEXT + 1)), metadata=auth)),
            grpc.StatusCode.RESOURCE_EXHAUSTED)

        def broken(*args, **kwargs):
            raise ZeroDivisionError("secret internals")

        thread.server.service.info = broken  # a bug in the service: INTERNAL, the type only, never the text
        error = _status(lambda: stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=empty), metadata=auth))
        text = _assert_short(error, grpc.StatusCode.INTERNAL)
        assert "ZeroDivisionError" in text and "secret" not in text

        expected = {"INVALID_ARGUMENT": 1, "NOT_FOUND": 1, "RESOURCE_EXHAUSTED": 1, "FAILED_PRECONDITION": 1,
                    "UNAUTHENTICATED": 2, "INTERNAL": 1}
        # The interceptor counts after the status went out, so the client can read /metrics a moment before the
        # last increment lands: wait briefly for it (a wrong count still fails, as does an extra one).
        deadline = time.monotonic() + 5.0
        while True:
            after = counts()
            delta = {code: after[code] - before[code] for code in after}
            if delta == expected or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert delta == expected


def test_a_servicer_that_aborts_keeps_its_status_and_is_counted(monkeypatch):
    async def deny(self, context):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")

    monkeypatch.setattr(grpc_app.RuntimeServicer, "_owner", deny)
    with running_server(tiny_served()) as thread, grpc.insecure_channel(thread.address) as channel:
        stub = pb_grpc.RuntimeServiceStub(channel)
        for call in (lambda: stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id="ses_x")),
                     lambda: list(stub.Generate(pb.GenerateRequest(session_id="ses_x", max_tokens=1)))):
            assert _assert_short(_status(call), grpc.StatusCode.PERMISSION_DENIED) == "not yours"
        assert metric_value(scrape_metrics(thread), "kakeya_rpc_errors_total", '{code="PERMISSION_DENIED"}') == 2
