"""What every relayout command shares, whether `relayout X` runs it or `python -m ...` does: a
one-line error and exit code, and every RELAYOUT_* variable checked before anything starts. Light on
purpose (typer and rich only): the `relayout` CLI imports the commands defined with it for its help."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

_err = Console(stderr=True)


def fail(msg: str, code: int = 2) -> NoReturn:
    """One line saying what is wrong, exit `code` (2: bad input)."""
    _err.print(f"[red]error:[/red] {escape(msg)}", soft_wrap=True)  # one line, however wide the terminal
    raise typer.Exit(code)


def run_as_main(command: Callable[..., Any], prog: str, argv: list[str] | None = None) -> None:
    """`python -m prog`: the command's own flags (the ones `relayout` registers), settings checked first."""
    from relayout.storage.settings import SettingsError, check_settings

    try:
        check_settings()  # every RELAYOUT_* variable, before anything starts
    except SettingsError as e:
        raise SystemExit(f"error: {e}") from None
    app = typer.Typer(add_completion=False)
    app.command()(command)
    app(args=argv, prog_name=prog)
