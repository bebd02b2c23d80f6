"""Grammar builds on a stack deep enough for any schema the checks let through.

llguidance builds a grammar recursively, a few kB of stack per subschema on the path it
follows: past its thread's stack the process dies (SIGSEGV, every request in flight lost).
A main thread has 8 MB, a macOS secondary thread only 512 kB (about 100 `$ref`s). The
schemas served are bounded first (`schema_graph.MAX_GRAPH_DEPTH` subschemas on any path,
~50 MB of llguidance's stack at most); grammars are then built here, on threads with a
`CAGE_STACK` stack: the server's grammar builders (`DeepPool`), its engine worker (which
masks and, when a build was evicted from the cache, builds again), and `run_deep` for a
single build (`generate --json-schema`). The stack is reserved address space: only the
pages a build touches take memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

CAGE_STACK = 256 * 1024 * 1024
_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide: set, start, restore
_HERE = threading.local()  # .deep: this thread runs on a CAGE_STACK stack


def on_deep_stack() -> bool:
    return getattr(_HERE, "deep", False)


def start_deep(target: Callable[[], Any], name: str) -> threading.Thread:
    """Start a daemon thread running `target` on a `CAGE_STACK` stack."""

    def run() -> None:
        _HERE.deep = True
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _STACK_LOCK:
        old = threading.stack_size(CAGE_STACK)
        try:
            thread.start()  # the size is read when the thread is created
        finally:
            threading.stack_size(old)
    return thread


def run_deep(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a deep stack (a fresh thread, waited for, unless this thread's stack
    is one already): its result, or its exception."""
    if on_deep_stack():
        return fn(*args)
    done: Future = Future()

    def work() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.set_exception(e)

    start_deep(work, "dflash-grammar-build").join()
    return done.result()


class DeepPool:
    """A fixed number of deep-stack worker threads (started on first use), taking work in
    order; a submitted call is a `Future` that can be cancelled until a worker takes it."""

    def __init__(self, workers: int, name: str):
        self._workers = workers
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        with self._lock:
            if not self._started:
                for i in range(self._workers):
                    start_deep(self._work, f"{self._name}_{i}")
                self._started = True
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)


def build_matcher(llguidance: Any, ll_tokenizer: Any, source: str) -> tuple[str, Any]:
    """llguidance's verdict on `source` and, when it has none, its matcher, both built on a
    deep stack (the engine's `controls.compile_grammar` calls this)."""

    def build() -> tuple[str, Any]:
        error = llguidance.LLMatcher.validate_grammar(source, ll_tokenizer)
        if error:
            return error, None
        return "", llguidance.LLMatcher(ll_tokenizer, source, log_level=0)

    return run_deep(build)
