"""Would more data or more steps help? The held-out curve's slope says (issue 64).

At every held-out check `train` also measures the block loss, with the same fixed anchors
each time, on the held-out examples and on as many training examples (`probe_losses`):
paired from check to check, so their slope is the draft's progress, not the anchors'
luck (a τ of 8 prompts moves by ±0.5 between checks of the same draft). `verdict` reads
the end of that curve:

- the held-out loss still falling at the end (by `RISING` of itself per 100 steps or more,
  even as the schedule's rate decays): more steps would help;
- the held-out loss above the training loss by `GAP` of it or more: the draft fits its
  own data better than text it has not seen, so more data would help (more prompts, or
  more continuations of each: `--continuations`);
- neither: the draft learnt what this data and size can teach; a deeper draft
  (`--layers`) is what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

RISING = 0.02  # the held-out loss's fall per 100 steps, a share of itself, that says "more steps"
GAP = 0.15  # held-out loss over training loss, less 1, that says "more data"
PROBE_ANCHORS = 64  # anchors per example in a probe


@dataclass
class Verdict:
    more_steps: bool
    more_data: bool
    line: str  # one line, for the command to print


def probe_loss(pair, examples, block_loss, gamma: float, seed: int = 0) -> float:
    """The block loss of `examples` (up to 16, whole) at fixed seeded anchors: the same
    anchors at every check of a run. nan without examples."""
    from .trainer import TrainSettings, block_targets, sample_rows

    examples = examples[:16]
    if not examples:
        return float("nan")
    st = TrainSettings(batch=len(examples), anchors_per_seq=PROBE_ANCHORS, seed=seed)
    rng = np.random.default_rng((seed, 5))
    _, tokens, lengths, si, an = sample_rows(examples, st, int(rng.integers(1 << 30)))
    tokens = mx.array(tokens)
    feats, nxt = block_targets(pair, tokens)
    args = (mx.array(si), mx.array(an), mx.array(lengths), gamma)
    return block_loss(pair, feats, nxt, tokens, *args).item()


def verdict(evals: list[dict]) -> Verdict | None:
    """The verdict from a run's checks (`TrainLog.evals`: step, tau, held_loss,
    train_loss); None before two checks with losses."""
    pts = [e for e in evals if e.get("held_loss") == e.get("held_loss") and "held_loss" in e]
    if len(pts) < 2:
        return None
    a, b = pts[-2], pts[-1]
    per100 = 100 / max(1, b["step"] - a["step"])
    fall = (a["held_loss"] - b["held_loss"]) * per100 / b["held_loss"]
    gap = b["held_loss"] / b["train_loss"] - 1 if b.get("train_loss") else 0.0
    more_steps, more_data = fall >= RISING, gap >= GAP
    curve = (
        f"held-out loss {a['held_loss']:.2f} → {b['held_loss']:.2f} over steps {a['step']}-"
        f"{b['step']} ({-fall:+.1%} per 100 steps), τ {a.get('tau', 0):.2f} → "
        f"{b.get('tau', 0):.2f}; training loss {b.get('train_loss', float('nan')):.2f}"
    )
    if more_steps and more_data:
        say = "more steps and more data would both help"
    elif more_steps:
        say = "more steps would help (the held-out curve is still falling)"
    elif more_data:
        say = "more data would help, not more steps (the draft fits its own data better)"
    else:
        say = "neither more data nor more steps is likely to help much (a deeper draft might)"
    return Verdict(more_steps, more_data, f"{say}: {curve}")
