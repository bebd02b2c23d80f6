"""Long-context fine-tuning data: the target's own continuations after long windows of the
user's data (`dflash-mlx train --long-context 1024,3072`, issue 37).

A draft trained on short sequences sees, deep in a long prompt, target features it never
saw in training (the target's hidden states at depth). Here each example is a window of
`n` tokens cut from the data (the texts of a file's lines, joined) and the target's greedy
continuation of it; anchors fall in the continuation only (`trainer.sample_batch`), so the
draft learns to draft at depth. Whole files are held out for the τ check at each depth, so
no held-out continuation was trained on. Never prints.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..errors import BadArgument
from ..stats import Stats
from .trainer import Example


def parse_lengths(text: str) -> list[int]:
    """`1024,3k` -> [1024, 3072]: the window lengths of `--long-context`, each >= 16."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            n = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        except ValueError:
            n = -1
        if n < 16:
            raise BadArgument(
                f"--long-context {text!r}: {part!r} is not a window length (an integer >= 16, "
                "or like 3k; e.g. 1024,3072)"
            )
        out.append(n)
    return sorted(set(out))


def file_tokens(path: Path, tokenizer, longest: int) -> list[list[int]]:
    """The token streams long windows are cut from: each `{"text"}` line of the data, and
    consecutive lines of a file joined (a line break apart) until a stream holds `longest`
    tokens, so that short documents still make long windows. Other lines are left out."""
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    streams = []
    for f in files:
        texts, count = [], 0
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                obj = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if not (isinstance(obj, dict) and isinstance(obj.get("text"), str)):
                continue
            texts.append(obj["text"])
            count += len(tokenizer.encode(obj["text"]))
            if count >= longest:
                streams.append(list(tokenizer.encode("\n".join(texts))))
                texts, count = [], 0
        if texts:
            streams.append(list(tokenizer.encode("\n".join(texts))))
    return streams


def cut_windows(
    streams: Sequence[list[int]],
    lengths: Sequence[int],
    per_length: int,
    reply: int,
    seed: int = 0,
    held_out: float = 0.125,
) -> tuple[list[tuple[int, list[int]]], list[tuple[int, list[int]]]]:
    """(training windows, held-out windows), each `(n, tokens)`: `per_length` windows of
    each length `n` from the streams long enough to hold `n + reply` tokens, at seeded
    places. Held out: whole streams (a seeded `held_out` share, at least one) when two or
    more can hold the longest window, two windows per length from them; else none (the
    caller then holds out examples)."""
    rng = np.random.default_rng((seed, 37))
    longest = max(lengths) + reply
    usable = [i for i, s in enumerate(streams) if len(s) >= longest]
    held: set[int] = set()
    if len(usable) >= 2:
        k = max(1, int(round(held_out * len(usable))))
        held = {int(i) for i in rng.choice(usable, size=k, replace=False)}

    def windows(ids: list[int], n: int, count: int) -> list[tuple[int, list[int]]]:
        pool = [i for i in ids if len(streams[i]) >= n + reply]
        out = []
        for _ in range(count if pool else 0):
            s = streams[int(rng.choice(pool))]
            start = int(rng.integers(0, len(s) - n - reply + 1))
            out.append((n, s[start : start + n]))
        return out

    train_ids = [i for i in range(len(streams)) if i not in held]
    train = [w for n in lengths for w in windows(train_ids, n, per_length)]
    test = [w for n in lengths for w in windows(sorted(held), n, 2)]
    if not train:
        raise BadArgument(
            f"--long-context: no text in the data is long enough for a window of "
            f"{min(lengths)} tokens and its {reply}-token reply"
        )
    return train, test


def long_examples(
    windows: list[tuple[int, list[int]]],
    regenerate: Callable[[list[list[int]]], list[list[int]]],
) -> list[Example]:
    """Each window continued by the target (`regenerate`: prompts -> replies); anchors are
    drawn from the reply (`Example.start` is where it begins)."""
    replies = regenerate([w for _, w in windows])
    out = []
    for (_, w), reply in zip(windows, replies, strict=True):
        if len(reply) >= 2:
            out.append(Example(list(w) + list(reply), len(w)))
    return out


def tau_at_depth(
    pair, tokenizer, held: list[tuple[int, list[int]]], tokens: int
) -> dict[int, float]:
    """Held-out τ per window length: greedy, the engine at the draft's full block, under
    the draft's default context policy (what `generate` would use), pooled per length."""
    from ..engine.generate import generate
    from ..options import GenerateOptions

    options = GenerateOptions(max_tokens=tokens, verify_width=pair.draft.config.block_size)
    by_length: dict[int, list] = {}
    for n, ids in held:
        by_length.setdefault(n, []).append(generate(pair, tokenizer, ids, options).stats)
    return {n: Stats.total(stats).tau for n, stats in sorted(by_length.items())}
