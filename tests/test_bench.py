"""`dflash-mlx bench`: side-by-side measurement, losslessness check, prompt files, the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.bench.benchmark import BASELINE, at_context, quantization, run_benchmark
from dflash_mlx.bench.prompts import SUITES, BenchPrompt, load_suite, read_prompts
from dflash_mlx.cli.main import app
from dflash_mlx.engine.generate import encode_prompt

MAX_TOKENS = 8
PROMPTS = [
    BenchPrompt("math", 0, text="What is 12 times 7?"),
    BenchPrompt(
        "chat",
        0,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three colors."},
        ],
    ),
]
SUMMARY_KEYS = {
    "run",
    "width",
    "generation_tps",
    "speedup",
    "tau",
    "acceptance_rates",
    "prompt_tps",
    "time_to_first_token",
    "peak_memory",
    "generation_tokens",
    "cycles",
    "ideal_speedup",
    "efficiency",
    "plain_fraction",
    "probes",
    "tree",
    "tree_fraction",
    "tree_note",
}


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def bench(target, draft, prompts=PROMPTS, **kwargs):
    model, tokenizer = target
    kwargs = {"widths": [1, 4], "max_tokens": MAX_TOKENS, "repeats": 1, **kwargs}
    return run_benchmark(dflash_mlx.Pair(model, draft), tokenizer, prompts, **kwargs)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "few.jsonl"
    lines = [json.dumps(p.to_dict()) for p in PROMPTS]
    path.write_text(lines[0] + "\n\n" + lines[1] + "\n")  # a blank line is skipped
    return path


def test_bench_measures_both_ways_and_serialises_everything(target, draft, tmp_path):
    calls = []
    result = bench(target, draft, progress=lambda *a: calls.append(a), model_id="tiny")
    runs = [BASELINE, "W=1", "W=4"]
    assert calls[-1][:2] == (len(runs) * (1 + len(PROMPTS)),) * 2, "progress must reach 100%"
    assert result.lossless is True and result.mismatches == []
    assert len(result.records) == len(runs) * len(PROMPTS)

    out = tmp_path / "bench.json"
    result.write_json(out)
    data = json.loads(out.read_text())
    assert data["lossless"] is True
    env = data["environment"]
    for key in ["device", "platform", "machine", "mlx", "mlx_lm"]:
        assert env[key], f"environment lacks {key}"
    assert data["models"]["target"] == "tiny"
    assert data["models"]["target_quantization"] is None
    assert data["models"]["draft_block_size"] == draft.config.block_size
    assert data["settings"]["verify_widths"] == [1, 4]
    assert data["settings"]["temperature"] == 0
    assert [s["suite"] for s in data["suites"]] == ["math", "chat"]
    assert [p["prompt_tokens"] > 0 for p in data["prompts"]] == [True, True]
    for summary in data["suites"] + [data["overall"]]:
        assert [r["run"] for r in summary["runs"]] == runs
        for r in summary["runs"]:
            assert set(r) == SUMMARY_KEYS
            assert r["generation_tps"]["median"] > 0 and r["prompt_tps"]["median"] > 0
            assert r["time_to_first_token"]["median"] > 0
            assert r["tau"] >= 1.0
    base, w1, w4 = data["overall"]["runs"]
    assert base["speedup"]["median"] == 1.0
    assert w4["speedup"]["median"] == pytest.approx(
        w4["generation_tps"]["median"] / base["generation_tps"]["median"]
    )
    assert w1["acceptance_rates"] == [] and len(w4["acceptance_rates"]) == 3
    assert w4["cycles"] > 0
    # What ran: W=1 decodes plainly, W=4 speculates but where the token budget leaves only
    # one token (a plain step); the baseline is not this engine.
    assert (base["plain_fraction"], w1["plain_fraction"]) == (None, 1.0)
    assert 0.0 <= w4["plain_fraction"] < 0.2
    for rec in data["records"]:
        if rec["run"] == "W=4":
            assert set(rec["ran"]["widths"]) <= {"1", "2", "3", "4"}  # narrower only at the end
            assert sum(w["cycles"] for w in rec["ran"]["widths"].values()) == rec["cycles"]


def test_losslessness_check_flags_a_corrupted_dflash_token(target, draft, monkeypatch):
    model, tokenizer = target
    victim = encode_prompt(tokenizer, PROMPTS[1].messages)
    real = dflash_mlx.generate

    def corrupted(*args, **kwargs):
        result = real(*args, **kwargs)
        if args[2] == victim and args[3].verify_width == 4:
            tokens = list(result.tokens)
            tokens[3] = (tokens[3] + 1) % 7
            return dataclasses.replace(result, tokens=tokens)
        return result

    monkeypatch.setattr(dflash_mlx, "generate", corrupted)
    result = bench(target, draft, repeats=2)
    assert result.lossless is False
    assert len(result.mismatches) == 2, "one mismatch per repeat, W=4 on prompt 1 only"
    for rep, m in enumerate(result.mismatches):
        assert (m.suite, m.prompt_index, m.width, m.position, m.repeat) == ("chat", 0, 4, 3, rep)
        assert m.prompt == "Name three colors."
        assert m.got == (m.expected + 1) % 7
    assert result.to_dict()["mismatches"][0]["position"] == 3


def test_sampling_runs_report_no_losslessness_verdict(target, draft):
    result = bench(target, draft, prompts=PROMPTS[:1], widths=[2], temperature=0.8, seed=3)
    assert result.lossless is None and result.mismatches == []
    assert result.to_dict()["lossless"] is None


def test_bad_widths_are_refused_naming_the_width(target, draft):
    with pytest.raises(ValueError, match="verify width 17 exceeds the draft's block size 16"):
        bench(target, draft, widths=[17])
    with pytest.raises(ValueError, match="verify width 0"):
        bench(target, draft, widths=[0])


def test_quantization_is_read_from_the_target_layers(models_dir, target):
    q_model, _ = dflash_mlx.load(str(models_dir / "qwen3-4bit"))
    assert quantization(q_model) == {"bits": 4, "group_size": 32, "mode": "affine"}
    assert quantization(target[0]) is None


def test_prompt_file_accepts_prompt_and_messages_lines(prompt_file):
    prompts = read_prompts(prompt_file)
    assert [p.suite for p in prompts] == ["few", "few"]
    assert [p.index for p in prompts] == [0, 1]
    assert prompts[0].text == PROMPTS[0].text and prompts[0].messages is None
    assert prompts[1].messages == PROMPTS[1].messages and prompts[1].text is None


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', '"prompt" or "messages"'),
        ('{"text": "hi"}', '"prompt" or "messages"'),
        ('{"prompt": "hi", "messages": []}', '"prompt" or "messages"'),
        ('{"prompt": "  "}', "non-empty string"),
        ('{"messages": [{"role": "user"}]}', 'message 0 needs string "role" and "content"'),
    ],
)
def test_prompt_file_rejects_a_bad_line_naming_file_and_line(tmp_path, bad, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + bad + "\n")
    with pytest.raises(ValueError, match=reason) as info:
        read_prompts(path)
    assert str(info.value).startswith(f"{path}:3: "), str(info.value)


def test_builtin_suites_ship_real_prompts():
    for name in SUITES:
        prompts = load_suite(name)
        assert len(prompts) >= 10, f"suite {name} has only {len(prompts)} prompts"
        assert all(p.suite == name and len(p.summary) > 20 for p in prompts)
    assert len(load_suite("all")) == sum(len(load_suite(s)) for s in SUITES)
    with pytest.raises(ValueError, match="unknown suite 'poetry'"):
        load_suite("poetry")


def test_cli_bench_prints_tables_and_writes_json(models_dir, prompt_file, tmp_path):
    out = tmp_path / "out.json"
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    args = ["--prompts", str(prompt_file), "--max-tokens", "6", "--repeats", "1"]
    result = run("bench", *pair, *args, "--verify-widths", "1,3,auto", "--json", str(out))
    assert result.exit_code == 0, result.output
    for shown in ["mlx-lm", "W=1", "W=3", "× mlx-lm", "τ", "acceptance per block position"]:
        assert shown in result.stdout, f"report lacks {shown!r}"
    assert "W=auto against each fixed choice" in result.stdout
    assert "lossless" in result.stdout
    data = json.loads(out.read_text())
    assert data["lossless"] is True
    assert [r["run"] for r in data["overall"]["runs"]] == [BASELINE, "W=1", "W=3", "auto"]
    assert {c["other"] for c in data["comparisons"]} == {BASELINE, "W=1", "W=3"}
    assert data["models"]["target"] == str(models_dir / "qwen3")


def test_cli_shouts_losslessness_failure_and_exits_1(models_dir, prompt_file, monkeypatch):
    real = dflash_mlx.generate

    def off_by_one(*args, **kwargs):
        result = real(*args, **kwargs)
        return dataclasses.replace(result, tokens=[(result.tokens[0] + 1) % 7, *result.tokens[1:]])

    monkeypatch.setattr(dflash_mlx, "generate", off_by_one)
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    args = ["--prompts", str(prompt_file), "--max-tokens", "4", "--repeats", "1"]
    result = run("bench", *pair, *args, "--verify-widths", "2")
    assert result.exit_code == 1, result.output
    assert "LOSSLESSNESS FAILURE" in result.stdout
    assert "first difference at generated token 0" in result.stdout
    assert "What is 12 times 7?" in result.stdout


@pytest.mark.slow  # end to end: calibrates the trained demo pair, then benches it
def test_cli_demo_says_what_the_pair_is_and_runs(prompt_file, tmp_path, monkeypatch):
    from dflash_mlx.demo import NOTICE

    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
    args = ["--prompts", str(prompt_file), "--max-tokens", "4", "--repeats", "1"]
    result = run("bench", "--demo", *args, "--verify-widths", "2")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert NOTICE in said and "not a useful" in said
    assert "W=2" in result.stdout
    calibrated = run("bench", "--demo", "--calibrate")
    assert calibrated.exit_code == 0, calibrated.output
    assert "verify (ms)" in calibrated.stdout and "cached in" in calibrated.stderr
    assert list((tmp_path / "cache" / "calibration").glob("*.json"))


def test_verify_widths_auto_runs_the_engines_own_choice(target, draft):
    from dflash_mlx.bench.benchmark import run_benchmark
    from dflash_mlx.bench.prompts import BenchPrompt

    model, tok = target
    prompts = [BenchPrompt(suite="code", index=0, text="def add(a, b):", messages=None)]
    pair = dflash_mlx.Pair(model, draft)
    result = run_benchmark(pair, tok, prompts, widths=[2, "auto"], max_tokens=12, repeats=1)
    names = [r.run for r in result.overall.runs]
    assert names == ["mlx-lm", "W=2", "auto"]
    assert result.lossless is True
    data = json.loads(json.dumps(result.to_dict()))
    assert data["settings"]["verify_widths"] == [2, "auto"]
    assert result.comparisons == [], "one pair per run: no interval can be given"
    again = run_benchmark(pair, tok, prompts * 2, widths=[2, "auto"], max_tokens=12, repeats=2)
    assert {c.other for c in again.comparisons} == {"mlx-lm", "W=2"}
    assert all(c.pairs == 4 and c.low <= c.ratio <= c.high for c in again.comparisons)
    assert json.loads(json.dumps(again.to_dict()))["comparisons"][0]["run"] == "auto"


def _records(run: str, speeds: list[float]):
    from dflash_mlx.bench.results import RunRecord

    def stats(tps: float) -> dflash_mlx.Stats:
        return dflash_mlx.Stats(
            prompt_tokens=5,
            time_to_first_token=0.01,
            generation_tokens=101,
            decode_seconds=100 / tps,
            cycles=100,
            committed=100,
        )

    return [RunRecord("code", i, 0, run, run, stats(tps), "length") for i, tps in enumerate(speeds)]


def test_auto_is_compared_with_every_fixed_choice_pairwise():
    from dflash_mlx.bench.results import auto_comparisons

    jitter = [1.0, 1.04, 0.97, 1.02, 0.99, 1.01, 0.96, 1.03]
    base = [100.0 * (1 + i % 3) for i in range(8)]  # prompts differ far more than runs do
    records = (
        _records("mlx-lm", base)
        + _records("W=1", [b * j for b, j in zip(base, jitter)])
        + _records("W=4", [b * 1.5 for b in base])
        + _records("auto", [b * j for b, j in zip(base, reversed(jitter))])
    )
    found = auto_comparisons(["mlx-lm", "W=1", "W=4", "auto"], records)
    assert found[0].other == "W=4", "the best fixed choice comes first"
    assert {c.other for c in found[1:]} == {"mlx-lm", "W=1"}
    w4 = found[0]
    assert w4.ratio == pytest.approx(1 / 1.5, rel=0.03) and w4.high < 1.0, "clearly slower"
    assert all(c.low < 1.0 < c.high for c in found[1:]), "within the noise"
    assert all(c.pairs == 8 for c in found)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--verify-widths", "2,x"], "'x' is not a width"),
        (["--draft", "d"], "--draft needs --model"),
        (["--demo", "--model", "m"], "without --model and --draft"),
        (["--demo", "--suite", "math", "--prompts", "p.jsonl"], "either --prompts or --suite"),
        (["--demo", "--suite", "poetry"], "unknown suite 'poetry'"),
    ],
)
def test_cli_bench_option_errors_exit_2(args, message):
    result = run("bench", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr


def test_bench_help_lists_its_options():
    result = run("bench", "--help")
    assert result.exit_code == 0
    for option in ["--model", "--draft", "--demo", "--prompts", "--suite", "--max-tokens"]:
        assert option in result.output
    for option in ["--temp", "--repeats", "--verify-widths", "--json"]:
        assert option in result.output


def test_the_random_demo_pair_is_built_once_and_cached(tmp_path):
    """The fallback when the package ships no trained pair."""
    from dflash_mlx import load, load_draft
    from dflash_mlx.demo import demo_pair

    target_dir, draft_dir = demo_pair(tmp_path)
    assert (tmp_path / "demo-pair-v1" / "complete").exists()
    stamp = (target_dir / "model.safetensors").stat().st_mtime_ns
    assert demo_pair(tmp_path) == (target_dir, draft_dir)
    assert (target_dir / "model.safetensors").stat().st_mtime_ns == stamp, "built only once"
    load(target_dir)
    assert load_draft(draft_dir).config.block_size == 16


def test_a_prompt_is_padded_in_front_or_cut_to_a_context_keeping_its_end():
    ids, filler = [7, 8, 9], [1, 2]
    assert at_context(ids, filler, 8) == [2, 1, 2, 1, 2, 7, 8, 9]
    assert at_context(ids, filler, 2) == [8, 9]
    assert at_context(ids, [], 5) == [8, 9, 7, 8, 9]
    with pytest.raises(ValueError, match="context 0"):
        at_context(ids, filler, 0)


def test_bench_at_given_contexts_runs_each_prompt_at_each_length(
    target, draft, monkeypatch, tmp_path
):
    from dflash_mlx.speed.costs import CostCurves

    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    block = draft.config.block_size
    verify = tuple(1.0 + 0.5 * (w - 1) for w in range(1, block + 1))
    curves = CostCurves(verify, tuple(0.05 * n for n in range(block)))
    monkeypatch.setattr(dflash_mlx.Pair, "costs", lambda self, **k: curves)
    result = bench(target, draft, contexts=[40, 90])
    assert [s.suite for s in result.suites] == ["40 tokens", "90 tokens"]
    assert sorted(p["prompt_tokens"] for p in result.prompts) == [40, 40, 90, 90]
    assert result.lossless is True and result.settings["contexts"] == [40, 90]
    for suite in result.suites:
        base, w1, w4 = suite.runs
        assert base.efficiency is None and w1.ideal_speedup == pytest.approx(w1.tau)
        # tau * t_plain / (t_verify(4) + t_draft(L)): the bench drafts the whole block.
        assert w4.ideal_speedup == pytest.approx(w4.tau * 1.0 / (2.5 + 0.05 * (block - 1)))
        assert w4.efficiency == pytest.approx(w4.speedup.median / w4.ideal_speedup)


def test_context_option_parses_token_counts_and_refuses_others():
    from dflash_mlx.cli.bench import parse_contexts

    assert parse_contexts("512, 2k,8K,512") == [512, 2048, 8192]
    assert parse_contexts(None) is None
    for bad in ("0", "two", "1.5k", "-3"):
        with pytest.raises(ValueError, match="not a token count"):
            parse_contexts(bad)
