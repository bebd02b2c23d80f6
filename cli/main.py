"""The `dflash-mlx` command: typer wiring only.

Each command parses its options, calls the public `dflash_mlx` API and hands what comes back
to `ui.py`. The library (and so mlx) is imported inside the commands, so `dflash-mlx --help`
answers without loading MLX.
"""

from pathlib import Path
from typing import Annotated

import typer

from . import errors, help_style

help_style.install()  # flags without a <bool>, arguments as SOURCE (before any command)
errors.install_usage_errors()  # one `error:` line, as every other error

from . import bench as bench_command  # noqa: E402
from . import chat as chat_command  # noqa: E402
from . import generate as generate_command  # noqa: E402
from . import models as models_command  # noqa: E402
from . import options, ui  # noqa: E402
from . import serve as serve_command  # noqa: E402
from .errors import user_errors  # noqa: E402
from .quantize import app as quantize_app  # noqa: E402

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
app.add_typer(__import__("dflash_mlx.cli.cache", fromlist=["app"]).app, name="cache")


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
    from dflash_mlx.distributed import quiet

    quiet()  # under mlx.launch, ranks other than 0 write nothing (docs/distributed.md)


app.command("generate")(generate_command.command)  # options and wiring: cli/generate.py
app.command("bench")(bench_command.command)  # options and wiring: cli/bench.py
app.command("chat")(chat_command.command)  # options, pair resolution, the REPL: cli/chat.py
app.command("serve")(serve_command.serve)  # options and wiring: cli/serve.py
app.command("ls")(models_command.ls)  # the models here: cli/models.py
app.command("pull")(models_command.pull)
app.command("rm")(models_command.rm)


@app.command()
def train(
    data: Annotated[
        Path,
        typer.Option(help='JSONL file or folder: {"text"}, {"prompt"} or {"messages"} per line.'),
    ],
    out: Annotated[Path, typer.Option(help="Output folder for the draft.")],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="Target: Hub id or local mlx-lm folder. [required]",
            show_default=False,
        ),
    ] = None,
    target: Annotated[
        str | None, typer.Option("--target", hidden=True, help="Deprecated: use --model/-m.")
    ] = None,
    layers: Annotated[int, typer.Option(help="Draft layers.")] = 1,
    draft_block: Annotated[
        int | None,
        typer.Option(
            "--draft-block",
            help="The draft's block: tokens it proposes per pass (default 16). Elsewhere "
            "--block-size is the old name of --verify-width; here it is this one's.",
            show_default=False,
        ),
    ] = None,
    block_size: Annotated[
        int | None, typer.Option("--block-size", hidden=True, help="Deprecated: --draft-block.")
    ] = None,
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
    continuations: Annotated[
        int | None,
        typer.Option(
            help="With --regenerate: the target's continuations of each prompt (whole, then "
            "cut at offsets with a sampled branch; default: enough for the steps).",
            show_default=False,
        ),
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from --out's state.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Train into a non-empty --out.")] = False,
    long_context: Annotated[
        str | None,
        typer.Option(
            help="Train on long prompts: windows of these many tokens (e.g. 1024,3072) cut "
            "from --data's texts, each continued by the target; reports held-out τ at each "
            "length before and after.",
            show_default=False,
        ),
    ] = None,
    long_windows: Annotated[
        int, typer.Option(help="With --long-context: windows per length.")
    ] = 64,
    init: Annotated[
        str | None,
        typer.Option(
            help="Fine-tune this draft (local folder or Hub id) instead of a new one: its "
            "config and weights (--layers, --block-size, --target-layer-ids are its own).",
            show_default=False,
        ),
    ] = None,
    dflash2: Annotated[
        bool,
        typer.Option(
            "--dflash2",
            help="Train a DFlash 2 draft (two-tap conv and candidate selector; docs/training.md).",
        ),
    ] = False,
    upgrade_from: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Upgrade this DFlash 1 draft to DFlash 2: its weights, identity convs and a "
            "selector that starts at its argmax, then fine-tuned (implies --dflash2).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Distil a DFlash draft for a target (target frozen; its embedding and head shared)."""
    from . import train as train_command
    from .train_options import aliases

    with user_errors():
        target, block, notes = aliases(model, target, draft_block, block_size)
        train_command.run(
            target=target,
            notes=notes,
            data=data,
            out=out,
            layers=layers,
            block_size=block,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            regenerate=regenerate,
            regen_tokens=regen_tokens,
            resume=resume,
            force=force,
            long_context=long_context,
            long_windows=long_windows,
            init=init,
            dflash2=dflash2,
            upgrade_from=upgrade_from,
            continuations=continuations,
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
