"""What a newcomer meets first, as the commands run: the one-time calibration said before
it runs (and how long it took), and arguments checked before any model loads."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from dflash_mlx import calibration as calibrate
from dflash_mlx.cli.main import app


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A cache folder with no calibration in it: the next automatic width measures."""
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))


def stderr_so_far() -> str:
    sys.stderr.flush()
    return sys.stderr.buffer.getvalue().decode()


@pytest.fixture
def watched(monkeypatch):
    """What stderr held when the calibration's measurement began, one entry per measure."""
    seen: list[str] = []
    real = calibrate.measure

    def measure(*args, **kwargs):
        seen.append(stderr_so_far())
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate, "measure", measure)
    return seen


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_calibration_is_said_before_it_runs_then_how_long_it_took(
    command, models_dir, fresh_cache, watched
):
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    args = [command, *pair, "-n", "4"] + (["--raw", "def f"] if command == "generate" else [])
    result = CliRunner().invoke(app, args, input="hello\n" if command == "chat" else None)
    assert result.exit_code == 0, result.output
    assert len(watched) == 1, "measured once"
    assert "calibrating the verify width for this device" in watched[0], watched[0]
    after = result.stderr[result.stderr.index("calibrating") :]
    assert "calibrated in " in after and " s;" in after
    again = CliRunner().invoke(app, args, input="hello\n" if command == "chat" else None)
    assert again.exit_code == 0 and len(watched) == 1, "cached: not measured again"
    assert "calibrat" not in again.stderr, "nor mentioned"


def test_a_fixed_width_never_calibrates(models_dir, fresh_cache, watched):
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    result = CliRunner().invoke(app, ["generate", *pair, "-n", "4", "--verify-width", "4", "x"])
    assert result.exit_code == 0 and watched == [] and "calibrat" not in result.stderr


def test_serve_says_it_calibrates_before_it_listens(models_dir, fresh_cache, watched, monkeypatch):
    import dflash_mlx.server
    from dflash_mlx.errors import BadArgument

    def create_server(engine, settings):
        raise BadArgument("stopped before serving")

    monkeypatch.setattr(dflash_mlx.server, "create_server", create_server)
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    result = CliRunner().invoke(app, ["serve", *pair, "--port", "0"])
    assert "stopped before serving" in result.stderr, result.output
    assert len(watched) == 1 and "calibrating the verify width" in watched[0]
    assert "calibrated in " in result.stderr


# -- every argument checked before a model loads ------------------------------------------


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a model fails the test: what is refused must be refused before."""
    import dflash_mlx

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for name in ("load", "load_draft"):
        monkeypatch.setattr(dflash_mlx, name, load)


@pytest.mark.parametrize(
    ("args", "stdin", "said"),
    [
        (["generate", "-m", "./nope", "hi"], None, "--model './nope': no such folder"),
        (["generate", "-m", "/no/such/dir", "-d", "org/d", "hi"], None, "no such folder"),
        (["generate", "-m", "org/x", "-d", "./nope", "hi"], None, "--draft './nope': no such"),
        (["generate", "-m", "org/x", "--no-draft", "--compare", "hi"], None, "needs a draft"),
        (["generate", "-m", "org/x", "--compare", "hi"], None, "needs a draft"),
        (["generate", "--demo", "--no-draft", "--compare", "hi"], None, "not with --no-draft"),
        (["generate", "--demo"], "", "stdin held nothing"),
        (["generate", "--demo"], "  \n", "stdin held nothing"),
        (["generate", "--demo", ""], None, "PROMPT is empty"),
        (["chat", "--demo"], "", "nothing on stdin"),
        (["chat", "-m", "./nope"], "hi", "--model './nope': no such folder"),
        (["serve", "-m", "./nope"], None, "--model './nope': no such folder"),
        (["bench", "-m", "./nope"], None, "--model './nope': no such folder"),
    ],
)
def test_bad_arguments_exit_2_before_any_model_loads(args, stdin, said, nothing_loads):
    result = CliRunner().invoke(app, args, input=stdin)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and said in lines[-1], lines
    assert "no known DFlash draft" not in result.stderr, "the error comes first"


# -- one name per meaning, one default across commands -----------------------------------


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_without_model_every_command_takes_chats_default_target(command, nothing_loads):
    from dflash_mlx.models.registry import DEFAULT_TARGET

    args = (
        [command]
        + (["hi"] if command == "generate" else [])
        + (["--port", "0"] if command == "serve" else [])
    )
    result = CliRunner().invoke(app, args)
    # Offline tests: the default is named, then the (patched) load is where it stops.
    assert f"model: {DEFAULT_TARGET}, the default" in " ".join(result.stderr.split())
    assert "--model is required" not in result.stderr


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_a_draft_without_its_target_is_refused(command, nothing_loads):
    result = CliRunner().invoke(
        app, [command, "-d", "org/draft", "hi"][: 4 - (command != "generate")]
    )
    assert result.exit_code == 2 and "--draft needs --model" in result.stderr, result.output


def test_cache_show_takes_serves_flag_name(tmp_path):
    folder = tmp_path / "store"
    for flag in ("--prompt-cache-dir", "--dir"):
        result = CliRunner().invoke(app, ["cache", "show", flag, str(folder)])
        assert result.exit_code == 0, result.output
        assert f"{folder}: no prompt cache yet" in result.stdout


def test_chat_replies_are_capped_at_1024_tokens_by_default():
    from dflash_mlx.chat.session import CHAT_DEFAULTS

    assert CHAT_DEFAULTS.max_tokens == 1024
    assert "[default: (1024;" in CliRunner().invoke(app, ["chat", "-h"]).stdout
