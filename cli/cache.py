"""`dflash-mlx cache show|clear`: the prompt cache's folder on disk (`serve`'s
--prompt-cache-dir), read or emptied. Nothing heavy is imported until a command runs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from dflash_mlx.errors import BadArgument

from .errors import user_errors

DEFAULT_DIR = Path("<cache>")  # --prompt-cache-dir: prompt-cache under the cache folder
DISK_GB, MEMORY_GB = 10.0, 2.0  # the prompt cache's default budgets (serve's and chat's)
MAX_CACHE_GB = 1_000_000  # a budget above this (a petabyte) is a typo, not a budget

app = typer.Typer(
    help="Show or clear the prompt cache on disk (prompt prefixes the server keeps).",
    no_args_is_help=True,
)

Folder = Annotated[
    Path | None,
    typer.Option(
        "--prompt-cache-dir",
        "--dir",
        help="The prompt cache folder, as serve's and chat's --prompt-cache-dir "
        "(--dir: its old name).",
        show_default="prompt-cache in the cache folder",
    ),
]


def _folder(folder: Path | None) -> Path:
    from dflash_mlx.paths import cache_dir

    return folder if folder is not None else cache_dir() / "prompt-cache"


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


@app.command()
def show(
    folder: Folder = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """How many prompt blocks the folder holds, their size, first and last use."""
    with user_errors():
        from dflash_mlx.cache.prompt_store.disk import summary

        info = summary(_folder(folder))
        if as_json:
            typer.echo(json.dumps(info))
            return
        if not info["exists"]:
            typer.echo(f"{info['folder']}: no prompt cache yet")
            return
        typer.echo(
            f"{info['folder']}: {info['blocks']} blocks, {info['bytes'] / 1e6:.1f} MB; "
            f"used {_when(info['oldest_use'])} to {_when(info['latest_use'])}"
        )


@app.command()
def clear(
    folder: Folder = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask first.")] = False,
) -> None:
    """Remove every prompt block from the folder (servers using it prefill again)."""
    with user_errors():
        from dflash_mlx.cache.prompt_store.disk import clear_folder, summary

        path = _folder(folder)
        info = summary(path)
        if not info["blocks"]:
            typer.echo(f"{path}: nothing to clear")
            return
        if not yes:
            typer.confirm(
                f"remove {info['blocks']} blocks ({info['bytes'] / 1e6:.1f} MB) from {path}?",
                abort=True,
            )
        n, size = clear_folder(path)
        typer.echo(f"{path}: removed {n} blocks, {size / 1e6:.1f} MB")


def prompt_cache_folder(folder: Path | None, off: bool) -> Path | None:
    """--prompt-cache-dir, its default, or None with --no-prompt-cache-dir."""
    if folder is not None and off:
        raise BadArgument("pass either --prompt-cache-dir or --no-prompt-cache-dir, not both")
    return None if off else folder or DEFAULT_DIR


def prompt_store(folder: Path | None, disk_gb: float, memory_gb: float):
    """`(PromptStore, note)`: the server's store, on disk under `folder` (`DEFAULT_DIR`: the
    cache folder's prompt-cache; None: memory only), and the line saying where (shown once
    the server listens, so that a refusal before is one `error:` line alone)."""
    from dflash_mlx.cache.prompt_store import GB, PromptStore
    from dflash_mlx.paths import cache_dir

    if folder == DEFAULT_DIR:
        folder = cache_dir() / "prompt-cache"
    store = PromptStore(folder, disk_bytes=int(disk_gb * GB), memory_bytes=int(memory_gb * GB))
    note = None
    if folder is not None:
        note = f"prompt cache: {folder} (up to {disk_gb:g} GB; --no-prompt-cache-dir: none)"
    return store, note
