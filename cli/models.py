"""`dflash-mlx ls / pull / rm`: the models on this machine (the Hugging Face cache and
`--models-dir` folders), fetching a target with its DFlash draft, removing one.
The finding and fetching is `dflash_mlx.models.hub`; this module renders."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from . import ui
from .errors import user_errors

ModelsDir = Annotated[
    list[Path] | None,
    typer.Option(
        "--models-dir",
        help="A folder of model folders to list too (repeatable).",
        show_default=False,
    ),
]


def _pairing(m) -> str:
    if m.is_draft:
        return f"DFlash draft for {m.draft_for}" if m.draft_for else "DFlash draft"
    if m.draft is None:
        return "no known draft"
    return f"draft {m.draft} " + ("(here)" if m.draft_here else "(not downloaded)")


def ls(
    models_dir: ModelsDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON list on stdout.")] = False,
) -> None:
    """List the models here (Hugging Face cache, --models-dir): size, weights, DFlash draft."""
    with user_errors():
        from dflash_mlx.models.hub import hub_cache, human_size, list_models

        models = list_models(models_dir or [])
        if as_json:
            typer.echo(json.dumps([m.to_dict() for m in models]))
            return
        if not models:
            where = f"the Hugging Face cache ({hub_cache()})"
            if models_dir:
                where += " or " + ", ".join(str(d) for d in models_dir)
            typer.echo(
                f"no models in {where}; `dflash-mlx pull mlx-community/Qwen3-4B-4bit` "
                "fetches one with its draft"
            )
            return
        table = Table(box=None, header_style="bold", pad_edge=False)
        for column in ("MODEL", "SIZE", "WEIGHTS", "DFLASH", "WHERE"):
            table.add_column(column, justify="right" if column == "SIZE" else "left")
        for m in models:
            where = "hf cache" if m.source == "hf-cache" else str(m.path.parent)
            table.add_row(m.name, human_size(m.size_bytes), m.weights, _pairing(m), where)
        # In a terminal, fitted to its width; on a pipe, one whole line per model.
        wide = None if sys.stdout.isatty() else 100_000
        Console(highlight=False, width=wide).print(table)
        missing = [m for m in models if m.draft and not m.draft_here]
        for m in missing:
            ui.note(f"{m.name}'s draft is not here: dflash-mlx pull {m.name}")


def pull(
    target: Annotated[str, typer.Argument(help="A Hugging Face model id (org/name).")],
    draft: Annotated[
        str | None,
        typer.Option("--draft", "-d", help="The draft to fetch (default: the registry's)."),
    ] = None,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Fetch the target alone.")] = False,
) -> None:
    """Download a target and its DFlash draft (the registry's, or --draft), with progress."""
    with user_errors():
        from dflash_mlx.errors import BadArgument
        from dflash_mlx.models.hub import download, human_size, plan_pull
        from dflash_mlx.models.registry import find_draft

        if draft is not None and no_draft:
            raise BadArgument("--draft and --no-draft: give one")
        plan = plan_pull(target, draft=draft, with_draft=not no_draft)
        if not no_draft and draft is None and find_draft(target) is None:
            ui.note(
                f"no DFlash draft is known for {target}: fetching the target alone (it runs "
                "plainly; --draft DRAFT fetches one)"
            )
        for item in plan:
            size = human_size(item.size_bytes) if item.size_bytes is not None else "size unknown"
            ui.note(f"pulling {item.repo_id} ({item.files} files, {size})")
            folder = download(item)
            ui.note(f"{item.repo_id}: {folder}")
        runs = f"dflash-mlx chat --model {target}"
        if draft is not None:
            runs += f" --draft {draft}"
        ui.note(f"ready: {runs}")


def rm(
    name: Annotated[str, typer.Argument(help="A model as `dflash-mlx ls` names it.")],
    models_dir: ModelsDir = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask first.")] = False,
) -> None:
    """Remove a model from the Hugging Face cache (every revision) or --models-dir."""
    with user_errors():
        from dflash_mlx.errors import BadArgument
        from dflash_mlx.models.hub import check_removable, find, human_size, remove

        model = find(name, models_dir or [])
        check_removable(model)  # before asking
        where = "the Hugging Face cache" if model.source == "hf-cache" else str(model.path)
        if not yes:
            if not sys.stdin.isatty():
                raise BadArgument(f"rm {name}: not a terminal to ask in; pass --yes to remove it")
            typer.confirm(
                f"remove {name} ({human_size(model.size_bytes)}) from {where}?", abort=True
            )
        freed = remove(model)
        typer.echo(f"removed {name} from {where}, {human_size(freed)} freed")
