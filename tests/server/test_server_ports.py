"""`kakeya serve` checks its ports before loading the model and names the flag to change in one line."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kakeya_runtime.server import cli
from kakeya_runtime.server.ports import Listen, port_problem


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another listener holds for the test."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def _serve(*args: str) -> tuple[int, str]:
    app = typer.Typer()
    cli.register(app)
    # A model that does not exist: reaching the load would fail differently (and only after the check).
    result = CliRunner().invoke(app, ["serve", "--model", "/no/such/model.gguf", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--openai-port"])
def test_serve_names_the_flag_of_a_port_in_use_before_loading(busy_port, flag):
    ports = {"--port": str(_free_port()), "--metrics-port": str(_free_port()), flag: str(busy_port)}
    code, output = _serve(*[x for kv in ports.items() for x in kv])
    assert code == 2, output
    lines = output.strip().splitlines()
    assert len(lines) == 1 and f"port {busy_port}" in lines[0] and "in use" in lines[0], output
    assert lines[0].endswith(flag)
    assert "Loading" not in output and "Traceback" not in output


def test_serve_refuses_two_flags_on_one_port():
    port = str(_free_port())
    code, output = _serve("--port", port, "--openai-port", port, "--metrics-port", "0")
    assert code == 2 and "--port and --openai-port both ask for port" in output
    assert len(output.strip().splitlines()) == 1


def test_port_problem_passes_free_and_any_ports(busy_port):
    assert port_problem([Listen("--port", "127.0.0.1", 0), Listen("--metrics-port", "127.0.0.1", _free_port())]) is None
    assert port_problem([Listen("--metrics-port", "127.0.0.1", busy_port)]) is not None
    bad_host = port_problem([Listen("--port", "no-such-host.invalid", 5)])
    assert bad_host is not None and "--host" in bad_host


def test_serve_refuses_a_state_dir_in_use_before_loading(tmp_path):
    from kakeya_runtime.sessions.journal import StateDir

    state = StateDir(tmp_path / "state", "m", "c")  # this process holds its lock, as a running server would
    try:
        code, output = _serve("--port", "0", "--no-metrics",
                              "--state-dir", str(tmp_path / "state"))
    finally:
        state.close()
    assert code == 1, output
    assert "in use by another server" in output and "Loading" not in output, output
    code, output = _serve("--port", "0", "--no-metrics",
                          "--state-dir", str(tmp_path / "state"))
    assert "in use" not in output and "/no/such/model.gguf" in output, output  # once free, the load is reached


def test_serve_refuses_a_state_dir_it_cannot_make_before_loading(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, output = _serve("--port", "0", "--no-metrics",
                          "--state-dir", str(blocker / "state"))
    assert code == 1 and "is not a directory" in output and "Loading" not in output, output


def test_serve_refuses_a_context_past_the_models_before_loading(tiny_gguf, tmp_path, monkeypatch):
    """--context beyond the model's positions was refused only after the load and the weight calibration (minutes on
    a first start): the positions a model directory or a converted GGUF states are read first."""
    import torch

    from kakeya_runtime.models.loader import declared_context, load_model

    monkeypatch.setenv("KAKEYA_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_gguf("llama").path
    unconverted = declared_context(path)  # read from the GGUF header as a stream
    code, output = _serve_model(str(path), "--port", "0", "--no-metrics", "--context", str(unconverted + 1))
    assert code == 2 and f"exceeds the model's {unconverted} positions" in " ".join(output.split()), output
    assert "Loading" not in output and not (tmp_path / "cache").exists(), output  # refused before any conversion
    positions = load_model(path, dtype=torch.float32).config.max_position_embeddings
    assert declared_context(path) == positions == unconverted and declared_context(tmp_path / "nope") is None
    code, output = _serve_model(str(path), "--port", "0", "--no-metrics",
                                "--context", str(positions + 1))
    assert code == 2 and f"--context {positions + 1} exceeds the model's {positions} positions" in " ".join(
        output.split()) and "Loading" not in output, output


def test_gguf_context_length_reads_the_bundled_models_headers(smollm2_bf16):
    """The streaming header read agrees with the loaded model on both real models, and gives None for what is not a
    GGUF."""
    from kakeya_runtime.models import bundled
    from kakeya_runtime.models.loader import cache_root, gguf_context_length

    path = bundled.bundled_gguf_path("smollm2", cache_root(None))
    assert gguf_context_length(path) == smollm2_bf16.config.max_position_embeddings == 8192
    # Gemma 3 270M states 32k positions (loading it here would cost more than this test is worth)
    assert gguf_context_length(bundled.bundled_gguf_path("gemma3-270m", cache_root(None))) == 32768
    assert gguf_context_length(Path(__file__)) is None


def _serve_model(model: str, *args: str) -> tuple[int, str]:
    app = typer.Typer()
    cli.register(app)
    result = CliRunner().invoke(app, ["serve", "--model", model, *args])
    return result.exit_code, result.output


def test_a_port_taken_while_the_model_loaded_is_a_clear_error(busy_port):
    """The port check runs before the model load (minutes on a first start); a port taken meanwhile ended the start
    in grpc's RuntimeError traceback. The server now raises PortTaken, which `kakeya serve` prints as an error."""
    import asyncio

    from kakeya_runtime.server.grpc_app import PortTaken, RuntimeServer, ServerConfig
    from kakeya_runtime.server.testing import tiny_served

    server = RuntimeServer(tiny_served(), ServerConfig(port=busy_port, metrics_port=None))
    with pytest.raises(PortTaken, match=f"could not bind 127.0.0.1:{busy_port}"):
        asyncio.run(server.start())
