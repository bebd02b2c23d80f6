"""Trees under a grammar (issue 38, item 3; SPEC 6, 7): a grammar row verifies a tree, each
node's target distribution masked by the grammar at that node's own path.

Every node is a token the grammar allows after its path (forced runs carried as single
children, the draft's likeliest allowed tokens elsewhere). Greedy replies are the constrained
target's own decode, one token at a time with the mask applied (`test_controls.reference`),
for several budgets, DFlash 1 and the demo pair's DFlash 2 draft, alone and in a batch of
mixed rows; the stats say trees were verified. Broken verifiers (the target unmasked at the
nodes, or masked with the parent's mask) must fail the greedy check; sampled, the masked
law over the first positions (a chi-square on the table grammar of test_forced_drafts.py)
holds, and fails with the target unmasked at the nodes.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx.engine.batch as batch
import dflash_mlx.engine.batch_cycle as batch_cycle
import dflash_mlx.engine.tree as tree_module
from dflash_mlx import GenerateOptions, Pair, batch_generate, generate
from dflash_mlx.engine import controls
from dflash_mlx.engine.walks import FORCED_BEYOND

from .test_controls import SCHEMA, reference, rejects, valid
from .test_sampling import PROMPT

OTHER = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def shipped():
    """The demo pair: its target, DFlash 1 draft and DFlash 2 draft."""
    from dflash_mlx import load, load_draft
    from dflash_mlx.demo import SHIPPED

    model, tok = load(str(SHIPPED / "target"))
    return model, tok, load_draft(str(SHIPPED / "draft")), load_draft(str(SHIPPED / "draft2"))


def spy_trees(monkeypatch) -> list:
    """Each grammar tree proposed: `(tokens, parents, masks, selector)` on the host."""
    seen, real = [], batch_cycle.grammar_tree

    def spy(req, *a, **k):
        shape, masks = real(req, *a, **k)
        tokens, parents = np.array(shape[0]), np.array(shape[1])
        seen.append((tokens, parents, masks, "candidate_selector" in req.draft))
        return shape, masks

    monkeypatch.setattr(batch_cycle, "grammar_tree", spy)
    return seen


def assert_within_the_grammar(seen) -> None:
    """Every node is a token its parent's mask allows; a mask for every node."""
    assert seen
    for tokens, parents, masks, _ in seen:
        assert masks.shape[0] == tokens.size
        g = controls.Grammar(None, 32 * masks.shape[1])
        for v in range(1, tokens.size):
            assert g.allows(masks[parents[v]], int(tokens[v])), (v, tokens, parents)


def branchy(seen) -> bool:
    """Some tree had a node with more than one child (not all chains)."""
    return any(
        np.bincount(parents[1:], minlength=tokens.size).max() > 1 for tokens, parents, *_ in seen
    )


def trees_verified(stats) -> int:
    return sum(c for c, _ in stats.trees.values())


# -- the tree: within the grammar, a mask per node at its path --------------------------------


@pytest.mark.parametrize("budget", [3, 8, 24])
def test_a_grammar_tree_masks_each_node_at_its_own_path(target, draft, budget):
    """`grammar_tree` on a schema, after a committed prefix, from a random block: every
    node's mask is a fresh matcher's after the committed tokens and the node's path; each
    child is allowed at its parent; a choice node's children are the draft's likeliest
    allowed tokens there; the budget holds (the run forced from the anchor aside); the
    matcher is left where it was."""
    from types import SimpleNamespace

    from dflash_mlx.engine.sampling import SamplingParams

    model, tok = target
    vocab = model(mx.array([[0]])).shape[-1]
    o = GenerateOptions(json_schema=SCHEMA)
    committed = tok.encode('{"name": "ab')
    grammar = controls.compile_grammar(o, tok, vocab)
    grammar.consume(committed)
    req = SimpleNamespace(
        controls=controls.Controls(o, vocab, [], grammar),
        draft=draft,
        state=SimpleNamespace(conv=[]),
        params=SamplingParams(),
    )
    rows = 6
    mx.random.seed(budget)
    logits = mx.random.normal((rows - 1, vocab)) * 4
    before = grammar.mask()
    shape, masks = tree_module.grammar_tree(
        req, mx.array([committed[-1]]), budget, rows, logits, None, room=40
    )
    tokens, parents, depths = (np.array(x).tolist() for x in shape[:3])
    assert (grammar.mask() == before).all()  # rolled back to the committed tokens
    host = np.array(logits)
    for v in range(1, len(tokens)):
        assert parents[v] < v and depths[v] == depths[parents[v]] + 1
        assert grammar.allows(masks[parents[v]], tokens[v]), v
        path, u = [], v
        while u > 0:
            path.append(tokens[u])
            u = parents[u]
        fresh = controls.compile_grammar(o, tok, vocab)
        fresh.consume(committed + path[::-1])
        assert (fresh.mask() == masks[v]).all(), v
    for v in range(len(tokens)):
        kids = [c for c in range(len(tokens)) if parents[c] == v]
        if len(kids) > 1:  # a choice: the draft's likeliest allowed tokens at that depth
            row = np.where(grammar.allowed(masks[v]), host[depths[v]], -np.inf)
            best = np.argsort(-row, kind="stable")[: len(kids)]
            assert [tokens[c] for c in kids] == best.tolist(), v
    branches = [sum(p == v for p in parents) for v in range(len(tokens))]
    assert max(branches) > 1 or budget < 8
    assert budget <= len(tokens) <= budget + FORCED_BEYOND


# -- greedy: the constrained target's own decode ---------------------------------------------


@pytest.mark.parametrize("budget", [4, 8, 16, 32])
def test_greedy_grammar_trees_are_the_constrained_targets_own_decode(
    target, draft, budget, monkeypatch
):
    model, tok = target
    ids = tok.encode("Reply in JSON:")
    o = GenerateOptions(max_tokens=80, json_schema=SCHEMA)
    want, _ = reference(model, tok, ids, o, 80)
    seen = spy_trees(monkeypatch)
    out = generate(Pair(model, draft), tok, ids, o.replace(verify_width=budget, tree=True))
    assert out.tokens == want, budget
    assert out.stats.tree_note is None
    assert trees_verified(out.stats) >= 1
    # The run the grammar forces from the anchor on counts 16 past the budget, as a chain's.
    assert max(out.stats.trees) <= budget + FORCED_BEYOND
    if budget <= 8:
        assert max(out.stats.trees) > budget
    assert_within_the_grammar(seen)
    if budget >= 8:
        assert branchy(seen)
    assert out.finish_reason == "stop" and valid(json.loads(out.text))


def test_a_grammar_tree_stops_at_the_requests_max_tokens(target, draft):
    """The forced run past the budget never carries the reply past `max_tokens`."""
    model, tok = target
    ids = tok.encode("Reply in JSON:")
    o = GenerateOptions(max_tokens=40, json_schema=SCHEMA)
    want, _ = reference(model, tok, ids, o, 40)
    for n in (2, 3, 5, 9, 17):
        out = generate(
            Pair(model, draft), tok, ids, o.replace(max_tokens=n, verify_width=4, tree=True)
        )
        assert out.tokens == want[:n], n
        assert out.stats.generation_tokens == n and out.finish_reason == "length"


@pytest.mark.parametrize("budget", [8, 16])
@pytest.mark.parametrize("which", ["dflash1", "dflash2"])
def test_the_demo_pairs_drafts_verify_grammar_trees_keeping_the_targets_output(
    shipped, which, budget, monkeypatch
):
    """The demo pair's DFlash 1 and DFlash 2 drafts under the issue's schema and a forced
    tool call's shape: trees verified (DFlash 2's from its selector among the allowed
    candidates), each reply the constrained target's own and valid."""
    model, tok, d1, d2 = shipped
    d = d1 if which == "dflash1" else d2
    seen = spy_trees(monkeypatch)
    for prompt, schema in (("def parse(path):\n    ", SCHEMA), ("import os\n", OTHER)):
        ids = tok.encode(prompt)
        o = GenerateOptions(max_tokens=60, json_schema=schema)
        want, _ = reference(model, tok, ids, o, 60)
        out = generate(Pair(model, d), tok, ids, o.replace(verify_width=budget, tree=True))
        assert out.tokens == want, (prompt, which, budget)
        assert out.stats.tree_note is None and trees_verified(out.stats) >= 1
        assert out.finish_reason == "stop", out.text
        doc = json.loads(out.text)
        assert valid(doc) if schema is SCHEMA else set(doc) == {"ok", "n"}
        assert out.stats.tau > 1.5  # forced structure at least
    assert_within_the_grammar(seen)
    assert all(sel == (which == "dflash2") for *_, sel in seen)
    assert branchy(seen)


def test_the_automatic_shape_under_a_grammar_keeps_the_targets_output(shipped, monkeypatch):
    """`tree=None` with a width policy that learns costs: the shape chooser may pick trees
    for a grammar row now (it tries a tree first), and the reply stays the target's."""
    from dflash_mlx.speed.policy import AutoPolicy

    from .test_adaptive import FLAT

    model, tok, d1, _ = shipped
    ids = tok.encode("def parse(path):\n    ")
    o = GenerateOptions(max_tokens=60, json_schema=SCHEMA)
    want, _ = reference(model, tok, ids, o, 60)
    seen = spy_trees(monkeypatch)
    grammar = controls.compile_grammar(o, tok, model(mx.array([[0]])).shape[-1])
    policy = AutoPolicy(FLAT, 16)
    got = []
    eos = frozenset(tok.eos_token_ids)
    pair = Pair(model, d1)
    for c in batch.speculative_decode(
        pair, ids, o, width=8, draft_block=16, policy=policy, grammar=grammar, eos_ids=eos
    ):
        got += c.tokens
    assert got[: len(want)] == want
    assert seen  # a tree was tried


@pytest.mark.parametrize("broken", ["unmasked", "parents_mask"])
def test_the_greedy_check_catches_nodes_verified_without_their_own_mask(
    shipped, broken, monkeypatch
):
    """Broken verifiers: the target's argmax unmasked at the nodes, or masked with each
    node's parent's mask (one position off): the reply leaves the target's own decode (or
    the grammar refuses a token)."""
    model, tok, d1, _ = shipped
    ids = tok.encode("def parse(path):\n    ")
    o = GenerateOptions(max_tokens=60, json_schema=SCHEMA)
    want, _ = reference(model, tok, ids, o, 60)
    real = tree_module.node_outputs

    def wrong(req, logits, masks=None):
        if masks is not None and broken == "parents_mask":
            return real(req, logits, np.concatenate([masks[:1], masks[:-1]]))
        return real(req, logits, None)

    monkeypatch.setattr(batch_cycle, "node_outputs", wrong)
    try:
        out = generate(Pair(model, d1), tok, ids, o.replace(verify_width=16, tree=True))
    except Exception as e:  # noqa: BLE001 - the grammar refused what the broken verifier took
        assert "grammar" in str(e)
        return
    assert out.tokens != want


@pytest.mark.parametrize("which", ["dflash1", "dflash2"])
def test_seeded_sampled_grammar_trees_are_plain_seeded_decoding(shipped, which):
    """A seeded request draws each position's token with that position's key from the
    masked target (`coupled_accept`): under a grammar, trees of 8 and 16 give the reply the
    target alone gives with that seed (verify width 1), token for token."""
    model, tok, d1, d2 = shipped
    d = d1 if which == "dflash1" else d2
    ids = tok.encode("def parse(path):\n    ")
    for seed in (0, 1):
        o = GenerateOptions(max_tokens=60, json_schema=SCHEMA, temperature=1.0, seed=seed)
        plain = generate(Pair(model, d), tok, ids, o.replace(verify_width=1))
        assert plain.finish_reason == "stop" and valid(json.loads(plain.text))
        for budget in (8, 16):
            out = generate(Pair(model, d), tok, ids, o.replace(verify_width=budget, tree=True))
            assert out.tokens == plain.tokens, (seed, budget)
            assert trees_verified(out.stats) >= 1


# -- in a batch: grammar trees beside free rows, one verify pass -------------------------------


@pytest.mark.parametrize("which", ["dflash1", "dflash2"])
def test_grammar_trees_in_a_batch_of_4_mixed_rows_are_each_their_own_decode(
    shipped, which, monkeypatch
):
    """Two grammar rows verifying trees beside a free tree row and a free chain row, one
    verify pass (`tree.batch_mask`): each reply is its request's own decode, the grammar
    rows' stats count trees, and their replies validate."""
    model, tok, d1, d2 = shipped
    d = d1 if which == "dflash1" else d2
    seen = spy_trees(monkeypatch)
    prompts = ["def parse(path):\n    ", "import os\n", "class Node:\n", "for x in y:\n"]
    options = [
        GenerateOptions(max_tokens=50, json_schema=SCHEMA, verify_width=8, tree=True),
        GenerateOptions(max_tokens=20, verify_width=8, tree=True),
        GenerateOptions(max_tokens=40, json_schema=OTHER, verify_width=12, tree=True),
        GenerateOptions(max_tokens=20, verify_width=4),
    ]
    got = batch_generate(Pair(model, d), tok, prompts, options, max_batch=4)
    for p, o, r in zip(prompts, options, got, strict=True):
        plain = o.replace(verify_width=None, tree=False)
        want, _ = reference(model, tok, tok.encode(p), plain, o.max_tokens)
        assert r.tokens == want, (p, o.constrained)
        if o.tree:
            assert r.stats.tree_note is None and trees_verified(r.stats) >= 1, p
        if o.constrained:
            assert r.finish_reason == "stop", r.text
            doc = json.loads(r.text)
            assert valid(doc) if o.json_schema is SCHEMA else set(doc) == {"ok", "n"}
    assert all(4 in r.stats.batches for r in got), [r.stats.batches for r in got]
    assert_within_the_grammar(seen)


# -- sampling: the masked law ------------------------------------------------------------------


@pytest.fixture(scope="module")
def top2_pair():
    from .test_sampling import build_tiny_vocab_pair
    from .test_tree import Top2Draft

    model, draft = build_tiny_vocab_pair(12)
    return model, Top2Draft(draft, model)


def tree_table_counts(model, draft, rule, draws: int) -> tuple[dict, int]:
    """The table grammar's first positions, sampled with trees of 8 (block 4: the forced x1,
    then the draft's two likeliest x2, each followed by the forced x3 x4); and how many
    cycles verified a tree. A run the grammar stops (it refused a token a broken verifier
    took) counts as a draw outside the law."""
    from .test_forced_drafts import JOINT, TABLE_OPTIONS, table_grammar

    pair = Pair(model, draft)
    o = GenerateOptions(max_tokens=10, tree=True, **TABLE_OPTIONS)
    counts: dict[tuple, int] = {}
    trees = 0
    for seed in range(draws):
        tokens = []
        try:
            for c in batch.speculative_decode(
                pair, PROMPT, o, seed=seed, width=8, draft_block=4, grammar=table_grammar(rule)
            ):
                tokens += c.tokens
                trees += c.tree
        except RuntimeError as e:
            assert "grammar" in str(e)
            tokens = ["refused"]
        key = tuple(tokens[:JOINT])
        counts[key] = counts.get(key, 0) + 1
    return counts, trees


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_sampled_grammar_trees_have_the_masked_law(top2_pair, monkeypatch):
    from .test_forced_drafts import exact_table_joint, table_rule

    model, draft = top2_pair
    rule = table_rule(model)
    used, real = [], tree_module.accept_sampled

    def spy(tree, p, uniforms):
        path, tok = real(tree, p, uniforms)
        used.append(any(int(c) != int(tree.children(tree.parents[c])[0]) for c in path[1:]))
        return path, tok

    monkeypatch.setattr(tree_module, "accept_sampled", spy)
    counts, trees = tree_table_counts(model, draft, rule, 3000)
    assert trees >= 3000 and sum(used) > 100, (trees, sum(used))
    assert not rejects(counts, exact_table_joint(model, rule))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_the_law_test_catches_the_target_unmasked_at_the_nodes(top2_pair, monkeypatch):
    from .test_forced_drafts import exact_table_joint, table_rule

    model, draft = top2_pair
    rule = table_rule(model)
    real = tree_module.node_outputs
    monkeypatch.setattr(
        batch_cycle, "node_outputs", lambda req, logits, masks=None: real(req, logits)
    )
    counts, _ = tree_table_counts(model, draft, rule, 1500)
    assert rejects(counts, exact_table_joint(model, rule))


def batched_tree_table_counts(model, draft, rule, draws: int) -> tuple[dict, int]:
    """`tree_table_counts` in batches of 4: each draw a table-grammar row verifying trees of
    8, beside free rows (a tree row and a chain row, other prompts), joining as others
    leave; and how many of the counted rows verified trees and ran in a batch."""
    from .test_batch import _IdsOnly
    from .test_forced_drafts import JOINT, TABLE_OPTIONS, table_grammar

    grammars = iter([table_grammar(rule) for _ in range(draws)])
    dec = batch.BatchDecoder(Pair(model, draft), _IdsOnly(), max_batch=4)
    constrained = GenerateOptions(
        max_tokens=10, verify_width=8, draft_block=4, tree=True, **TABLE_OPTIONS
    )
    free = [
        GenerateOptions(max_tokens=8, temperature=1.0, verify_width=8, draft_block=4, tree=True),
        GenerateOptions(max_tokens=8, temperature=1.0, verify_width=4, draft_block=4),
    ]
    real = batch.compile_grammar
    batch.compile_grammar = lambda opts, tokenizer, vocab: (
        next(grammars) if opts.constrained else None
    )
    tokens: dict = {}
    last: dict = {}
    try:
        for i in range(draws):
            dec.submit(list(PROMPT), constrained, handle=("c", i))
            if i % 2:
                dec.submit([2, 7, 1, 8], free[i % 4 == 1], handle=("f", i))
        while dec.busy:
            for row, item in dec.step():
                assert not isinstance(item, BaseException), item
                tokens.setdefault(row.handle, []).extend(item.tokens)
                last[row.handle] = item.stats
    finally:
        batch.compile_grammar = real
    assert max(dec.sizes) == 4
    batched_trees = sum(
        bool(st.trees) and bool(st.batches) for (kind, _), st in last.items() if kind == "c"
    )
    counts: dict = {}
    for (kind, _), got in tokens.items():
        if kind == "c":
            key = tuple(got[:JOINT])
            counts[key] = counts.get(key, 0) + 1
    return counts, batched_trees


@pytest.mark.slow  # thousands of sampled rows for a chi-square test
def test_batched_grammar_tree_rows_keep_the_masked_law(top2_pair):
    from .test_forced_drafts import exact_table_joint, table_rule

    model, draft = top2_pair
    rule = table_rule(model)
    counts, batched_trees = batched_tree_table_counts(model, draft, rule, 1500)
    assert batched_trees > 1000, batched_trees
    assert not rejects(counts, exact_table_joint(model, rule))
