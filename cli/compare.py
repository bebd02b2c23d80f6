"""`generate --compare`: plain decoding of the same request through the same engine, and
DFlash's speed over it: one statistic (the paired segments' geometric mean) for the figure
and its 95% interval, and a verdict only where the interval and τ allow one."""

from __future__ import annotations

# --compare: the two runs' generation times are paired segment by segment (the same tokens
# at temperature 0), and a verdict is given only where the paired interval excludes 1.
SEGMENTS = 8
ALL_PLAIN = 0.95  # the DFlash run's share of tokens decoded plainly: "both decoded plainly"
BARELY = 1.1  # τ under this: a run that speculated too little to be called faster


def segment_times(marks: list[tuple[int, float]], segments: int) -> list[float] | None:
    """The time taken by each of `segments` equal spans of the tokens after the first
    (the first token's time is TTFT, not speed), from `(tokens so far, time)` marks, the
    clock read linearly between two marks; None when too few tokens for that."""
    if len(marks) < 2:
        return None
    n0, t0 = marks[0]
    total = marks[-1][0] - n0
    if total < 2 * segments:
        return None

    def at(n: float) -> float:  # the time the n-th token (counted from the first) landed
        for (a, ta), (b, tb) in zip(marks, marks[1:]):
            if a - n0 <= n <= b - n0:
                return ta + (tb - ta) * (n - (a - n0)) / (b - a) if b > a else tb
        return marks[-1][1]

    edges = [at(total * k / segments) for k in range(segments + 1)]
    del t0
    return [b - a for a, b in zip(edges, edges[1:])]


def paired_speedup(
    dflash: list[tuple[int, float]], plain: list[tuple[int, float]], segments: int = SEGMENTS
) -> tuple[float, float, float] | None:
    """DFlash's speed over plain decoding's as the geometric mean of the paired segment
    ratios (plain time / DFlash time over the same tokens), with its 95% interval
    (Student t); None without enough tokens or time to measure."""
    import math
    import statistics

    from dflash_mlx.bench.results import _t95

    a, b = segment_times(dflash, segments), segment_times(plain, segments)
    if a is None or b is None:
        return None
    logs = [math.log(p / d) for d, p in zip(a, b) if d > 0 and p > 0]
    if len(logs) < 3:
        return None
    mean = statistics.fmean(logs)
    half = _t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(interval, plain_fraction: float, tau: float) -> str:
    """What the paired interval `(point, low, high)` says: `faster` / `slower` only where it
    excludes 1; `same speed within noise` otherwise; `both decoded plainly` when the DFlash
    run did too, and `barely speculated` (no verdict) for an interval above 1 from a run
    whose speculation cannot explain it: τ under BARELY (every pass costs at least a plain
    step, so speculation gains at most τ) or the interval's low end above τ."""
    if plain_fraction >= ALL_PLAIN:
        return "both decoded plainly"
    if interval is None:
        return "unmeasured"
    _, low, high = interval
    if high < 1:
        return "slower"
    if low <= 1:
        return "same speed within noise"
    if tau < BARELY or low > tau:
        return "barely speculated"
    return "faster"


def compared(pair, tokenizer, request, opts, run, marks: list[tuple[int, float]]) -> dict:
    """Plain decoding of the same request through the same engine (verify width 1, the same
    settings): its speed, DFlash's speed over it with a 95% interval paired over segments of
    the reply and its verdict, and (at temperature 0) whether its tokens are DFlash's;
    `same_tokens` None when sampling (outputs differ by chance). `run`: the DFlash run's
    `GenerationResult`, or `(tokens, Stats)`; `marks`: its `(tokens so far, time)`."""
    import dflash_mlx

    from .generate import collecting
    from .ui import PromptProgress

    tokens, stats = (run.tokens, run.stats) if hasattr(run, "tokens") else run
    progress = PromptProgress()
    plain_marks: list[tuple[int, float]] = []
    plain_tokens: list[int] = []
    try:
        from dflash_mlx.engine.generate import collect

        responses = dflash_mlx.stream_generate(
            pair, tokenizer, request, opts.replace(verify_width=1), prompt_progress=progress
        )
        plain = collect(collecting(responses, plain_tokens, plain_marks))
    finally:
        progress.close()
    first = next((i for i, (a, b) in enumerate(zip(tokens, plain.tokens)) if a != b), None)
    if first is None and len(tokens) != len(plain.tokens):
        first = min(len(tokens), len(plain.tokens))
    sampled = opts.temperature > 0
    plain_tps = plain.stats.generation_tps
    # Sampled runs make different tokens: their segments are not the same work.
    interval = None if sampled else paired_speedup(marks, plain_marks)
    if interval is not None:  # the figure and its interval: one statistic
        speedup = interval[0]
    else:  # unpaired: the ratio of the two speeds, without a verdict
        speedup = stats.generation_tps / plain_tps if plain_tps > 0 else None
    return {
        "generation_tps": plain_tps,
        "generation_tokens": plain.stats.generation_tokens,
        # DFlash's speed over plain's: the geometric mean of the paired segment ratios
        # (inside `interval`), or without one the ratio of the two tok/s.
        "speedup": speedup,
        "interval": None if interval is None else [interval[1], interval[2]],
        "verdict": verdict(interval, stats.plain_fraction, stats.tau),
        "same_tokens": None if sampled else first is None,
        "first_difference": None if sampled else first,
    }
