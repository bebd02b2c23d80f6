"""Command-line options that several commands share, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

Model = Annotated[str | None, typer.Option(help="Target: Hub id or local mlx-lm folder.")]
Draft = Annotated[str | None, typer.Option(help="DFlash draft: Hub id or local folder.")]
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
