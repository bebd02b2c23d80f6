"""Draft context feeding (SPEC 2.3) and the target rewind helper (SPEC 5.3)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dflash_mlx import Pair, load
from dflash_mlx.engine import batch_cache
from dflash_mlx.models.config import DraftConfig, default_target_layer_ids
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.models.target import TargetAdapter

from .conftest import draft_config


def block_logits_after(draft: DFlashDraft, feats: mx.array, chunks: list[int], head) -> mx.array:
    st = draft.make_state(head=head)
    start = 0
    for n in chunks:
        draft.add_context(feats[:, start : start + n], st)
        start += n
    assert st.context_length == feats.shape[1]
    return draft.block_logits(mx.array([5]), draft.config.block_size, None, st)


def test_incremental_context_equals_whole_context(target, draft):
    model, _ = target
    head = Pair(model, draft).head
    mx.random.seed(0)
    feats = mx.random.normal((1, 300, 2 * 64))  # crosses the cache's 256-row growth step
    whole = block_logits_after(draft, feats, [300], head)
    pieces = block_logits_after(draft, feats, [1, 7, 250, 3, 39], head)
    assert mx.allclose(whole, pieces, atol=1e-4).item(), "context cache drifted"


def test_block_sees_context_and_position(target, draft):
    """Logits must depend on the context (KV injection) and on the block's position."""
    model, _ = target
    head = Pair(model, draft).head
    mx.random.seed(1)
    feats = mx.random.normal((1, 20, 2 * 64))
    a = block_logits_after(draft, feats, [20], head)
    b = block_logits_after(draft, feats * 2.0 + 1.0, [20], head)
    c = block_logits_after(draft, feats[:, :19], [19], head)
    assert not mx.allclose(a, b, atol=1e-3).item()
    assert not mx.allclose(a, c, atol=1e-3).item()
    assert a.shape == (draft.config.block_size - 1, draft.config.vocab_size)


def test_skipped_positions_keep_true_rope_distances(target, draft):
    """A context may start anywhere and have gaps (positions decoded without features):
    only distances matter, so a shifted context drafts the same block, a gap does not."""
    model, _ = target
    head = Pair(model, draft).head
    mx.random.seed(3)
    feats = mx.random.normal((1, 12, 2 * 64))
    block = draft.config.block_size
    plain = block_logits_after(draft, feats, [12], head)
    st = draft.make_state(head=head, base=40)
    draft.add_context(feats, st)
    assert st.context_end == 52
    shifted = draft.block_logits(mx.array([5]), block, None, st)
    assert mx.allclose(plain, shifted, atol=1e-4).item()
    st = draft.make_state(head=head)
    draft.add_context(feats[:, :5], st)
    st.skip_to(9)  # positions 5..8 decoded without capturing features
    draft.add_context(feats[:, 5:], st)
    assert st.context_end == 16 and st.gaps == [(5, 4)]
    gapped = draft.block_logits(mx.array([5]), block, None, st)
    assert not mx.allclose(plain, gapped, atol=1e-3).item(), "the gap was ignored"
    # The same rows, each placed at its position one by one, draft the same block.
    st = draft.make_state(head=head)
    for i in range(12):
        st.skip_to(i + (4 if i >= 5 else 0))
        draft.add_context(feats[:, i : i + 1], st)
    one_by_one = draft.block_logits(mx.array([5]), block, None, st)
    assert mx.allclose(gapped, one_by_one, atol=1e-4).item()


def test_trimming_a_gapped_context_to_a_position(target, draft):
    model, _ = target
    head = Pair(model, draft).head
    feats = mx.zeros((1, 10, 2 * 64))

    def build():
        st = draft.make_state(head=head, base=100)
        draft.add_context(feats[:, :4], st)  # 100..103
        st.skip_to(110)  # 104..109 skipped
        draft.add_context(feats[:, 4:], st)  # 110..115
        assert st.context_end == 116
        return st

    st = build()
    st.trim_to(113)  # drops rows 113..115
    assert (st.context_length, st.gaps, st.context_end) == (7, [(4, 6)], 113)
    st = build()
    st.trim_to(107)  # into the gap: all rows after it go, the gap shrinks
    assert (st.context_length, st.gaps, st.context_end) == (4, [(4, 3)], 107)
    st = build()
    st.trim_to(102)
    assert (st.context_length, st.gaps, st.context_end) == (2, [], 102)
    st = build()
    st.trim_to(50)  # before the context's start: an empty context from there
    assert (st.context_length, st.gaps, st.context_end) == (0, [], 50)
    st = build()
    st.trim_to(120)  # beyond its end: the missing positions become a gap
    assert (st.context_length, st.gaps, st.context_end) == (10, [(4, 6), (10, 4)], 120)
    with pytest.raises(ValueError, match="cannot skip back"):
        st.skip_to(119)


def test_causal_sliding_layer_masks_future_block_rows(target):
    model, _ = target
    cfg = draft_config(4, [1, 2], block=8, layers=1)
    cfg.update(layer_types=["sliding_attention"], sliding_window=4)
    d = DFlashDraft(DraftConfig.from_dict(cfg))
    head = Pair(model, d).head
    assert d.layers[0].self_attn.causal and d.layers[0].self_attn.window == 4
    mx.random.seed(2)
    st = d.make_state(head=head)
    d.add_context(mx.random.normal((1, 10, 128)), st)
    # With a causal block, row 1's output cannot depend on the tokens after it.
    h1 = d.hidden(mx.array([[5, 1, 1, 1, 1, 1, 1, 1]]), st)
    h2 = d.hidden(mx.array([[5, 1, 9, 9, 9, 9, 9, 9]]), st)
    assert mx.allclose(h1[:, :2], h2[:, :2], atol=1e-5).item()
    assert not mx.allclose(h1[:, 2:], h2[:, 2:], atol=1e-3).item()


def test_default_target_layer_ids_follow_the_published_rule():
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    cfg = draft_config(36, None, layers=5)
    assert DraftConfig.from_dict(cfg).target_layer_ids == [1, 9, 17, 25, 33]


def test_block_size_read_from_top_level_or_dflash_config():
    cfg = draft_config(4, [1])
    cfg["block_size"] = cfg["dflash_config"].pop("block_size")
    assert DraftConfig.from_dict(cfg).block_size == 16


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
@pytest.mark.parametrize("keep", [1, 3, 5])
def test_rewind_then_regenerate_equals_a_clean_run(models_dir, name, keep):
    model, _ = load(str(models_dir / name))
    t = TargetAdapter(model)
    seq = mx.array([[7, 8, 9, 10, 11, 12, 40, 41, 42, 43, 44]])
    clean = t.make_cache()
    ref, ref_feats = t.forward(seq, clean, [1, 2])

    cache = t.make_cache()
    t.forward(seq[:, :5], cache, None)
    saved = t.snapshot(cache)
    junk = mx.array([[99, 98, 97, 96, 95, 94]])
    t.forward(mx.concatenate([seq[:, 5 : 5 + keep], junk[:, : 6 - keep]], axis=1), cache, None)
    batch_cache.keep(t, cache, [keep], 6, (saved, t.recorded_calls()))
    out, feats = t.forward(seq[:, 5 + keep :], cache, [1, 2])
    assert mx.allclose(out, ref[:, 5 + keep :], atol=1e-4).item(), f"{name}: state after rewind"
    assert mx.allclose(feats, ref_feats[:, 5 + keep :], atol=1e-4).item()


def test_capture_does_not_change_plain_mlx_lm_decoding(models_dir):
    model, _ = load(str(models_dir / "qwen3"))
    x = mx.array([[3, 4, 5, 6]])
    before = model(x)
    TargetAdapter(model)
    after = model(x)
    assert mx.array_equal(before, after).item()


def test_two_adapters_of_one_model_each_see_their_own_pass(models_dir):
    """No recorder is shared through the model: a pass of one adapter (one Pair) records
    nothing into another adapter of the same model, and each captures its own features."""
    model, _ = load(str(models_dir / "qwen35"))
    a, b = TargetAdapter(model), TargetAdapter(model)
    ca, cb = a.make_cache(), b.make_cache()
    assert a.replay_ids and a.replay_ids == b.replay_ids
    _, fa = a.forward(mx.array([[3, 4, 5]]), ca, [1])
    calls_a = a.recorded_calls()
    _, fb = b.forward(mx.array([[7, 8]]), cb, [1, 2])
    assert a.recorded_calls().keys() == calls_a.keys()
    assert all(x.shape[1] == 3 for x, _, _ in a.recorded_calls().values()), "b's pass leaked"
    assert all(x.shape[1] == 2 for x, _, _ in b.recorded_calls().values())
    assert fa.shape[1] == 3 and fb.shape[1] == 2 and fb.shape[-1] == 2 * fa.shape[-1]
    assert not any(k.startswith("_dflash") for k in vars(model)), "state stashed on the model"


def test_a_cache_that_can_be_neither_trimmed_nor_replayed_is_refused(models_dir, monkeypatch):
    from mlx_lm.models.cache import KVCache, _BaseCache

    class SealedCache(_BaseCache):
        """Stands for any cache without trim() or replayable state."""

    model, tok = load(str(models_dir / "qwen3"))
    monkeypatch.setattr(
        model, "make_cache", lambda: [KVCache(), SealedCache(), KVCache(), KVCache()], raising=False
    )
    with pytest.raises(ValueError, match=r"layer 1 uses SealedCache, which can be neither"):
        TargetAdapter(model).make_cache()


def test_binding_does_not_adopt_the_targets_weights(target, draft):
    from mlx.utils import tree_flatten

    model, _ = target
    before = {k for k, _ in tree_flatten(draft.parameters())}
    attrs = set(vars(draft))
    Pair(model, draft)
    after = {k for k, _ in tree_flatten(draft.parameters())}
    assert before == after and not any("embed" in k or "lm_head" in k for k in after)
    assert set(vars(draft)) == attrs, "pairing changed the draft"


def test_the_draft_holds_weights_only_and_never_samples(target, draft):
    """Request state lives in a DraftState; a loaded draft has none, and no sampling."""
    import dflash_mlx.models.draft as draft_module

    model, _ = target
    head = Pair(model, draft).head
    assert not hasattr(draft_module, "sample") and not hasattr(draft_module, "probabilities")
    assert not any(hasattr(draft, name) for name in ("propose", "_caches", "gaps", "reset"))
    before = {k: v for k, v in vars(draft).items() if not k.startswith("_")}
    a, b = draft.make_state(head=head), draft.make_state(head=head)
    draft.add_context(mx.ones((1, 3, 2 * 64)), a)
    assert (a.context_length, b.context_length) == (3, 0), "states are independent"
    assert {k: v for k, v in vars(draft).items() if not k.startswith("_")}.keys() == before.keys()


# -- the draft window (draft_window / --draft-window) ---------------------------------------


def test_a_windowed_draft_drafts_as_if_given_only_its_window(target, draft):
    """A block under window N sees its anchor and the last N - 1 context rows, at their true
    distances, also after old rows were dropped (and across a gap): as a fresh context of
    just those rows placed at their positions would."""
    from dflash_mlx.models.draft import FORGET_SLACK

    model, _ = target
    head = Pair(model, draft).head
    mx.random.seed(4)
    window = 24
    n = 295  # chunks of 38 reach 290 rows: past window - 1 + FORGET_SLACK; then 5 more
    assert 252 <= window - 1 + FORGET_SLACK < 290
    feats = mx.random.normal((1, n, 2 * 64))
    block = draft.config.block_size
    st = draft.make_state(head=head, window=window)
    draft.add_context(feats[:, :100], st)
    st.skip_to(130)  # positions 100..129 without features
    for i in range(100, n - 5, 38):  # in cycles' worth of rows, the last one drops rows
        draft.add_context(feats[:, i : min(i + 38, n - 5)], st)
    assert st.base > 0 and st.context_length == window - 1, "no row was dropped"
    draft.add_context(feats[:, n - 5 :], st)  # the window now straddles the drop
    assert st.context_end == n + 30
    windowed = draft.block_logits(mx.array([5]), block, None, st)
    only = draft.make_state(head=head, base=n + 30 - (window - 1))
    draft.add_context(feats[:, n - (window - 1) :], only)
    alone = draft.block_logits(mx.array([5]), block, None, only)
    assert mx.allclose(windowed, alone, atol=1e-4).item(), "the window saw other rows"
    unlimited = draft.make_state(head=head)
    draft.add_context(feats, unlimited)
    whole = draft.block_logits(mx.array([5]), block, None, unlimited)
    assert not mx.allclose(windowed, whole, atol=1e-3).item(), "the window was ignored"


def test_the_window_defaults_to_the_checkpoints_sliding_window(target, tmp_path):
    from .conftest import build_draft

    cfg = draft_config(4, [1, 2])
    cfg.update(layer_types=["sliding_attention", "sliding_attention"], sliding_window=8)
    from dflash_mlx import load_draft

    sliding = load_draft(build_draft(tmp_path / "s", cfg, seed=0))
    assert sliding.make_state().keep == 7  # its own window bounds what is cached
    assert sliding.make_state(window=32).windows == [8, 8]  # a wider request: still 8
    assert sliding.make_state(window=4).windows == [4, 4]
    cfg.update(layer_types=["sliding_attention", "full_attention"])
    mixed = load_draft(build_draft(tmp_path / "m", cfg, seed=0))
    assert mixed.make_state().keep is None  # a full layer reads everything: nothing dropped
    assert mixed.make_state(window=16).windows == [8, 16]


# -- the attention sink (draft_sink / --draft-sink) -------------------------------------------


@pytest.mark.parametrize("sink", [1, 4])
def test_a_sink_and_window_draft_as_if_given_only_those_rows(target, draft, sink):
    """Under sink S and window N a block sees the context's first S rows and its last N - 1,
    at their true positions, also after the rows between were dropped (and across a gap):
    as a fresh context holding just those rows, with the rest a gap, would."""
    from dflash_mlx.models.draft import FORGET_SLACK

    model, _ = target
    head = Pair(model, draft).head
    mx.random.seed(5)
    window, n = 24, 295
    feats = mx.random.normal((1, n, 2 * 64))
    block = draft.config.block_size
    st = draft.make_state(head=head, window=window, sink=sink)
    draft.add_context(feats[:, :100], st)
    st.skip_to(130)  # positions 100..129 without features
    for i in range(100, n - 5, 38):
        draft.add_context(feats[:, i : min(i + 38, n - 5)], st)
    assert st.context_length == sink + window - 1, "the rows between were not dropped"
    assert st.base == 0 and st.gaps[0][0] == sink, "the sink's rows were dropped"
    draft.add_context(feats[:, n - 5 :], st)
    assert st.context_end == n + 30 and st.context_length <= sink + window - 1 + FORGET_SLACK
    windowed = draft.block_logits(mx.array([5]), block, None, st)
    only = draft.make_state(head=head)
    draft.add_context(feats[:, :sink], only)
    only.skip_to(n + 30 - (window - 1))
    draft.add_context(feats[:, n - (window - 1) :], only)
    alone = draft.block_logits(mx.array([5]), block, None, only)
    assert mx.allclose(windowed, alone, atol=1e-4).item(), "the block saw other rows"
    no_sink = draft.make_state(head=head, window=window)
    draft.add_context(feats, no_sink)
    plain_window = draft.block_logits(mx.array([5]), block, None, no_sink)
    assert not mx.allclose(windowed, plain_window, atol=1e-3).item(), "the sink was ignored"


def test_a_sink_is_kept_through_trims_and_only_under_a_window(target, draft):
    model, _ = target
    head = Pair(model, draft).head
    feats = mx.random.normal((1, 700, 2 * 64))
    st = draft.make_state(head=head, window=16, sink=3)
    draft.add_context(feats[:, :600], st)
    assert st.context_length == 3 + 15 and st.gaps == [(3, 600 - 18)]
    st.trim_to(590)  # a rejected draft's rows go; the sink and the hole stay
    assert st.context_end == 590 and st.gaps == [(3, 582)] and st.context_length == 8
    draft.add_context(feats[:, 590:700], st)
    assert st.context_end == 700 and st.base == 0
    assert draft.make_state(head=head, sink=3).sink == 0, "a sink without a window"
    assert draft.make_state(head=head, window=16).sink == 0, "the test draft declares none"


def test_the_draft_config_declares_its_training_context_and_sink(target, tmp_path):
    from dflash_mlx import load_draft

    from .conftest import build_draft

    cfg = draft_config(4, [1, 2])
    cfg["dflash_config"].update(training_context=64, context_sink=4)
    d = load_draft(build_draft(tmp_path / "t", cfg, seed=0))
    assert (d.config.training_context, d.config.context_sink) == (64, 4)
    st = d.make_state()
    assert (st.windows, st.keep, st.sink) == ([64, 64], 63, 4), "not the default policy"
    st = d.make_state(window=256, sink=0)  # the request's own: wider, no sink
    assert (st.windows, st.sink) == ([256, 256], 0)
    for field, bad in [("training_context", 1), ("training_context", "8"), ("context_sink", -1)]:
        cfg = draft_config(4, [1, 2])
        cfg["dflash_config"][field] = bad
        with pytest.raises(ValueError, match=f"{field} {bad!r}"):
            DraftConfig.from_dict(cfg)
