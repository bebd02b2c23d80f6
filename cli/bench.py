"""`dflash-mlx bench`: options -> `dflash_mlx.bench.benchmark.run_benchmark` -> `bench_ui`;
with `--concurrency`, `dflash_mlx.bench.concurrency.run_concurrency` -> `bench_concurrency_ui`.

The library (and so mlx) is imported inside `run`, so the command line starts instantly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dflash_mlx.errors import BadArgument

from . import bench_ui, options, ui
from . import shard as sharding
from .errors import user_errors
from .paths import writable_file

EXIT_NOT_LOSSLESS = 1  # the bench ran, but a DFlash run differed from the target's tokens
# (or, with --concurrency, a batched request from its serial run)


def command(
    model: options.Model = None,
    draft: options.Draft = None,
    demo: options.Demo = False,
    prompts: Annotated[
        Path | None,
        typer.Option(help='JSONL file: one {"prompt": ...} or {"messages": [...]} per line.'),
    ] = None,
    suite: Annotated[
        str | None,
        typer.Option(help="Built-in prompts: math, code, chat or all.", show_default="all"),
    ] = None,
    max_tokens: options.MaxTokens = 128,
    temp: options.Temp = 0.0,
    top_p: options.TopP = 1.0,
    top_k: options.TopK = 0,
    min_p: options.MinP = 0.0,
    seed: Annotated[int, options.option("seed")] = 0,
    full: Annotated[
        bool,
        typer.Option(
            "--full",
            help="Every prompt of the suites (default: the first 2 of each, a quick look).",
        ),
    ] = False,
    repeats: Annotated[int, typer.Option(help="Measured passes over the prompts.")] = 3,
    verify_widths: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated verify widths W to compare, e.g. 1,2,3,4,5,8,16 "
            "(default: the engine's default width).",
            show_default=False,
        ),
    ] = None,
    trees: Annotated[
        str | None,
        typer.Option(
            "--trees",
            metavar="B[,B...]",
            help="Comma-separated tree budgets B to run beside the verify widths, e.g. 8,16,32: "
            "DFlash verifying a tree of B tokens each cycle (the widths run chains).",
            show_default=False,
        ),
    ] = None,
    draft_window: options.DraftWindow = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the full results to this file.")
    ] = None,
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate",
            help="Measure the pair's verify/draft cost curves on this device, cache and "
            "show them (what the automatic verify width uses), then stop.",
        ),
    ] = False,
    context: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated prompt lengths in tokens, e.g. 512,2k,8k: every prompt "
            "padded in front with the suite's other texts (or cut) to each length.",
            show_default=False,
        ),
    ] = None,
    concurrency: Annotated[
        str | None,
        typer.Option(
            metavar="N[,N...]",
            help="Comma-separated numbers of requests arriving at once, e.g. 1,2,4,8: each N "
            "prompts decoded one after another (serial) and together in one batch (batched), "
            "side by side, instead of the comparison with mlx-lm.",
            show_default=False,
        ),
    ] = None,
    max_batch: Annotated[
        int | None,
        typer.Option(
            help="With --concurrency: rows the batched decoder takes at once (default: N, "
            "every request).",
            show_default=False,
        ),
    ] = None,
    late_arrival: Annotated[
        bool,
        typer.Option(
            "--late-arrival",
            help="With --concurrency: also, at each N > 1, one request arriving while the "
            "other N - 1 decode: its time to first token.",
        ),
    ] = False,
    shard: options.Shard = "auto",
) -> None:
    """Measure DFlash against the target alone, side by side, on the same prompts.

    At temperature 0 every DFlash run must reproduce the target's tokens; exits with code 1
    when one differs. With --concurrency: serial against batched decoding, where every
    batched request must reproduce its serial tokens.
    """
    from dflash_mlx.distributed import session

    with user_errors(), options.flag_names(), session() as ranks:
        sharding.check(shard)
        code = run(
            shard=(shard, ranks),
            model=model,
            draft=draft,
            demo=demo,
            prompts=prompts,
            suite=suite,
            full=full,
            max_tokens=max_tokens,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repeats=repeats,
            verify_widths=verify_widths,
            trees=trees,
            seed=seed,
            json_out=json_out,
            calibrate=calibrate,
            context=context,
            draft_window=draft_window,
            concurrency=concurrency,
            max_batch=max_batch,
            late_arrival=late_arrival,
        )
    if code:
        raise typer.Exit(code)


def parse_widths(text: str | None) -> list[int | str] | None:
    """`--verify-widths`: "2,3,auto" -> [2, 3, "auto"]; None -> the engine's default (auto)."""
    if text is None:
        return None
    widths: list[int | str] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "auto":
            widths.append("auto")
            continue
        if not part.isdigit() or int(part) < 1:
            raise BadArgument(
                f"--verify-widths {text!r}: {part!r} is not a width (use integers >= 1 "
                "or auto, e.g. 1,2,3,4,5,8,16,auto)"
            )
        widths.append(int(part))
    return list(dict.fromkeys(widths))


def parse_trees(text: str | None) -> list[int] | None:
    """`--trees`: "8,16" -> [8, 16] (tree budgets, tokens verified); None -> no trees."""
    if text is None:
        return None
    budgets = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 3:
            raise BadArgument(
                f"--trees {text!r}: {part!r} is not a tree budget (use integers >= 3, the "
                "tokens a tree verifies, e.g. 8,16,32)"
            )
        budgets.append(int(part))
    return list(dict.fromkeys(budgets))


def parse_concurrency(text: str | None) -> list[int] | None:
    """`--concurrency`: "1,2,4" -> [1, 2, 4] (requests at once); None -> no concurrency bench."""
    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise BadArgument(
                f"--concurrency {text!r}: {part!r} is not a number of requests (use integers "
                ">= 1, e.g. 1,2,4,8)"
            )
        out.append(int(part))
    return list(dict.fromkeys(out))


def _concurrency_clashes(levels, max_batch, late, trees, context, calibrate) -> None:
    """What --concurrency (and its options) cannot be combined with, before anything loads."""
    if levels is None:
        for flag, given in (("--max-batch", max_batch is not None), ("--late-arrival", late)):
            if given:
                raise BadArgument(f"{flag} needs --concurrency (e.g. --concurrency 1,2,4,8)")
        return
    if max_batch is not None and max_batch < 1:
        raise BadArgument(f"--max-batch {max_batch}: use an integer >= 1 (rows at once)")
    for flag, given in (("--trees", trees), ("--context", context), ("--calibrate", calibrate)):
        if given:
            raise BadArgument(f"{flag} does not go with --concurrency (a bench of its own)")


def parse_contexts(text: str | None) -> list[int] | None:
    """`--context`: "1024,3072" -> [1024, 3072] (prompt tokens); None -> the prompts as they are."""
    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip().lower().replace("_", "")
        scale = 1024 if part.endswith("k") else 1
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) < 1:
            raise BadArgument(
                f"--context {text!r}: {part!r} is not a token count (use integers >= 1 or "
                "1k-style counts, e.g. 512,2k,8k)"
            )
        out.append(int(digits) * scale)
    return list(dict.fromkeys(out))


def run(
    *,
    model: str | None,
    draft: str | None,
    demo: bool,
    prompts: Path | None,
    suite: str | None,
    max_tokens: int,
    temp: float,
    repeats: int,
    verify_widths: str | None,
    seed: int,
    json_out: Path | None,
    calibrate: bool = False,
    context: str | None = None,
    draft_window: int | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    full: bool = False,
    trees: str | None = None,
    concurrency: str | None = None,
    max_batch: int | None = None,
    late_arrival: bool = False,
    shard: tuple = ("none", None),
) -> int:
    """Run the bench and render it; the exit code (0, or 1 when not lossless). `shard`:
    `--shard` and the `distributed.session` that joins the ranks (rank 0 alone writes)."""
    widths = parse_widths(verify_widths)  # before anything loads
    budgets = parse_trees(trees)
    contexts = parse_contexts(context)
    levels = parse_concurrency(concurrency)
    _concurrency_clashes(levels, max_batch, late_arrival, trees, context, calibrate)
    if prompts is not None and suite is not None:
        raise BadArgument("pass either --prompts or --suite, not both")
    if demo and (model is not None or draft is not None):
        raise BadArgument("--demo builds its own pair: pass it without --model and --draft")
    if not demo and model is None and draft is not None:
        raise BadArgument("--draft needs --model: the target it was trained for")
    if json_out is not None:
        writable_file(json_out, "--json")  # not after the whole bench ran
        json_out.parent.mkdir(parents=True, exist_ok=True)  # a missing folder: made now
    from .pairs import check_sources

    check_sources(model, draft)  # before anything heavy is imported

    import dflash_mlx
    from dflash_mlx.bench.benchmark import run_benchmark
    from dflash_mlx.bench.prompts import QUICK, load_suite, read_prompts

    # Refuses bad settings before anything loads.
    sampling = dict(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    dflash_mlx.GenerateOptions(max_tokens=max_tokens, draft_window=draft_window, **sampling)

    quick = None
    if prompts is not None:
        bench_prompts = read_prompts(prompts)
    elif levels is not None:  # every prompt of the suites, taken in turn
        bench_prompts = load_suite(suite or "all")
    else:
        bench_prompts = load_suite(suite or "all", None if full else QUICK)
        every = len(load_suite(suite or "all"))
        if len(bench_prompts) < every:
            quick = f"a quick look: the first {QUICK} prompts of each suite (--full: all {every})"
    if demo:
        from dflash_mlx.demo import NOTICE, demo_pair

        with ui.loading("demo pair", "tiny models"):
            target_dir, draft_dir = demo_pair()
        kind = sharding.plan(str(target_dir), shard[0])  # a bad --shard before any note
        bench_ui.demo_note(NOTICE, target_dir.parent)
        model, draft = str(target_dir), str(draft_dir)
    else:
        from .pairs import choose_draft, default_target

        model = default_target(model, draft)
        kind = sharding.plan(model, shard[0])
        choice = choose_draft(model, draft, False)
        if choice.note:
            ui.note(choice.note)
        draft = choice.draft
    from .pairs import DraftChoice

    loaded = sharding.load_for(model, DraftChoice(draft, None, None), kind, shard[1])
    if loaded is not None:
        pair, tokenizer = loaded
        if not sharding.speaks():
            json_out = None  # rank 0 writes the results
    else:
        from .generate import load as load_pair
        from .pairs import DraftChoice

        # The target and the draft behind spinners, the draft checked against the target, once.
        pair, tokenizer = load_pair(model, DraftChoice(draft, None, None))
    _contexts_fit(contexts, max_tokens, pair.context_limit)
    if calibrate:
        progress = bench_ui.BenchProgress()
        try:
            curves = pair.costs(refresh=True, progress=lambda d, t: progress(d, t, "calibrating"))
        finally:
            progress.close()
        bench_ui.calibration(curves, pair.calibration.path)
        return 0
    if not widths or "auto" in widths:  # measured now, said, not inside the first run
        ui.calibrate(pair, None)

    if levels is not None:
        return _concurrency(
            pair,
            tokenizer,
            bench_prompts,
            levels,
            widths=widths,
            max_batch=max_batch,
            late=late_arrival,
            max_tokens=max_tokens,
            repeats=repeats,
            seed=seed,
            json_out=json_out,
            draft_window=draft_window,
            model_id="demo target" if demo else model,
            draft_id="demo draft" if demo else draft,
            **sampling,
        )
    progress = bench_ui.BenchProgress()
    try:
        result = run_benchmark(
            pair,
            tokenizer,
            bench_prompts,
            widths=widths,
            trees=budgets,
            max_tokens=max_tokens,
            temperature=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repeats=repeats,
            seed=seed,
            model_id="demo target" if demo else model,
            draft_id="demo draft" if demo else draft,
            contexts=contexts,
            progress=progress,
            draft_window=draft_window,
        )
    finally:
        progress.close()
    if json_out is not None:
        result.write_json(json_out)
    bench_ui.report(result, quick)
    if json_out is not None:
        bench_ui.json_written(json_out)
    return EXIT_NOT_LOSSLESS if result.lossless is False else 0


def _contexts_fit(contexts: list[int] | None, max_tokens: int, limit: int | None) -> None:
    """Every `--context` must leave the target room for `--max-tokens` (as `generate`
    refuses a prompt too long at once, not after a prefill of minutes)."""
    for n in contexts or ():
        if limit is not None and n + max_tokens > limit:
            raise BadArgument(
                f"--context {n}: {n} prompt tokens and --max-tokens {max_tokens} need "
                f"{n + max_tokens} positions; the target holds {limit}"
            )


def _concurrency(pair, tokenizer, prompts, levels, *, json_out: Path | None, **settings) -> int:
    """`--concurrency`: serial against batched, rendered; 1 when a batched request differed."""
    from dflash_mlx.bench.concurrency import run_concurrency

    from . import bench_concurrency_ui

    progress = bench_ui.BenchProgress()
    try:
        result = run_concurrency(pair, tokenizer, prompts, levels, progress=progress, **settings)
    finally:
        progress.close()
    if json_out is not None:
        result.write_json(json_out)
    bench_concurrency_ui.report(result)
    if json_out is not None:
        bench_ui.json_written(json_out)
    return EXIT_NOT_LOSSLESS if result.lossless is False else 0
