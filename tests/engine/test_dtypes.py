"""`--dtype` takes bf16/bfloat16 and fp32/float32 in every command (generate, serve); fp16, which our kernels do not
take, is refused up front."""

from __future__ import annotations

import pytest
import torch
import typer
from typer.testing import CliRunner

from kakeya_runtime.cli import app
from kakeya_runtime.engine.dtypes import dtype_name, parse_dtype
from kakeya_runtime.server import cli as server_cli


@pytest.mark.parametrize(("names", "dtype"), [(("bf16", "bfloat16", "BF16"), torch.bfloat16),
                                              (("fp32", "float32", " Float32 "), torch.float32)])
def test_every_spelling_names_one_dtype(names, dtype):
    assert {parse_dtype(n) for n in names} == {dtype}
    assert {dtype_name(n) for n in names} == {str(dtype).removeprefix("torch.")}


def test_unknown_dtype_lists_the_accepted_names():
    for name in ("int3", "fp16", "float16"):
        with pytest.raises(ValueError, match="bf16 .*bfloat16.*fp32"):
            dtype_name(name)


@pytest.mark.usefixtures("single_thread")
def test_generate_takes_both_spellings(tiny_gguf, tmp_path):
    path, cache = str(tiny_gguf("llama").path), str(tmp_path / "cache")
    outs = [CliRunner().invoke(app, ["generate", "hi", "--model", path, "--cache-dir", cache, "-n", "6",
                                     "--raw", "--dtype", d]) for d in ("fp32", "float32")]
    assert [o.exit_code for o in outs] == [0, 0], outs[0].output
    assert outs[0].stdout == outs[1].stdout


def test_serve_takes_both_spellings():
    server = typer.Typer()
    server_cli.register(server)
    for spelling in ("bf16", "bfloat16", "fp32", "float32"):
        result = CliRunner().invoke(server, ["serve", "--model", "/no/such/model.gguf", "--dtype", spelling,
                                             "--port", "0", "--no-metrics"])
        # Past the dtype check: the model load itself refuses, in one line.
        assert result.exit_code == 1 and "--dtype" not in result.output, (spelling, result.output)
        assert "no such file" in result.output.lower() and "Traceback" not in result.output
    for bad_name in ("int3", "fp16"):
        bad = CliRunner().invoke(server, ["serve", "--model", "/no/such/model.gguf", "--dtype", bad_name])
        assert bad.exit_code == 2 and "--dtype must be" in bad.output
    half = CliRunner().invoke(app, ["generate", "hi", "--model", "/no/such/model.gguf", "--dtype", "fp16"])
    assert half.exit_code == 2 and "--dtype must be" in half.output and "Traceback" not in half.output


def test_generate_help_says_chat_is_the_default():
    text = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "200"}).output
    assert "Chat templating is on by default" in text and "--raw" in text
