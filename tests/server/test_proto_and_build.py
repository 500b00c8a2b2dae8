"""The proto is the single source of truth: buf-clean, and the generated stubs come from it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from kakeya_runtime import protogen

REPO = protogen.REPO_ROOT


def _buf() -> str:
    local = Path(sys.executable).parent / "buf"
    return str(local) if local.exists() else (shutil.which("buf") or "buf")


def test_buf_lint_passes():
    proc = subprocess.run([_buf(), "lint"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"buf lint failed:\n{proc.stdout}\n{proc.stderr}"


def test_stubs_are_generated_from_the_current_proto():
    protogen.ensure()
    for target in protogen.TARGETS:
        assert protogen.is_current(target)
        grpc_stub = (target / "runtime_pb2_grpc.py").read_text()
        assert "from . import runtime_pb2" in grpc_stub  # relative: works as a subpackage
        assert "from kakeya.v1 import" not in grpc_stub


def test_generate_writes_both_packages(tmp_path):
    out = (tmp_path / "a", tmp_path / "b")
    protogen.generate(out)
    for target in out:
        assert sorted(p.name for p in target.iterdir()) == sorted(
            ["__init__.py", protogen.STAMP, *protogen.GENERATED]
        )


def test_runtime_has_no_chat_template_logic():
    # Seed 000 §2.4: the runtime carries the template as data and never renders it.
    pattern = re.compile(r"apply_chat_template|^\s*(import|from) jinja2", re.MULTILINE)
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "src" / "kakeya_runtime").rglob("*.py")
        if "_proto" not in p.parts and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_sdk_imports_nothing_from_the_runtime():
    code = (
        "import sys, kakeya, kakeya.aio, kakeya.client, kakeya.tokenization, kakeya.errors\n"
        "bad = [m for m in sys.modules if m.startswith('kakeya_runtime') or m == 'torch']\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    imports = re.compile(r"^\s*(from|import) kakeya_runtime", re.MULTILINE)
    sources = (REPO / "sdks" / "python" / "src" / "kakeya").rglob("*.py")
    assert not [p for p in sources if imports.search(p.read_text())]
