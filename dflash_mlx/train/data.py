"""More training data from a few prompts: the target's own continuations (issue 64).

A draft learns what the target writes, and the target writes for free: from each prompt
the command asks it for several continuations instead of one. The first continues the
prompt whole, greedily; each further one starts from a cut of the prompt at a seeded
offset in its second half (a window of the user's text ending elsewhere) and takes a few
tokens sampled at a temperature (a branch the greedy reply would not have taken) before
continuing greedily. Anchors are drawn from the greedy part only, so every block is
labelled along the target's own greedy chain, which is what verification accepts. A few
hundred prompts so become a few thousand distinct sequences, about what a plain recipe's
2,048 continuations hold, for the cost of the target writing them (batched, once).

`Growth` says how many; `grow` plans the prompts; `TargetWriter` writes the branches and
the replies with mlx-lm's batched decoding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..engine.text import encode_prompt
from ..errors import BadArgument


@dataclass
class Example:
    tokens: list[int]
    start: int  # first response position: anchors are sampled from here on
    source: int = -1  # the line it came from (its continuations share it); -1: its own


@dataclass
class Growth:
    """How a prompt's continuations multiply. `per_prompt` None: `auto_per_prompt`."""

    per_prompt: int | None = None  # continuations of each prompt (1: the prompt whole only)
    branch: int = 8  # tokens sampled before the greedy reply, in continuations after the first
    temperature: float = 1.0  # of the sampled branch
    seed: int = 0

    def __post_init__(self) -> None:
        if self.per_prompt is not None and self.per_prompt < 1:
            raise ValueError(f"continuations per prompt {self.per_prompt} must be >= 1")
        if self.branch < 0:
            raise ValueError(f"branch {self.branch} tokens must be >= 0")
        if not self.temperature > 0:
            raise ValueError(f"temperature {self.temperature} must be > 0")


MOST_PER_PROMPT = 8


def auto_per_prompt(prompts: int, steps: int, batch: int) -> int:
    """Continuations per prompt so that the data holds about as many sequences as the run
    draws (each seen about once): 4 for 1,000 prompts at 250 steps of 16; 1 once the
    prompts alone are that many; at most `MOST_PER_PROMPT` (8: 384 prompts give 3,072
    sequences, a plain recipe's 2,048 continuations are each seen twice by that budget)."""
    want = steps * batch
    return max(1, min(MOST_PER_PROMPT, -(-want // max(1, prompts))))


@dataclass
class Planned:
    source: int  # which prompt it grew from
    prompt: list[int]  # the prompt's tokens (the whole prompt, or a cut of it)
    branch: bool  # whether a sampled branch comes before the greedy reply


def grow(prompts: list[list[int]], per_prompt: int, seed: int = 0) -> list[Planned]:
    """`per_prompt` continuations of each prompt: the prompt whole, then cuts at distinct
    seeded offsets in its second half (at least 4 tokens in), each with a sampled branch.
    A prompt too short for that many distinct cuts gets the cuts it has, and the rest are
    other sampled branches of it whole."""
    out = []
    for i, ids in enumerate(prompts):
        out.append(Planned(i, list(ids), False))
        if per_prompt < 2:
            continue
        rng = np.random.default_rng((seed, 7, i))
        lo = max(4, len(ids) // 2)
        offsets = np.arange(lo, len(ids))  # the whole prompt, ending at len(ids), is first
        take = min(per_prompt - 1, len(offsets))
        cuts = sorted(int(c) for c in rng.choice(offsets, size=take, replace=False))
        cuts += [len(ids)] * (per_prompt - 1 - take)  # too short: other branches of it whole
        out += [Planned(i, list(ids[:c]), True) for c in cuts]
    return out


def read_examples(
    path: Path,
    tokenizer,
    *,
    seq_len: int,
    regenerate: Callable[[list[list[int]]], list[list[int]]] | None = None,
    reply_room: int = 0,
    per_prompt: int | Callable[[int], int] = 1,
    branches: Callable[[list[list[int]]], list[list[int]]] | None = None,
    seed: int = 0,
) -> tuple[list[Example], list[str]]:
    """Examples from JSONL (`{"text"}`, `{"prompt"}`, `{"messages"}`) or a folder of them.

    Bad lines are skipped and reported (file:line and why), never silently. With
    `regenerate` (prompts -> the target's replies, all at once so it can batch) the target
    writes the responses: after a `{"prompt"}` (chat template) or a `{"text"}` (raw, e.g. a
    stretch of a file); without it, `{"text"}` is trained on as it is and `{"prompt"}`
    lines are skipped. A prompt to regenerate from keeps its last `seq_len - reply_room`
    tokens, so that a long prompt still leaves room for the reply. `per_prompt` > 1: that
    many continuations of each prompt (`grow`; a function: of the number of prompts), the
    sampled branches written by `branches` (prompts -> a few tokens each) before the greedy
    replies; every example keeps the index of the line it grew from in `source`."""
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise BadArgument(f"training data {path}: no JSONL file found")
    if regenerate is not None and not 0 <= reply_room < seq_len:
        raise ValueError(f"reply room {reply_room} tokens must be below seq_len {seq_len}")
    pending: list[tuple[str, Example]] = []
    skipped = []
    for f in files:
        for i, line in enumerate(f.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{f}:{i}"
            try:
                ex = _example(json.loads(line), tokenizer, regenerate is not None)
            except (ValueError, TypeError, KeyError) as e:
                skipped.append(f"{where}: skipped ({e})")
                continue
            ex.source = len(pending)
            if ex.start < 0:  # a prompt the target continues: cut from the left
                ex.tokens = ex.tokens[-(seq_len - reply_room) :]
            pending.append((where, ex))
    prompts = [ex for _, ex in pending if ex.start < 0]
    if prompts:  # each prompt's continuations take its place, in order
        if callable(per_prompt):
            per_prompt = per_prompt(len(prompts))
        plans = grow([ex.tokens for ex in prompts], per_prompt, seed)
        wanted = [p for p in plans if p.branch]
        sampled = iter(branches([p.prompt for p in wanted]) if branches and wanted else [])
        heads = [p.prompt + (list(next(sampled)) if p.branch and branches else []) for p in plans]
        grown: dict[int, list[Example]] = {}
        for p, head, reply in zip(plans, heads, regenerate(heads), strict=True):
            source = prompts[p.source].source
            grown.setdefault(source, []).append(Example(head + list(reply), len(head), source))
        pending = [
            (where, e) for where, ex in pending for e in grown.get(ex.source, [ex])
        ]  # fmt: skip
    examples = []
    for where, ex in pending:
        ex.tokens = ex.tokens[:seq_len]
        if len(ex.tokens) - ex.start < 2:
            skipped.append(f"{where}: skipped (fewer than 2 response tokens)")
            continue
        examples.append(ex)
    if not examples:
        raise BadArgument(f"training data {path}: no usable example ({len(skipped)} skipped)")
    return examples, skipped


def _example(obj, tokenizer, regenerate: bool) -> Example:
    """An example, or (start -1) a prompt whose reply the target is still to write."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    if isinstance(obj.get("text"), str):
        ids = tokenizer.encode(obj["text"])
        if regenerate:  # the text is a raw prompt the target continues
            if not ids:
                raise ValueError("empty text: nothing for the target to continue")
            return Example(ids, -1)
        return Example(ids, 0)
    if isinstance(obj.get("messages"), list) and obj["messages"]:
        msgs = obj["messages"]
        if msgs[-1].get("role") != "assistant":
            if not regenerate:
                raise ValueError("messages must end with an assistant turn (or use --regenerate)")
            return Example(encode_prompt(tokenizer, msgs), -1)
        prompt = encode_prompt(tokenizer, msgs[:-1])
        full = tokenizer.apply_chat_template(msgs, tokenize=True)
        if isinstance(full, dict) or hasattr(full, "input_ids"):
            full = full["input_ids"]
        return Example(list(full), min(len(prompt), len(full)))
    if isinstance(obj.get("prompt"), str):
        if not regenerate:
            raise ValueError('a {"prompt"} line needs --regenerate to get a response')
        return Example(encode_prompt(tokenizer, [{"role": "user", "content": obj["prompt"]}]), -1)
    raise ValueError('expected "text", "prompt" or "messages"')


def split_held_out(
    examples: list[Example], n: int, seed: int = 0
) -> tuple[list[Example], list[list[int]]]:
    """(training examples, `n` held-out prompts): whole examples drawn (seeded) from across
    the data, so the estimate does not hang on whichever file came last; the prompts are
    what came before each held-out reply. The other continuations of a held-out line are
    held out with it (`Example.source`): a draft is never checked on a prompt it trained
    on the continuations of."""
    train_set, held = split_held(examples, n, seed)
    return train_set, [e.tokens[: e.start or 16] for e in held]


def split_held(
    examples: list[Example], n: int, seed: int = 0
) -> tuple[list[Example], list[Example]]:
    """`split_held_out` with the held-out examples whole (one per held-out line: its first,
    the prompt continued whole)."""
    if n < 1 or len(examples) < 2:
        return examples, []
    firsts: dict[int, int] = {}
    for i, e in enumerate(examples):
        firsts.setdefault(e.source if e.source >= 0 else -1 - i, i)
    lines = list(firsts.values())
    n = min(n, max(1, len(lines) // 20))
    picked = np.random.default_rng((seed, 1)).choice(len(lines), size=n, replace=False)
    held = sorted(lines[j] for j in picked)
    gone = {_line(examples[i], i) for i in held}
    train_set = [e for i, e in enumerate(examples) if _line(e, i) not in gone]
    return train_set, [examples[i] for i in held]


def _line(e: Example, i: int) -> int:
    return e.source if e.source >= 0 else -1 - i


class TargetWriter:
    """The target writes: `branches(prompts)` samples `growth.branch` tokens at the growth's
    temperature (seeded), `replies(prompts)` continues greedily up to `max_tokens`; both
    with mlx-lm's batched decoding, stopping at EOS."""

    def __init__(self, model, tokenizer, max_tokens: int, growth: Growth | None = None):
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.growth = growth or Growth()

    def _batch(self, prompts: list[list[int]], max_tokens: int, **kw) -> list[list[int]]:
        from mlx_lm.generate import batch_generate

        r = batch_generate(
            self.model,
            self.tokenizer,
            prompts,
            max_tokens=max_tokens,
            return_token_ids=True,
            completion_batch_size=64,
            prefill_batch_size=16,
            **kw,
        )
        return [list(t) for t in r.token_ids]

    def replies(self, prompts: list[list[int]]) -> list[list[int]]:
        return self._batch(prompts, self.max_tokens)

    def branches(self, prompts: list[list[int]]) -> list[list[int]]:
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        g = self.growth
        if not prompts or g.branch == 0:
            return [[] for _ in prompts]
        mx.random.seed(g.seed)
        return self._batch(prompts, g.branch, sampler=make_sampler(temp=g.temperature))

    __call__ = replies  # the `regenerate` of `read_examples`
