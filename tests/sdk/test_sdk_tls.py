"""TLS: a server started with a certificate serves only TLS; the SDK connects with that CA (file or bytes, sync and
asyncio), a client that trusts only the system's roots is refused, and so is plaintext."""

from __future__ import annotations

import asyncio

import pytest
from kakeya import AsyncClient, Client, Unauthenticated, Unavailable

from kakeya_runtime.server.testing import running_server, self_signed_cert, tiny_served

KEY = "tls-key-0123456789"


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(cert):
    cert_path, key_path = cert
    with running_server(tiny_served(), api_keys=(KEY,), tls_cert=str(cert_path), tls_key=str(key_path)) as thread:
        yield thread


def test_the_sdk_connects_over_tls_with_the_servers_ca(tls_server, cert):
    cert_path, _ = cert
    for roots in (str(cert_path), cert_path, cert_path.read_bytes()):
        with Client(tls_server.address, api_key=KEY, root_certificates=roots, timeout=10) as client:
            assert client.model_info().vocab_size > 0
            with client.create_session(initial_tokens=[5, 6, 7]) as session:
                assert len(session.generate(max_tokens=3, ignore_eos=True).collect()) == 3
    with (Client(tls_server.address, api_key="wrong-key-0000000", root_certificates=cert_path, timeout=10) as client,
          pytest.raises(Unauthenticated)):  # TLS does not replace the key
        client.model_info()


def test_the_async_client_connects_over_tls(tls_server, cert):
    async def main() -> list[int]:
        async with AsyncClient(tls_server.address, api_key=KEY, root_certificates=cert[0], timeout=10) as client:
            session = await client.create_session(initial_tokens=[5, 6, 7])
            return [t async for t in session.generate(max_tokens=2, ignore_eos=True)]

    assert len(asyncio.run(main())) == 2


def test_plaintext_and_untrusted_clients_are_refused(tls_server):
    for kwargs in ({}, {"tls": True}):  # plaintext; TLS trusting only the system's roots (self-signed: untrusted)
        with Client(tls_server.address, api_key=KEY, timeout=5, **kwargs) as client, pytest.raises(Unavailable):
            client.model_info()
