"""The random demonstration pair behind `dflash-mlx bench --demo`: built once, then cached.

A tiny random Qwen3-style target and a random DFlash draft, built with `dflash_mlx.models.tiny`,
so the bench can run end to end without downloads. Their text is gibberish and the draft
is never right (tau ~ 1): not a useful model, and no measure of what DFlash gains with a
trained draft. Knows nothing about the bench itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .errors import BadArgument
from .paths import cache_dir

DEMO_NAME = "demo-pair-v1"  # bump when the random pair's recipe changes
LAYERS = 4
HIDDEN = 64
# The trained pair shipped in the package (scripts/make_demo_pair.py builds it).
SHIPPED = Path(__file__).parent / "demo_pair"


def shipped() -> bool:
    return all((SHIPPED / part / "config.json").is_file() for part in ("target", "draft"))


# DFLASH_MLX_DEMO=dflash2: the shipped target with its DFlash 2 draft (`train --from` the
# shipped draft, docs/models.md#the-demo-pair).
DFLASH2 = os.environ.get("DFLASH_MLX_DEMO") == "dflash2" and (SHIPPED / "draft2").is_dir()


# DFLASH_MLX_DEMO=random forces the random pair (e.g. for a reply that never ends).
TRAINED = shipped() and os.environ.get("DFLASH_MLX_DEMO") != "random"
DESCRIPTION = (
    "trained demo pair: a tiny (3.7M-parameter, 4-layer) code model trained for 30 minutes "
    "on the Python standard library's source + its distilled 2-layer "
    + (
        "DFlash 2 draft (block 16, upgraded from the DFlash 1 draft)"
        if DFLASH2
        else "DFlash draft (block 16)"
    )
    if TRAINED
    else f"random qwen3 target ({LAYERS} layers, hidden {HIDDEN}) "
    f"+ random 2-layer DFlash draft (block 16)"
)
# What every --demo says before it runs: what the pair is, and what it is not.
NOTICE = (
    f"the {DESCRIPTION}. It writes Python-looking text, not answers: a demonstration that "
    "runs offline, not a useful assistant."
    if TRAINED
    else f"a tiny RANDOM demonstration pair ({DESCRIPTION}), not a useful model: its text "
    "is gibberish and its draft is never right (τ ≈ 1), so DFlash runs slower than the "
    "target alone. It only shows the command working."
)


def demo_pair(root: Path | None = None) -> tuple[Path, Path]:
    """(target folder, draft folder) of the demo pair: the shipped trained pair, or (when
    the package has none, or `root` is given) a random pair built once under `root`."""
    from .models.tiny import build_draft, build_target, draft_config, qwen3_config, write_tokenizer

    if root is None and TRAINED:
        return SHIPPED / "target", SHIPPED / ("draft2" if DFLASH2 else "draft")
    folder = (root or cache_dir()) / DEMO_NAME
    target, draft = folder / "target", folder / "draft"
    if (folder / "complete").exists():
        return target, draft
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the final place, then move it there: a crash leaves no half pair.
        work = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=folder.parent))
    except OSError as e:
        raise BadArgument(f"cannot create the demo pair under {folder.parent}: {e}") from None
    try:
        (work / "target").mkdir()
        write_tokenizer(work / "target")
        build_target(work / "target", qwen3_config(layers=LAYERS, hidden=HIDDEN), seed=1)
        build_draft(work / "draft", draft_config(LAYERS, [1, 2], hidden=HIDDEN), seed=2)
        (work / "complete").write_text(DESCRIPTION + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        try:
            work.rename(folder)
        except OSError:
            if not (folder / "complete").exists():  # else: another process just built it
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target, draft
