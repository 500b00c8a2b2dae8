"""`kakeya` command line: each area registers its own commands (generate, serve, chat, bench ...)."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(help="Kakeya: a local LLM runtime for long agent sessions.", no_args_is_help=True)


def _show_version(value: bool) -> None:
    if value:
        from kakeya_runtime import __version__

        typer.echo(f"kakeya-runtime {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                       help="Print the runtime's version and exit.")) -> None:
    """Kakeya: a local LLM runtime for long agent sessions."""

# Modules that define `register(app: typer.Typer) -> None`; each owns its commands.
COMMAND_MODULES = (
    "kakeya_runtime.engine.cli",  # generate
    "kakeya_runtime.server.cli",  # serve, chat
    "kakeya_runtime.bench.cli",  # bench engine | session | niah
)

for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as e:
        if e.name != _name:
            raise
        continue
    _module.register(app)


if __name__ == "__main__":
    app()
