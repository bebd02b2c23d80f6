"""Serial against batched decoding at several concurrencies, in one process (SPEC 8).

For each concurrency N the same N prompts (the bench's prompts, suites taken in turn) arrive
together and are served two ways: **serial**, one after another through the public
`dflash_mlx.stream_generate` (what a server decoding one request at a time gives), and
**batched**, all submitted at once to one `batch.BatchDecoder` (`max_batch` N unless given),
which decodes them together. Each request is timed from the moment all N arrive by the
bench's own clock (not its `Stats`): its first response (TTFT) and its last. Per mode and N:
aggregate tok/s (every token over the time from the arrival to the last token), per-request
tok/s (each request's tokens over its own time from the arrival to its last token, mean over
requests), mean and max TTFT, τ (the requests' `Stats` pooled) and the batch sizes the
decoder's cycles ran at. The two modes alternate which goes first, per repeat and N, so
slow drift spreads over both. At temperature 0 every batched request must reproduce its
serial tokens; a difference is recorded with the request and the first differing position.

Returns dataclasses that serialise to JSON; never prints: progress goes to an optional
callback (`benchmark.Progress`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import dflash_mlx

from ..engine import batch
from ..errors import BadArgument
from ..options import GenerateOptions
from ..pair import Pair
from .benchmark import (
    WARMUP_TOKENS,
    Progress,
    _check,
    _first_difference,
    encode_prompts,
    environment,
    quantization,
)
from .concurrency_results import (
    BATCHED,
    LATE,
    MODES,
    SERIAL,
    ConcurrencyMismatch,
    ConcurrencyResult,
    ModeRun,
    RequestRecord,
    summarise,
)
from .prompts import BenchPrompt
from .results import AUTO, run_name


def in_turn(prompts: Sequence[BenchPrompt], n: int) -> list[BenchPrompt]:
    """`n` prompts taking the suites in turn (the first of each, then the second, ...),
    from the start again when there are fewer than `n`."""
    suites: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        suites.setdefault(p.suite, []).append(p)
    order = [
        group[i]
        for i in range(max(map(len, suites.values())))
        for group in suites.values()
        if i < len(group)
    ]
    return [order[i % len(order)] for i in range(n)]


def _serial(pair: Pair, tokenizer, encoded, options) -> tuple[float, list[tuple]]:
    """The requests one after another, all arrived at the start: (seconds, per request
    (tokens, first, last, finish reason, stats))."""
    t0 = time.perf_counter()
    out = []
    for ids, opts in zip(encoded, options):
        tokens: list[int] = []
        first = last = None
        response = None
        # Looked up at call time: the public API, exactly as users call it.
        for response in dflash_mlx.stream_generate(pair, tokenizer, ids, opts):
            last = time.perf_counter() - t0
            first = last if first is None else first
            tokens += response.tokens
        out.append((tokens, first, last, response.finish_reason, response.stats))
    return time.perf_counter() - t0, out


def _batched(decoder, encoded, options, late: int | None = None):
    """The requests submitted at once to `decoder` (with `late`, the last one only once each
    of the others has `late` tokens, or has ended): (seconds, per request (tokens, first,
    last, finish reason, stats), batch size -> cycles run, when the last one arrived).
    A request's times run from its own arrival."""
    before = dict(decoder.sizes)
    n = len(encoded)
    waiting = 1 if late is not None else 0
    arrival = [0.0] * n
    t0 = time.perf_counter()
    for i in range(n - waiting):
        decoder.submit(encoded[i], options[i], handle=i)
    got: list[list] = [[[], None, None, None, None] for _ in encoded]
    while decoder.busy or waiting:
        if waiting and all(len(g[0]) >= late or g[3] for g in got[:-1]):
            arrival[-1], waiting = time.perf_counter() - t0, 0
            decoder.submit(encoded[-1], options[-1], handle=n - 1)
        items = decoder.step()
        now = time.perf_counter() - t0
        for row, item in items:
            if isinstance(item, BaseException):
                decoder.close()
                raise item
            slot = got[row.handle]
            slot[0] += item.tokens
            since = now - arrival[row.handle]
            slot[1] = since if slot[1] is None else slot[1]
            slot[2], slot[3], slot[4] = since, item.finish_reason, item.stats
    seconds = time.perf_counter() - t0
    sizes = {k: v - before.get(k, 0) for k, v in decoder.sizes.items() if v > before.get(k, 0)}
    return seconds, [tuple(s) for s in got], sizes, arrival[-1] if late is not None else None


def parse_concurrency(values: Sequence[int]) -> list[int]:
    out = []
    for n in values:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadArgument(f"concurrency {n!r} must be an integer >= 1 (requests at once)")
        out.append(n)
    if not out:
        raise BadArgument("no concurrency to measure (e.g. 1,2,4,8)")
    return list(dict.fromkeys(out))


def run_concurrency(
    pair: Pair,
    tokenizer,
    prompts: Sequence[BenchPrompt],
    concurrency: Sequence[int],
    *,
    widths: Sequence[int | str] | None = None,
    max_batch: int | None = None,
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
    progress: Progress | None = None,
    draft_window: int | None = None,
    late: bool = False,
) -> ConcurrencyResult:
    """Serial against batched decoding of the same N prompts for each N of `concurrency`.

    `widths`: verify widths W or "auto" (default: ["auto"]), one table each; the batched
    decoder takes `max_batch` rows at a time (default: N, every request at once). Each
    request generates up to `max_tokens` tokens; figures are given over `repeats`. At
    temperature > 0 request k of a run is seeded `seed + k` in both modes. `late`: a third
    mode at each N > 1, LATE: N - 1 requests submitted at once and the last one when each
    of them has generated a quarter of `max_tokens` (a request joining a running batch).
    """
    if not prompts:
        raise BadArgument("no prompts to benchmark")
    ns = parse_concurrency(list(concurrency))
    if max_batch is not None and (
        isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1
    ):
        raise BadArgument(f"max_batch {max_batch!r} must be an integer >= 1")
    widths = list(dict.fromkeys(widths)) if widths else [AUTO]
    _check(widths, [], pair, repeats)
    options = GenerateOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        draft_window=draft_window,
    )
    chosen = in_turn(prompts, max(ns))
    encoded = encode_prompts(tokenizer, chosen, chat)

    def modes_at(n: int) -> tuple[str, ...]:
        return (*MODES, LATE) if late and n > 1 else MODES

    total = len(widths) * (1 + len(ns) + repeats * sum(len(modes_at(n)) for n in ns))
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)

    def each(width, n: int, tokens: int) -> list[GenerateOptions]:
        fixed = width != AUTO
        return [
            options.replace(
                max_tokens=tokens,
                seed=seed + k if temperature > 0 else None,
                verify_width=width if fixed else None,
                tree=False if fixed else None,
            )
            for k in range(n)
        ]

    def measure(mode: str, width, n: int, tokens: int, decoder) -> tuple:
        # As a server does: a calibration the engine asks for (none on this device yet, or
        # measured costs that kept disagreeing with it) is made between runs, never timed.
        if pair.draft is not None and pair.calibration_due:
            pair.calibrate()
        opts = each(width, n, tokens)
        if mode == SERIAL:
            return *_serial(pair, tokenizer, encoded[:n], opts), {}, None
        after = max(1, tokens // 4) if mode == LATE else None
        return _batched(decoder, encoded[:n], opts, after)

    runs: list[ModeRun] = []
    mismatches: list[ConcurrencyMismatch] = []
    warm = min(max_tokens, warmup_tokens)
    in_plan, pair.calibrate_in_plan = pair.calibrate_in_plan, False
    try:
        for width in widths:
            name = run_name(width)
            # One decoder per N for all its repeats, as a server keeps one.
            decoders = {
                n: batch.BatchDecoder(pair, tokenizer, max_batch=max_batch or n) for n in ns
            }
            measure(SERIAL, width, 1, warm, None)  # warm-ups: compile, allocate; not measured
            tick(f"warm-up {name} serial")
            for n in ns:
                measure(BATCHED, width, n, warm, decoders[n])
                tick(f"warm-up {name} batched ×{n}")
            for rep in range(repeats):
                for i, n in enumerate(ns):
                    measured: dict[str, ModeRun] = {}
                    modes = modes_at(n)
                    shift = (rep + i) % len(modes)
                    for mode in modes[shift:] + modes[:shift]:
                        seconds, got, sizes, at = measure(mode, width, n, max_tokens, decoders[n])
                        records = [
                            RequestRecord(k, p.suite, p.index, *g)
                            for k, (p, g) in enumerate(zip(chosen, got))
                        ]
                        measured[mode] = ModeRun(name, n, mode, rep, seconds, records, sizes, at)
                        tick(f"{name} ×{n} {mode} (repeat {rep + 1})")
                    runs += [measured[m] for m in modes]
                    if temperature == 0:
                        mismatches += _compare(measured, chosen, tokenizer)
    finally:
        pair.calibrate_in_plan = in_plan

    return ConcurrencyResult(
        environment=environment(),
        models={
            "target": model_id,
            "draft": draft_id,
            "target_type": getattr(getattr(pair.model, "args", None), "model_type", None),
            "target_quantization": quantization(pair.model),
            "draft_quantization": quantization(pair.draft) if pair.draft is not None else None,
            "draft_block_size": pair.draft.config.block_size if pair.draft is not None else None,
        },
        settings={
            "concurrency": ns,
            "max_batch": max_batch,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "repeats": repeats,
            "verify_widths": widths,
            "seed": seed,
            "chat_template": chat,
            "warmup_tokens": warm,
            "draft_window": draft_window,
            "late": late,
        },
        prompts=[{**p.to_dict(), "prompt_tokens": len(ids)} for p, ids in zip(chosen, encoded)],
        rows=summarise(runs, max_batch),
        mismatches=mismatches,
        runs=runs,
    )


def _compare(measured: dict[str, ModeRun], prompts, tokenizer) -> list[ConcurrencyMismatch]:
    """Each batched request (joining late or not) against the same request decoded serially."""
    found = []
    serial = measured[SERIAL]
    for mode in (m for m in measured if m != SERIAL):
        run = measured[mode]
        for s, b, p in zip(serial.requests, run.requests, prompts):
            pos = _first_difference(s.tokens, b.tokens)
            if pos is None:
                continue
            found.append(
                ConcurrencyMismatch(
                    run=run.run,
                    concurrency=run.concurrency,
                    repeat=run.repeat,
                    slot=b.slot,
                    suite=p.suite,
                    prompt_index=p.index,
                    prompt=p.summary,
                    position=pos,
                    expected=s.tokens[pos] if pos < len(s.tokens) else None,
                    got=b.tokens[pos] if pos < len(b.tokens) else None,
                    expected_text=tokenizer.decode(s.tokens[pos : pos + 8]),
                    got_text=tokenizer.decode(b.tokens[pos : pos + 8]),
                    expected_tokens=len(s.tokens),
                    got_tokens=len(b.tokens),
                    mode=mode,
                )
            )
    return found
