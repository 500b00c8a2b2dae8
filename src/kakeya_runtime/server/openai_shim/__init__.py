"""The deprecated OpenAI-style HTTP+SSE shim: single-shot sessions for clients that only speak OpenAI's API.

`kakeya serve --openai-port N` serves `POST /v1/chat/completions`, `POST /v1/completions` and
`GET /v1/models` on the gRPC server's host, in the same process and on the same event loop (HTTPS with the
gRPC server's certificate when it has one): each request is one session of the session service (create with
the prompt, generate, close), so it shares the engine scheduler, the API keys (as `Authorization: Bearer`) and
the session metrics with gRPC. It never reaches the session features (append, raw-token history, KV policies):
every response says so with `Deprecation` and `Sunset` headers and a `Link` to /docs/session-api, which
explains the way over.

One concern per module:
* `parsing`: request bodies -> ShimRequest (validation; OpenAI-shaped 400s naming the param);
* `generation`: a ShimRequest as a single-shot session (admission, stop-string text, disconnects);
* `responses`: the JSON and SSE shapes the official clients parse;
* `errors`: OpenAIError and the translation of session errors;
* `app`: the ASGI app, auth, the deprecation headers and the uvicorn server's lifecycle.
"""

from kakeya_runtime.server.openai_shim.app import DEPRECATION_HEADERS, DOCS_PATH, OpenAIShim
from kakeya_runtime.server.openai_shim.errors import OpenAIError
from kakeya_runtime.server.openai_shim.parsing import MAX_STOP_STRINGS

__all__ = ["DEPRECATION_HEADERS", "DOCS_PATH", "MAX_STOP_STRINGS", "OpenAIError", "OpenAIShim"]
