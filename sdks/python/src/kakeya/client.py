"""Synchronous client: `Client` -> `Session` -> `Generation` (iterate for token ids as they commit)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from kakeya import _convert as cv
from kakeya._channel import ChannelOwner, RootCertificates, open_channel
from kakeya._proto import runtime_pb2 as pb
from kakeya._proto import runtime_pb2_grpc as pb_grpc
from kakeya.errors import KakeyaError, SessionNotFound, from_rpc_error
from kakeya.types import (
    FinishReason,
    GenerateResult,
    GenerateStats,
    KvPolicy,
    ModelInfo,
    SessionInfo,
    Speculation,
)

if TYPE_CHECKING:
    from kakeya.tokenization import Tokenizer


class Client(ChannelOwner):
    """A connection to one runtime. `api_key` is sent as `authorization: Bearer <key>`.

    TLS: `tls=True` trusts the system's root certificates; `root_certificates` (PEM bytes, or the path of a PEM
    file, e.g. a self-signed server's certificate) trusts that CA instead and implies TLS. Without either the
    channel is plaintext (fine on loopback; elsewhere the key would cross the network in clear).
    """

    def __init__(self, addr: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 timeout: float | None = None, options: list[tuple[str, Any]] | None = None, tls: bool = False,
                 root_certificates: RootCertificates | None = None) -> None:
        self.addr = addr
        self.timeout = timeout  # per call, exports and imports whole; Generate streams are not time-limited
        self._metadata = cv.auth_metadata(api_key)
        self._channel = open_channel(addr, tls=tls, root_certificates=root_certificates, options=options)
        self._stub = pb_grpc.RuntimeServiceStub(self._channel)
        self._model_info: ModelInfo | None = None
        self._closed = False

    def _unary(self, method: Any, request: Any) -> Any:
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def model_info(self, *, refresh: bool = False) -> ModelInfo:
        """Vocab, EOS/BOS, context length, tokenizer.json and chat template (cached after the first call)."""
        if self._model_info is None or refresh:
            self._model_info = cv.model_info_from_pb(self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest()))
        return self._model_info

    def tokenizer(self) -> Tokenizer:
        """A local tokenizer built from GetModelInfo (needs the `tokenize` extra)."""
        from kakeya.tokenization import Tokenizer

        return Tokenizer.from_model_info(self.model_info())

    def create_session(self, initial_tokens: Iterable[int] | None = None,
                       policy: KvPolicy | str | None = None,
                       speculation: Speculation | str | None = None) -> Session:
        resp = self._unary(self.stub.CreateSession, cv.create_request(initial_tokens, policy, speculation))
        return Session(self, resp.session_id, history_length=resp.history_length,
                       policy=cv.policy_from_pb(resp.policy))

    def session(self, session_id: str) -> Session:
        """A handle on an existing session id (no RPC; the first call tells whether it exists)."""
        return Session(self, cv.session_id(session_id))

    def import_session(self, archive: bytes | str | os.PathLike[str], *, load_kv: bool = True) -> Session:
        """A new session (a new id, owned by this client's key) from an archive `Session.export` made, as bytes
        or a file path, on this server or another serving the same model. A KV snapshot in the archive is
        checked against the history it records and loaded (`session.kv_loaded`); a mismatching one raises
        InvalidArgument and creates nothing. Its values are trusted: `load_kv=False` for an archive from a source
        you do not trust (the server recomputes the cache from the history)."""
        data = cv.archive_bytes(archive)
        chunks = cv.archive_chunks(data, load_kv)
        try:
            resp = self.stub.ImportSession(chunks, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        session = Session(self, resp.session_id, history_length=resp.history_length,
                          policy=cv.policy_from_pb(resp.policy))
        session.kv_loaded = resp.kv_loaded
        return session

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """A server-owned session: append raw token ids, generate, inspect, close."""

    def __init__(self, client: Client, session_id: str, *, history_length: int | None = None,
                 policy: KvPolicy | None = None) -> None:
        self.client = client
        self.id = session_id
        self.history_length = history_length  # as of the last call that reported it
        self.policy = policy
        # the result of the last Generate that finished; None while one runs, and after one was cancelled or failed
        self.last_result: GenerateResult | None = None
        self.kv_loaded = False  # imported with a KV snapshot that the server verified and loaded
        self._closed = False

    def append(self, token_ids: Iterable[int]) -> int:
        """Append raw token ids; returns the new history length."""
        req = pb.AppendTokensRequest(session_id=self.id, token_ids=cv.token_list(token_ids, "token_ids"))
        self.history_length = self.client._unary(self.client.stub.AppendTokens, req).history_length
        return self.history_length

    def generate(self, max_tokens: int = 256, *, seed: int | None = None, temperature: float = 0.0,
                 top_k: int = 0, top_p: float | None = None, stop_tokens: Iterable[int] = (),
                 ignore_eos: bool = False, stop: str | Iterable[str] | None = (),
                 speculation: Speculation | str | None = None) -> Generation:
        """Start a Generate; iterate the result for token ids. Breaking out early cancels it.

        `temperature` 0 (the default) is greedy; otherwise it must be in (0, 100], and temperatures below
        1e-4 (the server's sampling floor) decode greedily too, exactly as 0 does (the seed is then unused).
        `top_k` 0 keeps the whole vocabulary, `top_p` is a nucleus mass in (0, 1], and a `seed` in
        [0, 2**63) makes sampling reproducible. `stop_tokens` stop on top of the model's EOS ids (unless
        `ignore_eos`). `speculation` ("history", "off" or a `Speculation`) overrides the session's default
        for this call; it changes speed, never the output's distribution (a seeded stream repeats with the same
        speculation setting). Bad values raise InvalidArgument and leave the session unchanged.

        `stop` (a string or several, at most 16 of 1 to 256 characters) ends the generation right after the token
        whose text completes one of them (`finish_reason` STOP, `result.stop_string` says which). Nothing is
        trimmed: those tokens are yielded and stay in the session history, which the next Generate continues from;
        `result.text_before_stop(tokenizer.decode(gen.token_ids))` gives the text before the stop string.
        """
        req = cv.generate_request(self.id, max_tokens=max_tokens, seed=seed, temperature=temperature, top_k=top_k,
                                  top_p=top_p, stop_tokens=stop_tokens, ignore_eos=ignore_eos, stop=stop,
                                  speculation=speculation)
        call = self.client.stub.Generate(req, metadata=self.client._metadata)
        self.last_result = None
        return Generation(self, call)

    def info(self, *, include_history: bool = False) -> SessionInfo:
        req = pb.GetSessionInfoRequest(session_id=self.id,
                                       include_history=cv.flag(include_history, "include_history"))
        info = cv.session_info_from_pb(self.client._unary(self.client.stub.GetSessionInfo, req), include_history)
        self.history_length = info.history_length
        return info

    def export(self, path: str | os.PathLike[str] | None = None, *, include_kv: bool = False) -> bytes:
        """The session as an archive (policy, context, whole history; with `include_kv` a snapshot of its KV cache,
        so an importer need not recompute it), also written to `path` when given. `Client.import_session` takes
        it back, on any server of the same model."""
        req = pb.ExportSessionRequest(session_id=self.id, include_kv=cv.flag(include_kv, "include_kv"))
        try:
            data = b"".join(c.data for c in self.client.stub.ExportSession(req, metadata=self.client._metadata,
                                                                            timeout=self.client.timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        cv.save_archive(data, path)
        return data

    def close(self) -> None:
        """Free the session (idempotent on this handle)."""
        if self._closed:
            return
        self.client._unary(self.client.stub.CloseSession, pb.CloseSessionRequest(session_id=self.id))
        self._closed = True

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(SessionNotFound):  # already evicted or failed: nothing left to free
            self.close()

    def __repr__(self) -> str:
        return f"Session({self.id!r})"


class Generation:
    """A running Generate. Iterate once for token ids; then `result` / `stats` / `finish_reason`."""

    def __init__(self, session: Session, call: Any) -> None:
        self.session = session
        self._call = call
        self.token_ids: list[int] = []
        self.result: GenerateResult | None = None
        self._iterated = False
        self._cancelled = False

    @property
    def stats(self) -> GenerateStats | None:
        return None if self.result is None else self.result.stats

    @property
    def finish_reason(self) -> FinishReason | None:
        return None if self.result is None else self.result.finish_reason

    def __iter__(self) -> Iterator[int]:
        if self._iterated:
            raise RuntimeError("a Generation can be iterated only once (see .token_ids)")
        self._iterated = True
        return self._events()

    def _events(self) -> Iterator[int]:
        try:
            for msg in self._call:
                if msg.HasField("tokens"):
                    for t in msg.tokens.token_ids:
                        self.token_ids.append(t)
                        yield t
                elif msg.HasField("done"):
                    self.result = cv.result_from_pb(msg.done, self.token_ids)
                    self.session.last_result = self.result
                    self.session.history_length = self.result.history_length
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise from_rpc_error(e) from None
        finally:
            if self.result is None:
                self.cancel()  # the caller left early (break, exception): stop the server's work

    def collect(self) -> list[int]:
        """Run to the end; returns every generated token id."""
        for _ in self:
            pass
        return self.token_ids

    def cancel(self) -> None:
        """Stop generating. Tokens already committed stay in the session history (see Session.info)."""
        if self.result is None and not self._cancelled:
            self._cancelled = True
            self._call.cancel()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


__all__ = ["Client", "Generation", "KakeyaError", "Session"]
