"""One streamed reply of `dflash-mlx chat`, on screen: `ReplyView`.

In a terminal a reply streams as live Markdown (code blocks highlighted): finished blocks
are printed for good as they complete, and only the block being written is redrawn, cut
to the screen's height. `<think>` sections are dimmed, or hidden behind a one-line
summary. Anywhere else (a pipe, a file) the reply is written as plain text as it arrives.
"""

from __future__ import annotations

import re
import time

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.progress_bar import ProgressBar
from rich.segment import Segment
from rich.spinner import Spinner
from rich.text import Text

from . import ui

OPEN, CLOSE = "<think>", "</think>"


class ReplyView:
    """Renders one streamed reply: `feed(text)` per chunk, then `close()`."""

    def __init__(self, console: Console, *, hide_thinking: bool = False, markdown: bool = True):
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
        if console.is_terminal and markdown:
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
            self._print(_Trimmed(Markdown(verbatim(self.answer[:cut].strip("\n")))))
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
            parts.append(_Trimmed(Markdown(verbatim(self.answer))))
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


# -- Markdown that never changes code --------------------------------------------------

# A line that is code whatever surrounds it: Python, C-family and shell openers, decorators,
# assignments, and lines ending in a block opener or closer.
_CODE_LINE = re.compile(
    r"^\s*(def |class |async def |import |from \S+ import |return\b|yield\b|raise\b"
    r"|for .+ in .+:|while .+:|if .+:|elif .+:|else:|try:|except\b.*:|finally:|with .+:"
    r"|@\w|#include|#!|public |private |static |function |const |let |var |fn |"
    r"\$ )"
    r"|^\s*[A-Za-z_][\w.]*(\[[^\]]*\])?\s*([-+*/%|&^]|//|\*\*)?=\s*[^=\s]"
    r"|[{};]\s*$|^\s*[}\])]"
)
_LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def _code_like(line: str, previous: str | None) -> bool:
    """Whether `line` reads as code: a code line, or an indented line (not a list item)
    after one or at the start of a block."""
    if not line.strip() or _LIST_ITEM.match(line):
        return False
    if _CODE_LINE.search(line):
        return True
    indented = line[:1] in (" ", "\t") and len(line) - len(line.lstrip()) >= 2
    return indented and (previous is None or _CODE_LINE.search(previous) is not None)


def _prose(lines: list[str]) -> str:
    """Markdown prose kept as written: `_` taken literally (dunders, snake_case; never
    emphasis) outside code spans, and every line break kept."""
    text = "\n".join(lines)
    out, pos = [], 0
    for m in _CODE_SPAN.finditer(text):
        out.append(text[pos : m.start()].replace("_", "\\_"))
        out.append(m.group(0))
        pos = m.end()
    out.append(text[pos:].replace("_", "\\_"))
    return "  \n".join("".join(out).split("\n"))


def verbatim(text: str) -> str:
    """`text` as Markdown that shows code exactly as written: fenced blocks as they are;
    outside them, from the first line of a paragraph that reads as code (`_code_like`) to
    the paragraph's end, a fence of its own (so `def __init__(self):` and its indented body
    keep their underscores, lines and indentation); prose with literal underscores and its
    line breaks."""
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if not block:
            return
        start = next(
            (i for i, line in enumerate(block) if _code_like(line, block[i - 1] if i else None)),
            None,
        )
        prose, code = (block, []) if start is None else (block[:start], block[start:])
        if prose:
            out.append(_prose(prose))
        if code:
            out.append("```\n" + "\n".join(code) + "\n```")
        block.clear()

    fence: str | None = None
    fenced: list[str] = []
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is not None:
            fenced.append(line)
            if m and m.group(1) == fence:
                out.append("\n".join(fenced))
                fence, fenced = None, []
            continue
        if m:
            flush()
            fence, fenced = m.group(1), [line]
        elif not line.strip():
            flush()
            out.append("")
        else:
            block.append(line)
    flush()
    if fence is not None:  # still open (streaming): shown as the fence it will be
        out.append("\n".join(fenced))
    return "\n".join(out)
