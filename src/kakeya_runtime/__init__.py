"""Kakeya: a local LLM runtime for long agent sessions."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kakeya-runtime")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
