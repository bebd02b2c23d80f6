"""The engine worker: the one thread that runs MLX, and the fair queue in front of it.

With `max_batch` 1 every generation goes through `dflash_mlx.stream_generate` on this
thread, one request at a time in arrival order. With more (the default, 8), the worker
drives one `batch.BatchDecoder` (`batching.py`): up to `max_batch` requests decode together,
joining and leaving between cycles, admitted in arrival order while the rows' tokens
(prompt + max_tokens each) stay within `max_batch_tokens`. Either way at most `max_queue`
requests wait beyond the running ones; more are refused (`QueueFull`). A few `PromptCache`s
keep recent conversations so that a follow-up request prefills only what its history does
not share (a cache serves one request at a time), and a `PromptStore` (optional) keeps
prompt prefixes for every conversation, on disk across restarts. Requests arrive from an asyncio
event loop and stream `GenerationResponse`s back to it. The worker is supervised: if it
dies, waiting requests and new ones are refused (503, `/health` too) until a fresh worker
has taken its place. No request waits for a calibration: the pair's cost curves are
measured during the warm-up (before `ready`), and one due later (new conditions: another
BLAS, the power source) only while no request runs or waits, logged, and abandoned as soon
as one arrives; the width policy learns costs from the passes it runs meanwhile. Knows
nothing about HTTP or OpenAI's formats: it takes token ids and a `GenerateOptions`, and
serves one `Pair`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from ..cache.prompt_cache import PromptCache
from ..cache.prompt_store import PromptStore
from ..engine.generate import GenerationResponse, stream_generate
from ..engine.text import encode_prompt
from ..grammar_cage import start_deep
from ..options import GenerateOptions
from ..pair import Pair
from ..stats import SEPARATOR, stats_fields
from . import batching
from .prompt_pool import PromptCachePool

log = logging.getLogger("dflash_mlx.server")

_END = object()  # the worker's last item on a job's queue


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the request queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class EngineClosed(Exception):
    pass


class EngineDown(Exception):
    """The worker died; it is being restarted."""


_Cancelled = batching.Cancelled


def vocab_size(model) -> int | None:
    """Rows of the target's embedding: token ids must be below it."""
    args = getattr(model, "args", None)
    n = getattr(args, "vocab_size", None)
    if n is None:
        text = getattr(args, "text_config", None)
        n = text.get("vocab_size") if isinstance(text, dict) else None
    return int(n) if n else None


class Job:
    """One request: its prompt ids and options, and the responses streaming back."""

    def __init__(self, engine: Engine, prompt: list[int], options: GenerateOptions):
        self.prompt = prompt
        self.options = options
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        # Prompt tokens taken from the prompt store's memory and disk (set before the first
        # response is handed over).
        self.sources: tuple[int, int] = (0, 0)
        self.row: Any = None  # its row in the worker's BatchDecoder (with max_batch > 1)

    @property
    def tokens(self) -> int:
        """Positions its row may hold: the prompt and all it may generate."""
        return len(self.prompt) + self.options.max_tokens

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Withdraw the request; if it is running, the worker stops it after this cycle."""
        if not self._cancel.is_set():
            self._cancel.set()
            self._engine._withdraw(self)

    async def responses(self) -> AsyncIterator[GenerationResponse]:
        """The request's responses in order; the worker's exception, if it failed, is raised."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _put(self, item: object) -> None:
        """From the worker thread: hand an item to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancel.set()


def request_line(outcome: str, last: GenerationResponse, seconds: float) -> str:
    """The log's one line per request, from its `Stats`, in the words of the command line's
    stats line (`stats_fields`): tokens and speed, tau and what ran, prefill, time to first
    token, peak memory, how it ended; then the request's whole time (as llama-server logs
    a request)."""
    fields = stats_fields(last.stats, last.finish_reason or "cut short", last.stop)
    return f"request {outcome}: " + SEPARATOR.join([*fields, f"{seconds:.2f} s"])


def _old_form(model, draft, args: tuple, options, old: dict):
    """`Engine(model, draft, tokenizer, block_size=..., draft_window=...)`, deprecated."""
    import warnings

    warnings.warn(
        "Engine(model, draft, tokenizer, ...) is deprecated: use Engine(Pair(model, draft), "
        "tokenizer, options=GenerateOptions(...))",
        DeprecationWarning,
        stacklevel=3,
    )
    if len(args) != 1:
        raise TypeError("Engine(model, draft, tokenizer): the tokenizer is missing")
    unknown = set(old) - {"block_size", "verify_width", "draft_window"}
    if unknown:
        raise TypeError(f"Engine got unexpected keyword arguments {sorted(unknown)}")
    if "block_size" in old:  # the warning above covers the old keyword too
        old["verify_width"] = old.pop("block_size")
    return Pair(model, draft), args[0], GenerateOptions.from_kwargs(options, **old)


class Engine:
    """The worker thread that owns MLX, running up to `max_batch` requests together (rows of
    at most `max_batch_tokens` positions in all; one request alone may exceed it), and a
    FIFO queue of at most `max_queue` more."""

    def __init__(
        self,
        pair: Pair,
        tokenizer,
        *args: Any,
        options: GenerateOptions | None = None,
        max_queue: int = 16,
        prompt_cache_slots: int = 4,
        prompt_store: PromptStore | None = None,
        warm_up: bool = True,
        max_batch: int = 8,
        max_batch_tokens: int = 32768,
        **old: Any,
    ):
        if max_queue < 0:
            raise ValueError(f"max_queue {max_queue} must be >= 0")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch {max_batch!r} must be an integer >= 1")
        if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens {max_batch_tokens!r} must be an integer >= 1")
        if not isinstance(pair, Pair):  # the old form: Engine(model, draft, tokenizer, ...)
            pair, tokenizer, options = _old_form(pair, tokenizer, args, options, old)
        elif args or old:
            raise TypeError("Engine(pair, tokenizer, *, options=..., ...)")
        self.pair = pair
        # The worker measures the pair's costs itself, never inside a request.
        pair.calibrate_in_plan = False
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size(pair.model)
        self.max_queue = max_queue
        self.max_batch = max_batch if max_batch == 1 else batching.batch_size(pair, max_batch)
        self.max_batch_tokens = max_batch_tokens
        # The server's defaults (verify width, draft window, budget): requests start from them.
        self.options = options or GenerateOptions()
        # Whether requests choose their width from the pair's measured costs.
        self._calibrates = pair.calibration is not None and self.options.verify_width is None
        # Prompt prefixes in blocks, shared by every conversation, maybe on disk.
        self.prompt_store = prompt_store
        self._pool = PromptCachePool(prompt_cache_slots, prompt_store)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()  # not started yet, in arrival order
        self._active: list[Job] = []  # started (with max_batch 1: the one running)
        self._closed = False
        self._warm_up = warm_up
        self.ready = False
        self.error: str | None = None  # why the warm-up failed, if it did
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.generated_tokens = 0
        self._mean_seconds = 1.0  # a running mean of request durations, for Retry-After
        self.restarts = 0  # workers that died and were replaced
        self.down: str | None = None  # why the worker died, until its replacement runs
        self._parked = threading.Event()  # set once the worker has stopped for good
        self._thread = threading.Thread(
            target=self._supervise, name="dflash-mlx-supervisor", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _supervise(self) -> None:
        """Run the worker; when it dies, refuse what waits, then start a fresh one."""
        while True:
            # On a deep stack: a grammar the builders' cache has let go is built again here.
            worker = start_deep(self._work, "dflash-mlx-engine")
            worker.join()
            if self._parked.is_set() or self._closed:
                self._parked.set()  # closed while the worker was dead: nothing to wait for
                return
            with self._cond:
                jobs = list(self._waiting) + self._active
                self._waiting.clear()
                self._active = []
                self.ready = False
                self.restarts += 1
                self.counts["failed"] += len(jobs)
            for job in jobs:
                job._cancel.set()
                job._put(EngineDown(f"the engine worker failed ({self.down}); restarting"))
                job._put(_END)
            time.sleep(min(0.1 * self.restarts, 2.0))  # a worker that dies at once: back off

    def submit(self, prompt: list[int], options: GenerateOptions | None = None) -> Job:
        """Queue a request (from the event loop); `QueueFull` when, beyond the `max_batch`
        that may run, `max_queue` are waiting."""
        job = Job(self, prompt, options or self.options)
        with self._cond:
            if self._closed:
                raise EngineClosed("the server is shutting down")
            if self.down is not None:
                raise EngineDown(f"the engine worker failed ({self.down}); restarting")
            ahead = len(self._waiting) + len(self._active)
            if ahead >= self.max_batch + self.max_queue:
                self.counts["rejected"] += 1
                raise QueueFull(self._retry_after(ahead))
            self._waiting.append(job)
            self._cond.notify()
        return job

    @property
    def running(self) -> Job | None:
        """The earliest request the worker is running now (None: idle)."""
        with self._cond:
            return self._active[0] if self._active else None

    def status(self) -> dict[str, Any]:
        with self._cond:
            out = {
                "running": len(self._active),
                "waiting": len(self._waiting),
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
                **self.counts,
                "generated_tokens": self.generated_tokens,
                "restarts": self.restarts,
            }
        if self.prompt_store is not None:
            out["prompt_cache"] = self.prompt_store.stats()
        return out

    def close(self, timeout: float = 30.0, why: str = "the server is shutting down") -> None:
        """Refuse new requests, stop the queued and running ones, wait for the worker to stop.

        The wait matters: a process that exits while the worker is inside MLX aborts.
        """
        with self._cond:
            self._closed = True
            jobs = list(self._waiting) + self._active
            self._waiting.clear()
            self._cond.notify()
        for job in jobs:
            job._cancel.set()
            job._put(EngineClosed(why))
        if self._thread.is_alive():
            self._parked.wait(timeout)
        if self.prompt_store is not None and timeout and not self.prompt_store.flush(timeout):
            log.warning("prompt cache: blocks still being written were left unwritten")

    def _retry_after(self, ahead: int) -> int:
        """Seconds until a place is likely free: `ahead` requests, `max_batch` at a time."""
        return max(1, min(60, math.ceil(self._mean_seconds * ahead / self.max_batch)))

    def _withdraw(self, job: Job) -> None:
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["cancelled"] += 1
                job._put(_END)

    def _work(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the supervisor restarts the worker
            self.down = f"{type(e).__name__}: {e}"
            log.error("the engine worker died", exc_info=True)

    def _serve(self) -> None:
        if self._warm_up and not self.restarts:
            self._warm()
        self.down = None
        self.ready = True
        if self.max_batch > 1:
            batching.Batcher(self).serve()
        else:
            self._one_at_a_time()
        # MLX can abort the process (std::terminate) when a thread that ran its work ends
        # just before the interpreter exits (mlx 0.32, CPU): the worker parks instead.
        self._parked.set()
        threading.Event().wait()

    def _one_at_a_time(self) -> None:
        while True:
            self._calibrate(between_requests=True)
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
                job = self._waiting.popleft()
                self._active.append(job)
            self._run(job)  # if it raises, the supervisor fails the job (still active)
            with self._cond:
                if job in self._active:
                    self._active.remove(job)

    def _warm(self) -> None:
        """The pair's costs (measured, or read from their cache) and one tiny generation,
        which loads the kernels."""
        self._calibrate(between_requests=False)
        try:
            ids = encode_prompt(self.tokenizer, "Hello")
            for _ in stream_generate(
                self.pair, self.tokenizer, ids, self.options.replace(max_tokens=2, stop=())
            ):
                pass
        except Exception as e:  # reported by /health; requests will fail the same way
            self.error = f"{type(e).__name__}: {e}"

    def _calibrate(self, *, between_requests: bool) -> None:
        """Measure the pair's costs if due. Between requests: only while none waits, and
        abandoned (still due) when one arrives, which then runs after at most one timed
        pass; requests meanwhile plan from the curves at hand, else the default width.
        Abandoned too when the engine closes."""

        def progress(done: int, total: int) -> None:
            if self._closed or (between_requests and self._waiting):
                raise _Cancelled

        if not self._calibrates:
            return
        try:
            if between_requests:
                progress(0, 0)
            if self.pair.calibration_due:
                when = "while idle" if between_requests else "before serving"
                log.info("calibrating the pair's costs %s (new conditions: %s)", when, _why())
                tic = time.perf_counter()
                self.pair.calibrate(progress=progress)
                log.info("calibrated in %.1f s", time.perf_counter() - tic)
        except _Cancelled:
            log.info("calibration abandoned: a request arrived (it runs on the curves at hand)")
        except Exception as e:  # e.g. no writable cache
            self._calibrates = False  # not again: each try would measure for nothing
            log.warning(
                "calibrating the pair failed (%s: %s): automatic widths go on from the "
                "curves at hand, else the default width",
                type(e).__name__,
                e,
                exc_info=not isinstance(e, OSError),
            )

    def _run(self, job: Job) -> None:
        if job.cancelled:  # withdrawn while the worker was taking it
            job._put(_END)
            with self._cond:
                self.counts["cancelled"] += 1
            return
        tic = time.perf_counter()
        pc = self._pool.acquire(job.prompt)
        try:
            self._stream(job, pc, tic)
        finally:
            self._pool.release(pc)

    def _stream(self, job: Job, pc: PromptCache, tic: float) -> None:
        def progress(done: int, total: int) -> None:
            if job.cancelled:  # a long prefill stops at the next chunk
                raise _Cancelled

        stream = stream_generate(
            self.pair,
            self.tokenizer,
            job.prompt,
            job.options,
            prompt_cache=pc,
            prompt_progress=progress,
        )
        outcome = "completed"
        last = None
        try:
            for last in stream:
                if last.width == 0:
                    job.sources = pc.sources
                job._put(last)
                if job.cancelled:
                    outcome = "cancelled"
                    break
        except _Cancelled:  # stopped during prefill: the request commits nothing back
            outcome = "cancelled"
        except Exception as e:  # a failed request leaves the cache empty, never half-written
            outcome = "failed"
            job._put(e)
        finally:
            stream.close()  # leaves the PromptCache consistent (the engine's contract)
        self._ended(job, outcome, last, tic)

    def _ended(self, job: Job, outcome: str, last: GenerationResponse | None, tic: float) -> None:
        """A started request is over: its last item, the counts, its log line."""
        job._put(_END)
        seconds = time.perf_counter() - tic
        with self._cond:
            if job in self._active:
                self._active.remove(job)
            self.counts[outcome] += 1
            if last is not None:
                self.generated_tokens += last.stats.generation_tokens
            self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * seconds
        if last is not None:
            log.info("%s", request_line(outcome, last, seconds))


def _why() -> str:
    from ..sysinfo import conditions

    return ", ".join(f"{k} {v}" for k, v in conditions().items() if v) or "none named"
