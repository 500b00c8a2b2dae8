"""Stop strings: a Generate ends right after the token whose text completes one of them.

What is matched: the text of the tokens this Generate produces, decoded as a client displays it (special tokens
skipped; a character split across tokens counts once it is complete), from the call's first generated token.
History from before the call is never matched, and neither are stop tokens (EOS, stop_token_ids): they end the
generation by themselves. Read left to right, the first stop string to complete wins (of two completing on the
same character, the longer), so the match depends only on the text, never on how tokens split it.

What the session keeps: every generated token, the one that completes the stop string included, joins the
history and is streamed to the client like any other; nothing is trimmed or rolled back. The history is raw
tokens and a stop string need not end on a token boundary, so the last token may spell text after the stop
string too. A client wanting the text before the stop cuts the decoded text at the first occurrence of the stop
string that matched (GenerateDone.stop_string): generation ended at the first completion, so no stop string is
complete any earlier. The next Generate continues from exactly that history.

`StopMatcher` also holds back text that may still become a stop string (the OpenAI shim streams text with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kakeya_runtime.sessions.errors import InvalidArgument, quoted

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # Unicode code points per stop string

Detokenize = Callable[[Sequence[int]], str]  # token ids -> text, special tokens skipped


def check_stop_strings(stops: Iterable[str]) -> tuple[str, ...]:
    """The stop strings of a request, duplicates dropped; InvalidArgument when there are too many, or one is
    empty or too long."""
    out = tuple(dict.fromkeys(stops))
    if len(out) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(out)}")
    for s in out:
        if not s:
            raise InvalidArgument("stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(f"stop string {quoted(s)} is longer than {MAX_STOP_STRING_CHARS} characters")
    return out


def detokenizer(tokenizer_json: str) -> Detokenize:
    """A thread-safe decode function from a Hugging Face tokenizer.json (special tokens skipped)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


@dataclass(slots=True)
class StreamDecoder:
    """Incremental detokenization: push token ids, get text as soon as it is complete.

    Decodes a short window before the new tokens and emits only the difference, so multi-byte characters split
    across tokens and leading-space rules of SentencePiece-style decoders come out right (the prefix/read offset
    scheme of TGI and vLLM; the same as the Python SDK's StreamDecoder).
    """

    decode: Detokenize
    ids: list[int] = field(default_factory=list)
    _prefix: int = 0
    _read: int = 0
    _sent: int = 0  # characters after the window's read offset already emitted (before an incomplete one)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.decode(self.ids[self._prefix:self._read])
        text = self.decode(self.ids[self._prefix:])
        start = len(before) + self._sent
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read, self._sent = self._read, len(self.ids), 0
            return text[start:]
        # A token may end complete characters and begin an incomplete one (a space and an emoji's first bytes):
        # the complete ones go now (a stop string may end in them); only the incomplete tail waits.
        complete = len(text.rstrip("\ufffd"))
        if complete > start:
            self._sent += complete - start
            return text[start:complete]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of the stream)."""
        before = self.decode(self.ids[self._prefix:self._read])
        text = self.decode(self.ids[self._prefix:])
        start = len(before) + self._sent
        self._prefix = self._read = len(self.ids)
        self._sent = 0
        return text[start:]


@dataclass(slots=True)
class StopMatcher:
    """Text-level stop strings, read left to right: emits what can no longer start a stop string, trims the first
    match. The first stop string to complete wins (at the same character, the one starting earliest), so the match
    depends only on the text, not on how it was split into pieces. One KMP automaton per stop string: each
    character costs O(number of stop strings), amortised, however long the text held back."""

    stops: tuple[str, ...]
    held: str = ""
    matched: str | None = None  # the stop string that matched, once one did
    _failure: list[list[int]] = field(default_factory=list)
    _state: list[int] = field(default_factory=list)  # per stop: the longest prefix of it the text ends with

    def __post_init__(self) -> None:
        self._failure = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, piece: str) -> str:
        """The text safe to emit after `piece`; on a match, the text before it (the rest is dropped)."""
        if self.matched is not None:
            return ""
        text = self.held + piece
        base = len(self.held)
        for pos, ch in enumerate(piece, start=base):
            done = None
            for k, s in enumerate(self.stops):
                st, fail = self._state[k], self._failure[k]
                while st and s[st] != ch:
                    st = fail[st - 1]
                if s[st] == ch:
                    st += 1
                if st == len(s):
                    if done is None or len(s) > len(done):
                        done = s
                    st = fail[st - 1]
                self._state[k] = st
            if done is not None:
                self.matched, self.held = done, ""
                return text[:pos + 1 - len(done)]
        keep = max(self._state, default=0)  # the longest tail that may still become a stop string
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        out, self.held = self.held, ""
        self._state = [0] * len(self.stops)
        return out


def _failure(s: str) -> list[int]:
    """KMP: for each prefix of `s`, the length of its longest proper prefix that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


@dataclass(slots=True)
class StopWatch:
    """Engine thread, one per Generate with stop strings: push each generated token, learn whether it ends it."""

    decoder: StreamDecoder
    matcher: StopMatcher

    @classmethod
    def new(cls, detokenize: Detokenize, stops: tuple[str, ...]) -> StopWatch:
        return cls(StreamDecoder(detokenize), StopMatcher(stops))

    def push(self, token_id: int) -> bool:
        self.matcher.push(self.decoder.push(token_id))
        return self.matcher.stopped
