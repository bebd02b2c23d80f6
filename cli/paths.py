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
    """`path` does not exist: the folder it would be made in must be a writable folder, and
    making it must work (tried, then undone: permissions alone do not tell, e.g. for root on
    a read-only or virtual filesystem, or a name too long)."""
    above = _nearest_existing(path)
    if not above.is_dir():
        raise BadArgument(f"{flag} {path} cannot be created: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise BadArgument(f"{flag} {path} cannot be created: {above} is not writable")
    made = path.absolute()
    try:
        made.mkdir(parents=True)
    except OSError as e:
        raise BadArgument(f"{flag} {path} cannot be created: {e.strerror or e}") from None
    while made != above:  # undo: the command makes it when it writes
        made.rmdir()
        made = made.parent


def _exists(path: Path, flag: str) -> bool:
    """Whether `path` exists; a path the system cannot even look up (a name too long) is
    the user's error."""
    try:
        return path.exists()
    except OSError as e:
        raise BadArgument(f"{flag} {path} cannot be used: {e.strerror or e}") from None


def writable_file(path: Path, flag: str) -> None:
    """Refuse an output file that cannot be written (a folder, or in an unwritable place)."""
    if not _exists(path, flag):
        _creatable(path, flag)
    elif path.is_dir():
        raise BadArgument(f"{flag} {path} is a folder; name a file to write")
    elif not os.access(path, os.W_OK):
        raise BadArgument(f"{flag} {path} is not writable")


def writable_folder(path: Path, flag: str) -> None:
    """Refuse an output folder that is a file or cannot be created or written."""
    if _exists(path, flag):
        if not path.is_dir():
            raise BadArgument(f"{flag} {path} is a file; name a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise BadArgument(f"{flag} {path} is not writable")
    else:
        _creatable(path, flag)
