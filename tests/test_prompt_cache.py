"""PromptCache: a request prefills only what differs from the previous one, losslessly."""

from __future__ import annotations

import pytest

from dflash_mlx import PromptCache, generate, load, stream_generate

from .test_decode import target_greedy


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def pair(request, models_dir, draft):
    model, tok = load(str(models_dir / request.param))
    return request.param, model, tok, draft


def greedy(model, tok, ids, n=12):
    """The target's greedy tokens, ending at its first EOS as generation does."""
    ref = target_greedy(model, ids, n)
    ends = [i for i, t in enumerate(ref) if t in tok.eos_token_ids]
    return ref[: ends[0] + 1] if ends else ref


def run(model, draft, tok, ids, pc, **kw):
    width = 4 if draft is not None else 1
    chunks = list(
        stream_generate(
            model, draft, tok, ids, max_tokens=12, verify_width=width, prompt_cache=pc, **kw
        )
    )
    return [t for c in chunks for t in c.tokens], chunks[0].cached_tokens


def test_second_turn_prefills_only_the_new_tokens(pair):
    name, model, tok, draft = pair
    pc = PromptCache()
    turn1 = tok.encode("def add(a, b):")
    out1, cached1 = run(model, draft, tok, turn1, pc)
    assert cached1 == 0
    turn2 = turn1 + out1 + tok.encode(" and the quick brown fox")
    out2, cached2 = run(model, draft, tok, turn2, pc)
    assert out2 == greedy(model, tok, turn2), f"{name}: reused state changed the output"
    # Everything but the last generated token (never fed to the target); a recurrent
    # target resumes from its snapshot after the last committed cycle.
    assert cached2 == len(turn1) + len(out1) - 1
    turn3 = turn2 + out2 + tok.encode(" print")
    out3, cached3 = run(model, draft, tok, turn3, pc)
    assert out3 == greedy(model, tok, turn3)
    assert cached3 >= len(turn1) - 1


def test_retry_and_divergent_prompts_reuse_their_common_prefix(pair):
    name, model, tok, draft = pair
    pc = PromptCache()
    ids = tok.encode("for i in range(10):\n    print(i * i)")
    out, _ = run(model, draft, tok, ids, pc)
    again, cached = run(model, draft, tok, ids, pc)
    assert again == out and cached == len(ids) - 1
    other = ids[:5] + tok.encode(" the lazy dog")
    diverged, cached = run(model, draft, tok, other, pc)
    assert diverged == greedy(model, tok, other)
    assert cached == (0 if name == "qwen35" else 5)


def test_a_reply_cut_by_a_stop_string_leaves_a_usable_cache(target, draft):
    model, tok = target
    pc = PromptCache()
    ids = tok.encode("The quick brown fox")
    full = generate(model, draft, tok, ids, max_tokens=20, verify_width=8)
    stop = full.text[6:9]
    cut = generate(
        model, draft, tok, ids, max_tokens=20, verify_width=8, stop=stop, prompt_cache=pc
    )
    assert cut.finish_reason == "stop"
    nxt = ids + cut.tokens + tok.encode(" jumps")
    out, cached = run(model, draft, tok, nxt, pc)
    assert out == greedy(model, tok, nxt)
    assert cached > len(ids)


def test_a_cache_from_another_pair_is_not_reused(models_dir, target, draft):
    model, tok = target
    other, _ = load(str(models_dir / "qwen3-4bit"))
    pc = PromptCache()
    ids = tok.encode("import os")
    run(model, draft, tok, ids, pc)
    out, cached = run(other, draft, tok, ids, pc)
    assert cached == 0 and out == greedy(other, tok, ids)
    _, cached = run(other, None, tok, ids, pc)
    assert cached == 0, "a cache built with a draft is not reused without it"
    pc.clear()
    assert len(pc) == 0 and pc.target_cache is None


def test_an_interrupted_prefill_leaves_no_stale_cache(target, draft):
    model, tok = target
    pc = PromptCache()
    ids = tok.encode("def add(a, b):\n    return a + b\n" * 4)
    run(model, draft, tok, ids, pc)

    def interrupt(done, total):
        if done < total:
            raise KeyboardInterrupt

    longer = ids + tok.encode(" for i in range(3): print(i)" * 3)
    with pytest.raises(KeyboardInterrupt):
        run(model, draft, tok, longer, pc, prefill_step=4, prompt_progress=interrupt)
    assert pc.target_cache is None, "a half-prefilled cache must not be reused"
    out, cached = run(model, draft, tok, longer, pc)
    assert cached == 0 and out == greedy(model, tok, longer)


@pytest.mark.parametrize("width", [1, 4])
def test_a_hybrid_target_resumes_after_the_reply_or_else_at_the_prompt(models_dir, draft, width):
    """Recurrent state cannot be trimmed: it is kept before the prompt's last token and
    after the last committed cycle (plain steps and speculative cycles alike)."""
    from .test_decode import ScriptedDraft

    model, tok = load(str(models_dir / "qwen35"))
    pc = PromptCache()
    # Always right at W=4: 13 tokens = 1 + 3 cycles of 4, so replies end on a speculative
    # cycle (at W=1, on a plain step).
    scripted = ScriptedDraft(draft, [], right=lambda c: 99)

    def turn(ids, **kw):
        scripted.script = ids + greedy(model, tok, ids, 13) + [0] * 32
        chunks = list(
            stream_generate(
                model, scripted, tok, ids, max_tokens=13, verify_width=width, prompt_cache=pc, **kw
            )
        )
        out = [t for c in chunks for t in c.tokens]
        assert out == greedy(model, tok, ids, 13)[: len(out)], "reused state changed the output"
        assert chunks[-1].width == width or chunks[-1].finish_reason == "stop"
        return out, chunks[0].cached_tokens, chunks[-1].finish_reason

    turn1 = tok.encode("def add(a, b):")
    out1, _, _ = turn(turn1)
    turn2 = turn1 + out1 + tok.encode(" print")
    out2, cached, _ = turn(turn2)
    assert cached == len(turn1) + len(out1) - 1, "the previous reply was prefilled again"
    # The template rewrote the reply (as thinking blocks are dropped): back to the prompt.
    turn3 = turn2 + [(out2[0] + 1) % 50] + tok.encode(" the lazy dog")
    _, cached, _ = turn(turn3)
    assert cached == len(turn2) - 1
    # A stop string ends the reply while the next cycle is already on the device.
    full = generate(model, draft, tok, turn3, max_tokens=13, verify_width=width).text
    cut, _, reason = turn(turn3, stop=full[4:7])
    assert reason == "stop"
    turn4 = turn3 + cut + tok.encode(" jumps")
    _, cached, _ = turn(turn4)
    assert len(turn3) - 1 <= cached <= len(turn3) + len(cut) - 1
