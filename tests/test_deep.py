"""The deep stand-in (`dflash_mlx.models.deep`): a target padded with identity layers keeps
its tokens and its draft's acceptance, and costs a deep target's compute."""

from __future__ import annotations

import json

import pytest

from dflash_mlx import GenerateOptions, Pair, load, load_draft
from dflash_mlx.engine.generate import generate
from dflash_mlx.models.deep import pad_pair, padded_positions


def test_real_layers_are_spread_evenly_and_the_first_stays_first():
    assert padded_positions(4, 24) == [0, 6, 12, 18]
    assert padded_positions(3, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot pad a 5-layer target to 4"):
        padded_positions(5, 4)


def test_a_padded_target_decodes_the_same_tokens_and_its_draft_the_same_acceptance(
    models_dir, tmp_path
):
    target_dir, draft_dir = pad_pair(models_dir / "qwen3", models_dir / "draft", tmp_path, 9)
    (model, tok), draft = load(str(models_dir / "qwen3")), load_draft(str(models_dir / "draft"))
    (deep, _), deep_draft = load(str(target_dir)), load_draft(str(draft_dir))
    real = json.loads((models_dir / "qwen3" / "config.json").read_text())["num_hidden_layers"]
    assert len(deep.layers) == 9 > real
    where = padded_positions(real, 9)
    assert deep_draft.config.target_layer_ids == [where[i] for i in draft.config.target_layer_ids]
    prompt = "def add(a, b):\n"
    plain = GenerateOptions(max_tokens=24, verify_width=1)
    assert (
        generate(Pair(deep), tok, prompt, plain).text
        == generate(Pair(model), tok, prompt, plain).text
    )
    wide = GenerateOptions(max_tokens=24, verify_width=4)
    a = generate(Pair(model, draft), tok, prompt, wide)
    b = generate(Pair(deep, deep_draft), tok, prompt, wide)
    assert b.text == a.text == generate(Pair(model), tok, prompt, plain).text
    # The draft reads the same features at its remapped layers: the same acceptance.
    assert b.stats.widths == a.stats.widths and b.stats.tau == a.stats.tau
