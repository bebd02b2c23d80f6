"""What a newcomer meets first, as the commands run: the one-time calibration said before
it runs (and how long it took), and arguments checked before any model loads."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli.main import app
from dflash_mlx.speed import calibrate


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
