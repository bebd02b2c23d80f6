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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import BadArgument
from .generate import GenerationResponse, stream_generate
from .prompt_cache import PromptCache

Message = dict[str, str]

# `/set` names -> ChatSettings fields.
SETTING_NAMES = {
    "temp": "temperature",
    "temperature": "temperature",
    "top_p": "top_p",
    "max_tokens": "max_tokens",
    "block_size": "block_size",
    "seed": "seed",
    "draft_window": "draft_window",
}


@dataclass
class ChatSettings:
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 2048
    block_size: int | None = None  # verify width W; None: chosen per cycle
    seed: int | None = None  # None: random; else reply i samples with seed + i
    draft_window: int | None = None  # positions a draft block sees; None: the draft's own


@dataclass
class ReplyStats:
    """What one reply cost and how well the draft did, from its GenerationResponses."""

    generation_tokens: int = 0
    generation_tps: float = 0.0
    mean_acceptance: float = 0.0  # tau: tokens committed per verify pass
    cycles: int = 0
    committed: int = 0  # tokens committed by verify passes (the sum of their tau)
    drafted: int = 0  # drafted tokens the target checked
    accepted: int = 0  # ... and accepted
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the previous turn, not prefilled
    prompt_tps: float = 0.0  # prefill speed over the tokens actually prefilled
    time_to_first_token: float = 0.0
    peak_memory: float = 0.0  # GB
    finish_reason: str | None = None  # "stop" | "length" | "interrupted"
    responses: int = 0
    plain_tokens: int = 0  # committed by plain steps (W = 1)
    probes: int = 0  # speculative cycles the width chooser made as probes
    draft: str | None = None  # at the end: "active", "dormant", None (no draft)

    @property
    def acceptance_rate(self) -> float | None:
        """Fraction of drafted tokens accepted; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def decode_seconds(self) -> float:
        n = self.generation_tokens - 1  # generation_tps excludes the first token
        return n / self.generation_tps if n > 0 and self.generation_tps > 0 else 0.0

    def add(self, r: GenerationResponse) -> None:
        if self.responses == 0:
            self.prompt_tokens = r.prompt_tokens
            self.cached_tokens = r.cached_tokens
            self.prompt_tps = r.prompt_tps
            self.time_to_first_token = r.time_to_first_token
        self.responses += 1
        self.committed = r.stats.committed
        self.drafted = r.drafted_tokens
        self.accepted = r.accepted_tokens
        self.generation_tokens = r.generation_tokens
        self.generation_tps = r.generation_tps
        self.mean_acceptance = r.mean_acceptance
        self.cycles = r.cycles
        self.peak_memory = max(self.peak_memory, r.peak_memory)
        self.finish_reason = r.finish_reason
        self.plain_tokens = r.stats.widths.get(1, [0, 0])[1]
        self.probes = r.stats.probes
        self.draft = r.stats.draft

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate}


@dataclass
class SessionTotals:
    """Sums over every reply of the session, retried and interrupted ones included."""

    replies: int = 0
    generation_tokens: int = 0
    decode_seconds: float = 0.0
    prefilled_tokens: int = 0
    cached_tokens: int = 0
    cycles: int = 0
    committed: int = 0
    drafted: int = 0
    accepted: int = 0
    peak_memory: float = 0.0
    first_token_seconds: list[float] = field(default_factory=list)
    plain_tokens: int = 0
    probes: int = 0
    draft: str | None = None  # after the latest reply

    def add(self, s: ReplyStats) -> None:
        self.replies += 1
        self.plain_tokens += s.plain_tokens
        self.probes += s.probes
        self.draft = s.draft or self.draft
        self.generation_tokens += s.generation_tokens
        self.decode_seconds += s.decode_seconds
        self.prefilled_tokens += s.prefilled_tokens
        self.cached_tokens += s.cached_tokens
        self.cycles += s.cycles
        self.committed += s.committed
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.peak_memory = max(self.peak_memory, s.peak_memory)
        self.first_token_seconds.append(s.time_to_first_token)

    @property
    def generation_tps(self) -> float:
        decoded = self.generation_tokens - self.replies  # each reply's first token is prefill
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def mean_acceptance(self) -> float:
        return self.committed / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class ChatSession:
    """One conversation with a target (and optionally a DFlash draft).

    `send(text)` and `retry()` are generators of `GenerationResponse`: iterate to stream the
    reply. Closing one early (Ctrl-C, `break`) keeps the text streamed so far as the reply;
    a reply stopped before its first token leaves the conversation as it was.
    """

    def __init__(
        self,
        model,
        draft,
        tokenizer,
        *,
        system: str | None = None,
        settings: ChatSettings | None = None,
        template_kwargs: dict[str, Any] | None = None,
        model_id: str = "",
        draft_id: str | None = None,
    ):
        has_template = getattr(tokenizer, "has_chat_template", None)
        if has_template is None:  # a plain Hugging Face tokenizer
            has_template = getattr(tokenizer, "chat_template", None) is not None
        if not has_template:
            raise BadArgument(
                f"{model_id or 'this model'}: the tokenizer has no chat template, so it cannot "
                "chat (use a chat/instruct model, or `dflash-mlx generate --raw`)"
            )
        self.model, self.draft, self.tokenizer = model, draft, tokenizer
        self.model_id, self.draft_id = model_id, draft_id
        self.template_kwargs = dict(template_kwargs or {})
        self.settings = ChatSettings()
        for f in fields(ChatSettings):
            value = getattr(settings or ChatSettings(), f.name)
            self.set(f.name, "auto" if f.name == "block_size" and value is None else value)
        self.system = system or None
        self.messages: list[Message] = []  # user and assistant turns, without the system
        self.replies: list[ReplyStats] = []  # one per assistant message
        self.last: ReplyStats | None = None  # the latest reply, kept or not
        self.totals = SessionTotals()
        self.cache = PromptCache()
        self.starts_in_thinking = False  # the latest prompt opened a <think> block
        self._generations = 0

    # -- the conversation -------------------------------------------------------------

    def conversation(self) -> list[Message]:
        """The messages a request would send: the system prompt, then the turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]

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

    def set(self, name: str, value: Any) -> None:
        """Change one setting (`temp`, `top_p`, `max_tokens`, `block_size`, `seed`,
        `draft_window`)."""
        limit = self.draft.config.block_size if self.draft is not None else 1
        key, parsed = parse_setting(name, value, block_limit=limit)
        setattr(self.settings, key, parsed)

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
            "settings": asdict(self.settings),
            "template_kwargs": self.template_kwargs,
            "messages": self.conversation(),
            "replies": [s.to_dict() for s in self.replies],
        }

    def to_markdown(self) -> str:
        s = self.settings
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
            if stats is not None:
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

    # -- internals --------------------------------------------------------------------

    def _reply(
        self,
        restore: tuple[list[Message], list[ReplyStats]],
        prompt_progress: Callable[[int, int], None] | None,
    ) -> Iterator[GenerationResponse]:
        stats = ReplyStats()
        parts: list[str] = []
        try:
            ids = self._render()
            s = self.settings
            seed = None if s.seed is None else s.seed + self._generations
            self._generations += 1
            stream = stream_generate(
                self.model,
                self.draft,
                self.tokenizer,
                ids,
                max_tokens=s.max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                seed=seed,
                block_size=s.block_size,
                draft_window=s.draft_window,
                prompt_progress=prompt_progress,
                prompt_cache=self.cache,
            )
            try:
                for r in stream:
                    stats.add(r)
                    parts.append(r.text)
                    yield r
            finally:
                # On Ctrl-C too: a reply stopped between cycles commits its state to the
                # cache; one stopped anywhere else (a prefill cut midway) leaves it empty.
                stream.close()
        finally:
            self._finish(stats, "".join(parts), restore)

    def _finish(
        self, stats: ReplyStats, text: str, restore: tuple[list[Message], list[ReplyStats]]
    ) -> None:
        if stats.responses:
            self.last = stats
            self.totals.add(stats)
        if stats.finish_reason is None and stats.responses:
            stats.finish_reason = "interrupted"
        if stats.finish_reason is None or (stats.finish_reason == "interrupted" and not text):
            self.messages, self.replies = restore  # nothing was said: as if never asked
            return
        self.messages.append({"role": "assistant", "content": text})
        self.replies.append(stats)

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


def parse_setting(name: str, value: Any, *, block_limit: int | None = None) -> tuple[str, Any]:
    """(`ChatSettings` field, parsed value) for `/set NAME VALUE`; BadArgument when bad.

    `block_limit` is the largest verify width (the draft's block size, 1 without a draft);
    None checks only that a width is a positive integer.
    """
    key = SETTING_NAMES.get(str(name).strip().lower())
    if key is None:
        raise BadArgument(f"unknown setting {name!r}; one of: {', '.join(_shown_names())}")
    text = str(value).strip().lower()
    if key == "block_size":
        if text in ("auto", "none"):
            return key, None
        limit = block_limit if block_limit is not None else float("inf")
        if not text.isdigit() or not 1 <= int(text) <= limit:
            if block_limit is None:
                rule = "auto, or a verify width >= 1"
            elif block_limit == 1:
                rule = "auto or 1: there is no draft"
            else:
                rule = f"auto, or a verify width 1..{block_limit} (the draft's block size)"
            raise BadArgument(f"block_size {value!r}: {rule}")
        return key, int(text)
    try:
        if key == "seed":
            return key, None if text in ("none", "random") else int(text)
        if key == "draft_window":
            if text in ("none", "auto", "default"):
                return key, None
            v = int(text)
            ok = v >= 2
        elif key == "max_tokens":
            v = int(text)
            ok = v >= 1
        else:
            v = float(text)
            ok = v >= 0 if key == "temperature" else 0 < v <= 1
        if not ok:
            raise ValueError
    except ValueError:
        raise BadArgument(f"{_shown(key)} {value!r}: {_RULES[key]}") from None
    return key, v


_RULES = {
    "temperature": "a number >= 0 (0 is greedy)",
    "top_p": "a number in (0, 1]",
    "max_tokens": "an integer >= 1",
    "seed": "an integer, or none",
    "draft_window": "none (the draft's own window), or an integer >= 2",
}


def _shown(key: str) -> str:
    return "temp" if key == "temperature" else key


def _shown_names() -> list[str]:
    return [n for n in SETTING_NAMES if n != "temperature"]


def _markdown_content(text: str) -> str:
    """A reply's <think> section as a collapsed <details> block, the rest as is."""
    start, end = text.find("<think>"), text.find("</think>")
    if end < 0:
        return text
    thought = text[start + len("<think>") if start >= 0 else 0 : end].strip()
    answer = text[end + len("</think>") :].strip()
    return f"<details><summary>Thinking</summary>\n\n{thought}\n\n</details>\n\n{answer}"


def _stats_summary(s: ReplyStats) -> str:
    parts = [f"{s.generation_tokens} tokens", f"{s.generation_tps:.1f} tok/s"]
    if s.cycles:
        parts.append(f"τ {s.mean_acceptance:.2f}")
    if s.finish_reason == "length":
        parts.append("stopped at max_tokens")
    elif s.finish_reason == "interrupted":
        parts.append("interrupted")
    return " · ".join(parts)
