"""How a command ends when something goes wrong: whose fault it was, as an exit code.

The library's `UserError` family (a bad argument, a checkpoint that cannot be used, a
context too long) is the user's: one red `error:` line naming the value, exit code 2.
Ctrl-C: exit code 130. Anything else is ours: one line saying so, a hint on how to see the
traceback (`DFLASH_MLX_DEBUG=1`), exit code 1. The codes live in `dflash_mlx.errors`
(which imports nothing heavy, so `--help` stays free of mlx).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import click
import typer

from dflash_mlx.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USER, UserError

from . import ui

DEBUG_ENV = "DFLASH_MLX_DEBUG"


@contextmanager
def user_errors() -> Iterator[None]:
    """Run a command body, turning exceptions into a message and an exit code."""
    try:
        yield
    except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
        raise
    except KeyboardInterrupt:
        ui.interrupted()
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:
        if isinstance(e, UserError):
            ui.error(str(e))
            raise typer.Exit(EXIT_USER) from None
        internal(e)


def internal(e: BaseException) -> NoReturn:
    """Report `e` as a bug of ours (not the user's input) and exit with `EXIT_INTERNAL`."""
    if os.environ.get(DEBUG_ENV):
        traceback.print_exception(e)
    ui.error(
        f"internal error: {type(e).__name__}: {e} (a bug in dflash-mlx, not your input; "
        f"set {DEBUG_ENV}=1 for the traceback and please report it)"
    )
    raise typer.Exit(EXIT_INTERNAL) from None


def usage_error(e: click.ClickException) -> None:
    """A usage error (an unknown option, a value of the wrong type, a missing option) as the
    other errors are: one `error:` line naming it, and where to find the options; exit 2.
    Replaces typer's usage line, hint and boxed panel."""
    if type(e).__name__ == "NoArgsIsHelpError":  # the help was shown: nothing to add
        return
    ctx = getattr(e, "ctx", None)
    hint = f" (options: {ctx.command_path} -h)" if ctx is not None else ""
    ui.error(e.format_message() + hint)


def install_usage_errors() -> None:
    """Have typer render usage errors with `usage_error` (idempotent)."""
    from typer import rich_utils

    rich_utils.rich_format_error = usage_error
    click.ClickException.show = lambda self, file=None: usage_error(self)
