"""Fixtures: real in-process gRPC servers (port 0) on tiny random-config models, and SDK clients."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kakeya_runtime import protogen

protogen.ensure()  # stubs are build outputs; regenerate if the proto changed

from kakeya import Client  # noqa: E402

from kakeya_runtime.server.grpc_app import ServerThread  # noqa: E402
from kakeya_runtime.server.testing import running_server, tiny_served  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_model: loads a bundled real model (slow; -m 'not real_model' skips)")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """One shared server per test module (tests that count metrics start their own)."""
    with running_server(tiny_served("llama")) as thread:
        yield thread


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.address) as c:
        yield c
