"""Build hook: the runtime's gRPC stubs (kakeya_runtime/_proto) are generated from proto/ whenever the package is
built, as the SDK's are (sdks/python/setup.py), so a wheel or an sdist built from a clean checkout serves.
grpcio-tools is a build requirement only. Everything else about the package is in pyproject.toml."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        # Into src/kakeya_runtime/_proto (gitignored), before build_py collects the packages: a wheel copies it from
        # there and an editable install imports it in place. protogen needs only the standard library and protoc.
        sys.path.insert(0, str(HERE / "src"))
        from kakeya_runtime import protogen

        protogen.generate((HERE / "src" / "kakeya_runtime" / "_proto",))
        for packages in (self.packages, self.distribution.packages):  # absent when the build was configured
            if packages is not None and "kakeya_runtime._proto" not in packages:
                packages.append("kakeya_runtime._proto")
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
