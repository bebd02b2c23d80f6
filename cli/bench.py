"""`dflash-mlx bench`: options -> `dflash_mlx.benchmark.run_benchmark` -> `bench_ui`.

The library (and so mlx) is imported inside `run`, so the command line starts instantly.
"""

from __future__ import annotations

from pathlib import Path

from dflash_mlx.errors import BadArgument

from . import bench_ui, ui

EXIT_NOT_LOSSLESS = 1  # the bench ran, but a DFlash run differed from the target's tokens


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
) -> int:
    """Run the bench and render it; the exit code (0, or 1 when not lossless)."""
    widths = parse_widths(verify_widths)  # before anything loads
    contexts = parse_contexts(context)
    if prompts is not None and suite is not None:
        raise BadArgument("pass either --prompts or --suite, not both")
    if demo and (model is not None or draft is not None):
        raise BadArgument("--demo builds its own pair: pass it without --model and --draft")
    if not demo and model is None:
        raise BadArgument("--model is required (or --demo for the demonstration pair)")

    import dflash_mlx
    from dflash_mlx.bench_prompts import load_suite, read_prompts
    from dflash_mlx.benchmark import run_benchmark

    dflash_mlx.GenerateOptions(draft_window=draft_window)  # refuses a bad window before loading

    bench_prompts = read_prompts(prompts) if prompts is not None else load_suite(suite or "all")
    if demo:
        from dflash_mlx.demo import NOTICE, demo_pair

        with ui.loading("demo pair", "tiny models"):
            target_dir, draft_dir = demo_pair()
        bench_ui.demo_note(NOTICE, target_dir.parent)
        model, draft = str(target_dir), str(draft_dir)
    else:
        from .pairs import choose_draft

        choice = choose_draft(model, draft, False)
        if choice.note:
            ui.note(choice.note)
        draft = choice.draft
    with ui.loading("target", model):
        target, tokenizer = dflash_mlx.load(model)
    drafter = None
    if draft is not None:
        with ui.loading("draft", draft):
            drafter = dflash_mlx.load_draft(draft)
    pair = dflash_mlx.Pair(target, drafter)  # checks the draft against the target, once
    if calibrate:
        progress = bench_ui.BenchProgress()
        try:
            curves = pair.costs(refresh=True, progress=lambda d, t: progress(d, t, "calibrating"))
        finally:
            progress.close()
        bench_ui.calibration(curves, pair.calibration.path)
        return 0

    progress = bench_ui.BenchProgress()
    try:
        result = run_benchmark(
            pair,
            tokenizer,
            bench_prompts,
            widths=widths,
            max_tokens=max_tokens,
            temperature=temp,
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
    bench_ui.report(result)
    if json_out is not None:
        bench_ui.json_written(json_out)
    return EXIT_NOT_LOSSLESS if result.lossless is False else 0
