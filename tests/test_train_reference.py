"""`dflash-mlx train`'s defaults against a minimal reference distillation loop (issue 28).

The reference is written here, apart from `dflash_mlx.train.trainer`: the same draft initialisation,
the target's greedy replies as data, anchors at random reply positions, loss = weighted
cross-entropy against the target's own greedy tokens, AdamW (MLX's) with warm-up and
cosine. Both train a fresh draft on the demo pair's target for the same steps, seed and data
order; the command's draft must not come out worse on held-out replies (a fixed loss: every
reply position of the held-out examples an anchor, γ 4). Losses, never wall time.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from dflash_mlx.cli.train import _regenerator
from dflash_mlx.models.tiny import CORPUS
from dflash_mlx.train.trainer import (
    TrainSettings,
    block_targets,
    draft_config_for,
    init_draft,
    read_examples,
    train,
)

from .test_decode import target_greedy

STEPS, BATCH, ANCHORS, SEQ_LEN, REPLY = 40, 4, 8, 96, 32


TRAIN_TARGETS = Path(__file__).resolve().parents[1] / "benchmarks" / "train_targets.py"
# Smaller versions of benchmarks/train_targets.py's targets, trained in this session: another
# depth, width, vocabulary and corpus than the demo target's (4 layers, hidden 256, a 2k BPE,
# code). A random tiny target's greedy replies are too easy to tell a good recipe from a bad
# one, so each is trained (briefly) on its corpus.
SMALL = {
    "code6": {"layers": 6, "hidden": 128, "vocab": 1024, "steps": 60},
    "prose": {"layers": 3, "hidden": 128, "vocab": 1536, "steps": 60},
}


@pytest.fixture(scope="module")
def builder():
    spec = importlib.util.spec_from_file_location("train_targets", TRAIN_TARGETS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# CI runs two targets (demo and prose); the 6-layer code target (~2.5 min to build here,
# ~6 on CI's machine) joins them with DFLASH_MLX_TRAIN_TARGETS=all.
_TARGETS = ["demo", "prose"] + (
    ["code6"] if os.environ.get("DFLASH_MLX_TRAIN_TARGETS") == "all" else []
)


@pytest.fixture(scope="module", params=_TARGETS)
def some_target(request, builder, tmp_path_factory):
    """(model, tokenizer, held-out texts): the shipped demo target (a trained 4-layer code
    model), or a target unlike it trained here."""
    from dflash_mlx import load
    from dflash_mlx.demo import SHIPPED

    if request.param == "demo":
        lines = (SHIPPED / "heldout_prompts.jsonl").read_text().splitlines()
        model, tok = load(str(SHIPPED / "target"))
        return model, tok, [json.loads(x)["prompt"] for x in lines if x.strip()]
    spec = {**builder.TARGETS[request.param], **SMALL[request.param]}
    held_in, held_out = builder.corpus(spec["corpus"])
    folder = tmp_path_factory.mktemp(request.param)
    builder.train_target(
        folder, held_in[:40], layers=spec["layers"], hidden=spec["hidden"],
        vocab=spec["vocab"], steps=spec["steps"], batch=8, seq=128,
    )  # fmt: skip
    model, tok = load(str(folder))
    return model, tok, [t[i : i + 480] for t in held_out for i in (0, len(t) // 3)]


@pytest.fixture(scope="module")
def data(some_target, tmp_path_factory):
    """(training examples, held-out examples): raw prompts (pieces of held-out texts)
    continued with the command's own batched regenerator; the replies are the target's
    greedy ones, whole."""
    model, tok, texts = some_target
    prompts = [t[i : i + 120] for t in texts for i in (0, len(t) // 2) if t[i : i + 120].strip()]
    path = tmp_path_factory.mktemp("ref") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"text": p}) for p in prompts))
    regen = _regenerator(model, tok, REPLY)
    examples, skipped = read_examples(
        path, tok, seq_len=SEQ_LEN, regenerate=regen, reply_room=REPLY
    )
    assert not skipped and len(examples) >= 24
    for e in examples[::8]:
        want = target_greedy(model, e.tokens[: e.start], REPLY)
        assert e.tokens[e.start :] == want[: len(e.tokens) - e.start], "the target's greedy reply"
    return examples[4:], examples[:4]


def fresh(model):
    cfg = draft_config_for(model, layers=1, block_size=8, mask_token_id=1)
    return init_draft(model, cfg, seed=0), cfg


def plain_optimizer(steps: int, lr: float):
    """AdamW, a 4% linear warm-up, then cosine decay to a tenth: the plain recipe's."""
    warm = max(1, int(0.04 * steps))
    sched = optim.join_schedules(
        [optim.linear_schedule(0.0, lr, warm), optim.cosine_decay(lr, steps - warm, lr / 10)],
        [warm],
    )
    return optim.AdamW(learning_rate=sched, weight_decay=0.01)


def reference_loop(pair, examples, steps, lr=2e-3, gamma=4.0, seed=0):
    """The plain recipe, a few dozen lines (not `dflash_mlx.train.trainer`'s code)."""
    draft, L = pair.draft, pair.draft.config.block_size
    opt = plain_optimizer(steps, lr)
    w = mx.exp(-mx.arange(L - 1) / gamma)

    def loss_fn(draft, feats, labels, block, si, an, valid):
        logits = draft.training_logits(feats, si, an, block, pair.head)
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")
        return (ce * w * valid).sum() / (w * valid).sum()

    grad = nn.value_and_grad(draft, loss_fn)
    for step in range(steps):
        rng = np.random.default_rng((seed, step))  # the command's data order, for less noise
        seqs = [examples[i] for i in rng.choice(len(examples), BATCH, replace=False)]
        toks, si, an = reply_anchors(seqs, rng, ANCHORS)
        labels, block, valid, feats = block_labels(pair, toks, si, an, seqs)
        loss, g = grad(draft, feats, labels, block, si, an, valid)
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt.update(draft, g)
        mx.eval(loss, draft.parameters(), opt.state)


def reply_anchors(seqs, rng, per_seq):
    """Padded tokens and anchors at random reply positions (None: every reply position)."""
    S = max(len(e.tokens) for e in seqs)
    toks = np.zeros((len(seqs), S), np.int32)
    si, an = [], []
    for b, e in enumerate(seqs):
        toks[b, : len(e.tokens)] = e.tokens
        where = np.arange(e.start, len(e.tokens) - 1)
        pick = where if per_seq is None else rng.choice(where, min(per_seq, len(where)), False)
        si += [b] * len(pick)
        an += [int(a) for a in pick]
    return mx.array(toks), mx.array(si, mx.int32), mx.array(an, mx.int32)


def block_labels(pair, toks, si, an, seqs):
    L = pair.draft.config.block_size
    logits, feats = pair.target.forward(toks, None, pair.draft.config.target_layer_ids)
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)  # the target's token at p + 1
    pos = an[:, None] + mx.arange(L - 1)[None]
    lens = mx.array([len(e.tokens) for e in seqs])[si]
    labels = greedy[si[:, None], mx.minimum(pos, toks.shape[1] - 1)]
    block = mx.full((an.size, L), pair.draft.config.mask_token_id, mx.int32)
    block[:, 0] = toks[si, an]
    return labels, block, pos + 1 < lens[:, None], mx.stop_gradient(feats)


def held_out_loss(pair, held, gamma=4.0) -> float:
    toks, si, an = reply_anchors(held, None, None)
    labels, block, valid, feats = block_labels(pair, toks, si, an, held)
    logits = pair.draft.training_logits(feats, si, an, block, pair.head)
    w = mx.exp(-mx.arange(pair.draft.config.block_size - 1) / gamma) * valid
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    return ((ce * w).sum() / w.sum()).item()


@pytest.mark.slow  # trains the same draft twice on each target (~80 s here on the demo's)
def test_the_defaults_train_as_well_as_the_reference_loop(some_target, data, tmp_path):
    """Same steps, same seed, the same data order: the command's held-out loss within 2% of
    the reference loop's (they agree to 1e-5 when the command runs the recipe; with anchors
    drawn in the prompt too it came out 3% worse)."""
    model, tok, _ = some_target
    train_set, held = data
    start = held_out_loss(fresh(model)[0], held)
    command, cfg = fresh(model)
    settings = TrainSettings(
        steps=STEPS, batch=BATCH, anchors_per_seq=ANCHORS, seq_len=SEQ_LEN,
        eval_every=10**6, save_every=10**6,
    )  # fmt: skip
    train(command, tok, cfg, train_set, settings, tmp_path / "d")
    reference, _ = fresh(model)
    reference_loop(reference, train_set, STEPS)
    mine, theirs = held_out_loss(command, held), held_out_loss(reference, held)
    assert theirs < 0.8 * start, ("the reference loop learns", start, theirs)
    assert mine <= 1.02 * theirs, f"held-out loss: command {mine:.3f}, reference {theirs:.3f}"


def test_grouped_blocks_give_exactly_the_drafts_training_logits(target):
    """The training step's faster layout (a sequence's blocks share its context) computes the
    logits `DFlashDraft.training_logits` does, sliding and causal layers included."""
    from dflash_mlx.train.blocks import grouped_blocks, grouped_logits

    model, tok = target
    for extra in (
        {},
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6},
    ):
        cfg = draft_config_for(model, layers=2, block_size=8, mask_token_id=1)
        cfg.update(extra)
        pair = init_draft(model, cfg)
        rows = [tok.encode(c)[: 20 + 6 * i] for i, c in enumerate(CORPUS[:3])]
        S = max(map(len, rows))
        toks = mx.array([r + [0] * (S - len(r)) for r in rows])
        feats, _ = block_targets(pair, toks)
        si = np.array([0, 0, 0, 1, 2, 2, 2, 2], np.int32)
        an = np.array([0, 5, 14, 19, 1, 7, 11, 25], np.int32)
        block = mx.full((len(an), 8), 1, dtype=mx.int32)
        block[:, 0] = toks[mx.array(si), mx.array(an)]
        want = pair.draft.training_logits(feats, mx.array(si), mx.array(an), block, pair.head)
        m, slot = grouped_blocks(si, 3)
        anchors = np.zeros(3 * m, np.int32)
        anchors[slot] = an
        padded = mx.full((3 * m, 8), 1, dtype=mx.int32)
        padded[mx.array(slot)] = block
        got = grouped_logits(pair.draft, feats, mx.array(anchors), padded, pair.head, m)
        assert mx.allclose(got[mx.array(slot)], want, atol=1e-4).item(), extra
        # only the slots that hold a block, taken before the LM head
        some = grouped_logits(
            pair.draft, feats, mx.array(anchors), padded, pair.head, m, mx.array(slot)
        )
        assert some.shape == want.shape and mx.allclose(some, want, atol=1e-4).item(), extra


def test_the_steps_exp_silu_and_cross_entropy_are_mlxs_values_and_gradients():
    """`blocks.exp` (2**(x log2 e), faster on a CPU) and what is built on it give MLX's
    exp, SiLU and cross-entropy and their gradients, masked (-inf) entries included."""
    from dflash_mlx.train.blocks import cross_entropy, exp, silu

    x = mx.random.normal((64, 300), key=mx.random.key(0)) * 8
    x = mx.where(mx.random.uniform(shape=x.shape, key=mx.random.key(1)) < 0.2, -mx.inf, x)
    assert mx.allclose(exp(x), mx.exp(x), rtol=2e-6, atol=0).item()
    assert (exp(x) == 0).sum().item() == (x == -mx.inf).sum().item() > 0
    y = mx.random.normal((64, 300), key=mx.random.key(2)) * 30
    assert mx.allclose(silu(y), nn.silu(y), rtol=1e-5, atol=1e-6).item()
    dy = mx.grad(lambda a: silu(a).sum())(y)
    assert mx.allclose(dy, mx.grad(lambda a: nn.silu(a).sum())(y), rtol=1e-5, atol=1e-6).item()
    logits = mx.random.normal((9, 7, 513), key=mx.random.key(3)) * 6
    labels = mx.random.randint(0, 513, (9, 7), key=mx.random.key(4))
    w = mx.random.uniform(shape=(9, 7), key=mx.random.key(5))

    def ours(a):
        return (cross_entropy(a, labels) * w).sum()

    def mlx(a):
        return (nn.losses.cross_entropy(a, labels, reduction="none") * w).sum()

    assert mx.allclose(cross_entropy(logits, labels),
                       nn.losses.cross_entropy(logits, labels, reduction="none"),
                       rtol=1e-5).item()  # fmt: skip
    assert mx.allclose(mx.grad(ours)(logits), mx.grad(mlx)(logits), atol=1e-6).item()


def test_the_fast_step_gives_the_fused_paths_loss_and_gradients(target):
    """`block_loss` through the grouped layout (shared context, the faster exp, only the
    slots that hold a block) gives the loss and gradients of the draft's own
    `training_logits`, with sequences of unequal lengths and anchor counts."""
    from mlx.utils import tree_flatten

    from dflash_mlx.train.blocks import grouped_blocks
    from dflash_mlx.train.trainer import block_loss

    model, tok = target
    pair = init_draft(model, draft_config_for(model, layers=2, block_size=8, mask_token_id=1))
    text = tok.encode(" ".join(CORPUS))
    rows = [text[60 * i : 60 * i + 30 + 7 * i] for i in range(3)]  # 30, 37, 44 tokens
    S = max(map(len, rows))
    assert S == 44
    toks = mx.array([r + [0] * (S - len(r)) for r in rows])
    lengths = mx.array([len(r) for r in rows])
    feats, nxt = block_targets(pair, toks)
    for si, an in (
        ([0, 0, 1, 2, 2, 2], [3, 20, 9, 1, 17, 40]),  # a sequence with more blocks than others
        ([0, 0, 1, 1, 2, 2], [3, 20, 9, 33, 17, 40]),  # as many each: every slot a block
    ):
        si, an = np.array(si, np.int32), np.array(an, np.int32)
        m, slot = grouped_blocks(si, 3)
        args = (pair, feats, nxt, toks, mx.array(si), mx.array(an), lengths, 4.0)
        vg = nn.value_and_grad(pair.draft, block_loss)
        loss_fast, g_fast = vg(*args, (m, mx.array(slot)))
        loss_fused, g_fused = vg(*args, None)
        assert abs(loss_fast.item() - loss_fused.item()) < 1e-5 * abs(loss_fused.item())
        fused = dict(tree_flatten(g_fused))
        for k, v in tree_flatten(g_fast):
            assert mx.allclose(v, fused[k], rtol=1e-3, atol=1e-5).item(), k
