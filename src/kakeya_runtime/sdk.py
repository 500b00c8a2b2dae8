"""The commands that render chat prompts (`kakeya generate`, `kakeya chat`, the OpenAI shim) use the kakeya SDK's
tokenizer. `make setup` installs the SDK beside the runtime; a runtime installed on its own needs it installed too,
which these commands check before loading a model."""

from __future__ import annotations

INSTALL = "pip install './sdks/python[tokenize]' from the Kakeya repository; `make setup` installs it"


def sdk_missing(what: str) -> str | None:
    """None when the SDK and its tokenize extra import; else why `what` cannot run."""
    try:
        import kakeya.tokenization  # noqa: F401
    except ImportError as e:
        return f"{what} needs the kakeya SDK with its tokenize extra ({INSTALL}): {e}"
    return None
