"""This process's place among the ranks: joining them (`start`, `session`), ending with them
(`finish`), agreeing on what could differ (`agree`, `fewest`), and the stall watchdog."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadArgument
from . import control
from .control import CLOSED, Channel

SHARDS = ("auto", "tensor", "pipeline", "none")


class RanksFailed(RuntimeError):
    """The ranks fell out of step, or one of them failed (ours: a bug or a lost machine)."""


def launched() -> bool:
    """Whether `mlx.launch` (or another launcher setting MLX_RANK) started this process as
    one of several ranks."""
    return os.environ.get("MLX_RANK") is not None and _world_hint() != 1


def _world_hint() -> int | None:
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            return len(json.loads(open(path).read() or "[]")) or 1
        except (OSError, ValueError):
            return None
    return None


def launched_rank() -> int:
    """This process's rank as the launcher set it (0 when not launched)."""
    try:
        return int(os.environ.get("MLX_RANK", "0"))
    except ValueError:
        return 0


def quiet() -> None:
    """Ranks other than 0 write nothing: stdout goes nowhere, stderr into a file whose last
    line a failing rank sends to rank 0 (`fail`). Called first thing by the CLI."""
    if launched():
        control.quiet(launched_rank())


@dataclass
class Cluster:
    """This process's place among the ranks."""

    group: Any
    rank: int
    size: int
    shard: str  # "tensor" or "pipeline"
    channel: Channel
    leading: bool = False  # rank 0 of a server: its decoder's inputs are broadcast
    ordinals: dict[int, int] = field(default_factory=dict)  # id(row) -> admission number
    admitted: int = 0
    events: list = field(default_factory=list)  # since the last step (rank 0)
    cancels: list = field(default_factory=list)  # rows whose cancel waits for the next step
    caches: dict[int, int] = field(default_factory=dict)  # id(prompt cache) -> its number
    cache_count: int = 0
    stepping: float | None = None  # when this rank's current step last made progress
    stall: float = 120.0  # seconds a step may go without progress


_CLUSTER: Cluster | None = None


def current() -> Cluster | None:
    """The cluster this process is a rank of (None: alone)."""
    return _CLUSTER


def speaks() -> bool:
    """Whether this process writes output: alone, or rank 0."""
    return _CLUSTER is None or _CLUSTER.rank == 0


def check_shard(shard: str) -> str:
    if shard not in SHARDS:
        raise BadArgument(f"--shard {shard!r}: expected one of {', '.join(SHARDS)}")
    return shard


def check_launched(shard: str) -> None:
    """`--shard tensor|pipeline` in a process that is not one of several ranks: refused."""
    if shard in ("tensor", "pipeline") and not launched():
        raise BadArgument(
            f"--shard {shard}: this process is not one of several ranks; start every "
            "rank with mlx.launch (e.g. mlx.launch --backend ring --hosts 127.0.0.1 -n 2 "
            "-- dflash-mlx ...), or pass --shard none"
        )


def check_timeouts() -> None:
    """The watchdog's settings (`DFLASH_MLX_RANK_TIMEOUT`, `DFLASH_MLX_STALL_TIMEOUT`,
    `DFLASH_MLX_CONNECT_TIMEOUT`): a bad value is one `error:` line, before loading."""
    control.rank_timeout()
    control.stall_timeout()
    control.connect_timeout()


def start(shard: str) -> Cluster | None:
    """Join the ranks the launcher started (None when this process runs alone, or with
    `--shard none`). `--shard tensor|pipeline` outside a launch is refused."""
    global _CLUSTER
    check_shard(shard)
    if shard == "none":
        return None
    if not launched():
        check_launched(shard)
        return None
    if _CLUSTER is not None:
        return _CLUSTER
    check_timeouts()
    import mlx.core as mx

    group = mx.distributed.init(strict=True)
    if group.size() == 1:
        return None
    channel = Channel(group.rank(), group.size(), group)
    _CLUSTER = Cluster(group, group.rank(), group.size(), shard, channel)
    _CLUSTER.stall = control.stall_timeout()
    channel.stalled = _stalled
    _hold_sigterm(channel)
    return _CLUSTER


def _hold_sigterm(channel: Channel) -> None:
    """`mlx.launch` ends every rank (SIGTERM) once one has exited with an error, and on a
    loaded machine it can do so before this rank's channel has said why (the rank that
    vanished, rank 0's abort). A SIGTERM here leaves the rank running a few seconds more
    (longer while its exit work runs), so that the channel or the rank's own ending has its
    word; then it ends the rank as SIGTERM would have, with a line that says so. The handler
    returns at once: the main thread may be the one that ends the rank."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def end_later() -> None:
        start = time.monotonic()
        grace = control.GRACE + control.ANSWER_GRACE + 1.0
        while time.monotonic() - start < (control.EXIT_WORK + 2.0 if channel.ending else grace):
            time.sleep(0.05)
        control.say(f"error: rank {channel.rank} was ended by a signal (SIGTERM)")
        os._exit(128 + signal.SIGTERM)

    def on_term(signum, frame) -> None:
        threading.Thread(target=end_later, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)


def finish(code: int, why: str = "") -> None:
    """This rank ends with `code` (the others are told; `why`: a failure's message)."""
    global _CLUSTER
    c = _CLUSTER
    if c is None:
        return
    c.stepping = None
    if code == 0:
        # Every rank at its end: a pass still in flight (one launched ahead) has every rank's
        # part done before any rank closes its connections.
        import mlx.core as mx

        mx.eval(mx.distributed.all_sum(mx.array(1), group=c.group, stream=mx.cpu))
    c.channel.close(code, why or control.last_line())
    if c.rank != 0 and code not in (0, 130):
        # Rank 0 says why and ends every rank (this one too); a rank that ended first would
        # have the launcher end rank 0 before it could.
        time.sleep(control.GRACE + control.ANSWER_GRACE + 3)
    if c.rank == 0:
        # The others' `bye`, so that none is taken for a rank that vanished, and so that the
        # launcher (which ends every rank once one exits with an error code) does not cut
        # their pending work short (`Channel.before_exit`).
        end = time.monotonic() + control.EXIT_WORK + 5.0
        while len(c.channel.said_bye | c.channel.gone) < c.size - 1 and time.monotonic() < end:
            time.sleep(0.01)
    _CLUSTER = None


class session:
    """`with session():` around a command's body, which calls `join(shard)` when it knows the
    sharding: this rank joins the others, and on the way out tells them how it ended (its
    exit code; a failing rank's error goes to rank 0, which ends every rank with it)."""

    def __init__(self) -> None:
        self.cluster: Cluster | None = None

    def join(self, shard: str) -> Cluster | None:
        self.cluster = start(shard)
        return self.cluster

    def __enter__(self) -> session:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if self.cluster is None:
            return
        if self.cluster.rank == 0:
            self.cluster.channel.ending = True  # rank 0's own message goes out
        code, why = 0, ""
        if kind is not None:
            code = _exit_code(error)
            self.cluster.channel.failed_first(code)
            if code == 1 and self.cluster.rank == 0 and isinstance(error, Exception):
                # Ours, on rank 0: the one line the CLI prints names the rank.
                error.args = (f"on rank 0 of {self.cluster.size}: {error}",)
            if code and not isinstance(error, SystemExit) and str(error):
                why = str(error)
                if code != 2:
                    why = f"{type(error).__name__}: {why}"
        finish(code, why)


def _exit_code(error: BaseException | None) -> int:
    if error is None:
        return 0
    # A command's chosen exit (click's `Exit`, or typer's: its own class since typer 0.10).
    code = getattr(error, "exit_code", None)
    if type(error).__name__ == "Exit" and (code is None or isinstance(code, int)):
        return int(code or 0)
    if isinstance(error, SystemExit):
        return int(error.code) if isinstance(error.code, int) else 1
    if isinstance(error, KeyboardInterrupt):
        return 130
    from ..errors import UserError

    return 2 if isinstance(error, UserError) else 1


def abort(message: str, code: int = 1) -> None:
    """End every rank now with one `error:` line (rank 0 says it; another rank tells rank 0,
    which says it). Never returns."""
    c = _CLUSTER
    if c is None:
        raise RanksFailed(message)
    if c.rank == 0:
        c.channel._abort(message, code)
    else:
        c.channel.tell_leader(("fail", message, code))
        time.sleep(control.GRACE + control.ANSWER_GRACE + 5)
        control.say(f"error: {message}")  # rank 0 did not end it: it cannot
    os._exit(code)


# -- agreement ----------------------------------------------------------------------------


def agree(what: str, value: Any) -> Any:
    """Rank 0's `value` on every rank (`what` names the decision point: ranks that reach
    different points have fallen out of step, which is refused). Alone: `value`."""
    c = _CLUSTER
    if c is None:
        return value
    progress()
    _fault(c, what)
    if c.rank == 0:
        c.channel.send(("agree", what, value))
        return value
    return _expect(c, what)


def _expect(c: Cluster, what: str) -> Any:
    msg = c.channel.recv()
    if msg is CLOSED or msg[0] != "agree" or msg[1] != what:
        got = "the end" if msg is CLOSED else f"{msg[0]} {msg[1] if len(msg) > 1 else ''}"
        raise RanksFailed(
            f"rank {c.rank} fell out of step with rank 0: expected {what!r}, got {got}"
        )
    return msg[2]


def fewest(what: str, value: int) -> int:
    """The least of every rank's `value` (an integer), on every rank: what each rank can
    do on its own (e.g. the stored prompt blocks it holds), cut to what all can. Each rank
    reports to rank 0, which answers the least. Alone: `value`."""
    c = _CLUSTER
    if c is None:
        return value
    progress()
    if c.rank != 0:
        c.channel.tell_leader(("report", what, int(value)))
        return int(_expect(c, what))
    least = int(value)
    for r in sorted(c.channel.peers):
        got = c.channel.reply(r, c.channel.timeout + c.stall)
        if got is None or got[0] != what:
            said = "nothing" if got is None else repr(got[0])
            raise RanksFailed(
                f"rank {r} fell out of step with rank 0: expected {what!r}, got {said}"
            )
        least = min(least, int(got[1]))
    c.channel.send(("agree", what, least))
    return least


# -- the stall watchdog -------------------------------------------------------------------


def stepping() -> None:
    """A decode step begins on this rank (the watchdog runs until `stepped`)."""
    c = _CLUSTER
    if c is not None:
        c.stepping = time.monotonic()


def stepped() -> None:
    """The decode step ended on this rank."""
    c = _CLUSTER
    if c is not None:
        c.stepping = None


def progress(*_: Any) -> None:
    """The current step moved on (a prefill chunk, a cycle's agreement)."""
    c = _CLUSTER
    if c is not None and c.stepping is not None:
        c.stepping = time.monotonic()


def _stalled() -> str | None:
    c = _CLUSTER
    if c is None or c.stepping is None:
        return None
    idle = time.monotonic() - c.stepping
    if idle <= c.stall:
        return None
    return (
        f"rank {c.rank} made no progress for {idle:.0f} s inside a decode step (a collective "
        "that never completed: the ranks fell out of step; DFLASH_MLX_STALL_TIMEOUT)"
    )


# -- faults, for the tests ------------------------------------------------------------------

_FAULT: dict[str, Any] = {}


def _fault(c: Cluster, what: str) -> None:
    """A test hook: `DFLASH_MLX_TEST_FAULT="RANK:KIND:N"` makes rank RANK fail at its Nth
    agreement of a decode cycle (`raise`: a RuntimeError; `stop`: SIGSTOP itself, a rank that
    stops answering; `hang`: its main thread never returns, its heartbeat goes on). Read
    once; unset, nothing happens."""
    if not _FAULT:
        spec = os.environ.get("DFLASH_MLX_TEST_FAULT", "")
        parts = spec.split(":")
        _FAULT["spec"] = None
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            _FAULT["spec"] = (int(parts[0]), parts[1], int(parts[2]))
        _FAULT["seen"] = 0
    spec = _FAULT["spec"]
    if spec is None or spec[0] != c.rank or what not in ("cycle seconds", "launch seconds"):
        return
    _FAULT["seen"] += 1
    if _FAULT["seen"] != spec[2]:
        return
    if spec[1] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif spec[1] == "hang":  # its threads (the heartbeat) go on: a step that never ends
        while True:
            time.sleep(3600)
    elif spec[1] == "raise":
        raise RuntimeError(f"injected fault on rank {c.rank} (DFLASH_MLX_TEST_FAULT)")
