"""Draft training (`dflash_mlx.train.trainer`, `dflash-mlx train`) on a tiny target."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from dflash_mlx import Pair, generate, load_draft
from dflash_mlx.cli.main import app
from dflash_mlx.cli.train import _regenerator
from dflash_mlx.models.tiny import CORPUS
from dflash_mlx.train.trainer import (
    FEATURES,
    HELD_OUT,
    SAVING,
    TRAINING,
    Example,
    TargetRows,
    TrainSettings,
    block_targets,
    draft_config_for,
    held_out_tau,
    init_draft,
    read_examples,
    split_held_out,
    train,
)

from .test_decode import target_greedy

PROMPTS = [c[:12] for c in CORPUS[:6]] + ["x = ", "import re", "while True:", "def f("]


@pytest.fixture(scope="module")
def regen_data(target, tmp_path_factory):
    """Prompts whose responses the target writes itself (the paper's recipe)."""
    model, tok = target

    def regenerate(prompts):
        return [target_greedy(model, ids, 40) for ids in prompts]

    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    examples, skipped = read_examples(path, tok, seq_len=96, regenerate=regenerate)
    assert not skipped and len(examples) == len(PROMPTS)
    return examples


def fresh_pair(model, block=8):
    cfg = draft_config_for(model, layers=1, block_size=block, mask_token_id=1)
    return init_draft(model, cfg, seed=0), cfg


@pytest.mark.parametrize("sliding", [False, True])
def test_training_blocks_see_exactly_what_inference_shows(target, sliding):
    model, tok = target
    cfg = draft_config_for(model, layers=2, block_size=8, mask_token_id=1)
    if sliding:
        cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    pair = init_draft(model, cfg)
    draft = pair.draft
    seq = mx.array([tok.encode("def add(a, b):\n    return a + b\nfor i in range(10):")])
    _, feats = pair.target.forward(seq, None, draft.config.target_layer_ids)
    anchors = mx.array([2, 9, 15])
    block = mx.full((3, 8), 1, dtype=mx.int32)
    block[:, 0] = seq[0, anchors]
    batch = draft.training_logits(feats, mx.array([0, 0, 0]), anchors, block, pair.head)
    for i, s in enumerate(anchors.tolist()):
        state = pair.draft_state()
        draft.add_context(feats[:, :s], state)
        engine = draft.block_logits(seq[0, s : s + 1], 8, None, state)
        assert mx.allclose(batch[i], engine, atol=1e-4).item(), f"anchor {s}"


def test_short_training_with_the_defaults_lowers_loss_and_raises_engine_tau(
    target, regen_data, tmp_path
):
    """The default learning rate, schedule and γ (by block size) distil a useful draft in a
    few dozen steps (a small batch keeps the test fast)."""
    model, tok = target
    pair, cfg = fresh_pair(model)
    prompts = [e.tokens[: e.start] for e in regen_data[:4]]
    before = held_out_tau(pair, tok, prompts, 32)
    settings = TrainSettings(
        steps=60, batch=4, anchors_per_seq=8, seq_len=96, eval_every=1000, save_every=1000
    )
    log = train(pair, tok, cfg, regen_data, settings, tmp_path / "d")
    first = np.mean([s["loss"] for s in log.steps[:5]])
    last = np.mean([s["loss"] for s in log.steps[-5:]])
    after = held_out_tau(pair, tok, prompts, 32)
    assert last < 0.6 * first, (first, last)
    assert after > before + 0.25, (before, after)
    assert log.settings["loss_gamma"] == 4.0, "block 8 takes the paper's γ = 4"
    # The saved draft is a published-format checkpoint the engine loads, still lossless.
    loaded = load_draft(tmp_path / "d")
    ids = prompts[0]
    out = generate(Pair(model, loaded), tok, ids, max_tokens=24, verify_width=8)
    assert out.tokens == target_greedy(model, ids, 24)[: len(out.tokens)]
    assert out.stats.tau > 1.0


def test_resume_continues_the_same_loss_curve(target, regen_data, tmp_path):
    model, tok = target
    settings = TrainSettings(
        steps=12, save_every=6, batch=2, seq_len=96, anchors_per_seq=4, lr=2e-3, eval_every=1000
    )

    def run(out: str, **kw):
        pair, cfg = fresh_pair(model)  # a resumed run takes weights from the checkpoint
        return train(pair, tok, cfg, regen_data, settings, tmp_path / out, **kw)

    straight = run("a")

    class Interrupted(Exception):
        pass

    def stop_at_6(entry):
        # The step's closing call: the checkpoint of step 6 is written before it.
        if entry["step"] == 6 and entry["phase"] == "training":
            raise Interrupted

    with pytest.raises(Interrupted):
        run("b", progress=stop_at_6)
    resumed = run("b", resume=True)
    a = [s["loss"] for s in straight.steps]
    b = [s["loss"] for s in resumed.steps]
    assert [s["step"] for s in resumed.steps] == list(range(1, 13))
    np.testing.assert_allclose(b, a, rtol=1e-4)


def test_bad_data_lines_are_reported_with_their_line_and_skipped(target, tmp_path):
    _, tok = target
    path = tmp_path / "d.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"text": "def add(a, b): return a + b"}),
                "{not json",
                json.dumps({"prompt": "needs a response"}),
                json.dumps({"foo": 1}),
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello there friend"},
                        ]
                    }
                ),
            ]
        )
    )
    examples, skipped = read_examples(path, tok, seq_len=64)
    assert len(examples) == 2
    assert [s.split(": ")[0] for s in skipped] == [f"{path}:2", f"{path}:3", f"{path}:4"]
    assert all("skipped" in s for s in skipped)
    assert "--regenerate" in skipped[1]
    assert examples[1].start > 0, "anchors come from the assistant's reply only"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="warmup 2"):
        TrainSettings(warmup=2)
    with pytest.raises(ValueError, match="steps 0"):
        TrainSettings(steps=0)


def test_cli_trains_a_loadable_draft_and_refuses_a_used_folder(models_dir, tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("\n".join(json.dumps({"text": c}) for c in CORPUS[:6]) + "\n{bad\n")
    args = [
        "train",
        "--target",
        str(models_dir / "qwen3"),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "d"),
        "--steps",
        "4",
        "--batch",
        "2",
        "--seq-len",
        "48",
        "--block-size",
        "8",
        "--eval-every",
        "2",
        "--save-every",
        "2",
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "t.jsonl:7: skipped" in r.stderr and "held-out τ" in r.stderr
    # On a pipe, plain progress lines: each phase named before it runs, with the time left.
    lines = [line for line in r.stderr.splitlines() if line.startswith("train: ")]
    assert lines[0] == "train: 4 steps to go"
    assert any(
        line.startswith("train: 2/4 steps · held-out τ check · ") and "left ~" in line
        for line in lines
    ), lines
    assert any("saving a checkpoint" in line for line in lines), lines
    assert load_draft(tmp_path / "d").config.block_size == 8
    log = json.loads((tmp_path / "d" / "training_log.json").read_text())
    assert len(log["steps"]) == 4 and log["evals"]
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "not empty" in again.stderr


def test_long_regenerate_prompts_are_cut_from_the_left(target, tmp_path):
    model, tok = target
    long_text = "".join(CORPUS[:6]) * 3
    ids = tok.encode(long_text)
    assert len(ids) > 64
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": long_text}) + "\n" + json.dumps({"text": "x = "}))
    seen = []

    def regenerate(prompts):
        seen.extend(prompts)
        return [target_greedy(model, p, 24) for p in prompts]

    examples, skipped = read_examples(path, tok, seq_len=64, regenerate=regenerate, reply_room=24)
    assert not skipped and len(examples) == 2
    long = examples[0]
    assert seen[0] == ids[-40:], "the prompt keeps its last seq_len - reply_room tokens"
    assert long.start == 40 and long.tokens[:40] == ids[-40:]
    assert long.tokens[40:] == target_greedy(model, ids[-40:], 24)
    with pytest.raises(ValueError, match="reply room 64 tokens must be below seq_len 64"):
        read_examples(path, tok, seq_len=64, regenerate=regenerate, reply_room=64)


def test_batched_regeneration_writes_the_targets_greedy_replies(target):
    model, tok = target
    prompts = [tok.encode(p) for p in PROMPTS[:5]]
    replies = _regenerator(model, tok, 16)(prompts)
    eos = set(tok.eos_token_ids)
    for ids, reply in zip(prompts, replies, strict=True):
        want = target_greedy(model, ids, 16)
        cut = next((i for i, t in enumerate(want) if t in eos), len(want))
        assert reply == want[:cut]


def test_held_out_prompts_come_from_across_the_data_and_leave_training():
    examples = [Example(list(range(i, i + 30)), 10) for i in range(200)]
    kept, held = split_held_out(examples, 8, seed=0)
    assert len(held) == 8 and len(kept) == 192
    firsts = {h[0] for h in held}
    assert all(len(h) == 10 for h in held), "a held-out prompt is what precedes its reply"
    assert not firsts & {e.tokens[0] for e in kept}
    assert min(firsts) < 100 < max(firsts), "spread over the data, not its last lines"


def test_an_empty_text_to_regenerate_from_is_skipped_and_reported(target, tmp_path):
    """mlx-lm's batched decoding fails on an empty prompt: the line is reported instead."""
    model, tok = target
    seen = []

    def regenerate(prompts):
        seen.extend(prompts)
        assert all(prompts), "an empty prompt reached the target"
        return [target_greedy(model, ids, 8) for ids in prompts]

    path = tmp_path / "texts.jsonl"
    path.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "def f("}))
    examples, skipped = read_examples(path, tok, seq_len=64, regenerate=regenerate)
    assert len(examples) == 1 and len(seen) == 1
    assert skipped == [f"{path}:1: skipped (empty text: nothing for the target to continue)"]


def test_the_targets_rows_kept_once_train_exactly_as_computed_each_step(
    target, regen_data, tmp_path
):
    """The frozen target's features and next tokens, computed once before the first step
    (`TargetRows`), give the losses the per-step forward gives; the run says the phase."""
    model, tok = target
    losses, phases = {}, {}
    for mb in (0, 2048):
        pair, cfg = fresh_pair(model)
        settings = TrainSettings(
            steps=6, batch=3, anchors_per_seq=6, seq_len=96, eval_every=1000, save_every=1000,
            feature_cache_mb=mb,
        )  # fmt: skip
        seen = []
        log = train(pair, tok, cfg, regen_data, settings, tmp_path / str(mb), progress=seen.append)
        losses[mb] = [s["loss"] for s in log.steps]
        phases[mb] = [e["phase"] for e in seen]
    np.testing.assert_allclose(losses[2048], losses[0], rtol=1e-5)
    assert phases[2048][0] == FEATURES and FEATURES not in phases[0]
    assert phases[2048][1:] == phases[0]


def test_rows_too_big_for_the_budget_are_computed_each_step(target, regen_data, tmp_path):
    model, tok = target
    pair, _ = fresh_pair(model)
    need = TargetRows.nbytes(pair, regen_data)
    assert need == sum(len(e.tokens) for e in regen_data) * (
        len(pair.draft.config.target_layer_ids) * pair.target.hidden_size * 4 + 4
    )
    pair, cfg = fresh_pair(model)
    seen = []
    settings = TrainSettings(
        steps=2, batch=2, anchors_per_seq=4, seq_len=96, eval_every=1000, save_every=1000,
        feature_cache_mb=need / 2**20 * 0.99,  # just too small
    )  # fmt: skip
    train(pair, tok, cfg, regen_data, settings, tmp_path / "d", progress=seen.append)
    assert FEATURES not in [e["phase"] for e in seen]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_time_left_counts_steps_checks_and_saves_at_their_own_speed():
    """Steps of 2 s, a held-out check of 30 s, a checkpoint of 5 s, and a 60 s phase before
    the first step: the time left is the steps to go at 2 s plus the checks and
    checkpoints to come, not the elapsed time spread over the steps done."""
    import io

    from rich.console import Console

    from dflash_mlx.cli.train import TrainProgress

    clock, buf = FakeClock(), io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    p = TrainProgress(console, 100, eval_every=50, save_every=50, clock=clock)
    with p:
        p({"step": 0, "loss": float("nan"), "tokens_per_s": 0, "phase": FEATURES})
        clock.now += 60  # the target reads the data
        for step in range(1, 51):
            clock.now += 2
            entry = {"step": step, "loss": 1.0, "tokens_per_s": 1, "step_s": 2.0}
            if step == 50:
                assert p.left(50) == "left ~1 min 40 s + checks", "no check timed yet"
                p({**entry, "phase": HELD_OUT})
                clock.now += 30
                p({**entry, "phase": SAVING})
                clock.now += 5
            p({**entry, "phase": TRAINING})
    # 50 steps at 2 s, one check (30 s) and one save (5 s) to come.
    assert p.left(50) == "left ~2 min 15 s"
    lines = buf.getvalue().splitlines()
    assert lines[0] == "train: 100 steps to go"
    assert lines[1].startswith(f"train: 0/100 steps · {FEATURES} · ") and "left: –" in lines[1]
    assert "loss nan" not in buf.getvalue()
    assert any(x.startswith("train: 50/100 steps · held-out τ check") for x in lines), lines


def test_a_half_precision_target_gets_a_float32_draft(models_dir):
    """A bf16 target (a GPU, or a CPU without an optimized BLAS: no upcast) once gave a bf16
    draft: its late updates rounded away and it took the slower, worse fused bf16 path."""
    from dflash_mlx import load
    from dflash_mlx.train.blocks import fast_path

    model, _ = load(str(models_dir / "qwen3"))
    model.set_dtype(mx.bfloat16)
    pair, _ = fresh_pair(model)
    dtypes = {v.dtype for _, v in tree_flatten(pair.draft.trainable_parameters())}
    assert dtypes == {mx.float32}
    assert fast_path(pair.draft)
    feats, _ = block_targets(pair, mx.array([[3, 4, 5, 6]]))
    assert feats.dtype == mx.bfloat16, "the target itself is left as it is"
