"""Tree verification (issue 23, SPEC 7): one target pass over a tree of drafts, lossless.

The tree pass is checked against plain forwards of every root path; acceptance against the
target's own greedy decode and, sampled, against its exact joint law; committing against a
fresh prefill of the committed tokens. Each check is also run on a broken variant (siblings
that see each other, sequential positions, a sibling accepted without the residual rule) and
must catch it.
"""

from __future__ import annotations

import heapq

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import dflash_mlx.engine.batch as batch
import dflash_mlx.engine.tree as tree_module
import dflash_mlx.models.target as target_module
from dflash_mlx import GenerateOptions, Pair, generate, load
from dflash_mlx.engine.batch_cache import keep
from dflash_mlx.engine.tree import Tree, accept_sampled, build
from dflash_mlx.models.config import DraftConfig
from dflash_mlx.models.draft import DFlashDraft

from .conftest import draft_config
from .test_decode import PROMPTS, target_greedy
from .test_sampling import JOINT, PROMPT, TableDraft, exact_joint, greedy_table

PREFIX = [5, 9, 33, 70, 12, 8]
# anchor 40; depth 1: 7, 8; under 7: 9, 10; under 8: 11; under 9: 12
BRANCHY = Tree(
    np.array([40, 7, 8, 9, 10, 11, 12]),
    np.array([-1, 0, 0, 1, 1, 2, 3]),
    np.array([0, 1, 1, 2, 2, 2, 3]),
)


def ancestors_of(tree: Tree) -> np.ndarray:
    """Who sees whom, by walking up from each node (the reference for `ancestors`)."""
    seen = np.eye(tree.size, dtype=bool)
    for i in range(tree.size):
        v = i
        while v >= 0:
            seen[i, v] = True
            v = tree.parents[v]
    return seen


def path_of(tree: Tree, v: int) -> list[int]:
    out = []
    while v >= 0:
        out.append(int(tree.tokens[v]))
        v = int(tree.parents[v])
    return out[::-1]


# -- building --------------------------------------------------------------------------------


def best_first(logprobs: np.ndarray, budget: int) -> list[float]:
    """A reference: the classic best-first expansion with a heap, node scores only."""
    depth, k = logprobs.shape
    heap = [(-logprobs[0, 0], 1, (0,))]
    scores = []
    while heap and len(scores) < budget - 1:
        s, d, ranks = heapq.heappop(heap)
        scores.append(-s)
        if ranks[-1] + 1 < k:  # the next sibling
            sib = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(
                heap, (s + logprobs[d - 1, ranks[-1]] - logprobs[d - 1, sib[-1]], d, sib)
            )
        if d < depth:  # the first child
            heapq.heappush(heap, (s - logprobs[d, 0], d + 1, ranks + (0,)))
    return sorted(scores, reverse=True)


@pytest.mark.parametrize("budget", [2, 5, 16, 32])
def test_build_keeps_the_best_nodes_as_a_tree(budget):
    rng = np.random.default_rng(budget)
    for _ in range(20):
        lp = np.sort(np.log(rng.dirichlet(np.ones(12), size=7)), axis=1)[:, ::-1][:, :8].copy()
        ranked = rng.permutation(100)[:56].reshape(7, 8)
        out = build(mx.array([3]), mx.array(lp, dtype=mx.float32), mx.array(ranked), budget)
        tree = Tree(*(np.array(x) for x in out[:3]))
        assert (np.array(out[3]) == np.array(ancestors_of(tree))).all()
        assert tree.size == min(budget, 1 + 7 * 8) and tree.tokens[0] == 3
        assert (tree.parents[1:] < np.arange(1, tree.size)).all()  # parents first
        assert (tree.depths[1:] == tree.depths[tree.parents[1:]] + 1).all()
        for v in range(1, tree.size):  # each node is its depth's token of some rank
            assert tree.tokens[v] in ranked[tree.depths[v] - 1]
        score = {0: 0.0}
        for v in range(1, tree.size):
            d = tree.depths[v] - 1
            r = list(ranked[d]).index(tree.tokens[v])
            score[v] = score[tree.parents[v]] + lp[d, r]
        assert np.allclose(sorted(list(score.values())[1:], reverse=True), best_first(lp, budget))
        for v in range(tree.size):  # siblings in rank order
            ranks = [
                list(ranked[tree.depths[c] - 1]).index(tree.tokens[c]) for c in tree.children(v)
            ]
            assert ranks == sorted(ranks)


# -- one pass over a tree --------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense(models_dir):
    return load(str(models_dir / "qwen3"))


def tree_pass(model, tree: Tree, prefix: list[int]):
    adapter = Pair(model, None).target
    cache = adapter.make_cache()
    assert adapter.tree_support(cache) is None
    adapter.forward(mx.array([prefix]), cache, None)
    seen = tree_module.ancestors(mx.array(tree.parents), tree.depth)
    mask = tree_module.attention_mask(seen, len(prefix))
    depths = mx.array(tree.depths, dtype=mx.int32)
    logits, _ = adapter.forward_tree(mx.array(tree.tokens)[None], cache, mask, depths, None)
    return adapter, cache, logits[0]


def pass_error(model, tree: Tree) -> float:
    """The largest difference between the tree pass and a plain forward of each node's path."""
    _, _, logits = tree_pass(model, tree, PREFIX)
    worst = 0.0
    for v in range(tree.size):
        ref = model(mx.array([PREFIX + path_of(tree, v)]))[0, -1]
        worst = max(worst, float(mx.abs(ref - logits[v]).max()))
    return worst


def test_each_node_sees_its_ancestors_at_its_depth(dense):
    model, _ = dense
    assert pass_error(model, BRANCHY) < 1e-4


def test_the_pass_check_catches_siblings_that_see_each_other(dense, monkeypatch):
    model, _ = dense

    def causal(seen, prefix):
        n = seen.shape[0]
        return mx.array(np.tri(n, prefix + n, prefix) > 0)

    monkeypatch.setattr(tree_module, "attention_mask", causal)
    assert pass_error(model, BRANCHY) > 1e-2


def test_the_pass_check_catches_sequential_positions(dense, monkeypatch):
    model, _ = dense
    monkeypatch.setattr(
        target_module._TreeRoPE, "__call__", lambda self, x, offset=0: self.inner(x, offset=offset)
    )
    assert pass_error(model, BRANCHY) > 1e-2


def test_keeping_a_path_leaves_the_cache_a_fresh_prefill_would(dense):
    model, _ = dense
    adapter, cache, _ = tree_pass(model, BRANCHY, PREFIX)
    path = [0, 1, 3, 6]  # 40 7 9 12
    keep(adapter, cache, [len(path)], BRANCHY.size, ({}, {}), [path])
    fresh = make_prompt_cache(model)
    model(mx.array([PREFIX + path_of(BRANCHY, 6)]), cache=fresh)
    for c, f in zip(cache, fresh, strict=True):
        assert c.offset == f.offset
        for a, b in ((c.keys, f.keys), (c.values, f.values)):
            assert float(mx.abs(a[..., : c.offset, :] - b[..., : f.offset, :]).max()) < 1e-5
    # and decoding goes on from it as from the fresh prefill
    nxt = model(mx.array([[99]]), cache=cache)[0, -1]
    assert float(mx.abs(nxt - model(mx.array([[99]]), cache=fresh)[0, -1]).max()) < 1e-4


# -- greedy: the target's own output, with siblings accepted ---------------------------------


class SiblingDraft(DFlashDraft):
    """Proposes the target's greedy continuation as its *second* choice at every position
    (a wrong token first): a chain accepts nothing, a tree accepts through siblings."""

    def __init__(self, base: DFlashDraft, script: list[int]):
        super().__init__(base.config)
        self.update(base.parameters())
        self.script = script

    def block_logits(self, anchor, length, rows, state):
        pos = state.context_end
        vocab = self.config.vocab_size
        rows = length - 1 if rows is None else rows
        out = np.zeros((rows, vocab), dtype=np.float32)
        for i in range(rows):
            right = self.script[pos + 1 + i] if pos + 1 + i < len(self.script) else 0
            out[i, (right + 1) % vocab] = 9.0  # top-1: wrong
            out[i, right] = 8.0  # top-2: right
        return mx.array(out)


@pytest.mark.parametrize("budget", [8, 16, 32])
def test_greedy_trees_keep_the_targets_output_accepting_siblings(dense, draft, budget):
    model, tok = dense
    ids = tok.encode(PROMPTS[0])
    ref = target_greedy(model, ids, 40)
    sib = SiblingDraft(draft, ids + ref)
    chain = generate(model, sib, tok, ids, max_tokens=40, verify_width=8)
    tree = generate(model, sib, tok, ids, max_tokens=40, verify_width=budget, tree=True)
    assert chain.tokens == ref and tree.tokens == ref
    assert chain.stats.tau == 1.0  # the top-1 chain is always wrong
    assert tree.stats.tau > 1.5, "siblings must be accepted"
    # every cycle verified a tree but those the last tokens left under 3 to verify
    assert sum(c for c, _ in tree.stats.trees.values()) >= tree.stats.cycles - 2


@pytest.mark.parametrize("budget", [4, 16])
def test_greedy_trees_on_random_drafts_keep_the_output(dense, draft, budget):
    model, tok = dense
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        out = generate(model, draft, tok, ids, max_tokens=32, verify_width=budget, tree=True)
        assert out.tokens == target_greedy(model, ids, 32)


def test_a_dflash2_draft_verifies_trees_losslessly(dense):
    model, tok = dense
    mx.random.seed(5)
    d2 = DFlashDraft(DraftConfig.from_dict(draft_config(4, [1, 2], dflash2=True)))
    mx.eval(d2.parameters())
    ids = tok.encode(PROMPTS[1])
    out = generate(model, d2, tok, ids, max_tokens=32, verify_width=12, tree=True)
    assert out.tokens == target_greedy(model, ids, 32) and out.stats.trees


def test_a_hybrid_target_verifies_chains_and_says_why(models_dir, draft):
    model, tok = load(str(models_dir / "qwen35"))
    ids = tok.encode(PROMPTS[0])
    out = generate(model, draft, tok, ids, max_tokens=24, verify_width=12, tree=True)
    assert out.tokens == target_greedy(model, ids, 24)
    assert not out.stats.trees and "recurrent" in out.stats.tree_note
    assert out.stats.to_dict()["ran"]["tree_note"] == out.stats.tree_note


def test_bad_tree_settings_are_refused(dense, draft):
    model, tok = dense
    with pytest.raises(Exception, match="tree 'yes' must be True, False or None"):
        generate(model, draft, tok, "x", tree="yes", max_tokens=2)
    with pytest.raises(Exception, match="holds at most"):
        generate(model, draft, tok, "x", tree=True, verify_width=999, max_tokens=2)


# -- sampling: the target's exact law --------------------------------------------------------


class Top2Draft(TableDraft):
    """Proposes the target's greedy continuation after the anchor first and, at each
    position, the target's second choice there second: siblings are often right."""

    def __init__(self, base: DFlashDraft, model):
        super().__init__(base, greedy_table(model))
        self.second = {}
        for a in self.table:
            seq = PROMPT + [a]
            self.second[a] = []
            for t in self.table[a]:
                row = np.array(model(mx.array([seq]))[0, -1])
                self.second[a].append(int(np.argsort(-row)[1]))
                seq.append(t)

    def _table_logits(self, rows: int) -> mx.array:
        first = (self.table[self._anchor] + [0] * rows)[:rows]
        second = (self.second[self._anchor] + [1] * rows)[:rows]
        eye = mx.eye(self.config.vocab_size)
        return eye[mx.array(first)] * 2.0 + eye[mx.array(second)] * 1.0


@pytest.fixture(scope="module")
def table_pair():
    from .test_sampling import build_tiny_vocab_pair

    model, draft = build_tiny_vocab_pair(12)
    return model, Top2Draft(draft, model)


def tree_joint_counts(model, draft, draws: int) -> tuple[dict, int]:
    pair = Pair(model, draft)
    o = GenerateOptions(max_tokens=JOINT, temperature=1.0, top_k=3, tree=True)
    counts: dict[tuple[int, ...], int] = {}
    siblings = 0
    for seed in range(draws):
        tokens = []
        for c in batch.speculative_decode(pair, PROMPT, o, seed=seed, width=6, draft_block=4):
            tokens += c.tokens
        key = tuple(tokens[:JOINT])
        counts[key] = counts.get(key, 0) + 1
    return counts, siblings


def tree_rejects(counts: dict, exact: dict) -> bool:
    from .test_controls import rejects

    return rejects(counts, exact)


def sibling_without_residual(tree, p, uniforms):
    """A broken rule: each child tested against the target's p itself, and the final draw
    from p, as if the refused children had not been refused."""
    path = [0]
    while True:
        v = path[-1]
        for j, c in enumerate(tree.children(v)):
            if uniforms[v, j] < p[v][tree.tokens[c]]:
                path.append(int(c))
                break
        else:
            cdf = np.cumsum(p[v] / p[v].sum())
            return path, int(min(np.searchsorted(cdf, uniforms[v, -1]), p.shape[1] - 1))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_sampled_trees_follow_the_targets_exact_law(table_pair, monkeypatch):
    model, draft = table_pair
    used = []
    real = accept_sampled

    def spy(tree, p, uniforms):
        path, tok = real(tree, p, uniforms)
        used.append(any(int(c) != int(tree.children(tree.parents[c])[0]) for c in path[1:]))
        return path, tok

    monkeypatch.setattr(tree_module, "accept_sampled", spy)
    counts, _ = tree_joint_counts(model, draft, 3000)
    assert sum(used) > 100, "siblings must be accepted"
    assert not tree_rejects(counts, exact_joint(model, 1.0, 3, 1.0))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_the_law_test_catches_a_sibling_accepted_without_the_residual_rule(table_pair, monkeypatch):
    model, draft = table_pair
    monkeypatch.setattr(tree_module, "accept_sampled", sibling_without_residual)
    counts, _ = tree_joint_counts(model, draft, 3000)
    assert tree_rejects(counts, exact_joint(model, 1.0, 3, 1.0))


def test_seeded_sampled_trees_replay(dense, draft):
    model, tok = dense
    o = GenerateOptions(max_tokens=24, temperature=1.0, seed=4, verify_width=8, tree=True)
    runs = [generate(model, draft, tok, PROMPTS[2], o).tokens for _ in range(2)]
    assert runs[0] == runs[1]
