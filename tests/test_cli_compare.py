"""`generate --compare`: after the speculative run, plain decoding of the same prompt with
the same settings through the same engine, both speeds on one line, and at temperature 0
the check that the tokens are the same (issue 25, item 5). The real command in a
subprocess; one in-process run makes the plain tokens differ on purpose."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cli.main import app

from .test_cli_serve import dflash, text

PROMPT = "def add(a, b):"
LINE = re.compile(
    r"plain decoding: [\d.]+ tok/s · DFlash ([\d.]+× (faster|slower)|as fast \(1\.00×\))"
    r" · same 24 tokens"
)


@pytest.fixture(scope="module")
def pair(models_dir) -> list[str]:
    return ["-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft")]


def test_compare_prints_plain_speed_and_checks_the_tokens(pair, target, draft):
    done = dflash("generate", *pair, "--raw", "-n", "24", "--compare", PROMPT)
    out, err = text(done)
    assert done.returncode == 0, err
    assert LINE.fullmatch(err.strip().splitlines()[-1]), err
    model, tokenizer = target
    ref = dflash_mlx.generate(model, draft, tokenizer, PROMPT, max_tokens=24)
    assert out == ref.text + "\n", "stdout holds the completion once: the plain run is silent"


def test_compare_in_json_and_refusals(pair, models_dir):
    done = dflash("generate", *pair, "--raw", "-n", "24", "--compare", "--json", PROMPT)
    data = json.loads(text(done)[0])
    plain = data["plain"]
    assert plain["same_tokens"] is True and plain["generation_tokens"] == 24
    assert plain["speedup"] == pytest.approx(data["generation_tps"] / plain["generation_tps"])
    alone = ["-m", str(models_dir / "qwen3"), "--no-draft"]
    done = dflash("generate", *alone, "-n", "4", "--compare", PROMPT)
    assert done.returncode == 2 and "--compare measures DFlash against plain" in text(done)[1]


def test_sampled_runs_are_not_compared_token_by_token(pair):
    done = dflash("generate", *pair, "--raw", "-n", "8", "--temp", "1", "--compare", PROMPT)
    out, err = text(done)
    assert done.returncode == 0, err
    assert "sampled: tokens not compared" in err.strip().splitlines()[-1]


def test_a_difference_is_an_error_exit_1(pair, monkeypatch):
    """Plain decoding's tokens made to differ: an error line naming the first differing
    token, exit code 1 (what the check is for)."""
    real = dflash_mlx.generate

    def plain_differs(*args, **kwargs):
        result = real(*args, **kwargs)
        options = [a for a in args if isinstance(a, dflash_mlx.GenerateOptions)]
        if options and options[0].verify_width == 1:
            result.tokens[3] += 1
        return result

    monkeypatch.setattr(dflash_mlx, "generate", plain_differs)
    result = CliRunner().invoke(app, ["generate", *pair, "--raw", "-n", "8", "--compare", PROMPT])
    assert result.exit_code == 1, result.output
    assert "error: plain decoding: " in result.stderr and "differ from token 3" in result.stderr
