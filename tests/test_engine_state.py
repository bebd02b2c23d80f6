"""Request state is the request's (issue 13): one draft serves interleaved requests, seeds
replay under the automatic width, and a failure at any stage leaves a PromptCache that
the next request can use as if it were fresh."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from dflash_mlx import GenerateOptions, Pair, PromptCache, generate, load, stream_generate
from dflash_mlx.engine.batch import speculative_decode
from dflash_mlx.engine.sampling import SamplingParams

from .test_decode import PROMPTS

# -- one draft, two requests -----------------------------------------------------------------


def cycles_of(model, draft, ids, params=None, seed=0, **kw):
    """The cycles of one request at W = 4 (greedy, or sampled as `params` says)."""
    p = params or SamplingParams()
    options = GenerateOptions(
        max_tokens=40, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p
    )
    args = dict(width=4, draft_block=4, seed=seed) | kw
    return speculative_decode(Pair(model, draft), ids, options, **args)


def record(cycle):
    return cycle.tokens, cycle.accepted, cycle.width


def interleave(*gens):
    """Advance the generators one cycle each in turn; the records of each."""
    got = [[] for _ in gens]
    live = list(range(len(gens)))
    while live:
        for i in list(live):
            try:
                got[i].append(record(next(gens[i])))
            except StopIteration:
                live.remove(i)
    return got


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_one_draft_serves_two_interleaved_requests(models_dir, draft, name):
    """Two generations through one loaded draft, advanced alternately cycle by cycle,
    commit exactly what each commits alone: the same tokens, the same drafts accepted.

    Greedy, a draft that reads its context position (right at some positions, wrong at
    others); sampled, the real draft (its proposals and q follow its context cache)."""
    from .test_decode import ScriptedDraft, target_greedy

    model, tok = load(str(models_dir / name))
    ids = tok.encode(PROMPTS[0])
    d = ScriptedDraft(draft, ids + target_greedy(model, ids, 40) + [0] * 32, None)
    d.right = lambda c: (d.pos * 7) % 5
    solo = [record(c) for c in cycles_of(model, d, ids)]
    assert 10 < sum(a for _, a, _ in solo) < 3 * len(solo), "partial acceptance expected"
    both = interleave(cycles_of(model, d, ids), cycles_of(model, d, ids))
    assert both == [solo, solo], f"{name}: greedy requests changed when interleaved"

    sampled = SamplingParams(temperature=0.8)
    a_ids, b_ids = ids, tok.encode(PROMPTS[2])
    solo_a = [record(c) for c in cycles_of(model, draft, a_ids, params=sampled, seed=1)]
    solo_b = [record(c) for c in cycles_of(model, draft, b_ids, params=sampled, seed=2)]
    both = interleave(
        cycles_of(model, draft, a_ids, params=sampled, seed=1),
        cycles_of(model, draft, b_ids, params=sampled, seed=2),
    )
    assert both == [solo_a, solo_b], f"{name}: sampled requests changed when interleaved"


# -- seeds replay ----------------------------------------------------------------------------

SEEDED = dict(max_tokens=48, temperature=1.0, seed=3)  # block_size: automatic


def test_a_seed_replays_under_the_automatic_width_after_other_requests(target, draft, monkeypatch):
    """A seeded request's widths follow from the pair's calibrated curves and its own
    tokens, never from what other requests taught the pair's policy (their acceptance,
    their cycles timed on the wall clock). The curves are injected: a re-calibration that
    those timings can trigger on a busy machine must not decide the verdict."""
    from dflash_mlx.speed.costs import CostCurves

    model, tok = target
    pair = Pair(model, draft)
    block = draft.config.block_size
    curves = CostCurves(
        tuple(1e-3 * (1 + 0.1 * (w - 1)) for w in range(1, block + 1)),
        (0.0,) + (1e-4,) * (block - 1),
    )
    monkeypatch.setattr(pair, "costs", lambda **_: curves)
    first = generate(pair, tok, "import os", **SEEDED)
    assert first.verify_width is None, "the width must be the automatic one"
    assert len(first.stats.widths) > 1, f"the widths should vary: {first.stats.widths}"
    # Other requests teach the pair's shared policy, at other settings and without a seed.
    for prompt in PROMPTS:
        generate(pair, tok, prompt, max_tokens=40, temperature=0.7)
    assert pair.policies, "the unseeded requests kept a policy on the pair"
    again = generate(pair, tok, "import os", **SEEDED)
    assert again.tokens == first.tokens
    assert again.stats.widths == first.stats.widths
    other = generate(pair, tok, "import os", **(SEEDED | {"seed": 4}))
    assert other.tokens != first.tokens, "a different seed should sample differently"


def test_a_seed_replays_in_a_fresh_process(models_dir, target, draft):
    """Same prompt, settings and seed in a new process (same calibration cache)."""
    model, tok = target
    mine = generate(model, draft, tok, "import os", **SEEDED).tokens
    code = (
        "import json, sys\n"
        "from dflash_mlx import generate, load, load_draft\n"
        "model, tok = load(sys.argv[1])\n"
        "draft = load_draft(sys.argv[2])\n"
        "generate(model, draft, tok, 'def f(x):', max_tokens=30, temperature=0.5)\n"
        f"r = generate(model, draft, tok, 'import os', **{SEEDED!r})\n"
        "print(json.dumps(r.tokens))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(models_dir / "qwen3"), str(models_dir / "draft")],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == mine


def test_draws_follow_the_position_not_the_cycle(target, draft):
    """A draft the target always rejects: every token is then the target's own draw at its
    position (the residual is p without the proposal), so W = 1 and W = 4 must give the
    same tokens for one seed, although the draws fall in different cycles."""
    from dflash_mlx.models.draft import DFlashDraft

    from .test_decode import target_greedy

    model, tok = target
    ids = tok.encode(PROMPTS[1])
    never = next(t for t in range(2, 300) if t not in target_greedy(model, ids, 40))

    class Refused(DFlashDraft):
        def block_logits(self, anchor, length, rows, state):
            rows = length - 1 if rows is None else rows
            return mx.broadcast_to(mx.eye(self.config.vocab_size)[never] * 30.0, (rows, 320))

    wrong = Refused(draft.config)
    wrong.update(draft.parameters())
    kw = dict(max_tokens=30, temperature=0.05, seed=11)
    plain = generate(model, None, tok, ids, **kw)
    wide = generate(model, wrong, tok, ids, verify_width=4, **kw)
    assert wide.cycles == 29 and wide.mean_acceptance == 1.0, "every draft rejected"
    assert wide.tokens == plain.tokens


# -- failures leave a usable PromptCache -----------------------------------------------------


class Boom(Exception):
    pass


def fails_on(n: int, real, when=lambda *a: True):
    """`real`, except that its `n`-th call for which `when(*args)` holds raises `Boom`."""
    seen = [0]

    def wrapper(*args, **kwargs):
        if when(*args):
            seen[0] += 1
            if seen[0] == n:
                raise Boom(getattr(real, "__name__", "call"))
        return real(*args, **kwargs)

    return wrapper


def run_tokens(pair, tok, ids, pc, **kw):
    stream = stream_generate(pair, tok, ids, max_tokens=16, verify_width=4, prompt_cache=pc, **kw)
    return [t for r in stream for t in r.tokens]


def injections(pair, tok):
    """Stage -> (patch installer, extra stream_generate arguments)."""
    import dflash_mlx.engine.walks as walks
    from dflash_mlx.engine.text import StopMatcher

    adapter = pair.target
    detok = type(tok.detokenizer)

    def chunks(tokens, *_):
        return tokens.shape[1] > 1 and tokens.shape[1] != 4

    def verifies(tokens, *_):
        return tokens.shape[1] == 4

    return {
        "prefill chunk": (
            lambda m: m.setitem(vars(adapter), "forward", fails_on(2, adapter.forward, chunks)),
            {"prefill_step": 8},
        ),
        "draft": (lambda m: m.setattr(walks, "propose", fails_on(2, walks.propose)), {}),
        "verify": (
            lambda m: m.setitem(vars(adapter), "forward", fails_on(2, adapter.forward, verifies)),
            {},
        ),
        "detokenizer": (lambda m: m.setattr(detok, "add_token", fails_on(5, detok.add_token)), {}),
        "stop matcher": (
            lambda m: m.setattr(StopMatcher, "feed", fails_on(3, StopMatcher.feed)),
            {"stop": ["zzzz"]},
        ),
    }


STAGES = [
    "prefill chunk",
    "draft",
    "verify",
    "detokenizer",
    "stop matcher",
    "consumer",
    "abandoned stream",
    "server disconnect",
]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_a_failure_at_any_stage_leaves_a_cache_the_next_request_can_use(
    models_dir, draft, name, stage, monkeypatch
):
    """A request fails at one stage (or its stream is dropped); then a request through the
    same PromptCache gives what a fresh request gives, and leaves a cache the one after
    can use too."""
    model, tok = load(str(models_dir / name))
    pair = Pair(model, draft)
    ids = tok.encode(" ".join(PROMPTS) * 2)
    nxt = ids + tok.encode(" return a + b")
    other = tok.encode(" ".join(reversed(PROMPTS)) * 2)
    want = run_tokens(pair, tok, nxt, None)
    pc = PromptCache()
    run_tokens(pair, tok, ids, pc)
    late = None
    if stage in ("consumer", "abandoned stream", "server disconnect"):
        stream = stream_generate(pair, tok, ids, max_tokens=16, verify_width=4, prompt_cache=pc)
        shown = next(stream).tokens + next(stream).tokens
        if stage == "consumer":
            with pytest.raises(Boom):
                for i, _ in enumerate(stream):
                    if i == 1:
                        raise Boom("consumer")
            del stream  # the consumer's loop is gone: the stream is collected
        elif stage == "server disconnect":
            stream.close()  # what the server does when its client goes away
        else:
            late = stream  # abandoned: closed late, after the next request ended
    else:
        install, extra = injections(pair, tok)[stage]
        with monkeypatch.context() as m:
            install(m)
            with pytest.raises(Boom):  # another prompt: it would rewrite the reused caches
                run_tokens(pair, tok, other, pc, **extra)
    got = run_tokens(pair, tok, nxt, pc)
    assert got == want, f"{name}: after a failure in the {stage}"
    if late is not None:
        # The abandoned stream ends now: it must not replace the newer request's state
        # with one claiming its own tokens (a prompt continuing them would trust it).
        late.close()
        cont = ids + shown + tok.encode(" print")
        cont_want = run_tokens(pair, tok, cont, None)
        assert run_tokens(pair, tok, cont, pc) == cont_want, f"{name}: {stage}"
    again = run_tokens(pair, tok, nxt, pc)
    assert again == want, f"{name}: the cache left after the {stage} is not usable"


def test_a_late_commit_never_overwrites_a_newer_request():
    pc = PromptCache()
    lease_a, _ = pc.take("model", "draft")
    lease_b, _ = pc.take("model", "draft")
    assert not pc.commit(lease_a, object()), "A's lease ended when B took the cache"
    assert pc.state is None
    assert pc.commit(lease_b, "state") and pc.state == "state"


def test_the_owner_check_is_identity_not_equality(target, draft):
    """An `nn.Module` is a dict: `==` would compare weights. Two equal drafts are two."""
    from dflash_mlx.models.draft import DFlashDraft

    model, tok = target
    twin = DFlashDraft(draft.config)
    twin.update(draft.parameters())
    pc = PromptCache()
    ids = tok.encode(PROMPTS[0])
    list(stream_generate(model, draft, tok, ids, max_tokens=8, verify_width=4, prompt_cache=pc))
    chunks = list(
        stream_generate(model, twin, tok, ids, max_tokens=8, verify_width=4, prompt_cache=pc)
    )
    assert chunks[0].cached_tokens == 0, "another draft object must not reuse the state"
