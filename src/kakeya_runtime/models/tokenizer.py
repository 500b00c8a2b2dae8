"""Build a `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata (no transformers at run time).

A GGUF carries no tokenizer.json, only llama.cpp's description of one (`tokenizer.ggml.*`):
- "gpt2": byte-level BPE (SmolLM2): tokens already spelled in the GPT-2 byte alphabet, plus merges;
  `tokenizer.ggml.pre` names the regex that splits text before BPE.
- "llama": SentencePiece-style BPE (Gemma 3): tokens with "▁" for spaces, scores, token types,
  `<0xNN>` byte-fallback tokens, no merges (they are implied by the vocabulary).
Control tokens (type 3, e.g. <|im_start|>, <start_of_turn>) become special added tokens and
user-defined tokens (type 4) plain added tokens, so each is always matched whole in text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

# llama.cpp's token types (llama_token_type / gguf.TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


class TokenizerBuildError(ValueError):
    """GGUF tokenizer metadata that is missing or describes a tokenizer we cannot build."""


# Pre-tokenizer regexes, keyed by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp defines them.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# "digits": every digit is its own pre-token, then the GPT-2 split (SmolLM2's original tokenizer.json:
# Digits(individual_digits) + ByteLevel; llama.cpp's SMOLLM/STARCODER/REFACT pre-type).
_BYTE_LEVEL_PRE: dict[str, str] = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
}


def build_tokenizer(meta: Mapping[str, Any], *, source: str = "<gguf>") -> Tokenizer:
    """`meta`: the GGUF key/value metadata (arrays as Python lists). `source` names the file in errors."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise TokenizerBuildError(f"{source}: GGUF has no tokenizer (tokenizer.ggml.model / tokens missing)")
    token_types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise TokenizerBuildError(f"{source}: {len(token_types)} token types for {len(tokens)} tokens")
    if kind == "gpt2":
        tok, vocab = _byte_level(meta, tokens, source)
    elif kind == "llama":
        tok, vocab = _sentencepiece_bpe(meta, tokens, source)
    else:
        raise TokenizerBuildError(f"{source}: unsupported tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
    _add_special_tokens(tok, tokens, token_types, vocab, byte_level=kind == "gpt2")
    _set_post_processor(tok, meta, tokens)
    return tok


def tokenizer_to_json(tok: Tokenizer) -> str:
    """tokenizer.json text that loads fast: merges written as "a b" strings rather than ["a", "b"] pairs
    (tokenizers parses the pair form ~2.5x slower: 1.4 s vs 0.5 s for Gemma's 515k merges). The string
    form is only unambiguous when no token contains a space, so otherwise the pairs stay."""
    data = json.loads(tok.to_str())
    model = data.get("model", {})
    merges = model.get("merges")
    if merges and isinstance(merges[0], list) and not any(" " in t for t in model.get("vocab", {})):
        model["merges"] = [f"{left} {right}" for left, right in merges]
    return json.dumps(data, ensure_ascii=False)


def _byte_level(meta: Mapping[str, Any], tokens: Sequence[str], source: str) -> tuple[Tokenizer, dict[str, int]]:
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise TokenizerBuildError(f"{source}: byte-level BPE tokenizer without tokenizer.ggml.merges")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens are stored in the byte alphabet already; respell the odd one that is not (raw UTF-8).
    vocab = {
        t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    split = _BYTE_LEVEL_PRE.get(pre)
    if split is None:
        raise TokenizerBuildError(
            f"{source}: unsupported pre-tokenizer {pre!r} (supported: {sorted(_BYTE_LEVEL_PRE)})"
        )
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    else:
        regex = _LLAMA3_SPLIT if split == "llama3" else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: Sequence[str],
                       source: str) -> tuple[Tokenizer, dict[str, int]]:
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        # Llama-2-style files prepend "▁"; only Gemma's convention (no prefix) is built and tested here.
        raise TokenizerBuildError(f"{source}: SentencePiece tokenizer with add_space_prefix is not supported")
    # Gemma stores tokens made only of 2+ spaces as real spaces, but text is normalised to "▁" first:
    # spell them with "▁" so they (and the merges built from them) can match.
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(respelled)}
    # The file lists no merges. Rebuild them from the vocabulary, best first. Gemma's order of merges is
    # the order of the tokens in the file (the scores mostly follow it, but not exactly), so rank a
    # merge by the position of the token it produces, as transformers' GGUF converter does.
    merges = _merges_from_vocab(vocab, {t: -i for i, t in enumerate(respelled)})
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, vocab


def _merges_from_vocab(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """Every split of every token into two vocabulary tokens, highest-scoring product first (ties: the
    shorter left part, then the shorter right part, first)."""
    found: list[tuple[str, str, float]] = []
    for merged, score in scores.items():
        local = []
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        found.extend(local)
    found.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(tok: Tokenizer, tokens: Sequence[str], token_types: Sequence[int],
                        vocab: Mapping[str, int], *, byte_level: bool) -> None:
    spelled = set(_byte_alphabet().values()) if byte_level else None
    # A byte-level "control" token outside the byte alphabet is a llama.cpp mislabel; adding it would
    # grow the vocabulary past the model's, so it stays an ordinary token.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, token_types, strict=True)
        if ty == TOKEN_CONTROL and (spelled is None or set(t) <= spelled)
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, token_types, strict=True)
        if ty == TOKEN_USER_DEFINED and t in vocab
    ]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _set_post_processor(tok: Tokenizer, meta: Mapping[str, Any], tokens: Sequence[str]) -> None:
    """Prepend BOS when the file asks for it (Gemma); `encode(..., add_special_tokens=False)` skips it."""
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = meta.get("tokenizer.ggml.model") == "llama"  # llama.cpp's default for SentencePiece
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))]
        )
    elif meta.get("tokenizer.ggml.model") == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))
