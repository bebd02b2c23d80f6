"""Command-line options that several commands share, declared once."""

from __future__ import annotations

import math
import sys
from typing import Annotated

import typer

from dflash_mlx.errors import BadArgument


def finite(value: float | None) -> float | None:
    """Callback of every float option: click's FLOAT accepts inf and nan, which no option
    means; they are a usage error naming the option (exit 2)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def unicode_text(option: str, value: str) -> str:
    """`value` if it is valid Unicode, else a `BadArgument` naming `option` and the position
    (the library's one rule: `dflash_mlx.text.check_text`)."""
    from dflash_mlx.text import check_text

    return check_text(option, value)


def stdin_is_terminal() -> bool:
    """Whether stdin is a terminal (or absent): nothing to read a prompt from."""
    return sys.stdin is None or sys.stdin.isatty()


def read_stdin() -> str:
    """All of stdin as text, decoded as UTF-8 with surrogateescape (whatever the locale):
    bytes that are not UTF-8 become lone surrogates, which `unicode_text` names."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text-only stream (a test's, an embedding's): already decoded
        return sys.stdin.read()
    return raw.read().decode("utf-8", "surrogateescape")


Temp = Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.", callback=finite)]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass; 1 disables.", callback=finite)]
Model = Annotated[
    str | None, typer.Option("--model", "-m", help="Target: Hub id or local mlx-lm folder.")
]
Draft = Annotated[
    str | None, typer.Option("--draft", "-d", help="DFlash draft: Hub id or local folder.")
]
Demo = Annotated[
    bool, typer.Option("--demo", help="Use the tiny demonstration pair: no downloads.")
]
DraftWindow = Annotated[
    int | None,
    typer.Option(
        help="Positions a draft block sees on long contexts: its anchor and the N - 1 before "
        "it (default: the draft's own sliding window, else all).",
        show_default=False,
    ),
]
VerifyWidth = Annotated[
    int | None,
    typer.Option(
        help="Verify width W: tokens the target checks per cycle (≤ the draft's block; "
        "1: plain decoding; default: picked per cycle for this device).",
        show_default=False,
    ),
]
# The old name of --verify-width: still accepted, with a note.
BlockSize = Annotated[
    int | None,
    typer.Option("--block-size", hidden=True, help="Deprecated: use --verify-width."),
]


def verify_width(width: int | None, block_size: int | None) -> int | None:
    """--verify-width, or the deprecated --block-size (with a note on stderr)."""
    from . import ui

    if block_size is None:
        return width
    ui.note("note: --block-size is deprecated; use --verify-width")
    if width is not None and width != block_size:
        raise BadArgument(f"--block-size {block_size} and --verify-width {width} disagree")
    return block_size
