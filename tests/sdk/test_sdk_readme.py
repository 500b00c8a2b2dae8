"""The README's Python quickstart, verbatim, against a real server on SmolLM2 (its hand-written second turn once
left out the newline the chat template puts after <|im_end|>)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from kakeya_runtime.server.testing import running_server

README = Path(__file__).resolve().parents[2] / "README.md"


def _quickstart() -> str:
    section = README.read_text().split("## Python quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.real_model
def test_the_readme_python_quickstart_runs(smollm2_bf16):
    from kakeya_runtime.server.grpc_app import ServedModel

    code = _quickstart()
    assert '"127.0.0.1:50051"' in code
    with running_server(ServedModel.from_loaded(smollm2_bf16, "smollm2")) as thread:
        out, ns = io.StringIO(), {}
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace("127.0.0.1:50051", thread.address), "README.md", "exec"), ns)  # noqa: S102
    first, second = out.getvalue().strip().split("\n", 1)[0], out.getvalue().strip().rsplit("\n", 1)[-1]
    assert "Paris" in first and "Rome" in second, out.getvalue()
    tok, history, messages = ns["tok"], list(ns["history"]), ns["messages"]
    # the second turn's tokens made the conversation exactly what the chat template renders
    assert tok.decode(history + tok.chat_delta(history, messages), skip_special_tokens=False) == tok.render_chat(
        messages)
