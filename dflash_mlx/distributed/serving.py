"""A server across ranks (SPEC 10, item 4): rank 0's admissions, cancels and prompt caches,
replayed by the other ranks at the start of the same step.

Requests arrive at rank 0 only. Each step of its batched decoder starts by sending what
happened since the last step, in order: the prompt caches its pool handed out and took
back (`pool_acquired`, `pool_released`), the admissions (prompt tokens, options, the
prompt cache each uses) and the cancels. The other ranks (`follow`) replay them on a pool
and a decoder of their own, so every rank's pool makes the same choices (which cache a
request continues, forks, evicts: a pure function of that sequence and of the caches'
tokens, which every rank commits at the same step) and each rank's caches hold its own
shard. A prompt store's hit is agreed (`fewest`: the longest stored prefix every rank
holds), so every rank prefills the same positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .cluster import RanksFailed, abort, current, progress, stepped, stepping
from .control import CLOSED, EXIT_WORK


def lead() -> None:
    """Rank 0 of a server: from now on its decoders' admissions and cancels are broadcast
    at each step (`submitted`, `cancel_later`, `step`), for `follow` on the others."""
    c = current()
    if c is not None and c.rank == 0:
        c.leading = True


def when_aborting(hook: Callable[[str], None]) -> None:
    """Rank 0: `hook(message)` runs before a failure ends every rank (a server answers the
    requests in flight with the message)."""
    c = current()
    if c is not None and c.rank == 0:
        c.channel.on_abort.append(hook)


def submitted(row: Any, ids: list[int], options: Any) -> None:
    """Hook in `BatchDecoder.submit`. On every rank: the row's prefill chunks feed the stall
    watchdog. Rank 0 of a server records the admission, with the number of its prompt cache
    (`pool_acquired`); its progress callback (which may stop a prefill on rank 0 alone) is
    dropped: the row's prefill must be the others'."""
    c = current()
    if c is None:
        return
    if not c.leading:
        own = row.progress
        row.progress = progress if own is None else _both(own)
        return
    row.progress = progress
    cache = c.caches.get(id(row.prompt_cache)) if row.prompt_cache is not None else None
    if row.prompt_cache is not None and cache is None:
        row.prompt_cache = None  # not the pool's: the others could not hold the same
    n = c.admitted
    c.admitted += 1
    c.ordinals[id(row)] = n
    c.events.append(("submit", n, list(ids), options, cache))


def _both(own: Callable[[int, int], None]) -> Callable[[int, int], None]:
    def both(done: int, total: int) -> None:
        progress()
        own(done, total)

    return both


def pool_acquired(pc: Any, prompt: list[int]) -> None:
    """Hook in `PromptCachePool.acquire`: rank 0 of a server numbers the cache handed out
    and records the acquisition, for the others' pools to make the same."""
    c = current()
    if c is None or not c.leading:
        return
    k = c.cache_count
    c.cache_count += 1
    c.caches[id(pc)] = k
    c.events.append(("acquire", k, list(prompt)))


def pool_released(pc: Any) -> None:
    """Hook in `PromptCachePool.release`: rank 0 of a server records the release."""
    c = current()
    if c is None or not c.leading:
        return
    k = c.caches.pop(id(pc), None)
    if k is not None:
        c.events.append(("release", k))


def cancel_later(row: Any) -> bool:
    """Hook in `BatchDecoder.cancel`: rank 0 of a server defers a cancel to the start of
    the next step, where every rank applies it (True: deferred)."""
    c = current()
    if c is None or not c.leading:
        return False
    n = c.ordinals.get(id(row))
    if n is None:
        return False
    c.cancels.append(row)
    c.events.append(("cancel", n))
    return True


def step() -> None:
    """Hook at the start of `BatchDecoder.step`: the stall watchdog runs until `stepped`;
    rank 0 of a server applies the cancels deferred since the last step and sends this
    step's events to the others."""
    c = current()
    if c is None:
        return
    stepping()
    if not c.leading:
        return
    for row in c.cancels:
        row.cancelled = True
    c.cancels = []
    events, c.events = c.events, []
    c.channel.send(("step", events))


def step_failed(error: BaseException) -> None:
    """Hook where a server's batched step failed as a whole: across ranks the others are
    mid-step, out of step for good, so every rank ends (rank 0 answers the requests in flight
    first). Alone: nothing (the next requests get a fresh decoder)."""
    c = current()
    if c is None:
        return
    abort(f"rank {c.rank} failed in a decode step: {type(error).__name__}: {error}")


def follow(
    pair: Any,
    tokenizer: Any,
    max_batch: int,
    prompt_cache_slots: int = 1,
    prompt_store: Any = None,
) -> None:
    """The other ranks of a server: a decoder (and a prompt cache pool over this rank's
    `prompt_store`) that runs rank 0's steps with rank 0's admissions, cancels and pool
    choices, until rank 0 ends. A step that fails here is raised: every rank ends."""
    from ..engine.batch import BatchDecoder
    from ..server.prompt_pool import PromptCachePool

    c = current()
    if c is None:
        raise RuntimeError("follow() outside a cluster")
    decoder = BatchDecoder(pair, tokenizer, max_batch=max_batch)
    pool = PromptCachePool(prompt_cache_slots, prompt_store)
    caches: dict[int, Any] = {}
    rows: dict[int, Any] = {}
    if prompt_store is not None:
        # Rank 0 ends the launch once it has: this rank's pending block writes first, on
        # whichever way it ends (rank 0's word, Ctrl-C here, rank 0 gone).
        c.channel.before_exit.append(lambda: prompt_store.flush(EXIT_WORK))
    restore = _defer_ctrl_c()
    try:
        while True:
            msg = c.channel.recv()
            if msg is CLOSED:
                decoder.close()
                return
            if msg[0] != "step":
                raise RanksFailed(f"rank {c.rank} fell out of step with rank 0: got {msg[0]}")
            for ev in msg[1]:
                replay(ev, pool, caches, decoder, rows)
            decoder.step()
            stepped()
            for n in [n for n, r in rows.items() if r.done]:
                del rows[n]
    finally:
        # Its blocks on disk before it says how it ended (rank 0 waits for that word, and
        # the launcher ends this rank once rank 0 has exited), as rank 0's server does.
        if prompt_store is not None:
            prompt_store.flush(EXIT_WORK)
        restore()


def _defer_ctrl_c() -> Callable[[], None]:
    """Ctrl-C in a terminal reaches every rank of a launch at once. Rank 0 ends the others
    (its word, then each one's pending writes, `Channel.before_exit`): a Ctrl-C landing here
    mid-step would cut this rank's step or its prompt store's writes short. So the first is
    left to rank 0; a second ends this rank at once. Returns what puts the handler back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = signal.getsignal(signal.SIGINT)
    if old is not signal.default_int_handler:
        return lambda: None  # ignored (a background job) or the embedder's own
    pressed = []

    def handler(signum: int, frame: Any) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(signum)

    signal.signal(signal.SIGINT, handler)
    return lambda: signal.signal(signal.SIGINT, old)


def replay(ev: tuple, pool: Any, caches: dict[int, Any], decoder: Any, rows: dict) -> None:
    """One of rank 0's events on this rank's `pool` and `decoder` (`caches`: the pool's
    caches by rank 0's numbers; `rows`: the decoder's rows by admission number)."""
    if ev[0] == "acquire":
        caches[ev[1]] = pool.acquire(ev[2])
    elif ev[0] == "release":
        pc = caches.pop(ev[1], None)
        if pc is not None:
            pool.release(pc)
    elif ev[0] == "submit":
        pc = caches.get(ev[4]) if ev[4] is not None else None
        rows[ev[1]] = decoder.submit(ev[2], ev[3], prompt_cache=pc)
    elif ev[0] == "cancel" and ev[1] in rows:
        rows[ev[1]].cancelled = True
