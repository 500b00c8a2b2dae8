"""What the `kakeya bench` and `kakeya calibrate` commands share at their boundary: list options parsed into clear
usage errors, and the runtime's own typed errors (a bad policy parameter, a model that does not load, a length past
the context) answered as one line and exit status 2 instead of a traceback, before any evidence file is written."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    import torch

USAGE_EXIT = 2  # what click gives a bad option: the same for a bad value found once the command runs
DTYPES = ("bf16", "fp32")


class BenchInputError(ValueError):
    """A bench option the command cannot run with, found once it runs (an unknown name, a file it cannot write)."""


def csv(value: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c')."""
    return tuple(v.strip() for v in value.split(",") if v.strip())


def items(value: str, name: str, known: Iterable[str] | None = None) -> tuple[str, ...]:
    """A comma-separated list that must name something (an empty one measured nothing and said so with exit 0),
    each item among `known` when given."""
    got = csv(value)
    if not got:
        raise typer.BadParameter(f"{name}: give at least one value")
    allowed = None if known is None else tuple(known)
    bad = [] if allowed is None else [v for v in got if v not in allowed]
    if bad:
        raise typer.BadParameter(f"{name}: unknown {', '.join(bad)} (one of: {', '.join(allowed or ())})")
    return got


def dtype_of(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise BenchInputError(f"--dtype {name!r}: one of {', '.join(DTYPES)}")
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def positive_ints(value: str, name: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    """Comma-separated integers, each at least 1 (lengths, counts); '' only where `allow_empty` (an optional run)."""
    try:
        got = tuple(int(v) for v in csv(value))
    except ValueError:
        raise typer.BadParameter(f"{name}: expected comma-separated integers, got {value!r}") from None
    if not got and not allow_empty:
        raise typer.BadParameter(f"{name}: give at least one value")
    bad = [v for v in got if v < 1]
    if bad:
        raise typer.BadParameter(f"{name}: every value must be at least 1, got {', '.join(map(str, bad))}")
    return got


def floats_in(value: str, name: str, lo: float, hi: float) -> tuple[float, ...]:
    """Comma-separated numbers in [lo, hi], at least one."""
    try:
        got = tuple(float(v) for v in csv(value))
    except ValueError:
        raise typer.BadParameter(f"{name}: expected comma-separated numbers, got {value!r}") from None
    if not got:
        raise typer.BadParameter(f"{name}: give at least one value")
    bad = [v for v in got if not lo <= v <= hi]
    if bad:
        raise typer.BadParameter(f"{name}: every value must lie in [{lo:g}, {hi:g}], got {', '.join(map(str, bad))}")
    return got


def check_model(name: str, also: Iterable[str] = ()) -> str:
    """A model a bench can load: bundled, an existing path, or one of `also` (a bench's own random-weight models);
    checked before work starts (a child process's load failure was a traceback or a 'failed job' with exit 0)."""
    from kakeya_runtime.models import bundled

    if name in tuple(also) or bundled.is_bundled(name) or (name.strip() and Path(name).expanduser().exists()):
        return name
    raise BenchInputError(f"{name!r}: no such file or directory, and not a bundled model (bundled: "
                          f"{', '.join(sorted(bundled.BUNDLED))})")


def make_out_dirs(out: str) -> list[Path]:
    """The folders a command writes `out` under, made before any work (a path it could not write once failed with a
    traceback after the whole run); returns those it created, deepest last, for removal if the command is refused."""
    path = Path(out).expanduser()
    folder = path.parent if path.suffix else path
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK) or (path.suffix and path.exists() and not os.access(path, os.W_OK)):
            raise PermissionError(13, "not writable")
    except OSError as e:
        _remove_empty(missing)
        raise BenchInputError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


def is_input_error(error: BaseException) -> bool:
    """One of the runtime's typed errors for a request it cannot take (they derive from ValueError, or are the
    sessions' typed errors); a ValueError from elsewhere (a bug) keeps its traceback."""
    from kakeya_runtime.sessions.errors import SessionError

    return isinstance(error, ValueError | SessionError) and type(error).__module__.startswith("kakeya_runtime.")


def answers_bad_input(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command: the runtime's typed errors become 'error: <message>' on stderr and exit status 2."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        created: list[Path] = []
        try:
            if kwargs.get("out"):
                created = make_out_dirs(str(kwargs["out"]))
            return command(*args, **kwargs)
        except Exception as e:
            if not is_input_error(e) and not isinstance(e, typer.BadParameter):
                raise
            _remove_empty(created)  # refused: no folder left behind for evidence that was never written
            if isinstance(e, typer.BadParameter):
                raise
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(USAGE_EXIT) from None

    return run
