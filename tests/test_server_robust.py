"""A real server against slow clients, failures it must log once, and calibration.

Each test starts its own uvicorn server on loopback over the tiny session pair
(`test_server.serving`). Nothing here decides from a measured duration: deadlines are
short configured ones against clients that would go on far longer, failures are injected
into the engine, and the calibration is a stand-in that counts its calls and blocks on an
Event.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from dflash_mlx import calibration as calibrate
from dflash_mlx.server import create_server
from dflash_mlx.server.engine import EngineClosed, EngineDown, QueueFull
from dflash_mlx.speed.costs import CostCurves

from . import test_server
from .test_server import MODEL, TIMEOUT, serving

DEADLINE = 1.0  # seconds: the configured header and body deadlines
TRICKLE = 0.25  # seconds between the bytes of a slow client
BYTES = 40  # bytes it trickles: 10 s, ten times the deadline


def trickle(base: str, head: bytes, body_length: int | None) -> tuple[int, bytes]:
    """Send `head` (and then a body of `body_length` bytes, if given) one byte every
    `TRICKLE` seconds, at most `BYTES` of them, until the server answers or closes:
    (bytes trickled, what the server sent)."""
    host, port = base.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        if body_length is not None:
            sock.sendall(head)
        slow = head if body_length is None else b"x" * body_length
        sock.settimeout(TRICKLE)
        reply = b""
        for byte in slow[:BYTES]:
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # reset: the server has gone
                break
            sent += 1
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            reply += data
            break  # an answer, or the connection closed
        sock.settimeout(TIMEOUT)
        try:
            while data := sock.recv(65536):
                reply += data
        except OSError:
            pass
    return sent, reply


@pytest.fixture(scope="module")
def slow_server(models_dir):
    settings = {"body_timeout": DEADLINE, "header_timeout": DEADLINE}
    with serving(models_dir, verify_width=4, settings=settings) as s:
        yield s


def test_the_body_deadline_is_for_the_whole_body(slow_server):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    sent, reply = trickle(slow_server.base, head, 1000)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"request_timeout" in reply
    # A deadline per chunk would have let all of them through.
    assert sent < BYTES // 2, f"the connection stayed open for {sent} trickled bytes"
    assert slow_server.health()["status"] == "ok"


def test_the_header_deadline_is_for_the_whole_headers(slow_server):
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    sent, reply = trickle(slow_server.base, head, None)
    assert reply == b"", reply[:200]  # dropped without an answer
    assert sent < BYTES // 2, f"the connection stayed open for {sent} trickled bytes"


def test_head_health_answers_like_get_without_a_body(slow_server):
    get = httpx.get(f"{slow_server.base}/health", timeout=TIMEOUT)
    head = httpx.head(f"{slow_server.base}/health", timeout=TIMEOUT)
    assert head.status_code == get.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


def test_a_null_origin_is_not_told_to_use_an_option_the_cli_refuses(slow_server, models_dir):
    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app

    r = httpx.get(f"{slow_server.base}/v1/models", headers={"Origin": "null"}, timeout=TIMEOUT)
    assert r.status_code == 403
    message = r.json()["error"]["message"]
    assert "--cors-origin null" not in message
    suggested = message.split("--cors-origin ")[1].split()[0].strip("'\".,;:")
    # The option the message suggests is one the command takes: it gets past the option
    # checks and fails only on the (missing) model.
    missing = str(models_dir / "nowhere")
    args = ["serve", "--model", missing, "--draft", missing, "--port", "0"]
    out = CliRunner().invoke(app, [*args, "--cors-origin", suggested])
    assert "--cors-origin" not in out.output, out.output
    r = httpx.get(
        f"{slow_server.base}/v1/models",
        headers={"Origin": "http://example.com:3000"},
        timeout=TIMEOUT,
    )
    assert "--cors-origin http://example.com:3000" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------
# One log line per failure


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not any(r is record for r in self.records):  # seen again by a parent logger
            self.records.append(record)


@contextmanager
def server_log():
    """Every record of the server's loggers (uvicorn's and ours) while the block runs."""
    handler = Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


REQUESTS = [  # (path, body): one per API shape
    ("completions", {"model": MODEL, "prompt": "def", "max_tokens": 2}),
    ("messages", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
]
FAILURES = [
    # (what the engine raises, status, code, logged with a traceback)
    (QueueFull(3), 503, "queue_full", False),
    (EngineClosed("the server is shutting down"), 503, "shutting_down", False),
    (EngineDown("the engine worker failed (x); restarting"), 503, "engine_restarting", False),
    (RuntimeError("boom"), 500, None, True),
]


@pytest.mark.parametrize("exc,status,code,traceback", FAILURES, ids=lambda v: str(v))
def test_each_failure_is_logged_once_and_refusals_without_a_traceback(
    slow_server, exc, status, code, traceback
):
    engine = slow_server.engine

    def submit(*args, **kwargs):
        raise exc

    engine.submit = submit  # this server's engine only, for this test
    try:
        with server_log() as records:
            for path, body in REQUESTS:
                r = httpx.post(f"{slow_server.base}/v1/{path}", json=body, timeout=TIMEOUT)
                assert r.status_code == status, r.text
                assert code is None or path == "messages" or r.json()["error"]["code"] == code
            bad = httpx.post(f"{slow_server.base}/v1/completions", json={}, timeout=TIMEOUT)
            assert bad.status_code == 400
    finally:
        del engine.submit
    shown = [(r.name, r.getMessage(), bool(r.exc_info)) for r in records]
    if traceback:  # ours: each once, with its traceback
        assert len(records) == len(REQUESTS) and all(r.exc_info for r in records), shown
    else:  # expected refusals and the 400: nothing to trace, nothing twice
        assert not any(r.exc_info for r in records) and len(records) <= len(REQUESTS), shown


# ---------------------------------------------------------------------------------------
# Calibration: never while a request runs or waits


class StandIn:
    """`calibrate.measure`, replaced: fixed curves at once for the first `free` calls, then
    held (reporting progress, as a real measurement does) until `release` is set. Records,
    for each call, the request the engine was running (None: none) and how it ended."""

    def __init__(self, free: int):
        self.free = free
        self.engine = None  # the server's, once it is made
        self.running: list[object] = []
        self.ended: list[str] = []
        self.held = threading.Event()  # a held call has begun
        self.release = threading.Event()

    def __call__(self, pair, *, progress=None, **kwargs) -> CostCurves:
        self.running.append(self.engine.running if self.engine else None)
        if len(self.running) > self.free:
            self.held.set()
            deadline = time.monotonic() + TIMEOUT
            while not self.release.wait(0.005) and time.monotonic() < deadline:
                if progress is not None:
                    try:
                        progress(0, 1)
                    except BaseException:
                        self.ended.append("abandoned")
                        raise
        self.ended.append("measured")
        block = pair.draft.config.block_size
        verify = tuple(1e-3 * (1 + 0.2 * w) for w in range(block))
        return CostCurves(verify, (0.0,) + (5e-4,) * (block - 1), depths=(128,))


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """A fresh calibration cache (nothing measured yet), `measure` replaced, and the
    server's engine made known to it."""
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    fake = StandIn(free=1)
    monkeypatch.setattr(calibrate, "measure", fake)
    servers = []

    def made(engine, settings, **kwargs):
        fake.engine = engine
        servers.append(create_server(engine, settings, **kwargs))
        return servers[-1]

    monkeypatch.setattr(test_server, "create_server", made)
    fake.servers = servers
    yield fake
    fake.release.set()  # whatever happened, nothing stays held


def completion(base: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "def", "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)


def test_health_is_not_ok_and_requests_wait_until_the_startup_calibration_ends(
    models_dir, stand_in
):
    stand_in.free = 0  # the startup calibration is held
    context = serving(models_dir)
    with ThreadPoolExecutor(2) as pool:
        started = pool.submit(context.__enter__)  # returns once /health says ok
        try:
            assert stand_in.held.wait(TIMEOUT), "no calibration at startup"
            deadline = time.monotonic() + TIMEOUT
            while not (stand_in.servers and stand_in.servers[0].started):
                assert time.monotonic() < deadline, "uvicorn did not start"
                time.sleep(0.01)
            port = stand_in.servers[0].servers[0].sockets[0].getsockname()[1]
            base = f"http://127.0.0.1:{port}"
            health = httpx.get(f"{base}/health", timeout=TIMEOUT)
            assert health.status_code == 503 and health.json()["status"] == "loading"
            early = pool.submit(completion, base)
            state = test_server.Server(base, stand_in.engine).wait_until(
                lambda h: h["waiting"] == 1, "the request queued"
            )
            assert state["running"] == 0 and not started.done() and not early.done()
        finally:
            stand_in.release.set()
        server = started.result(TIMEOUT)
        try:
            assert early.result(TIMEOUT).status_code == 200
            assert server.health()["status"] == "ok"
        finally:
            context.__exit__(None, None, None)
    assert stand_in.running == [None] and stand_in.ended == ["measured"]
