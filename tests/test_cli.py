"""The `dflash-mlx` command line on the tiny session models: output, exit codes, streams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cli.main import app

PROMPT = "def add(a, b):"
MAX_TOKENS = 24
JSON_KEYS = {
    "text",
    "tokens",
    "finish_reason",
    "stop",
    "prompt_tokens",
    "generation_tokens",
    "generation_tps",
    "prompt_tps",
    "mean_acceptance",
    "cycles",
    "verify_width",
    "acceptance_rates",
    "peak_memory_gb",
    "time_to_first_token",
    "ran",
}


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def pair(models_dir) -> list[str]:
    return ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]


def generate_args(pair: list[str], *extra: str) -> list[str]:
    return ["generate", *pair, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), *extra]


def test_json_tokens_equal_library_generate(pair, target, draft):
    result = run(*generate_args(pair, "--raw", "--json"))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # stdout holds exactly one JSON object
    assert set(data) == JSON_KEYS
    model, tokenizer = target
    expected = dflash_mlx.generate(
        model, draft, tokenizer, PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert data["tokens"] == expected.tokens, "CLI and library disagree on greedy tokens"
    assert data["text"] == expected.text
    assert data["generation_tokens"] == MAX_TOKENS
    assert data["finish_reason"] == "length"
    assert data["verify_width"] is None  # chosen per cycle
    assert len(data["acceptance_rates"]) <= draft.config.block_size - 1
    ran = data["ran"]  # what the engine ran: every cycle at some width
    assert sum(w["cycles"] for w in ran["widths"].values()) == data["cycles"]
    assert 0.0 <= ran["plain_fraction"] <= 1.0 and ran["draft"] in ("active", "dormant")


def test_chat_template_is_applied_by_default(pair, target, draft):
    result = run(*generate_args(pair, "--json"))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    model, tokenizer = target
    messages = [{"role": "user", "content": PROMPT}]
    expected = dflash_mlx.generate(
        model, draft, tokenizer, messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert data["prompt_tokens"] == expected.prompt_tokens
    assert data["prompt_tokens"] > len(tokenizer.encode(PROMPT)), "no chat template applied"
    assert data["tokens"] == expected.tokens


def test_streaming_prints_the_text_then_a_stats_line_with_tau(pair, target, draft):
    result = run(*generate_args(pair, "--raw"))
    assert result.exit_code == 0, result.output
    model, tokenizer = target
    text = dflash_mlx.generate(
        model, draft, tokenizer, PROMPT, max_tokens=MAX_TOKENS, temperature=0
    ).text
    assert result.stdout == (text if text.endswith("\n") else text + "\n"), (
        "stdout must hold the completion only; notes and stats belong on stderr"
    )
    stats = result.stderr.strip().splitlines()[-1]
    assert "τ" in stats
    assert f"{MAX_TOKENS} tokens" in stats
    assert "tok/s" in stats and "TTFT" in stats and "peak" not in stats  # details: -v
    assert "hit max_tokens" in stats
    verbose = run(*generate_args(pair, "--raw", "-v")).stderr.strip().splitlines()[-1]
    assert "peak" in verbose and "prefill" in verbose


def test_long_prompt_streams_with_prompt_progress(pair, target):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 20
    assert len(target[1].encode(long_prompt)) > 512, "prompt too short to show progress"
    result = run("generate", *pair, "--prompt", long_prompt, "--max-tokens", "4", "--raw")
    assert result.exit_code == 0, result.output
    assert "τ" in result.stderr


def test_missing_model_folder_is_a_one_line_error_with_exit_code_2(models_dir, pair):
    missing = str(models_dir / "no-such-model")
    result = run("generate", "--model", missing, "--draft", pair[3], "--prompt", PROMPT)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ")
    assert "no-such-model" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_library_value_error_during_generation_exits_2(pair):
    result = run(*generate_args(pair, "--verify-width", "99"))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: --verify-width 99")
    assert "Traceback" not in result.output


def test_block_size_is_a_deprecated_name_of_verify_width(pair):
    old = run(*generate_args(pair, "--raw", "--json", "--block-size", "4"))
    new = run(*generate_args(pair, "--raw", "--json", "--verify-width", "4"))
    assert old.exit_code == new.exit_code == 0, old.output
    assert "deprecated" in old.stderr and "--verify-width" in old.stderr
    assert "deprecated" not in new.stderr
    a, b = json.loads(old.stdout), json.loads(new.stdout)
    assert a["tokens"] == b["tokens"] and a["verify_width"] == b["verify_width"] == 4
    clash = run(*generate_args(pair, "--block-size", "4", "--verify-width", "2"))
    assert clash.exit_code == 2 and "disagree" in clash.stderr


@pytest.mark.parametrize("error", [RuntimeError("boom"), ValueError("boom")])
def test_an_internal_error_is_ours_exit_1_with_a_hint_not_a_traceback(pair, monkeypatch, error):
    """A failure inside the engine (even a plain ValueError) is not the user's fault: exit
    code 1 and one line saying so, never exit 2 or a traceback."""
    from dflash_mlx.models.target import TargetAdapter

    def broken(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(TargetAdapter, "forward", broken)
    result = run(*generate_args(pair))
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: internal error: ")
    assert "boom" in result.stderr and "DFLASH_MLX_DEBUG" in result.stderr
    assert "Traceback" not in result.output


def test_draft_and_no_draft_together_are_refused(models_dir):
    model = str(models_dir / "qwen3")
    result = run("generate", "--model", model, "--draft", "d", "--no-draft", "--prompt", PROMPT)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: pass either --draft or --no-draft")


def test_no_draft_decodes_with_the_target_alone_and_says_so(models_dir, target):
    args = ["generate", "--model", str(models_dir / "qwen3"), "--no-draft", "--prompt", PROMPT]
    result = run(*args, "--max-tokens", str(MAX_TOKENS), "--raw", "--json")
    assert result.exit_code == 0, result.output
    assert "without speculation" in result.stderr
    model, tokenizer = target
    expected = dflash_mlx.generate(
        model, None, tokenizer, PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    data = json.loads(result.stdout)
    assert data["tokens"] == expected.tokens
    assert data["verify_width"] == 1 and data["mean_acceptance"] == 1.0

    streamed = run(*args, "--max-tokens", "8")
    assert streamed.exit_code == 0, streamed.output
    assert "without speculation" in streamed.stderr and "plain decoding" in streamed.stderr


def test_ctrl_c_while_streaming_stops_with_exit_code_130(pair, monkeypatch):
    real = dflash_mlx.stream_generate

    def interrupted_after_first_chunk(*args, **kwargs):
        stream = real(*args, **kwargs)
        yield next(stream)
        stream.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash_mlx, "stream_generate", interrupted_after_first_chunk)
    result = run(*generate_args(pair))
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.stderr
    assert "Traceback" not in result.output


def test_help_and_version():
    result = run("--help")
    assert result.exit_code == 0 and "generate" in result.output
    result = run("generate", "--help")
    assert result.exit_code == 0
    for option in ["--model", "--draft", "--no-draft", "--verify-width", "--raw", "--json"]:
        assert option in result.output
    result = run("--version")
    assert result.exit_code == 0, result.output
    report = dict(line.split(":", 1) for line in result.stdout.strip().splitlines())
    report = {k.strip(): v.strip() for k, v in report.items()}
    assert report["dflash-mlx-engine"] == version("dflash-mlx-engine")
    assert report["mlx"] == version("mlx") and report["mlx-lm"] == version("mlx-lm")
    import mlx.core as mx

    assert report["device"] in ("cpu", "gpu")
    assert report["device"] == ("gpu" if mx.default_device() == mx.gpu else "cpu")
    assert report["metal"] == ("available" if mx.metal.is_available() else "not available")
    assert "dflash2 conv kernel" in report and report["cache"] == os.environ["DFLASH_MLX_CACHE"]


def test_help_does_not_import_mlx():
    code = (
        "import sys\n"
        "from dflash_mlx.cli.main import app\n"
        "engine = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')\n"
        "          or (m.startswith('dflash_mlx.') and not m.startswith('dflash_mlx.cli')\n"
        "              and m != 'dflash_mlx.errors')]\n"
        "assert not engine, engine\n"
        "app()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "generate" in done.stdout


@pytest.mark.slow  # end to end: the trained demo pair, calibrated
def test_generate_demo_runs_offline_and_says_what_the_pair_is():
    from dflash_mlx.demo import NOTICE

    result = run("generate", "--demo", "--prompt", "def fib(n):", "--max-tokens", "8", "--json")
    assert result.exit_code == 0, result.output
    assert NOTICE in " ".join(result.stderr.split())
    assert json.loads(result.stdout)["generation_tokens"] == 8
    result = run("generate", "--demo", "--model", "m", "--prompt", "x")
    assert result.exit_code == 2 and "without --model" in result.stderr


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_chat_and_serve_report_internal_errors_as_ours(monkeypatch, command):
    """Every command, not only generate: a plain ValueError from inside is exit 1, while a
    bad option stays the user's (exit 2)."""
    from dflash_mlx.cli import chat, serve

    def broken(**kwargs):
        raise ValueError("boom inside")

    monkeypatch.setattr(chat if command == "chat" else serve, "run", broken)
    result = run(command, "--demo")
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: internal error: ") and "boom inside" in result.stderr
    monkeypatch.undo()
    bad = ["--port", "70000"] if command == "serve" else ["--temp", "-1"]
    result = CliRunner().invoke(app, [command, "--demo", *bad], input="hi")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and "internal" not in result.stderr


def test_draft_sink_reaches_the_engine_and_keeps_the_output(pair, target, monkeypatch):
    import importlib

    generate_module = importlib.import_module("dflash_mlx.engine.generate")
    seen = []
    real = generate_module.stream_generate

    def spy(*args, **kwargs):
        options = [a for a in args if isinstance(a, dflash_mlx.GenerateOptions)]
        seen.append((options[0].draft_window, options[0].draft_sink))
        return real(*args, **kwargs)

    monkeypatch.setattr(dflash_mlx, "stream_generate", spy)
    monkeypatch.setattr(generate_module, "stream_generate", spy)
    args = generate_args(pair, "--raw", "--json", "--verify-width", "4")
    result = run(*args, "--draft-window", "4", "--draft-sink", "2")
    assert result.exit_code == 0, result.output
    assert seen == [(4, 2)]
    monkeypatch.undo()
    model, tokenizer = target
    plain = dflash_mlx.generate(model, None, tokenizer, PROMPT, max_tokens=MAX_TOKENS)
    assert json.loads(result.stdout)["tokens"] == plain.tokens


def test_draft_window_reaches_the_engine_and_bad_ones_exit_2(pair, target, draft, monkeypatch):
    import importlib

    generate_module = importlib.import_module("dflash_mlx.engine.generate")
    seen = []
    real = generate_module.stream_generate

    def spy(*args, **kwargs):
        options = [a for a in args if isinstance(a, dflash_mlx.GenerateOptions)]
        seen.append(options[0].draft_window if options else kwargs.get("draft_window"))
        return real(*args, **kwargs)

    monkeypatch.setattr(dflash_mlx, "stream_generate", spy)
    monkeypatch.setattr(generate_module, "stream_generate", spy)
    result = run(*generate_args(pair, "--raw", "--json", "--draft-window", "8"))
    assert result.exit_code == 0, result.output
    assert seen == [8]
    monkeypatch.undo()
    model, tokenizer = target
    plain = dflash_mlx.generate(model, None, tokenizer, PROMPT, max_tokens=MAX_TOKENS)
    assert json.loads(result.stdout)["tokens"] == plain.tokens
    for command in (generate_args(pair), ["chat", *pair], ["serve", *pair], ["bench", *pair]):
        result = CliRunner().invoke(app, [*command, "--draft-window", "1"], input="hi\n")
        assert result.exit_code == 2, (command[0], result.output)
        assert (
            "draft" in result.stderr and "1" in result.stderr and "Traceback" not in result.output
        )
