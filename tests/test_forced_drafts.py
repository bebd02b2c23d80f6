"""What a grammar forces is a free draft (issue 38, SPEC 6).

Under a grammar the tokens it forces (llguidance's fast-forward tokens) are carried in the
block without drafting them, a point mass when sampling, and a forced run may go past the
verify width. The output stays the constrained target's own: greedy, token for token
against the target alone one token at a time with the mask applied (`test_controls.
reference`); sampled, the processed law over the first positions (a chi-square on a table
grammar whose forced tokens are sometimes certain and sometimes not), alone and in a batch
of mixed rows. A broken engine that commits forced tokens as certain where the grammar
still allows others must fail that test.
"""

from __future__ import annotations

import ctypes
import importlib
import json

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx.engine.batch as batch
import dflash_mlx.engine.controls as controls
from dflash_mlx import GenerateOptions, Pair, batch_generate, generate
from dflash_mlx.engine.batch import BatchDecoder

from .test_controls import SCHEMA, exact_joint, reference, rejects, valid
from .test_decode import ScriptedDraft
from .test_sampling import PROMPT, V, numpy_target_probs

# -- greedy: forced runs come free, the output is the target's ---------------------------------


def wrong_everywhere(draft, ids, want):
    """A draft whose every proposal is wrong: whatever is accepted, the grammar forced."""
    return ScriptedDraft(draft, ids + want, right=lambda c: -1)


def masked_drafts(monkeypatch, mask_drafts: bool) -> None:
    compile_grammar = controls.compile_grammar
    monkeypatch.setattr(
        importlib.import_module("dflash_mlx.engine.batch"),
        "compile_grammar",
        lambda *a: compile_grammar(*a, mask_drafts=mask_drafts),
    )


@pytest.mark.parametrize("mask_drafts", [True, False])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_forced_runs_are_accepted_from_a_draft_wrong_everywhere(
    target, draft, width, mask_drafts, monkeypatch
):
    model, tok = target
    ids = tok.encode("Reply in JSON:")
    o = GenerateOptions(max_tokens=120, json_schema=SCHEMA)
    want, _ = reference(model, tok, ids, o, 120)
    masked_drafts(monkeypatch, mask_drafts)
    scripted = wrong_everywhere(draft, ids, want)
    cycles = []
    pair = Pair(model, scripted)
    for r in importlib.import_module("dflash_mlx").stream_generate(
        pair, tok, ids, o.replace(verify_width=width)
    ):
        cycles.append(r)
    tokens = [t for r in cycles for t in r.tokens]
    assert tokens == want, (width, mask_drafts)
    assert valid(json.loads("".join(r.text for r in cycles)))
    # Keys, quotes, separators and brackets are forced: accepted with certainty, though
    # every drafted token was wrong.
    accepted = sum(r.accepted for r in cycles)
    forced = forced_positions(tok, o, model, want)
    speculative = [r for r in cycles if r.width]
    assert accepted >= forced - len(speculative), (accepted, forced)
    assert accepted >= 0.25 * len(want)
    # A forced run goes past the width (W = 8 ends on the free `name` string's runs).
    if width < 8:
        assert max(r.width for r in speculative) > width
    # ... and a block the grammar forces whole runs no draft pass (a plain cycle, W = 1,
    # verifies the run the grammar forces and never drafts).
    assert scripted.calls < len(speculative)
    if width == 1:
        assert scripted.calls == 0


def forced_positions(tok, o, model, tokens) -> int:
    """How many of `tokens` the grammar allowed alone (the mask a single token)."""
    vocab = model(mx.array([[0]])).shape[-1]
    g = controls.compile_grammar(o, tok, vocab)
    n = 0
    for t in tokens:
        n += int(g.allowed(g.mask()).sum()) == 1
        if t in g.eos:
            break
        g.consume([t])
    return n


def test_the_forced_count_is_not_vacuous(target):
    """The schema's reply is mostly structure: the greedy test above counts real forcing."""
    model, tok = target
    ids = tok.encode("Reply in JSON:")
    o = GenerateOptions(max_tokens=120, json_schema=SCHEMA)
    want, _ = reference(model, tok, ids, o, 120)
    assert forced_positions(tok, o, model, want) >= 10


def test_without_forced_runs_the_wrong_draft_gets_nothing(target, draft, monkeypatch):
    """The broken engine (no forced runs): free proposals under a grammar, all wrong, are
    all rejected, so the check above has power."""
    model, tok = target
    ids = tok.encode("Reply in JSON:")
    o = GenerateOptions(max_tokens=120, json_schema=SCHEMA, verify_width=4)
    want, _ = reference(model, tok, ids, o, 120)
    masked_drafts(monkeypatch, False)
    monkeypatch.setattr(controls.Grammar, "forced", lambda self: [])
    out = generate(Pair(model, wrong_everywhere(draft, ids, want)), tok, ids, o)
    assert out.tokens == want
    assert out.stats.accepted < 0.25 * len(want)


def test_mixed_constrained_and_free_rows_in_a_batch_of_4_are_each_their_own(target, draft):
    """Two rows under schemas, two free, greedy, decoded together (one draft pass, one
    verify pass): each reply is its request's own decode."""
    model, tok = target
    other = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    prompts = ["Reply in JSON:", "def add(a, b):", "A tool call:", "class Stack:"]
    options = [
        GenerateOptions(max_tokens=40, json_schema=SCHEMA, verify_width=4),
        GenerateOptions(max_tokens=20, verify_width=4),
        GenerateOptions(max_tokens=30, json_schema=other, verify_width=8),
        GenerateOptions(max_tokens=20, verify_width=8),
    ]
    got = batch_generate(Pair(model, draft), tok, prompts, options, max_batch=4)
    for p, o, r in zip(prompts, options, got, strict=True):
        ids = tok.encode(p)
        want, _ = reference(model, tok, ids, o.replace(verify_width=None), o.max_tokens)
        assert r.tokens == want, (p, o.constrained)
        if o.constrained and r.finish_reason == "stop":
            json.loads(r.text)
    assert all(4 in r.stats.batches for r in got), [r.stats.batches for r in got]


# -- sampling: the processed law --------------------------------------------------------------


class TableMatcher:
    """A grammar over a tiny vocabulary, by position (llguidance's matcher interface as
    `controls.Grammar` uses it). `rule(prefix)` gives `(allowed ids, forced ids)`."""

    def __init__(self, rule):
        self.rule, self.seq = rule, []

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        bits = np.zeros(nbytes // 4, dtype=np.uint32)
        for t in self.rule(tuple(self.seq))[0]:
            bits[t >> 5] |= np.uint32(1 << (t & 31))
        ctypes.memmove(ptr, bits.ctypes.data, nbytes)

    def compute_ff_tokens(self) -> list[int]:
        return list(self.rule(tuple(self.seq))[1])

    def consume_token(self, t: int) -> bool:
        if t not in self.rule(tuple(self.seq))[0]:
            return False
        self.seq.append(t)
        return True

    def rollback(self, n: int) -> bool:
        del self.seq[len(self.seq) - n :]
        return True

    def is_error(self) -> bool:
        return False

    def get_error(self) -> str:
        return ""


def table_rule(model):
    """x0: a choice among the 3 likeliest; x1: forced `f` (the second likeliest), alone
    after x0's likeliest value, else beside `g` (the likeliest: llguidance forces a
    canonical token where others remain allowed); x2: free; x3, x4: a forced run of two,
    each alone; then free."""
    first = np.array(model(mx.array([PROMPT]))[0, -1].astype(mx.float32))
    a0 = [int(t) for t in np.argsort(-first)[:3]]
    nxt = np.array(model(mx.array([PROMPT + [x] for x in a0]))[:, -1].astype(mx.float32))
    order = {x: [int(t) for t in np.argsort(-nxt[i])] for i, x in enumerate(a0)}
    everything = tuple(range(V))

    def rule(prefix: tuple[int, ...]):
        n = len(prefix)
        if n == 0:
            return a0, []
        if n == 1:
            g, f = order[prefix[0]][:2]
            return ((f,) if prefix[0] == a0[0] else (f, g)), [f]
        if n == 3:
            return (7,), [7, 9]
        if n == 4:
            return (9,), [9]
        return everything, []

    return rule


JOINT = 5
TABLE_OPTIONS = dict(temperature=1.0, top_k=3, grammar="start: table")  # a placeholder:
# the table grammar is handed to the engine as it is


def exact_table_joint(model, rule) -> dict[tuple[int, ...], float]:
    """P(x_0 .. x_4 | PROMPT) of the masked, top-3, T = 1 target, exactly."""

    def law(s, row):
        allowed = np.zeros(V, dtype=bool)
        allowed[list(rule(s)[0])] = True
        return numpy_target_probs(np.where(allowed, row, -np.inf), 1.0, 3, 1.0)

    return exact_joint(model, law, JOINT)


def table_grammar(rule) -> controls.Grammar:
    return controls.Grammar(TableMatcher(rule), V)


def table_counts(model, draft, rule, draws: int, mask_drafts: bool = True) -> dict:
    pair = Pair(model, draft)
    o = GenerateOptions(max_tokens=6, **TABLE_OPTIONS)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(draws):
        g = table_grammar(rule)
        g.mask_drafts = mask_drafts
        tokens = []
        for c in batch.speculative_decode(
            pair, PROMPT, o, seed=seed, width=4, draft_block=4, grammar=g
        ):
            tokens += c.tokens
        key = tuple(tokens[:JOINT])
        counts[key] = counts.get(key, 0) + 1
    return counts


def forced_taken_as_certain(monkeypatch) -> None:
    """A broken engine: where the grammar forces a token it is committed as certain (the
    target's mask narrowed to it), though the grammar allows others there."""
    real = controls.Grammar.mask

    def narrowed(self):
        forced = self.matcher.compute_ff_tokens()
        out = real(self)
        if forced:
            out[:] = 0
            out[forced[0] >> 5] = np.int32(np.uint32(1 << (forced[0] & 31)).view(np.int32))
        return out

    monkeypatch.setattr(controls.Grammar, "mask", narrowed)


@pytest.fixture(scope="module")
def table_pair():
    from .test_sampling import TableDraft, build_tiny_vocab_pair, greedy_table

    model, draft = build_tiny_vocab_pair(12)
    return model, TableDraft(draft, greedy_table(model))


def test_the_table_grammar_has_uncertain_forced_tokens(table_pair):
    """The law test below means something: the forced x1 is not the target's only choice
    after two of the three x0, and the run past the width (x3, x4) is certain."""
    model, _ = table_pair
    rule = table_rule(model)
    exact = exact_table_joint(model, rule)
    p = {}
    for s, v in exact.items():
        p[s[:2]] = p.get(s[:2], 0.0) + v
    a0 = rule(())[0]
    f = rule((a0[1],))[1][0]
    p_f = p.get((a0[1], f), 0.0) / sum(v for k, v in p.items() if k[0] == a0[1])
    assert 0.05 < p_f < 0.95, p_f
    assert all(s[3:] == (7, 9) for s in exact)


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
@pytest.mark.parametrize("mask_drafts", [True, False])
def test_sampled_output_under_forced_drafts_has_the_processed_law(table_pair, mask_drafts):
    model, draft = table_pair
    rule = table_rule(model)
    counts = table_counts(model, draft, rule, 2000, mask_drafts)
    assert not rejects(counts, exact_table_joint(model, rule))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_the_law_test_catches_forced_tokens_committed_as_certain(table_pair, monkeypatch):
    model, draft = table_pair
    rule = table_rule(model)
    forced_taken_as_certain(monkeypatch)
    counts = table_counts(model, draft, rule, 1500)
    assert rejects(counts, exact_table_joint(model, rule))


def batched_table_counts(model, draft, rule, draws: int) -> dict:
    """`table_counts`, each draw a row of batches of 4: two rows under the table grammar
    (counted) beside two free rows (other prompts), joining as others leave."""

    grammars = iter(())

    def compile_grammar(opts, tokenizer, vocab):
        return next(grammars) if opts.constrained else None

    from .test_batch import _IdsOnly

    dec = BatchDecoder(Pair(model, draft), _IdsOnly(), max_batch=4)
    grammars = iter([table_grammar(rule) for _ in range(draws)])
    constrained = GenerateOptions(max_tokens=6, verify_width=4, draft_block=4, **TABLE_OPTIONS)
    free = GenerateOptions(max_tokens=8, temperature=1.0, verify_width=4, draft_block=4)
    real = batch.compile_grammar
    batch.compile_grammar = compile_grammar
    try:
        for i in range(draws):
            dec.submit(list(PROMPT), constrained, handle=("c", i))
            if i % 2:
                dec.submit([2, 7, 1, 8], free, handle=("f", i))
        tokens: dict = {}
        while dec.busy:
            for row, item in dec.step():
                assert not isinstance(item, BaseException), item
                tokens.setdefault(row.handle, []).extend(item.tokens)
    finally:
        batch.compile_grammar = real
    assert max(dec.sizes) == 4
    counts: dict = {}
    for (kind, _), got in tokens.items():
        if kind == "c":
            key = tuple(got[:JOINT])
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.slow  # thousands of sampled rows for a chi-square test
def test_batched_mixed_rows_keep_the_processed_law(table_pair):
    model, draft = table_pair
    rule = table_rule(model)
    counts = batched_table_counts(model, draft, rule, 1200)
    assert not rejects(counts, exact_table_joint(model, rule))


@pytest.mark.parametrize("mask_drafts", [True, False])
def test_a_dflash2_draft_under_a_grammar_keeps_the_targets_output(target, mask_drafts, monkeypatch):
    """DFlash 2's conv rows keep the inputs of an accepted row of its block: its forced runs
    stop at the width, and a block forced whole still runs its draft pass."""
    from dflash_mlx.models.config import DraftConfig
    from dflash_mlx.models.draft import DFlashDraft

    from .conftest import draft_config

    model, tok = target
    mx.random.seed(5)
    d2 = DFlashDraft(DraftConfig.from_dict(draft_config(4, [1, 2], dflash2=True)))
    mx.eval(d2.parameters())
    ids = tok.encode("Reply in JSON:")
    o = GenerateOptions(max_tokens=60, json_schema=SCHEMA)
    want, _ = reference(model, tok, ids, o, 60)
    masked_drafts(monkeypatch, mask_drafts)
    for width in (1, 4):
        out = generate(Pair(model, d2), tok, ids, o.replace(verify_width=width))
        assert out.tokens == want, width
        if width > 1:  # a run after the anchor stops at the width: no conv row past it
            assert max(out.stats.widths) <= width, out.stats.widths


# -- DFlash 2 drafts drawn within the grammar (the selector among allowed candidates) -------


def masked_selector_walk(ms, allowed, temperature=0.0, rng=None):
    """Walk `MaskedSelector` `ms` as `walks.walk_grammar` does, `allowed[t]` at slot `t`."""
    prev, out = None, []
    for t in range(ms.cands.shape[0]):
        row = ms.row(t, prev, allowed[t], temperature)
        prev = int(np.argmax(row))
        out.append(prev)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_the_masked_selector_walks_as_the_selector_where_the_grammar_allows_everything(seed):
    from dflash_mlx.engine.sampling import MaskedSelector, selector_walk

    from .test_dflash2 import random_selector

    sel = random_selector(seed)
    logits, hidden = mx.random.normal((6, 40)) * 3, mx.random.normal((6, 32))
    want, _ = selector_walk(sel, logits, hidden, mx.array([3]))
    ms = MaskedSelector(sel, logits, hidden, mx.array([3]))
    assert masked_selector_walk(ms, np.ones((6, 40), bool)) == want.tolist()


def test_the_masked_selector_chooses_among_allowed_candidates_else_the_masked_draft_row():
    from dflash_mlx.engine.sampling import MaskedSelector

    from .test_dflash2 import random_selector

    sel = random_selector(7)
    logits, hidden = mx.random.normal((3, 40)) * 3, mx.random.normal((3, 32))
    ms = MaskedSelector(sel, logits, hidden, mx.array([3]))
    A, B = np.array(sel.predecessor_codebook), np.array(sel.successor_codebook)
    H, U = np.array(sel.hidden_projection(hidden)), np.array(logits)
    top = np.argsort(-U[0])[: sel.top_k]
    score = {int(b): U[0, b] + float(np.sum(A[3] * H[0] * B[b])) for b in top}
    best = max(score, key=score.get)
    # The best candidate refused: the best allowed one, by the pair score after the anchor.
    allowed = np.ones(40, bool)
    allowed[best] = False
    row = ms.row(0, None, allowed)
    second = max((b for b in score if b != best), key=score.get)
    assert int(np.argmax(row)) == second
    assert np.isfinite(row).sum() == len(score) - 1  # only the allowed candidates
    # A predecessor outside the candidates (a forced token): its own pair term.
    outside = next(t for t in range(40) if t not in ms.cands[0])
    row = ms.row(1, outside, np.ones(40, bool))
    top1 = np.argsort(-U[1])[: sel.top_k]
    want = max(top1, key=lambda b: U[1, b] + float(np.sum(A[outside] * H[1] * B[b])))
    assert int(np.argmax(row)) == int(want)
    # None of the candidates allowed: the draft's own row within the grammar.
    allowed = np.ones(40, bool)
    allowed[top] = False
    row = ms.row(0, None, allowed, 0.5)
    assert int(np.argmax(row)) == int(np.argmax(np.where(allowed, U[0], -np.inf)))
    assert np.allclose(row[allowed], U[0][allowed] / 0.5, atol=1e-5)
    assert np.isneginf(row[~allowed]).all()


@pytest.fixture(scope="module")
def shipped_dflash2():
    from dflash_mlx import load, load_draft
    from dflash_mlx.demo import SHIPPED

    model, tok = load(str(SHIPPED / "target"))
    return model, tok, load_draft(str(SHIPPED / "draft2"))


def spy_walks(monkeypatch) -> list:
    """Each `walk_grammar` call's (drafts, masks), and whether its draft had a selector."""
    import dflash_mlx.engine.walks as walks

    seen, real = [], walks.walk_grammar

    def spy(req, *a, **k):
        drafts, q, masks = real(req, *a, **k)
        seen.append((drafts.tolist(), masks, "candidate_selector" in req.draft))
        return drafts, q, masks

    monkeypatch.setattr(walks, "walk_grammar", spy)
    return seen


@pytest.mark.parametrize("width", [4, 8])
def test_the_shipped_dflash2_draft_drafts_within_the_grammar_and_keeps_the_targets_output(
    shipped_dflash2, width, monkeypatch
):
    """The demo pair's DFlash 2 draft under the issue's schema: every proposal (forced or
    the selector's choice) is one the grammar allows after the tokens before it, and the
    reply is the constrained target's own greedy decode, one token at a time."""
    model, tok, d2 = shipped_dflash2
    ids = tok.encode("def parse(path):\n    ")
    o = GenerateOptions(max_tokens=60, json_schema=SCHEMA)
    want, _ = reference(model, tok, ids, o, 60)
    seen = spy_walks(monkeypatch)
    out = generate(Pair(model, d2), tok, ids, o.replace(verify_width=width))
    assert out.tokens == want
    assert seen and all(sel for _, _, sel in seen)
    for drafts, masks, _ in seen:
        g = controls.Grammar(None, 32 * masks.shape[1])
        for i, t in enumerate(drafts):
            assert g.allows(masks[i], t), (i, t)
    assert out.stats.accepted > 0


def table_counts2(model, draft, rule, draws: int) -> dict:
    """`table_counts` with a DFlash 2 draft (drafting within the table grammar)."""
    return table_counts(model, draft, rule, draws, True)


@pytest.fixture(scope="module")
def table_pair2():
    from .test_sampling import TableDraft, build_tiny_vocab_pair, greedy_table

    model, draft = build_tiny_vocab_pair(13, dflash2=True)
    return model, TableDraft(draft, greedy_table(model))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_sampled_dflash2_within_the_grammar_has_the_processed_law(table_pair2, monkeypatch):
    model, draft = table_pair2
    rule = table_rule(model)
    seen = spy_walks(monkeypatch)
    counts = table_counts2(model, draft, rule, 2000)
    assert seen and all(sel for _, _, sel in seen)
    assert not rejects(counts, exact_table_joint(model, rule))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_the_law_test_catches_a_q_other_than_the_masked_subset_drawn_from(table_pair2, monkeypatch):
    """A broken walk: the proposals drawn from the selector's distribution over the allowed
    candidates, but acceptance told a uniform `q` over them."""
    import dflash_mlx.engine.walks as walks

    model, draft = table_pair2
    rule = table_rule(model)
    real = walks.walk_grammar

    def uniform_q(req, *a, **k):
        drafts, q, masks = real(req, *a, **k)
        if q is not None:
            support = (q > 0).astype(mx.float32)
            q = support / support.sum(axis=-1, keepdims=True)
        return drafts, q, masks

    monkeypatch.setattr(walks, "walk_grammar", uniform_q)
    counts = table_counts2(model, draft, rule, 1500)
    assert rejects(counts, exact_table_joint(model, rule))


# -- trees under a grammar with other controls: chains, and the reply says why -----------------
# (a grammar alone verifies trees: tests/test_grammar_trees.py)


@pytest.mark.parametrize("tree", [True, None])
def test_a_tree_asked_for_under_a_grammar_with_logprobs_verifies_chains_and_says_why(
    target, draft, tree
):
    """Logprobs (like penalties and a bias) follow chains, so a grammar row asking for them
    verifies chains: `tree=True` says why in its stats, the automatic choice never picks a
    tree; the reply is the constrained target's own."""
    model, tok = target
    ids = tok.encode("Reply in JSON:")
    o = GenerateOptions(max_tokens=40, json_schema=SCHEMA, logprobs=2)
    want, _ = reference(model, tok, ids, o, 40)
    out = generate(Pair(model, draft), tok, ids, o.replace(verify_width=8, tree=tree))
    assert out.tokens == want
    assert not out.stats.trees
    if tree:
        assert "logprobs" in out.stats.tree_note
        assert out.stats.to_dict()["ran"]["tree_note"] == out.stats.tree_note


def test_grammar_rows_with_penalties_verify_chains_beside_rows_verifying_trees(target, draft):
    """In a batch, a free row verifies trees while a grammar row under a penalty beside it,
    asking for trees too, verifies chains; each reply is its own decode."""
    model, tok = target
    prompts = ["Reply in JSON:", "def add(a, b):"]
    opts = [
        GenerateOptions(
            max_tokens=30, json_schema=SCHEMA, verify_width=8, tree=True, presence_penalty=0.5
        ),
        GenerateOptions(max_tokens=30, verify_width=8, tree=True),
    ]
    got = batch_generate(Pair(model, draft), tok, prompts, opts, max_batch=2)
    for p, o, r in zip(prompts, opts, got, strict=True):
        want, _ = reference(model, tok, tok.encode(p), o.replace(tree=False), 30)
        assert r.tokens == want, p
    assert not got[0].stats.trees and "penalties" in got[0].stats.tree_note
    assert got[1].stats.trees and got[1].stats.tree_note is None
    assert max(got[0].stats.batches) == 2


def test_dflash2_grammar_rows_in_a_batch_draw_within_the_grammar_from_the_shared_pass(
    shipped_dflash2, monkeypatch
):
    """Two schema rows beside two free rows, the shipped DFlash 2 draft, one draft pass for
    the batch: the grammar rows' selectors walk within the grammar from that pass's rows
    (hidden states and logits), and each reply is its request's own decode."""
    import dflash_mlx.engine.batch_draft as batch_draft

    model, tok, d2 = shipped_dflash2
    prompts = ["def parse(path):\n    ", "import os\n", "class Node:\n", "for x in y:\n"]
    options = [
        GenerateOptions(max_tokens=24, json_schema=SCHEMA, verify_width=8),
        GenerateOptions(max_tokens=12, verify_width=8),
        GenerateOptions(max_tokens=24, json_schema=SCHEMA, verify_width=4),
        GenerateOptions(max_tokens=12, verify_width=4),
    ]
    seen, shared = spy_walks(monkeypatch), []
    real = batch_draft.block_rows
    monkeypatch.setattr(
        batch_draft, "block_rows", lambda reqs, *a: shared.append(len(reqs)) or real(reqs, *a)
    )
    got = batch_generate(Pair(model, d2), tok, prompts, options, max_batch=4)
    for p, o, r in zip(prompts, options, got, strict=True):
        want, _ = reference(model, tok, tok.encode(p), o.replace(verify_width=None), o.max_tokens)
        assert r.tokens == want, (p, o.constrained)
    assert seen and all(sel for _, _, sel in seen)
    assert max(shared) == 4, shared


def test_a_dflash2_block_forced_whole_runs_its_pass_without_reading_it_back(
    shipped_dflash2, monkeypatch
):
    """A DFlash 2 draft's block the grammar forces whole: its pass runs (its conv rows are
    committed) but nothing of it is read back (no selector walk); the reply is the target's."""
    from dflash_mlx.engine import sampling

    model, tok, d2 = shipped_dflash2
    ids = tok.encode("import os\n")
    envelope = '"def get_weather(city, unit, days):\\n    return fetch(city, unit, days)\\n"'
    o = GenerateOptions(max_tokens=40, grammar=f"start: {envelope} /[a-z]+/")
    want, _ = reference(model, tok, ids, o, 40)
    passes, walks = [], []
    real_hidden, real_init = type(d2).block_hidden, sampling.MaskedSelector.__init__
    monkeypatch.setattr(
        type(d2), "block_hidden", lambda self, *a: passes.append(1) or real_hidden(self, *a)
    )
    monkeypatch.setattr(
        sampling.MaskedSelector,
        "__init__",
        lambda self, *a: walks.append(1) or real_init(self, *a),
    )
    out = generate(Pair(model, d2), tok, ids, o.replace(verify_width=4))
    assert out.tokens == want
    speculative = sum(c for w, (c, _) in out.stats.widths.items() if w > 1)
    assert len(passes) == speculative  # every cycle's pass ran ...
    assert len(walks) < speculative  # ... the forced ones not read back
    assert out.stats.accepted >= 12  # the forced envelope, 3 tokens a cycle
