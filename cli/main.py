"""The `dflash-mlx` command: typer wiring only.

Each command parses its options, calls the public `dflash_mlx` API and hands what comes back
to `ui.py`. The library (and so mlx) is imported inside the commands, so `dflash-mlx --help`
answers without loading MLX.
"""

from pathlib import Path
from typing import Annotated

import typer

from dflash_mlx.errors import BadArgument

from . import bench as bench_command
from . import chat as chat_command
from . import options, ui
from . import serve as serve_command
from .errors import user_errors
from .quantize import app as quantize_app

app = typer.Typer(
    name="dflash-mlx",
    help="Lossless DFlash speculative decoding for mlx-lm models.",
    no_args_is_help=True,
    add_completion=False,
    # -h as well as --help, on the app and (inherited by click's context) every command.
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)
app.add_typer(quantize_app, name="quantize")


def _version(value: bool) -> None:
    if value:
        from dflash_mlx.sysinfo import system_info

        ui.version_report(system_info())
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-v",
            callback=_version,
            is_eager=True,
            help="Show versions, device and cache folder (for bug reports).",
        ),
    ] = False,
) -> None:
    """Lossless DFlash speculative decoding for mlx-lm models."""


@app.command()
def generate(
    prompt_arg: Annotated[
        str | None,
        typer.Argument(
            metavar="PROMPT",
            help="The prompt text (or --prompt); - or none with piped stdin: read stdin.",
            show_default=False,
        ),
    ] = None,
    prompt: Annotated[
        str | None,
        typer.Option("--prompt", "-p", help="The prompt text; - reads stdin.", show_default=False),
    ] = None,
    model: options.Model = None,
    draft: options.Draft = None,
    no_draft: Annotated[
        bool, typer.Option("--no-draft", help="Decode with the target alone (no speculation).")
    ] = False,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")
    ] = 256,
    temp: options.Temp = 0.0,
    top_p: options.TopP = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 disables.")] = 0,
    min_p: Annotated[
        float,
        typer.Option(help="Drop tokens below min_p × the top prob.", callback=options.finite),
    ] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Seed for reproducible sampling.")] = None,
    verify_width: options.VerifyWidth = None,
    block_size: options.BlockSize = None,
    draft_window: options.DraftWindow = None,
    chat: Annotated[
        bool | None,
        typer.Option(
            "--chat/--raw",
            help="Wrap the prompt in the chat template (default: if the tokenizer has one).",
            show_default=False,
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object with text, tokens and stats.")
    ] = False,
    demo: Annotated[
        bool, typer.Option("--demo", help="Use the tiny demonstration pair: no downloads.")
    ] = False,
) -> None:
    """Stream a completion of the prompt, then one line of statistics.

    The prompt: an argument, --prompt/-p, or stdin (--prompt -, or none with stdin piped).
    """
    with user_errors():
        prompt = _prompt_text(prompt_arg, prompt)
        import dflash_mlx

        if demo:
            if model is not None or draft is not None:
                raise BadArgument("--demo brings its own pair: pass it without --model/--draft")
            from dflash_mlx.demo import NOTICE, demo_pair

            target_dir, draft_dir = demo_pair()
            ui.note(f"demo: {NOTICE}")
            model, draft = str(target_dir), None if no_draft else str(draft_dir)
            chat = False if chat is None else chat
        if model is None:
            raise BadArgument("--model is required (or --demo for the demonstration pair)")
        opts = dflash_mlx.GenerateOptions(
            max_tokens=max_tokens,
            temperature=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            verify_width=options.verify_width(verify_width, block_size),
            draft_window=draft_window,
        )
        pair, tokenizer = _load(model, draft, no_draft)
        pair.plan(opts)  # a width the draft cannot hold fails before anything runs
        request = _prompt_form(tokenizer, prompt, chat)
        if json_out:
            ui.result_json(dflash_mlx.generate(pair, tokenizer, request, opts))
            return
        progress = ui.PromptProgress()
        try:
            responses = dflash_mlx.stream_generate(
                pair, tokenizer, request, opts, prompt_progress=progress
            )
            last = ui.stream(responses)
        finally:
            progress.close()
        ui.stats(last)


@app.command()
def bench(
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
    max_tokens: Annotated[int, typer.Option(help="Most tokens per generation.")] = 128,
    temp: Annotated[
        float,
        typer.Option(
            help="Sampling temperature; 0 also checks losslessness.", callback=options.finite
        ),
    ] = 0.0,
    repeats: Annotated[int, typer.Option(help="Measured passes over the prompts.")] = 3,
    verify_widths: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated verify widths W to compare, e.g. 1,2,3,4,5,8,16 "
            "(default: the engine's default width).",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for sampling at temperature > 0.")] = 0,
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
    draft_window: options.DraftWindow = None,
) -> None:
    """Measure DFlash against the target alone, side by side, on the same prompts.

    Exits with code 1 when a DFlash run at temperature 0 differs from the target's tokens.
    """
    with user_errors():
        code = bench_command.run(
            model=model,
            draft=draft,
            demo=demo,
            prompts=prompts,
            suite=suite,
            max_tokens=max_tokens,
            temp=temp,
            repeats=repeats,
            verify_widths=verify_widths,
            seed=seed,
            json_out=json_out,
            calibrate=calibrate,
            context=context,
            draft_window=draft_window,
        )
    if code:
        raise typer.Exit(code)


# Options, pair resolution and the REPL live in cli/chat.py.
app.command(name="chat")(chat_command.command)


app.command("serve")(serve_command.serve)  # options and wiring live in cli/serve.py


def _load(model: str, draft: str | None, no_draft: bool):
    """`(Pair, tokenizer)`: the target and its draft (as given, none with --no-draft, else
    the registry's published one; none known: plain decoding, with a note), behind
    spinners, checked against each other."""
    import dflash_mlx

    from .pairs import choose_draft

    choice = choose_draft(model, draft, no_draft)
    if choice.note:
        ui.note(choice.note)
    with ui.loading("target", model):
        target, tokenizer = dflash_mlx.load(model)
    if choice.draft is None:
        return dflash_mlx.Pair(target), tokenizer
    with ui.loading("draft", choice.draft):
        drafter = dflash_mlx.load_draft(choice.draft)
    return dflash_mlx.Pair(target, drafter), tokenizer


NO_PROMPT = (
    'no prompt: pass it as an argument (dflash-mlx generate "..."), with --prompt/-p, '
    "or on stdin (echo ... | dflash-mlx generate, or --prompt - to read stdin)"
)


def _prompt_text(positional: str | None, option: str | None) -> str:
    """The prompt from the argument, --prompt or stdin ("-", or neither with stdin piped),
    checked as Unicode; read before any model loads."""
    if positional is not None and option is not None:
        raise BadArgument("pass the prompt either as PROMPT or with --prompt, not both")
    name, text = ("PROMPT", positional) if positional is not None else ("--prompt", option)
    if text is None:
        if options.stdin_is_terminal():
            raise BadArgument(NO_PROMPT)
        text = "-"
    if text == "-":
        return options.unicode_text("stdin", options.read_stdin())
    return options.unicode_text(name, text)


def _prompt_form(tokenizer, prompt: str, chat: bool | None) -> str | list[dict[str, str]]:
    """The prompt as chat messages (template applied by the library) or as raw text."""
    has_template = bool(getattr(tokenizer, "has_chat_template", False))
    if chat is None:
        chat = has_template
    if chat and not has_template:
        raise BadArgument("--chat: this tokenizer has no chat template; pass --raw")
    return [{"role": "user", "content": prompt}] if chat else prompt


@app.command()
def train(
    target: Annotated[str, typer.Option(help="Target: Hub id or local mlx-lm folder.")],
    data: Annotated[
        Path,
        typer.Option(help='JSONL file or folder: {"text"}, {"prompt"} or {"messages"} per line.'),
    ],
    out: Annotated[Path, typer.Option(help="Output folder for the draft.")],
    layers: Annotated[int, typer.Option(help="Draft layers.")] = 1,
    block_size: Annotated[int, typer.Option(help="Draft block size.")] = 16,
    target_layer_ids: Annotated[
        str | None, typer.Option(help="Comma-separated target layers to read (default: spread).")
    ] = None,
    mask_token_id: Annotated[int | None, typer.Option(help="MASK token id.")] = None,
    steps: Annotated[int, typer.Option(help="Optimiser steps.")] = 1000,
    batch: Annotated[int, typer.Option(help="Sequences per step.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Longest sequence, in tokens.")] = 512,
    lr: Annotated[
        float, typer.Option(help="Peak learning rate (AdamW, cosine).", callback=options.finite)
    ] = 2e-3,
    warmup: Annotated[
        float, typer.Option(help="Warm-up fraction of the steps.", callback=options.finite)
    ] = 0.04,
    anchors_per_seq: Annotated[int, typer.Option(help="Random anchors per sequence.")] = 32,
    loss_gamma: Annotated[
        float | None,
        typer.Option(
            help="Loss decay: w_k = exp(-(k-1)/γ) (default: 7 for block 16, 4 for 8).",
            callback=options.finite,
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for data order, anchors and init.")] = 0,
    eval_every: Annotated[int, typer.Option(help="Steps between held-out τ checks.")] = 100,
    save_every: Annotated[int, typer.Option(help="Steps between checkpoints.")] = 100,
    regenerate: Annotated[
        bool, typer.Option("--regenerate", help="Let the target write the responses first.")
    ] = False,
    regen_tokens: Annotated[int, typer.Option(help="Most tokens per regenerated reply.")] = 128,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from --out's state.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Train into a non-empty --out.")] = False,
) -> None:
    """Distil a DFlash draft for a target (target frozen; its embedding and head shared)."""
    from . import train as train_command

    with user_errors():
        train_command.run(
            target=target,
            data=data,
            out=out,
            layers=layers,
            block_size=block_size,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            regenerate=regenerate,
            regen_tokens=regen_tokens,
            resume=resume,
            force=force,
            settings=dict(
                steps=steps,
                batch=batch,
                seq_len=seq_len,
                lr=lr,
                warmup=warmup,
                anchors_per_seq=anchors_per_seq,
                loss_gamma=loss_gamma,
                seed=seed,
                eval_every=eval_every,
                save_every=save_every,
            ),
        )
