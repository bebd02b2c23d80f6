"""The forms mlx_lm and ollama users type: a positional prompt, the prompt from stdin, short
flags (-h, -v, -m, -d, -p, -n)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import bench, chat, options, serve
from dflash_mlx.cli import generate as generate_command
from dflash_mlx.cli.main import app
from dflash_mlx.errors import BadArgument

STOP = "stopped before decoding"


def run(*args: str, input: bytes | str | None = None):
    return CliRunner().invoke(app, list(args), input=input)


@pytest.fixture
def seen(monkeypatch) -> dict:
    """generate up to the prompt, without models: what it would load, its options and the
    prompt it would send; it then stops with a user error."""
    import dflash_mlx

    seen: dict = {}

    def load(model, choice):
        seen.update(model=model, draft=choice.draft)
        return SimpleNamespace(plan=lambda opts: None), None

    def prompt_form(tokenizer, prompt, chat, system=None):
        seen["prompt"] = prompt
        raise BadArgument(STOP)

    monkeypatch.setattr(generate_command, "load", load)
    monkeypatch.setattr(generate_command, "prompt_form", prompt_form)
    monkeypatch.setattr(
        dflash_mlx, "GenerateOptions", lambda **kw: SimpleNamespace(**seen.setdefault("opts", kw))
    )
    return seen


def stopped(result) -> None:
    assert result.exit_code == 2 and STOP in result.stderr, result.output


def test_prompt_positional_or_short_flag_with_short_model_draft_and_max_tokens(seen):
    stopped(run("generate", "-m", "org/M", "-d", "org/D", "-n", "7", "hello there"))
    assert seen == {
        "model": "org/M",
        "draft": "org/D",
        "opts": seen["opts"],
        "prompt": "hello there",
    }
    assert seen["opts"]["max_tokens"] == 7
    seen.clear()
    stopped(run("generate", "-m", "org/M", "-d", "org/D", "-p", "hi"))
    assert seen["prompt"] == "hi"


def test_prompt_from_stdin_with_dash_or_when_none_is_given(seen):
    stopped(run("generate", "-m", "org/M", "-d", "org/D", "--prompt", "-", input="from stdin\n"))
    assert seen["prompt"] == "from stdin\n"
    seen.clear()
    stopped(run("generate", "-m", "org/M", "-d", "org/D", input="piped\n"))
    assert seen["prompt"] == "piped\n"
    seen.clear()
    stopped(run("generate", "-m", "org/M", "-d", "org/D", "-", input="dash argument"))
    assert seen["prompt"] == "dash argument"


def test_stdin_is_utf8_and_bad_bytes_are_a_user_error(seen):
    stopped(run("generate", "-m", "org/M", "-d", "org/D", input="é ∑ 😀".encode()))
    assert seen["prompt"] == "é ∑ 😀"
    seen.clear()
    result = run("generate", "-m", "org/M", "-d", "org/D", "-p", "-", input=b"ok \xff no")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: stdin is not valid Unicode") and "0xff" in result.stderr
    assert "prompt" not in seen and "model" not in seen  # refused before anything loads


def test_prompt_twice_is_an_error_naming_both(seen):
    result = run("generate", "-m", "org/M", "-d", "org/D", "hi", "--prompt", "there")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and "PROMPT" in result.stderr
    assert "--prompt" in result.stderr and "model" not in seen


def test_no_prompt_and_a_terminal_says_how_to_give_one(seen, monkeypatch):
    monkeypatch.setattr(options, "stdin_is_terminal", lambda: True)
    result = run("generate", "-m", "org/M", "-d", "org/D")
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: no prompt")
    assert "--prompt" in line and "stdin" in line and "model" not in seen


@pytest.mark.parametrize(
    "command",
    [[], ["generate"], ["chat"], ["serve"], ["bench"], ["train"], ["quantize"]]
    + [["quantize", "draft"], ["quantize", "target"]],
)
def test_short_help_everywhere(command):
    result = run(*command, "-h")
    assert result.exit_code == 0, result.output
    assert "Usage: dflash-mlx" in result.stdout and "-h, --help" not in result.stderr


def test_short_version():
    result = run("-v")
    assert result.exit_code == 0, result.output
    assert "dflash-mlx-engine" in result.stdout


@pytest.mark.parametrize("command", ["chat", "serve", "bench"])
def test_short_model_and_draft(monkeypatch, command):
    seen: dict = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return 0

    monkeypatch.setattr({"chat": chat, "serve": serve, "bench": bench}[command], "run", fake)
    result = run(command, "-m", "org/M", "-d", "org/D")
    assert result.exit_code == 0, result.output
    assert seen["model"] == "org/M" and seen["draft"] == "org/D"


# End to end: the real entry point, real pipes, the demo pair (in the package: no download).
DEMO = ["generate", "--demo", "--raw", "--max-tokens", "4", "--json"]
TEXT = "def fib(n):\n"


def command() -> list[str]:
    exe = shutil.which("dflash-mlx") or str(Path(sys.executable).with_name("dflash-mlx"))
    return [exe]


def piped(*args: str, stdin: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([*command(), *DEMO, *args], input=stdin, capture_output=True, timeout=300)


@pytest.mark.slow  # three end-to-end runs of the demo pair
def test_piped_stdin_dash_and_positional_give_the_same_completion():
    done = [
        piped(stdin=TEXT.encode()),
        piped("--prompt", "-", stdin=TEXT.encode()),
        piped(TEXT, stdin=b"ignored: a prompt was given"),
    ]
    for d in done:
        assert d.returncode == 0, d.stderr.decode()
    first, *rest = (json.loads(d.stdout) for d in done)
    assert first["prompt_tokens"] > 2  # the text, not "-" nor an empty prompt
    for other in rest:
        assert (other["text"], other["prompt_tokens"]) == (first["text"], first["prompt_tokens"])


@pytest.mark.slow  # one end-to-end run: refused before the models load
def test_piped_bad_bytes_exit_2_with_one_error_line():
    done = piped("-p", "-", stdin=b"def f(\xff):\n")
    assert done.returncode == 2, done.stderr.decode()
    lines = done.stderr.decode().strip().splitlines()
    assert lines[-1].startswith("error: stdin is not valid Unicode") and done.stdout == b""
