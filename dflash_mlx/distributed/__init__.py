"""One pair across several machines: the target sharded with `mx.distributed` (SPEC 10).

`mlx.launch` starts the same command on every rank. Each rank loads the target's shard
(`models.loading.load_sharded`: mlx-lm's tensor or pipeline parallelism) and the whole draft,
and runs the same decode cycle in lockstep: the target's passes meet in collectives, so every
rank must feed them the same tokens in the same shapes. What could differ between ranks is
agreed here, rank 0's value broadcast to the others over a control connection (`control`):

- every wall-clock measurement the engine feeds its width choosers (`agree`, a few hooks
  in the engine), so each rank's choosers hold the same state and take the same decisions
  (widths, draft block, chain or tree, when to capture features, when to probe);
- a random seed drawn for a request without one;
- the calibration's cost curves (`calibration`: rank 0's file, measured in lockstep when
  missing);
- for `serve`, each admission (prompt tokens and options), cancel and prompt cache the pool
  hands out, applied by every rank at the start of the same step (`serving.follow` runs the
  other ranks' decoder); a prompt store's hit is the longest prefix every rank holds
  (`fewest`).

The control connection is also the watchdog: a rank that fails tells rank 0, which says so
in one line and ends every rank; a rank that vanishes (killed, its machine gone) closes its
connection, one that stops answering misses its heartbeats (`DFLASH_MLX_RANK_TIMEOUT`), and
a decode step that makes no progress (`DFLASH_MLX_STALL_TIMEOUT`) means the ranks fell out of
step: each ends every rank with one message. Rank 0 speaks (stdout, HTTP, stats); the
others write nothing (`quiet`).

Nothing here runs, and every hook returns its value unchanged, in a process alone.
"""

from __future__ import annotations

from .calibration import freeze_calibration, lockstep_calibration
from .cluster import (
    SHARDS,
    Cluster,
    RanksFailed,
    abort,
    agree,
    check_launched,
    check_shard,
    check_timeouts,
    current,
    fewest,
    finish,
    launched,
    launched_rank,
    progress,
    quiet,
    session,
    speaks,
    start,
    stepped,
)
from .control import CONNECT_TIMEOUT, GRACE, Channel
from .pipeline import pipeline_features, pipeline_span
from .serving import (
    cancel_later,
    follow,
    lead,
    pool_acquired,
    pool_released,
    step,
    step_failed,
    submitted,
    when_aborting,
)

__all__ = [
    "CONNECT_TIMEOUT",
    "GRACE",
    "SHARDS",
    "Channel",
    "Cluster",
    "RanksFailed",
    "abort",
    "agree",
    "cancel_later",
    "check_launched",
    "check_shard",
    "check_timeouts",
    "current",
    "fewest",
    "finish",
    "follow",
    "freeze_calibration",
    "launched",
    "launched_rank",
    "lead",
    "lockstep_calibration",
    "pipeline_features",
    "pipeline_span",
    "pool_acquired",
    "pool_released",
    "progress",
    "quiet",
    "session",
    "speaks",
    "start",
    "step",
    "step_failed",
    "stepped",
    "submitted",
    "when_aborting",
]
