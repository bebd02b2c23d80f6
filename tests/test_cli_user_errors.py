"""Issue 43, item 6: the user errors of `train`, `quantize` and `bench` exit 2 with one
`error:` line naming the flag, before the slow work (loading a model, training,
benchmarking), never as a bug of ours (exit 1) and never after the work is lost.

"Before the slow work" is shown by a model argument that does not exist: had the command
loaded anything first, it would have failed on that instead.
"""

from __future__ import annotations

import json

import pytest

from .test_cli_faults import run, user_error

NOWHERE = "/nonexistent/model"  # loading it would fail: the checks must come first


@pytest.fixture
def files(tmp_path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "unusable.jsonl").write_text('{"x": 1}\nnot json\n[1, 2]\n{"prompt": "p"}\n')
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe{")
    (tmp_path / "no-jsonl").mkdir()
    (tmp_path / "good.jsonl").write_text(json.dumps({"text": "def f(x): return x"}) + "\n")
    return tmp_path


@pytest.mark.parametrize(
    "data, named",
    [
        ("missing.jsonl", "no such file"),
        ("empty.jsonl", "empty"),
        ("unusable.jsonl", "--regenerate"),  # a {"prompt"} line needs it: said so
        ("binary.jsonl", "cannot be read"),
        ("no-jsonl", "no .jsonl file"),
    ],
)
def test_train_refuses_data_it_cannot_use_before_loading(files, data, named):
    result = run("train", "--target", NOWHERE, "--data", str(files / data),
                 "--out", str(files / "out"))  # fmt: skip
    user_error(result, "--data", data, named)
    assert not (files / "out").exists()


@pytest.mark.parametrize("out", ["a-file", "a-file/draft"])
def test_train_refuses_an_out_it_cannot_write_before_loading(files, out):
    result = run("train", "--target", NOWHERE, "--data", str(files / "good.jsonl"),
                 "--out", str(files / out))  # fmt: skip
    user_error(result, "--out", out)


def test_train_refuses_resuming_a_folder_without_a_draft(files):
    result = run("train", "--target", NOWHERE, "--data", str(files / "good.jsonl"),
                 "--out", str(files / "no-jsonl"), "--resume")  # fmt: skip
    user_error(result, "--resume", "config.json")


def test_train_data_with_no_usable_example_is_a_user_error(models_dir, files):
    """Lines that look like examples but are too short once tokenized: found after the
    tokenizer loads, still the user's error (it was an internal one, exit 1)."""
    (files / "short.jsonl").write_text('{"text": "a"}\n')
    result = run("train", "-m", str(models_dir / "qwen3"), "--data",
                 str(files / "short.jsonl"), "--out", str(files / "out"))  # fmt: skip
    user_error(result, "short.jsonl", "no usable example")


@pytest.mark.parametrize("kind", ["draft", "target"])
@pytest.mark.parametrize("out", ["a-file", "a-file/q"])
def test_quantize_refuses_an_out_it_cannot_write_before_loading(files, kind, out):
    user_error(run("quantize", kind, NOWHERE, "--out", str(files / out)), "--out", out)


def test_quantize_target_on_corrupt_weights_is_a_user_error(models_dir, files):
    corrupt = files / "corrupt"
    corrupt.mkdir()
    for f in (models_dir / "qwen3").iterdir():
        data = f.read_bytes()
        (corrupt / f.name).write_bytes(data[:1000] if f.suffix == ".safetensors" else data)
    result = run("quantize", "target", str(corrupt), "--out", str(files / "q"))
    user_error(result, "corrupt", "unreadable weights")


@pytest.mark.parametrize("where", ["a-file/results.json", "."])
def test_bench_refuses_a_json_path_it_cannot_write_before_running(files, where):
    """It failed only after the whole bench ran, losing the results."""
    target = files / where
    result = run("bench", "--model", NOWHERE, "--json", str(target))
    user_error(result, "--json")


def test_bench_refuses_a_context_beyond_the_models_positions(models_dir):
    """It prefilled for minutes (no output for 120 s); `generate` refuses at once."""
    pair = ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]
    result = run("bench", *pair, "--context", "1024,100000", "--max-tokens", "8")
    message = user_error(result, "--context 100000", "100008 positions")
    assert "4096" in message  # what the tiny target holds
