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
VERDICT = (
    r"(DFlash [\d.]+× faster \(95% [\d.]+–[\d.]+×\)"
    r"|DFlash [\d.]+× slower \(DFlash [\d.]+×, 95% [\d.]+–[\d.]+×\)"
    r"|(same speed within noise|both decoded plainly: no verdict"
    r"|barely speculated \(τ [\d.]+\): no verdict)"
    r" \(DFlash [\d.]+×, 95% [\d.]+–[\d.]+×\))"
)
LINE = re.compile(rf"plain decoding: [\d.]+ tok/s · {VERDICT} · same 24 tokens")


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
    assert plain["verdict"] in VERDICTS
    low, high = plain["interval"]
    assert low <= plain["speedup"] <= high, "the figure is the one its interval is of"
    assert plain["verdict"] != "faster" or low > 1
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
    import sys

    module = sys.modules["dflash_mlx.engine.generate"]
    real = module.collect

    def plain_differs(responses):  # streamed output: only the plain run is collected
        result = real(responses)
        result.tokens[3] += 1
        return result

    monkeypatch.setattr(module, "collect", plain_differs)
    result = CliRunner().invoke(app, ["generate", *pair, "--raw", "-n", "8", "--compare", PROMPT])
    assert result.exit_code == 1, result.output
    assert "error: plain decoding: " in result.stderr and "differ from token 3" in result.stderr


# -- the verdict, from injected clocks (never from this machine's wall time) --------------

VERDICTS = {"faster", "slower", "same speed within noise", "both decoded plainly",
            "barely speculated", "unmeasured"}  # fmt: skip


def clock(per_token: list[float], step: int = 4) -> list[tuple[int, float]]:
    """`(tokens so far, time)` marks of a run whose token i took `per_token[i]` seconds,
    one response every `step` tokens (the first token alone, as the engine's first)."""
    marks, t, n = [(1, 0.0)], 0.0, 1
    for i in range(1, len(per_token), step):
        t += sum(per_token[i : i + step])
        n = min(i + step, len(per_token))
        marks.append((n, t))
    return marks


def jitter(n: int, seed: int, base: float = 0.01, spread: float = 0.3) -> list[float]:
    import random

    rng = random.Random(seed)
    return [base * (1 + spread * (rng.random() - 0.5)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_the_same_speed_is_never_called_faster_or_slower(seed):
    from dflash_mlx.cli.compare import paired_speedup, verdict

    a, b = clock(jitter(256, seed)), clock(jitter(256, 1000 + seed))
    interval = paired_speedup(a, b)
    assert verdict(interval, plain_fraction=0.5, tau=3.0) == "same speed within noise"


def test_a_real_difference_gets_its_verdict_and_plain_runs_say_so():
    from dflash_mlx.cli.compare import paired_speedup, verdict

    slow, fast = clock(jitter(256, 1)), clock(jitter(256, 2, base=0.005))
    up = paired_speedup(fast, slow)
    assert 1.8 < up[0] < 2.2 and verdict(up, 0.1, tau=3.0) == "faster"
    down = paired_speedup(slow, fast)
    assert verdict(down, 0.1, tau=3.0) == "slower"
    assert verdict(up, plain_fraction=0.99, tau=3.0) == "both decoded plainly"
    assert paired_speedup(clock(jitter(8, 1)), clock(jitter(8, 2))) is None, "too short"
    assert verdict(None, 0.1, tau=3.0) == "unmeasured"


def test_a_run_that_barely_speculated_is_never_called_faster():
    """τ 1.06 (issue 62: `1.69× faster` at τ 1.06): speculation gains at most τ, so a
    faster interval from such a run is the machine's noise, not DFlash; a low end above τ
    the same. Slower stays slower (the cost of trying is real)."""
    from dflash_mlx.cli.compare import paired_speedup, verdict

    slow, fast = clock(jitter(256, 1)), clock(jitter(256, 2, base=0.005))
    up, down = paired_speedup(fast, slow), paired_speedup(slow, fast)
    assert verdict(up, 0.5, tau=1.06) == "barely speculated"
    assert verdict(up, 0.1, tau=1.5) == "barely speculated", "a 2x gain from τ 1.5"
    assert verdict(down, 0.5, tau=1.06) == "slower"


def test_the_figure_lies_inside_its_interval_whatever_the_tok_s_say(monkeypatch):
    """Issue 62: `DFlash 9.27× faster (9.27×, 95% 1.25–9.02×)`: the figure was the ratio of
    the two tok/s, the interval the paired segments'. Now both are the paired statistic."""
    from types import SimpleNamespace

    from dflash_mlx.cli import generate as gen

    slow, fast = clock(jitter(256, 1)), clock(jitter(256, 2, base=0.005))

    def plain_run(*args, **kwargs):  # plain decoding, its marks from the slow clock
        yield from ()

    def collect(responses, tokens, marks):
        marks.extend(slow)
        return responses

    stats = SimpleNamespace(generation_tps=927.0, plain_fraction=0.1, tau=3.0)
    plain = SimpleNamespace(tokens=[1] * 256, stats=SimpleNamespace(
        generation_tps=100.0, generation_tokens=256))  # fmt: skip
    monkeypatch.setattr(gen, "collecting", collect)
    monkeypatch.setattr("dflash_mlx.stream_generate", plain_run)
    monkeypatch.setattr("dflash_mlx.engine.generate.collect", lambda responses: plain)
    opts = SimpleNamespace(temperature=0.0, replace=lambda **kw: None)
    out = gen.compared(None, None, None, opts, ([1] * 256, stats), fast)
    low, high = out["interval"]
    assert low <= out["speedup"] <= high and 1.8 < out["speedup"] < 2.2, out
    assert out["verdict"] == "faster"


def test_the_comparison_line_never_states_a_verdict_the_interval_does_not_hold(capsys):
    from dflash_mlx.cli import ui

    base = {"generation_tps": 100.0, "same_tokens": True, "first_difference": None}
    for verdict_, x, interval, said in [
        ("same speed within noise", 1.18, [0.9, 1.5], "same speed within noise (DFlash 1.18×"),
        ("both decoded plainly", 1.36, [1.1, 1.5], "both decoded plainly: no verdict (DFlash"),
        ("barely speculated", 1.69, [1.2, 2.1], "barely speculated (τ 1.06): no verdict"),
        ("faster", 1.5, [1.2, 1.8], "DFlash 1.50× faster (95% 1.20–1.80×)"),
        ("slower", 0.5, [0.4, 0.6], "DFlash 2.00× slower (DFlash 0.50×, 95% 0.40–0.60×)"),
        ("unmeasured", 1.3, None, "not paired: no verdict (DFlash 1.30× by tok/s, unpaired)"),
    ]:
        ui.comparison({**base, "speedup": x, "interval": interval, "verdict": verdict_}, 256, 1.06)
        line = capsys.readouterr().err.strip()
        assert said in line and line.endswith("same 256 tokens"), line
        if verdict_ not in ("faster", "slower"):
            assert "faster" not in line and "slower" not in line, line
        if verdict_ != "both decoded plainly":
            assert "same speed" not in line or verdict_ == "same speed within noise", line
