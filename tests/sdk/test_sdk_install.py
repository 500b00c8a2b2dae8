"""The Python SDK installs on its own: a clean venv, `pip install` of the SDK alone (no runtime, no pre-generated
stubs), then import it and build requests. pip's cache is reused, so only the first run downloads anything."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SDK_DIR = Path(__file__).resolve().parents[2] / "sdks" / "python"

# Runs in the fresh venv, outside the repository: nothing of the runtime or of the repo's src/ is importable.
PROBE = textwrap.dedent("""
    import importlib.util, sys
    import kakeya
    from kakeya import Client, KvPolicy, _convert
    from kakeya._proto import runtime_pb2 as pb, runtime_pb2_grpc as pb_grpc

    assert importlib.util.find_spec("kakeya_runtime") is None, "the runtime leaked into the SDK's venv"
    assert kakeya.__file__.startswith(sys.prefix), kakeya.__file__
    req = _convert.generate_request("ses_x", max_tokens=7, seed=3, temperature=0.5, top_k=4, top_p=0.9,
                                    stop_tokens=[2], ignore_eos=False)
    again = pb.GenerateRequest.FromString(req.SerializeToString())
    assert (again.session_id, again.max_tokens, again.sampling.seed, list(again.stop_token_ids)) == ("ses_x", 7, 3, [2])
    create = _convert.create_request([1, 2], KvPolicy("sink_window", {"sink": 4, "window": 64}))
    assert create.policy.params["window"] == 64
    assert hasattr(pb_grpc, "RuntimeServiceStub")
    Client("127.0.0.1:1").close()  # a channel is lazy: constructing one needs no server
    print("ok", kakeya.__version__)
""")


@pytest.mark.install
def test_sdk_installs_alone_in_a_clean_venv(tmp_path):
    # A copy of the SDK as a fresh checkout (or an sdist) has it: the proto link resolved to the file, no stubs.
    src = tmp_path / "sdk"
    shutil.copytree(SDK_DIR, src, symlinks=False,
                    ignore=shutil.ignore_patterns("_proto", "*.egg-info", "build", "dist", "__pycache__"))
    assert not (src / "src" / "kakeya" / "_proto").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # pip comes from here
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_CACHE_DIR")}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--disable-pip-version-check",
         str(src)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    probe = subprocess.run([str(py), "-I", "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert probe.stdout.split() == ["ok", "0.1.0"]
