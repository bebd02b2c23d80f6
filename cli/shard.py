"""`--shard`: the target split across the ranks `mlx.launch` started (docs/distributed.md).

Every rank runs the same command: it joins the others, loads its shard of the target and the
whole draft, and decodes in lockstep (`dflash_mlx.distributed`). Rank 0 speaks; the others are
silent (`dflash_mlx.distributed.quiet`, from the CLI's first callback). The library is imported
inside the functions (`--help` stays free of mlx).
"""

from __future__ import annotations

from typing import Any

from dflash_mlx.errors import BadArgument

from . import ui


def check(shard: str) -> None:
    """An unknown `--shard` kind: one `error:` line, before anything else."""
    from dflash_mlx import distributed

    distributed.check_shard(shard)


def refuse_chat(shard: str) -> None:
    """`chat` runs in one process only: `--shard tensor|pipeline`, or any chat `mlx.launch`
    started, is one `error:` line (exit 2) before anything loads. mlx.launch hands each rank
    a pipe for stdin, never the terminal (no line editing, no REPL), and never closes it (a
    piped chat would wait for the end of its input forever)."""
    from dflash_mlx import distributed

    distributed.check_shard(shard)
    if shard in ("tensor", "pipeline") or (shard != "none" and distributed.launched()):
        what = f"chat --shard {shard}" if shard != "auto" else "chat under mlx.launch"
        raise BadArgument(
            f"{what}: chat does not run across ranks (mlx.launch gives each rank a pipe for "
            "stdin, never the terminal, and never closes it: the chat would wait for input "
            "forever); serve the model across ranks instead (mlx.launch ... -- dflash-mlx "
            "serve) and chat with it from its page or any OpenAI client, or chat in one "
            "process"
        )
    if distributed.launched():
        raise BadArgument(
            "chat --shard none under mlx.launch: every rank would chat alone on a stdin "
            "mlx.launch never closes; run chat without mlx.launch"
        )


def plan(model: str, shard: str) -> str | None:
    """The sharding `model` loads with (None: in one process), checked before any weight
    loads: an unknown kind, a family mlx-lm or DFlash cannot shard so, or `--shard
    tensor|pipeline` outside a launch, each one `error:` line (exit 2)."""
    from dflash_mlx import distributed
    from dflash_mlx.models.loading import choose_shard

    distributed.check_shard(shard)
    if shard == "none" or (shard == "auto" and not distributed.launched()):
        return None
    distributed.check_timeouts()
    kind = choose_shard(model, shard)
    distributed.check_launched(shard)
    return kind


def load(model: str, choice: Any, kind: str):
    """`(Pair, tokenizer)` on this rank: its shard of the target (`kind`), the whole draft,
    rank 0's calibration (`distributed.lockstep_calibration`)."""
    import dflash_mlx
    from dflash_mlx import distributed
    from dflash_mlx.models.loading import load_sharded

    cluster = distributed.current()
    if choice.note:
        ui.note(choice.note)
    with ui.loading("target", f"{model} ({kind} parallel, {cluster.size} ranks)"):
        target, tokenizer = load_sharded(model, kind, cluster.group)
    if choice.draft is None:
        return dflash_mlx.Pair(target), tokenizer
    with ui.loading("draft", choice.draft):
        drafter = dflash_mlx.load_draft(choice.draft)
    pair = dflash_mlx.Pair(target, drafter)
    distributed.lockstep_calibration(pair)
    return pair, tokenizer


def load_for(model: str, choice: Any, kind: str | None, ranks: Any):
    """With a sharding (`kind`, from `plan`): join the ranks (`ranks`, the command's
    `distributed.session`) and load this rank's `(Pair, tokenizer)`; else None (the caller
    loads in one process)."""
    if kind is None or ranks is None or ranks.join(kind) is None:
        return None
    return load(model, choice, kind)


def store_folder(folder: Any, cluster: Any) -> Any:
    """The prompt store's folder on this rank: across ranks a subfolder per rank and
    sharding (`tensor-2-rank1`): each rank's blocks hold its own shard, never another's,
    also when the ranks share a machine or a disk."""
    if folder is None or cluster is None:
        return folder
    from dflash_mlx.paths import cache_dir

    from .cache import DEFAULT_DIR

    base = cache_dir() / "prompt-cache" if folder == DEFAULT_DIR else folder
    return base / f"{cluster.shard}-{cluster.size}-rank{cluster.rank}"


def speaks() -> bool:
    """Whether this process writes output (alone, or rank 0)."""
    from dflash_mlx import distributed

    return distributed.speaks()
