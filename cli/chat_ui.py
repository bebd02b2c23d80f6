"""What `dflash-mlx chat` shows: the banner, streamed replies, stats, help and notes.

In a terminal a reply streams as live Markdown (code blocks highlighted): finished blocks
are printed for good as they complete, and only the block being written is redrawn, cut
to the screen's height. `<think>` sections are dimmed, or hidden behind a one-line
summary. Anywhere else (a pipe, a file) the reply is written as plain text as it arrives.
Replies go to `out`; stats, notes and errors to `err`. Renders what the library returns
(`ReplyStats`, `SessionTotals`, `ChatSettings`); knows nothing about models.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.progress_bar import ProgressBar
from rich.segment import Segment
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from . import ui

if TYPE_CHECKING:  # the library imports mlx: only for type checkers, never at run time
    from dflash_mlx.chat_session import ChatSettings, ReplyStats, SessionTotals

OPEN, CLOSE = "<think>", "</think>"
KEYS = (
    "Enter sends · Esc Enter (Alt-Enter) adds a line · /help lists commands · "
    "Ctrl-C stops a reply · Ctrl-D or /exit leaves"
)


class ChatUI:
    """The two consoles a chat writes to, and everything it shows besides replies."""

    def __init__(self, out: Console, err: Console, *, hide_thinking: bool = False):
        self.out, self.err = out, err
        self.hide_thinking = hide_thinking

    def reply_view(self) -> ReplyView:
        return ReplyView(self.out, hide_thinking=self.hide_thinking)

    def banner(self, lines: list[tuple[str, str]], settings: ChatSettings) -> None:
        grid = Table.grid(padding=(0, 2))
        for label, value in lines:
            grid.add_row(Text(label, style="dim"), Text(value))
        grid.add_row(Text("settings", style="dim"), Text(settings_summary(settings)))
        self.err.print(Text("dflash-mlx chat", style="bold"))
        self.err.print(grid)
        self.err.print(Text(KEYS, style="dim"))

    def stats(self, s: ReplyStats, has_draft: bool) -> None:
        self.err.print(Text(stats_line(s, has_draft), style="dim"))

    def totals(self, t: SessionTotals, context_tokens: int, has_draft: bool) -> None:
        table = Table.grid(padding=(0, 2))
        first = t.first_token_seconds
        rows = [
            ("replies", f"{t.replies}"),
            ("generated", f"{t.generation_tokens} tokens @ {t.generation_tps:.1f} tok/s"),
            ("prefilled", f"{t.prefilled_tokens} tokens"),
            ("reused", f"{t.cached_tokens} prompt tokens from earlier turns, not prefilled"),
            ("context", f"{context_tokens} tokens held"),
        ]
        if has_draft:
            rate = "—" if t.acceptance_rate is None else f"{t.acceptance_rate:.0%}"
            rows.append(("τ", f"{t.mean_acceptance:.2f} tokens per verify · accepted {rate}"))
            plain = t.plain_tokens / t.committed if t.committed else 0.0
            ran = f"{plain:.0%} of tokens decoded plainly · {t.probes} probes"
            rows.append(("ran", ran + (f" · draft {t.draft}" if t.draft else "")))
        if first:
            rows.append(("TTFT", f"first {first[0] * 1e3:.0f} ms · last {first[-1] * 1e3:.0f} ms"))
        rows.append(("peak", f"{t.peak_memory:.2f} GB"))
        for label, value in rows:
            table.add_row(Text(label, style="dim"), Text(value))
        self.err.print(table)

    def settings(self, settings: ChatSettings, hide_thinking: bool) -> None:
        self.err.print(
            Text(
                settings_summary(settings) + f" · thinking {'hidden' if hide_thinking else 'shown'}"
            )
        )

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


def settings_summary(s: ChatSettings) -> str:
    width = "auto" if s.block_size is None else str(s.block_size)
    seed = "" if s.seed is None else f" · seed {s.seed}"
    return (
        f"temp {s.temperature:g} · top_p {s.top_p:g} · max_tokens {s.max_tokens} · "
        f"block_size {width}{seed}"
    )


def stats_line(s: ReplyStats, has_draft: bool) -> str:
    """tokens · tok/s · τ · acceptance · prefill · TTFT · peak memory (· how it ended)."""
    parts = [_count(s.generation_tokens, "token"), f"{s.generation_tps:.1f} tok/s"]
    if has_draft:
        rate = "—" if s.acceptance_rate is None else f"{s.acceptance_rate:.0%}"
        parts += [f"τ {s.mean_acceptance:.2f}", f"accepted {rate}"]
    else:
        parts.append("no draft")
    prefill = f"prefill {_count(s.prefilled_tokens, 'token')} @ {s.prompt_tps:.0f} tok/s"
    if s.cached_tokens:
        prefill += f" ({s.cached_tokens} reused)"
    parts += [prefill, f"TTFT {s.time_to_first_token * 1e3:.0f} ms", f"peak {s.peak_memory:.2f} GB"]
    if s.finish_reason == "length":
        parts.append("hit max_tokens")
    elif s.finish_reason == "interrupted":
        parts.append("interrupted")
    return " · ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


class CalibrationProgress:
    """`progress(done, total)` of the one-time verify-width calibration: a bar on stderr."""

    def __init__(self, console: Console):
        self.console = console
        self._bar: Progress | None = None
        self._task = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = Progress(
                TextColumn("calibrating the verify width on this device (once per pair)"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("calibrate", total=total)
        self._bar.update(self._task, completed=done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class ReplyView:
    """Renders one streamed reply: `feed(text)` per chunk, then `close()`."""

    def __init__(self, console: Console, *, hide_thinking: bool = False):
        self.console = console
        self.hide = hide_thinking
        self.thinking = False
        self.pending = ""  # text that may still turn out to be the start of a tag
        self.thought = ""  # thinking text not printed for good yet
        self.answer = ""  # answer text not printed for good yet
        self.gap = False  # a blank line is due before the next block
        self.think_started = 0.0
        self._shown = False  # some text of the reply was shown
        self._thought_shown = False  # lines of the current <think> section were printed
        self._answered = False  # plain mode: some answer text was written
        self._ends_with_newline = True  # plain mode: the last text written ended a line
        self._plain_progress: ui.PromptProgress | None = None
        self._prefill: tuple[int, int] | None = None
        self._spinner = Spinner("dots", style="dim")
        self.live: Live | None = None
        if console.is_terminal:
            self.live = Live(
                console=console,
                get_renderable=lambda: _Bottom(self._live_renderable()),
                refresh_per_second=10,
                transient=True,
            )
            self.live.start()

    def begin_thinking(self) -> None:
        """The prompt itself opened a <think> section: the reply starts inside it."""
        self.thinking = True
        self.think_started = time.perf_counter()

    def prefill(self, done: int, total: int) -> None:
        """`prompt_progress` callback: a bar while a long prompt is prefilled."""
        if self.live is None:
            if self._plain_progress is None:
                self._plain_progress = ui.PromptProgress()
            self._plain_progress(done, total)
            return
        self._prefill = (done, total) if done < total else None

    def feed(self, text: str) -> None:
        self.pending += text
        while True:
            tag = CLOSE if self.thinking else OPEN
            i = self.pending.find(tag)
            if i < 0:
                break
            self._emit(self.pending[:i])
            self.pending = self.pending[i + len(tag) :]
            self._toggle()
        keep = _partial_tag(self.pending, CLOSE if self.thinking else OPEN)
        self._emit(self.pending[: len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep :]
        self._commit(final=False)

    def close(self, *, interrupted: bool = False) -> None:
        """Print what is left for good. After Ctrl-C: exactly what was streamed so far."""
        if self._plain_progress is not None:
            self._plain_progress.close()
        self._emit(self.pending)
        self.pending = ""
        if self.live is not None:
            self.live.stop()
        if self.thinking:
            self._end_thinking()
        self._commit(final=True)
        if self.live is None and not self._ends_with_newline:
            self._write("\n")
        if interrupted and self.live is not None and self._shown:
            # Only on screen: a piped reply stays clean, the stats line says it was cut.
            self.console.print(Text("⏹ stopped · the reply so far is kept", style="yellow"))

    # -- internals --------------------------------------------------------------------

    def _write(self, text: str) -> None:
        """Plain mode: the text as it arrives."""
        if text:
            self.console.file.write(text)
            self.console.file.flush()
            self._ends_with_newline = text.endswith("\n")

    def _emit(self, text: str) -> None:
        if not text:
            return
        self._shown = True
        if self.live is not None:
            # Control characters would move the cursor under the live display's feet.
            text = _CONTROL.sub("\ufffd", text)
        if self.thinking:
            if self.live is None and not self.hide:
                self._write(text)
            self.thought += text
            return
        if self.live is None:
            # With thinking hidden, the blank lines after </think> lead nowhere.
            if self.hide and not self._answered:
                text = text.lstrip("\n")
            self._answered = self._answered or bool(text)
            self._write(text)
        self.answer += text

    def _toggle(self) -> None:
        if self.thinking:
            if self.live is None and not self.hide:
                self._write(CLOSE)
            self._end_thinking()
            self.thinking = False
        else:
            if self.live is None and not self.hide:
                self._write(OPEN)
            self.thinking = True
            self.think_started = time.perf_counter()

    def _print(self, renderable) -> None:
        """Print for good, after a blank line when one is due."""
        if self.gap:
            self.console.print()
            self.gap = False
        self.console.print(renderable)

    def _end_thinking(self) -> None:
        if self.live is not None:
            if self.hide:
                seconds = time.perf_counter() - self.think_started
                words = len(self.thought.split())
                self._print(Text(f"▸ thought for {seconds:.1f} s ({words} words, hidden)", "dim"))
                self.gap = True
            else:
                rest = self.thought.strip("\n")
                if rest:
                    self._print(Text(rest, style="dim italic"))
                    self._thought_shown = True
                self.gap = self.gap or self._thought_shown
        self.thought = ""
        self._thought_shown = False

    def _commit(self, *, final: bool) -> None:
        """Print finished parts for good; in plain mode everything is already written."""
        if self.live is None:
            self.thought = self.answer = ""
            return
        if self.thinking and not self.hide:
            cut = self.thought.rfind("\n")
            if cut >= 0:
                lines = self.thought[:cut].strip("\n")
                if lines:
                    self._print(Text(lines, style="dim italic"))
                    self._thought_shown = True
                self.thought = self.thought[cut + 1 :]
        self.answer = self.answer.lstrip("\n")
        cut = len(self.answer) if final else _stable_end(self.answer)
        if cut > 0 and self.answer[:cut].strip():
            self._print(_Trimmed(Markdown(self.answer[:cut].strip("\n"))))
            self.gap = True
            self.answer = self.answer[cut:].lstrip("\n")

    def _live_renderable(self):
        parts = []
        if self._prefill is not None:
            done, total = self._prefill
            parts.append(
                Group(
                    Text(f"prefill {done}/{total} tokens", style="dim"),
                    ProgressBar(total=total, completed=done, width=40),
                )
            )
        elif self.thinking and self.hide:
            self._spinner.update(text=Text(f"thinking… {len(self.thought.split())} words"))
            parts.append(self._spinner)
        elif self.thinking:
            parts.append(Text(self.thought, style="dim italic"))
        elif self.answer.strip():
            if self.gap:
                parts.append(Text(""))
            parts.append(_Trimmed(Markdown(self.answer)))
        elif not self.gap:
            parts.append(self._spinner)  # nothing shown yet: waiting for the first token
        return Group(*parts)


class _Trimmed:
    """A renderable without its leading and trailing blank lines (rich's Markdown adds
    them around some blocks), so blocks printed one by one are spaced evenly."""

    def __init__(self, renderable):
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(self.renderable, options, pad=False)
        while lines and _blank(lines[0]):
            lines.pop(0)
        while lines and _blank(lines[-1]):
            lines.pop()
        for line in lines:
            yield from line
            yield Segment.line()


def _blank(line: list[Segment]) -> bool:
    # A code block's padding has a background colour: it is part of the block.
    return all(not seg.text.strip() and not (seg.style and seg.style.bgcolor) for seg in line)


class _Bottom:
    """The last lines of a renderable that fit the screen (the live tail of a reply)."""

    def __init__(self, renderable):
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(self.renderable, options, pad=False)
        height = max(3, console.size.height - 2)
        for line in lines[-height:]:
            yield from line
            yield Segment.line()


_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _stable_end(text: str) -> int:
    """End of the last complete Markdown block: a blank line outside any code fence."""
    end, fence, pos = 0, None, 0
    for line in text.splitlines(keepends=True):
        m = _FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = None if fence else m.group(1)
        pos += len(line)
        if fence is None and not line.strip() and line.endswith("\n"):
            end = pos
    return end


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back until complete)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
