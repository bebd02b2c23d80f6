"""The README's commands, run exactly as written: the first command (the demo pair with
`--compare`) and what it prints, the server example (its port and the curl), the bench demo,
and every other `dflash-mlx` line (real models: offline they must fail to load, never on a
flag or a usage error). A README edit that breaks a pasted command fails here."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .test_cli_compare import VERDICT
from .test_cli_serve import TIMEOUT, serve
from .test_cli_stats import SHORT, fields, kind

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(language: str) -> list[str]:
    """The README's code blocks in `language`, in order."""
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def commands() -> list[str]:
    """Every command line of the README's bash blocks (continuations joined)."""
    out = []
    for block in blocks("bash"):
        out += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return out


def shell(line: str, env: dict | None = None, timeout: float = TIMEOUT, cwd=None):
    """`line` run by bash exactly as written (pipes, quotes, comments and all)."""
    bindir = str(Path(sys.executable).parent)  # the dflash-mlx next to this Python first
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run(
        ["bash", "-c", line],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**base, "PATH": bindir + os.pathsep + base.get("PATH", ""), **(env or {})},
        stdin=subprocess.DEVNULL,
    )


COMPARED = re.compile(rf"plain decoding: [\d.]+ tok/s · {VERDICT} · same (?P<n>\d+) tokens")


def test_the_first_command_runs_as_written_and_prints_what_the_readme_shows(tmp_path):
    first = blocks("bash")[0].splitlines()[0]
    install, _, command = first.partition(" && ")
    assert install == "pip install -e ." and command.startswith("dflash-mlx generate --demo")
    assert "--verify-width" not in command and "--block-size" not in command, "the default"
    shown = blocks("text")[0].strip().splitlines()  # in a terminal: fitted to its width
    done = shell(command, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = done.stderr.strip().splitlines()  # on a pipe: one stats line
    short = [[kind(f) for f in fields(lines)] for lines in (got[-2:-1], shown[:-1])]
    assert short == [SHORT, SHORT], (got, shown)
    for line in (got[-1], shown[-1]):
        assert COMPARED.fullmatch(line), line
    assert COMPARED.fullmatch(got[-1])["n"] == COMPARED.fullmatch(shown[-1])["n"]
    assert done.stdout.strip(), "the completion is on stdout"


def other_commands() -> list[str]:
    """The README's commands for real models (and --version): everything but the lines the
    tests below run for real."""
    return [c for c in commands() if re.match(r"(echo .*\| )?dflash-mlx ", c) and "--demo" not in c]


@pytest.mark.parametrize("line", other_commands())
def test_every_other_command_parses_as_written(line, tmp_path):
    """Offline and with an empty Hub cache, a real model cannot load: the command must get
    that far (exit 0, or 2 with one error naming what could not load), never stop at a flag
    or a usage error; nothing it runs may wait for a terminal."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path)}
    done = shell(line, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode in (0, 2), done.stderr
    assert "No such option" not in done.stderr and "Usage:" not in done.stderr, done.stderr
    if done.returncode == 2:
        assert "error: " in done.stderr and "internal" not in done.stderr, done.stderr
        # ... or, for the interactive chat run here on an empty stdin, that stdin is empty
        # (refused before any model loads).
        said = r"TARGET|DRAFT|Qwen3|z-lab|could not|8080|nothing on stdin"
        assert re.search(said, done.stderr), done.stderr


def test_the_python_example_runs_up_to_loading_the_pair(tmp_path):
    (code,) = blocks("python")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, **env},
    )
    assert done.returncode == 1 and "LoadError" in done.stderr, done.stderr
    assert "Qwen3-4B" in done.stderr


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow  # the demo pair served end to end on the README's port
def test_the_server_example_runs_as_written():
    lines = [c for c in commands() if "serve --demo" in c or c.startswith("curl ")]
    (start,), (curl,) = [x for x in lines if "serve" in x], [x for x in lines if "curl" in x]
    command = start.split("#")[0].split()
    assert command[:3] == ["dflash-mlx", "serve", "--demo"]
    port = int(re.search(r"127\.0\.0\.1:(\d+)", curl).group(1))
    if not port_free(port):
        pytest.skip(f"port {port} (the README's) is in use on this machine")
    with serve(*command[2:], port=None) as server:  # as written: the default port
        assert server.base == f"http://127.0.0.1:{port}", "the curl goes where it listens"
        done = shell(curl)
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] <= 64


@pytest.mark.slow  # the bench demo, end to end
def test_the_bench_demo_runs_as_written(tmp_path):
    (line,) = [c for c in commands() if c.startswith("dflash-mlx bench --demo")]
    done = shell(line, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "lossless" in done.stdout and "mlx-lm" in done.stdout
