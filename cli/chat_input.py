"""The chat's line editor: prompt_toolkit with history across sessions and completion.

Enter sends; Esc Enter (Alt/Option-Enter) adds a line, and pasted text keeps its lines.
Slash commands, `/set` names and `/save` paths complete with Tab (or as you type). Inputs
are remembered in a history file (`$DFLASH_MLX_HISTORY`, else
`$XDG_DATA_HOME/dflash-mlx/chat_history`, else `~/.local/share/dflash-mlx/chat_history`),
so Up recalls them in later sessions too. Knows nothing about models or commands' meaning.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


def history_path() -> Path:
    override = os.environ.get("DFLASH_MLX_HISTORY")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    root = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return root / "dflash-mlx" / "chat_history"


@contextmanager
def quiet_keys() -> Iterator[None]:
    """While a reply streams: keys typed are not echoed (they wait for the next prompt),
    and Ctrl-C's "^C" is not printed into the live display, which would shift it."""
    try:
        import termios

        fd = sys.stdin.fileno()
        old = termios.tcgetattr(fd) if os.isatty(fd) else None
    except (ImportError, OSError, ValueError):  # no termios, or stdin is not a terminal
        old = None
    if old is None:
        yield
        return
    new = list(old)
    new[3] &= ~(termios.ECHO | termios.ECHOCTL)  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, new)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, old)


def _history(path: Path | None):
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    if path is None:
        return InMemoryHistory()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.touch(mode=0o600)  # conversations can be private
        return FileHistory(str(path))
    except OSError:
        return InMemoryHistory()


def make_reader(
    *,
    commands: Mapping[str, str],
    setting_names: Iterable[str],
    history: Path | None,
    toolbar: Callable[[], str] | None = None,
    input=None,
    output=None,
) -> Callable[[], str]:
    """A `read()` returning one input; raises EOFError on Ctrl-D, KeyboardInterrupt on Ctrl-C.

    `commands` maps each slash command to a one-line description shown beside it.
    `input` / `output` are prompt_toolkit's (tests pass a pipe input and a dummy output).
    """
    from prompt_toolkit import PromptSession
    from prompt_toolkit.formatted_text import HTML
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    session = PromptSession(
        history=_history(history),
        completer=_completer(dict(commands), list(setting_names)),
        complete_while_typing=True,
        key_bindings=keys,
        multiline=False,
        prompt_continuation=lambda width, line, wrap: "… ".rjust(width),
        bottom_toolbar=toolbar,
        input=input,
        output=output,
    )
    message = HTML("<ansicyan><b>›</b></ansicyan> ")

    def read() -> str:
        return session.prompt(message)

    return read


def _completer(commands: dict[str, str], setting_names: list[str]):
    """Slash commands (with their description), then `/set` names and `/save` paths."""
    from prompt_toolkit.completion import Completer, Completion, PathCompleter
    from prompt_toolkit.document import Document

    paths = PathCompleter(expanduser=True)

    class SlashCompleter(Completer):
        def get_completions(self, document, complete_event):
            text = document.text_before_cursor
            if not text.startswith("/") or "\n" in text:
                return
            name, space, rest = text.partition(" ")
            if not space:
                for command, meta in commands.items():
                    if command.startswith(name.lower()):
                        yield Completion(command, -len(name), display_meta=meta)
            elif name == "/set" and " " not in rest:
                for setting in setting_names:
                    if setting.startswith(rest.lower()):
                        yield Completion(setting, -len(rest))
            elif name == "/save":
                yield from paths.get_completions(Document(rest), complete_event)

    return SlashCompleter()
