"""`dflash-mlx bench` as users run it (issue 25, item 7): a quick default (`--full` for every
prompt), plain progress lines when stderr is no terminal, verdicts that follow their
intervals, eff. above 100% marked and explained, one figure for one repeat. The real command
in a subprocess, on the tiny session models."""

from __future__ import annotations

import re
from types import SimpleNamespace

from typer.testing import CliRunner

from dflash_mlx.cli.main import app


def run(*args: str):
    return CliRunner().invoke(app, list(args))


VS = re.compile(r"  vs (\S+(?: \(no draft\))?) +([\d.]+)×  \[([\d.]+)–([\d.]+)\]  (.+?)  \(")


def bench_command(models_dir, *args: str):
    """`dflash-mlx bench` on the tiny pair, for real, stderr on a pipe: (code, out, err)."""
    from .test_cli_serve import dflash, text

    pair = ["-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft")]
    done = dflash("bench", *pair, "--max-tokens", "4", *args)
    return (done.returncode, *text(done))


def test_the_default_is_a_quick_look_with_progress_lines_on_a_pipe(models_dir):
    """Two prompts per suite unless --full; on a pipe, plain progress lines (a bar shows
    nothing there); one repeat shows one figure: no median of 1, no min–max."""
    code, out, err = bench_command(models_dir, "--suite", "math", "--repeats", "1")
    assert code == 0, err
    assert "2 prompts (math 2)" in out and "--full: all 12" in out
    progress = [line for line in err.splitlines() if line.startswith("bench: ")]
    assert progress[0].startswith("bench: 1/6 runs · warm-up") and progress[-1].startswith(
        "bench: 6/6 runs · math #"
    ), err
    assert "one run each after a warm-up" in out
    assert "median of 1" not in out and "min–max" not in out
    code, out, err = bench_command(models_dir, "--suite", "math", "--repeats", "1", "--full")
    assert code == 0, err
    assert "12 prompts (math 12)" in out and "--full" not in out


def test_each_verdict_follows_its_interval(models_dir):
    code, out, err = bench_command(models_dir, "--suite", "code", "--verify-widths", "1,2,auto")
    assert code == 0, err
    rows = VS.findall(out)
    assert {r[0] for r in rows} == {"mlx-lm", "W=1 (no draft)", "W=2"}, out
    for _, _, low, high, said in rows:
        low, high = float(low), float(high)
        assert said == ("faster" if low > 1 else "slower" if high < 1 else "within the noise")


def test_the_summary_says_what_the_intervals_say():
    """The issue's case: 1.39× [1.27–1.51] against mlx-lm is faster, not 'as fast'."""
    from dflash_mlx.bench.results import Comparison
    from dflash_mlx.cli import bench_ui

    def said(*comparisons):
        result = SimpleNamespace(comparisons=list(comparisons))
        return bench_ui._auto_comparison(result).plain.splitlines()[-1].strip()

    faster = Comparison("auto", "mlx-lm", 1.39, 1.27, 1.51, 18)
    assert said(faster).startswith("W=auto is faster than mlx-lm")
    noise = Comparison("auto", "W=16", 1.02, 0.95, 1.09, 18)
    assert said(noise, faster).startswith("W=auto is as fast as W=16 within the noise, faster")
    slower = Comparison("auto", "W=4", 0.8, 0.7, 0.9, 18)
    assert said(slower, noise, faster).startswith("W=auto is slower than W=4")


def test_efficiency_above_100_percent_is_marked_and_explained(models_dir, prompt_file, monkeypatch):
    """eff. is a measured speedup over what the calibrated costs predict: above 100% means
    the costs and the run disagree, which the report says instead of showing 117% bare."""
    from dflash_mlx.bench import benchmark

    monkeypatch.setattr(
        benchmark, "_cost_ratios", lambda pair, runs, depth: {"W=2": 0.1, "W=1": 1.0}
    )
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    args = ["--prompts", str(prompt_file), "--max-tokens", "4", "--repeats", "1"]
    result = run("bench", *pair, *args, "--verify-widths", "1,2")
    assert result.exit_code == 0, result.output
    assert re.search(r"\d+%\*", result.stdout), result.stdout
    assert "* eff. above 100%: this run beat what the calibrated pass costs predict" in (
        " ".join(result.stdout.split())
    )


def test_the_table_agrees_with_itself_and_names_its_units(models_dir):
    """× mlx-lm is the row's tok/s over the mlx-lm row's, as shown (not a ratio of other
    figures); prefill has its unit; the acceptance bars say they are conditional."""
    code, out, err = bench_command(
        models_dir, "--suite", "math", "--repeats", "2", "--verify-widths", "1,4,auto"
    )
    assert code == 0, err
    assert "× mlx-lm" in out and "prefill tok/s" in out
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\s*(mlx-lm|W=\S+(?: \(no draft\))?)\s+([\d.]+)\s+\S+–\S+\s+([\d.]+)×", line)
        if m:
            rows.setdefault(m.group(1), (float(m.group(2)), float(m.group(3))))
    base, one = rows.pop("mlx-lm")
    assert one == 1.0 and len(rows) == 3, out
    for run, (tps, ratio) in rows.items():
        shown = tps / base  # from figures rounded to 0.1 tok/s (or 1): allow for that
        assert abs(ratio - shown) <= 0.011 + shown * 0.01, (run, tps, base, ratio)
    assert "given positions 1..k-1 were accepted" in out


def test_a_verdict_is_decided_on_the_interval_as_printed():
    """`[1.00–1.20]` shown is never 'faster' (an unrounded 1.004 once made it so)."""
    from dflash_mlx.cli.bench_ui import verdict

    assert verdict(1.004, 1.2) == "within the noise"
    assert verdict(1.006, 1.2) == "faster"
    assert verdict(0.9, 0.996) == "within the noise"
    assert verdict(0.9, 0.994) == "slower"
