"""Command-line options that several commands share, declared once."""

from __future__ import annotations

from typing import Annotated

import typer

Model = Annotated[str | None, typer.Option(help="Target: Hub id or local mlx-lm folder.")]
Draft = Annotated[str | None, typer.Option(help="DFlash draft: Hub id or local folder.")]
Demo = Annotated[
    bool, typer.Option("--demo", help="Use the tiny demonstration pair: no downloads.")
]
