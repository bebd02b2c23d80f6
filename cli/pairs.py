"""Which draft goes with a target: the one lookup `generate`, `chat`, `serve` and `bench` make.

`--draft DRAFT` is used as given; `--no-draft` decodes with the target alone; with neither,
the registry of published drafts (`dflash_mlx.models.registry`) names the draft for the target
(conversions such as `mlx-community/Qwen3-4B-4bit` included). A target with no known draft
is decoded plainly, with one note saying how to add a draft: never an error. Knows names
only: loads nothing, and imports the library inside the function (`--help` stays free of
mlx).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_mlx.errors import BadArgument

if TYPE_CHECKING:
    from dflash_mlx.models.registry import DraftEntry

NO_DRAFT = "no draft: the target decodes alone, without speculation"


@dataclass(frozen=True)
class DraftChoice:
    """What to load as the draft, where it came from, and the one note to show."""

    draft: str | None  # Hub id or folder; None: the target decodes alone
    entry: DraftEntry | None  # the registry's entry, when the draft is its published one
    note: str | None  # None: nothing worth a line


def no_known_draft(model: str) -> str:
    """The note for a target the registry has no draft for."""
    return (
        f"no known DFlash draft for {model}: decoding with the target alone (plain decoding). "
        "To speculate, pass --draft DRAFT, a DFlash draft trained for this target "
        "(dflash-mlx train makes one)"
    )


def default_target(model: str | None, draft: str | None) -> str:
    """`--model`, or when left out the default target `chat` uses too (with a note saying
    so); a `--draft` without `--model` is refused: the draft is trained for one target."""
    if model is not None:
        return model
    if draft is not None:
        raise BadArgument("--draft needs --model: the target it was trained for")
    from dflash_mlx.models.registry import DEFAULT_TARGET

    from . import ui

    ui.note(
        f"model: {DEFAULT_TARGET}, the default (--model picks another; --demo runs the tiny "
        "demo pair offline)"
    )
    return DEFAULT_TARGET


def check_source(flag: str, source: str) -> None:
    """A `--model` / `--draft` that can be neither a folder nor a Hub id fails now, before
    any note or download, in the loader's words (`dflash_mlx.models.loading.resolve`)."""
    from pathlib import Path

    if Path(source).expanduser().exists():
        return
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise BadArgument(
            f"{flag} {source!r}: no such folder, and not a Hub id of the form 'org/name'"
        )


def choose_draft(model: str, draft: str | None, no_draft: bool) -> DraftChoice:
    """The draft for `model`: as given, none (--no-draft), or the registry's published one.
    Sources that cannot exist are refused first (`check_source`)."""
    from dflash_mlx.models.registry import find_draft

    if draft is not None and no_draft:
        raise BadArgument("pass either --draft or --no-draft, not both")
    check_source("--model", model)
    if draft is not None:
        check_source("--draft", draft)
    entry = find_draft(model)
    if no_draft:
        return DraftChoice(None, None, NO_DRAFT)
    if draft is not None:
        return DraftChoice(
            draft, entry if entry is not None and entry.draft == draft else None, None
        )
    if entry is None:
        return DraftChoice(None, None, no_known_draft(model))
    return DraftChoice(
        entry.draft,
        entry,
        f"draft: {entry.draft}, published for {entry.target} (--draft picks another, "
        "--no-draft none)",
    )


def check_sources(model: str | None, draft: str | None) -> None:
    """A --model/--draft that can be neither a folder nor a Hub id fails before anything
    heavy is imported (`check_source`)."""
    for flag, source in (("--model", model), ("--draft", draft)):
        if source is not None:
            check_source(flag, source)
