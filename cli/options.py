"""Command-line options that several commands share, declared once."""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from dflash_mlx.errors import BadArgument


def finite(value: float | None) -> float | None:
    """Callback of every float option: click's FLOAT accepts inf and nan, which no option
    means; they are a usage error naming the option (exit 2)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def unicode_text(option: str, value: str) -> str:
    """`value` if it is valid Unicode, else a `BadArgument` naming `option` and the position
    (the library's one rule: `dflash_mlx.engine.text.check_text`)."""
    from dflash_mlx.engine.text import check_text

    return check_text(option, value)


def stdin_is_terminal() -> bool:
    """Whether stdin is a terminal (or absent): nothing to read a prompt from."""
    return sys.stdin is None or sys.stdin.isatty()


def read_stdin() -> str:
    """All of stdin as text, decoded as UTF-8 with surrogateescape (whatever the locale):
    bytes that are not UTF-8 become lone surrogates, which `unicode_text` names."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text-only stream (a test's, an embedding's): already decoded
        return sys.stdin.read()
    return raw.read().decode("utf-8", "surrogateescape")


# --demo replies in chat and serve: the demo's gibberish rarely ends on its own.
DEMO_MAX_TOKENS = 200

# The target every command takes when --model is left out (the registry's DEFAULT_TARGET;
# written here so that --help imports nothing heavy; a test checks they agree).
DEFAULT_MODEL = "mlx-community/Qwen3-4B-4bit"
Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Target: Hub id or local mlx-lm folder.",
        show_default=DEFAULT_MODEL,
    ),
]
Draft = Annotated[
    str | None,
    typer.Option(
        "--draft",
        "-d",
        "--draft-model",  # mlx_lm's name
        help="DFlash draft: Hub id or local folder (default: the published draft for "
        "--model, if known; none known: plain decoding). --draft-model: the same.",
        show_default=False,
    ),
]
# A system prompt: `--system`, or mlx_lm's `--system-prompt`.
System = Annotated[
    str | None,
    typer.Option("--system", "--system-prompt", help="System prompt.", show_default=False),
]
Demo = Annotated[
    bool, typer.Option("--demo", help="Use the tiny demonstration pair: no downloads.")
]
Shard = Annotated[
    str,
    typer.Option(
        "--shard",
        metavar="KIND",
        help="Under mlx.launch: shard the target across the ranks: tensor, pipeline, auto "
        "(what its family supports) or none (each process alone). See docs/distributed.md.",
    ),
]
NoDraft = Annotated[
    bool, typer.Option("--no-draft", help="Decode with the target alone (no speculation).")
]
Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Detailed stats after a reply: acceptance, verify widths, prefill, peak memory.",
    ),
]
Json = Annotated[
    bool, typer.Option("--json", help="Print one JSON object with text, tokens and stats.")
]
# The old name of --verify-width: still accepted, with a note.
BlockSize = Annotated[
    int | None,
    typer.Option("--block-size", hidden=True, help="Deprecated: use --verify-width."),
]


def verify_width(width: int | None, block_size: int | None) -> int | None:
    """--verify-width, or the deprecated --block-size (with a note on stderr)."""
    from . import ui

    if block_size is None:
        return width
    ui.note("note: --block-size is deprecated; use --verify-width")
    if width is not None and width != block_size:
        raise BadArgument(f"--block-size {block_size} and --verify-width {width} disagree")
    return block_size


# -- the generation options: one table for generate, chat (and its /set), serve and bench --


@dataclass(frozen=True)
class Setting:
    """One generation option: its `GenerateOptions` field, its flag, chat's `/set` name and
    its help (the same words in every command)."""

    field: str
    flag: str
    name: str  # chat's /set NAME
    help: str
    short: str | None = None
    # Whether `bench` takes it: its baseline decodes through mlx-lm with sampling only.
    bench: bool = True
    off: str | None = None  # a switch's flag for False (`--no-tree`); left out: None

    @property
    def decls(self) -> list[str]:
        flag = f"{self.flag}/{self.off}" if self.off else self.flag
        return [flag, *([self.short] if self.short else [])]


SETTINGS = (
    Setting(
        "temperature",
        "--temp",
        "temp",
        "Sampling temperature; 0 is greedy: the target's own tokens.",
    ),
    Setting(
        "top_p",
        "--top-p",
        "top_p",
        "Nucleus sampling: keep the smallest set of tokens holding this probability mass; "
        "1 disables.",
    ),
    Setting("top_k", "--top-k", "top_k", "Keep the k most likely tokens; 0 disables."),
    Setting(
        "min_p",
        "--min-p",
        "min_p",
        "Drop tokens below min_p × the top token's probability; 0 disables.",
    ),
    Setting("max_tokens", "--max-tokens", "max_tokens", "Most tokens to generate.", "-n"),
    Setting(
        "verify_width",
        "--verify-width",
        "verify_width",
        "Verify width W: tokens the target checks per cycle (≤ the draft's block; "
        "1: plain decoding; default: picked per cycle for this device).",
    ),
    Setting(
        "tree",
        "--tree",
        "tree",
        "Verify a tree of drafts: --verify-width N then means N verified tokens (the "
        "anchor included); --no-tree: chains only; default: chosen per cycle.",
        bench=False,  # the bench compares shapes: --trees
        off="--no-tree",
    ),
    Setting("seed", "--seed", "seed", "Seed for reproducible sampling."),
    Setting(
        "draft_window",
        "--draft-window",
        "draft_window",
        "Positions a draft block sees on long contexts: its anchor and the N - 1 before "
        "it (default: the draft's own sliding window, else the context it was trained "
        "on if its config says, else all).",
    ),
    Setting(
        "draft_sink",
        "--draft-sink",
        "draft_sink",
        "Under a draft window, the context's first N positions a draft block sees as well "
        "(an attention sink; 0: none; default: the draft's own, else 0).",
        bench=False,
    ),
    Setting(
        "presence_penalty",
        "--presence-penalty",
        "presence_penalty",
        "Subtract this from the logit of every token already generated (OpenAI's, "
        "-2 to 2); 0 disables.",
        bench=False,
    ),
    Setting(
        "frequency_penalty",
        "--frequency-penalty",
        "frequency_penalty",
        "Subtract this times a token's count so far from its logit (OpenAI's, -2 to 2); "
        "0 disables.",
        bench=False,
    ),
    Setting(
        "repetition_penalty",
        "--repetition-penalty",
        "repetition_penalty",
        "Scale down the logits of the last 20 tokens by this factor (mlx-lm's; > 1 "
        "discourages repeats); default off.",
        bench=False,
    ),
)
SETTING = {s.field: s for s in SETTINGS}
_FLOATS = {
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
}


def option(field: str, **extra: Any) -> Any:
    """The `typer.Option` of a generation option, from the table (`extra`: show_default)."""
    s = SETTING[field]
    if field in _FLOATS:
        extra.setdefault("callback", finite)
    return typer.Option(*s.decls, help=s.help, **extra)


MaxTokens = Annotated[int, option("max_tokens")]
Temp = Annotated[float, option("temperature")]
TopP = Annotated[float, option("top_p")]
TopK = Annotated[int, option("top_k")]
MinP = Annotated[float, option("min_p")]
Seed = Annotated[int | None, option("seed", show_default="random")]
VerifyWidth = Annotated[int | None, option("verify_width", show_default=False)]
PresencePenalty = Annotated[float, option("presence_penalty")]
FrequencyPenalty = Annotated[float, option("frequency_penalty")]
RepetitionPenalty = Annotated[float | None, option("repetition_penalty", show_default=False)]
DraftWindow = Annotated[int | None, option("draft_window", show_default=False)]
DraftSink = Annotated[int | None, option("draft_sink", show_default=False)]
Tree = Annotated[bool | None, option("tree", show_default=False)]


_NONE = re.compile(r"\bor None\b")


def flag_message(message: str) -> str:
    """A library message about a generation option in the command line's terms: the flag
    the user typed for the field it names first (`verify_width 32 exceeds ...` ->
    `--verify-width 32 exceeds ...`), and `None`, which no one can type, as leaving the
    option out."""
    name, sep, rest = message.partition(" ")
    setting = SETTING.get("verify_width" if name == "block_size" else name)
    if setting is None:
        return message
    return setting.flag + sep + _NONE.sub("or left out", rest)


@contextmanager
def flag_names() -> Iterator[None]:
    """Around a command's body: a `BadArgument` naming a `GenerateOptions` field is raised
    again naming the flag (`flag_message`)."""
    try:
        yield
    except BadArgument as e:
        text = flag_message(str(e))
        if text == str(e):
            raise
        raise BadArgument(text) from None
