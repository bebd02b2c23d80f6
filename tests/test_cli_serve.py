"""`dflash-mlx serve` as users start it: the real command in a subprocess, on the tiny session
models (or the demo pair), asked over HTTP. Also the helpers the other `test_cli_*` files use
to run the real command."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TIMEOUT = 120.0  # seconds, for every wait on a subprocess


def exe() -> list[str]:
    """The installed `dflash-mlx` command (what users type), next to this Python."""
    here = Path(sys.executable).with_name("dflash-mlx")
    return [str(here)] if here.exists() else [shutil.which("dflash-mlx") or "dflash-mlx"]


def dflash(*args: str, input: str | bytes | None = None, env: dict | None = None, timeout=TIMEOUT):
    """Run `dflash-mlx ARGS` to the end: the CompletedProcess, text out and err."""
    return subprocess.run(
        [*exe(), *args],
        input=input.encode() if isinstance(input, str) else (input or b""),
        capture_output=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
    )


def text(done: subprocess.CompletedProcess) -> tuple[str, str]:
    return done.stdout.decode(), done.stderr.decode()


@dataclass
class Serving:
    base: str
    log: list[str] = field(default_factory=list)

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(f"{self.base}{path}", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()


@contextmanager
def serve(*args: str, port: str | None = "0", env: dict | None = None) -> Iterator[Serving]:
    """`dflash-mlx serve ARGS --port PORT` (port None: ARGS alone) in a subprocess until
    /health says ok; stopped with Ctrl-C (SIGINT) afterwards, which must exit with code 130."""
    proc = subprocess.Popen(
        [*exe(), "serve", *args, *(["--port", port] if port is not None else [])],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        # A shell that runs the tests in the background has SIGINT ignored, and children
        # inherit that: give the command the default Ctrl-C a user's terminal gives it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    handle = Serving("")
    try:
        deadline = time.monotonic() + TIMEOUT
        while not handle.base:
            assert time.monotonic() < deadline, "".join(handle.log)
            try:
                handle.log.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, "".join(handle.log)
                continue
            found = re.search(r"serving (http://127\.0\.0\.1:\d+)/v1", handle.log[-1])
            handle.base = found.group(1) if found else ""
        while httpx.get(f"{handle.base}/health", timeout=TIMEOUT).json()["status"] != "ok":
            assert time.monotonic() < deadline, "".join(handle.log)
            time.sleep(0.05)
        yield handle
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT) == 130, "Ctrl-C: a clean stop, exit code 130"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
        reader.join(timeout=TIMEOUT)
        while not lines.empty():
            handle.log.append(lines.get())


# -- the tests ------------------------------------------------------------------------------

USER = [{"role": "user", "content": "def add(a, b):"}]


def test_serve_with_model_alone_decodes_plainly_with_one_note(models_dir, target):
    """No --draft and no draft known for the target: served plainly, one note saying how
    to add a draft (it used to be '--model and --draft are required')."""
    import dflash_mlx

    with serve("--model", str(models_dir / "qwen3")) as server:
        got = server.post(
            "/v1/chat/completions",
            {"model": "anything", "messages": USER, "max_tokens": 6, "temperature": 0},
        )
    model, tokenizer = target
    ref = dflash_mlx.generate(model, None, tokenizer, USER, max_tokens=6, temperature=0)
    assert got["choices"][0]["message"]["content"] == ref.text
    assert got["model"] == str(models_dir / "qwen3")
    log = " ".join("".join(server.log).split())
    assert log.count("no known DFlash draft") == 1 and "--draft DRAFT" in log, log
    assert "required" not in log


def test_serve_no_draft_is_an_option():
    done = subprocess.run(
        [*exe(), "serve", "--model", "m", "--draft", "d", "--no-draft"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: pass either --draft or --no-draft"), done.stderr


def test_demo_replies_are_capped_as_chats_are():
    """serve --demo: a request that names no max_tokens gets chat --demo's cap, not 2048
    tokens of gibberish (the random demo pair never ends by itself)."""
    from dflash_mlx.cli import chat, options

    assert chat.DEMO_MAX_TOKENS == options.DEMO_MAX_TOKENS
    body = {"messages": USER, "temperature": 0}
    with serve("--demo", env={"DFLASH_MLX_DEMO": "random"}) as server:
        got = server.post("/v1/chat/completions", body)
        capped = server.post("/v1/chat/completions", {**body, "max_tokens": 5})
    assert 0 < got["usage"]["completion_tokens"] <= options.DEMO_MAX_TOKENS
    assert capped["usage"]["completion_tokens"] <= 5, "a request's own max_tokens still rules"
    log = " ".join("".join(server.log).split())
    assert f"at most {options.DEMO_MAX_TOKENS} tokens" in log


def test_the_socket_accepts_connections_as_soon_as_the_banner_can_say_serving():
    """`serve` prints "serving URL" before uvicorn's loop starts: the socket already
    listens then, so a client that connects at once waits in the backlog instead of being
    refused (a loaded machine showed the refusal)."""
    import socket

    from dflash_mlx.cli.serve import listen

    sock = listen("127.0.0.1", 0)
    try:
        client = socket.create_connection(sock.getsockname(), timeout=5)
        client.close()
    finally:
        sock.close()
