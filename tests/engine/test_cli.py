"""`kakeya generate`: streamed text on stdout, timings on stderr, chat vs raw prompts, incremental decoding."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from kakeya_runtime.cli import app
from kakeya_runtime.engine.cli import iter_text
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.models.loader import load_model

# Tiny models: per-op work is far too small to split across threads, and on a shared 2-core machine a
# second OpenMP thread mostly waits on a busy core (see conftest.single_thread).
pytestmark = pytest.mark.usefixtures("single_thread")


def _run(*args: str):
    return CliRunner().invoke(app, ["generate", *args], catch_exceptions=False)


def test_streaming_decoder_keeps_multibyte_characters_whole(tiny_gguf, tmp_path):
    """Every byte is its own token in the tiny byte-level vocabulary, so each multi-byte character
    arrives split across tokens; the streamed pieces must still join to the exact text."""
    tok = load_model(tiny_gguf("llama").path, dtype=torch.float32, cache_dir=tmp_path).tokenizer
    text = "naïve café 😀 中文 — done <|im_end|>"
    ids = tok.encode(text).ids
    assert len(ids) > len("naïve café")  # really split
    pieces = list(iter_text(tok, ids))
    assert "".join(pieces) == "naïve café 😀 中文 — done "  # the special token is skipped
    assert not any("\ufffd" in p for p in pieces)
    assert len(pieces) > 5  # streamed, not buffered to the end
    cut = tok.encode("café 😀").ids[:-1]  # the stream ends inside the emoji: shown as a whole decode spells it
    assert "".join(iter_text(tok, cut)) == tok.decode(cut) and tok.decode(cut).endswith("\ufffd")


def test_generate_raw_streams_the_greedy_tokens(tiny_gguf, tmp_path):
    tiny = tiny_gguf("gemma3")
    cache_dir = str(tmp_path / "cache")
    result = _run("hello world", "--model", str(tiny.path), "--cache-dir", cache_dir, "-n", "12",
                  "--dtype", "fp32")  # no chat template in this file: raw by default
    assert result.exit_code == 0, result.output
    loaded = load_model(tiny.path, dtype=torch.float32, cache_dir=cache_dir)
    ids = loaded.tokenizer.encode("hello world").ids
    assert ids[0] == 2  # raw prompts get the tokenizer's BOS
    engine = Engine(loaded.model)
    want = engine.generate(engine.new_cache(capacity=len(ids) + 12), torch.tensor([ids]),
                           GenerateRequest(12, stop_ids=loaded.eos_ids)).token_ids[0]
    assert result.stdout == "".join(iter_text(loaded.tokenizer, want)) + "\n"
    for field in ("prefill", "tok/s", "TTFT", "decode"):
        assert field in result.stderr
    assert "prefill" not in result.stdout


def test_generate_chat_and_errors(tiny_gguf, tmp_path):
    cache_dir = str(tmp_path / "cache")
    llama = tiny_gguf("llama")
    ok = _run("hi", "--model", str(llama.path), "--cache-dir", cache_dir, "-n", "4", "--chat",
              "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3")
    assert ok.exit_code == 0, ok.output
    again = _run("hi", "--model", str(llama.path), "--cache-dir", cache_dir, "-n", "4", "--chat",
                 "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3")
    assert again.stdout == ok.stdout  # seeded

    gemma = tiny_gguf("gemma3")
    no_template = _run("hi", "--model", str(gemma.path), "--cache-dir", cache_dir, "--chat")
    assert no_template.exit_code == 2 and "no chat template" in no_template.stderr
    missing = _run("hi", "--model", str(tmp_path / "missing.gguf"), "--cache-dir", cache_dir)
    assert missing.exit_code == 1 and "no such file" in missing.stderr
    bad_dtype = _run("hi", "--model", str(gemma.path), "--dtype", "int3")
    assert bad_dtype.exit_code == 2
    bad_top_p = _run("hi", "--model", str(gemma.path), "--top-p", "1.5", "--temperature", "1")
    assert bad_top_p.exit_code == 2 and "top_p" in bad_top_p.output
    too_long = _run("hi", "--model", str(gemma.path), "--cache-dir", cache_dir, "-n", "500")
    assert too_long.exit_code == 2 and "exceeds the context" in too_long.stderr


@pytest.mark.real_model
def test_generate_real_chat_answer(smollm2_bf16):
    """Default model and --chat rendering through the SDK (ChatML for SmolLM2)."""
    result = _run("Name the capital city of France.", "-n", "24")
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout
    assert "TTFT" in result.stderr
