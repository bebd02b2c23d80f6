"""Benchmark prompts: the built-in suites (math, code, chat) and JSONL prompt files.

A prompt file holds one JSON object per line, either `{"prompt": "text"}` or
`{"messages": [{"role": ..., "content": ...}, ...]}`; blank lines are skipped. Knows nothing
about models or tokenizers: a prompt stays text or chat messages until the benchmark
encodes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from ..engine.text import check_text
from ..errors import BadArgument

SUITES = ("math", "code", "chat")
QUICK = 2  # prompts per suite the bench runs unless told --full


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: plain text or chat messages, and where it came from."""

    suite: str
    index: int  # position in its suite, from 0
    text: str | None = None
    messages: list[dict[str, str]] | None = field(default=None, hash=False)

    @property
    def summary(self) -> str:
        """The prompt text, or the last message's content: what a report shows."""
        if self.text is not None:
            return self.text
        return self.messages[-1]["content"] if self.messages else ""

    def to_dict(self) -> dict:
        body = {"prompt": self.text} if self.text is not None else {"messages": self.messages}
        return {"suite": self.suite, "index": self.index, **body}


def _parse_line(line: str, where: str) -> tuple[str | None, list[dict[str, str]] | None]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadArgument(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
        raise BadArgument(f'{where}: expected an object with either "prompt" or "messages"')
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise BadArgument(f'{where}: "prompt" must be a non-empty string')
        return check_text(f'{where}: "prompt"', obj["prompt"]), None
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadArgument(f'{where}: "messages" must be a non-empty list')
    for i, m in enumerate(messages):
        ok = isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))
        if not ok:
            raise BadArgument(f'{where}: message {i} needs string "role" and "content"')
        check_text(f"{where}: message {i}", m["content"])
    return None, [{"role": m["role"], "content": m["content"]} for m in messages]


def parse_prompts(text: str, source: str, suite: str) -> list[BenchPrompt]:
    """Prompts from JSONL `text`; errors name `source` and the line number."""
    prompts = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        prompt, messages = _parse_line(line, f"{source}:{lineno}")
        prompts.append(BenchPrompt(suite, len(prompts), prompt, messages))
    if not prompts:
        raise BadArgument(f"{source}: no prompts (expected JSON lines with a prompt or messages)")
    return prompts


def read_prompts(path: str | Path, suite: str | None = None) -> list[BenchPrompt]:
    """Prompts from a JSONL file; the suite name defaults to the file's stem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadArgument(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
        ) from None
    except OSError as e:
        raise BadArgument(f"{path}: cannot read prompts ({e.strerror or e})") from None
    return parse_prompts(text, str(path), suite or path.stem)


def load_suite(name: str, per_suite: int | None = None) -> list[BenchPrompt]:
    """A built-in suite (`math`, `code`, `chat`), or all of them with `all`; `per_suite`:
    only the first that many prompts of each (the bench's quick default), None: all."""
    if name == "all":
        return [p for s in SUITES for p in load_suite(s, per_suite)]
    if name not in SUITES:
        raise BadArgument(f"unknown suite {name!r}: choose one of {', '.join(SUITES)} or all")
    resource = files("dflash_mlx") / "prompts" / f"{name}.jsonl"
    prompts = parse_prompts(resource.read_text(encoding="utf-8"), f"{name}.jsonl", name)
    return prompts if per_suite is None else prompts[:per_suite]
