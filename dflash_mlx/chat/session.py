"""A chat conversation over the DFlash engine: messages, settings, state reuse and statistics.

Owns the conversation (system prompt, user and assistant messages), its sampling settings,
one `PromptCache` kept across turns, per-reply and session statistics, and the JSON and
Markdown transcripts. Every turn re-renders the whole conversation with the tokenizer's
chat template, exactly as a fresh request would, and the engine reuses the target cache,
the draft's context cache and the token history up to the longest common prefix with the
previous turn: a turn prefills only what is new, and its reply is what a fresh request
with the same messages would give. Knows nothing about terminals: it never prints; a
reply is a stream of `GenerationResponse` that the caller renders.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache.prompt_cache import PromptCache
from ..cache.prompt_store import PromptStore
from ..engine.generate import GenerationResponse, stream_generate
from ..errors import BadArgument
from ..options import GenerateOptions
from ..pair import Pair
from ..stats import SEPARATOR, Stats, stats_fields
from .settings import parse_setting

Message = dict[str, str]

# Chat's defaults: longer replies than a plain request's, though not so long that a small
# model repeating itself runs for minutes (/set max_tokens raises it); greedy unless
# /set temp says.
CHAT_DEFAULTS = GenerateOptions(max_tokens=1024, temperature=0.0)


@dataclass(frozen=True)
class Reply:
    """One reply's figures: the engine's `Stats` as of its last response, and how it ended
    ("stop", "length" or "interrupted")."""

    stats: Stats
    finish_reason: str

    def to_dict(self) -> dict[str, Any]:
        return {**self.stats.to_dict(), "finish_reason": self.finish_reason}


class ChatSession:
    """One conversation with a `Pair` (a target, and optionally a DFlash draft).

    `ChatSession(pair, tokenizer)`; the old form `ChatSession(model, draft, tokenizer)`
    builds the Pair. One Pair serves the whole session, so the width choosers learn across
    turns. `send(text)` and `retry()` are generators of `GenerationResponse`: iterate to
    stream the reply. Closing one early (Ctrl-C, `break`) keeps the text streamed so far as
    the reply; a reply stopped before its first token leaves the conversation as it was.
    """

    def __init__(
        self,
        pair: Pair | Any,
        *args: Any,
        system: str | None = None,
        options: GenerateOptions | None = None,
        template_kwargs: dict[str, Any] | None = None,
        model_id: str = "",
        draft_id: str | None = None,
        store: PromptStore | None = None,
    ):
        if not isinstance(pair, Pair):  # the old form: (model, draft, tokenizer)
            if len(args) != 2:
                raise TypeError("ChatSession(pair, tokenizer) or (model, draft, tokenizer)")
            pair, args = Pair(pair, args[0]), args[1:]
        if len(args) != 1:
            raise TypeError("ChatSession(pair, tokenizer): one tokenizer after the pair")
        tokenizer = args[0]
        has_template = getattr(tokenizer, "has_chat_template", None)
        if has_template is None:  # a plain Hugging Face tokenizer
            has_template = getattr(tokenizer, "chat_template", None) is not None
        if not has_template:
            raise BadArgument(
                f"{model_id or 'this model'}: the tokenizer has no chat template, so it cannot "
                "chat (use a chat/instruct model, or `dflash-mlx generate --raw`)"
            )
        self.pair, self.tokenizer = pair, tokenizer
        self.model_id, self.draft_id = model_id, draft_id
        self.template_kwargs = dict(template_kwargs or {})
        self.options = self._checked(options if options is not None else CHAT_DEFAULTS)
        self.system = system or None
        self.messages: list[Message] = []  # user and assistant turns, without the system
        self.replies: list[Reply] = []  # one per assistant message
        self.last: Reply | None = None  # the latest reply, kept or not
        self.history: list[Stats] = []  # every reply's, retried and interrupted ones included
        # Each turn resumes from the conversation's own state, or from the longest prefix
        # the `store` holds (another conversation's, or a previous process's on disk).
        self.cache = PromptCache(store=store)
        self.starts_in_thinking = False  # the latest prompt opened a <think> block
        self._generations = 0

    # -- the conversation -------------------------------------------------------------

    def conversation(self) -> list[Message]:
        """The messages a request would send: the system prompt, then the turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]

    @property
    def draft(self):
        """The pair's DFlash draft (None: the target decodes alone)."""
        return self.pair.draft

    @property
    def totals(self) -> Stats:
        """Every reply of the session pooled, retried and interrupted ones included."""
        return Stats.total(self.history)

    @property
    def context_tokens(self) -> int:
        """Tokens of the conversation the engine holds state for."""
        return len(self.cache)

    def reset(self) -> None:
        """A new conversation: the same model, settings and system prompt."""
        self.messages.clear()
        self.replies.clear()
        self.cache.clear()

    def set_system(self, text: str | None) -> None:
        """Set (or with None / "" remove) the system prompt; the turns are kept."""
        self.system = text.strip() if text and text.strip() else None

    def set(self, name: str, value: Any) -> tuple[str, str | None]:
        """Change one setting from its `/set` name and text (see `chat_settings`):
        (the `GenerateOptions` field set, a deprecation note or None). BadArgument when the
        value is bad, or is a verify width the draft cannot hold; nothing changes then."""
        field, parsed, note = parse_setting(name, value)
        self.options = self._checked(self.options.replace(**{field: parsed}))
        return field, note

    def send(
        self, text: str, *, prompt_progress: Callable[[int, int], None] | None = None
    ) -> Iterator[GenerationResponse]:
        """Add a user message and stream the reply."""
        if not text.strip():
            raise BadArgument("empty message")
        restore = (list(self.messages), list(self.replies))
        self.messages.append({"role": "user", "content": text})
        yield from self._reply(restore, prompt_progress)

    def retry(
        self, *, prompt_progress: Callable[[int, int], None] | None = None
    ) -> Iterator[GenerationResponse]:
        """Replace the last reply with a new one (a new sample when temperature > 0)."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise BadArgument("nothing to retry yet: send a message first")
        restore = (list(self.messages), list(self.replies))
        self.messages.pop()
        self.replies.pop()
        yield from self._reply(restore, prompt_progress)

    # -- transcripts ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "draft": self.draft_id,
            "settings": self.options.as_dict(),
            "template_kwargs": self.template_kwargs,
            "messages": self.conversation(),
            "replies": [s.to_dict() for s in self.replies],
        }

    def to_markdown(self) -> str:
        s = self.options
        lines = [
            "# dflash-mlx chat",
            "",
            f"- model: `{self.model_id}`",
            f"- draft: `{self.draft_id}`" if self.draft_id else "- draft: none",
            f"- temperature {s.temperature:g}, top_p {s.top_p:g}, max_tokens {s.max_tokens}",
        ]
        replies = iter(self.replies)
        for m in self.conversation():
            lines += ["", f"## {m['role'].capitalize()}", "", _markdown_content(m["content"])]
            stats = next(replies, None) if m["role"] == "assistant" else None
            if stats is not None and stats.finish_reason != "loaded":  # loaded: no figures
                lines += ["", f"*{_stats_summary(stats)}*"]
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the conversation as JSON (`.json`, or no suffix) or Markdown (`.md`)."""
        path = Path(path).expanduser()
        suffix = path.suffix.lower()
        if suffix == "":
            path = path.with_suffix(".json")
            suffix = ".json"
        if suffix == ".json":
            text = json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"
        elif suffix in (".md", ".markdown"):
            text = self.to_markdown()
        else:
            raise BadArgument(f"{path.name}: save as .json or .md (Markdown)")
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as e:
            raise BadArgument(f"cannot write {path}: {e.strerror or e}") from None
        return path

    def load(self, path: str | Path) -> int:
        """Continue a conversation saved by `save` as JSON (ollama's `/load`): its system
        prompt and messages replace these (settings stay); the number of messages. A file
        that is not such a conversation is a BadArgument naming it, and nothing changes."""
        path = Path(path).expanduser()
        if path.suffix == "":
            path = path.with_suffix(".json")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise BadArgument(f"cannot read {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise BadArgument(f"{path}: not a conversation saved by /save ({e})") from None
        messages = data.get("messages") if isinstance(data, dict) else None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict)
            and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise BadArgument(
                f'{path}: not a conversation saved by /save (expected "messages": a list of '
                '{"role": "system", "user" or "assistant", "content": text})'
            )
        system = [m["content"] for m in messages if m["role"] == "system"]
        turns = [
            {"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"
        ]
        self.reset()
        self.system = system[0] if system else None
        self.messages = turns
        self.replies = [Reply(Stats(), "loaded") for m in turns if m["role"] == "assistant"]
        return len(messages)

    # -- internals --------------------------------------------------------------------

    def _reply(
        self,
        restore: tuple[list[Message], list[Reply]],
        prompt_progress: Callable[[int, int], None] | None,
    ) -> Iterator[GenerationResponse]:
        last: GenerationResponse | None = None
        parts: list[str] = []
        try:
            ids = self._render()
            options = self.options
            if options.seed is not None:  # reply i samples with seed + i
                options = options.replace(seed=options.seed + self._generations)
            self._generations += 1
            stream = stream_generate(
                self.pair,
                self.tokenizer,
                ids,
                options,
                prompt_cache=self.cache,
                prompt_progress=prompt_progress,
            )
            try:
                for last in stream:
                    parts.append(last.text)
                    yield last
            finally:
                # On Ctrl-C too: a reply stopped between cycles commits its state to the
                # cache; one stopped anywhere else (a prefill cut midway) leaves it empty.
                stream.close()
        finally:
            self._finish(last, "".join(parts), restore)

    def _finish(
        self,
        last: GenerationResponse | None,
        text: str,
        restore: tuple[list[Message], list[Reply]],
    ) -> None:
        if last is not None:
            self.last = Reply(last.stats, last.finish_reason or "interrupted")
            self.history.append(last.stats)
        if last is None or (self.last.finish_reason == "interrupted" and not text):
            self.messages, self.replies = restore  # nothing was said: as if never asked
            return
        self.messages.append({"role": "assistant", "content": text})
        self.replies.append(self.last)

    def _checked(self, options: GenerateOptions) -> GenerateOptions:
        """`options`, once the pair is known to hold the verify width they fix: refused
        now, not at the next reply. (Auto widths are planned per reply: no calibration.)"""
        if options.verify_width is not None:
            self.pair.plan(options)
        return options

    def _render(self) -> list[int]:
        """Token ids of the conversation plus the assistant's generation prompt."""
        try:
            ids = self.tokenizer.apply_chat_template(
                self.conversation(), add_generation_prompt=True, **self.template_kwargs
            )
        except Exception as e:  # jinja2 errors, and templates that raise on their own rules
            raise BadArgument(f"the chat template cannot render this conversation: {e}") from e
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if isinstance(ids, str):
            ids = self.tokenizer.encode(ids, add_special_tokens=False)
        ids = [int(t) for t in ids]
        tail = self.tokenizer.decode(ids[-8:])
        self.starts_in_thinking = tail.rfind("<think>") > tail.rfind("</think>")
        return ids


def _markdown_content(text: str) -> str:
    """A reply's <think> section as a collapsed <details> block, the rest as is."""
    start, end = text.find("<think>"), text.find("</think>")
    if end < 0:
        return text
    thought = text[start + len("<think>") if start >= 0 else 0 : end].strip()
    answer = text[end + len("</think>") :].strip()
    return f"<details><summary>Thinking</summary>\n\n{thought}\n\n</details>\n\n{answer}"


def _stats_summary(reply: Reply) -> str:
    """A reply's stats line, in the command line's words (one line)."""
    return SEPARATOR.join(stats_fields(reply.stats, reply.finish_reason))


def _chat_settings(
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_tokens: int = 2048,
    block_size: int | None = None,
    seed: int | None = None,
    draft_window: int | None = None,
) -> GenerateOptions:
    """The old `ChatSettings(...)`: chat's options, as one `GenerateOptions`."""
    return CHAT_DEFAULTS.replace(
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        verify_width=block_size,
        seed=seed,
        draft_window=draft_window,
    )


_DEPRECATED = {
    "ChatSettings": (_chat_settings, "GenerateOptions (session.options)"),
    "ReplyStats": (Stats, "dflash_mlx.Stats (session.last.stats)"),
    "SessionTotals": (Stats, "dflash_mlx.Stats (session.totals)"),
}


def __getattr__(name: str):
    """Old names, with a DeprecationWarning."""
    if name in _DEPRECATED:
        import warnings

        value, new = _DEPRECATED[name]
        warnings.warn(f"{name} is deprecated: use {new}", DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
