"""What a server shows and to whom (issue 63): loopback spelled any way (`--host 127.1`,
`0x7f.1`) keeps the Host (DNS-rebinding) check and is not warned about as exposed; the
chat page's own files carry the headers `/` has; a model folder's path is not shown on
the pages any client may read (`/health`, `/docs`) without the key."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from dflash_mlx.server.app import PAGE, PAGE_HEADERS
from dflash_mlx.server.security import is_loopback_host

from .test_cli_serve import TIMEOUT, exe
from .test_server import KEY, serving


@pytest.mark.parametrize(
    "host",
    ["127.1", "0x7f.1", "0177.0.0.1", "2130706433", "127.1:8080", "0X7F.0.0.1", "127.0.0.1",
     "localhost", "[::1]:80", "::1"],
)  # fmt: skip
def test_loopback_spelled_any_way_is_loopback(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize(
    "host",
    ["128.1", "0x80.1", "1", "127.1.evil.example", "127.0.0.1 evil", "evil.example",
     "0x7f.1.evil", "4294967296"],
)  # fmt: skip
def test_other_hosts_are_not(host):
    assert not is_loopback_host(host)


@pytest.mark.parametrize("host", ["127.1", "0x7f.1"])
def test_serve_on_loopback_spelled_otherwise_keeps_the_host_check(models_dir, host):
    """The real command: no exposure warning, and a foreign Host header is refused."""
    args = ["serve", "-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft"),
            "--host", host, "--port", "0"]  # fmt: skip
    proc = subprocess.Popen(
        [*exe(), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "300"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    log: list[str] = []
    try:
        port = None
        deadline = time.monotonic() + TIMEOUT
        while port is None:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(log)
            try:
                log.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            found = re.search(r"serving http://\S+?:(\d+)/v1", log[-1])
            port = found and found.group(1)
        base = f"http://127.0.0.1:{port}"
        while httpx.get(f"{base}/health", timeout=TIMEOUT).json()["status"] != "ok":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # any warning after the banner has been written
        while not lines.empty():
            log.append(lines.get())
        assert not any("warning" in line for line in log), "".join(log)
        evil = httpx.get(f"{base}/v1/models", headers={"Host": "evil.example"}, timeout=TIMEOUT)
        assert evil.status_code == 403 and "Host" in evil.json()["error"]["message"]
        spelled = httpx.get(f"{base}/v1/models", headers={"Host": f"{host}:{port}"})
        assert spelled.status_code == 200, spelled.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def keyed(models_dir):
    folder = str(models_dir / "qwen3")  # served under its path, as `serve -m FOLDER` does
    with serving(models_dir, api_key=KEY, settings={"model_id": folder}) as s:
        yield s, folder


def test_the_pages_own_files_carry_the_pages_headers(keyed):
    server, _ = keyed
    files = [p.relative_to(PAGE).as_posix() for p in PAGE.rglob("*") if p.is_file()]
    assert any(f.endswith(".js") for f in files) and any(f.endswith(".css") for f in files)
    for name in ["", *files]:
        r = httpx.get(f"{server.base}/page/{name}" if name else server.base, timeout=TIMEOUT)
        assert r.status_code == 200, (name, r.status_code)
        for header, value in PAGE_HEADERS.items():
            assert r.headers.get(header) == value, (name, header, r.headers.get(header))
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]


def test_a_model_folders_path_shows_only_with_the_key(keyed):
    server, folder = keyed
    name = os.path.basename(folder)
    health = httpx.get(f"{server.base}/health", timeout=TIMEOUT).json()
    assert health["model"] == name and folder not in str(health)
    docs = httpx.get(f"{server.base}/docs", timeout=TIMEOUT).text
    assert folder not in docs and f"<code>{name}</code>" in docs
    with_key = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{server.base}/health", headers=with_key).json()["model"] == folder
    models = httpx.get(f"{server.base}/v1/models", headers=with_key).json()
    assert models["data"][0]["id"] == folder  # what clients send back is unchanged
