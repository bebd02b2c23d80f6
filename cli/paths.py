"""Output paths and input files a command checks before its slow work (loading models,
training, benchmarking): a path it cannot write, or data it cannot use, is the user's
error (`BadArgument` naming the flag: one line, exit code 2), not a failure at the end.
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash_mlx.errors import BadArgument


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _creatable(path: Path, flag: str) -> None:
    """`path` does not exist: the folder it would be made in must be a writable folder."""
    above = _nearest_existing(path)
    if not above.is_dir():
        raise BadArgument(f"{flag} {path} cannot be created: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise BadArgument(f"{flag} {path} cannot be created: {above} is not writable")


def writable_file(path: Path, flag: str) -> None:
    """Refuse an output file that cannot be written (a folder, or in an unwritable place)."""
    if path.is_dir():
        raise BadArgument(f"{flag} {path} is a folder; name a file to write")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise BadArgument(f"{flag} {path} is not writable")
    else:
        _creatable(path, flag)


def writable_folder(path: Path, flag: str) -> None:
    """Refuse an output folder that is a file or cannot be created or written."""
    if path.exists():
        if not path.is_dir():
            raise BadArgument(f"{flag} {path} is a file; name a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise BadArgument(f"{flag} {path} is not writable")
    else:
        _creatable(path, flag)
