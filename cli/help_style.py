"""How `--help` shows options and arguments: as click always did, where typer 0.2x differs.

Recent typer versions print a type after every option (`--json <bool>`, a flag that takes
no value) and wrap a required argument in braces in the usage line (`{source}`). Flags get
no type here, and arguments read as click writes them: `SOURCE`, `[PROMPT]`. Guarded by
`hasattr`: with a typer that has none of these methods nothing changes.
"""

from __future__ import annotations

from typer import core


def _display_type_rich(original):
    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False):  # --json, --chat/--raw: no value to type
            return None
        return original(self, ctx)

    return display_type_rich


def _usage_display_name(self) -> str:
    name = self.display_name_raw.upper()
    if self.nargs != 1:
        name += "..."
    return name if self.required else f"[{name}]"


def _rich_display_name(self) -> str:
    name = self.display_name_raw.upper()
    return name + ("..." if self.metavar is None and self.nargs != 1 else "")


def install() -> None:
    """Patch typer's help rendering once (idempotent)."""
    option = getattr(core, "TyperOption", None)
    if option is not None and hasattr(option, "display_type_rich"):
        if not getattr(option.display_type_rich, "_dflash", False):
            patched = _display_type_rich(option.display_type_rich)
            patched._dflash = True
            option.display_type_rich = patched
    argument = getattr(core, "TyperArgument", None)
    if argument is not None and hasattr(argument, "_usage_display_name"):
        argument._usage_display_name = _usage_display_name
    if argument is not None and hasattr(argument, "_rich_display_name"):
        argument._rich_display_name = _rich_display_name
