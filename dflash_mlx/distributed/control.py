"""The control connection: rank 0 connected to every other rank over TCP, beside MLX's own
collectives. Rank 0's messages (agreements, a server's steps) go out in order; each rank's
end (`bye`, `fail`, its connection closing) and its heartbeat are watched by threads, so a
rank that fails, vanishes or stops answering ends every rank with one message.

Liveness: every rank sends a heartbeat every `beat` seconds from a thread of its own (it
beats while its main thread waits in a collective); a rank heard from by nobody for
`RANK_TIMEOUT` seconds (stopped, hung with the interpreter held, or its link down) is taken
for gone. The other failures are said by the ranks themselves (`fail`), or found by the
stall watchdog (`cluster.py`).
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
from collections.abc import Callable
from typing import Any

from ..errors import BadArgument


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise BadArgument(f"{name}={raw!r}: expected a number of seconds > 0")
    return value


def connect_timeout() -> float:
    """How long a rank waits for the others at start-up (loading a large shard is slow)."""
    return _seconds("DFLASH_MLX_CONNECT_TIMEOUT", 600.0)


def rank_timeout() -> float:
    """Seconds without a word from a rank (or from rank 0) before it is taken for gone, and
    (`stall_timeout`) the basis of how long a decode step may make no progress."""
    return _seconds("DFLASH_MLX_RANK_TIMEOUT", 30.0)


def stall_timeout() -> float:
    """Seconds a decode step may go without progress (a chunk, a cycle) on a rank before
    the ranks are taken to be out of step (a collective that never completes)."""
    return _seconds("DFLASH_MLX_STALL_TIMEOUT", 120.0)


CONNECT_TIMEOUT = 600.0  # the default of `connect_timeout()` (kept for old imports)
# How long rank 0 lets its own error reach the user before a rank's failure ends it.
GRACE = 2.0
# How long rank 0 lets the answers to in-flight requests go out before it ends.
ANSWER_GRACE = 1.0
# How long a rank's end waits for its own pending work (`Channel.before_exit`: a prompt
# store's block writes), and rank 0 for the others' word that they have done theirs.
EXIT_WORK = 10.0


# -- silence ---------------------------------------------------------------------------------

_QUIET: dict[str, Any] = {}


def quiet(rank: int) -> None:
    """Ranks other than 0 write nothing: stdout goes nowhere, stderr into a file whose last
    line a failing rank sends to rank 0."""
    if _QUIET or rank == 0:
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
    import atexit

    atexit.register(_linger, rank)


def _linger(rank: int) -> None:
    """A silent rank that fails before joining the others (a bad argument every rank sees
    alike): rank 0 says it, so this one waits first (the launcher ends every rank once one
    exits with an error code: ending first would have it end rank 0 before it could), then
    says its line itself when rank 0 did not end it (rank 0 saw no error: only this rank's)."""
    if _QUIET.get("joined"):
        return  # the ranks' channel said how it ended
    message = last_error()
    if message:
        time.sleep(GRACE + ANSWER_GRACE + 3)
        say(f"{message} (rank {rank})")


def _logged() -> list[str] | None:
    """The stripped lines a silent rank wrote to its stderr (None when it speaks)."""
    log = _QUIET.get("log")
    if log is None:
        return None
    try:
        sys.stderr.flush()
        log.seek(0)
        return [ln.strip() for ln in log.read().decode(errors="replace").splitlines()]
    except OSError:
        return None


def last_line() -> str:
    """The last line a silent rank wrote to its stderr ("" when none, or when it speaks)."""
    lines = [ln for ln in _logged() or () if ln]
    return lines[-1] if lines else ""


def last_error() -> str:
    """The last `error:` message a silent rank wrote, its wrapped lines joined ("" when none)."""
    lines = _logged() or []
    starts = [i for i, ln in enumerate(lines) if ln.startswith("error:")]
    if not starts:
        return ""
    return " ".join(ln for ln in lines[starts[-1] :] if ln)


def say(message: str, fresh_line: bool = False) -> None:
    """One line on this rank's real stderr (a rank other than 0 only when rank 0 cannot);
    `fresh_line`: on a line of its own even when another writer left one unfinished (the ring
    backend writes its `[ring] Socket N was closed by the peer` in pieces once a peer is lost)."""
    fd = _QUIET.get("stderr", 2)
    try:
        os.write(fd, (("\n" if fresh_line else "") + message.rstrip() + "\n").encode())
    except OSError:
        pass


# -- frames ---------------------------------------------------------------------------------


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


CLOSED = ("closed",)


class Channel:
    """Rank 0 connected to every other rank: messages from rank 0 in order, each rank's end
    (`bye`, `fail`, or its connection closing) and heartbeat watched by threads."""

    def __init__(self, rank: int, size: int, group: Any):
        self.rank, self.size = rank, size
        self.peers: dict[int, socket.socket] = {}  # rank 0: the others
        self.leader: socket.socket | None = None  # the others: rank 0
        self.inbox: queue.Queue = queue.Queue()
        self.replies: dict[int, queue.Queue] = {}  # rank 0: what each other rank reported
        self.ending = False  # this rank is ending on its own (its own message goes out)
        self.failing = False  # the others: this rank ended with an error (told rank 0)
        self.said_bye: set[int] = set()
        self.gone: set[int] = set()  # rank 0: the others whose connection has closed
        self.failures: list[str] = []  # rank 0: the other ranks' failures, as said
        self.aborted: int | None = None  # the others: rank 0 ends every rank with this code
        self.timeout = rank_timeout()
        self.heard: dict[int, float] = {}  # rank -> when a frame last came from it
        # Rank 0: called with the message before every rank ends (a server answers the
        # requests in flight); `stalled` says whether this rank's main thread is stuck.
        self.on_abort: list[Callable[[str], None]] = []
        self.stalled: Callable[[], str | None] = lambda: None
        # The others: work to finish before this rank ends on rank 0's word (each bounded).
        self.before_exit: list[Callable[[], Any]] = []
        self._exit_ready = threading.Event()
        self._lock = threading.Lock()
        _QUIET["joined"] = True
        self._connect(group)
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _connect(self, group: Any) -> None:
        import mlx.core as mx

        host = _leader_host()
        wait = connect_timeout()
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
        now = time.monotonic()
        if server is not None:
            server.settimeout(wait)
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
                self.heard[r] = now
                self.replies[r] = queue.Queue()
                threading.Thread(target=self._watch_peer, args=(r, conn), daemon=True).start()
        else:
            deadline = time.monotonic() + wait
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
            self.heard[0] = time.monotonic()
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
            with self._lock:
                try:
                    _send_frame(self.leader, list(obj), plain=True)
                except OSError:
                    pass

    def reply(self, rank: int, timeout: float) -> Any:
        """Rank 0: the next report of `rank` (None: none within `timeout` seconds)."""
        try:
            return self.replies[rank].get(timeout=timeout)
        except queue.Empty:
            return None

    def _heartbeat(self) -> None:
        """Beat every few seconds; a rank heard from by nobody for `timeout` is gone, and a
        rank whose own step stalls says so."""
        beat = min(1.0, self.timeout / 5)
        while not self.ending:
            time.sleep(beat)
            if self.ending:
                return
            if self.rank == 0:
                self.send(("beat",))
            else:
                self.tell_leader(("beat",))
            now = time.monotonic()
            for r, when in list(self.heard.items()):
                if r in self.said_bye or now - when <= self.timeout:
                    continue
                gone = (
                    f"rank {r} stopped answering: no word from it for {self.timeout:g} s "
                    "(stopped, hung, or its link is down; DFLASH_MLX_RANK_TIMEOUT)"
                )
                if self.rank == 0:
                    self._abort(f"{gone}: every rank stops")
                else:
                    say(f"error: {gone}: rank {self.rank} stops too")
                    os._exit(1)
                return
            stalled = self.stalled()
            if stalled is not None:
                if self.rank == 0:
                    self._abort(stalled)
                else:
                    self.tell_leader(("fail", stalled, 1))
                    time.sleep(GRACE + ANSWER_GRACE + 2 * beat)
                    say(f"error: {stalled}")  # rank 0 did not end it: it cannot
                    os._exit(1)
                return

    def _watch_leader(self) -> None:
        while True:
            msg = _recv_frame(self.leader)
            if msg is None:
                if self.aborted is not None:  # rank 0 said why, and has ended
                    self._exit_ready.wait(EXIT_WORK + 1.0)
                    os._exit(self.aborted)
                # A failing rank whose failure rank 0 never answered (no abort): rank 0 went
                # first, and this rank's failure (a collective that lost it) follows from it.
                if (self.ending and not self.failing) or 0 in self.said_bye:
                    self.inbox.put(CLOSED)
                    return
                say(
                    f"error: rank 0 ended without a word (killed, or its machine is gone): "
                    f"rank {self.rank} stops too"
                )
                os._exit(1)
            self.heard[0] = time.monotonic()
            if msg[0] == "beat":
                continue
            if msg[0] == "bye":
                self.said_bye.add(0)
                self.inbox.put(CLOSED)
            elif msg[0] == "abort":
                # Rank 0 says why as it ends: this rank ends once rank 0 has (its connection
                # closes), so that the launcher does not end rank 0 before it could say it.
                self.aborted = int(msg[1])
                self.ending = True
                threading.Thread(target=self._end_on_abort, daemon=True).start()
            else:
                self.inbox.put(msg)

    def _end_on_abort(self) -> None:
        """The others, told by rank 0 that every rank ends: this rank's pending work
        (`before_exit`), then its `bye` (rank 0 waits for it: the launcher ends every rank
        once rank 0 has exited), then its end once rank 0's connection closes, or 10 s on."""
        start = time.monotonic()
        for work in list(self.before_exit):
            try:
                work()
            except Exception:  # noqa: BLE001 - ending anyway
                pass
        self.tell_leader(("bye",))
        self._exit_ready.set()
        time.sleep(max(0.0, 10.0 - (time.monotonic() - start)))
        os._exit(self.aborted if self.aborted is not None else 1)

    def _watch_peer(self, rank: int, conn: socket.socket) -> None:
        while True:
            msg = _recv_frame(conn, plain=True, limit=1 << 20)
            if msg is None:
                self.gone.add(rank)
                if rank in self.said_bye:
                    return
                # Kept as a failure too: when rank 0's own collective fails first (its
                # peer gone), `failed_first` says this, the cause, rather than that.
                gone = (
                    f"rank {rank} ended without a word (killed, or its machine is gone): "
                    "every rank stops"
                )
                self.failures.append(gone)
                self._abort(gone, grace=False)
                return
            self.heard[rank] = time.monotonic()
            if not isinstance(msg, list) or not msg:
                continue
            if msg[0] == "bye":
                self.said_bye.add(rank)
            elif msg[0] == "fail":
                self.said_bye.add(rank)
                self.failures.append(f"rank {rank} failed: {msg[1]}")
                # A bad argument fails on rank 0 the same way, Ctrl-C reaches it too: then
                # its own message (or none) goes out.
                code = int(msg[2])
                self._abort(self.failures[-1], code=code, grace=code in (2, 130))
            elif msg[0] == "report":
                self.replies[rank].put(msg[1:])

    def _abort(self, message: str, code: int = 1, grace: bool = False) -> None:
        """Rank 0: one line, then every rank ends (after `GRACE` seconds when rank 0 may be
        failing the same way on its own: then its own message is the one). The `on_abort`
        callbacks run first (a server answers its requests in flight)."""
        if grace:
            end = time.monotonic() + GRACE
            while time.monotonic() < end:
                if self.ending:
                    return
                time.sleep(0.02)
        with self._lock:
            if self.ending:
                return
            self.ending = True
        say(f"error: {message}", fresh_line=bool(self.gone))
        if self.on_abort:
            for hook in self.on_abort:
                try:
                    hook(message)
                except Exception:  # noqa: BLE001 - ending anyway
                    pass
            time.sleep(ANSWER_GRACE)
        self.send(("abort", code))
        os._exit(code)

    def failed_first(self, code: int, wait: float = 0.3) -> None:
        """Rank 0 failing (`code`, not a bad argument): when another rank's failure came
        first (rank 0's error then follows from it: a collective lost its peer), that
        one's message ends every rank (never returns); else nothing."""
        if code in (0, 2, 130) or self.rank != 0:
            return
        end = time.monotonic() + wait
        while not self.failures and time.monotonic() < end:
            time.sleep(0.02)
        if self.failures:
            self.ending = False
            self._abort(self.failures[0], code)

    def close(self, code: int, why: str = "") -> None:
        """This rank ends: the others hear `bye`, or (a failure) why."""
        self.ending = True
        self.failing = code not in (0, 130)
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
