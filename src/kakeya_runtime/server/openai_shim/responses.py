"""OpenAI's response shapes: one JSON body, or SSE chunks as the official clients parse them (role in the first
delta, `finish_reason` on the last, an optional usage chunk with empty `choices`, then `data: [DONE]`)."""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kakeya_runtime.server.openai_shim.errors import OpenAIError


@dataclass(slots=True, frozen=True)
class Finish:
    """The end of a reply: OpenAI's finish_reason and the tokens generated (stop-string tokens included)."""

    reason: str
    completion_tokens: int


Piece = str | Finish  # what a generation yields: text pieces, then one Finish


@dataclass(slots=True)
class Reply:
    """The response to one request, whole or streamed."""

    chat: bool
    model: str
    include_usage: bool
    prompt_tokens: int
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_urlsafe(18)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def whole(self, text: str, finish: Finish) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": finish.reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish.reason}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage(finish.completion_tokens)}

    def chunk(self, text: str | None, finish: str | None, *, first: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        data: dict[str, Any] = {"id": self.id, "object": self.chunk_object, "created": self.created,
                                "model": self.model, "choices": [choice]}
        if self.include_usage:
            data["usage"] = None
        return sse(data)

    async def sse(self, first: Piece, rest: AsyncIterator[Piece]) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(rest):  # a disconnect cancels this iterator, and so the generation
            if self.chat:
                yield self.chunk(None, None, first=True)
            item = first
            try:
                while not isinstance(item, Finish):
                    yield self.chunk(item, None)
                    item = await anext(rest)
            except OpenAIError as e:  # after the status line: OpenAI's clients raise on an error event
                yield sse(e.body())
                yield b"data: [DONE]\n\n"
                return
            yield self.chunk(None, item.reason)
            if self.include_usage:
                yield sse({"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                           "choices": [], "usage": self.usage(item.completion_tokens)})
            yield b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def collect(gen: AsyncIterator[Piece]) -> tuple[str, Finish]:
    """A whole reply's text and its Finish."""
    parts: list[str] = []
    async with contextlib.aclosing(gen):
        async for item in gen:
            if isinstance(item, Finish):
                return "".join(parts), item
            parts.append(item)
    raise RuntimeError("generation ended without a finish")  # pragma: no cover - a generation always finishes
