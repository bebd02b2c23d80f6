"""PromptCache: decoding state kept between requests of one conversation.

A chat turn or a server request usually repeats the previous prompt and reply before its
new text. Passing the same `PromptCache` to `stream_generate` each time keeps the target's
cache, the draft's context cache and the token history, so a request prefills only from
the longest common prefix on (SPEC 1: caches only ever hold committed positions).
Recurrent targets cannot be trimmed to an arbitrary prefix: their state is snapshotted
just before the last prompt token and after the last committed cycle, and a request
resumes from the longest snapshot its prompt extends (a chat turn: the whole previous
exchange, or the previous prompt when the template rewrote the reply).
Owns the bookkeeping; `decode.py` does the trimming and restoring.
"""

from __future__ import annotations

from typing import Any


class PromptCache:
    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget everything (e.g. a new conversation)."""
        self.owner: tuple[Any, Any] | None = None  # (target model, draft) it was built with
        self.tokens: list[int] = []  # prompt + generated tokens of the last request
        self.target_cache: list[Any] | None = None
        self.draft_caches: list[Any] | None = None
        self.draft_base = 0  # the target position the draft's context starts at
        self.draft_gaps: list[tuple[int, int]] = []  # positions it skipped (DFlashDraft.gaps)
        # Recurrent states, each after this many tokens of `tokens` were fed.
        self.snapshots: list[tuple[int, dict[int, tuple]]] = []

    def __len__(self) -> int:
        return len(self.tokens)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
