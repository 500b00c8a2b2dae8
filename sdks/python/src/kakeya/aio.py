"""asyncio client (grpc.aio) with the same surface as the synchronous one."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Coroutine, Generator, Iterable
from typing import TYPE_CHECKING, Any

import grpc

from kakeya import _convert as cv
from kakeya._channel import ChannelOwner, RootCertificates, open_channel
from kakeya._proto import runtime_pb2 as pb
from kakeya._proto import runtime_pb2_grpc as pb_grpc
from kakeya.errors import Cancelled, SessionNotFound, from_rpc_error
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


ORPHAN_CLOSE_S = 5.0  # close() waits at most this long for cancelled creates to answer and their sessions to close


class AsyncClient(ChannelOwner):
    """A connection to one runtime (as `Client`: `api_key`, `tls`, `root_certificates`)."""

    def __init__(self, addr: str = "127.0.0.1:50051", *, api_key: str | None = None,
                 timeout: float | None = None, options: list[tuple[str, Any]] | None = None, tls: bool = False,
                 root_certificates: RootCertificates | None = None) -> None:
        self.addr = addr
        self.timeout = timeout
        self._metadata = cv.auth_metadata(api_key)
        self._channel = open_channel(addr, tls=tls, root_certificates=root_certificates, options=options, aio=True)
        self._stub = pb_grpc.RuntimeServiceStub(self._channel)
        self._model_info: ModelInfo | None = None
        self._closed = False
        self._orphans: set[asyncio.Future] = set()  # creates whose caller cancelled, until their session is closed

    async def _unary(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def _making_session(self, call: Coroutine[Any, Any, Any]) -> Any:
        """A call that makes a session, its id in the answer. Cancelled by its caller, it is not cancelled itself: the
        server may have made the session already, and nobody would learn its id (it would hold the key's quota, and
        evict its real sessions, until its TTL). It finishes in the background and the session it made is closed."""
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._orphans.add(task)
            task.add_done_callback(self._close_orphan)
            raise

    def _close_orphan(self, task: asyncio.Future) -> None:
        self._orphans.discard(task)
        if task.cancelled() or task.exception() is not None:
            return
        closing = asyncio.ensure_future(self._unary(self._stub.CloseSession,  # (also while close() waits)
                                                    pb.CloseSessionRequest(session_id=task.result().session_id)))
        self._orphans.add(closing)
        closing.add_done_callback(lambda t: (self._orphans.discard(t), t.cancelled() or t.exception()))

    async def model_info(self, *, refresh: bool = False) -> ModelInfo:
        if self._model_info is None or refresh:
            resp = await self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest())
            self._model_info = cv.model_info_from_pb(resp)
        return self._model_info

    async def tokenizer(self) -> Tokenizer:
        from kakeya.tokenization import Tokenizer

        return Tokenizer.from_model_info(await self.model_info())

    def create_session(self, initial_tokens: Iterable[int] | None = None,
                       policy: KvPolicy | str | None = None,
                       speculation: Speculation | str | None = None) -> SessionCreation:
        """`async with client.create_session(...) as session:` (closed at the end, as with `Client`), or
        `session = await client.create_session(...)`."""
        request = cv.create_request(initial_tokens, policy, speculation)  # argument errors raise here, as in the sync client
        return SessionCreation(self, request)

    async def _create_session(self, request: Any) -> AsyncSession:
        resp = await self._making_session(self._unary(self.stub.CreateSession, request))
        return AsyncSession(self, resp.session_id, history_length=resp.history_length,
                            policy=cv.policy_from_pb(resp.policy))

    def session(self, session_id: str) -> AsyncSession:
        return AsyncSession(self, cv.session_id(session_id))

    async def import_session(self, archive: bytes | str | os.PathLike[str], *, load_kv: bool = True) -> AsyncSession:
        """As `Client.import_session`."""
        data = cv.archive_bytes(archive)
        chunks = cv.archive_chunks(data, load_kv)
        resp = await self._making_session(self._unary(self.stub.ImportSession, chunks))
        session = AsyncSession(self, resp.session_id, history_length=resp.history_length,
                               policy=cv.policy_from_pb(resp.policy))
        session.kv_loaded = resp.kv_loaded
        return session

    async def close(self) -> None:
        self._closed = True
        # cancelled creates still running, and the closes of what they made: the channel stays until they end
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ORPHAN_CLOSE_S
        while self._orphans and loop.time() < deadline:
            await asyncio.wait(list(self._orphans), timeout=max(0.0, deadline - loop.time()))
            await asyncio.sleep(0)  # their done callbacks run: a finished create starts its close
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SessionCreation(Coroutine[Any, Any, "AsyncSession"]):
    """What `AsyncClient.create_session` returns: a coroutine (await it, or hand it to `asyncio.create_task`, for
    the session) and an async context manager (creates the session on entry, closes it on exit)."""

    def __init__(self, client: AsyncClient, request: Any) -> None:
        self._client = client
        self._request = request
        self._session: AsyncSession | None = None
        self._coro: Coroutine[Any, Any, AsyncSession] | None = None  # made when first run: `async with` never is

    def _run(self) -> Coroutine[Any, Any, AsyncSession]:
        if self._coro is None:
            self._coro = self._client._create_session(self._request)
        return self._coro

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._run().__await__()

    def send(self, value: Any) -> Any:
        return self._run().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        return self._run().throw(typ, val, tb) if val is not None or tb is not None else self._run().throw(typ)

    def close(self) -> None:
        if self._coro is not None:
            self._coro.close()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._client._create_session(self._request)
        return self._session

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.__aexit__(*exc)


class AsyncSession:
    def __init__(self, client: AsyncClient, session_id: str, *, history_length: int | None = None,
                 policy: KvPolicy | None = None) -> None:
        self.client = client
        self.id = session_id
        self.history_length = history_length
        self.policy = policy
        # the result of the last Generate that finished; None while one runs, and after one was cancelled or failed
        self.last_result: GenerateResult | None = None
        self.kv_loaded = False  # imported with a KV snapshot that the server verified and loaded
        self._closed = False

    async def append(self, token_ids: Iterable[int]) -> int:
        req = pb.AppendTokensRequest(session_id=self.id, token_ids=cv.token_list(token_ids, "token_ids"))
        self.history_length = (await self.client._unary(self.client.stub.AppendTokens, req)).history_length
        return self.history_length

    def generate(self, max_tokens: int = 256, *, seed: int | None = None, temperature: float = 0.0,
                 top_k: int = 0, top_p: float | None = None, stop_tokens: Iterable[int] = (),
                 ignore_eos: bool = False, stop: str | Iterable[str] | None = (),
                 speculation: Speculation | str | None = None) -> AsyncGeneration:
        """`async for token_id in session.generate(...)`; use `async with` to cancel on early exit.

        Parameters as in the sync `Session.generate`: temperatures below 1e-4 (the server's sampling floor)
        decode greedily, exactly as 0 does.
        """
        req = cv.generate_request(self.id, max_tokens=max_tokens, seed=seed, temperature=temperature, top_k=top_k,
                                  top_p=top_p, stop_tokens=stop_tokens, ignore_eos=ignore_eos, stop=stop,
                                  speculation=speculation)
        call = self.client.stub.Generate(req, metadata=self.client._metadata)
        self.last_result = None
        return AsyncGeneration(self, call)

    async def info(self, *, include_history: bool = False) -> SessionInfo:
        req = pb.GetSessionInfoRequest(session_id=self.id,
                                       include_history=cv.flag(include_history, "include_history"))
        resp = await self.client._unary(self.client.stub.GetSessionInfo, req)
        info = cv.session_info_from_pb(resp, include_history)
        self.history_length = info.history_length
        return info

    async def export(self, path: str | os.PathLike[str] | None = None, *, include_kv: bool = False) -> bytes:
        """As `Session.export`."""
        req = pb.ExportSessionRequest(session_id=self.id, include_kv=cv.flag(include_kv, "include_kv"))
        try:
            chunks = [c.data async for c in self.client.stub.ExportSession(req, metadata=self.client._metadata,
                                                                           timeout=self.client.timeout)]
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        data = b"".join(chunks)
        cv.save_archive(data, path)
        return data

    async def close(self) -> None:
        if self._closed:
            return
        await self.client._unary(self.client.stub.CloseSession, pb.CloseSessionRequest(session_id=self.id))
        self._closed = True

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(SessionNotFound):  # already evicted or failed: nothing left to free
            await self.close()

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"


class AsyncGeneration:
    def __init__(self, session: AsyncSession, call: Any) -> None:
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

    def __aiter__(self) -> AsyncIterator[int]:
        if self._iterated:
            raise RuntimeError("an AsyncGeneration can be iterated only once (see .token_ids)")
        self._iterated = True
        return self._events()

    async def _events(self) -> AsyncIterator[int]:
        try:
            async for msg in self._call:
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
        except asyncio.CancelledError:
            if self.session.client._closed and not self._cancelled:
                raise Cancelled("the client was closed during the generation") from None  # as the sync client says
            if not self._cancelled:
                raise  # our task was cancelled, not the call
        finally:
            if self.result is None:
                self.cancel()

    async def collect(self) -> list[int]:
        async for _ in self:
            pass
        return self.token_ids

    def cancel(self) -> None:
        if self.result is None and not self._cancelled:
            self._cancelled = True
            self._call.cancel()

    def __del__(self) -> None:
        # Dropped before its end (never iterated, say): stop the server's work, as the sync Generation does. grpc.aio
        # keeps the call alive on its own, so without this the server generated every token for nobody.
        if getattr(self, "_call", None) is not None and self.result is None and not self._cancelled:
            with contextlib.suppress(Exception):  # the loop may be closed by now: nothing left to stop
                self._call.cancel()

    async def __aenter__(self) -> AsyncGeneration:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()
