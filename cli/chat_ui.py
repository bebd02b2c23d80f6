"""What `dflash-mlx chat` shows: the banner, streamed replies, stats, help and notes.

A reply streams through `chat_reply.ReplyView` (live Markdown in a terminal, plain text
anywhere else). Replies go to `out`; stats, notes and errors to `err`. Renders what the
library returns (a reply's `Stats` and how it ended, the session's `GenerateOptions`);
knows nothing about models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .chat_reply import ReplyView
from .options import SETTINGS

if TYPE_CHECKING:  # these import mlx: only for type checkers, never at run time
    from dflash_mlx.chat.session import Reply
    from dflash_mlx.options import GenerateOptions
    from dflash_mlx.stats import Stats

KEYS = (
    "Enter sends · Esc Enter (Alt-Enter) adds a line · /help lists commands · "
    "Ctrl-C stops a reply · Ctrl-D or /exit leaves"
)


class ChatUI:
    """The two consoles a chat writes to, and everything it shows besides replies."""

    def __init__(
        self,
        out: Console,
        err: Console,
        *,
        hide_thinking: bool = False,
        verbose: bool = False,
        markdown: bool = True,
    ):
        self.out, self.err = out, err
        self.hide_thinking = hide_thinking
        self.markdown = markdown  # off: replies as plain text, as written (--plain)
        self.verbose = verbose  # the detailed stats line after each reply

    def reply_view(self) -> ReplyView:
        return ReplyView(self.out, hide_thinking=self.hide_thinking, markdown=self.markdown)

    def banner(self, lines: list[tuple[str, str]], settings: GenerateOptions) -> None:
        grid = Table.grid(padding=(0, 2))
        for label, value in lines:
            grid.add_row(Text(label, style="dim"), Text(value))
        grid.add_row(Text("settings", style="dim"), Text(settings_summary(settings)))
        self.err.print(Text("dflash-mlx chat", style="bold"))
        self.err.print(grid)
        self.err.print(Text(KEYS, style="dim"))

    def stats(self, reply: Reply, has_draft: bool, *, verbose: bool | None = None) -> None:
        """A reply's stats: the short line, or the details (`--verbose`, `/stats`)."""
        from dflash_mlx.stats import short_fields, stats_fields

        from .ui import stats_lines

        detailed = self.verbose if verbose is None else verbose
        shown = stats_fields if detailed else short_fields
        stats_lines(shown(reply.stats, reply.finish_reason), self.err)

    def totals(
        self,
        history: list[Stats],
        context_tokens: int,
        has_draft: bool,
        last: Reply | None = None,
    ) -> None:
        """`/stats`: the last reply's detailed stats line, then every reply of the session
        (`history`) pooled."""
        from dflash_mlx.stats import Stats, count

        if last is not None:
            self.err.print(Text("last reply", style="dim"))
            self.stats(last, has_draft, verbose=True)

        t = Stats.total(history)
        table = Table.grid(padding=(0, 2))
        first = [s.time_to_first_token for s in history]
        rows = [
            ("replies", f"{t.requests}"),
            ("generated", f"{t.generation_tokens} tokens @ {t.generation_tps:.1f} tok/s"),
            ("prefilled", f"{t.prefilled_tokens} tokens"),
            ("reused", f"{t.cached_tokens} prompt tokens from earlier turns, not prefilled"),
            ("context", f"{context_tokens} tokens held"),
        ]
        if has_draft:
            rate = "—" if t.acceptance_rate is None else f"{t.acceptance_rate:.0%}"
            rows.append(("τ", f"{t.tau:.2f} tokens per verify · accepted {rate}"))
            ran = f"{t.plain_fraction:.0%} of tokens decoded plainly · {count(t.probes, 'probe')}"
            rows.append(("ran", ran + (f" · draft {t.draft}" if t.draft else "")))
        if first:
            rows.append(("TTFT", f"first {first[0] * 1e3:.0f} ms · last {first[-1] * 1e3:.0f} ms"))
        rows.append(("peak", f"{t.peak_memory:.2f} GB"))
        for label, value in rows:
            table.add_row(Text(label, style="dim"), Text(value))
        self.err.print(table)

    def settings(self, settings: GenerateOptions, hide_thinking: bool) -> None:
        thinking = "hidden" if hide_thinking else "shown"
        markdown = "on" if self.markdown else "off"
        self.err.print(
            Text(settings_summary(settings) + f" · thinking {thinking} · markdown {markdown}")
        )

    def changed(self, name: str, value: str, note: str | None = None) -> None:
        """The confirmation of `/set NAME VALUE` (after a deprecation note, if any)."""
        if note:
            self.note(f"note: {note}")
        self.err.print(Text(f"{name} set to {value} (from the next reply)", style="dim"))

    def help(self, commands: dict[str, tuple[str, str]]) -> None:
        table = Table.grid(padding=(0, 2))
        for usage, text in commands.values():
            table.add_row(Text(usage, style="bold"), Text(text))
        self.err.print(table)
        self.err.print(Text(KEYS + " · start with // to send a message beginning with /", "dim"))

    def note(self, message: str) -> None:
        self.err.print(Text(message, style="yellow"))

    def info(self, message: str) -> None:
        self.err.print(Text(message, style="dim"))

    def error(self, message: str) -> None:
        self.err.print(Text("error: ", style="bold red") + Text(" ".join(message.split())))

    def demo_note(self, notice: str) -> None:
        self.err.print(Text.assemble(("demo: ", "bold yellow"), (notice, "yellow")))


# What `/set` and the banner show: (name, GenerateOptions field), in the table's order.
SHOWN = [(s.name, s.field) for s in SETTINGS]


def settings_summary(options: GenerateOptions) -> str:
    """Every chat setting: `temp 0 · top_p 1 · … · draft_window auto`."""
    from dflash_mlx.chat.settings import show_value

    return " · ".join(
        f"{name} {show_value(field, getattr(options, field))}" for name, field in SHOWN
    )
