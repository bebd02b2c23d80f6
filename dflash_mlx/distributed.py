"""One pair across several machines: the target sharded with `mx.distributed` (SPEC 10).

`mlx.launch` starts the same command on every rank. Each rank loads the target's shard
(`models.loading.load_sharded`: mlx-lm's tensor or pipeline parallelism) and the whole draft,
and runs the same decode cycle in lockstep: the target's passes meet in collectives, so every
rank must feed them the same tokens in the same shapes. What could differ between ranks is
agreed here, rank 0's value broadcast to the others over a control connection:

- every wall-clock measurement the engine feeds its width choosers (`agree`, a few hooks
  in the engine), so each rank's choosers hold the same state and take the same decisions
  (widths, draft block, chain or tree, when to capture features, when to probe);
- a random seed drawn for a request without one;
- the calibration's cost curves (`LockstepCalibration`: rank 0's file, measured in
  lockstep when missing);
- for `serve`, each admission (prompt tokens and options) and each cancel, applied by every
  rank at the start of the same step (`follow` runs the other ranks' decoder).

The control connection is also the watchdog: a rank that fails tells rank 0, which says so
in one line and ends every rank; a rank that vanishes (killed, its machine gone) closes its
connection, and the others end at once with one message. Rank 0 speaks (stdout, HTTP,
stats); the others write nothing (`quiet`).

Nothing here runs, and every hook returns its value unchanged, in a process alone.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import BadArgument

SHARDS = ("auto", "tensor", "pipeline", "none")

# How long a rank waits for the others at start-up (loading a large shard can take long).
CONNECT_TIMEOUT = float(os.environ.get("DFLASH_MLX_CONNECT_TIMEOUT", "600"))
# How long rank 0 lets its own error reach the user before a rank's failure ends it.
GRACE = 2.0


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


# -- silence ---------------------------------------------------------------------------------

_QUIET: dict[str, Any] = {}


def quiet() -> None:
    """Ranks other than 0 write nothing: stdout goes nowhere, stderr into a file whose last
    line a failing rank sends to rank 0 (`fail`). Called first thing by the CLI."""
    if _QUIET or launched_rank() == 0 or not launched():
        return
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    _QUIET["stderr"] = os.dup(2)  # to speak when rank 0 is gone and cannot
    log = tempfile.TemporaryFile(mode="w+b")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(log.fileno(), 2)
    os.close(null)
    _QUIET["log"] = log


def _last_line() -> str:
    log = _QUIET.get("log")
    if log is None:
        return ""
    try:
        sys.stderr.flush()
        log.seek(0)
        lines = [ln.strip() for ln in log.read().decode(errors="replace").splitlines()]
        lines = [ln for ln in lines if ln]
        return lines[-1] if lines else ""
    except OSError:
        return ""


def _say(message: str) -> None:
    """One line on this rank's real stderr (a rank other than 0 only when rank 0 cannot)."""
    fd = _QUIET.get("stderr", 2)
    try:
        os.write(fd, (message.rstrip() + "\n").encode())
    except OSError:
        pass


# -- the control connection -------------------------------------------------------------------


def _send_frame(sock: socket.socket, obj: Any, plain: bool = False) -> None:
    """A frame: rank 0's messages pickled (options, curves), the others' JSON (`plain`):
    rank 0 never unpickles what reaches its port."""
    data = json.dumps(obj).encode() if plain else pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket, plain: bool = False, limit: int = 1 << 40) -> Any:
    head = _recv_exact(sock, 8)
    if head is None:
        return None
    size = struct.unpack("!Q", head)[0]
    if size > limit:
        return None
    body = _recv_exact(sock, size)
    if body is None:
        return None
    if plain:
        try:
            return json.loads(body)
        except ValueError:
            return None
    return pickle.loads(body)


_CLOSED = ("closed",)


class Channel:
    """Rank 0 connected to every other rank: messages from rank 0 in order, and each
    rank's end (`bye`, `fail`, or its connection closing) watched by a thread."""

    def __init__(self, rank: int, size: int, group: Any):
        self.rank, self.size = rank, size
        self.peers: dict[int, socket.socket] = {}  # rank 0: the others
        self.leader: socket.socket | None = None  # the others: rank 0
        self.inbox: queue.Queue = queue.Queue()
        self.ending = False  # this rank is ending on its own (its own message goes out)
        self.said_bye: set[int] = set()
        self._lock = threading.Lock()
        self._connect(group)

    def _connect(self, group: Any) -> None:
        import mlx.core as mx

        host = _leader_host()
        if self.rank == 0:
            server = socket.create_server((_bind_host(host), 0))
            port = server.getsockname()[1]
        else:
            server, port = None, 0
        # The one collective of the set-up: rank 0's port and a token the others must show
        # (only the ranks learn it), the others add zeros.
        token = int.from_bytes(os.urandom(3), "little") if server is not None else 0
        shared = mx.distributed.all_sum(mx.array([port, token], dtype=mx.int32), stream=mx.cpu)
        port, token = (int(v) for v in shared.tolist())
        if server is not None:
            server.settimeout(CONNECT_TIMEOUT)
            while len(self.peers) < self.size - 1:
                conn, _ = server.accept()
                conn.settimeout(10)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                hello = _recv_frame(conn, plain=True, limit=256)
                ok = isinstance(hello, list) and len(hello) == 3 and hello[0] == "hello"
                if not ok or hello[2] != token or not 0 < int(hello[1]) < self.size:
                    conn.close()  # not one of ours
                    continue
                conn.settimeout(None)
                self.peers[int(hello[1])] = conn
            server.close()
            for r, conn in self.peers.items():
                threading.Thread(target=self._watch_peer, args=(r, conn), daemon=True).start()
        else:
            deadline = time.monotonic() + CONNECT_TIMEOUT
            while True:
                try:
                    sock = socket.create_connection((host, port), timeout=10)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_frame(sock, ["hello", self.rank, token], plain=True)
            self.leader = sock
            threading.Thread(target=self._watch_leader, daemon=True).start()

    # rank 0 -> the others
    def send(self, obj: Any) -> None:
        with self._lock:
            for conn in self.peers.values():
                try:
                    _send_frame(conn, obj)
                except OSError:
                    pass  # its watcher says why it is gone

    def recv(self) -> Any:
        return self.inbox.get()

    # the others -> rank 0
    def tell_leader(self, obj: Any) -> None:
        if self.leader is not None:
            try:
                _send_frame(self.leader, list(obj), plain=True)
            except OSError:
                pass

    def _watch_leader(self) -> None:
        while True:
            msg = _recv_frame(self.leader)
            if msg is None:
                if self.ending or 0 in self.said_bye:
                    self.inbox.put(_CLOSED)
                    return
                _say(
                    f"error: rank 0 ended without a word (killed, or its machine is gone): "
                    f"rank {self.rank} stops too"
                )
                os._exit(1)
            if msg[0] == "bye":
                self.said_bye.add(0)
                self.inbox.put(_CLOSED)
            elif msg[0] == "abort":
                os._exit(int(msg[1]))  # rank 0 said why
            else:
                self.inbox.put(msg)

    def _watch_peer(self, rank: int, conn: socket.socket) -> None:
        while True:
            msg = _recv_frame(conn, plain=True, limit=1 << 20)
            if msg is None:
                if rank in self.said_bye:
                    return
                self._abort(
                    f"rank {rank} ended without a word (killed, or its machine is gone): "
                    "every rank stops",
                    grace=False,
                )
                return
            if msg[0] == "bye":
                self.said_bye.add(rank)
            elif msg[0] == "fail":
                self.said_bye.add(rank)
                self._abort(f"rank {rank} failed: {msg[1]}", code=int(msg[2]), grace=True)

    def _abort(self, message: str, code: int = 1, grace: bool = False) -> None:
        """Rank 0: one line, then every rank ends (after `GRACE` seconds when rank 0 may be
        failing the same way on its own: then its own message is the one)."""
        if grace:
            end = time.monotonic() + GRACE
            while time.monotonic() < end:
                if self.ending:
                    return
                time.sleep(0.02)
        if self.ending:
            return
        _say(f"error: {message}")
        self.send(("abort", code))
        os._exit(code)

    def close(self, code: int, why: str = "") -> None:
        """This rank ends: the others hear `bye`, or (a failure) why."""
        self.ending = True
        if self.rank == 0:
            self.send(("bye",) if code == 0 else ("abort", code))
        elif code == 0:
            self.tell_leader(("bye",))
        else:
            self.tell_leader(("fail", why or f"exit code {code}", code))


def _leader_host() -> str:
    override = os.environ.get("DFLASH_MLX_CONTROL_HOST")
    if override:
        return override
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            hosts = json.loads(open(path).read())
            first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
            return str(first).rsplit(":", 1)[0]
        except (OSError, ValueError, IndexError, KeyError, TypeError):
            pass
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    return "127.0.0.1"


def _bind_host(host: str) -> str:
    """Rank 0 listens on its address in the hostfile (the link the ranks share), else on
    every interface (a host name: the token keeps strangers out)."""
    try:
        socket.inet_aton(host)
        return host
    except OSError:
        return "localhost" if host == "localhost" else "0.0.0.0"


# -- the cluster --------------------------------------------------------------------------


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
    import mlx.core as mx

    group = mx.distributed.init(strict=True)
    if group.size() == 1:
        return None
    channel = Channel(group.rank(), group.size(), group)
    _CLUSTER = Cluster(group, group.rank(), group.size(), shard, channel)
    return _CLUSTER


def finish(code: int, why: str = "") -> None:
    """This rank ends with `code` (the others are told; `why`: a failure's message)."""
    global _CLUSTER
    c = _CLUSTER
    if c is None:
        return
    if code == 0:
        # Every rank at its end: a pass still in flight (one launched ahead) has every rank's
        # part done before any rank closes its connections.
        import mlx.core as mx

        mx.eval(mx.distributed.all_sum(mx.array(1), group=c.group, stream=mx.cpu))
    c.channel.close(code, why or _last_line())
    if c.rank == 0:
        # The others' `bye`, so that none is taken for a rank that vanished.
        end = time.monotonic() + 5.0
        while len(c.channel.said_bye) < c.size - 1 and time.monotonic() < end:
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
            if code and not isinstance(error, SystemExit) and str(error):
                why = str(error)
                if code != 2:
                    why = f"{type(error).__name__}: {why}"
        finish(code, why)


def _exit_code(error: BaseException | None) -> int:
    import click

    if error is None:
        return 0
    if isinstance(error, click.exceptions.Exit):
        return int(error.exit_code or 0)
    if isinstance(error, SystemExit):
        return int(error.code) if isinstance(error.code, int) else 1
    if isinstance(error, KeyboardInterrupt):
        return 130
    from .errors import UserError

    return 2 if isinstance(error, UserError) else 1


# -- agreement ----------------------------------------------------------------------------


def agree(what: str, value: Any) -> Any:
    """Rank 0's `value` on every rank (`what` names the decision point: ranks that reach
    different points have fallen out of step, which is refused). Alone: `value`."""
    c = _CLUSTER
    if c is None:
        return value
    if c.rank == 0:
        c.channel.send(("agree", what, value))
        return value
    msg = c.channel.recv()
    if msg is _CLOSED or msg[0] != "agree" or msg[1] != what:
        got = "the end" if msg is _CLOSED else f"{msg[0]} {msg[1] if len(msg) > 1 else ''}"
        raise RanksFailed(
            f"rank {c.rank} fell out of step with rank 0: expected {what!r}, got {got}"
        )
    return msg[2]


# -- pipeline shards: the layers a rank holds, the features it shares ----------------------


def pipeline_span(backbone: Any, args: Any, layers: list) -> tuple[int | None, list, int]:
    """`(first layer, this rank's layers, the model's layer count)` of a target whose
    backbone mlx-lm split into a pipeline (`model.model.pipeline`: each rank holds a run of
    the layers, rank 0 the last ones); `(None, layers, len(layers))` otherwise."""
    if getattr(backbone, "pipeline_size", 1) <= 1:
        return None, layers, len(layers)
    own = list(backbone.pipeline_layers)
    total = getattr(args, "num_hidden_layers", None)
    if not isinstance(total, int):
        import mlx.core as mx

        total = int(mx.distributed.all_sum(mx.array(len(own)), stream=mx.cpu).item())
    return int(backbone.start_idx), own, total


def pipeline_features(outputs: dict, capture_ids: list[int], target: Any, logits: Any):
    """`(logits, features)` of a pass on a pipeline rank: the captured layers' outputs
    `(B, n, len(capture_ids) * D)`, each layer's rows from the rank that holds it and zeros
    from the others, summed over the ranks in one collective (SPEC 10, item 5). The sum
    follows the pass's own collectives (its input depends on the logits) and the logits
    returned depend on it: every rank makes them in one order whenever the logits are
    evaluated, never one rank the sum of an earlier pass while another waits on this one's."""
    import mlx.core as mx

    b, n = logits.shape[:2]
    zeros = None
    parts = []
    for g in capture_ids:
        out = outputs.get(g - target.first_layer)
        if out is None:
            if zeros is None:
                zeros = mx.zeros((b, n, target.hidden_size), dtype=logits.dtype)
            out = zeros
        parts.append(out.astype(logits.dtype))
    local = mx.depends([mx.concatenate(parts, axis=-1)], [logits])[0]
    feats = mx.distributed.all_sum(local)
    return mx.depends([logits], [feats])[0], feats


# -- calibration --------------------------------------------------------------------------


def lockstep_calibration(pair: Any) -> None:
    """Give `pair` a calibration whose curves are rank 0's (measured in lockstep when
    missing: a measurement runs sharded passes, which every rank must run)."""
    if _CLUSTER is None or pair.calibration is None:
        return
    from .speed.calibrate import Calibration

    class LockstepCalibration(Calibration):
        """Rank 0's curves, read from its file (keyed also by the sharding) or measured
        with every rank taking part; the other ranks keep rank 0's. Read once per process,
        so that no rank looks at a file the others do not; `freeze` (a server) turns
        later re-measurements into a no-op."""

        frozen = False

        def _key(self) -> dict:
            from .speed.calibrate import calibration_key

            c = _CLUSTER
            return {**calibration_key(self.pair), "shard": [c.shard, c.size] if c else None}

        def cached(self):
            if self.latest is not None:
                return self.latest
            from .speed.calibrate import _cache_path, _read

            curves = None
            if speaks():
                key = self._key()
                curves = _read(_cache_path(key), key)
            curves = agree("calibration", curves)
            self.latest = curves
            return curves

        def curves(self, *, refresh: bool = False, progress=None):
            curves = None if refresh and not self.frozen else self.cached()
            if curves is None:
                from .speed.calibrate import _cache_path, _write, measure

                curves = measure(self.pair, progress=progress)
                if speaks():
                    key = self._key()
                    try:
                        _write(_cache_path(key), key, curves)
                    except OSError:
                        pass  # not cached for the next run; this one goes on
                curves = agree("calibration", curves)
                self.latest = curves
            return curves

        def forget(self) -> None:
            pass  # the curves stay rank 0's for this process

        @property
        def path(self):
            from .speed.calibrate import _cache_path

            return _cache_path(self._key())

    pair.calibration = LockstepCalibration(pair)


def freeze_calibration(pair: Any) -> None:
    """A server's ranks measure only at start: afterwards no re-measurement (rank 0's worker
    would measure alone, between requests, where the others cannot join)."""
    if pair.calibration is not None and hasattr(type(pair.calibration), "frozen"):
        pair.calibration.frozen = True


# -- serving: rank 0's admissions and cancels, replayed by the others -------------------------


def lead() -> None:
    """Rank 0 of a server: from now on its decoders' admissions and cancels are broadcast
    at each step (`submitted`, `cancel_later`, `step`), for `follow` on the others."""
    if _CLUSTER is not None and _CLUSTER.rank == 0:
        _CLUSTER.leading = True


def submitted(row: Any, ids: list[int], options: Any) -> None:
    """Hook in `BatchDecoder.submit`: rank 0 of a server records the admission (the row
    reuses no prompt cache and has no progress callback: its prefill must be the others')."""
    c = _CLUSTER
    if c is None or not c.leading:
        return
    row.prompt_cache = None
    row.progress = None
    n = c.admitted
    c.admitted += 1
    c.ordinals[id(row)] = n
    c.events.append(("submit", n, list(ids), options))


def cancel_later(row: Any) -> bool:
    """Hook in `BatchDecoder.cancel`: rank 0 of a server defers a cancel to the start of
    the next step, where every rank applies it (True: deferred)."""
    c = _CLUSTER
    if c is None or not c.leading:
        return False
    n = c.ordinals.get(id(row))
    if n is None:
        return False
    c.cancels.append(row)
    c.events.append(("cancel", n))
    return True


def step() -> None:
    """Hook at the start of `BatchDecoder.step`: rank 0 of a server applies the cancels
    deferred since the last step and sends this step's events to the others."""
    c = _CLUSTER
    if c is None or not c.leading:
        return
    for row in c.cancels:
        row.cancelled = True
    c.cancels = []
    events, c.events = c.events, []
    c.channel.send(("step", events))


def follow(pair: Any, tokenizer: Any, max_batch: int) -> None:
    """The other ranks of a server: a decoder that runs rank 0's steps with rank 0's
    admissions and cancels, until rank 0 ends."""
    from .engine.batch import BatchDecoder

    c = _CLUSTER
    if c is None:
        raise RuntimeError("follow() outside a cluster")
    decoder = BatchDecoder(pair, tokenizer, max_batch=max_batch)
    rows: dict[int, Any] = {}
    while True:
        msg = c.channel.recv()
        if msg is _CLOSED:
            return
        if msg[0] != "step":
            raise RanksFailed(f"rank {c.rank} fell out of step with rank 0: got {msg[0]}")
        for ev in msg[1]:
            if ev[0] == "submit":
                rows[ev[1]] = decoder.submit(ev[2], ev[3])
            elif ev[0] == "cancel" and ev[1] in rows:
                rows[ev[1]].cancelled = True
        try:
            decoder.step()
        except Exception:  # noqa: BLE001 - rank 0's step failed as well: a fresh decoder
            decoder = BatchDecoder(pair, tokenizer, max_batch=max_batch)
        for n in [n for n, r in rows.items() if r.done]:
            del rows[n]
