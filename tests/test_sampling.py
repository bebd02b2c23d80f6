"""Sampling is lossless (SPEC 4): DFlash output follows the target's exact distribution.

The chi-square tests draw thousands of seeded samples and compare them with the exact
distribution computed independently in numpy. Each test is paired with a deliberately
broken acceptance rule that the same test must reject, to show it has power.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx.engine.batch as batch
import dflash_mlx.engine.decode as decode
from dflash_mlx.engine.sampling import SamplingParams, probabilities, rejection_accept
from dflash_mlx.models.config import DraftConfig
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.options import GenerateOptions
from dflash_mlx.pair import Pair

from .conftest import draft_config, qwen3_config

V = 16


def chi_square_rejects(counts: np.ndarray, expected_p: np.ndarray, alpha_z: float = 3.09) -> bool:
    """True when counts are implausible under expected_p (alpha about 1e-3).

    Cells with expected count < 5 are pooled; the critical value uses the Wilson-Hilferty
    approximation so the test needs nothing beyond numpy.
    """
    n = counts.sum()
    exp = expected_p * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    if exp[-1] < 5:  # fold a small pooled cell into the smallest big one
        i = int(np.argmin(exp[:-1]))
        obs[i] += obs[-1]
        exp[i] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    if (counts[expected_p == 0] > 0).any():
        return True
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    crit = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat > crit


def numpy_target_probs(logits: np.ndarray, t: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent reference: top-p then top-k on the untempered distribution, then T."""
    logits = logits.astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p)
    mass_above = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
    keep = np.zeros_like(p, dtype=bool)
    keep[order[mass_above < top_p]] = True
    if 0 < top_k < len(p):
        ranks = np.empty_like(order)
        ranks[order] = np.arange(len(p))
        keep &= ranks < top_k
    out = np.where(keep, np.exp((logits - logits.max()) / t), 0.0)
    return out / out.sum()


def always_accept(drafts, q, p, accept_keys, final_keys):
    """A broken rule: trusts the draft blindly."""
    return mx.array(drafts.size), mx.random.categorical(mx.log(p[-1]), key=final_keys[-1])


def ratio_inverted(drafts, q, p, accept_keys, final_keys):
    """A broken rule: accepts with min(1, q/p) instead of min(1, p/q)."""
    return rejection_accept(drafts, p[:-1], mx.concatenate([q, p[-1:]]), accept_keys, final_keys)


def split_keys(key, w):
    """Keys for one verified block of width `w`: `w - 1` accept tests, `w` final draws."""
    keys = mx.random.split(key, 2 * w - 1)
    return keys[: w - 1], keys[w - 1 :]


# -- the rule on its own --------------------------------------------------------------------


def first_token_counts(p, q, rule, draws, seed=0):
    counts = np.zeros(p.shape[1], dtype=np.int64)
    key = mx.random.key(seed)
    for _ in range(draws):
        key, kd, ka = mx.random.split(key, 3)
        drafts = mx.random.categorical(mx.log(q), key=kd).astype(mx.int32)
        n, tok = rule(drafts, q, p, *split_keys(ka, p.shape[0]))
        first = drafts[0] if n.item() >= 1 else tok
        counts[first.item()] += 1
    return counts


def synthetic_pq(seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(6) * 0.7, size=3)
    q = rng.dirichlet(np.ones(6) * 0.7, size=2)
    q[0] = np.array([0.0, 0.6, 0.0, 0.0, 0.4, 0.0])  # q misses most of p's support
    return mx.array(p, dtype=mx.float32), mx.array(q, dtype=mx.float32)


def test_rejection_rule_first_token_follows_p():
    p, q = synthetic_pq(0)
    counts = first_token_counts(p, q, rejection_accept, 3000)
    assert not chi_square_rejects(counts, np.array(p[0])), counts


def test_rejection_rule_test_has_power_against_broken_rules():
    p, q = synthetic_pq(0)
    for rule in (always_accept, ratio_inverted):
        counts = first_token_counts(p, q, rule, 3000)
        assert chi_square_rejects(counts, np.array(p[0])), f"{rule.__name__} not detected"


def test_residual_without_mass_falls_back_to_p():
    p = mx.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = mx.array([[0.5, 0.5, 0.0]])  # q == p: the residual is empty, every draft accepted
    for s in range(50):
        drafts = mx.array([s % 2], dtype=mx.int32)
        n, tok = rejection_accept(drafts, q, p, *split_keys(mx.random.key(s), 2))
        assert n.item() == 1


# -- end to end through the decode engine ---------------------------------------------------


def build_tiny_vocab_pair(draft_seed: int, dflash2: bool = False):
    """A V-token target with peaked distributions and a random draft (block 4) bound to it."""
    from mlx_lm.utils import _get_classes

    cfg = qwen3_config(vocab=V)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(11)
    model = model_cls(args_cls.from_dict(cfg))
    model.lm_head.weight = model.lm_head.weight * 6.0
    mx.random.seed(draft_seed)
    dcfg = draft_config(4, [1, 2], block=4, vocab=V, dflash2=dflash2)
    draft = DFlashDraft(DraftConfig.from_dict(dcfg))
    if dflash2:  # random codebooks, so the selector's pair term matters
        sel = draft.candidate_selector
        sel.predecessor_codebook = mx.random.normal(sel.predecessor_codebook.shape)
        sel.successor_codebook = mx.random.normal(sel.successor_codebook.shape)
    mx.eval(model.parameters(), draft.parameters())
    return model, draft


@pytest.fixture(scope="module")
def tiny_vocab_pair():
    return build_tiny_vocab_pair(12)


PROMPT = [3, 1, 4, 1, 5]


def exact_second_token(model, t, top_k, top_p) -> np.ndarray:
    """p(x1) = sum over x0 of p(x0 | prompt) p(x1 | prompt, x0), exactly."""
    rows = mx.array([PROMPT + [x0] for x0 in range(V)])
    logits = np.array(model(rows).astype(mx.float32))
    p0 = numpy_target_probs(logits[0, len(PROMPT) - 1], t, top_k, top_p)
    p1 = np.stack([numpy_target_probs(logits[x0, -1], t, top_k, top_p) for x0 in range(V)])
    return p0 @ p1


def as_options(params: SamplingParams, max_tokens: int) -> GenerateOptions:
    return GenerateOptions(
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
    )


def second_token_counts(model, draft, params, draws):
    pair = Pair(model, draft)
    counts = np.zeros(V, dtype=np.int64)
    accepted = 0
    for seed in range(draws):
        cycles = batch.speculative_decode(
            pair,
            PROMPT,
            as_options(params, 3),
            seed=seed,
            width=4,
            draft_block=4,
        )
        _, first = next(cycles), next(cycles)
        counts[first.tokens[0]] += 1
        accepted += first.accepted
    return counts, accepted


SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 0.9)]


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
@pytest.mark.parametrize("t,top_k,top_p", SETTINGS)
def test_dflash_sampling_matches_target_distribution(tiny_vocab_pair, t, top_k, top_p):
    model, draft = tiny_vocab_pair
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p)
    counts, accepted = second_token_counts(model, draft, params, 2500)
    assert accepted > 100, "the draft must be accepted sometimes for the test to mean much"
    assert not chi_square_rejects(counts, exact_second_token(model, t, top_k, top_p)), counts


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
@pytest.mark.parametrize("t,top_k,top_p", SETTINGS)
def test_dflash_sampling_test_detects_a_broken_rule(tiny_vocab_pair, monkeypatch, t, top_k, top_p):
    model, draft = tiny_vocab_pair
    monkeypatch.setattr(decode, "rejection_accept", always_accept)
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p)
    counts, _ = second_token_counts(model, draft, params, 2500)
    assert chi_square_rejects(counts, exact_second_token(model, t, top_k, top_p))


def test_numpy_reference_agrees_with_engine_probabilities():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 32)).astype(np.float32) * 3
    for t, k, tp in [(1.0, 0, 1.0), (0.5, 7, 1.0), (1.3, 0, 0.8), (0.8, 4, 0.6)]:
        got = np.array(probabilities(mx.array(logits), SamplingParams(t, tp, k)))
        want = np.stack([numpy_target_probs(row, t, k, tp) for row in logits])
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_seeded_sampling_is_reproducible(target, draft):
    from dflash_mlx import generate

    model, tok = target
    a = generate(model, draft, tok, "def", max_tokens=20, temperature=0.9, seed=7, verify_width=4)
    b = generate(model, draft, tok, "def", max_tokens=20, temperature=0.9, seed=7, verify_width=4)
    c = generate(model, draft, tok, "def", max_tokens=20, temperature=0.9, seed=8, verify_width=4)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens, "a different seed should sample differently"


# -- the whole acceptance chain: every accept test, the residuals and the bonus -------------

JOINT = 5  # generated positions: the first token, one width-4 cycle (3 drafts), the bonus


class TableDraft(DFlashDraft):
    """Proposes, after anchor `a`, the target's greedy continuation of `PROMPT + [a]`, as
    soft logits (the proposal is sampled, often right, often not). A function of the anchor
    only, so that drafts are accepted 0..3 at a time and every path of the rule is taken."""

    def __init__(self, base: DFlashDraft, table: dict[int, list[int]], sharpness: float = 3.0):
        super().__init__(base.config)
        self.update(base.parameters())
        self.table, self.sharpness = table, sharpness
        self._anchor = 0

    def _table_logits(self, rows: int) -> mx.array:
        want = (self.table[self._anchor] + [0] * rows)[:rows]
        return mx.eye(V)[mx.array(want)] * self.sharpness

    def block_logits(self, anchor, length, rows, state):
        self._anchor = anchor.item()
        return self._table_logits(length - 1 if rows is None else rows)

    def block_hidden(self, anchor, length, rows, state):  # DFlash 2: the selector reads both
        self._anchor = anchor.item()
        return super().block_hidden(anchor, length, rows, state)

    def logits(self, h, head=None):
        return self._table_logits(h.shape[0])


def greedy_table(model) -> dict[int, list[int]]:
    table = {}
    for a in range(V):
        seq = PROMPT + [a]
        for _ in range(3):
            seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
        table[a] = seq[len(PROMPT) + 1 :]
    return table


def exact_joint(model, t, top_k, top_p, n=JOINT) -> dict[tuple[int, ...], float]:
    """P(x_0 .. x_{n-1} | PROMPT) over every sequence the truncation allows, exactly."""
    probs = {(): 1.0}
    for _ in range(n):
        prefixes = list(probs)
        logits = np.array(model(mx.array([PROMPT + list(s) for s in prefixes]))[:, -1])
        nxt = {}
        for s, row in zip(prefixes, logits.astype(np.float64)):
            p = numpy_target_probs(row, t, top_k, top_p)
            for x in np.nonzero(p)[0]:
                nxt[s + (int(x),)] = probs[s] * p[x]
        probs = nxt
    return probs


def joint_counts(model, draft, params, draws, seeded=False) -> tuple[dict, list[int]]:
    """Counts of the first `JOINT` tokens over `draws` seeds (width 4), and how many drafts
    the first cycle accepted, by count 0..3. `seeded`: each request's options carry its
    seed (the coupled rule, `sampling.coupled_accept`), else rejection sampling."""
    pair = Pair(model, draft)
    counts: dict[tuple[int, ...], int] = {}
    by_accepted = [0, 0, 0, 0]
    for seed in range(draws):
        opts = as_options(params, JOINT)
        cycles = batch.speculative_decode(
            pair,
            PROMPT,
            opts.replace(seed=seed) if seeded else opts,
            seed=seed,
            width=4,
            draft_block=4,
        )
        tokens, first = [], None
        for c in cycles:
            tokens += c.tokens
            if c.width and first is None:
                first = c
        assert first.width == 4
        by_accepted[first.accepted] += 1
        key = tuple(tokens[:JOINT])
        counts[key] = counts.get(key, 0) + 1
    return counts, by_accepted


def joint_rejects(counts: dict, exact: dict) -> bool:
    if any(k not in exact for k in counts):
        return True  # a sequence the target can never produce
    keys = sorted(exact)
    return chi_square_rejects(
        np.array([counts.get(k, 0) for k in keys], dtype=np.int64),
        np.array([exact[k] for k in keys]),
    )


JOINT_PARAMS = SamplingParams(temperature=1.0, top_k=3)


@pytest.fixture(scope="module")
def table_pair(tiny_vocab_pair):
    model, draft = tiny_vocab_pair
    return model, TableDraft(draft, greedy_table(model))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_joint_distribution_of_a_whole_width_4_cycle_is_the_targets(table_pair):
    """Positions 1..3 are the three drafts of one cycle (accept tests 1, 2 and 3, the
    residual after a rejection at any of them) and position 4 the bonus when all three
    were accepted: their joint distribution with the first token must be the target's."""
    model, draft = table_pair
    counts, by_accepted = joint_counts(model, draft, JOINT_PARAMS, 3000)
    assert min(by_accepted) > 100, f"every acceptance length must occur: {by_accepted}"
    assert not joint_rejects(counts, exact_joint(model, 1.0, 3, 1.0))


def later_drafts_accepted_blindly(drafts, q, p, accept_keys, final_keys):
    """A broken rule: tests the first draft only; the ones after it are trusted."""
    n, tok = rejection_accept(drafts, q, p, accept_keys, final_keys)
    full = mx.random.categorical(mx.log(p[-1]), key=final_keys[-1])
    return mx.where(n >= 1, drafts.size, n), mx.where(n >= 1, full, tok)


def bonus_from_the_wrong_row(drafts, q, p, accept_keys, final_keys):
    """A broken rule: the bonus token is drawn at the last draft's position, not after it."""
    if p.shape[0] == 1:  # a plain step has no bonus
        return rejection_accept(drafts, q, p, accept_keys, final_keys)
    return rejection_accept(drafts, q, mx.concatenate([p[:-1], p[-2:-1]]), accept_keys, final_keys)


def residual_of_the_first_row(drafts, q, p, accept_keys, final_keys):
    """A broken rule: after a rejection at any position, position 1's residual."""
    w = p.shape[0]
    if w == 1:
        return rejection_accept(drafts, q, p, accept_keys, final_keys)
    rows = mx.arange(w - 1)
    u = mx.stack([mx.random.uniform(key=accept_keys[i]) for i in range(w - 1)])
    n = mx.cumprod((u * q[rows, drafts] < p[rows, drafts]).astype(mx.int32)).sum()
    residual = mx.maximum(p[:1] - q[:1], 0.0)
    residual = mx.broadcast_to(residual / residual.sum(), q.shape)
    final = mx.concatenate([residual, p[-1:]])
    return n, mx.random.categorical(mx.log(final[n]), key=final_keys[n])


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
@pytest.mark.parametrize(
    "rule", [later_drafts_accepted_blindly, bonus_from_the_wrong_row, residual_of_the_first_row]
)
def test_the_joint_test_detects_rules_wrong_only_after_the_first_draft(
    table_pair, monkeypatch, rule
):
    """Each rule is right at the first drafted position, which is all the second-token test
    above can see; the joint test must reject each."""
    model, draft = table_pair
    monkeypatch.setattr(decode, "rejection_accept", rule)
    counts, _ = joint_counts(model, draft, JOINT_PARAMS, 2000)
    assert joint_rejects(counts, exact_joint(model, 1.0, 3, 1.0)), rule.__name__


def test_rejections_draw_from_the_residual_not_from_p():
    """q != p, so drafts are rejected: the token emitted at a rejection follows
    normalize(max(0, p - q)) exactly, and a rule that draws from p there is caught."""
    p, q = synthetic_pq(1)
    residual = np.maximum(np.array(p[0]) - np.array(q[0]), 0)
    residual /= residual.sum()

    def counts_after_rejection(rule, draws=3000):
        counts = np.zeros(p.shape[1], dtype=np.int64)
        key = mx.random.key(5)
        rejected = 0
        for _ in range(draws):
            key, kd, ka = mx.random.split(key, 3)
            drafts = mx.random.categorical(mx.log(q), key=kd).astype(mx.int32)
            n, tok = rule(drafts, q, p, *split_keys(ka, p.shape[0]))
            if n.item() == 0:
                rejected += 1
                counts[tok.item()] += 1
        return counts, rejected

    counts, rejected = counts_after_rejection(rejection_accept)
    assert rejected > 500, "the test needs real rejections"
    assert not chi_square_rejects(counts, residual), counts

    def from_p(drafts, q, p, accept_keys, final_keys):
        n, tok = rejection_accept(drafts, q, p, accept_keys, final_keys)
        plain = mx.random.categorical(mx.log(p[0]), key=final_keys[0])
        return n, mx.where(n == 0, plain, tok)

    counts, _ = counts_after_rejection(from_p)
    assert chi_square_rejects(counts, residual), "drawing from p after a rejection not caught"


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_seeded_requests_keep_the_targets_joint_distribution(table_pair):
    """Seeded requests accept drafts equal to the target's Gumbel-max draw at each position
    (issue 43): the first `JOINT` tokens over many seeds still follow the target's law."""
    model, draft = table_pair
    counts, by_accepted = joint_counts(model, draft, JOINT_PARAMS, 2000, seeded=True)
    assert min(by_accepted) > 100, f"every acceptance length must occur: {by_accepted}"
    assert not joint_rejects(counts, exact_joint(model, 1.0, 3, 1.0))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_the_seeded_joint_test_catches_noise_shared_between_positions(table_pair, monkeypatch):
    """A broken coupled rule: every position of a cycle drawn with its first position's
    key (the tokens of a cycle are then not independent draws)."""
    from dflash_mlx.engine.sampling import coupled_accept

    def one_key(drafts, p, final_keys):
        return coupled_accept(drafts, p, mx.broadcast_to(final_keys[:1], final_keys.shape))

    monkeypatch.setattr(decode, "coupled_accept", one_key)
    model, draft = table_pair
    counts, _ = joint_counts(model, draft, JOINT_PARAMS, 1200, seeded=True)
    assert joint_rejects(counts, exact_joint(model, 1.0, 3, 1.0))
