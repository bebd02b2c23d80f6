"""The server's prompt caches: one per recent conversation, shared prefixes forked.

Only the engine's worker thread uses the pool. A cache serves one request at a time: the
pool never hands out a cache a running request holds (requests of a batch run at once).
With a `PromptStore`, every cache of the pool resumes from it as well: a prefix any
conversation (or an earlier server on the same folder) prefilled is found there.
"""

from __future__ import annotations

import copy
import dataclasses

from .. import distributed
from ..cache.prompt_cache import PromptCache, common_prefix
from ..cache.prompt_store import PromptStore


def fork(pc: PromptCache) -> PromptCache:
    """A new PromptCache holding a copy of `pc`'s state: the request that resumes from it
    trims and extends the copy, never the original (another conversation's cache)."""
    out = PromptCache(store=pc.store)
    state = pc.state
    if state is not None:
        lease, _ = out.take(*state.owner)
        # The caches and the draft's context are copied; the models (the owner, and the
        # target head a DraftState carries) are shared.
        copied = dataclasses.replace(
            state,
            tokens=list(state.tokens),
            target_cache=copy.deepcopy(state.target_cache),
            draft=copy.deepcopy(state.draft),
            pending=list(state.pending),
            snapshots=list(state.snapshots),
        )
        out.commit(lease, copied)
    return out


class PromptCachePool:
    """A few PromptCaches, one per recent conversation, most recently used last.

    A request takes the cache whose last request it continues (that whole prompt is shared:
    a next turn, or a retry of the last reply). A new conversation that shares at least
    `MIN_SHARED` tokens with a cached one (agents resend one long system prompt and tool
    list from every conversation) gets a copy of that cache, so it prefills only the rest
    and the other conversation keeps its own; the copy takes a free slot, else the least
    recently used other one. Anything else takes a free slot, else an emptied cache, else
    the least recently used one. Only the worker thread uses the pool.

    A cache is in use from `acquire` to `release`: it is never handed out again meanwhile
    (two requests of a batch never share one). When every slot is in use, a request gets a
    cache of its own beyond the slots, and the least recently used caches not in use are
    dropped once it is released, down to `slots`.
    """

    MIN_SHARED = 64  # below this, prefilling the prefix again costs less than a copy

    def __init__(self, slots: int, store: PromptStore | None = None):
        if slots < 1:
            raise ValueError(f"prompt cache slots {slots} must be >= 1")
        self.slots = slots
        self.store = store  # every cache resumes from it too (see PromptCache)
        self._caches: list[PromptCache] = []
        self._prompt_len: list[int] = []  # the length of each cache's last prompt
        self._in_use: set[int] = set()  # ids of the caches handed out and not yet released

    def acquire(self, prompt: list[int]) -> PromptCache:
        caches = self._caches
        free = [k for k, c in enumerate(caches) if id(c) not in self._in_use]
        shared = [common_prefix(pc.tokens, prompt) for pc in caches]
        continued = [k for k in free if shared[k] > 0 and shared[k] >= self._prompt_len[k] - 1]
        best = max(free, key=lambda k: (shared[k], k), default=None)
        if continued:
            pc = self._drop(max(continued, key=lambda k: shared[k]))
        elif best is not None and shared[best] >= self.MIN_SHARED and self.slots > 1:
            pc = fork(caches[best])
            others = [k for k in free if k != best]
            if len(caches) >= self.slots and others:  # evict the least recently used other
                self._drop(others[0])
        elif len(caches) < self.slots or not free:
            pc = PromptCache(store=self.store)
        else:
            empty = [k for k in free if not caches[k].tokens]
            pc = self._drop(empty[0] if empty else (best if shared[best] else free[0]))
        caches.append(pc)
        self._prompt_len.append(len(prompt))
        self._in_use.add(id(pc))
        distributed.pool_acquired(pc, prompt)  # a server across ranks: told to the others
        return pc

    def release(self, pc: PromptCache) -> None:
        """The request holding `pc` has ended; the pool keeps at most `slots` caches."""
        distributed.pool_released(pc)  # a server across ranks: told to the others
        self._in_use.discard(id(pc))
        while len(self._caches) > self.slots:
            free = [k for k, c in enumerate(self._caches) if id(c) not in self._in_use]
            if not free:
                break
            self._drop(free[0])

    def _drop(self, k: int) -> PromptCache:
        self._prompt_len.pop(k)
        return self._caches.pop(k)
