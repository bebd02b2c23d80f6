"""Tree verification (SPEC 7): more tokens per target pass from the same draft pass.

A DFlash draft gives a distribution at every block position in one pass; a chain verifies
only its top token at each. A tree verifies, in the same one target pass, the likeliest
continuations under the draft's per-position marginals: `build` picks the `budget - 1`
drafted nodes of highest path probability (best-first, vectorised per depth: the draft's
marginals do not depend on the parent, so every node's children are the same ranked tokens
of the next position). `attention_mask` lets each node see the committed prefix and its own
ancestors only, at position `prefix + depth`. `accept_greedy` and `accept_sampled` walk the
verified tree from the root (SPEC 7): greedy follows the child equal to the target's argmax;
sampling tests a node's children in rank order with the rule for deterministically chosen
children (accept child `c` with probability `r(c)`; on rejection `r(c) = 0`, renormalise),
which leaves the output distributed exactly as the target's.

Why that rule is exact: at node `v` with target distribution `p`, the children `c_1..c_m`
are fixed before any draw. Accepting `c_1` with probability `p(c_1)` and otherwise drawing
from `p` without `c_1` is a draw from `p`: P(c_1) = p(c_1), and any other token `x`
comes out with probability `(1 - p(c_1)) * p(x) / (1 - p(c_1)) = p(x)`. Testing `c_2`
against that renormalised remainder repeats the argument, and so on; the final draw from the
remainder completes it. Descending into an accepted child continues with that child's `p`,
the target's distribution given the accepted prefix, so the whole path is a draw from the
target's autoregressive law.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

# Children considered per node: the draft's ranked tokens at the next position.
BRANCH = 8


@dataclass(frozen=True)
class Tree:
    """A verified tree: node 0 is the anchor (the root, depth 0); nodes `1..` are drafted
    tokens, each after its parent (parents come first), children of a node in rank order."""

    tokens: np.ndarray  # (N,) int: the anchor, then each node's token
    parents: np.ndarray  # (N,) int: parent index (-1 for the root)
    depths: np.ndarray  # (N,) int

    @property
    def size(self) -> int:
        return int(self.tokens.size)

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def children(self, v: int) -> np.ndarray:
        return np.nonzero(self.parents == v)[0]

    def is_chain(self) -> bool:
        return bool((self.parents[1:] == np.arange(self.size - 1)).all())


def build(anchor: int, logprobs: np.ndarray, ranked: np.ndarray, budget: int) -> Tree:
    """The `budget`-node tree (anchor included) of highest path log-probability.

    `ranked` `(D, K)`: the draft's K likeliest tokens at each depth `1..D`, best first, and
    `logprobs` `(D, K)` theirs. A node's path score is the sum of its path's log-probs; every
    child scores at most its parent, so the `budget - 1` best nodes over all depths form a
    tree (each node's parent is among them)."""
    depth, k = ranked.shape
    scores, parents, ranks, levels = [], [], [], []
    frontier = np.zeros(1)  # path scores of the kept nodes at the previous depth
    frontier_ids = np.array([0])  # their node ids (0: the anchor)
    next_id = 1
    for d in range(depth):
        cand = (frontier[:, None] + logprobs[d][None, :]).ravel()
        keep = np.argsort(-cand, kind="stable")[: budget - 1]
        scores.append(cand[keep])
        parents.append(frontier_ids[keep // k])
        ranks.append(keep % k)
        levels.append(np.full(keep.size, d + 1))
        frontier = cand[keep]
        frontier_ids = np.arange(next_id, next_id + keep.size)
        next_id += keep.size
    score = np.concatenate(scores)
    parent = np.concatenate(parents)
    rank = np.concatenate(ranks)
    level = np.concatenate(levels)
    ids = np.arange(1, score.size + 1)
    # The best budget - 1 of all candidate nodes; ties keep the shallower, lower-rank node
    # first, so a node is never kept without its parent.
    best = np.lexsort((rank, level, -score))[: budget - 1]
    best.sort()  # candidate order: by depth, parents before children
    new_index = np.full(score.size + 1, -1)
    new_index[0] = 0
    new_index[ids[best]] = np.arange(1, best.size + 1)
    tokens = [anchor] + [int(ranked[level[i] - 1, rank[i]]) for i in best]
    par = [-1] + [int(new_index[parent[i]]) for i in best]
    assert min(par[1:], default=0) >= 0, "a kept node lost its parent"
    # Children in rank order among siblings (they were added in score order per parent).
    return Tree(np.array(tokens), np.array(par), np.array([0] + list(level[best])))


def chain(anchor: int, tokens: list[int]) -> Tree:
    n = len(tokens) + 1
    return Tree(np.array([anchor, *tokens]), np.arange(-1, n - 1), np.arange(n))


def attention_mask(tree: Tree, prefix: int) -> mx.array:
    """`(N, prefix + N)` bool: node `i` sees the committed prefix, itself and its ancestors."""
    n = tree.size
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):  # parents come first, so each row extends its parent's
        anc[i] |= anc[tree.parents[i]]
    full = np.concatenate([np.ones((n, prefix), dtype=bool), anc], axis=1)
    return mx.array(full)


def accept_greedy(tree: Tree, argmax: np.ndarray) -> tuple[list[int], int]:
    """The accepted path (node ids from the root, anchor included) and the target's token
    after it: from the root, follow the child equal to the target's argmax there."""
    path = [0]
    while True:
        v = path[-1]
        nxt = [c for c in tree.children(v) if tree.tokens[c] == argmax[v]]
        if not nxt:
            return path, int(argmax[v])
        path.append(int(nxt[0]))


def accept_sampled(tree: Tree, p: np.ndarray, uniforms: np.ndarray) -> tuple[list[int], int]:
    """Sampling acceptance over a tree whose children are the draft's ranked tokens (chosen
    deterministically): see the module docstring. `p` `(N, V)`: the target's distribution at
    each node; `uniforms` `(N, BRANCH + 1)`: node `v`'s draws (one per child test, the last
    for the final sample), a function of the seed and the node's position and rank only."""
    path = [0]
    while True:
        v = path[-1]
        r = p[v].astype(np.float64)
        for j, c in enumerate(tree.children(v)):
            tok = tree.tokens[c]
            if uniforms[v, j] < r[tok] / max(r.sum(), 1e-30):
                path.append(int(c))
                break
            r = r.copy()
            r[tok] = 0.0
        else:
            total = r.sum()
            if total <= 1e-12:  # every token the target allows was tested and refused
                r, total = p[v].astype(np.float64), float(p[v].sum())
            cdf = np.cumsum(r / total)
            return path, int(min(np.searchsorted(cdf, uniforms[v, -1]), r.size - 1))
