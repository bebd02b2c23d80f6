"""More data from few prompts (`dflash_mlx.train.data`), the verdict (`train.verdict`), and
the lines `dflash-mlx train` ends with (issue 64)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli.main import app
from dflash_mlx.models.tiny import CORPUS
from dflash_mlx.train.data import (
    Example,
    Growth,
    TargetWriter,
    auto_per_prompt,
    grow,
    read_examples,
    split_held,
    split_held_out,
)
from dflash_mlx.train.verdict import verdict

from .test_decode import target_greedy


def test_each_prompt_grows_several_continuations_at_several_offsets(target, tmp_path):
    """A prompt gives `per_prompt` examples: itself whole, continued greedily, then cuts at
    distinct offsets in its second half, each with a sampled branch before the greedy
    reply; anchors start after the branch; all keep the prompt's line."""
    model, tok = target
    texts = [c for c in CORPUS if len(tok.encode(c)) >= 24][:3]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    writer = TargetWriter(model, tok, 12, Growth(per_prompt=4, branch=3, seed=1))
    examples, skipped = read_examples(
        path, tok, seq_len=128, regenerate=writer, reply_room=12, per_prompt=4,
        branches=writer.branches,
    )  # fmt: skip
    assert not skipped and len(examples) == 4 * len(texts)
    eos = set(tok.eos_token_ids)
    for line, text in enumerate(texts):
        ids = tok.encode(text)
        mine = [e for e in examples if e.source == line]
        assert len(mine) == 4
        whole, cuts = mine[0], mine[1:]
        assert whole.start == len(ids) and whole.tokens[: len(ids)] == ids
        offsets = []
        for e in cuts:
            cut = e.start - 3  # the cut, then the 3 sampled tokens of its branch
            offsets.append(cut)
            assert e.tokens[:cut] == ids[:cut] and len(ids) // 2 <= cut < len(ids)
            want = target_greedy(model, e.tokens[: e.start], 12)
            stop = next((i for i, t in enumerate(want) if t in eos), len(want))
            assert e.tokens[e.start :] == want[:stop], "after the branch: the greedy reply"
        assert len(set(offsets)) == 3, "distinct offsets"
        greedy_next = [target_greedy(model, ids[:c], 3) for c in offsets]
        assert any(e.tokens[c : c + 3] != g for e, c, g in zip(cuts, offsets, greedy_next)), (
            "the branches are sampled, not the greedy continuation"
        )


def test_one_continuation_per_prompt_is_the_plain_regeneration(target, tmp_path):
    model, tok = target
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"text": c[:30]}) for c in CORPUS[:4]))
    writer = TargetWriter(model, tok, 8)
    examples, _ = read_examples(path, tok, seq_len=64, regenerate=writer, reply_room=8)
    assert [e.source for e in examples] == [0, 1, 2, 3]
    assert [e.tokens[: e.start] for e in examples] == [tok.encode(c[:30]) for c in CORPUS[:4]]


def test_a_short_prompt_fills_its_continuations_with_branches_of_it_whole():
    plans = grow([[5, 6, 7, 8, 9, 10]], 5, seed=0)
    assert len(plans) == 5 and not plans[0].branch and all(p.branch for p in plans[1:])
    cuts = sorted(len(p.prompt) for p in plans[1:])
    assert cuts == [4, 5, 6, 6], "the two cuts it has (4 and 5), then the prompt whole"


def test_auto_continuations_give_about_half_the_draws():
    assert auto_per_prompt(1000, 250, 16) == 4  # 4,000 sequences for 4,000 draws
    assert auto_per_prompt(5000, 250, 16) == 1
    assert auto_per_prompt(384, 250, 16) == 8  # capped
    with pytest.raises(ValueError, match="continuations per prompt 0"):
        Growth(per_prompt=0)


def test_a_held_out_lines_continuations_all_leave_training():
    examples = [Example(list(range(i, i + 30)), 10 + i % 3, i // 3) for i in range(600)]
    kept, held = split_held(examples, 8, seed=0)
    assert len(held) == 8 and len(kept) == 600 - 8 * 3
    assert {e.source for e in held}.isdisjoint({e.source for e in kept})
    assert all(examples.index(h) % 3 == 0 for h in held), "the prompt continued whole"
    _, prompts = split_held_out(examples, 8, seed=0)
    assert prompts == [h.tokens[: h.start] for h in held]


def _check(step, held, train, tau=2.0):
    return {"step": step, "tau": tau, "held_loss": held, "train_loss": train}


def test_the_verdict_reads_the_end_of_the_held_out_curve():
    # still falling 10% per 100 steps, no gap: more steps
    v = verdict([_check(100, 2.4, 2.3), _check(200, 2.2, 2.1), _check(250, 2.1, 2.0, 2.6)])
    assert v.more_steps and not v.more_data and v.line.startswith("more steps would help")
    # flat, held-out far above training: more data
    v = verdict([_check(200, 3.01, 1.5), _check(250, 3.0, 1.45)])
    assert v.more_data and not v.more_steps and v.line.startswith("more data would help")
    # both
    v = verdict([_check(200, 3.2, 1.5), _check(250, 3.0, 1.4)])
    assert v.more_data and v.more_steps and "both" in v.line
    # flat and no gap: neither
    v = verdict([_check(200, 2.005, 1.95), _check(250, 2.0, 1.95)])
    assert not v.more_data and not v.more_steps and v.line.startswith("neither")
    assert verdict([_check(250, 2.0, 1.9)]) is None, "one check has no slope"


def test_train_ends_with_the_held_out_tau_at_its_width_and_a_verdict(models_dir, tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("\n".join(json.dumps({"text": c[:40]}) for c in CORPUS * 4) + "\n")
    args = [
        "train", "--target", str(models_dir / "qwen3"), "--data", str(data),
        "--out", str(tmp_path / "d"), "--regenerate", "--regen-tokens", "16",
        "--continuations", "2", "--steps", "4", "--batch", "2", "--seq-len", "64",
        "--block-size", "4", "--eval-every", "2", "--save-every", "4",
    ]  # fmt: skip
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    log = json.loads((tmp_path / "d" / "training_log.json").read_text())
    tau = log["evals"][-1]["tau"]
    assert f"held-out τ at W=4 (the width it was trained for): {tau:.2f}" in r.stderr
    assert log["verdict"] and f"verdict: {log['verdict']}\n" in r.stderr
    assert all("held_loss" in e and "train_loss" in e for e in log["evals"])
    assert log["data"]["sequences"] > len(CORPUS) * 4, "two continuations of each prompt"
    bad = CliRunner().invoke(app, [*args[:-2], "--continuations", "0", "--force"])
    assert bad.exit_code == 2 and "--continuations 0 must be >= 1" in bad.stderr
