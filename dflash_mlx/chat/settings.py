"""Chat's `/set NAME VALUE`: which `GenerateOptions` field a name sets, and the typed value.

Only the text is read here: the value is validated by `GenerateOptions` itself (its
`BadArgument` names the field), and what depends on the pair (a verify width the draft's
block cannot hold) by the `Pair`. Imports nothing heavy, so the REPL can list the names.
"""

from __future__ import annotations

from typing import Any

from ..errors import BadArgument

# `/set` names -> GenerateOptions fields.
NAMES = {
    "temp": "temperature",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_tokens": "max_tokens",
    "verify_width": "verify_width",
    "tree": "tree",
    "seed": "seed",
    "draft_window": "draft_window",
    "draft_sink": "draft_sink",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
}
DEPRECATED = {"block_size": "verify_width"}  # old names: they work, with a note
INTEGERS = {"top_k", "max_tokens", "verify_width", "seed", "draft_window", "draft_sink"}
# Fields that take None, and the words that mean it (the first is how it is shown).
UNSET = {
    "verify_width": ("auto", "none"),
    "seed": ("none", "auto", "random"),
    "draft_window": ("auto", "none", "default"),
    "draft_sink": ("auto", "none", "default"),
    "repetition_penalty": ("off", "none"),
    "tree": ("auto", "none", "chosen"),
}
# Switches: the words for True and for False (the first of each is how it is shown).
SWITCHES = {"tree": (("on", "true", "yes"), ("off", "false", "no"))}


def choices(field: str) -> str | None:
    """The words a field takes besides numbers, as `/help` lists them: `or auto` (None),
    `on, off or auto` (a switch); None: numbers only."""
    if field in SWITCHES:
        return f"{SWITCHES[field][0][0]}, {SWITCHES[field][1][0]} or {UNSET[field][0]}"
    return f"or {UNSET[field][0]}" if field in UNSET else None


def shown_names() -> list[str]:
    """The names `/set` lists (`temperature` is `temp`; deprecated names are left out)."""
    return [n for n in NAMES if n != "temperature"]


def parse_setting(name: str, value: Any) -> tuple[str, Any, str | None]:
    """(GenerateOptions field, value, deprecation note or None) for `/set NAME VALUE`.

    A value that is not a number of the field's kind is passed on as text, for
    `GenerateOptions` to refuse naming the field. BadArgument for an unknown name, or a
    switch's value that is none of its words.
    """
    key = str(name).strip().lower()
    field = NAMES.get(key) or DEPRECATED.get(key)
    if field is None:
        raise BadArgument(f"unknown setting {name!r}; one of: {', '.join(shown_names())}")
    note = f"{key} is deprecated: use {field}" if key in DEPRECATED else None
    text = str(value).strip()
    if text.lower() in UNSET.get(field, ()):
        return field, None, note
    if field in SWITCHES:
        on, off = SWITCHES[field]
        if text.lower() not in on + off:
            raise BadArgument(f"{field} {text!r}: one of {choices(field)}")
        return field, text.lower() in on, note
    try:
        return field, int(text) if field in INTEGERS else float(text), note
    except ValueError:
        return field, text, note


def show_value(field: str, value: Any) -> str:
    """A setting's value as `/set` shows it (None as the word that sets it)."""
    if value is None:
        return UNSET.get(field, ("none",))[0]
    if field in SWITCHES:
        return SWITCHES[field][0 if value else 1][0]
    return f"{value:g}" if isinstance(value, float) else str(value)
