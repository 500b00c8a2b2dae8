"""Opt-in client-side tokenization (the `tokenize` extra): the runtime never renders templates.

GetModelInfo hands out the model's tokenizer.json and chat template as data. This module builds a
tokenizer from them, renders the template with Jinja2 the way Hugging Face does, and computes the
token *delta* a new chat turn adds to a session, so a session's history stays the exact raw tokens
it already holds (generated tokens included) instead of being re-rendered every turn.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

from kakeya.types import ModelInfo

Message = dict[str, Any]

_INSTALL_HINT = "client-side tokenization needs the `tokenize` extra: pip install './sdks/python[tokenize]' (from a checkout)"


_CONTENT_RULE = ("each message needs a 'role' and a string 'content' (from_openai_messages converts OpenAI-style "
                 "content parts)")


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template refused the messages."""


class ChatTemplateMismatch(ChatTemplateError):
    """The rendered conversation does not extend the session's history text (e.g. the template trims
    or rewrites earlier turns). Start a new session from `tokens_for_chat(messages)` instead."""


class Tokenizer:
    """A Hugging Face `tokenizers` tokenizer plus the model's chat template and special tokens."""

    def __init__(self, tokenizer_json: str, *, chat_template: str | None = None, bos_token_id: int | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(_INSTALL_HINT) from e
        if not tokenizer_json:
            raise ValueError("the server sent no tokenizer.json for this model")
        self.hf = HFTokenizer.from_str(tokenizer_json)
        self._json = tokenizer_json
        self._literal: Any = None  # a second tokenizer that reads special-token text as plain text (made on demand)
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self._template = None

    @classmethod
    def from_model_info(cls, info: ModelInfo) -> Tokenizer:
        return cls(info.tokenizer_json, chat_template=info.chat_template, bos_token_id=info.bos_token_id,
                   eos_token_ids=info.eos_token_ids)

    # ---- plain text -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. Special-token text such as "<|im_start|>" maps to its id either way. ValueError for a str
        that is not Unicode text (a lone surrogate, as JSON's "\\ud800" decodes to)."""
        try:
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the tokenizers library's "TextInputSequence must be str", for either cause
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"text is not valid Unicode: a lone surrogate at character {e.start}") from None
            raise

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.hf.id_to_token(token_id) or "")

    @property
    def bos_token(self) -> str:
        return self.token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else ""

    def stream_decoder(self, *, skip_special_tokens: bool = True, stop: str | Iterable[str] = ()) -> StreamDecoder:
        """Streamed text for a Generate; pass its `stop` strings to hold them back (see StreamDecoder)."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens, stop=stop)

    def decode_stream(self, ids: Iterable[int], *, skip_special_tokens: bool = True,
                      stop: str | Iterable[str] = ()) -> Iterator[str]:
        """Text pieces as token ids arrive: `for text in tok.decode_stream(session.generate(...))`. With `stop`, no
        part of a stop string is yielded and the text ends before the first one to complete."""
        decoder = self.stream_decoder(skip_special_tokens=skip_special_tokens, stop=stop)
        for token_id in ids:
            if text := decoder.push(token_id):
                yield text
        if rest := decoder.flush():
            yield rest

    async def decode_stream_async(self, ids: AsyncIterable[int], *, skip_special_tokens: bool = True,
                                  stop: str | Iterable[str] = ()) -> AsyncIterator[str]:
        """`decode_stream` for an AsyncClient's generation: `async for text in tok.decode_stream_async(gen)`."""
        decoder = self.stream_decoder(skip_special_tokens=skip_special_tokens, stop=stop)
        async for token_id in ids:
            if text := decoder.push(token_id):
                yield text
        if rest := decoder.flush():
            yield rest

    # ---- chat ---------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The chat template rendered to text (Hugging Face semantics: trim_blocks, lstrip_blocks, tojson)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; tokenize plain text with "
                                    "encode(text, add_special_tokens=True), which starts it with the BOS token")
        bad = next((i for i, m in enumerate(messages) if not isinstance(m.get("content"), str)), None)
        if bad is not None:  # some templates would print a list or a number into the prompt as text
            raise ChatTemplateError(f"message {bad} has no string content: {_CONTENT_RULE}")
        if self._template is None:
            self._template = _compile(self.chat_template)
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **template_kwargs}
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **context)
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2's UndefinedError for a missing role, TypeError for non-string content, ...
            raise ChatTemplateError(
                f"the chat template could not render these messages ({type(e).__name__}: {e}); {_CONTENT_RULE}") from e

    def tokens_for_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                        literal_content: bool = False, **template_kwargs: Any) -> list[int]:
        """The whole conversation as raw token ids (for CreateSession(initial_tokens=...)).

        As Hugging Face's apply_chat_template, special-token text inside a message ("<|im_end|>") becomes that
        control token, so a message can close its own turn and open another (a forged system turn). With
        `literal_content` such text in a message's content is tokenized as the plain text it is; the OpenAI shim
        uses it, as the OpenAI API treats content. Content without special-token text tokenizes the same either
        way."""
        return self._encode_pieces(self._rendered_pieces(messages, add_generation_prompt, literal_content,
                                                         template_kwargs))

    def _rendered_pieces(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                         literal_content: bool, template_kwargs: Mapping[str, Any]) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, literal) pieces, in order: their texts joined are the render; a
        literal piece is special-token text from a message's content, to tokenize as plain text."""
        specials = sorted({t.content for t in self.hf.get_added_tokens_decoder().values() if t.special and t.content},
                          key=len, reverse=True) if literal_content else []
        if not specials or not any(isinstance(m.get("content"), str) and any(x in m["content"] for x in specials)
                                   for m in messages):
            return [(self.render_chat(messages, add_generation_prompt=add_generation_prompt, **template_kwargs), False)]
        # Each occurrence of special-token text in a message's content is rendered as a marker the template passes
        # through as it passes the text around it (filters, trimming, tests on the content still apply), then
        # tokenized as that text where the marker lands. Markers are private-use characters with a random part, so
        # no message can hold one by chance.
        nonce = "".join(chr(0xE100 + b) for b in os.urandom(8))
        pattern = re.compile("|".join(map(re.escape, specials)))
        literal: dict[str, str] = {}

        def mark(found: re.Match[str]) -> str:
            marker = f"\ue000{nonce}{chr(0xF000 + len(literal))}\ue001"
            literal[marker] = found.group(0)
            return marker

        marked = [{**m, "content": pattern.sub(mark, m["content"])} if isinstance(m.get("content"), str) else m
                  for m in messages]
        pieces = re.split(f"(\ue000{nonce}.\ue001)",
                          self.render_chat(marked, add_generation_prompt=add_generation_prompt, **template_kwargs))
        if sorted(pieces[1::2]) != sorted(literal):
            raise ChatTemplateError("the chat template dropped or repeated part of a message's content, so its "
                                    "special-token text cannot be kept literal")
        return [(literal[piece], True) if i % 2 else (piece, False) for i, piece in enumerate(pieces) if piece]

    def _encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        return [t for text, literal in pieces for t in (self._encode_literal(text) if literal else self.encode(text))]

    def _encode_literal(self, text: str) -> list[int]:
        if self._literal is None:
            from tokenizers import Tokenizer as HFTokenizer

            self._literal = HFTokenizer.from_str(self._json)
            self._literal.encode_special_tokens = True
        return self._literal.encode(text, add_special_tokens=False).ids

    def chat_delta(self, history_ids: Sequence[int], messages: Sequence[Mapping[str, Any]], *,
                   add_generation_prompt: bool = True, literal_content: bool = False,
                   **template_kwargs: Any) -> list[int]:
        """Tokens to AppendTokens so a session holding `history_ids` continues as `messages`.

        The history is the truth: generated tokens stay exactly as sampled. The rendered conversation
        must extend the history's text; only the new suffix is tokenized. Raises ChatTemplateMismatch
        when it does not (the caller then starts a fresh session from tokens_for_chat). `literal_content` as
        tokens_for_chat's: pass the value the session's earlier turns were tokenized with.
        """
        pieces = self._rendered_pieces(messages, add_generation_prompt, literal_content, template_kwargs)
        if not history_ids:
            return self._encode_pieces(pieces)
        rendered = "".join(text for text, _ in pieces)
        prefix = self._history_text(history_ids, rendered)
        if not rendered.startswith(prefix):
            at = next((i for i, (a, b) in enumerate(zip(prefix, rendered, strict=False)) if a != b),
                      min(len(prefix), len(rendered)))
            raise ChatTemplateMismatch(
                f"rendered chat diverges from the session history at character {at}: "
                f"history {prefix[at:at + 40]!r} vs rendered {rendered[at:at + 40]!r}"
            )
        suffix: list[tuple[str, bool]] = []
        skip = len(prefix)  # characters of the render the history already holds
        for text, literal in pieces:
            if skip < len(text):
                suffix.append((text[skip:], literal))  # a literal's tail is plain text too
            skip = max(0, skip - len(text))
        return self._encode_pieces(suffix)

    def _history_text(self, history_ids: Sequence[int], rendered: str) -> str:
        """The history's text, each EOS token in it read as the EOS the render has there: a reply that ended on
        another of the model's EOS tokens than the one the template closes a turn with (SmolLM2's <|endoftext|>
        where it writes <|im_end|>) stands for the turn's end, in the last turn and in every earlier one."""
        ids = list(history_ids)
        text = self.decode(ids, skip_special_tokens=False)
        if rendered.startswith(text):
            return text
        eos = set(self.eos_token_ids)
        for i, token in enumerate(ids):
            if token not in eos:
                continue
            before = self.decode(ids[:i], skip_special_tokens=False)
            if not rendered.startswith(before):
                break  # the history diverges before this token: nothing to read differently
            ids[i] = next((e for e in self.eos_token_ids if self.token_text(e) and
                           rendered.startswith(before + self.token_text(e))), token)
        return self.decode(ids, skip_special_tokens=False)


class StreamDecoder:
    """Incremental detokenization: push token ids, get text as soon as it is complete.

    Decodes a short window before the new tokens and emits only the difference, so multi-byte
    characters split across tokens and leading-space rules of SentencePiece-style decoders come
    out right (the prefix/read offset scheme of TGI and vLLM).

    With `stop` (the stop strings given to `generate`), text that may still become a stop string is
    held back, and the stream ends just before the first stop string to complete (of two completing
    on the same character, the longer): the displayed text never shows any part of it.
    `stop_string` then says which one matched, as the server's result does.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 stop: str | Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stops: tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(dict.fromkeys(stop))
        if not all(isinstance(s, str) and s for s in self.stops):
            raise ValueError("stop strings must be non-empty strings")
        self.ids: list[int] = []
        self.stop_string: str | None = None  # the stop string the text reached, once it did
        self._held = ""  # text that may still become a stop string
        self._prefix = 0
        self._read = 0
        self._sent = 0  # characters after the read offset already emitted (before an incomplete one)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        start = len(before) + self._sent
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read, self._sent = self._read, len(self.ids), 0
            return self._hold_back(text[start:])
        # A token may end complete characters and begin an incomplete one (a space and an emoji's first
        # bytes): the complete ones go now (a stop string may end in them); only the incomplete tail waits.
        complete = len(text.rstrip("\ufffd"))
        if complete > start:
            self._sent += complete - start
            return self._hold_back(text[start:complete])
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character, or text that did not become a stop string)."""
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        start = len(before) + self._sent
        self._prefix = self._read = len(self.ids)
        self._sent = 0
        out = self._hold_back(text[start:])
        if self.stop_string is None:
            out, self._held = out + self._held, ""
        return out

    def _hold_back(self, piece: str) -> str:
        if not self.stops:
            return piece
        if self.stop_string is not None:
            return ""
        text = self._held + piece
        # Text already emitted was no stop string's prefix, so a match can only start inside `text`.
        found = [(i + len(s), -len(s), i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            _, _, start, self.stop_string = min(found)
            self._held = ""
            return text[:start]
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]


def tokens_for_chat(messages: Sequence[Mapping[str, Any]], tokenizer: Any, *, add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> list[int]:
    """Render `messages` with the model's chat template and tokenize, client-side.

    `tokenizer` is a kakeya Tokenizer (from GetModelInfo) or anything with Hugging Face's
    `apply_chat_template` (e.g. a transformers AutoTokenizer).
    """
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.tokens_for_chat(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
    if hasattr(tokenizer, "apply_chat_template"):
        ids = tokenizer.apply_chat_template(list(messages), tokenize=True,
                                            add_generation_prompt=add_generation_prompt, **template_kwargs)
        if isinstance(ids, Mapping):  # BatchEncoding in recent transformers
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    raise TypeError(f"cannot render a chat template with {type(tokenizer).__name__}")


def from_openai_messages(messages: Iterable[Any], tokenizer: Any, *, add_generation_prompt: bool = True,
                         literal_content: bool = True, **template_kwargs: Any) -> list[int]:
    """OpenAI chat-completions messages + the model's tokenizer -> the token ids a session takes.

    The one-helper migration from the HTTP shim to sessions: what `POST /v1/chat/completions` would have
    prompted with becomes `client.create_session(initial_tokens=from_openai_messages(messages, tok))`.
    `messages` are dicts or the openai package's message objects; `tokenizer` is a kakeya Tokenizer (from
    GetModelInfo) or anything with Hugging Face's `apply_chat_template`. As the shim (and the OpenAI API) does,
    special-token text in a message's content stays text (`literal_content`; a Hugging Face tokenizer cannot keep
    it so, and such content is refused with one unless literal_content=False). For later turns of the same
    session append `tokenizer.chat_delta(history, chat_messages_from_openai(messages), literal_content=True)` instead.
    """
    chat = chat_messages_from_openai(messages)
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.tokens_for_chat(chat, add_generation_prompt=add_generation_prompt,
                                         literal_content=literal_content, **template_kwargs)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = [t for t in [*(getattr(tokenizer, "all_special_tokens", None) or []),
                            *(str(a) for a in added.values() if getattr(a, "special", False))] if isinstance(t, str) and t]
    held = next((t for m in chat if isinstance(m.get("content"), str) for t in specials if t in m["content"]), None)
    if literal_content and held is not None:
        raise ValueError(f"a message's content holds the special-token text {held!r}, which this tokenizer would "
                         "read as that control token: use a kakeya Tokenizer (Tokenizer.from_model_info), which "
                         "keeps it as text, or pass literal_content=False")
    return tokens_for_chat(chat, tokenizer, add_generation_prompt=add_generation_prompt, **template_kwargs)


def chat_messages_from_openai(messages: Iterable[Any]) -> list[Message]:
    """OpenAI chat-completions messages -> the plain dicts chat templates expect.

    Text content parts are joined; `developer` becomes `system` (templates rarely know it); tool
    calls keep their structure with JSON `arguments` parsed, as Hugging Face templates expect.
    Non-text parts (images, audio) are refused rather than silently dropped.
    """
    out: list[Message] = []
    for raw in messages:
        m = raw.model_dump(exclude_none=True) if hasattr(raw, "model_dump") else dict(raw)
        role = m.get("role")
        if not role:
            raise ValueError(f"message without a role: {m!r}")
        msg: Message = {"role": "system" if role == "developer" else role, "content": _text(m.get("content"))}
        if m.get("name"):
            msg["name"] = m["name"]
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(tc) for tc in m["tool_calls"]]
        out.append(msg)
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            parts.append(part.get("text", ""))
        else:
            raise ValueError(f"unsupported content part {kind!r}: only text parts can be tokenized")
    return "".join(parts)


def _tool_call(tc: Mapping[str, Any]) -> dict[str, Any]:
    fn = dict(tc.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # else keep the raw string; templates may print it
            fn["arguments"] = json.loads(args) if args else {}
    return {"type": tc.get("type", "function"), "id": tc.get("id"), "function": fn}


def _compile(source: str) -> Any:
    """Jinja2 environment matching transformers' chat-template rendering."""
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover
        raise ImportError(_INSTALL_HINT) from e

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e
