"""The shim's ASGI app (routes, auth, the deprecation headers) and its uvicorn server on the caller's event loop.

Why starlette + uvicorn: both are small, widely deployed and actively maintained (the ASGI stack under
FastAPI), uvicorn's `Server` runs inside an event loop we already own (grpc.aio's), starlette's
StreamingResponse cancels the body iterator when the client disconnects (which cancels the engine job),
and neither pulls in a validation framework we do not need (requests are checked by hand in `parsing`, so the
errors are OpenAI's). With TLS (the gRPC server's certificate) uvicorn serves HTTPS only.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kakeya_runtime.server.auth import ApiKeyAuth
from kakeya_runtime.server.openai_shim import transport
from kakeya_runtime.server.openai_shim.errors import OpenAIError, http_error, internal
from kakeya_runtime.server.openai_shim.generation import ClientGone, SingleShot, until_disconnect
from kakeya_runtime.server.openai_shim.parsing import RequestParser, ShimRequest
from kakeya_runtime.server.openai_shim.responses import Reply, collect
from kakeya_runtime.sessions.service import SessionService
from kakeya_runtime.sessions.stops import detokenizer

if TYPE_CHECKING:
    from kakeya_runtime.server.grpc_app import ServedModel

DOCS_PATH = "/docs/session-api"
# RFC 9745 (a structured date: deprecated since 2026-01-01) and RFC 8594 (an HTTP date), on every response.
DEPRECATION_HEADERS = (
    (b"deprecation", b"@1767225600"),
    (b"sunset", b"Fri, 31 Dec 2027 23:59:59 GMT"),
    (b"link", f'<{DOCS_PATH}>; rel="deprecation"; type="text/markdown"'.encode()),
)

SESSION_API_DOCS = """\
# This HTTP API is deprecated

It is a single-shot compatibility layer: every request re-reads its whole prompt as a fresh session
that is closed when the reply ends, and it will be removed. The runtime's session API (gRPC service
`kakeya.v1.RuntimeService`, defined by `proto/kakeya/v1/runtime.proto`, at {grpc_address}) keeps the
conversation on the server, so each turn costs only its new tokens. With the Python SDK (`kakeya`):

    from kakeya import Client
    from kakeya.tokenization import Tokenizer

    with Client("{grpc_address}", api_key=YOUR_KEY) as client:  # the same key as here (none: leave it out)
        tok = Tokenizer.from_model_info(client.model_info())
        with client.create_session(initial_tokens=tok.tokens_for_chat(messages)) as session:
            reply = tok.decode(list(session.generate(max_tokens=256)))
            history = session.info(include_history=True).history_token_ids
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "..."}]
            session.append(tok.chat_delta(history, messages))  # only the new turn is prefilled
            ...
"""


class _DeprecationHeaders:
    """ASGI middleware: the deprecation headers on every HTTP response, errors and 404s included."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *DEPRECATION_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield  # `kakeya serve` owns SIGINT/SIGTERM; uvicorn must not replace the loop's handlers


class OpenAIShim:
    """The shim's ASGI app plus its uvicorn server, on the caller's event loop."""

    def __init__(self, service: SessionService, served: ServedModel, auth: ApiKeyAuth, *,
                 max_queue: int = 16, on_limit: Callable[[str], None] | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"openai_max_queue must be >= 0, got {max_queue}")
        if not served.tokenizer_json:
            raise ValueError("the OpenAI shim needs the model's tokenizer (this model was served without one)")
        try:
            from kakeya.tokenization import Tokenizer
        except ImportError as e:  # the SDK is installed beside the runtime (make setup); say so if not
            raise ValueError(f"the OpenAI shim renders prompts with the kakeya SDK's tokenizer: {e}") from None
        self.service = service
        self.auth = auth
        self.model_name = served.name
        self.tokenizer = Tokenizer(served.tokenizer_json, chat_template=served.chat_template,
                                   bos_token_id=served.bos_id, eos_token_ids=service.eos_ids)
        self.parser = RequestParser.for_context(served.name, service.context_length, self.tokenizer)
        # The service's own decoder when it has one, so the text here is the text its stop strings matched.
        detokenize = service.detokenize or detokenizer(served.tokenizer_json)
        self.single_shot = SingleShot(service, detokenize, max_queue=max_queue, on_limit=on_limit)
        self.created = int(time.time())
        self.docs = SESSION_API_DOCS.replace("{grpc_address}", "127.0.0.1:50051")
        self.port: int | None = None
        self.scheme = "http"
        self._server: _Server | None = None
        self._grace_s = 2.0  # how long in-flight requests may finish at stop (start sets it)
        self._task: asyncio.Task | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._endpoint(self._chat), methods=["POST"]),
                Route("/v1/completions", self._endpoint(self._completions), methods=["POST"]),
                Route("/v1/models", self._endpoint(self._models), methods=["GET"]),
                Route("/v1/models/{model:path}", self._endpoint(self._model), methods=["GET"]),
                Route(DOCS_PATH, self._session_docs, methods=["GET"]),
            ],
            middleware=[Middleware(_DeprecationHeaders)],
            exception_handlers={HTTPException: http_error},
        )

    @property
    def active(self) -> int:
        """Shim generations admitted and not yet finished."""
        return self.single_shot.active

    # ---- serving ---------------------------------------------------------------------------

    async def start(self, host: str, port: int, *, grace_s: float = 2.0, grpc_address: str | None = None,
                    tls: tuple[str, str] | None = None) -> int:
        """Bind host:port (0: any free port), start serving, return the port. `tls`: (certificate chain, private
        key) PEM paths: HTTPS only, as the gRPC server serves TLS only."""
        if grpc_address:
            self.docs = SESSION_API_DOCS.replace("{grpc_address}", grpc_address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host.strip("[]"), port), family=family)
        ssl = {} if tls is None else {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]}
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                http=transport.BoundedH11Protocol, ws="none", timeout_graceful_shutdown=grace_s, **ssl)
        self.scheme = "http" if tls is None else "https"
        self._grace_s = grace_s
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"the OpenAI shim on {host}:{port} stopped while starting")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """New requests get 503 at once; those in flight have the grace period to finish, then end with a 503 (an
        error body, or an error event and [DONE] on a stream), before the listener closes."""
        if self._server is None or self._task is None:
            return
        self.single_shot.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._grace_s
        while self.single_shot.active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await self.single_shot.end_all()
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._server = self._task = None

    # ---- endpoints -------------------------------------------------------------------------

    def _endpoint(self, handler: Callable[[Request, str], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Auth first, then the handler; every failure becomes an OpenAI-shaped error."""

        async def endpoint(request: Request) -> Response:
            try:
                owner = self.auth.owner([("authorization", request.headers.get("authorization", ""))])
                if owner is None:
                    raise OpenAIError(401, "Incorrect or missing API key (Authorization: Bearer <key>).",
                                      code="invalid_api_key")
                return await handler(request, owner)
            except OpenAIError as e:
                return e.response()
            except (ClientGone, ClientDisconnect):  # (the latter: gone while its body was read, or cut off for
                # sending it too slowly): not a failure of ours, and nobody reads the answer
                return Response(status_code=499)  # uvicorn just closes the connection
            except Exception:
                return internal("OpenAI shim request failed").response()

        return endpoint

    async def _session_docs(self, request: Request) -> Response:
        return PlainTextResponse(self.docs, media_type="text/markdown")

    async def _models(self, request: Request, owner: str) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request, owner: str) -> Response:
        self.parser.check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kakeya"}

    # Rendering and tokenizing a prompt (up to the body limit: ~0.6 s for 1.2 MB of text) run off the event loop,
    # which serves every other HTTP and gRPC call meanwhile.
    async def _chat(self, request: Request, owner: str) -> Response:
        body = await self.parser.json_body(request)
        return await self._respond(request, owner, await asyncio.to_thread(self.parser.chat, body))

    async def _completions(self, request: Request, owner: str) -> Response:
        body = await self.parser.json_body(request)
        return await self._respond(request, owner, await asyncio.to_thread(self.parser.completion, body))

    async def _respond(self, request: Request, owner: str, req: ShimRequest) -> Response:
        reply = Reply(req.chat, self.model_name, req.include_usage, len(req.prompt_ids))
        gen = self.single_shot.generate(owner, req)
        if not req.stream:
            text, finish = await until_disconnect(request, collect(gen))
            return JSONResponse(reply.whole(text, finish))
        # The first event before the response starts: refusals (queue full, quota, shutting down) keep their codes.
        first = await until_disconnect(request, anext(gen))
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return StreamingResponse(reply.sse(first, gen), media_type="text/event-stream", headers=headers)
