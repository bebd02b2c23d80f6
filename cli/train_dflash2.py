"""`dflash-mlx train --dflash2` / `--from`: the option checks made before anything loads, the
DFlash 2 draft to start from, and the loss (the work is `dflash_mlx.train.dflash2`'s).

Kept apart from `cli/train.py`, which calls these three from small hooks.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_mlx.errors import BadArgument


def check_options(
    *, dflash2: bool, upgrade_from: str | None, init: str | None, resume: bool
) -> bool:
    """Refuse what cannot work, before anything loads; whether the run trains DFlash 2.

    `--from` with `--init` or `--resume`; a `--from` that names no local folder (a Hub id
    `owner/name` is resolved later) or a draft already DFlash 2; `--dflash2 --init` of a
    DFlash 1 draft (that is `--from`'s job: `--init` keeps a draft's own kind)."""
    if upgrade_from is not None:
        if init is not None or resume:
            raise BadArgument(
                "--from (a DFlash 1 draft to upgrade) goes without --init or --resume"
            )
        folder = Path(upgrade_from).expanduser()
        if not folder.exists():
            if folder.is_absolute() or upgrade_from.startswith(".") or upgrade_from.count("/") != 1:
                raise BadArgument(f"--from {upgrade_from}: no such draft folder")
        elif "DFlash2DraftModel" in (_architectures(folder) or []):
            raise BadArgument(
                f"--from {upgrade_from}: already a DFlash 2 draft; fine-tune it with --init instead"
            )
        return True
    if dflash2 and init is not None and _architectures(Path(init)) == ["DFlashDraftModel"]:
        raise BadArgument(
            f"--init {init} is a DFlash 1 draft: --from {init} upgrades it to DFlash 2"
        )
    return dflash2


def _architectures(folder: Path) -> list | None:
    """A local draft folder's declared architectures (None: no readable config.json)."""
    try:
        config = json.loads((folder.expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("architectures") if isinstance(config, dict) else None


def upgraded(model, start, seed: int):
    """(pair, config): the DFlash 1 draft `start` upgraded for `model` (its fit checked)."""
    import dflash_mlx
    from dflash_mlx.train.dflash2 import dflash2_config, upgrade

    dflash_mlx.Pair(model, start)  # checks that the DFlash 1 draft fits the target
    config = dflash2_config(json.loads(json.dumps(start.config.raw)))
    return dflash_mlx.Pair(model, upgrade(start, config, seed=seed)), config


def loss_for(draft):
    """The DFlash 2 loss (block loss + selector) for a DFlash 2 draft, else the block loss."""
    from dflash_mlx.train import trainer

    if draft.config.is_dflash2:
        from dflash_mlx.train.dflash2 import dflash2_loss

        return dflash2_loss
    return trainer.block_loss
