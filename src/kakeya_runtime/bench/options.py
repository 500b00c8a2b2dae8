"""What the `kakeya bench` and `kakeya calibrate` commands share at their boundary: list options parsed into clear
usage errors, and the runtime's own typed errors (a bad policy parameter, a model that does not load, a length past
the context) answered as one line and exit status 2 instead of a traceback, before any evidence file is written."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer

USAGE_EXIT = 2  # what click gives a bad option: the same for a bad value found once the command runs


def csv(value: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c')."""
    return tuple(v.strip() for v in value.split(",") if v.strip())


def positive_ints(value: str, name: str) -> tuple[int, ...]:
    """Comma-separated integers, each at least 1 (lengths, counts); '' is the empty list."""
    try:
        got = tuple(int(v) for v in csv(value))
    except ValueError:
        raise typer.BadParameter(f"{name}: expected comma-separated integers, got {value!r}") from None
    bad = [v for v in got if v < 1]
    if bad:
        raise typer.BadParameter(f"{name}: every value must be at least 1, got {', '.join(map(str, bad))}")
    return got


def floats_in(value: str, name: str, lo: float, hi: float) -> tuple[float, ...]:
    """Comma-separated numbers in [lo, hi]."""
    try:
        got = tuple(float(v) for v in csv(value))
    except ValueError:
        raise typer.BadParameter(f"{name}: expected comma-separated numbers, got {value!r}") from None
    bad = [v for v in got if not lo <= v <= hi]
    if bad:
        raise typer.BadParameter(f"{name}: every value must lie in [{lo:g}, {hi:g}], got {', '.join(map(str, bad))}")
    return got


def is_input_error(error: BaseException) -> bool:
    """One of the runtime's typed errors for a request it cannot take (they derive from ValueError, or are the
    sessions' typed errors); a ValueError from elsewhere (a bug) keeps its traceback."""
    from kakeya_runtime.sessions.errors import SessionError

    return isinstance(error, ValueError | SessionError) and type(error).__module__.startswith("kakeya_runtime.")


def answers_bad_input(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command: the runtime's typed errors become 'error: <message>' on stderr and exit status 2."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except Exception as e:
            if not is_input_error(e):
                raise
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(USAGE_EXIT) from None

    return run
