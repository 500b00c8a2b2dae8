"""Loopback by default; API keys as bearer metadata; sessions visible only to the key that made them."""

from __future__ import annotations

import asyncio

import pytest
from kakeya import AsyncClient, Client, SessionNotFound, Unauthenticated

from kakeya_runtime.server.grpc_app import InsecureBindError, RuntimeServer, ServerConfig, is_loopback
from kakeya_runtime.server.testing import running_server, self_signed_cert, tiny_served

KEY_A, KEY_B = "key-alpha-0123456789", "key-bravo-0123456789"


@pytest.fixture(scope="module")
def secured():
    with running_server(tiny_served(), api_keys=(KEY_A, KEY_B)) as thread:
        yield thread


def test_default_bind_is_loopback():
    assert ServerConfig().host == "127.0.0.1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.4")
    assert not is_loopback("example.com")


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return tuple(str(p) for p in self_signed_cert(tmp_path_factory.mktemp("tls")))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "myhost"])
def test_non_loopback_bind_requires_an_api_key_and_tls_or_an_acknowledgement(host, cert):
    with pytest.raises(InsecureBindError, match="API key"):
        RuntimeServer(tiny_served(), ServerConfig(host=host, port=0))
    with pytest.raises(InsecureBindError, match="without TLS"):
        RuntimeServer(tiny_served(), ServerConfig(host=host, port=0, api_keys=(KEY_A,)))
    with pytest.raises(InsecureBindError, match="API key"):  # TLS alone does not authenticate anyone
        RuntimeServer(tiny_served(), ServerConfig(host=host, port=0, tls_cert=cert[0], tls_key=cert[1]))
    RuntimeServer(tiny_served(), ServerConfig(host=host, port=0, api_keys=(KEY_A,), insecure=True))  # acknowledged
    RuntimeServer(tiny_served(), ServerConfig(host=host, port=0, api_keys=(KEY_A,), tls_cert=cert[0], tls_key=cert[1]))


def test_tls_needs_a_certificate_and_its_key(cert, tmp_path):
    for paths in ({"tls_cert": cert[0]}, {"tls_key": cert[1]}):
        with pytest.raises(ValueError, match="both a certificate"):
            ServerConfig(**paths).validate()
    with pytest.raises(ValueError, match="not a readable file"):
        ServerConfig(tls_cert=str(tmp_path / "missing.crt"), tls_key=cert[1]).validate()


def test_missing_or_wrong_key_is_unauthenticated(secured):
    for key in (None, "wrong-key-000000", KEY_A + "x"):
        with Client(secured.address, api_key=key) as client:
            with pytest.raises(Unauthenticated):
                client.model_info()
            with pytest.raises(Unauthenticated):
                client.create_session(initial_tokens=[1])
            with pytest.raises(Unauthenticated):
                client.session("ses_x").generate(max_tokens=2).collect()
            with pytest.raises(Unauthenticated):  # the client-streaming call too (it answered UNKNOWN)
                client.import_session(b"KAKEYA-SESSION\x00\x01")
    with Client(secured.address, api_key=KEY_A) as client:
        assert client.model_info().vocab_size > 0


def test_sessions_are_private_to_their_key(secured):
    with Client(secured.address, api_key=KEY_A) as a, Client(secured.address, api_key=KEY_B) as b:
        mine = a.create_session(initial_tokens=[3, 4, 5])
        theirs = b.session(mine.id)
        for call in (theirs.info, lambda: theirs.append([1]), lambda: theirs.generate(max_tokens=1).collect(),
                     theirs.close):
            with pytest.raises(SessionNotFound):
                call()
        # Nothing the other key did touched the session.
        info = mine.info()
        assert info.history_length == 3 and info.generate_calls == 0
        mine.close()
        with pytest.raises(SessionNotFound, match="not found"):  # foreign: no hint that it ever existed
            theirs.info()


def test_async_client_sends_the_key(secured):
    async def main():
        async with AsyncClient(secured.address, api_key=KEY_B) as client:
            s = await client.create_session(initial_tokens=[7])
            assert (await s.info()).history_length == 1
            await s.close()
        async with AsyncClient(secured.address) as anonymous:
            with pytest.raises(Unauthenticated):
                await anonymous.model_info()

    asyncio.run(main())


@pytest.mark.parametrize("tls", [False, True])
def test_a_connection_that_never_handshakes_is_closed(tls, cert, monkeypatch):
    """A TCP connection that sends nothing was held for gRPC's default 60 s, so a few thousand of them took the
    server to its file-descriptor limit. The TLS and HTTP/2 handshake must now finish within HANDSHAKE_S."""
    import socket
    import time

    from kakeya_runtime.server import grpc_app

    monkeypatch.setattr(grpc_app, "HANDSHAKE_S", 1.0)
    extra = {"tls_cert": str(cert[0]), "tls_key": str(cert[1])} if tls else {}
    with running_server(tiny_served(), **extra) as thread:
        host, port = thread.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as conn:
            conn.settimeout(20)
            started = time.monotonic()
            while conn.recv(4096):  # plaintext: the server's SETTINGS, then its GOAWAY; TLS: nothing
                pass
            assert time.monotonic() - started < 10


def test_a_connection_idle_after_its_handshake_is_closed_and_a_client_reconnects(monkeypatch):
    """A connection that finished its HTTP/2 handshake (42 bytes, no key needed) and then sent nothing was held for
    ever: 200 of them held 200 descriptors. One with no call in progress is now closed after IDLE_CONNECTION_S, and a
    client whose connection was closed so reconnects at its next call."""
    import socket
    import time

    from kakeya_runtime.server import grpc_app

    monkeypatch.setattr(grpc_app, "IDLE_CONNECTION_S", 1.0)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings, ack = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00", b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        host, port = thread.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(preface + settings + ack)
            conn.settimeout(20)
            started = time.monotonic()
            while conn.recv(4096):  # the server's SETTINGS and ACK, then its GOAWAY, then the close
                pass
            assert time.monotonic() - started < 10
        s = client.create_session([5, 6, 7])
        time.sleep(2.5)  # the client's connection is closed as idle meanwhile
        assert len(s.generate(max_tokens=3, ignore_eos=True).collect()) == 3
