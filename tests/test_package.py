"""The runtime as a package: a wheel built from a clean checkout carries what `kakeya serve` needs outside the
repository (gRPC stubs generated at build time, kernel sources, head profiles), the installed version is visible,
and the commands that need the SDK say so before loading a model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kakeya_runtime
from kakeya_runtime.cli import app

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.install
def test_a_wheel_from_a_clean_checkout_carries_the_stubs(tmp_path):
    """The stubs are gitignored build outputs: a wheel of a fresh clone had none, and its `kakeya serve` failed with
    'gRPC stubs missing' and a fix (protogen) that needs a checkout."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    src = tmp_path / "checkout"
    for name in filter(None, tracked.decode().split("\0")):
        if name.startswith(("sdks/", "tests/", "results/", "docs/")):
            continue
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    assert not (src / "src" / "kakeya_runtime" / "_proto").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_CACHE_DIR")}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
                            "-w", str(tmp_path / "dist"), str(src)], env=env, capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("kakeya_runtime-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("kakeya_runtime/_proto/runtime_pb2.py", "kakeya_runtime/_proto/runtime_pb2_grpc.py",
                   "kakeya_runtime/models/csrc/cached_attention.cpp", "kakeya_runtime/models/csrc/common.h"):
        assert needed in names, needed
    assert any(n.startswith("kakeya_runtime/kv/profiles/") and n.endswith(".json") for n in names)


def test_the_version_is_visible():
    """`kakeya --version`, GetModelInfo and /metrics name the runtime's version (nothing did: an operator could not
    tell which runtime a client was talking to)."""
    from kakeya import Client

    from kakeya_runtime.server.testing import metric_value, running_server, scrape_metrics, tiny_served

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"kakeya-runtime {kakeya_runtime.__version__}"
    assert kakeya_runtime.__version__ == "0.1.0"
    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        assert client.model_info().runtime_version == "0.1.0"
        assert metric_value(scrape_metrics(thread), "kakeya_build_info", '{version="0.1.0"}') == 1


def test_commands_that_need_the_sdk_say_so_before_loading_a_model(monkeypatch):
    """Without the SDK (a runtime installed on its own), `kakeya generate` loaded the model for ~20 s and then
    failed, and `kakeya serve --openai-port` loaded and measured the weights first."""
    from kakeya_runtime.models import loader

    monkeypatch.setitem(sys.modules, "kakeya.tokenization", None)  # import fails as if not installed

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "load_model", no_load)
    for args in (["generate", "hi"], ["serve", "--openai-port", "0", "--port", "0", "--metrics-port", "0"]):
        result = CliRunner().invoke(app, args)
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and "needs the kakeya SDK with its tokenize extra" in text, (args, text)
