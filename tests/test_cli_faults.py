"""Issue 26, items 3, 6 and 9: what the user got wrong is refused with exit 2 naming it,
through the real commands, never reported as a bug of ours (exit 1) and never a server that
starts but cannot serve."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading

import pytest
from typer.testing import CliRunner

from dflash_mlx import GenerateOptions, LoadError, load, load_draft
from dflash_mlx.cli.main import app
from dflash_mlx.errors import BadArgument

from .conftest import build_draft, draft_config

SERVE_BOUND_S = 180  # a serve that does not exit by then is killed (it would never exit)


def run(*args: str, input: str | bytes | None = None):
    return CliRunner().invoke(app, list(args), input=input)


def one_line(text: str) -> str:
    """The error as one line (rich wraps long ones at the console's width)."""
    return " ".join(text.split())


def user_error(result, *names: str) -> str:
    """Assert `result` is a user error (exit 2, one `error:` line, no traceback) naming
    every one of `names`; the message, on one line."""
    assert result.exit_code == 2, result.output
    message = one_line(result.stderr)
    assert message.startswith("error: ") and "internal" not in message, message
    assert "Traceback" not in result.output
    for name in names:
        assert name in message, (name, message)
    return message


@pytest.fixture(autouse=True)
def serve_never_listens(monkeypatch):
    """A `serve` run in-process that got as far as listening would never return: it fails
    instead (exit 1, internal), which no test here accepts."""
    from dflash_mlx.cli import serve_ui

    def serving(*args, **kwargs):
        raise RuntimeError("serve was about to listen")

    monkeypatch.setattr(serve_ui, "serving", serving)


@pytest.fixture(scope="module")
def misfit(models_dir, tmp_path_factory) -> str:
    """A draft built for another target (hidden size 32; the session target's is 64)."""
    cfg = draft_config(4, [1, 2])
    cfg.update(hidden_size=32, head_dim=8)
    return str(build_draft(tmp_path_factory.mktemp("misfit") / "draft", cfg, seed=0))


# Item 3: a draft that does not fit the target.

MISFIT = "error: draft does not fit target 'qwen3': hidden size: draft 32, target 64"


def test_serve_refuses_a_draft_for_another_target_with_exit_2_before_listening(models_dir, misfit):
    """A real `dflash-mlx serve` process: it must exit 2 with generate's message and never
    say "serving" (before the fix it listened, answered 503 and blamed every client)."""
    command = "from dflash_mlx.cli.main import app; app()"
    args = ["serve", "--model", str(models_dir / "qwen3"), "--draft", misfit, "--port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-c", command, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    watchdog = threading.Timer(SERVE_BOUND_S, proc.kill)  # a bound, not a verdict
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line or "Uvicorn running" in line:
                proc.kill()
                pytest.fail("serve started with a draft that does not fit:\n" + "".join(lines))
        code = proc.wait()
    finally:
        watchdog.cancel()
        proc.kill()
        proc.stdout.close()
    assert code == 2, "".join(lines)
    assert one_line("".join(lines)) == MISFIT


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_every_command_refuses_a_draft_for_another_target_with_the_same_message(
    models_dir, misfit, command
):
    pair = ["--model", str(models_dir / "qwen3"), "--draft", misfit]
    extra = {"generate": ["--prompt", "hi"], "chat": [], "bench": ["--repeats", "1"]}[command]
    result = run(command, *pair, *extra, input="hi\n")
    assert user_error(result) == MISFIT


# Item 6: a damaged weights file, a prompt that is not text.


def damage(path, how: str) -> None:
    """Truncate a safetensors file: inside its tensors, inside its header, or to nothing."""
    size = path.stat().st_size
    keep = {"data": size - size // 3, "header": 20, "empty": 0}[how]
    with open(path, "r+b") as f:
        f.truncate(keep)


def damaged_copy(models_dir, tmp_path, name: str, how: str = "data"):
    folder = tmp_path / name
    shutil.copytree(models_dir / name, folder)
    damage(folder / "model.safetensors", how)
    return folder


@pytest.mark.parametrize("how", ["data", "header", "empty"])
def test_load_names_a_damaged_safetensors_file(models_dir, tmp_path, how):
    target = damaged_copy(models_dir, tmp_path, "qwen3", how)
    with pytest.raises(LoadError, match="damaged or incomplete safetensors") as e:
        load(target)
    assert str(target / "model.safetensors") in str(e.value)
    draft = damaged_copy(models_dir, tmp_path, "draft", how)
    with pytest.raises(LoadError, match="damaged or incomplete safetensors") as e:
        load_draft(draft)
    assert str(draft / "model.safetensors") in str(e.value)


@pytest.mark.parametrize("command", ["generate", "serve", "chat", "bench"])
@pytest.mark.parametrize("which", ["qwen3", "draft"])
def test_a_truncated_weights_file_is_the_users_exit_2_naming_it(
    models_dir, tmp_path, command, which
):
    """Before: the target's exited 1 "internal error … a bug in dflash-mlx"."""
    folders = {"qwen3": models_dir / "qwen3", "draft": models_dir / "draft"}
    folders[which] = damaged_copy(models_dir, tmp_path, which)
    pair = ["--model", str(folders["qwen3"]), "--draft", str(folders["draft"])]
    extra = {"generate": ["--prompt", "hi"], "serve": ["--port", "0"], "chat": [], "bench": []}
    result = run(command, *pair, *extra[command], input="hi\n")
    user_error(result, str(folders[which] / "model.safetensors"), "damaged or incomplete")


# What Python makes of bytes that are not UTF-8 (surrogateescape), and a lone surrogate.
NOT_TEXT = [("ab\udcffc", "byte 0xff is not UTF-8"), ("ab\ud800c", "U+D800 is a lone surrogate")]


@pytest.mark.parametrize("prompt, what", NOT_TEXT)
def test_a_prompt_that_is_not_valid_unicode_is_refused_naming_the_position(
    models_dir, prompt, what
):
    """Before: exit 1, "internal error: TypeError: TextEncodeInput must be ..."."""
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    for form in ("--raw", "--chat"):
        result = run("generate", *pair, "--prompt", prompt, form)
        user_error(result, "--prompt", "not valid Unicode", "at character 2", what)


def test_chat_refuses_stdin_and_a_system_prompt_that_are_not_text(models_dir):
    """Piped bytes that are not UTF-8 (a UnicodeDecodeError under a strict locale, as on
    macOS: exit 1 before) and a --system that is not text (a tokenizer error before)."""
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    result = run("chat", *pair, "--max-tokens", "2", input=b"hi \xff there\n")
    user_error(result, "stdin", "at character 3", "byte 0xff is not UTF-8")
    result = run("chat", *pair, "--max-tokens", "2", "--system", "be \ud800", input="hi\n")
    user_error(result, "--system", "at character 3", "U+D800 is a lone surrogate")


@pytest.mark.parametrize("option", ["--host", "--api-key", "--cors-origin"])
def test_serve_refuses_text_options_that_are_not_unicode_before_loading(option):
    value = "http://a\udcff" if option == "--cors-origin" else "k\udcff"
    user_error(run("serve", "--demo", option, value), option, "not valid Unicode")


def test_serve_refuses_a_host_name_idna_cannot_encode():
    """Before: exit 1, "internal error: UnicodeError: encoding with 'idna' codec failed"."""
    user_error(run("serve", "--demo", "--host", "a" * 70, "--port", "0"), "cannot listen on")


# Item 9: numbers that are not finite.

FLOAT_OPTIONS = [
    ("generate", "--temp"),
    ("generate", "--top-p"),
    ("generate", "--min-p"),
    ("chat", "--temp"),
    ("chat", "--top-p"),
    ("serve", "--max-body-mb"),
    ("bench", "--temp"),
    ("train", "--lr"),
    ("train", "--warmup"),
    ("train", "--loss-gamma"),
]


@pytest.mark.parametrize("command, option", FLOAT_OPTIONS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_a_float_option_that_is_not_finite_is_refused_naming_it(command, option, value):
    """Before: `--temp inf` ran (and `--max-body-mb inf` lifted the body limit)."""
    required = {
        "generate": ["--demo", "--prompt", "hi"],
        "train": ["--target", "t", "--data", "d", "--out", "o"],
    }
    result = run(command, *required.get(command, ["--demo"]), option, value, input="hi\n")
    assert result.exit_code == 2, result.output
    message = one_line(result.stderr.replace("│", " "))
    assert f"Invalid value for '{option}': {value} is not a finite number" in message


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_generate_options_refuse_a_temperature_that_is_not_finite(value):
    with pytest.raises(BadArgument, match=r"^temperature (inf|nan) must be .*\[0, inf\)"):
        GenerateOptions(temperature=value)
    with pytest.raises(BadArgument, match=r"^temperature"):
        GenerateOptions().replace(temperature=value)  # chat's /set temp inf
    assert GenerateOptions(temperature=1e300).temperature == 1e300


def test_the_library_refuses_text_that_is_not_unicode_naming_it(target):
    """The rule the CLI applies lives in the library: a direct caller gets a BadArgument
    naming the position, not a tokenizer's TypeError."""
    from dflash_mlx import Pair, generate

    model, tok = target
    with pytest.raises(BadArgument, match=r"the prompt is not valid Unicode: at character 1"):
        generate(Pair(model), tok, "a\ud800b", max_tokens=2)
    messages = [{"role": "user", "content": "hi \udcff"}]
    with pytest.raises(BadArgument, match=r"message 0's content .* byte 0xff is not UTF-8"):
        generate(Pair(model), tok, messages, max_tokens=2)


def test_bench_refuses_a_prompts_file_that_is_not_text(models_dir, tmp_path):
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9"}\n')
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"prompt": "a\\ud800"}\n')
    for path, named in ((latin, "not UTF-8 text (byte 0xe9"), (surrogate, "lone surrogate")):
        result = run("bench", *pair, "--prompts", str(path), "--repeats", "1")
        assert named in user_error(result), result.output
