"""Issue 39, item 3: DFlash 2 trees from the candidate selector (SPEC 7): the paths the
selector would walk, best first, verified in one pass; greedy keeps the target's output,
sampling its exact law, and the law test catches a rule that treats the selector's children
as drawn from the draft's full-vocabulary distribution."""

from __future__ import annotations

import heapq

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx.engine.tree as tree_module
from dflash_mlx import GenerateOptions, generate
from dflash_mlx.engine.tree import Tree, build, selector_tree
from dflash_mlx.models.config import DraftConfig
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.models.selector import CandidateSelector

from .conftest import draft_config
from .test_decode import PROMPTS, target_greedy
from .test_sampling import exact_joint
from .test_tree import dense, tree_joint_counts, tree_rejects  # noqa: F401 - fixture


def pair_best_first(logp: np.ndarray, budget: int) -> list[tuple[float, tuple[int, ...]]]:
    """A reference: best-first expansion with a heap over every path of candidate indices,
    each child scored given its parent's index; the `budget - 1` best (score, path)."""
    depth, k, _ = logp.shape
    heap = [(-logp[0, 0, j], (j,)) for j in range(k)]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < budget - 1:
        s, path = heapq.heappop(heap)
        out.append((-s, path))
        d = len(path)
        if d < depth:
            for j in range(k):
                heapq.heappush(heap, (s - logp[d, path[-1], j], path + (j,)))
    return out


@pytest.mark.parametrize("budget", [4, 9, 16, 30])
def test_pair_trees_keep_the_best_paths_with_children_that_depend_on_the_parent(budget):
    rng = np.random.default_rng(budget)
    D, K = 5, 4
    raw = rng.normal(size=(D, K, K)) * 2
    raw[0] = raw[0, :1]  # depth 1 follows the anchor: every row the same
    logp = raw - np.log(np.exp(raw).sum(-1, keepdims=True))
    cands = rng.permutation(50)[: D * K].reshape(D, K) + 100  # distinct token ids per slot
    tokens, parents, depths, _ = build(
        mx.array(7), mx.array(logp, dtype=mx.float32), mx.array(cands), budget
    )
    tree = Tree(np.array(tokens), np.array(parents), np.array(depths))
    want = pair_best_first(logp, budget)
    # Every node is the path of candidate indices the reference kept, and nothing else.
    index = {(d, int(c)): j for d in range(D) for j, c in enumerate(cands[d])}
    got = []
    for v in range(1, tree.size):
        path, u = [], v
        while u > 0:
            path.append(index[(int(tree.depths[u]) - 1, int(tree.tokens[u]))])
            u = int(tree.parents[u])
        got.append(tuple(path[::-1]))
    assert sorted(got) == sorted(p for _, p in want)
    assert (tree.parents[1:] < np.arange(1, tree.size)).all(), "parents come first"


def test_a_selector_tree_is_built_from_pair_scores_not_per_slot_marginals():
    """Two depth-1 nodes get different best children when the pair term says so (the
    per-slot marginals alone would give both the same)."""
    V, D = 12, 8
    sel = CandidateSelector(V, 2, D, top_k=3)
    logits = mx.full((2, V), -10.0)
    logits[0, mx.array([1, 2])] = mx.array([5.0, 4.9])
    logits[1, mx.array([3, 4, 5])] = mx.array([1.0, 0.9, 0.8])
    hidden = mx.ones((2, D))
    sel.hidden_projection.weight = mx.zeros((2, D)).at[0].add(1.0 / D)  # H(h) = (1, 0)
    pred = mx.zeros((V, 2))
    pred[1] = mx.array([1.0, 0.0])  # after token 1: prefer 5
    pred[2] = mx.array([-1.0, 0.0])  # after token 2: prefer 4
    sel.predecessor_codebook = pred
    succ = mx.zeros((V, 2))
    succ[5] = mx.array([3.0, 0.0])
    succ[4] = mx.array([-3.0, 0.0])
    sel.successor_codebook = succ
    tokens, parents, depths, _ = selector_tree(sel, logits, hidden, mx.array(0), 7)
    tree = Tree(np.array(tokens), np.array(parents), np.array(depths))
    first = {int(tree.tokens[c]): c for c in tree.children(0)}
    assert set(first) >= {1, 2}
    best_after = {t: int(tree.tokens[tree.children(v)[0]]) for t, v in first.items()}
    assert best_after[1] == 5 and best_after[2] == 4


def random_dflash2(seed: int, block: int = 8, vocab=None):
    mx.random.seed(seed)
    kwargs = {} if vocab is None else {"vocab": vocab}
    d2 = DFlashDraft(DraftConfig.from_dict(draft_config(4, [1, 2], block=block, dflash2=True,
                                                        **kwargs)))  # fmt: skip
    sel = d2.candidate_selector
    sel.predecessor_codebook = mx.random.normal(sel.predecessor_codebook.shape)
    sel.successor_codebook = mx.random.normal(sel.successor_codebook.shape)
    mx.eval(d2.parameters())
    return d2


@pytest.mark.parametrize("budget,block", [(6, 8), (16, 8), (16, 16)])
def test_greedy_selector_trees_keep_the_targets_output(dense, budget, block):  # noqa: F811
    """Block 16: the tree of 16 may go 15 deep, where the chain of width 8 stops at 7."""
    model, tok = dense
    d2 = random_dflash2(5, block=block)
    calls = []
    real = tree_module.selector_tree

    def spy(*args):
        calls.append(1)
        return real(*args)

    tree_module.selector_tree = spy
    try:
        for prompt in PROMPTS[:2]:
            ids = tok.encode(prompt)
            o = GenerateOptions(max_tokens=32, verify_width=budget, tree=True)
            out = generate(model, d2, tok, ids, o)
            assert out.tokens == target_greedy(model, ids, 32) and out.stats.trees
    finally:
        tree_module.selector_tree = real
    assert calls, "the trees came from the selector"


# -- sampling: the target's exact law --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vocab_dflash2():
    from .test_sampling import build_tiny_vocab_pair

    return build_tiny_vocab_pair(21, dflash2=True)


def full_vocab_q_rule(seen: dict):
    """A broken rule: the selector's children tested as if drawn from the draft's
    full-vocabulary softmax at their depth (`min(1, r / q)`, residual `r - q`), the
    selector's candidate subset and pair scores not accounted for."""

    def accept(tree, p, uniforms):
        q_by_depth = seen["q"]
        path = [0]
        while True:
            v = path[-1]
            r = p[v].astype(np.float64) / p[v].sum()
            for j, c in enumerate(tree.children(v)):
                q = q_by_depth[int(tree.depths[c]) - 1]
                tok = tree.tokens[c]
                if uniforms[v, j] < min(1.0, r[tok] / max(q[tok], 1e-30)):
                    path.append(int(c))
                    break
                r = np.maximum(r - q, 0.0)
                r = r / r.sum() if r.sum() > 1e-12 else p[v] / p[v].sum()
            else:
                cdf = np.cumsum(r)
                return path, int(min(np.searchsorted(cdf, uniforms[v, -1]), r.size - 1))

    return accept


def recording_selector_tree(seen: dict):
    real = tree_module.selector_tree

    def spy(selector, logits, hidden, anchor, budget):
        z = np.array(logits, dtype=np.float64)
        z = np.exp(z - z.max(-1, keepdims=True))
        seen["q"] = z / z.sum(-1, keepdims=True)
        seen["trees"] = seen.get("trees", 0) + 1
        return real(selector, logits, hidden, anchor, budget)

    return spy


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_sampled_selector_trees_follow_the_targets_exact_law(tiny_vocab_dflash2, monkeypatch):
    model, d2 = tiny_vocab_dflash2
    seen: dict = {}
    monkeypatch.setattr(tree_module, "selector_tree", recording_selector_tree(seen))
    counts, _ = tree_joint_counts(model, d2, 3000)
    assert seen["trees"] >= 3000
    assert not tree_rejects(counts, exact_joint(model, 1.0, 3, 1.0))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_the_law_test_catches_selector_children_taken_as_full_vocabulary_draws(
    tiny_vocab_dflash2, monkeypatch
):
    model, d2 = tiny_vocab_dflash2
    seen: dict = {}
    monkeypatch.setattr(tree_module, "selector_tree", recording_selector_tree(seen))
    monkeypatch.setattr(tree_module, "accept_sampled", full_vocab_q_rule(seen))
    counts, _ = tree_joint_counts(model, d2, 3000)
    assert tree_rejects(counts, exact_joint(model, 1.0, 3, 1.0))


def test_batched_selector_trees_read_the_shared_draft_pass(dense, monkeypatch):  # noqa: F811
    """Rows of a DFlash 2 draft verifying trees in one batch: each tree built from the
    batch's one draft pass (its hidden states and logits equal the row's own pass), each
    row its solo greedy decode."""
    from dflash_mlx import Pair
    from dflash_mlx.engine import batch_cycle
    from dflash_mlx.engine.batch import batch_generate

    model, tok = dense
    d2 = random_dflash2(7)
    shared = []
    real = batch_cycle.propose_tree

    def spy(req, anchor, budget, rows, logits=None, hidden=None):
        if logits is not None:
            assert hidden is not None, "a DFlash 2 tree needs the pass's hidden states"
            own = req.draft.block_hidden(anchor, rows, rows - 1, req.state)
            assert mx.allclose(hidden, own, atol=1e-4).item()
            shared.append(budget)
        return real(req, anchor, budget, rows, logits, hidden=hidden)

    monkeypatch.setattr(batch_cycle, "propose_tree", spy)
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    opts = [GenerateOptions(max_tokens=24, verify_width=10, tree=True) for _ in ids]
    got = batch_generate(Pair(model, d2), tok, ids, opts)
    assert [r.tokens for r in got] == [target_greedy(model, i, 24) for i in ids]
    assert all(r.stats.trees for r in got) and len(shared) > 5, shared
