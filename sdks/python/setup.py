"""Build hook: the gRPC stubs (kakeya/_proto) are generated from the proto whenever the SDK is built.

`proto/kakeya/v1/runtime.proto` here is a link to the repository's proto, the one source of truth (an sdist
carries the file itself). grpcio-tools is a build requirement only; the installed SDK needs grpcio + protobuf.
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE / "proto"
PROTO_FILE = "kakeya/v1/runtime.proto"  # relative to PROTO_ROOT, as protoc sees it
GENERATED = ("runtime_pb2.py", "runtime_pb2.pyi", "runtime_pb2_grpc.py")
STAMP = ".proto-sha256"  # the same stamp the runtime's protogen writes, so both agree on freshness
# protoc emits `from kakeya.v1 import runtime_pb2`; the stubs live in kakeya._proto, so make it relative.
_ABS_IMPORT = re.compile(r"^from kakeya\.v1 import (runtime_pb2\b.*)$", re.MULTILINE)
HEADER = "# Generated from proto/kakeya/v1/runtime.proto when the kakeya SDK was built. Do not edit.\n"


def generate_stubs(package_root: Path) -> Path:
    """Run protoc on the proto and write the stubs into `package_root`/kakeya/_proto."""
    import grpc_tools
    from grpc_tools import protoc

    proto = PROTO_ROOT / PROTO_FILE
    if not proto.is_file():
        raise FileNotFoundError(f"{proto} is missing: the SDK is built from the repository's proto/")
    wkt = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/struct.proto ships with grpc_tools
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{wkt}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", PROTO_FILE]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
        produced = Path(tmp) / Path(PROTO_FILE).parent
        texts = {name: _ABS_IMPORT.sub(r"from . import \1", (produced / name).read_text()) for name in GENERATED}
    out = package_root / "kakeya" / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    (out / "__init__.py").write_text(HEADER)
    for name, text in texts.items():
        (out / name).write_text(HEADER + text)
    (out / STAMP).write_text(hashlib.sha256(proto.read_bytes()).hexdigest() + "\n")
    return out


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        # Into src/kakeya/_proto (gitignored), before build_py collects the package: a wheel copies it from there
        # and an editable install imports it in place.
        generate_stubs(HERE / "src")
        for packages in (self.packages, self.distribution.packages):  # absent when the build was configured
            if packages is not None and "kakeya._proto" not in packages:
                packages.append("kakeya._proto")
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
