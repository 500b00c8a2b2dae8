"""The gRPC channel both clients open: plaintext, or TLS with a given CA or the system's root certificates."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc

from kakeya import _convert as cv

RootCertificates = bytes | str | os.PathLike[str]


def credentials(tls: bool, root_certificates: RootCertificates | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting `root_certificates` (PEM bytes, or the path of a PEM file) or, with `tls` alone,
    the system's root certificates; None for a plaintext channel."""
    if root_certificates is None:
        return grpc.ssl_channel_credentials() if tls else None
    pem = root_certificates if isinstance(root_certificates, bytes) else Path(root_certificates).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=pem)


def open_channel(addr: str, *, tls: bool, root_certificates: RootCertificates | None,
                 options: list[tuple[str, Any]] | None, aio: bool = False) -> Any:
    """A grpc (or grpc.aio) channel to `addr`, secure when `tls` or `root_certificates` is given."""
    opts = cv.CHANNEL_OPTIONS + list(options or ())
    creds = credentials(tls, root_certificates)
    module = grpc.aio if aio else grpc
    if creds is None:
        return module.insecure_channel(addr, options=opts)
    return module.secure_channel(addr, creds, options=opts)


class ChannelOwner:
    """What both clients expose of their channel: the generated stub (refused once the client is closed, instead of
    gRPC's own ValueError or UsageError) and the metadata every call sends (the API key)."""

    _stub: Any
    _metadata: tuple[tuple[str, str], ...]
    _closed: bool

    @property
    def stub(self) -> Any:
        """The generated gRPC stub on this client's channel (pass `metadata=client.metadata` for the key)."""
        if self._closed:
            from kakeya.errors import FailedPrecondition

            raise FailedPrecondition("this client is closed")
        return self._stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata
