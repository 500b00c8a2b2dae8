"""The SDK is tested against a real in-process runtime (tiny random-config model, port 0)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kakeya_runtime import protogen

protogen.ensure()

from kakeya import Client  # noqa: E402

from kakeya_runtime.server.grpc_app import ServerThread  # noqa: E402
from kakeya_runtime.server.testing import running_server, tiny_served  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with running_server(tiny_served("llama")) as thread:
        yield thread


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.address) as c:
        yield c
