"""`dflash-mlx bench --concurrency` (issue 21): serial against batched decoding of the same N
prompts. The real command through typer's runner, on the tiny session models: a row per N
and mode with its figures, the JSON, a batched request that differs from its serial run
reported loudly with exit code 1, plain pairs and fixed widths, and bad values refused
naming them. Nothing here decides from wall time."""

from __future__ import annotations

import json
import re

import pytest

from .test_cli_bench import run

ROW = re.compile(r"^ *(\d+) +(serial|batched|late) +([\d.]+) ", re.M)
ROW_KEYS = {
    "run",
    "concurrency",
    "mode",
    "max_batch",
    "aggregate_tps",
    "per_request_tps",
    "ttft_mean",
    "ttft_max",
    "tau",
    "tokens",
    "batches",
    "vs_serial",
    "mean_batch",
    "late_ttft",
}


def bench(models_dir, prompt_file, *args: str, draft: bool = True):
    pair = ["-m", str(models_dir / "qwen3")]
    pair += ["-d", str(models_dir / "draft")] if draft else []
    common = ["--prompts", str(prompt_file), "--max-tokens", "5", "--repeats", "1"]
    return run("bench", *pair, *common, *args)


def test_a_row_per_concurrency_and_mode_with_its_figures_and_the_json(
    models_dir, prompt_file, tmp_path
):
    out = tmp_path / "c.json"
    result = bench(
        models_dir, prompt_file, "--concurrency", "1,3", "--verify-widths", "2,auto",
        "--late-arrival", "--json", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text = result.stdout
    for shown in ["W=2: serial vs batched", "W=auto: serial vs batched", "per req"]:
        assert shown in text, f"report lacks {shown!r}"
    for shown in ["TTFT mean", "TTFT max", "late TTFT", "τ", "batch", "vs serial", "✓ identical"]:
        assert shown in text, f"report lacks {shown!r}"
    rows = [(int(n), mode) for n, mode, _ in ROW.findall(text)]
    # One table per width, a row per N and mode; a late arrival where N > 1.
    pairs = [(1, "serial"), (1, "batched"), (3, "serial"), (3, "batched"), (3, "late")]
    assert rows == pairs * 2, text
    assert "all 14 batched requests reproduced their serial tokens" in text

    data = json.loads(out.read_text())
    assert data["lossless"] is True and data["mismatches"] == []
    assert data["settings"]["concurrency"] == [1, 3]
    assert data["settings"]["verify_widths"] == [2, "auto"]
    # 3 requests from 2 prompts: from the start again.
    assert [p["index"] for p in data["prompts"]] == [0, 1, 0]
    assert [(r["run"], r["concurrency"], r["mode"]) for r in data["rows"]] == [
        (w, n, m) for w in ("W=2", "auto") for n, m in pairs
    ]
    for row in data["rows"]:
        assert set(row) == ROW_KEYS
        assert row["tokens"] == 5 * row["concurrency"]  # one repeat, 5 tokens a request
        batched = row["mode"] != "serial"
        assert (row["vs_serial"] is not None) == (row["mode"] == "batched")
        assert (row["late_ttft"] is not None) == (row["mode"] == "late")
        assert (row["max_batch"] == row["concurrency"]) if batched else row["max_batch"] is None
        if batched:
            assert max(int(b) for b in row["batches"]) <= row["concurrency"]
        else:
            assert row["batches"] == {} and row["mean_batch"] is None
        assert row["ttft_max"]["median"] >= row["ttft_mean"]["median"] > 0
    assert len(data["runs"]) == 10
    for r in data["runs"]:
        assert len(r["requests"]) == r["concurrency"]
        assert (r["arrived"] is not None) == (r["mode"] == "late")
        assert {q["tokens"] for q in r["requests"]} == {5}
        for q in r["requests"]:
            assert 0 < q["ttft"] <= q["seconds"]
    # The batched rows of 3 ran in a batch of 3 at some cycle; the late one joined two.
    assert "3" in data["rows"][3]["batches"]
    late = data["runs"][4]
    assert late["mode"] == "late" and late["arrived"] > 0
    assert data["rows"][4]["late_ttft"]["median"] == late["requests"][-1]["ttft"]


def test_a_batched_request_that_differs_from_its_serial_run_fails_loudly(
    models_dir, prompt_file, monkeypatch
):
    from dflash_mlx.engine import batch

    real = batch.BatchDecoder.step

    def corrupted(self):
        out = real(self)
        for row, item in out:
            if row.handle == 1 and not isinstance(item, BaseException) and item.width:
                item.tokens = [(t + 1) % 7 for t in item.tokens]
        return out

    monkeypatch.setattr(batch.BatchDecoder, "step", corrupted)
    result = bench(models_dir, prompt_file, "--concurrency", "2", "--verify-widths", "2")
    assert result.exit_code == 1, result.output
    said = " ".join(result.stdout.replace("│", " ").split())  # the panel's lines joined
    assert "BATCHED ≠ SERIAL" in said
    assert "1 of 2 batched requests differ from the same request decoded alone" in said
    where = "W=2 · N=2 · request 2 (few #2) · repeat 1 · first difference at generated token 1"
    assert where in said
    assert "prompt: Name three colors." in said


def test_plain_pairs_and_a_smaller_max_batch(models_dir, prompt_file, tmp_path):
    """No draft: the target decodes plainly in both modes; --max-batch 1 lets one row in at
    a time, so the batched run never verifies two rows in one pass."""
    out = tmp_path / "c.json"
    result = bench(
        models_dir, prompt_file, "--concurrency", "2", "--max-batch", "1", "--json", str(out),
        draft=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "draft  none: the target decodes plainly" in result.stdout
    assert "at most 1 rows at once" in " ".join(result.stdout.split())
    data = json.loads(out.read_text())
    assert data["lossless"] is True
    batched = [r for r in data["rows"] if r["mode"] == "batched"]
    assert [(r["max_batch"], list(r["batches"])) for r in batched] == [(1, ["1"])]
    assert {r["tau"] for r in data["rows"]} == {1.0}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--concurrency", "0"], "--concurrency '0': '0' is not a number of requests"),
        (["--concurrency", "x"], "--concurrency 'x': 'x' is not a number of requests"),
        (["--concurrency", "1,,2"], "--concurrency '1,,2': '' is not a number of requests"),
        (["--concurrency", "2", "--max-batch", "0"], "--max-batch 0: use an integer >= 1"),
        (["--max-batch", "2"], "--max-batch needs --concurrency"),
        (["--late-arrival"], "--late-arrival needs --concurrency"),
        (["--concurrency", "2", "--trees", "8"], "--trees does not go with --concurrency"),
        (["--concurrency", "2", "--context", "64"], "--context does not go with --concurrency"),
    ],
)
def test_bad_values_are_refused_naming_them(args, message):
    result = run("bench", "--demo", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.output


def test_help_lists_the_options():
    result = run("bench", "--help")
    assert result.exit_code == 0
    said = " ".join(result.output.split())
    assert "--concurrency" in said and "--max-batch" in said and "--late-arrival" in said


def test_the_suites_are_taken_in_turn_and_reused_when_too_few():
    from dflash_mlx.bench.concurrency import in_turn
    from dflash_mlx.bench.prompts import BenchPrompt

    prompts = [BenchPrompt(s, i, text=f"{s}{i}") for s in ("math", "code") for i in range(3)]
    assert [p.text for p in in_turn(prompts, 5)] == ["math0", "code0", "math1", "code1", "math2"]
    assert [p.text for p in in_turn(prompts[:2], 3)] == ["math0", "math1", "math0"]
