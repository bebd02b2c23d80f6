"""The engine's seams: one Pair per pairing, one GenerateOptions, one Stats value."""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest

import dflash_mlx
from dflash_mlx import GenerateOptions, Pair, Stats, generate, load, stream_generate
from dflash_mlx.errors import BadArgument

from .test_decode import PROMPTS, target_greedy


def test_one_draft_with_two_targets_is_two_pairs_and_both_work(models_dir, draft):
    """The draft is never rebound: each Pair carries its own view of its target, so
    requests of the two pairs interleaved stay lossless for their own target."""
    a_model, tok = load(str(models_dir / "qwen3"))
    b_model, _ = load(str(models_dir / "qwen3-4bit"))  # other weights, same shapes
    ids = tok.encode(PROMPTS[0])
    ref_a, ref_b = target_greedy(a_model, ids, 24), target_greedy(b_model, ids, 24)
    assert ref_a != ref_b, "the two targets must differ for this test to mean anything"
    a, b = Pair(a_model, draft), Pair(b_model, draft)
    assert a.head is not b.head
    streams = [stream_generate(p, tok, ids, verify_width=4, max_tokens=24) for p in (a, b)]
    got = [[], []]
    for ra, rb in zip(*streams):  # one cycle of each in turn
        got[0] += ra.tokens
        got[1] += rb.tokens
    for s in streams:
        got[streams.index(s)] += [t for r in s for t in r.tokens]
    assert got == [ref_a, ref_b]
    # Drafts are lossless whatever they propose: check the proposals themselves. Each pair's
    # draft state drafts through its own target's embedding and head, whichever came last.
    feats = mx.random.normal((1, 5, 2 * 64), key=mx.random.key(0))

    def block(p):
        st = p.draft_state()
        draft.add_context(feats, st)
        return draft.block_logits(mx.array([5]), draft.config.block_size, None, st)

    la, lb = block(a), block(b)
    assert not mx.allclose(la, lb, atol=1e-4).item(), "both pairs drafted through one target"
    assert mx.allclose(la, block(Pair(a_model, draft)), atol=1e-5).item()
    assert not any(k.startswith("_dflash") for k in vars(draft)), "state stashed on the draft"
    assert not any(k.startswith("_dflash") for k in vars(a_model)), "state stashed on the model"


def test_a_pair_refuses_a_draft_built_for_another_target(models_dir):
    from .conftest import build_draft, draft_config

    model, _ = load(str(models_dir / "qwen3"))
    build_draft(models_dir / "wide-draft", draft_config(4, [1, 2], hidden=96), seed=5)
    other = dflash_mlx.load_draft(str(models_dir / "wide-draft"))
    with pytest.raises(dflash_mlx.LoadError, match="hidden size: draft 96, target 64"):
        Pair(model, other)


def test_a_pair_carries_its_policies_and_another_pair_starts_fresh(target, draft):
    model, tok = target
    ids = tok.encode(PROMPTS[1])
    pair = Pair(model, draft)
    generate(pair, tok, ids, max_tokens=12)
    policy = pair.policies[None]
    generate(pair, tok, ids, max_tokens=12)
    assert pair.policies[None] is policy, "the next request did not get what the first learnt"
    assert Pair(model, draft).policies == {}
    pair.forget()
    assert pair.policies == {}


def test_options_are_validated_once_naming_the_field():
    for kwargs, field in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"seed": "7"}, "seed"),
        ({"verify_width": 0}, "verify_width"),
        ({"draft_block": 1}, "draft_block"),
        ({"draft_window": 1}, "draft_window"),
        ({"stop": (1,)}, "stop"),
        ({"prefill_step": 0}, "prefill_step"),
    ]:
        with pytest.raises(BadArgument, match=rf"^{field} "):
            GenerateOptions(**kwargs)
    with pytest.raises(BadArgument, match="unknown generation option 'temp'"):
        GenerateOptions.from_kwargs(temp=0.5)
    opts = GenerateOptions.from_kwargs(stop="END", temperature=1)
    assert opts.stop == ("END",) and opts.replace(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(BadArgument, match="tuple of strings"):
        GenerateOptions(stop="END")
    with pytest.raises(AttributeError):
        opts.max_tokens = 3  # frozen: carried unchanged to the decode loop
    assert opts.replace(max_tokens=3).max_tokens == 3 and opts.max_tokens == 256


def test_block_size_is_a_deprecated_alias_of_verify_width(target, draft):
    model, tok = target
    with pytest.warns(DeprecationWarning, match="verify_width"):
        old = generate(model, draft, tok, "def", max_tokens=8, block_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = generate(Pair(model, draft), tok, "def", max_tokens=8, verify_width=4)
    assert old.tokens == new.tokens and new.verify_width == 4
    with pytest.warns(DeprecationWarning):
        assert old.block_size == 4
    with pytest.warns(DeprecationWarning):
        assert GenerateOptions.from_kwargs(block_size=3).verify_width == 3
    with pytest.raises(BadArgument, match="disagree"), pytest.warns(DeprecationWarning):
        GenerateOptions.from_kwargs(block_size=3, verify_width=4)
    with pytest.warns(DeprecationWarning, match="Pair"):
        assert isinstance(dflash_mlx.models.loading.bind_draft(draft, model), Pair)
    with pytest.warns(DeprecationWarning, match="Stats"):
        from dflash_mlx.engine.generate import DecodeStats
    assert DecodeStats is Stats


def test_the_response_says_which_stop_string_ended_it(target, draft):
    model, tok = target
    ids = tok.encode(PROMPTS[0])
    full = generate(Pair(model, draft), tok, ids, max_tokens=30, verify_width=4)
    assert len(full.text) > 6 and full.stop is None
    stop = full.text[3:6]
    cut = generate(model, draft, tok, ids, max_tokens=30, verify_width=4, stop=["zzz", stop])
    assert cut.finish_reason == "stop" and cut.stop == stop
    assert cut.text == full.text[: full.text.index(stop)]


def test_stats_are_one_value_snapshotted_per_response_and_merged(target, draft):
    model, tok = target
    ids = tok.encode(PROMPTS[2])
    responses = list(stream_generate(Pair(model, draft), tok, ids, max_tokens=20, verify_width=4))
    gen = [r.stats.generation_tokens for r in responses]
    assert gen == sorted(gen) and len(set(gen)) == len(gen), "responses share one mutable stats"
    last = responses[-1].stats
    assert last.generation_tokens == sum(len(r.tokens) for r in responses) == 20
    # "Drafted" is W - 1 per verify pass (near max_tokens a pass is narrower).
    assert last.drafted == sum((w - 1) * c for w, (c, _) in last.widths.items()) > 0
    assert last.tau == last.committed / last.cycles
    both = last.merge(last)
    assert (both.requests, both.cycles, both.drafted) == (2, 2 * last.cycles, 2 * last.drafted)
    assert both.tau == pytest.approx(last.tau)
    assert both.generation_tps == pytest.approx(last.generation_tps)
    assert Stats.total([last, last]).to_dict() == both.to_dict()
    assert Stats.total([]).requests == 0


def test_old_names_still_work_with_a_deprecation_warning(target, draft):
    import importlib

    from dflash_mlx.server import Engine

    model, tok = target
    with pytest.warns(DeprecationWarning, match="Engine"):
        engine = Engine(model, draft, tok, block_size=4, draft_window=32, warm_up=False)
    assert isinstance(engine.pair, Pair) and engine.pair.draft is draft
    assert (engine.options.verify_width, engine.options.draft_window) == (4, 32)
    with pytest.warns(DeprecationWarning, match="context_limit"):
        assert dflash_mlx.server.context_length(model) == Pair(model).context_limit
    with pytest.warns(DeprecationWarning, match="Pair"):
        assert dflash_mlx.models.target.TargetAdapter.of(model).model is model
    chat = importlib.import_module("dflash_mlx.chat.session")
    with pytest.warns(DeprecationWarning, match="GenerateOptions"):
        settings = chat.ChatSettings(temperature=0.5, block_size=4)
    assert (settings.temperature, settings.verify_width, settings.max_tokens) == (0.5, 4, 2048)
    for name in ("ReplyStats", "SessionTotals"):
        with pytest.warns(DeprecationWarning, match="Stats"):
            assert getattr(chat, name) is Stats


def test_the_old_calibration_call_still_works_with_a_deprecation_warning(target, draft):
    from dflash_mlx import calibration as calibrate

    model, _ = target
    with pytest.warns(DeprecationWarning, match="costs"):
        assert calibrate.load_or_measure(model, draft) == Pair(model, draft).costs()


def test_a_fixed_width_drafts_the_positions_it_verifies(target, draft, monkeypatch):
    """`verify_width=W` (a DFlash 1 draft) drafts W positions a cycle, as z-lab's reference
    drafts its `block_size`, not the trained block's (rows never verified, a dearer draft
    pass); `draft_block` still asks for more; the tokens are the target's either way."""
    model, tok = target
    ids = tok.encode(PROMPTS[0])
    block = draft.config.block_size
    assert block > 4
    lengths: list[int] = []
    real = type(draft).block_logits

    def spy(self, anchor, length, rows, state):
        lengths.append(length)
        return real(self, anchor, length, rows, state)

    monkeypatch.setattr(type(draft), "block_logits", spy)
    pair = Pair(model, draft)
    assert pair.plan(GenerateOptions(verify_width=4))[:2] == (4, 4)
    assert pair.plan(GenerateOptions(verify_width=4, draft_block=block))[:2] == (4, block)
    assert pair.plan(GenerateOptions(verify_width=1))[:2] == (1, block)
    ref = target_greedy(model, ids, 24)
    for opts, drafted in (
        (GenerateOptions(max_tokens=24, verify_width=4), 4),
        (GenerateOptions(max_tokens=24, verify_width=4, draft_block=block), block),
    ):
        lengths.clear()
        assert generate(pair, tok, ids, opts).tokens == ref
        assert lengths and set(lengths) == {drafted}, lengths
