"""Where dflash-mlx keeps what it builds or measures on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$DFLASH_MLX_CACHE`, else `$XDG_CACHE_HOME/dflash-mlx`, else `~/.cache/dflash-mlx`."""
    root = os.environ.get("DFLASH_MLX_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dflash-mlx"
