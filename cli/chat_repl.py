"""The chat loop: read a line, run a slash command or stream a reply, until /exit or Ctrl-D.

Ctrl-C during a reply stops it and keeps what was shown; at the prompt it clears the line.
Piped stdin is one message, answered once. Knows the commands and what they do to a
`ChatSession`; rendering is `chat_ui.py`, line editing `chat_input.py`.
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING

from dflash_mlx.chat.settings import choices, show_value
from dflash_mlx.errors import BadArgument

from . import chat_ui
from .chat_input import quiet_keys
from .options import SETTINGS, unicode_text

if TYPE_CHECKING:
    from dflash_mlx.chat.session import ChatSession

EXIT_INTERRUPTED = 130  # as cli/chat.py

COMMANDS = {  # name: (usage, what it does)
    "/help": ("/help", "show this help"),
    "/reset": ("/reset", "start a new conversation (keeps the system prompt and settings)"),
    "/system": ("/system [TEXT | none]", "show, set or remove the system prompt"),
    "/set": (
        "/set [NAME VALUE]",
        "show the settings, or set "
        + ", ".join(
            s.name + (f" ({choices(s.field)})" if choices(s.field) else "") for s in SETTINGS
        )
        + ", thinking (show or hide), markdown (on or off: plain text as written)",
    ),
    "/stats": ("/stats", "totals for this session"),
    "/save": ("/save FILE", "save the conversation as FILE.json, or FILE.md (Markdown)"),
    "/load": ("/load FILE", "continue a conversation saved with /save FILE.json"),
    "/show": (
        "/show [info | system | settings]",
        "the model, its draft and context, the system prompt, the settings",
    ),
    "/retry": ("/retry", "replace the last reply with a new one"),
    "/exit": ("/exit", "leave (Ctrl-D too)"),
}
ALIASES = {"/quit": "/exit", "/bye": "/exit", "/?": "/help", "/clear": "/reset"}
SET_NAMES = [*(s.name for s in SETTINGS), "thinking", "markdown"]


def answer_once(
    session: ChatSession, view: chat_ui.ChatUI, text: str, *, json_out: bool = False
) -> int:
    """Piped stdin: the whole input is one message; answer it (streamed, or as one JSON
    object with `json_out`) and stop."""
    if not text.strip():
        raise BadArgument("nothing on stdin to answer (e.g. echo 'hello' | dflash-mlx chat)")
    unicode_text("stdin", text)
    if json_out:
        from dflash_mlx.engine.generate import GenerationResult

        from .ui import result_json

        texts, tokens, last = [], [], None
        for last in session.send(text.strip()):
            texts.append(last.text)
            tokens += last.tokens
        result = GenerationResult(
            text="".join(texts),
            tokens=tokens,
            finish_reason=last.finish_reason,
            stats=last.stats,
            stop=last.stop,
        )
        result_json(result)
        return 0
    interrupted = stream_reply(
        session, view, lambda progress: session.send(text.strip(), prompt_progress=progress)
    )
    return EXIT_INTERRUPTED if interrupted else 0


class DeferredInterrupt:
    """Ctrl-C during a reply, acted on between the engine's cycles.

    A SIGINT raised wherever it lands could cut a verify pass in half, and the engine then
    drops the conversation's cache (the next turn prefills it all again). Inside this
    context the first Ctrl-C only sets `asked`: the caller stops the stream at its next
    response, where the engine commits every token so far to the cache. A second Ctrl-C
    raises KeyboardInterrupt at once. Only where Python's own handler is installed (the
    main thread, a terminal's default), so an ignored SIGINT stays ignored.
    """

    def __init__(self) -> None:
        self.asked = False
        self._old = None

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            old = signal.getsignal(signal.SIGINT)
            if old is signal.default_int_handler:
                self._old = old
                signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None

    def _handler(self, signum, frame) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed (between responses)."""
        if self.asked:
            raise KeyboardInterrupt


def stream_reply(session: ChatSession, view: chat_ui.ChatUI, start) -> bool:
    """Stream one reply from `start(progress)`, then its stats line; True after Ctrl-C.

    Ctrl-C stops the reply at the next response (`DeferredInterrupt`), so the tokens
    committed so far stay in the conversation's cache: during a prefill, once the prompt is
    read (a prefill cut midway would drop the cache). A calibration the pair needs runs
    first, said on screen (Ctrl-C abandons it; it stays due)."""
    from .ui import calibrate

    calibrate(session.pair, session.options.verify_width, view.err)
    before = len(session.history)
    reply = view.reply_view()
    interrupted = False
    with quiet_keys(), DeferredInterrupt() as ctrl_c:
        stream = start(reply.prefill)
        try:
            for i, r in enumerate(stream):
                if i == 0 and session.starts_in_thinking:
                    reply.begin_thinking()
                reply.feed(r.text)
                ctrl_c.check()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            stream.close()
            reply.close(interrupted=interrupted)
    if len(session.history) > before:
        view.stats(session.last, session.draft is not None)
    elif interrupted:
        view.note("stopped before the reply began: the message was not kept (Up recalls it)")
    return interrupted


class Repl:
    """Read a line; run a slash command or send it as a message; until /exit or Ctrl-D."""

    def __init__(self, session: ChatSession, view: chat_ui.ChatUI, read):
        self.session, self.view, self.read = session, view, read

    def run(self) -> None:
        while True:
            try:
                line = self.read()
            except KeyboardInterrupt:
                self.view.info("(Ctrl-D or /exit leaves)")
                continue
            except EOFError:
                break
            try:
                if not self.handle(line):
                    break
            except KeyboardInterrupt:
                self.view.note("interrupted")
            except ValueError as e:
                self.view.error(str(e))
            except Exception as e:  # a chat survives one bad turn; say what happened
                self.view.error(f"{type(e).__name__}: {e}")

    def handle(self, line: str) -> bool:
        """Act on one input; False to leave."""
        text = unicode_text("the line", line.strip())
        if not text:
            return True
        if text.startswith("/") and not text.startswith("//"):
            return self.command(text)
        if text.startswith("//"):
            text = text[1:]
        stream_reply(self.session, self.view, lambda p: self.session.send(text, prompt_progress=p))
        return True

    def command(self, text: str) -> bool:
        name, _, arg = text.partition(" ")
        name = ALIASES.get(name.lower(), name.lower())
        arg = arg.strip()
        s, view = self.session, self.view
        if name == "/exit":
            return False
        if name == "/help":
            view.help(COMMANDS)
        elif name == "/reset":
            s.reset()
            view.info("new conversation" + (" (system prompt kept)" if s.system else ""))
        elif name == "/system":
            if not arg:
                view.info(f"system prompt: {s.system}" if s.system else "no system prompt")
            elif arg.lower() == "none":
                s.set_system(None)
                view.info("system prompt removed")
            else:
                s.set_system(arg)
                view.info("system prompt set; it applies from the next reply")
        elif name == "/set":
            self.set(arg)
        elif name == "/stats":
            view.totals(s.history, s.context_tokens, s.draft is not None, s.last)
        elif name == "/save":
            if not arg:
                raise BadArgument("/save needs a file name, e.g. /save chat.json or /save chat.md")
            path = s.save(arg)
            view.info(f"saved {len(s.conversation())} messages to {path}")
        elif name == "/load":
            if not arg:
                raise BadArgument("/load needs a file saved with /save, e.g. /load chat.json")
            view.info(f"loaded {s.load(arg)} messages; the next reply continues them")
        elif name == "/show":
            self.show(arg.lower())
        elif name == "/retry":
            if s.options.temperature == 0 and s.messages:
                view.info("at temperature 0 the reply comes out the same (/set temp 0.7 varies it)")
            stream_reply(s, view, lambda p: s.retry(prompt_progress=p))
        else:
            view.error(f"unknown command {name}")
            view.help(COMMANDS)
        return True

    def show(self, what: str) -> None:
        """ollama's /show: the model (`info`), the system prompt, the settings; all three
        without an argument."""
        s, view = self.session, self.view
        if what not in ("", "info", "system", "settings", "parameters"):
            raise BadArgument(f"/show {what}: info, system or settings")
        if what in ("", "info"):
            draft = s.draft_id if s.draft is not None else "none (plain decoding)"
            limit = s.pair.context_limit
            view.info(
                f"model {s.model_id} · draft {draft} · context {s.context_tokens} tokens held"
                + (f" of {limit}" if limit else "")
                + f" · {len(s.messages)} messages"
            )
        if what in ("", "system"):
            view.info(f"system prompt: {s.system}" if s.system else "no system prompt")
        if what in ("", "settings", "parameters"):
            view.settings(s.options, view.hide_thinking)

    def set(self, arg: str) -> None:
        if not arg:
            self.view.settings(self.session.options, self.view.hide_thinking)
            return
        key, _, value = arg.partition(" ")
        value = value.strip()
        if not value:
            raise BadArgument(f"/set {key} needs a value, e.g. /set temp 0.7")
        if key.lower() == "markdown":
            if value.lower() not in ("on", "off"):
                raise BadArgument(f"/set markdown {value!r}: on or off")
            self.view.markdown = value.lower() == "on"
            self.view.changed("markdown", "on" if self.view.markdown else "off (plain text)")
            return
        if key.lower() == "thinking":
            if value.lower() not in ("show", "hide"):
                raise BadArgument(f"/set thinking {value!r}: show or hide")
            self.view.hide_thinking = value.lower() == "hide"
            self.view.changed("thinking", "hidden" if self.view.hide_thinking else "shown")
            return
        field, note = self.session.set(key, value)
        self.view.changed(field, show_value(field, getattr(self.session.options, field)), note)


def toolbar(session: ChatSession, label: str) -> str:
    """The line under the prompt: model, width (and shape, if fixed), temperature, context
    held."""
    s = session.options
    width = show_value("verify_width", s.verify_width)
    shape = {None: "", True: " tree", False: " chains"}[s.tree]
    draft = "no draft" if session.draft is None else f"W {width}{shape}"
    return (
        f" {label} · {draft} · temp {s.temperature:g} · max {s.max_tokens} · "
        f"{session.context_tokens} tokens in context · /help"
    )
