"""The engine worker's loop with continuous batching (`Engine(max_batch > 1)`, SPEC 8).

The worker drives one `batch.BatchDecoder`. Each turn of its loop it hands the decoder the
waiting requests the batch has room for, in arrival order (the first that does not fit
waits, and those behind it): at most `max_batch` rows, their positions (prompt +
max_tokens each) within `max_batch_tokens` (a request alone may exceed it: it runs by
itself). The decoder prefills each in chunks with a cycle of the running rows between
them (what those cycles produce reaches the clients then, not when the admission ends),
hands out its first token and lets it join; each `step` runs one cycle of every row.
Responses go to their requests as they come; a request whose client left is cancelled in
the decoder (it leaves at the next step, its prompt cache committed as a closed stream's
is); a row's exception ends that request alone, as a failed request (the server's
internal error), and the others go on. A step that fails as a whole (the batch's own
target pass) fails the requests it held; the next ones start a fresh decoder. Each
request's prompt cache comes from the engine's pool, which never hands one cache to two
running requests. The pair is calibrated only while no request runs or waits, as between
requests without batching.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .. import distributed
from ..engine.batch import BatchDecoder
from ..engine.batch_cache import batchable
from ..engine.generate import GenerationResponse
from ..pair import Pair

if TYPE_CHECKING:
    from .engine import Engine, Job

log = logging.getLogger("dflash_mlx.server")


class Cancelled(Exception):
    """Raised from a progress callback: abandon a cancelled request's prefill, or a
    calibration a request arrived during."""


def batch_size(pair: Pair, wanted: int) -> int:
    """`wanted`, or 1 (with a warning) for a target whose caches a batch cannot hold."""
    try:
        why = batchable(pair.target.make_cache())
    except Exception:  # noqa: BLE001 - its requests will say what is wrong with the target
        return wanted
    if why is not None:
        log.warning("requests run one at a time (max_batch 1): %s", why)
        return 1
    return wanted


class _Started:
    """What the worker keeps about a request it handed to the decoder."""

    def __init__(self, pc: Any):
        self.pc = pc  # its PromptCache, from the pool
        self.tic = time.perf_counter()
        self.last: GenerationResponse | None = None
        self.outcome: str | None = None  # set when an error ended it


class Batcher:
    """The worker's loop over one `BatchDecoder` (runs on the engine's worker thread)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.decoder = self._decoder()
        self.started: dict[Job, _Started] = {}

    def _decoder(self) -> BatchDecoder:
        e = self.engine
        decoder = BatchDecoder(e.pair, e.tokenizer, max_batch=e.max_batch)
        decoder.on_output = self._between_chunks
        decoder.interrupt = self._interrupt
        return decoder

    def _interrupt(self) -> bool:
        """Whether a waiting request has room in the batch, or a running one's client is
        gone: the decoder's stretch of plain steps ends for it (read without the lock: a
        late answer only delays it by a pass)."""
        e = self.engine
        if e._waiting and len(e._active) < e.max_batch:
            return True
        return any(job.cancelled for job in self.started)

    def _between_chunks(self, out: list) -> None:
        """While a long prompt is admitted, the running rows' tokens made between its
        chunks reach their clients at once; a client gone by then cancels its row."""
        self._dispatch(out)
        self._reap()
        self._cancel_gone()

    def serve(self) -> None:
        """Serve until the engine closes."""
        try:
            self._loop()
        finally:  # also when the worker dies: its requests' caches may be handed out again
            for started in self.started.values():
                self.engine._pool.release(started.pc)

    def _loop(self) -> None:
        e = self.engine
        while True:
            if not self.started:
                e._calibrate(between_requests=True)  # only while nothing runs or waits
            with e._cond:
                while not e._waiting and not e._active and not e._closed:
                    e._cond.wait()
                if e._closed:
                    break
                jobs = self._next()
            for job in jobs:
                self._start(job)
            self._cancel_gone()
            if self.decoder.busy:
                try:
                    out = self.decoder.step()
                except Exception as error:  # noqa: BLE001 - the batch's pass: its rows fail
                    self._fail_all(error)
                    continue
                self._dispatch(out)
            self._reap()
        self._close()

    def _cancel_gone(self) -> None:
        for job in list(self.started):
            if job.cancelled and job.row is not None and not job.row.done:
                self.decoder.cancel(job.row)

    def _next(self) -> list[Job]:
        """The waiting requests the batch has room for, in arrival order, moved to the
        running ones (called holding the engine's lock)."""
        e = self.engine
        jobs = []
        used = sum(j.tokens for j in e._active)
        while e._waiting and len(e._active) < e.max_batch:
            job = e._waiting[0]
            if e._active and used + job.tokens > e.max_batch_tokens:
                break  # it waits (and those behind it) until rows leave
            e._waiting.popleft()
            e._active.append(job)
            jobs.append(job)
            used += job.tokens
        return jobs

    def _start(self, job: Job) -> None:
        e = self.engine
        pc = e._pool.acquire(job.prompt)
        started = self.started[job] = _Started(pc)

        def progress(done: int, total: int) -> None:
            if job.cancelled:  # a long prefill stops at the next chunk
                raise Cancelled

        if job.cancelled:  # withdrawn while the worker was taking it
            started.outcome = "cancelled"
            self._end(job)
            return
        try:
            job.row = self.decoder.submit(
                job.prompt, job.options, handle=job, prompt_cache=pc, progress=progress
            )
        except Exception as error:  # noqa: BLE001 - its settings: this request fails
            job._put(error)
            started.outcome = "failed"
            self._end(job)

    def _dispatch(self, out: list) -> None:
        for row, item in out:
            job: Job = row.handle
            started = self.started.get(job)
            if started is None:
                continue
            if isinstance(item, Cancelled):  # stopped during its prefill
                started.outcome = "cancelled"
            elif isinstance(item, BaseException):
                # The row's error, the request's alone: never half-written to its cache.
                started.outcome = "failed"
                job._put(item)
            else:
                if item.width == 0:
                    job.sources = started.pc.sources
                started.last = item
                job._put(item)

    def _reap(self) -> None:
        """End the requests whose rows are done."""
        for job in [j for j in self.started if j.row is not None and j.row.done]:
            self._end(job)

    def _end(self, job: Job, outcome: str | None = None) -> None:
        started = self.started.pop(job)
        last = started.last
        if outcome is None:
            outcome = started.outcome
        if outcome is None:
            finished = last is not None and last.finish_reason is not None
            outcome = "completed" if finished else "cancelled"
        self.engine._pool.release(started.pc)
        self.engine._ended(job, outcome, last, started.tic)

    def _fail_all(self, error: Exception) -> None:
        """A step failed outside any one row: every request in the decoder fails with it,
        and a fresh decoder serves the next ones."""
        distributed.step_failed(error)  # across ranks: every rank ends (never returns)
        log.error("a batched step failed: its %d requests fail", len(self.started))
        for job in list(self.started):
            if job.row is not None and not job.row.done:
                job._put(error)
                self._end(job, "failed")
            else:
                self._end(job)
        self.decoder = self._decoder()

    def _close(self) -> None:
        """The engine closes: every row ends (cancelled), their prompt caches committed."""
        self.decoder.close()
        for job in list(self.started):
            self._end(job, "cancelled")
