"""Long prompts: `dflash-mlx train --long-context` (issue 37 item 3) on a tiny target."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_mlx import load_draft
from dflash_mlx.cli.main import app
from dflash_mlx.errors import BadArgument
from dflash_mlx.models.tiny import CORPUS
from dflash_mlx.train.long_context import cut_windows, file_tokens, parse_lengths


def test_window_lengths_parse_and_bad_ones_name_the_option():
    assert parse_lengths("3k, 1024,1024") == [1024, 3072]
    for bad in ("", "abc", "8", "1024,-5", "2.5k"):
        with pytest.raises(BadArgument, match="--long-context"):
            parse_lengths(bad)


def test_windows_are_cut_at_each_length_and_held_out_streams_are_never_trained_on():
    streams = [[s * 1000 + i for i in range(300 + 40 * s)] for s in range(10)]
    train, held = cut_windows(streams, [64, 200], per_length=12, reply=16, seed=3)
    assert sorted({n for n, _ in train}) == [64, 200] and len(train) == 24
    assert all(len(w) == n for n, w in train + held)
    assert len(held) == 4, "two held-out windows per length"
    held_streams = {w[0] // 1000 for _, w in held}
    train_streams = {w[0] // 1000 for _, w in train}
    assert held_streams and not held_streams & train_streams
    for n, w in train:  # a window is a contiguous stretch, leaving room for its reply
        s = streams[w[0] // 1000]
        start = s.index(w[0])
        assert s[start : start + n] == w and start + n + 16 <= len(s)
    assert cut_windows(streams, [64, 200], 12, 16, seed=3) == (train, held), "not seeded"
    with pytest.raises(BadArgument, match="long enough"):
        cut_windows(streams, [4000], per_length=2, reply=16)


def test_short_lines_are_joined_into_streams_long_enough(target, tmp_path):
    _, tok = target
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": c}) for c in CORPUS * 8) + "\n{bad\n")
    streams = file_tokens(data, tok, longest=60)
    assert len(streams) > 1 and all(len(s) >= 60 for s in streams[:-1])
    assert sum(len(s) for s in streams) >= sum(len(tok.encode(c)) for c in CORPUS * 8)


@pytest.mark.slow  # ~16 s: regeneration, two steps and three τ checks
def test_cli_fine_tunes_a_draft_on_long_windows_and_reports_tau_at_depth(models_dir, tmp_path):
    data = tmp_path / "long.jsonl"
    texts = ["\n".join(CORPUS[k:] + CORPUS[:k]) * 8 for k in range(8)]  # 8 long documents
    data.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    out = tmp_path / "ft"
    args = ["train", "--target", str(models_dir / "qwen3"), "--data", str(data)]
    args += ["--out", str(out), "--init", str(models_dir / "draft"), "--long-context", "48,96"]
    args += ["--long-windows", "2", "--regen-tokens", "8", "--steps", "1", "--batch", "2"]
    args += ["--seq-len", "32"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "long_context.json").read_text())
    assert report["lengths"] == [48, 96]
    assert set(report["tau_before"]) == set(report["tau_after"]) == {"48", "96"}
    assert all(t >= 1.0 for t in report["tau_after"].values())
    assert "held-out τ at depth, before → after: 48 tokens" in " ".join(r.stderr.split())
    draft = load_draft(out)
    start = load_draft(models_dir / "draft")
    assert draft.config.block_size == start.config.block_size, "not the --init draft's shape"
    assert draft.config.training_context == 96 + 8, "the longest trained context"
    bad = CliRunner().invoke(app, [*args[:-2], "--long-context", "lots", "--force"])
    assert bad.exit_code == 2 and "--long-context 'lots'" in bad.stderr
