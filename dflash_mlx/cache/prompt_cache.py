"""PromptCache: decoding state kept between requests of one conversation.

A chat turn or a server request usually repeats the previous prompt and reply before its
new text. Passing the same `PromptCache` to `stream_generate` each time keeps the target's
cache, the draft's context and the token history, so a request prefills only from the
longest common prefix on (SPEC 1: caches only ever hold committed positions).
Recurrent targets cannot be trimmed to an arbitrary prefix: their state is snapshotted
just before the last prompt token and after the last committed cycle, and a request
resumes from the longest snapshot its prompt extends (a chat turn: the whole previous
exchange, or the previous prompt when the template rewrote the reply).

The cache holds one value, a `CachedState`, and changes only in two methods: a request
`take`s the state when it starts (the cache is then empty: nothing another request or a
late clean-up could see half-written) and `commit`s its own state back when it ends
cleanly or is closed between two cycles. A request that fails anywhere else commits
nothing, so the next one starts fresh. A commit is refused once another request has
taken the cache since (an abandoned stream closed late by the garbage collector, on
whatever thread, cannot overwrite a newer conversation). The engine (`prefill.py`,
`batch.py`) builds and reads the state; this module only keeps it.

With a `PromptStore` (`PromptCache(store=...)`), a request also resumes from the longest
prefix of its prompt the store holds, whichever conversation or process left it, when
that is longer than what this cache shares with it; and a committed request's prompt
blocks are kept in the store (`dflash_mlx.cache.prompt_store`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .prompt_store import Link, PromptStore

log = logging.getLogger("dflash_mlx.cache.prompt_store")


@dataclass
class CachedState:
    """What a request leaves for the next one (every field as of its last committed cycle)."""

    owner: tuple[Any, Any]  # (target model, draft) it was built with, compared by identity
    tokens: list[int]  # prompt + generated tokens
    target_cache: list[Any]  # may hold positions after the committed ones (trimmed on reuse)
    draft: Any = None  # the request's DraftState (None without a draft)
    pending: list[Any] = field(default_factory=list)  # features the draft has not consumed
    draft_end: int | None = None  # a dormant draft's context skips up to this position
    # Recurrent states, each after this many tokens of `tokens` were fed.
    snapshots: list[tuple[int, dict[int, tuple]]] = field(default_factory=list)
    # The taking request's link to the cache's PromptStore (set by `take`, read by `resume`).
    link: Link | None = None


class PromptCache:
    def __init__(self, store: PromptStore | None = None) -> None:
        self._lock = threading.Lock()
        self._state: CachedState | None = None
        self._lease = 0
        self.store = store
        self._link: Link | None = None

    @property
    def sources(self) -> tuple[int, int]:
        """Prompt tokens the latest request took from the store: (from memory, from disk)."""
        link = self._link
        return (link.memory_tokens, link.disk_tokens) if link is not None else (0, 0)

    @property
    def state(self) -> CachedState | None:
        return self._state

    @property
    def tokens(self) -> list[int]:
        """Prompt + generated tokens of the last committed request ([] when empty)."""
        state = self._state
        return state.tokens if state is not None else []

    @property
    def target_cache(self) -> list[Any] | None:
        state = self._state
        return state.target_cache if state is not None else None

    def __len__(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        """Forget everything (e.g. a new conversation)."""
        with self._lock:
            self._lease += 1
            self._state = None

    def take(self, model: Any, draft: Any) -> tuple[int, CachedState | None]:
        """Start a request: its lease, and the state to resume from when it was built with
        this very `(model, draft)` pair. The cache is empty until the request commits."""
        with self._lock:
            self._lease += 1
            lease = self._lease
            state, self._state = self._state, None
        if state is not None and not (state.owner[0] is model and state.owner[1] is draft):
            state = None
        if self.store is not None:
            link = self._link = self.store.link()
            if state is None:  # nothing of its own: the request may still resume from the store
                state = CachedState(owner=(model, draft), tokens=[], target_cache=[])
            state.link = link
        return lease, state

    def watch(
        self, progress: Callable[[int, int], None] | None
    ) -> Callable[[int, int], None] | None:
        """A prefill progress callback that also lets the store keep a recurrent target's
        state at block boundaries (`progress` itself when there is no store)."""
        if self.store is None:
            return progress

        def watched(done: int, total: int) -> None:
            link = self._link
            if link is not None:
                link.progress(done)
            if progress is not None:
                progress(done, total)

        return watched

    def commit(self, lease: int, state: CachedState) -> bool:
        """Keep `state` unless another request took the cache since `lease` was given."""
        with self._lock:
            if lease != self._lease:
                return False
            draft = getattr(state, "draft", None)
            if draft is not None:
                # The draft's context rows as values, not as a graph: a request that ended
                # before its draft ran again leaves its last rows lazy, over the rows before
                # them, and each later request of the conversation chained its own onto them
                # (the server's memory grew ~150 KB per short request, issue 43).
                import mlx.core as mx

                mx.eval(draft.arrays)
            self._state = state
            link = self._link
        if link is not None and self.store is not None:
            try:
                self.store.keep(link, state.target_cache, state.snapshots)
            except Exception as e:  # noqa: BLE001 - the store is an optimisation
                log.warning("prompt cache: keeping the prompt's blocks failed (%s)", e)
        return True


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
