"""One table of generation options drives `generate`, `chat` (and its `/set`), `serve` and
`bench`: the same flags with the same help everywhere, each reaching the engine (issue 25,
item 3). The real `dflash-mlx` command in a subprocess (and a pseudo-terminal for `/set`)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys

import pytest
import typer

import dflash_mlx
from dflash_mlx.chat.settings import NAMES
from dflash_mlx.cli import chat_repl
from dflash_mlx.cli.main import app
from dflash_mlx.cli.options import SETTINGS
from dflash_mlx.options import OPTIONS

from .test_cli_serve import dflash, serve, text

COMMANDS = ("generate", "chat", "serve", "bench")
PROMPT = "def add(a, b):"


def flags_of(command: str) -> dict[str, str]:
    """Each option of `command`: its long flags -> its help text (as click holds it); a
    switch's flag for False (`--no-tree` of `--tree/--no-tree`) too."""
    group = typer.main.get_command(app)
    cmd = group.commands[command]
    return {
        flag: p.help
        for p in cmd.params
        for flag in [p.opts[0], *getattr(p, "secondary_opts", [])]
        if flag.startswith("--")
    }


def test_every_generation_option_is_one_flag_with_one_help_in_every_command():
    for s in SETTINGS:
        assert s.field in OPTIONS, f"{s.field} is no GenerateOptions field"
        assert NAMES[s.name] == s.field, f"/set {s.name} must set {s.field}"
        assert s.name in chat_repl.SET_NAMES
        assert s.name in chat_repl.COMMANDS["/set"][1], f"/help does not list {s.name}"
        for command in COMMANDS:
            if command == "bench" and (s.field == "verify_width" or not s.bench):
                continue  # the bench compares several: --verify-widths; no penalties
            flags = flags_of(command)
            assert flags.get(s.flag) == s.help, (command, s.flag)
            if s.off is not None:  # a switch: its False flag is the same option's
                assert flags.get(s.off) == s.help, (command, s.off)


@pytest.mark.parametrize("command", COMMANDS)
def test_the_help_of_the_real_command_lists_them(command):
    out, err = text(dflash(command, "--help"))
    for s in SETTINGS:
        if command == "bench" and (s.field == "verify_width" or not s.bench):
            continue
        for flag in [s.flag, *([s.off] if s.off else [])]:
            assert re.search(rf"{re.escape(flag)}\b(?!-)", out), (command, flag, out)
    assert "--default-max-tokens" not in out  # the deprecated name works, unlisted


@pytest.fixture(scope="module")
def pair(models_dir) -> list[str]:
    return ["-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft")]


@pytest.fixture(scope="module")
def greedy(target, draft):
    model, tokenizer = target
    messages = [{"role": "user", "content": PROMPT}]
    return dflash_mlx.generate(model, draft, tokenizer, messages, max_tokens=24)


def chat_json(pair: list[str], *args: str) -> dict:
    done = dflash("chat", *pair, "--json", "-n", "24", *args, input=PROMPT)
    out, err = text(done)
    assert done.returncode == 0, err
    return json.loads(out)


def test_chat_takes_top_k_min_p_and_json(pair, greedy):
    """At temperature 5 a sampled reply is no greedy one; --top-k 1 (or --min-p 1) leaves
    the top token alone, so the reply is the greedy one: the flags reach the engine."""
    hot = ["--temp", "5", "--seed", "3"]
    assert chat_json(pair, *hot)["tokens"] != greedy.tokens
    assert chat_json(pair, *hot, "--top-k", "1")["tokens"] == greedy.tokens
    assert chat_json(pair, *hot, "--min-p", "1")["tokens"] == greedy.tokens


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_chat_json_needs_piped_stdin(pair):
    pexpect = pytest.importorskip("pexpect")
    from .test_cli_serve import exe

    out = pexpect.run(f"{exe()[0]} chat {' '.join(pair)} --json", timeout=60, withexitstatus=True)
    said, status = out[0].decode(), out[1]
    assert status == 2 and "error: --json prints one answer as JSON" in said, said


def test_serve_sampling_defaults_apply_to_requests_that_do_not_say(pair, greedy):
    """serve --temp 0 --max-tokens 24: a request without temperature or max_tokens is the
    greedy reply of 24 tokens (the APIs' default would sample at temperature 1)."""
    body = {"messages": [{"role": "user", "content": PROMPT}]}
    with serve(*pair, "--temp", "0", "--max-tokens", "24") as server:
        got = server.post("/v1/chat/completions", body)
    assert got["usage"]["completion_tokens"] == 24
    assert got["choices"][0]["message"]["content"] == greedy.text


def test_serve_default_max_tokens_is_a_deprecated_name_of_max_tokens(pair):
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0}
    with serve(*pair, "--default-max-tokens", "3") as server:
        got = server.post("/v1/chat/completions", body)
    assert got["usage"]["completion_tokens"] == 3
    log = "".join(server.log)
    assert "--default-max-tokens is deprecated; use --max-tokens" in log
    done = dflash("serve", *pair, "--default-max-tokens", "3", "--max-tokens", "4")
    assert done.returncode == 2 and "disagree" in text(done)[1]


def chat_terminal(tmp_path, *args: str, timeout: float = 120, columns: int = 160):
    """`dflash-mlx chat ARGS` in a pseudo-terminal of its own width (no COLUMNS another
    test may have left), its history under `tmp_path`, Ctrl-C as a user's terminal sends it."""
    pexpect = pytest.importorskip("pexpect")
    from .test_cli_serve import exe

    env = {
        **{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
        "DFLASH_MLX_HISTORY": str(tmp_path / "history"),
        "PROMPT_TOOLKIT_NO_CPR": "1",
        "TERM": "xterm-256color",
    }
    return pexpect.spawn(
        exe()[0],
        ["chat", *args],
        env=env,
        encoding="utf-8",
        timeout=timeout,
        dimensions=(30, columns),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def type_lines(child, steps: list[tuple[str, str]]) -> None:
    """Type each line at a prompt that reads it and expect what it shows; then /exit, and
    the chat ends."""
    import pexpect

    try:
        for line, shown in steps:
            child.expect("›")  # each line typed at a prompt that reads it
            child.send(line + "\r")
            child.expect(shown)
        child.expect("›")
        child.send("/exit\r")
        child.expect(pexpect.EOF)
    finally:
        child.close()


@pytest.mark.slow  # the real command in a pseudo-terminal
@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_set_shows_and_confirms_every_setting_in_a_terminal(tmp_path, pair):
    pytest.importorskip("pexpect")

    # A fixed width: no calibration before the prompt (slow on a busy machine).
    child = chat_terminal(tmp_path, *pair, "--max-tokens", "4", "--verify-width", "4")
    type_lines(
        child,
        [
            ("/set draft_window 64", "draft_window set to 64"),
            ("/set seed 7", "seed set to 7"),
            ("/set", r"seed 7 ·\s+draft_window 64"),
            ("/help", r"draft_window\s+\(or\s+auto\)"),
        ],
    )
    assert child.exitstatus == 0
