"""The deprecated OpenAI-style HTTP+SSE shim: single-shot sessions for clients that only speak OpenAI's API.

`kakeya serve --openai-port N` serves `POST /v1/chat/completions`, `POST /v1/completions` and
`GET /v1/models` on the gRPC server's host, in the same process and on the same event loop: each request
is one session of the session service (create with the prompt, generate, close), so it shares the engine
scheduler, the API keys (as `Authorization: Bearer`) and the session metrics with gRPC. It never
reaches the session features (append, raw-token history, KV policies): every response says so with
`Deprecation` and `Sunset` headers and a `Link` to /docs/session-api, which explains the way over.

Chat messages are rendered with the model's template by the SDK's `Tokenizer` (the same renderer a
client uses before CreateSession), so the session layer itself stays template-free. Stop strings are
matched on the decoded text, held back while they may still be starting, and trimmed.

Why starlette + uvicorn: both are small, widely deployed and actively maintained (the ASGI stack under
FastAPI), uvicorn's `Server` runs inside an event loop we already own (grpc.aio's), starlette's
StreamingResponse cancels the body iterator when the client disconnects (which cancels the engine job),
and neither pulls in a validation framework we do not need (requests are checked here, by hand, so the
errors are OpenAI's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kakeya_runtime.engine.generate import FinishReason
from kakeya_runtime.server.auth import ApiKeyAuth
from kakeya_runtime.sessions.errors import ErrorKind, InvariantViolation, SessionError
from kakeya_runtime.sessions.service import DoneEvent, GenerateParams, SessionService

if TYPE_CHECKING:
    from kakeya_runtime.server.grpc_app import ServedModel

_log = logging.getLogger(__name__)

DOCS_PATH = "/docs/session-api"
# RFC 9745 (a structured date: deprecated since 2026-01-01) and RFC 8594 (an HTTP date), on every response.
DEPRECATION_HEADERS = (
    (b"deprecation", b"@1767225600"),
    (b"sunset", b"Fri, 31 Dec 2027 23:59:59 GMT"),
    (b"link", f'<{DOCS_PATH}>; rel="deprecation"; type="text/markdown"'.encode()),
)
MAX_STOP_STRINGS = 4  # as OpenAI
BODY_HEADROOM_BYTES = 1024 * 1024
BODY_BYTES_PER_TOKEN = 32  # generous: JSON-escaped text runs a few bytes per token
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}
_ROLES = ("system", "developer", "user", "assistant", "tool")

SESSION_API_DOCS = """\
# This HTTP API is deprecated

It is a single-shot compatibility layer: every request re-reads its whole prompt as a fresh session
that is closed when the reply ends, and it will be removed. The runtime's session API (gRPC service
`kakeya.v1.RuntimeService`, defined by `proto/kakeya/v1/runtime.proto`, at {grpc_address}) keeps the
conversation on the server, so each turn costs only its new tokens. With the Python SDK (`kakeya`):

    from kakeya import Client
    from kakeya.tokenization import Tokenizer

    with Client("{grpc_address}") as client:
        tok = Tokenizer.from_model_info(client.model_info())
        with client.create_session(initial_tokens=tok.tokens_for_chat(messages)) as session:
            reply = tok.decode(list(session.generate(max_tokens=256)))
            history = session.info(include_history=True).history_token_ids
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "..."}]
            session.append(tok.chat_delta(history, messages))  # only the new turn is prefilled
            ...
"""


class OpenAIError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


class _ClientGone(Exception):
    """The client disconnected before the reply was ready."""


@dataclass(slots=True)
class _Request:
    chat: bool
    prompt_ids: list[int]
    params: GenerateParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


@dataclass(slots=True, frozen=True)
class _Finish:
    reason: str
    completion_tokens: int


@dataclass(slots=True)
class StopMatcher:
    """Text-level stop strings: emits what can no longer start a stop string, trims the first match."""

    stops: tuple[str, ...]
    held: str = ""
    stopped: bool = False

    def push(self, piece: str) -> str:
        """The text safe to emit after `piece`; sets `stopped` (and drops the rest) on a match."""
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[:min(hits)]
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


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
                 max_queue: int = 16) -> None:
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
        self.max_queue = max_queue
        self.max_body_bytes = BODY_HEADROOM_BYTES + BODY_BYTES_PER_TOKEN * service.context_length
        self.created = int(time.time())
        self.docs = SESSION_API_DOCS.replace("{grpc_address}", "127.0.0.1:50051")
        self.active = 0  # shim generations admitted and not yet finished
        self.port: int | None = None
        self._server: _Server | None = None
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
            exception_handlers={HTTPException: _http_error},
        )

    # ---- serving ---------------------------------------------------------------------------

    async def start(self, host: str, port: int, *, grace_s: float = 2.0, grpc_address: str | None = None) -> int:
        """Bind host:port (0: any free port), start serving, return the port."""
        if grpc_address:
            self.docs = SESSION_API_DOCS.replace("{grpc_address}", grpc_address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host.strip("[]"), port), family=family)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", http="h11",
                                ws="none", timeout_graceful_shutdown=grace_s)
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
        if self._server is None or self._task is None:
            return
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
            except _ClientGone:
                return Response(status_code=499)  # nobody reads it; uvicorn just closes the connection
            except Exception:
                bug = uuid.uuid4()
                _log.exception("OpenAI shim request failed (bug id %s)", bug)
                return OpenAIError(500, f"internal error; bug id {bug}", type="server_error",
                                   code="internal_error").response()

        return endpoint

    async def _session_docs(self, request: Request) -> Response:
        return PlainTextResponse(self.docs, media_type="text/markdown")

    async def _models(self, request: Request, owner: str) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request, owner: str) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kakeya"}

    async def _chat(self, request: Request, owner: str) -> Response:
        body = await self._json_body(request)
        messages = _chat_messages(body.get("messages"))
        if not self.tokenizer.has_chat_template:
            raise _bad(f"model {self.model_name!r} has no chat template: use /v1/completions", "messages")
        from kakeya.tokenization import ChatTemplateError

        try:
            ids = self.tokenizer.tokens_for_chat(messages)
        except ChatTemplateError as e:
            raise _bad(f"the chat template refused the messages: {e}", "messages") from None
        return await self._respond(request, owner, self._parse(body, ids, chat=True))

    async def _completions(self, request: Request, owner: str) -> Response:
        body = await self._json_body(request)
        for name, default in (("echo", False), ("best_of", 1), ("suffix", None), ("logprobs", None)):
            if body.get(name) not in (default, None):
                raise _bad(f"{name} is not supported by this server", name, "unsupported_parameter")
        return await self._respond(request, owner, self._parse(body, self._prompt_ids(body.get("prompt")), chat=False))

    # ---- requests --------------------------------------------------------------------------

    async def _json_body(self, request: Request) -> dict[str, Any]:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _bad("We could not parse the JSON body of your request.") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        self._check_model(body.get("model"))
        return body

    def _check_model(self, model: Any) -> None:
        if not isinstance(model, str) or not model:
            raise _bad("you must provide a model parameter", "model")
        if model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                              param="model", code="model_not_found")

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            ids = list(prompt)  # token ids; the session service checks their range
        else:
            raise _bad("prompt must be a string, a list of token ids, or a list of one of them (n=1 only)",
                       "prompt")
        if not ids:
            raise _bad("the prompt is empty", "prompt")
        return ids

    def _parse(self, body: dict[str, Any], ids: list[int], *, chat: bool) -> _Request:
        n = body.get("n")
        if n is not None and (not _is_int(n) or n != 1):
            raise _bad("only n=1 is supported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if body.get(name) not in (None, 0, 0.0):
                raise _bad(f"{name} is not supported by this server", name, "unsupported_parameter")
        if body.get("logit_bias"):
            raise _bad("logit_bias is not supported by this server", "logit_bias", "unsupported_parameter")
        if chat:
            if body.get("logprobs") or body.get("top_logprobs"):
                raise _bad("logprobs are not supported by this server", "logprobs", "unsupported_parameter")
            if body.get("tools") or body.get("functions"):
                raise _bad("tools are not supported by this server", "tools", "unsupported_parameter")
            fmt = body.get("response_format")
            if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
                raise _bad("only response_format {\"type\": \"text\"} is supported", "response_format")
        stream = _bool(body, "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        if options and not stream:
            raise _bad("stream_options is only allowed with stream=true", "stream_options")
        include_usage = _bool(options or {}, "include_usage", "stream_options.include_usage")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0.0:
            raise _bad("top_p must be in (0, 1]", "top_p")
        seed = body.get("seed")
        if seed is not None and not _is_int(seed):
            raise _bad("seed must be an integer", "seed")
        context = self.service.context_length
        if len(ids) >= context:
            raise _bad(f"This model's maximum context length is {context} tokens. However, your "
                       f"{'messages' if chat else 'prompt'} resulted in {len(ids)} tokens.",
                       "messages" if chat else "prompt", "context_length_exceeded")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(name)
        if max_tokens is None:
            max_tokens = context - len(ids)
        elif not _is_int(max_tokens) or max_tokens < 1:
            raise _bad(f"{name} must be a positive integer", name)
        elif len(ids) + max_tokens > context:
            raise _bad(f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{len(ids) + max_tokens} tokens ({len(ids)} in the {'messages' if chat else 'prompt'}, "
                       f"{max_tokens} in the completion).", name, "context_length_exceeded")
        params = GenerateParams(max_tokens=max_tokens, temperature=temperature,
                                top_p=None if top_p >= 1.0 else top_p, seed=seed)
        return _Request(chat, ids, params, _stop_strings(body.get("stop")), stream, include_usage)

    # ---- generation ------------------------------------------------------------------------

    async def _respond(self, request: Request, owner: str, req: _Request) -> Response:
        reply = _Reply(req.chat, self.model_name, req.include_usage, len(req.prompt_ids))
        gen = self._generate(owner, req)
        if not req.stream:
            text, finish = await _until_disconnect(request, _collect(gen))
            return JSONResponse(reply.whole(text, finish))
        # The first event before the response starts: refusals (queue full, shutting down) keep their codes.
        first = await _until_disconnect(request, anext(gen))
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return StreamingResponse(reply.sse(first, gen), media_type="text/event-stream", headers=headers)

    async def _generate(self, owner: str, req: _Request) -> AsyncIterator[str | _Finish]:
        """A single-shot session: text pieces with stop strings applied, then one _Finish."""
        service = self.service
        limit = service.config.max_concurrent + self.max_queue

        if self.active >= limit or service.scheduler.queued >= max(self.max_queue, 1):
            raise OpenAIError(429, f"the server is busy ({self.active} requests in flight, {service.scheduler.queued}"
                                   " generations queued); retry shortly", type="rate_limit_error",
                              code="queue_full", headers={"retry-after": "1"})
        service.store.sweep()
        if len(service.store) >= service.config.max_sessions:  # never evict a session for a one-shot request
            raise OpenAIError(429, f"all {service.config.max_sessions} sessions are in use; retry later",
                              type="rate_limit_error", code="sessions_full", headers={"retry-after": "1"})
        self.active += 1
        try:
            session = await _call(service.create(owner, req.prompt_ids))
            try:
                async for item in self._pieces(owner, session.id, req):
                    yield item
            finally:
                with contextlib.suppress(SessionError):
                    await service.close(owner, session.id)
        finally:
            self.active -= 1

    async def _pieces(self, owner: str, session_id: str, req: _Request) -> AsyncIterator[str | _Finish]:
        eos = set(self.service.eos_ids)
        decoder = self.tokenizer.stream_decoder()
        stops = StopMatcher(req.stop)
        count = 0
        events = self.service.generate(owner, session_id, req.params)
        async with contextlib.aclosing(events):  # leaving early (stop string, disconnect) cancels the engine job
            while True:
                event = await _call(anext(events))
                if isinstance(event, DoneEvent):
                    text = stops.push(decoder.flush()) + stops.flush()
                    if text:
                        yield text
                    yield _Finish(_FINISH[event.finish_reason], count)
                    return
                for token in event.token_ids:
                    count += 1
                    if token in eos:
                        continue
                    text = stops.push(decoder.push(token))
                    if text:
                        yield text
                    if stops.stopped:
                        yield _Finish("stop", count)
                        return


async def _call(awaitable: Awaitable[Any]) -> Any:
    """Await a session-service call, answering its typed errors as OpenAI errors."""
    try:
        return await awaitable
    except SessionError as e:
        raise _from_session_error(e) from None


def _from_session_error(e: SessionError) -> OpenAIError:
    if isinstance(e, InvariantViolation):
        bug = uuid.uuid4()
        _log.error("invariant violation in a shim session (bug id %s): %s", bug, e.message)
        return OpenAIError(500, f"internal cache invariant violation; bug id {bug}", type="internal_error",
                           code="kv_cache_inv_violation")
    if e.kind is ErrorKind.INVALID_ARGUMENT:
        return _bad(e.message)
    if e.kind is ErrorKind.RESOURCE_EXHAUSTED:
        return OpenAIError(429, e.message, type="rate_limit_error", code="resource_exhausted",
                           headers={"retry-after": "1"})
    if e.kind is ErrorKind.UNAVAILABLE:
        return OpenAIError(503, e.message, type="server_error", code="unavailable", headers={"retry-after": "5"})
    return OpenAIError(500, e.message, type="server_error", code=e.kind.value)


@dataclass(slots=True)
class _Reply:
    """The OpenAI response shapes: one JSON body, or SSE chunks as the official clients parse them."""

    chat: bool
    model: str
    include_usage: bool
    prompt_tokens: int
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_urlsafe(18)

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def whole(self, text: str, finish: _Finish) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": finish.reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish.reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(finish.completion_tokens)}

    def chunk(self, text: str | None, finish: str | None, *, first: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        data: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                "created": self.created, "model": self.model, "choices": [choice]}
        if self.include_usage:
            data["usage"] = None
        return _sse(data)

    async def sse(self, first: str | _Finish, rest: AsyncIterator[str | _Finish]) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(rest):  # a disconnect cancels this iterator, and so the generation
            if self.chat:
                yield self.chunk(None, None, first=True)
            item = first
            try:
                while not isinstance(item, _Finish):
                    yield self.chunk(item, None)
                    item = await anext(rest)
            except OpenAIError as e:  # after the status line: OpenAI's clients raise on an error event
                yield _sse(e.body())
                yield b"data: [DONE]\n\n"
                return
            yield self.chunk(None, item.reason)
            if self.include_usage:
                yield _sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                            "created": self.created, "model": self.model, "choices": [],
                            "usage": self.usage(item.completion_tokens)})
            yield b"data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _collect(gen: AsyncIterator[str | _Finish]) -> tuple[str, _Finish]:
    parts: list[str] = []
    async with contextlib.aclosing(gen):
        async for item in gen:
            if isinstance(item, _Finish):
                return "".join(parts), item
            parts.append(item)
    raise RuntimeError("generation ended without a finish")  # pragma: no cover - _pieces always finishes


async def _until_disconnect(request: Request, awaitable: Awaitable[Any]) -> Any:
    """`awaitable`'s result, or _ClientGone (with the work cancelled) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise _ClientGone
    return work.result()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return OpenAIError(exc.status_code, message, code=code).response()


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"request body of {size} bytes exceeds this server's limit of {limit} bytes "
                            "(sized to the model's context)", code="request_too_large")


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> the plain dicts chat templates take (text content only; `developer` -> `system`)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise _bad(f"{where} must be an object with a role in {', '.join(_ROLES)}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"{where}.content: only text parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"{where}.content must be a string or an array of text parts", f"{where}.content")
        if m.get("tool_calls"):
            raise _bad("tool calls are not supported by this server", f"{where}.tool_calls", "unsupported_parameter")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _stop_strings(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop must be a non-empty string or an array of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(stops)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bool(body: Mapping[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{param or name} must be a boolean", param or name)
    return value


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _bad(f"{name} must be a number in [{low:g}, {high:g}]", name)
    return float(value)

