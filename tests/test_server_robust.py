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
from contextlib import contextmanager

import httpx
import pytest

from dflash_mlx.server.engine import EngineClosed, EngineDown, QueueFull

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
            if not data or reply:
                break
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
