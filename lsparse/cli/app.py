"""The typer application every command registers on, and the options before the command."""

from __future__ import annotations

import json

import typer

from lsparse.errors import LsparseError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run language models larger than RAM by paging sparse FFN neurons from flash.")


def _version(value: bool):
    if value:
        from lsparse import __version__
        typer.echo(f"lsparse {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
):
    """Run language models larger than RAM by paging sparse FFN neurons from flash."""


def numbers(text: str, option: str) -> tuple[float, ...]:
    """A comma-separated list of numbers given to `option` ('' is none)."""
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise LsparseError(f"{option} must be comma-separated numbers, got {text!r}") from None


def show(result: dict, as_json: bool, printer) -> None:
    """A command's result: as JSON for scripts, or printed for people."""
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        printer(result)
