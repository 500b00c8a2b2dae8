"""Request parsing and validation, by hand so every refusal is OpenAI's 400 (or 404/413) naming its `param`.

A request becomes a `ShimRequest`: the prompt as token ids (chat messages rendered with the model's template by
the SDK's `Tokenizer`, the same renderer a client uses before CreateSession) and the session service's
GenerateParams. Nothing is started before a request has passed every check.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from kakeya_runtime.server.openai_shim.errors import OpenAIError, bad, too_large
from kakeya_runtime.sessions.errors import InvalidArgument
from kakeya_runtime.sessions.service import GenerateParams
from kakeya_runtime.sessions.stops import check_stop_strings

MAX_STOP_STRINGS = 4  # as OpenAI (the session API itself takes more)
BODY_HEADROOM_BYTES = 1024 * 1024
BODY_BYTES_PER_TOKEN = 32  # generous: JSON-escaped text runs a few bytes per token
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True)
class ShimRequest:
    chat: bool
    prompt_ids: list[int]
    params: GenerateParams  # stop strings included: the session service ends the generation on them
    stream: bool = False
    include_usage: bool = False


@dataclass(slots=True)
class RequestParser:
    """Turns the bodies of /v1/chat/completions and /v1/completions into ShimRequests for one served model."""

    model_name: str
    context_length: int
    tokenizer: Any  # kakeya.tokenization.Tokenizer
    max_body_bytes: int

    @classmethod
    def for_context(cls, model_name: str, context_length: int, tokenizer: Any) -> RequestParser:
        return cls(model_name, context_length, tokenizer, BODY_HEADROOM_BYTES + BODY_BYTES_PER_TOKEN * context_length)

    async def json_body(self, request: Request) -> dict[str, Any]:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit)
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # nesting past Python's stack: unreadable
            raise bad("We could not parse the JSON body of your request.") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        self.check_model(body.get("model"))
        return body

    def check_model(self, model: Any) -> None:
        if not isinstance(model, str) or not model:
            raise bad("you must provide a model parameter", "model")
        if model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                              param="model", code="model_not_found")

    def chat(self, body: dict[str, Any]) -> ShimRequest:
        messages = chat_messages(body.get("messages"))
        if not self.tokenizer.has_chat_template:
            raise bad(f"model {self.model_name!r} has no chat template: use /v1/completions", "messages")
        from kakeya.tokenization import ChatTemplateError

        try:
            ids = self.tokenizer.tokens_for_chat(messages, literal_content=True)  # content is text, as OpenAI's
        except ChatTemplateError as e:
            raise bad(f"the chat template refused the messages: {e}", "messages") from None
        return self._parse(body, ids, chat=True)

    def completion(self, body: dict[str, Any]) -> ShimRequest:
        for name, default in (("echo", False), ("best_of", 1), ("suffix", None), ("logprobs", None)):
            if not _is_default(body.get(name), default):
                raise bad(f"{name} is not supported by this server", name, "unsupported_parameter")
        return self._parse(body, self._prompt_ids(body.get("prompt")), chat=False)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(_text(prompt, "prompt"), add_special_tokens=True)
        elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            ids = list(prompt)  # token ids; the session service checks their range
        else:
            raise bad("prompt must be a string, a list of token ids, or a list of one of them (n=1 only)", "prompt")
        if not ids:
            raise bad("the prompt is empty", "prompt")
        return ids

    def _parse(self, body: dict[str, Any], ids: list[int], *, chat: bool) -> ShimRequest:
        n = body.get("n")
        if n is not None and (not _is_int(n) or n != 1):
            raise bad("only n=1 is supported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_default(body.get(name), 0):
                raise bad(f"{name} is not supported by this server", name, "unsupported_parameter")
        if body.get("logit_bias"):
            raise bad("logit_bias is not supported by this server", "logit_bias", "unsupported_parameter")
        if chat:
            if body.get("logprobs") or body.get("top_logprobs"):
                raise bad("logprobs are not supported by this server", "logprobs", "unsupported_parameter")
            if body.get("tools") or body.get("functions"):
                raise bad("tools are not supported by this server", "tools", "unsupported_parameter")
            if body.get("tool_choice") not in (None, "none", "auto"):  # no tools: nothing it could choose
                raise bad("tools are not supported by this server", "tool_choice", "unsupported_parameter")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise bad("only response_format {\"type\": \"text\"} is supported", "response_format")
        stream = _bool(body, "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise bad("stream_options must be an object", "stream_options")
        if options and not stream:
            raise bad("stream_options is only allowed with stream=true", "stream_options")
        include_usage = _bool(options or {}, "include_usage", "stream_options.include_usage")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0.0:
            raise bad("top_p must be in (0, 1]", "top_p")
        seed = body.get("seed")
        if seed is not None and not (_is_int(seed) and 0 <= seed < 2**63):  # the sampler's range
            raise bad("seed must be an integer in [0, 2**63)", "seed")
        context = self.context_length
        if len(ids) >= context:
            raise bad(f"This model's maximum context length is {context} tokens. However, your "
                      f"{'messages' if chat else 'prompt'} resulted in {len(ids)} tokens.",
                      "messages" if chat else "prompt", "context_length_exceeded")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(name)
        if max_tokens is None:
            max_tokens = context - len(ids)
        elif not _is_int(max_tokens) or max_tokens < 1:
            raise bad(f"{name} must be a positive integer", name)
        elif len(ids) + max_tokens > context:
            raise bad(f"This model's maximum context length is {context} tokens. However, you requested "
                      f"{len(ids) + max_tokens} tokens ({len(ids)} in the {'messages' if chat else 'prompt'}, "
                      f"{max_tokens} in the completion).", name, "context_length_exceeded")
        params = GenerateParams(max_tokens=max_tokens, temperature=temperature,
                                top_p=None if top_p >= 1.0 else top_p, seed=seed, stop=stop_strings(body.get("stop")))
        return ShimRequest(chat, ids, params, stream, include_usage)


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> the plain dicts chat templates take (text content only; `developer` -> `system`)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise bad(f"{where} must be an object with a role in {', '.join(_ROLES)}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"{where}.content: only text parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content must be a string or an array of text parts", f"{where}.content")
        content = _text(content, f"{where}.content")
        if m.get("tool_calls"):
            raise bad("tool calls are not supported by this server", f"{where}.tool_calls", "unsupported_parameter")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = _text(m["name"], f"{where}.name")
        out.append(msg)
    return out


def stop_strings(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a non-empty string or an array of them", "stop")
    stops = [_text(s, "stop") for s in stops]
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
    try:
        return check_stop_strings(stops)  # the session API's own limits (length)
    except InvalidArgument as e:
        raise bad(e.message, "stop") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_default(value: Any, default: Any) -> bool:
    """Absent, or the parameter's default itself (a bool is not the number 0 or 1 here, though Python's == says so)."""
    if value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    return isinstance(value, int | float) and isinstance(default, int | float) and value == default


def _text(value: str, param: str) -> str:
    """JSON strings may carry lone UTF-16 surrogates ("\\ud800"), which are no Unicode text: refused by name."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{param} is not valid Unicode (a lone surrogate at character {e.start})", param) from None
    return value


def _bool(body: Mapping[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{param or name} must be a boolean", param or name)
    return value


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad(f"{name} must be a number in [{low:g}, {high:g}]", name)
    return float(value)
