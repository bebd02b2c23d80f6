"""Sampling controls inside the cycle (issue 24): penalties, logit bias, grammars and
logprobs stay exact under speculation.

Every DFlash run is compared with an independent reference: the target alone, one token at
a time, its logits processed in numpy (OpenAI's presence/frequency penalties over the
generated tokens, mlx-lm's repetition penalty over the recent context, the bias) and masked
by a fresh grammar matcher. Each check is also run against a broken engine (penalties counted
over the prompt, rows processed without the block's own drafts, a mask one position off, no
rollback of the matcher) and must catch it.
"""

from __future__ import annotations

import importlib
import json
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import dflash_mlx.engine.batch as batch
import dflash_mlx.engine.batch_cycle as batch_cycle
import dflash_mlx.engine.controls as controls
import dflash_mlx.engine.decode as decode
from dflash_mlx import BadArgument, GenerateOptions, Pair, check_grammar, generate, load
from dflash_mlx.models.config import DraftConfig
from dflash_mlx.models.draft import DFlashDraft

from .conftest import draft_config
from .test_decode import ScriptedDraft
from .test_sampling import (
    JOINT,
    PROMPT,
    TableDraft,
    chi_square_rejects,
    greedy_table,
    numpy_target_probs,
)

PROMPT_TEXT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
N = 32

PROCESSING = {
    "presence+frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.6, repetition_context_size=6),
    "all+bias": dict(
        presence_penalty=0.8,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        logit_bias={7: 2.5, 11: -4.0, 40: 1.0},
    ),
}


def process_np(row: np.ndarray, prompt: list[int], gen: list[int], o: GenerateOptions):
    """The processed logits of one position after `prompt + gen`, in numpy (mlx-lm's order:
    bias, repetition, then OpenAI's penalties over the generated tokens only)."""
    row = row.astype(np.float64).copy()
    for t, b in (o.logit_bias or {}).items():
        row[t] += b
    if o.repetition_penalty is not None:
        for t in set((prompt + gen)[-o.repetition_context_size :]):
            p = o.repetition_penalty
            row[t] = row[t] * p if row[t] < 0 else row[t] / p
    counts = np.bincount(np.array(gen, dtype=np.int64), minlength=row.size)[: row.size]
    return row - o.presence_penalty * (counts > 0) - o.frequency_penalty * counts


def reference(model, tok, prompt: list[int], o: GenerateOptions, n: int):
    """The target alone, greedy on its processed (and grammar-masked) logits: the tokens and
    each position's processed log-softmax."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    vocab = logits.shape[-1]
    grammar = controls.compile_grammar(o, tok, vocab) if o.constrained else None
    gen, lps = [], []
    for _ in range(n):
        row = process_np(np.array(logits.astype(mx.float32)), prompt, gen, o)
        if grammar is not None:
            m = grammar.mask()
            allowed = np.array([grammar.allows(m, i) for i in range(row.size)])
            row[~allowed] = -np.inf
        t = int(np.argmax(row))
        top = row.max()
        lps.append(row - top - np.log(np.exp(row - top).sum()))
        gen.append(t)
        if t in tok.eos_token_ids:
            break
        if grammar is not None:
            grammar.consume([t])
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return gen, lps


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def any_target(request, models_dir):
    return request.param, *load(str(models_dir / request.param))


def scripted(draft, ids, want):
    """A draft proposing the reference's own continuation, wrong from a varying block index
    on: every acceptance length occurs, so every row's history is exercised."""
    return ScriptedDraft(draft, ids + want, right=lambda c: (c * 5) % 7)


@pytest.mark.parametrize("width", [1, 4, 8])
@pytest.mark.parametrize("name", list(PROCESSING))
def test_processed_greedy_is_the_targets_processed_greedy(any_target, draft, name, width):
    kind, model, tok = any_target
    ids = tok.encode(PROMPT_TEXT)
    o = GenerateOptions(max_tokens=N, logprobs=3, **PROCESSING[name])
    want, lps = reference(model, tok, ids, o, N)
    out = generate(Pair(model, scripted(draft, ids, want)), tok, ids, o.replace(verify_width=width))
    assert out.tokens == want, f"{kind} {name} W={width}"
    if width > 1:
        assert out.stats.tau > 1.3, "the scripted draft must be accepted in part"
    # logprobs: the processed log-softmax at each position, and the 3 most likely there
    assert len(out.logprobs) == len(want)
    for lp, ref in zip(out.logprobs, lps, strict=True):
        assert abs(lp.logprob - ref[lp.token]) < 2e-2
        assert len(lp.top) == 3
        assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:3])
        assert max(abs(v - ref[t]) for t, v in lp.top) < 2e-2


def test_a_dflash2_draft_under_penalties_keeps_the_targets_output(target):
    model, tok = target
    mx.random.seed(5)
    d2 = DFlashDraft(DraftConfig.from_dict(draft_config(4, [1, 2], dflash2=True)))
    mx.eval(d2.parameters())
    ids = tok.encode(PROMPT_TEXT)
    o = GenerateOptions(max_tokens=N, **PROCESSING["all+bias"])
    want, _ = reference(model, tok, ids, o, N)
    for width in (4, 8):
        assert generate(Pair(model, d2), tok, ids, o.replace(verify_width=width)).tokens == want


def diverges(run, want: list[int]) -> bool:
    """Whether a (broken) run's output differs from `want`: other tokens, or a scripted draft
    finding the committed tokens off its script, or a matcher refusing them."""
    try:
        return run().tokens != want
    except (AssertionError, RuntimeError):
        return True


def process_rows_without_the_blocks_drafts(monkeypatch) -> None:
    """A broken engine: every verified row processed with the committed history alone."""
    target_rows = controls.Controls.target

    def committed_history_only(self, logits, drafts, masks=None):
        rows = [target_rows(self, logits[i : i + 1], drafts[:0], masks) for i in range(len(logits))]
        return mx.concatenate(rows)

    monkeypatch.setattr(controls.Controls, "target", committed_history_only)


def test_the_check_catches_penalties_counted_over_the_prompt(target, draft, monkeypatch):
    model, tok = target
    ids = tok.encode(PROMPT_TEXT)
    o = GenerateOptions(max_tokens=N, verify_width=4, **PROCESSING["presence+frequency"])
    want, _ = reference(model, tok, ids, o, N)
    init = controls.Controls.__init__

    def over_the_prompt(self, options, vocab, prompt, grammar=None):
        init(self, options, vocab, prompt, grammar)
        self.counts = self.counts.at[mx.array(list(prompt))].add(1.0)

    monkeypatch.setattr(controls.Controls, "__init__", over_the_prompt)
    assert diverges(lambda: generate(Pair(model, scripted(draft, ids, want)), tok, ids, o), want)


def test_the_check_catches_rows_processed_without_the_blocks_drafts(target, draft, monkeypatch):
    model, tok = target
    ids = tok.encode(PROMPT_TEXT)
    o = GenerateOptions(max_tokens=N, verify_width=8, **PROCESSING["presence+frequency"])
    want, _ = reference(model, tok, ids, o, N)
    process_rows_without_the_blocks_drafts(monkeypatch)
    assert diverges(lambda: generate(Pair(model, scripted(draft, ids, want)), tok, ids, o), want)


def test_seeded_processed_sampling_replays(target, draft):
    model, tok = target
    o = GenerateOptions(
        max_tokens=24, temperature=1.0, seed=7, verify_width=4, **PROCESSING["all+bias"]
    )
    runs = [generate(Pair(model, draft), tok, PROMPT_TEXT, o).tokens for _ in range(2)]
    assert runs[0] == runs[1]
    assert generate(Pair(model, draft), tok, PROMPT_TEXT, o.replace(seed=8)).tokens != runs[0]


def test_bad_controls_are_refused_naming_them(target):
    model, tok = target
    with pytest.raises(BadArgument, match="logit_bias token id 999999"):
        generate(model, None, tok, "x", logit_bias={999999: 1.0}, max_tokens=2)
    with pytest.raises(BadArgument, match="json_schema is invalid"):
        check_grammar(GenerateOptions(json_schema={"type": "objekt"}), tok)
    with pytest.raises(BadArgument, match="grammar is invalid"):
        generate(model, None, tok, "x", grammar="start: nothing_here", max_tokens=2)


# -- the processed law, sampled through DFlash -----------------------------------------------

JOINT_OPTIONS = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={2: 1.5, 5: -1.0})


def exact_processed_joint(model, top_k: int) -> dict[tuple[int, ...], float]:
    """P(x_0 .. x_{JOINT-1} | PROMPT) of the processed, top-k, T=1 target, exactly."""
    o = GenerateOptions(**JOINT_OPTIONS)
    return exact_joint(
        model,
        lambda s, row: numpy_target_probs(process_np(row, PROMPT, list(s), o), 1.0, top_k, 1.0),
        JOINT,
    )


def exact_joint(model, law, steps: int) -> dict[tuple[int, ...], float]:
    """P(x_0 .. x_{steps-1} | PROMPT) exactly, every continuation enumerated: `law(s, row)`
    is the next token's distribution after the sequence `s` whose target logits are `row`."""
    probs = {(): 1.0}
    for _ in range(steps):
        prefixes = list(probs)
        logits = np.array(model(mx.array([PROMPT + list(s) for s in prefixes]))[:, -1])
        nxt = {}
        for s, row in zip(prefixes, logits.astype(np.float64)):
            p = law(s, row)
            for x in np.nonzero(p)[0]:
                nxt[s + (int(x),)] = probs[s] * p[x]
        probs = nxt
    return probs


def processed_joint_counts(model, draft, draws: int) -> tuple[dict, list[int]]:
    pair = Pair(model, draft)
    o = GenerateOptions(max_tokens=JOINT, temperature=1.0, top_k=3, **JOINT_OPTIONS)
    counts: dict[tuple[int, ...], int] = {}
    by_accepted = [0, 0, 0, 0]
    for seed in range(draws):
        tokens, first = [], None
        for c in batch.speculative_decode(pair, PROMPT, o, seed=seed, width=4, draft_block=4):
            tokens += c.tokens
            if c.width and first is None:
                first = c
        by_accepted[first.accepted] += 1
        key = tuple(tokens[:JOINT])
        counts[key] = counts.get(key, 0) + 1
    return counts, by_accepted


def rejects(counts: dict, exact: dict) -> bool:
    if any(k not in exact for k in counts):
        return True
    keys = sorted(exact)
    return chi_square_rejects(
        np.array([counts.get(k, 0) for k in keys], dtype=np.int64),
        np.array([exact[k] for k in keys]),
    )


@pytest.fixture(scope="module")
def table_pair():
    from .test_sampling import build_tiny_vocab_pair

    model, draft = build_tiny_vocab_pair(12)
    return model, TableDraft(draft, greedy_table(model))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_processed_sampling_through_dflash_has_the_exact_processed_law(table_pair):
    """Presence and frequency penalties and a bias at temperature 1, top-k 3, width 4: the
    joint law of the first token, one whole cycle and its bonus is the processed target's."""
    model, draft = table_pair
    counts, by_accepted = processed_joint_counts(model, draft, 3000)
    assert min(by_accepted) > 50, f"every acceptance length must occur: {by_accepted}"
    assert not rejects(counts, exact_processed_joint(model, 3))


@pytest.mark.slow  # thousands of sampled requests for a chi-square test
def test_the_law_test_catches_rows_processed_without_the_blocks_drafts(table_pair, monkeypatch):
    model, draft = table_pair
    process_rows_without_the_blocks_drafts(monkeypatch)
    counts, _ = processed_joint_counts(model, draft, 3000)
    assert rejects(counts, exact_processed_joint(model, 3))


# -- grammars --------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["file", "dir", "link"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "size", "kind", "tags"],
    "additionalProperties": False,
}


def valid(doc) -> bool:
    """The SCHEMA's constraints, checked by hand."""
    return (
        isinstance(doc, dict)
        and set(doc) == {"name", "size", "kind", "tags"}
        and isinstance(doc["name"], str)
        and len(doc["name"]) <= 8
        and type(doc["size"]) is int
        and 0 <= doc["size"] <= 999
        and doc["kind"] in ("file", "dir", "link")
        and isinstance(doc["tags"], list)
        and len(doc["tags"]) <= 3
        and all(t in ("a", "b") for t in doc["tags"])
    )


@pytest.mark.parametrize("width", [None, 1, 4, 8])
def test_sampled_replies_of_a_random_model_follow_the_schema(any_target, draft, width):
    kind, model, tok = any_target
    for seed in range(4):
        o = GenerateOptions(
            max_tokens=160, temperature=1.0, seed=seed, verify_width=width, json_schema=SCHEMA
        )
        out = generate(Pair(model, draft), tok, "Reply in JSON:", o)
        assert out.finish_reason == "stop", (kind, width, seed, out.text)
        assert valid(json.loads(out.text)), (kind, width, seed, out.text)
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', out.text)  # whitespace between tokens
        assert "  " not in outside and "\n" not in outside, out.text


def test_json_object_replies_parse(target, draft):
    model, tok = target
    for seed in range(3):
        o = GenerateOptions(max_tokens=200, temperature=0.7, seed=seed, json_schema=True)
        out = generate(Pair(model, draft), tok, "{", o.replace(verify_width=4))
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text
        else:  # cut by max_tokens: still a prefix of a JSON object
            assert out.text.startswith("{"), out.text


@pytest.mark.parametrize("mask_drafts", [True, False])
@pytest.mark.parametrize("width", [2, 4, 8])
def test_constrained_greedy_is_the_targets_constrained_greedy(
    any_target, draft, width, mask_drafts, monkeypatch
):
    kind, model, tok = any_target
    ids = tok.encode("Reply in JSON:")
    o = GenerateOptions(max_tokens=120, json_schema=SCHEMA, logprobs=0)
    want, lps = reference(model, tok, ids, o, 120)
    compile_grammar = controls.compile_grammar
    monkeypatch.setattr(
        importlib.import_module("dflash_mlx.engine.batch"),
        "compile_grammar",
        lambda *a: compile_grammar(*a, mask_drafts=mask_drafts),
    )
    out = generate(Pair(model, scripted(draft, ids, want)), tok, ids, o.replace(verify_width=width))
    assert out.tokens == want, (kind, width, mask_drafts)
    assert out.finish_reason == "stop" and valid(json.loads(out.text))
    assert out.stats.tau > 1.3
    for lp, ref in zip(out.logprobs, lps, strict=True):
        assert abs(lp.logprob - ref[lp.token]) < 2e-2


def run_broken(model, tok, draft, ids, want, width=8) -> bool:
    o = GenerateOptions(max_tokens=120, json_schema=SCHEMA, verify_width=width)
    return diverges(lambda: generate(Pair(model, scripted(draft, ids, want)), tok, ids, o), want)


def test_the_check_catches_a_mask_one_position_off(target, draft, monkeypatch):
    model, tok = target
    ids = tok.encode("Reply in JSON:")
    want, _ = reference(model, tok, ids, GenerateOptions(json_schema=SCHEMA), 120)
    accept = decode.accept

    def one_off(req, drafts, q, logits, a, masks=None):
        if masks is not None and len(masks) > 1:
            masks = np.concatenate([masks[:1], masks[:-1]])
        return accept(req, drafts, q, logits, a, masks)

    monkeypatch.setattr(batch_cycle, "accept", one_off)  # where the engine accepts
    assert run_broken(model, tok, draft, ids, want)


def test_the_check_catches_a_matcher_never_rolled_back(target, draft, monkeypatch):
    model, tok = target
    ids = tok.encode("Reply in JSON:")
    want, _ = reference(model, tok, ids, GenerateOptions(json_schema=SCHEMA), 120)
    monkeypatch.setattr(controls.Grammar, "rollback", lambda self, n: None)
    assert run_broken(model, tok, draft, ids, want)


def test_a_grammar_writing_a_special_token_as_text_is_refused(target):
    """llguidance would allow the token there and then refuse it (a failure mid-reply):
    the grammar is refused up front, saying how to write it."""
    model, tok = target
    with pytest.raises(BadArgument, match="write it bare, as <\\|im_start\\|>"):
        check_grammar(GenerateOptions(grammar='start: "<|im_start|>" "a"'), tok)
    check_grammar(GenerateOptions(grammar='start: <|im_start|> "a"'), tok)
