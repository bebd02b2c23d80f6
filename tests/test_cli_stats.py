"""One stats formatter for generate, chat, the bench and the server log: the same words,
singular and plural right, fitted to the terminal's width between fields (issue 25, item 6).
The real command with stderr on a pseudo-terminal of a given width, or on a pipe."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios

import pytest

from .test_cli_serve import TIMEOUT, dflash, exe, text

PROMPT = "def add(a, b):"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
FIELD = re.compile(  # every field a stats line may hold, numbers and all
    r"\d+ tokens?|[\d.]+ tok/s|τ [\d.]+|accepted \d+% of drafts|\d+% plain|all plain"
    r"|W=\d+×\d+(, W=\d+×\d+)*( \(\+\d+ widths?\))?|\d+ probes?|draft dormant|plain decoding"
    r"|trees \d+×\d+(, \d+×\d+)*( \(\+\d+ budgets?\))?|chains only: [^·]+"
    r"|prefill \d+ tokens? @ [\d.]+ tok/s( \(\d+ reused\))?|TTFT \d+ ms|peak [\d.]+ [MG]B"
    r"|hit max_tokens|end of text|stop string .+|interrupted"
)


def fields(lines: list[str]) -> list[str]:
    """The stats fields of the stats lines, each checked whole (never split across lines)."""
    out = []
    for line in lines:
        for f in line.split(" · "):
            assert FIELD.fullmatch(f), f"not a whole field: {f!r} in {lines}"
            out.append(f)
    return out


# What every run with a draft shows with -v, in this order (tau onwards: the mechanism; the
# widths, plain share and probes that ran depend on the width chooser's choices, run by run).
ALWAYS = ["tokens", "tok/s", "τ", "prefill", "TTFT", "peak", "hit max_tokens"]
# The default line: those fields and no others.
SHORT = ["tokens", "tok/s", "τ", "TTFT", "hit max_tokens"]


def kind(f: str) -> str:
    if re.fullmatch(r"\d+ tokens?", f):
        return "tokens"
    if f == "hit max_tokens":
        return f
    return "tok/s" if f.endswith(" tok/s") and " " not in f[:-6] else f.split(" ")[0]


def shape(fs: list[str]) -> list[str]:
    """The kinds of the fields every run shows, in order: what two runs must share."""
    return [k for k in map(kind, fs) if k in ALWAYS]


def on_a_terminal(args: list[str], columns: int, stdin: str | None = None) -> list[str]:
    """Run `dflash-mlx ARGS` with stderr on a pseudo-terminal `columns` wide (stdout on a
    pipe); its stderr lines, ANSI codes removed."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [*exe(), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**env, "TERM": "xterm-256color"},
    )
    os.close(slave)
    proc.stdin.write((stdin or "").encode())
    proc.stdin.close()
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the other end closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    proc.stdout.read()
    assert proc.wait(timeout=TIMEOUT) == 0, b"".join(chunks).decode(errors="replace")
    screen = ANSI.sub("", b"".join(chunks).decode()).replace("\r", "")
    return [line.rstrip() for line in screen.split("\n") if line.strip()]


def stats_lines(lines: list[str]) -> list[str]:
    """The closing stats lines: from the one that starts with the token count on."""
    starts = [i for i, line in enumerate(lines) if re.match(r"\d+ tokens? · ", line)]
    assert starts, lines
    return lines[starts[-1] :]


@pytest.fixture(scope="module")
def pair(models_dir) -> list[str]:
    return ["-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft")]


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
@pytest.mark.parametrize("columns", [60, 100])
def test_stats_are_fitted_to_the_terminal_between_fields(pair, columns):
    """In a terminal: lines no wider than it, broken between fields; on a pipe: one line
    with the same fields. Generate and chat say the same things in the same words."""
    gen = on_a_terminal(["generate", *pair, "-v", "-n", "24", PROMPT], columns)
    chat = on_a_terminal(["chat", *pair, "-v", "-n", "24"], columns, stdin=PROMPT)
    for lines in (gen, chat):
        shown = stats_lines(lines)
        assert len(shown) > 1 and all(len(line) <= columns for line in shown), shown
        assert shape(fields(shown)) == ALWAYS, shown
    done = dflash("generate", *pair, "-v", "-n", "24", PROMPT)
    piped = text(done)[1].strip().splitlines()[-1]
    assert shape(fields([piped])) == ALWAYS, piped
    assert "hit max_tokens" in piped and "draft active" not in piped


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_the_default_stats_line_is_short_and_fits_100_columns(pair):
    """By default one line in plain words: tokens, speed, τ, time to first token and how
    it ended, the same in generate and chat, on a terminal and on a pipe."""
    gen = on_a_terminal(["generate", *pair, "-n", "24", PROMPT], 100)
    chat = on_a_terminal(["chat", *pair, "-n", "24"], 100, stdin=PROMPT)
    piped = text(dflash("generate", *pair, "-n", "24", PROMPT))[1].strip().splitlines()[-1:]
    for lines in (gen, chat, piped):
        (line,) = stats_lines(lines)
        assert len(line) <= 100 and [kind(f) for f in fields([line])] == SHORT, line


def test_one_token_is_singular_and_plain_runs_say_so(pair):
    _, err = text(dflash("generate", *pair, "-v", "-n", "1", "--raw", "--verify-width", "1", "def"))
    line = err.strip().splitlines()[-1]
    fs = fields([line])
    assert fs[0] == "1 token" and "plain decoding" in fs, line
    assert "tok/s" not in fs[1], "no speed from a single token"
    assert "draft active" not in err and "1 tokens" not in err
