"""The first invariant: greedy DFlash output equals the target's own greedy decode."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import generate, load
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.speed.costs import CostCurves
from dflash_mlx.speed.policy import AutoPolicy
from dflash_mlx.speed.port import Plan

from .sim import SimClock, decode, plans, records, tokens

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "for i in range(10):\n    print(",
]


def target_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Plain mlx-lm greedy decoding: the reference every DFlash run must reproduce."""
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=n, sampler=lambda x: x.argmax(-1))
    return [int(t) for t, _ in steps]


class ScriptedDraft(DFlashDraft):
    """A draft whose proposals are read from a script instead of computed.

    `script` is the full greedy sequence (prompt + continuation); at each cycle the draft
    proposes its next tokens, corrupted from block index `right(cycle)` on (`self.pos` is
    the anchor's position then). The anchor's position is where the draft's context ends,
    which the engine must keep exact.
    """

    def __init__(self, base: DFlashDraft, script: list[int], right):
        super().__init__(base.config)
        self.update(base.parameters())
        self.script = script
        self.right = right
        self.calls = 0
        self.pos = 0

    def block_logits(self, anchor, length, rows, state):
        pos = self.pos = state.context_end
        assert self.script[pos] == anchor.item(), "draft context length out of sync"
        vocab = self.config.vocab_size
        want = []
        for i in range(1, length):
            t = self.script[pos + i] if pos + i < len(self.script) else 0
            if i > self.right(self.calls):
                t = (t + 1) % vocab
            want.append(t)
        self.calls += 1
        return (mx.eye(vocab)[mx.array(want)] * 30.0)[:rows]


class PlainButWarm:
    """A width policy (`speed.port.Policy`) that plans a plain step every cycle, keeping the
    draft's context current (features captured at every plain pass, as before a probe)."""

    window = 0

    def __init__(self, block: int):
        self.block = block

    def begin(self, tokens):
        from dflash_mlx.speed.port import Ticket

        return Ticket([0.0] * self.block, [0.0] * self.block, tokens)

    def plan(self, asks, rows=0):
        # Plain for good: the plan stands (a stretch runs on without planning again).
        return Plan((1,) * len(asks), (1,) * len(asks), capture=True, stands=1 << 20)

    def learn(self, record):
        pass

    def forget(self):
        pass


@pytest.fixture(scope="module", params=["qwen3", "qwen3-4bit", "qwen35"])
def any_target(request, models_dir):
    return request.param, *load(str(models_dir / request.param))


@pytest.mark.parametrize("width", [1, 2, 4, 8, 16])
def test_greedy_dflash_equals_target_greedy(any_target, draft, width):
    name, model, tok = any_target
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ref = target_greedy(model, ids, 40)
        out = generate(model, draft, tok, ids, max_tokens=40, verify_width=width)
        assert out.tokens == ref, f"{name} W={width} diverged on {prompt!r}"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("width", [2, 5, 16])
def test_partially_right_drafts_rewind_exactly(any_target, draft, width):
    """Acceptance lengths vary cycle to cycle, so every rewind depth is exercised."""
    name, model, tok = any_target
    ids = tok.encode(PROMPTS[0])
    ref = target_greedy(model, ids, 60)
    scripted = ScriptedDraft(draft, ids + ref, right=lambda c: (c * 7) % 17)
    out = generate(model, scripted, tok, ids, max_tokens=60, verify_width=width)
    assert out.tokens == ref, f"{name} W={width}: rewind corrupted the target state"
    assert 1 < out.mean_acceptance < width, "the script should give partial acceptance"


def test_always_right_draft_is_accepted_whole(target, draft):
    model, tok = target
    ids = tok.encode(PROMPTS[1])
    ref = target_greedy(model, ids, 1 + 16 * 4)
    oracle = ScriptedDraft(draft, ids + ref, right=lambda c: 99)
    out = generate(model, oracle, tok, ids, max_tokens=1 + 16 * 4, verify_width=16)
    assert out.tokens == ref
    assert out.cycles == 4 and out.mean_acceptance == 16.0
    assert out.acceptance_rates == [1.0] * 15


def test_always_wrong_draft_still_gives_target_output(target, draft):
    model, tok = target
    ids = tok.encode(PROMPTS[2])
    ref = target_greedy(model, ids, 30)
    wrong = ScriptedDraft(draft, ids + ref, right=lambda c: 0)
    out = generate(model, wrong, tok, ids, max_tokens=30, verify_width=8)
    assert out.tokens == ref
    assert out.mean_acceptance == 1.0 and out.cycles == 29
    assert out.acceptance_rates == [0.0] * 7


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 10, 23])
def test_max_tokens_inside_a_block(target, draft, max_tokens):
    model, tok = target
    ids = tok.encode(PROMPTS[0])
    ref = target_greedy(model, ids, max_tokens)
    oracle = ScriptedDraft(draft, ids + ref + [0] * 32, right=lambda c: 99)
    out = generate(model, oracle, tok, ids, max_tokens=max_tokens, verify_width=16)
    assert out.tokens == ref and len(out.tokens) == max_tokens
    assert out.finish_reason == "length"
    assert out.verify_width == 16, "the request's width, even when the budget capped a cycle"


def test_eos_inside_an_accepted_block_stops_there(target, draft):
    model, tok = target
    ids = tok.encode(PROMPTS[1])
    ref = target_greedy(model, ids, 40)
    # An EOS that the target emits mid-way (first occurrence at index j >= 3).
    j = next(i for i in range(3, 40) if ref[i] not in ref[:i])
    old = set(tok.eos_token_ids)
    tok.eos_token_ids = {ref[j]}
    try:
        oracle = ScriptedDraft(draft, ids + ref, right=lambda c: 99)
        out = generate(model, oracle, tok, ids, max_tokens=40, verify_width=16)
        expect_text = tok.decode(ref[:j])
    finally:
        tok.eos_token_ids = old
    assert out.tokens == ref[: j + 1], "EOS must end the output inside the accepted block"
    assert out.finish_reason == "stop"
    assert out.text == expect_text, "the EOS token itself is not rendered"


def test_chat_messages_and_stop_strings(target, draft):
    model, tok = target
    msgs = [{"role": "user", "content": "hello"}]
    full = generate(model, draft, tok, msgs, max_tokens=30, verify_width=4)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert full.tokens == target_greedy(model, list(ids), 30)
    stop = full.text[5:8]
    assert stop
    cut = generate(model, draft, tok, msgs, max_tokens=30, verify_width=4, stop=[stop])
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop"
    # A right draft commits 8 tokens a cycle: the reply still ends at the token that
    # completed the stop string, and only the tokens up to it are returned and counted.
    oracle = ScriptedDraft(draft, list(ids) + full.tokens + [0] * 32, right=lambda c: 99)
    text = full.text
    stop = next(text[i : i + 2] for i in range(2, len(text)) if text[i : i + 2].isalnum())
    cut = generate(model, oracle, tok, msgs, max_tokens=30, verify_width=8, stop=[stop])
    n = len(cut.tokens)
    assert n < len(full.tokens) and cut.tokens == full.tokens[:n] and cut.generation_tokens == n
    assert stop in tok.decode(cut.tokens) and stop not in tok.decode(cut.tokens[:-1])
    assert cut.mean_acceptance > 4, "the cycles did commit whole blocks"


def test_stream_text_joins_to_the_decoded_tokens(target, draft):
    from dflash_mlx import stream_generate

    model, tok = target
    ids = tok.encode(PROMPTS[2])
    chunks = list(stream_generate(model, draft, tok, ids, max_tokens=25, verify_width=8))
    tokens = [t for c in chunks for t in c.tokens]
    assert "".join(c.text for c in chunks) == tok.decode(tokens, skip_special_tokens=True)
    assert chunks[-1].finish_reason == "length" and all(
        c.finish_reason is None for c in chunks[:-1]
    )
    assert chunks[-1].generation_tokens == 25 and chunks[-1].prompt_tokens == len(ids)


def test_bad_generation_arguments_name_the_value(target, draft):
    model, tok = target
    for kwargs, word in [
        ({"verify_width": 17}, "verify_width 17"),
        ({"verify_width": 0}, "verify_width 0"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
    ]:
        with pytest.raises(ValueError, match=word):
            generate(model, draft, tok, "hi", **kwargs)
    with pytest.raises(ValueError, match="empty"):
        generate(model, draft, tok, [], max_tokens=3)


def test_a_prompt_longer_than_the_context_is_the_callers_error(target, draft, monkeypatch):
    from dflash_mlx.errors import ContextTooLong, UserError

    model, tok = target
    ids = tok.encode(PROMPTS[0])
    monkeypatch.setattr(model.args, "max_position_embeddings", len(ids))
    with pytest.raises(ContextTooLong, match=f"{len(ids)} tokens .* context of {len(ids)}"):
        generate(model, draft, tok, ids, max_tokens=3)
    monkeypatch.setattr(model.args, "max_position_embeddings", len(ids) + 1)
    assert len(generate(model, draft, tok, ids, max_tokens=3).tokens) == 3
    assert issubclass(ContextTooLong, UserError)


def test_bad_arguments_are_the_callers_errors(target, draft):
    """Every argument error is a UserError (the CLI's exit 2, the server's 4xx)."""
    from dflash_mlx.errors import UserError

    model, tok = target
    for kwargs in [{"verify_width": 17}, {"max_tokens": 0}, {"temperature": -1.0}, {"top_k": -1}]:
        with pytest.raises(UserError):
            generate(model, draft, tok, "hi", **kwargs)
    for prompt in ([], [{"role": "user"}], 3.5):
        with pytest.raises(UserError):
            generate(model, draft, tok, prompt, max_tokens=3)


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_chunked_prefill_equals_the_target(models_dir, draft, name, monkeypatch):
    """A prompt longer than the prefill step is processed in chunks, reporting progress;
    the last prompt token goes alone, so the LM head never runs over the prompt."""
    from dflash_mlx import Pair

    model, tok = load(str(models_dir / name))
    ids = tok.encode(" ".join(PROMPTS) * 3)
    assert len(ids) > 40
    ref = target_greedy(model, ids, 20)
    pair = Pair(model, draft)
    adapter = pair.target
    passes, real_forward = [], adapter.forward

    def forward(tokens, cache, capture_ids):
        passes.append(tokens.shape[1])
        return real_forward(tokens, cache, capture_ids)

    monkeypatch.setitem(vars(adapter), "forward", forward)  # undo: the class method again
    seen = []
    out = generate(
        pair,
        tok,
        ids,
        max_tokens=20,
        verify_width=4,
        prefill_step=16,
        prompt_progress=lambda done, total: seen.append((done, total)),
    )
    assert out.tokens == ref
    assert seen[0] == (16, len(ids)) and seen[-1] == (len(ids), len(ids))
    chunks = [16] * ((len(ids) - 1) // 16) + ([(len(ids) - 1) % 16] if (len(ids) - 1) % 16 else [])
    assert passes[: len(chunks) + 1] == chunks + [1], passes


def test_the_first_token_does_not_wait_for_the_drafts_context(target, draft, monkeypatch):
    """A speculating request's prefill evaluates the draft's context chunk by chunk (memory
    stays bounded), all but the chunk that ends at the prompt's last token but one: that
    one is left to the first cycle, so the first token comes straight after the target's
    prefill, as plain decoding's does (its TTFT). Output stays the target's."""
    from dflash_mlx import Pair, stream_generate

    model, tok = target
    ids = tok.encode(" ".join(PROMPTS) * 3)
    assert len(ids) > 40
    made: dict[int, int] = {}  # id of a draft context array -> context rows it holds
    evaluated: list[int] = []  # the context rows of each draft array evaluated so far
    first = []
    add, real_eval = DFlashDraft.add_context, mx.eval

    def add_context(self, feats, state):
        add(self, feats, state)
        made.update((id(a), state.context_length) for a in state.arrays)

    def spy(*args):
        todo = list(args)
        while todo:
            a = todo.pop()
            if isinstance(a, (list, tuple)):
                todo.extend(a)
            elif id(a) in made:
                evaluated.append(made[id(a)])
        return real_eval(*args)

    monkeypatch.setattr(DFlashDraft, "add_context", add_context)
    monkeypatch.setattr(mx, "eval", spy)
    got = []
    for r in stream_generate(
        Pair(model, draft), tok, ids, max_tokens=20, verify_width=4, prefill_step=16
    ):
        first.append(True)
        got += r.tokens
        if len(first) == 1:  # the first token is out: what was evaluated before it
            before, evaluated[:] = list(evaluated), []
    assert got == target_greedy(model, ids, 20)
    whole = (len(ids) - 1) // 16 * 16  # the chunks before the one that ends at len - 1
    assert before and max(before) == whole, (
        f"before the first token the draft's context was evaluated up to {max(before or [0])}"
        f" rows; the chunks before the prompt's last token but one hold {whole}"
    )
    # The first cycle evaluates the rest before it runs (so that no cycle the policy
    # learns from pays for the prompt's context).
    assert evaluated and evaluated[0] == len(ids), evaluated


def test_quantized_targets_default_to_the_capped_verify_width(models_dir, draft):
    from dflash_mlx import Pair
    from dflash_mlx.pair import QUANTIZED_VERIFY_CAP

    q_model, _ = load(str(models_dir / "qwen3-4bit"))
    f_model, _ = load(str(models_dir / "qwen3"))
    assert Pair(q_model, draft).default_verify_width() == QUANTIZED_VERIFY_CAP == 5
    assert Pair(f_model, draft).default_verify_width() == draft.config.block_size
    assert Pair(f_model).default_verify_width() == 1


def test_automatic_width_is_lossless(any_target, draft):
    """W and L chosen per cycle (measured costs + acceptance) still give the target's output."""
    name, model, tok = any_target
    ids = tok.encode(PROMPTS[0])
    ref = target_greedy(model, ids, 60)
    for d in (draft, ScriptedDraft(draft, ids + ref + [0] * 32, right=lambda c: (c * 5) % 17)):
        out = generate(model, d, tok, ids, max_tokens=60)
        assert out.tokens == ref, f"{name}: automatic width diverged"
        assert out.verify_width is None


def flat_curves(block: int, step: float = 1e-3):
    """A calibration that says speculation is free: every verify costs a plain step and the
    draft nothing (it never says W = 1 pays)."""
    return CostCurves((step,) * block, (0.0,) * block)


@pytest.mark.parametrize("device", ["steep", "flat"])
def test_automatic_width_falls_back_to_plain_decoding_for_a_useless_draft(target, draft, device):
    """The random draft is never right. Its calibration says speculation costs nothing;
    the (simulated) device says a cycle of W tokens costs 1 + (W - 1) / 2 plain steps: the
    policy learns that from the cycles it runs and decodes plainly, probing now and then.
    On a device where speculation really is free, it keeps speculating: the fallback comes
    from the costs, not from the draft alone."""
    from dflash_mlx import Pair

    model, tok = target
    block = draft.config.block_size
    steep = device == "steep"
    truth = CostCurves(
        tuple(1e-3 * (1 + (w - 1) / 2 if steep else 1) for w in range(1, block + 1)),
        (0.0,) * block,
    )
    ids = tok.encode(PROMPTS[1])
    policy = AutoPolicy(flat_curves(block), block)
    cycles, events = decode(Pair(model, draft), ids, 120, policy, clock=SimClock(truth))
    assert tokens(cycles) == target_greedy(model, ids, 120)
    # A plain cycle of k tokens: k plain steps (a stretch's), each a pass.
    widths = [w for c in cycles[1:] for w in ([1] * c.steps if c.width == 1 else [c.width])]
    passes = [e for e in events if e.kind in ("plain", "verify")]
    assert len(passes) >= len(widths), "every cycle was charged"
    plain = sum(w == 1 for w in widths)
    if steep:
        assert plain >= 0.8 * len(widths), f"a never-right draft kept being verified: {widths}"
        assert widths[0] > 1, "the calibration alone says speculate"
    else:
        # Plain only where the token budget leaves one token (the last cycle).
        assert 1 not in widths[:-1], f"free speculation was given up: {widths}"


# Wide verifies nearly free, so right drafts pay; a probe loses about a fifth of a plain
# step, so that probes come every ten plain steps or so, and the draft sleeps between.
DORMANT = CostCurves(
    tuple(1.0 + 0.05 * w for w in range(16)), (0.0,) + (0.1,) * 15, context=0.01, lazy=0.01
)


def dormant_policy(window: int = 4, costs: CostCurves = DORMANT) -> AutoPolicy:
    """A policy on synthetic costs (the simulated device's, `auto_decode`) that probes
    often enough for a short test and goes dormant between probes (a `window` shorter
    than the plain steps between them)."""
    policy = AutoPolicy(costs, 16)
    policy.window = window
    return policy


def auto_decode(model, d, ids, n, policy, prompt_cache=None):
    """`model`: a target model, or a Pair (then `d` must be its draft). Decodes on a device
    whose passes cost what the policy's curves say: (cycles, events)."""
    from dflash_mlx import Pair

    pair = model if isinstance(model, Pair) else Pair(model, d)
    assert pair.draft is d
    clock = SimClock(policy.table.curves)
    return decode(pair, ids, n, policy, clock=clock, prompt_cache=prompt_cache)


def test_a_dormant_draft_wakes_on_a_window_of_context_and_stays_lossless(target, draft):
    """Never-right drafts: plain steps stop capturing features. Once the drafts turn right,
    a probe wakes the draft on a window of fresh context, at exact positions."""
    model, tok = target
    ids = tok.encode(PROMPTS[2])
    n = 160
    ref = target_greedy(model, ids, n)
    wake = len(ids) + 80
    d = ScriptedDraft(draft, ids + ref + [0] * 32, right=lambda c: 99 if d.pos >= wake else 0)
    cycles, events = auto_decode(model, d, ids, n, dormant_policy())
    assert tokens(cycles) == ref
    woke = next(i for i, e in enumerate(events) if e.kind == "learn" and e.detail.accepted[0] >= 8)
    before = plans(events[:woke])  # all before the drafts turn right
    assert any(not p.capture for p in before), "plain steps kept capturing features"
    assert any(p.probe for p in before), "speculation was never probed"
    assert all(p.capture for p in plans(events) if max(p.widths) > 1), "a draft without features"
    late = [c for c in cycles if c.width > 1 and c.accepted >= 8]
    assert len(late) >= 3, "right drafts did not wake the draft up"


def test_a_dormant_request_leaves_a_prompt_cache_the_next_turn_reuses(target, draft):
    from dflash_mlx import PromptCache

    model, tok = target
    turn1 = tok.encode(PROMPTS[0])
    ref1 = target_greedy(model, turn1, 60)
    d = ScriptedDraft(draft, turn1 + ref1 + [0] * 32, right=lambda c: 0)
    pc = PromptCache()
    cycles, events = auto_decode(model, d, turn1, 60, dormant_policy(), pc)
    out1 = tokens(cycles)
    assert out1 == ref1 and not plans(events)[-1].capture, "the request should end dormant"
    kept = pc.state
    assert kept.draft_end == len(turn1) + len(out1) - 1, "the dormant stretch: a gap"
    assert kept.draft.context_length >= len(turn1), "the prompt's context was kept"
    turn2 = turn1 + out1 + tok.encode(" print")
    ref2 = target_greedy(model, turn2, 40)
    d.script, d.right = turn2 + ref2 + [0] * 32, lambda c: 99
    cycles, _ = auto_decode(model, d, turn2, 40, dormant_policy(), pc)
    assert cycles[0].reused == len(turn1) + len(out1) - 1
    assert tokens(cycles) == ref2
    assert any(c.accepted >= 8 for c in cycles), "the reused context should draft right away"


def test_a_dormant_prefills_window_is_not_computed_for_a_probe_that_never_comes(target, draft):
    """Where speculation cannot pay, the prefill keeps the draft's context deferred
    (`Request.pending`, unevaluated) for a probe. A request that makes none must leave it
    unfed: fed as the draft went dormant, the first cycle computed it (21 ms a request at
    1k tokens, 0.96x forced plain). The next turn feeds it at its place, before the gap."""
    from dflash_mlx import PromptCache

    model, tok = target
    turn1 = tok.encode(PROMPTS[0])
    ref1 = target_greedy(model, turn1, 40)
    d = ScriptedDraft(draft, turn1 + ref1 + [0] * 32, right=lambda c: 0)
    steep = CostCurves(tuple(1.0 + w for w in range(16)), (0.0,) + (0.1,) * 15)
    pc = PromptCache()
    cycles, events = auto_decode(model, d, turn1, 40, dormant_policy(costs=steep), pc)
    assert tokens(cycles) == ref1
    assert all(c.width <= 1 for c in cycles), "the test shows nothing"
    assert not any(p.probe for p in plans(events)), "the test shows nothing"
    kept = pc.state
    assert kept.draft_end == len(turn1) + len(ref1) - 1, "the request should end dormant"
    assert kept.draft.context_length == 0, "the deferred window was fed with no probe to read it"
    assert sum(p.shape[1] for p in kept.pending) >= 1, "the deferred window was dropped"
    turn2 = turn1 + ref1 + tok.encode(" print")
    ref2 = target_greedy(model, turn2, 40)
    d.script, d.right = turn2 + ref2 + [0] * 32, lambda c: 99
    cycles, _ = auto_decode(model, d, turn2, 40, dormant_policy(), pc)
    assert tokens(cycles) == ref2
    assert any(c.accepted >= 8 for c in cycles), "the fed window stood at the wrong positions"


def test_each_cycle_is_charged_what_it_cost_wherever_its_launch_fell(target, draft):
    """On a CPU most of a pass runs inside its launch, and a plain step launches the next
    cycle before waiting: the policy must still learn each cycle's own cost. A simulated
    device whose target passes cost 1 + W units for W tokens (drafting and catching up
    nothing) makes costs exact."""
    from dflash_mlx import Pair

    model, tok = target
    ids = tok.encode(PROMPTS[1])
    ref = target_greedy(model, ids, 80)
    # Stretches of right and of wrong drafts: probes, runs of speculative cycles, and plain
    # steps after either.
    d = ScriptedDraft(draft, ids + ref + [0] * 32, right=lambda c: 99 if (d.pos // 20) % 2 else 0)
    units = CostCurves(tuple(1.0 + w for w in range(1, 17)), (0.0,) * 16, context=0.0, lazy=0.0)
    policy = AutoPolicy(units, 16)
    cycles, events = decode(Pair(model, d), ids, 80, policy, clock=SimClock(units))
    assert tokens(cycles) == ref
    seen = [(max(r.widths), r.seconds) for r in records(events) if r.seconds is not None]
    kinds = {(a > 1, b > 1) for (a, _), (b, _) in zip(seen, seen[1:])}
    assert kinds == {(False, False), (False, True), (True, False), (True, True)}, kinds
    assert all(s == 1.0 + w for w, s in seen), [x for x in seen if x[1] != 1.0 + x[0]]


# -- the draft window ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_a_draft_window_stays_lossless_and_bounds_the_drafts_memory(models_dir, draft, name):
    """Windowed decoding past the point where old rows are dropped: the scripted draft
    checks that its context ends exactly at each anchor, the real one runs the attention."""
    from dflash_mlx import PromptCache
    from dflash_mlx.models.draft import FORGET_SLACK

    model, tok = load(str(models_dir / name))
    ids = tok.encode(PROMPTS[0] * 6)
    n = FORGET_SLACK + 60
    ref = target_greedy(model, ids, n)
    scripted = ScriptedDraft(draft, ids + ref + [0] * 32, right=lambda c: (c * 5) % 9)
    for d in (scripted, draft):
        pc = PromptCache()
        out = generate(
            model, d, tok, ids, max_tokens=n, verify_width=8, draft_window=8, prompt_cache=pc
        )
        assert out.tokens == ref, f"{name}: a windowed draft changed the output"
        st, pending = pc.state.draft, sum(f.shape[1] for f in pc.state.pending)
        assert st.keep == 7 and st.context_length <= 7 + FORGET_SLACK
        assert st.context_end + pending == len(ids) + n - 1
        if d is scripted:
            assert scripted.calls > 10 and 1 < out.mean_acceptance


def projected_rows(monkeypatch) -> list[int]:
    """The rows of target features each `DFlashDraft.add_context` call projects, as made."""
    rows = []
    add = DFlashDraft.add_context
    monkeypatch.setattr(
        DFlashDraft, "add_context", lambda self, f, st: (rows.append(f.shape[1]), add(self, f, st))
    )
    return rows


def test_prefill_projects_only_the_positions_the_window_shows(target, draft, monkeypatch):
    model, tok = target
    ids = tok.encode(PROMPTS[1] * 8)
    assert len(ids) > 100
    rows = projected_rows(monkeypatch)
    out = generate(model, draft, tok, ids, max_tokens=1, verify_width=4, draft_window=16)
    assert sum(rows) == 15, f"prefill projected {sum(rows)} rows for a window of 16"
    rows.clear()
    generate(model, draft, tok, ids, max_tokens=1, verify_width=4)
    assert sum(rows) == len(ids), "without a window the whole prompt is the draft's context"
    assert out.tokens == target_greedy(model, ids, 1)


@pytest.mark.parametrize("name", ["qwen3", "qwen35"])
def test_a_sink_and_window_stay_lossless_and_keep_the_prompts_first_rows(models_dir, draft, name):
    """Sink + window past the point where the rows between are dropped: the scripted draft
    checks its context ends at each anchor, the real one attends over sink and window;
    the sink's rows are the prompt's first positions, captured in prefill."""
    from dflash_mlx import PromptCache
    from dflash_mlx.models.draft import FORGET_SLACK

    model, tok = load(str(models_dir / name))
    ids = tok.encode(PROMPTS[0] * 6)
    n = FORGET_SLACK + 40
    ref = target_greedy(model, ids, n)
    scripted = ScriptedDraft(draft, ids + ref + [0] * 32, right=lambda c: (c * 5) % 9)
    for d in (scripted, draft):
        pc = PromptCache()
        out = generate(
            model,
            d,
            tok,
            ids,
            max_tokens=n,
            verify_width=8,
            draft_window=8,
            draft_sink=4,
            prompt_cache=pc,
        )
        assert out.tokens == ref, f"{name}: a sink changed the output"
        st, pending = pc.state.draft, sum(f.shape[1] for f in pc.state.pending)
        assert (st.keep, st.sink, st.base) == (7, 4, 0)
        assert st.gaps[0][0] == 4, "the sink's rows are not the prompt's first positions"
        assert st.context_length <= 4 + 7 + FORGET_SLACK
        assert st.context_end + pending == len(ids) + n - 1
        if d is scripted:
            assert scripted.calls > 10 and 1 < out.mean_acceptance


def test_prefill_projects_the_sink_and_the_window_only(target, draft, monkeypatch):
    model, tok = target
    ids = tok.encode(PROMPTS[1] * 8)
    assert len(ids) > 100
    rows = projected_rows(monkeypatch)
    out = generate(
        model, draft, tok, ids, max_tokens=1, verify_width=4, draft_window=16, draft_sink=5
    )
    assert rows[0] == 5 and sum(rows) == 5 + 15, f"prefill projected {rows}"
    assert out.tokens == target_greedy(model, ids, 1)


def test_bad_draft_sinks_are_the_callers_errors(target, draft):
    from dflash_mlx.errors import BadArgument

    model, tok = target
    for bad in (-1, "4", 2.5, True):
        with pytest.raises(BadArgument, match=f"draft_sink {bad!r}"):
            generate(model, draft, tok, "hi", max_tokens=3, draft_window=8, draft_sink=bad)


def test_a_conversation_resumes_under_another_draft_window(target, draft):
    from dflash_mlx import PromptCache

    model, tok = target
    turn1 = tok.encode(PROMPTS[2] * 4)
    ref1 = target_greedy(model, turn1, 50)
    d = ScriptedDraft(draft, turn1 + ref1 + [0] * 32, right=lambda c: (c * 3) % 7)
    pc = PromptCache()
    assert (
        generate(model, d, tok, turn1, max_tokens=50, verify_width=6, prompt_cache=pc).tokens
        == ref1
    )
    turn2 = turn1 + ref1 + tok.encode(" print")
    ref2 = target_greedy(model, turn2, 40)
    d.script = turn2 + ref2 + [0] * 32
    from dflash_mlx import stream_generate

    chunks = list(
        stream_generate(
            model, d, tok, turn2, max_tokens=40, verify_width=6, draft_window=12, prompt_cache=pc
        )
    )
    assert [t for c in chunks for t in c.tokens] == ref2
    assert chunks[-1].cached_tokens > len(turn1)
    assert pc.state.draft.keep == 11, "the second turn's window was not applied"


def test_bad_draft_windows_are_the_callers_errors(target, draft):
    from dflash_mlx.errors import BadArgument

    model, tok = target
    for bad in (1, 0, -4, "8", 2.5, True):
        with pytest.raises(BadArgument, match=f"draft_window {bad!r}"):
            generate(model, draft, tok, "hi", max_tokens=3, draft_window=bad)


# -- one engine: what a request alone gets from it ------------------------------------------


@pytest.mark.parametrize(
    "kind", ["sampled", "penalised", "logprobs", "capturing", "recurrent-cached"]
)
def test_a_request_alone_chains_its_plain_passes_and_decodes_the_same(
    models_dir, draft, kind, monkeypatch
):
    """A row alone decoding plainly launches each pass on the last one's device token
    before that token reaches the host (as mlx-lm chains its steps), whatever it samples,
    processes, reports or keeps; and what it decodes is what the same request decodes
    with every pass waiting for the host."""
    from dflash_mlx import GenerateOptions, Pair, PromptCache
    from dflash_mlx.engine import batch as batch_mod
    from dflash_mlx.engine import batch_cycle

    name = "qwen35" if kind == "recurrent-cached" else "qwen3"
    model, tok = load(str(models_dir / name))
    ids = tok.encode(PROMPTS[0])
    opts = {
        "sampled": GenerateOptions(max_tokens=24, temperature=0.8, seed=5, verify_width=1),
        "penalised": GenerateOptions(max_tokens=24, repetition_penalty=1.3, verify_width=1),
        "logprobs": GenerateOptions(max_tokens=24, logprobs=3, verify_width=1),
        # Automatic width on a draft the policy keeps dormant-free: plain cycles capture.
        "capturing": GenerateOptions(max_tokens=24),
        "recurrent-cached": GenerateOptions(max_tokens=24, verify_width=1),
    }[kind]
    pair = Pair(model, draft)
    block = draft.config.block_size

    def run():
        dec = batch_mod.BatchDecoder(pair, tok, max_batch=1)
        cache = PromptCache() if kind == "recurrent-cached" else None
        row = dec.submit(ids, opts, prompt_cache=cache)
        if kind == "capturing":
            # Automatic width kept plain, with the draft's context kept warm (features
            # captured at every plain pass, as before a probe).
            row.plan = (block, block, PlainButWarm(block))
        out = [r for r in dec.run(row)]
        if kind == "capturing":  # each plain pass fed the draft its features
            assert out[-1].stats.draft == "active" and out[-1].stats.plain_tokens >= 20
        return [t for r in out for t in r.tokens], [r.logprobs for r in out], dec.chained

    tokens, logprobs, chained = run()
    assert chained >= len(tokens) - 4, f"{kind}: {chained} of {len(tokens)} passes chained"
    monkeypatch.setattr(batch_cycle, "plain", lambda *a: False)  # every pass waits
    want, want_lp, unchained = run()
    assert unchained == 0
    assert tokens == want, f"{kind}: a chained pass changed the reply"
    if kind == "logprobs":
        assert logprobs == want_lp and all(lp for lp in logprobs)


def test_a_request_alone_has_its_first_decode_pass_in_flight_when_its_first_token_goes_out(
    target, draft
):
    """As mlx-lm's loop launches its next step before it yields a token, a request alone
    that decodes plainly launches the pass after its first token as soon as that token is
    read: when the first response is handed out, the pass is in flight, and it is the
    decode's first cycle. Not for a request with others waiting (the next step admits
    them), nor where the first cycle speculates (its plan is kept for it instead)."""
    from dflash_mlx import GenerateOptions, Pair
    from dflash_mlx.engine.batch import BatchDecoder

    model, tok = target
    ids = tok.encode(PROMPTS[1])
    ref = target_greedy(model, ids, 12)
    pair = Pair(model, draft)

    dec = BatchDecoder(pair, tok, max_batch=2)
    row = dec.submit(ids, GenerateOptions(max_tokens=12, verify_width=1))
    (first,) = dec.step()
    assert first[1].tokens == ref[:1]
    assert dec._ahead is not None and dec._ahead.rows == [row], "no pass in flight"
    launched = dec._ahead
    got = [ref[0]] + [t for _, r in dec.step() for t in r.tokens]  # that pass committed
    assert dec._ahead is not launched and len(got) > 1
    while dec.busy:
        got += [t for _, r in dec.step() for t in r.tokens]
    assert got == ref

    dec = BatchDecoder(pair, tok, max_batch=2)  # another request waits: admitted next
    dec.submit(ids, GenerateOptions(max_tokens=12, verify_width=1))
    dec.submit(ids, GenerateOptions(max_tokens=12, verify_width=1))
    dec.step()
    assert dec._ahead is None

    dec = BatchDecoder(pair, tok, max_batch=2)  # the first cycle speculates: planned
    row = dec.submit(ids, GenerateOptions(max_tokens=12, verify_width=4))
    dec.step()
    assert dec._ahead is None and dec._planned == ([id(row)], ([(4, 4)], [True], None))


def test_a_request_alone_teaches_its_policy_each_cycle_and_each_catch_up(target, draft):
    """Each speculative cycle of a request alone is learnt with what it committed and the
    seconds it took, and a catch-up of the draft's context with its own rows and seconds
    (apart from the cycle's): what the policy's bank and prices rest on."""
    from dflash_mlx import Pair

    model, tok = target
    ids = tok.encode(PROMPTS[2])
    ref = target_greedy(model, ids, 160)
    # Right drafts in stretches: speculation, plain steps, and speculation resumed.
    d = ScriptedDraft(draft, ids + ref + [0] * 32, right=lambda c: 99 if (d.pos // 40) % 2 else 0)
    cycles, events = auto_decode(Pair(model, d), d, ids, 160, dormant_policy())
    assert tokens(cycles) == ref
    spec = [c for c in cycles[1:] if c.width > 1]
    learnt = [r for r in records(events) if max(r.widths) > 1]
    assert spec and len(learnt) == len(spec), (len(learnt), len(spec))
    assert [r.accepted[0] for r in learnt] == [c.accepted for c in spec]
    assert all(r.seconds > 0 for r in learnt[1:])
    caught = [r for r in learnt if r.caught]
    assert all(r.caught_seconds > 0 for r in caught)
    ups = [e for e in events if e.kind == "catch-up"]
    assert [e.tokens for e in ups] == [r.caught for r in caught]


def test_every_probe_after_dormant_plain_steps_reads_a_window_of_fresh_context(target, draft):
    """A dormant draft's plain steps capture nothing until a window before the probe: every
    probe after such steps first catches the draft up on that window."""
    from dflash_mlx import Pair

    model, tok = target
    ids = tok.encode(PROMPTS[2])
    ref = target_greedy(model, ids, 160)
    d = ScriptedDraft(draft, ids + ref + [0] * 32, right=lambda c: 99 if (d.pos // 40) % 2 else 0)
    cycles, events = auto_decode(Pair(model, d), d, ids, 160, dormant_policy())
    assert tokens(cycles) == ref
    learnt = records(events)
    probes = [r for prev, r in zip(learnt, learnt[1:]) if r.probe and max(prev.widths) == 1]
    assert probes and all(r.caught >= 1 for r in probes), [r.caught for r in probes]
