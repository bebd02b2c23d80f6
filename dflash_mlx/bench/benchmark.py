"""DFlash against the target alone, measured side by side in one process.

Runs plain mlx-lm decoding (the baseline: `mlx_lm.generate.generate_step` with mlx-lm's own
sampler) and DFlash through the public `dflash_mlx.generate` at each verify width (one
`Pair` for all of them, one `GenerateOptions` per run), and with `trees` at each tree budget
(tree verification of that many tokens), on the same encoded prompts, after a warm-up. The
order of the runs rotates with every prompt and repeat, so slow drift (heat, other
processes) spreads over all of them. At temperature 0 every DFlash run, trees included,
must reproduce the baseline's tokens; a difference is recorded with the prompt and the first
differing position. With `contexts`, every prompt is also run padded (in front, with the
other prompts' text) or cut to each of those token counts, one group per count. Each fixed
width's efficiency is its measured speedup over what its calibrated pass costs and its tau
allow. Every run's figures are its `Stats`. Returns dataclasses that serialise to JSON;
never prints: progress goes to an optional callback.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

import dflash_mlx

from ..engine.text import encode_prompt
from ..engine.tree import BRANCH as TREE_BRANCH
from ..errors import BadArgument
from ..options import GenerateOptions
from ..pair import Pair
from ..stats import Stats
from .prompts import BenchPrompt
from .results import (
    AUTO,
    BASELINE,
    BenchResult,
    Mismatch,
    RunRecord,
    auto_comparisons,
    run_name,
    summarise,
)

WARMUP_TOKENS = 32

Progress = Callable[[int, int, str], None]  # (runs done, runs in all, what just ran)


def environment() -> dict[str, Any]:
    """Device, platform and library versions the figures were measured with."""

    def pkg(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    info = mx.device_info()
    device = mx.default_device()
    return {
        "device": str(device),
        "device_type": device.type.name,  # "cpu" or "gpu"
        "device_info": {k: v for k, v in info.items() if isinstance(v, str | int | float)},
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": pkg("mlx-lm"),
        "dflash_mlx": pkg("dflash-mlx-engine"),
    }


def quantization(module: nn.Module) -> dict[str, Any] | None:
    """Bits, group size and mode of a module's quantized layers; None when it has none."""
    kinds = {
        (m.bits, m.group_size, getattr(m, "mode", "affine"))
        for _, m in module.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
    }
    found = [{"bits": b, "group_size": g, "mode": m} for b, g, m in sorted(kinds)]
    if not found:
        return None
    return found[0] if len(found) == 1 else {"mixed": found}


def _check(widths: list[int | str], trees: list[int], pair: Pair, repeats: int) -> None:
    draft = pair.draft
    limit = draft.config.block_size if draft is not None else 1
    for b in trees:
        if draft is None:
            raise BadArgument(f"trees {b}: a tree is of drafts, and no draft was given")
        if isinstance(b, bool) or not isinstance(b, int) or b < 3:
            raise BadArgument(
                f"trees {b!r}: a tree budget is an integer >= 3 (tokens verified, the anchor "
                "included; 2 is the chain W=2)"
            )
        most = (limit - 1) * TREE_BRANCH + 1
        if b > most:
            raise BadArgument(
                f"trees {b}: a tree over the draft's {limit - 1} drafted positions holds at "
                f"most {most} tokens"
            )
    for w in widths:
        if w == AUTO:
            continue
        if not isinstance(w, int) or w < 1:
            raise BadArgument(f"verify width {w!r} must be an integer >= 1 or {AUTO!r}")
        if w > limit:
            raise BadArgument(
                f"verify width {w} exceeds "
                + (f"the draft's block size {limit}" if draft is not None else "1 (no draft)")
            )
    if not isinstance(repeats, int) or repeats < 1:
        raise BadArgument(f"repeats {repeats!r} must be an integer >= 1")


def _baseline(model, ids: list[int], options: GenerateOptions, eos: frozenset[int]):
    """Plain mlx-lm decoding: (tokens, its `Stats`: one plain step per token after the first)."""
    mx.reset_peak_memory()
    tic = time.perf_counter()
    # The same prefill chunk as our engine, so prefill figures compare like with like.
    steps = generate_step(
        mx.array(ids),
        model,
        max_tokens=options.max_tokens,
        sampler=make_sampler(
            temp=options.temperature,
            top_p=options.top_p,
            min_p=options.min_p,
            top_k=options.top_k,
        ),
        prefill_step_size=options.prefill_step,
    )
    tokens: list[int] = []
    first = tic
    for token, _ in steps:
        tokens.append(int(token))
        if len(tokens) == 1:
            first = time.perf_counter()
        if tokens[-1] in eos:
            break  # kept, as dflash_mlx keeps the EOS id among its tokens
    end = time.perf_counter()
    steps.close()
    n = max(len(tokens) - 1, 0)
    return tokens, Stats(
        prompt_tokens=len(ids),
        time_to_first_token=first - tic,
        generation_tokens=len(tokens),
        decode_seconds=end - first,
        peak_memory=mx.get_peak_memory() / 1e9,
        cycles=n,
        committed=n,
    )


def _first_difference(expected: list[int], got: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def at_context(ids: list[int], filler: list[int], n: int) -> list[int]:
    """`ids` padded in front to `n` tokens with `filler` (repeated as needed), or cut to its
    last `n` tokens: the prompt's own end, where the reply starts, is kept."""
    if n < 1:
        raise BadArgument(f"context {n} must be >= 1 tokens")
    if len(ids) >= n:
        return ids[len(ids) - n :]
    need = n - len(ids)
    if not filler:
        filler = ids
    reps = -(-need // len(filler))
    return (filler * reps)[len(filler) * reps - need :] + ids


def encode_prompts(tokenizer, prompts: Sequence[BenchPrompt], chat: bool | None) -> list:
    """Each prompt's token ids: its messages, else its text as a user message under the
    chat template (`chat`; None: when the tokenizer has one), else the text itself."""
    if chat is None:
        chat = bool(getattr(tokenizer, "has_chat_template", False))
    return [
        encode_prompt(
            tokenizer, p.messages or ([{"role": "user", "content": p.text}] if chat else p.text)
        )
        for p in prompts
    ]


def _cost_ratios(pair: Pair, runs, depth: int) -> dict[str, float]:
    """t_plain / (t_verify(W) + t_draft(L)) of each fixed-width run at `depth`, from the
    pair's calibrated costs (measured now if not cached)."""
    try:
        curves = pair.costs()
    except OSError:  # no writable cache: no efficiency figures
        return {}
    verify, drafting = curves.at(depth)
    rows = pair.draft.config.block_size  # the bench runs the draft's whole block at fixed widths
    out = {}
    for name, width, tree in runs:
        if isinstance(width, int) and not tree:  # a tree's pass is not a chain's
            cost = verify[width - 1] + (drafting[rows - 1] if width > 1 else 0.0)
            out[name] = verify[0] / cost
    return out


def run_benchmark(
    pair: Pair,
    tokenizer,
    prompts: Sequence[BenchPrompt],
    *,
    widths: Sequence[int | str] | None = None,
    trees: Sequence[int] | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repeats: int = 3,
    seed: int = 0,
    chat: bool | None = None,
    warmup_tokens: int = WARMUP_TOKENS,
    model_id: str | None = None,
    draft_id: str | None = None,
    contexts: Sequence[int] | None = None,
    progress: Progress | None = None,
    draft_window: int | None = None,
) -> BenchResult:
    """Measure the baseline (`pair.model` alone, through mlx-lm) and DFlash at each verify
    width on `prompts`, side by side.

    `widths` are verify widths W (1 is the target alone through dflash_mlx's engine) or
    "auto" (W chosen per cycle from measured costs); default: ["auto"], the engine's own
    default. `trees` are tree budgets B: DFlash verifying a tree of B tokens each cycle
    (`GenerateOptions.tree` True; fixed widths run chains only). `chat` sends text prompts
    through the chat
    template (default: when the tokenizer has one); message prompts always use it. Each
    run generates up to `max_tokens` tokens; every figure is reported over `repeats`.
    `contexts`: token counts each prompt is padded or cut to (one suite per count, named
    "<n> tokens") instead of its own length.
    """
    if not prompts:
        raise BadArgument("no prompts to benchmark")
    for n in contexts or ():
        if not isinstance(n, int) or n < 1:
            raise BadArgument(f"context {n!r} must be an integer >= 1 (tokens)")
    widths = list(dict.fromkeys(widths)) if widths else [AUTO]
    trees = list(dict.fromkeys(trees or ()))
    _check(widths, trees, pair, repeats)
    model, draft = pair.model, pair.draft
    # Validated before anything runs; each run's options are these with its width and seed.
    options = GenerateOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        draft_window=draft_window,
    )
    encoded = encode_prompts(tokenizer, prompts, chat)
    if contexts:
        # The other prompts' text (no chat template) fills the context in front of each.
        filler = [t for p in prompts for t in encode_prompt(tokenizer, p.summary)]
        grouped = [
            (BenchPrompt(f"{n} tokens", i, p.text, p.messages), at_context(ids, filler, n))
            for n in dict.fromkeys(contexts)
            for i, (p, ids) in enumerate(zip(prompts, encoded))
        ]
        prompts = [p for p, _ in grouped]
        encoded = [ids for _, ids in grouped]
    eos = frozenset(getattr(tokenizer, "eos_token_ids", None) or ())
    # (name, verify width or tree budget, trees asked for)
    runs: list[tuple[str, int | str | None, bool]] = [
        (BASELINE, None, False),
        *((run_name(w), w, False) for w in widths),
        *((run_name(b, tree=True), b, True) for b in trees),
    ]
    total = len(runs) * (1 + repeats * len(prompts))
    done = 0

    def one(width: int | str | None, tree: bool, ids: list[int], n: int, run_seed: int):
        """(tokens, Stats, finish reason) of one generation."""
        # Greedy runs pass no seed: a seeded request keeps its widths from learning
        # wall-clock costs. A fixed width verifies chains, a budget trees; auto: chosen.
        fixed = width not in (None, AUTO)
        run = options.replace(
            max_tokens=n,
            seed=run_seed if temperature > 0 else None,
            verify_width=width if fixed else None,
            tree=tree if fixed else None,
        )
        if width is None:
            mx.random.seed(run_seed)
            tokens, stats = _baseline(model, ids, run, eos)
            return tokens, stats, "stop" if tokens and tokens[-1] in eos else "length"
        # Looked up at call time: the public API, exactly as users call it.
        r = dflash_mlx.generate(pair, tokenizer, ids, run)
        return r.tokens, r.stats, r.finish_reason

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)

    for name, width, tree in runs:  # warm-up: compile, allocate, fill caches; not measured
        one(width, tree, encoded[0], min(max_tokens, warmup_tokens), seed)
        tick(f"warm-up {name}")

    records: list[RunRecord] = []
    mismatches: list[Mismatch] = []
    for rep in range(repeats):
        for i, (p, ids) in enumerate(zip(prompts, encoded)):
            shift = (rep * len(prompts) + i) % len(runs)
            outputs: dict[str, list[int]] = {}
            for name, width, tree in runs[shift:] + runs[:shift]:
                run_seed = seed + rep * len(prompts) + i
                tokens, stats, finish = one(width, tree, ids, max_tokens, run_seed)
                outputs[name] = tokens
                records.append(RunRecord(p.suite, p.index, rep, name, width, stats, finish, tree))
                tick(f"{p.suite} #{p.index + 1} {name}")
            if temperature == 0:
                mismatches += _compare(p, rep, outputs, runs, tokenizer)

    suites = list(dict.fromkeys(p.suite for p in prompts))
    names = [name for name, _, _ in runs]

    def ratios(group: list[list[int]]) -> dict[str, float] | None:
        if draft is None:
            return None
        depth = round(statistics.mean(len(ids) for ids in group)) + max_tokens // 2
        return _cost_ratios(pair, runs, depth)

    return BenchResult(
        environment=environment(),
        models={
            "target": model_id,
            "draft": draft_id,
            "target_type": getattr(getattr(model, "args", None), "model_type", None),
            "target_quantization": quantization(model),
            "draft_quantization": quantization(draft) if draft is not None else None,
            "draft_block_size": draft.config.block_size if draft is not None else None,
        },
        settings={
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "repeats": repeats,
            "verify_widths": widths,
            "trees": trees,
            "seed": seed,
            "chat_template": chat,
            "warmup_tokens": min(max_tokens, warmup_tokens),
            "prefill_step": options.prefill_step,
            "suites": suites,
            "contexts": list(dict.fromkeys(contexts)) if contexts else None,
        },
        prompts=[{**p.to_dict(), "prompt_tokens": len(ids)} for p, ids in zip(prompts, encoded)],
        suites=[
            summarise(
                s,
                names,
                [r for r in records if r.suite == s],
                sum(p.suite == s for p in prompts),
                ratios([ids for p, ids in zip(prompts, encoded) if p.suite == s]),
            )
            for s in suites
        ],
        overall=summarise("overall", names, records, len(prompts), ratios(encoded)),
        mismatches=mismatches,
        records=records,
        comparisons=auto_comparisons(names, records),
    )


def _compare(p: BenchPrompt, rep: int, outputs: dict[str, list[int]], runs, tokenizer):
    """Mismatches of each DFlash run (chains and trees) against the baseline's tokens for one
    prompt."""
    expected = outputs[BASELINE]
    found = []
    for name, width, _ in runs[1:]:
        got = outputs[name]
        pos = _first_difference(expected, got)
        if pos is None:
            continue
        found.append(
            Mismatch(
                suite=p.suite,
                prompt_index=p.index,
                prompt=p.summary,
                width=width,
                repeat=rep,
                position=pos,
                expected=expected[pos] if pos < len(expected) else None,
                got=got[pos] if pos < len(got) else None,
                expected_text=tokenizer.decode(expected[pos : pos + 8]),
                got_text=tokenizer.decode(got[pos : pos + 8]),
                expected_tokens=len(expected),
                got_tokens=len(got),
                run=name,
            )
        )
    return found
