"""The disk tier: one file per block, written atomically, read whole and verified.

A block file is `MAGIC`, the SHA-256 of the rest, then the block as mlx-lm's
`save_prompt_cache` writes it (safetensors: one cache per layer, and the block's key in
its metadata). It is written to a temporary file beside its final name and renamed into
place, so a reader (this process or another server on the same folder) sees either no
file or a whole one; a file whose checksum, format or key does not match (truncated,
overwritten, copied from elsewhere) is removed with a log line and counts as missing.
Recency is the file's modification time, set on every write and use; when a write would
pass the byte budget, the least recently used files go first, whichever process wrote
them. Servers sharing a folder share its budget: a write makes room, writes and renames
holding the folder's lock (`flock` on `.lock`), whose stamp says when another process
wrote since this one last looked (then the folder is scanned again); temporary files
count against the budget. A temporary file whose writer is gone (killed mid-write: its
pid, in the name, runs no process here) is removed at start and at every scan; one from
a process that cannot be seen (another host or container on the same folder) is removed
once it is `STALE_TEMP` old. Writes run on one background thread per store.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

log = logging.getLogger("dflash_mlx.cache.prompt_store")

MAGIC = b"DFLASHPB"
SUFFIX = ".block"
HEADER = len(MAGIC) + 32
STALE_TEMP = 3600.0  # seconds: a temporary file this old was left by a writer that died
RESCAN_EVERY = 64  # writes between two scans of the folder (other processes write too)
EXIT_WAIT = 60.0  # seconds a process's exit waits for its pending block writes


class BadBlock(Exception):
    """A block file that is not a whole, valid block of the key asked for."""


class _Named(io.BytesIO):
    name = "block.safetensors"  # mx.load reads the format from the name


def encode(layers: list[Any], metadata: dict[str, str]) -> bytes:
    """A block file's bytes: MAGIC, checksum, then `layers` as `save_prompt_cache` writes them."""
    buf = io.BytesIO()
    save_prompt_cache(buf, layers, metadata)
    payload = buf.getvalue()
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode(data: bytes, key: str) -> tuple[list[Any], dict[str, str]]:
    """The layers and metadata of a block file's bytes; `BadBlock` saying why not."""
    if len(data) < HEADER or not data.startswith(MAGIC):
        raise BadBlock("not a prompt-cache block")
    if hashlib.sha256(memoryview(data)[HEADER:]).digest() != data[len(MAGIC) : HEADER]:
        raise BadBlock("checksum mismatch (truncated or corrupted)")
    try:
        layers, meta = load_prompt_cache(_Named(data[HEADER:]), return_metadata=True)
    except Exception as e:  # noqa: BLE001 - whatever the parser says, the file is unusable
        raise BadBlock(f"unreadable ({type(e).__name__}: {e})") from None
    if meta.get("key") != key:
        raise BadBlock(f"holds block {str(meta.get('key'))[:16]}, not this one")
    return layers, meta


class DiskTier:
    """Block files under `folder`, at most `budget` bytes of them."""

    def __init__(self, folder: str | Path, budget: int):
        if budget < 0:
            raise ValueError(f"prompt cache disk budget {budget} bytes must be >= 0")
        self.folder = Path(folder).expanduser()
        self.budget = int(budget)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._usage: int | None = None  # bytes on disk, as of the last scan and own writes
        self._since_scan = 0
        self.counts = {"bytes_written": 0, "written": 0, "removed_bad": 0, "evicted": 0}
        self._queue: queue.Queue = queue.Queue()
        self._starting = threading.Lock()  # the writer thread's start
        self._thread: threading.Thread | None = None
        self._stamp = b""  # the folder lock's stamp as of this process's last look
        self._temp_bytes = 0  # other writers' temporary files, as of the last scan
        self.counts["removed_temp"] = 0
        self.scan()  # a killed writer's leftovers go now, not in an hour

    # -- paths and reads --------------------------------------------------------------------

    def path(self, key: str) -> Path:
        return self.folder / key[:2] / (key + SUFFIX)

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def read(self, key: str) -> tuple[list[Any], dict[str, str]] | None:
        """The block stored under `key` (None: none, or a bad file, which is removed)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("prompt cache: cannot read %s (%s): skipped", path, e)
            return None
        try:
            block = decode(data, key)
        except BadBlock as e:
            self.remove_bad(path, str(e))
            return None
        self.touch(key)
        return block

    def remove_bad(self, path: Path, why: str) -> None:
        log.warning("prompt cache: removed %s: %s", path, why)
        with self._lock:
            self.counts["removed_bad"] += 1
        self._unlink(path)

    def touch(self, key: str) -> None:
        """Mark a block as just used (the disk tier's recency)."""
        self.touch_chain([key])

    def touch_chain(self, keys: list[str]) -> None:
        """Mark a chain of blocks as just used, the first most recently: a block is useless
        without the blocks before it, so the last ones go first."""
        now = time.time_ns()
        for i, key in enumerate(keys):
            try:
                os.utime(self.path(key), ns=(now, now - 1000 * i))
            except OSError:
                pass

    # -- writes -----------------------------------------------------------------------------

    def write(self, key: str, data: bytes) -> bool:
        """Put `data` under `key`: a temporary file renamed into place, after making room
        within the budget. False when the block alone is over the budget."""
        size = len(data)
        if size > self.budget:
            return False
        path = self.path(key)
        tmp = path.parent / f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        with self._folder_lock() as others_wrote:
            self._make_room(size, others_wrote)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    write_all(f, data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                self._unlink(tmp)
                raise
        with self._lock:
            self.counts["bytes_written"] += size
            self.counts["written"] += 1
            if self._usage is not None:
                self._usage += size
            self._since_scan += 1
        return True

    @contextlib.contextmanager
    def _folder_lock(self):
        """Hold the folder's lock (shared by every process writing there); yields whether
        another process wrote since this one last held it. The stamp is renewed after."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover (no flock: each process keeps its own count)
            yield False
            return
        fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            stamp = os.pread(fd, 64, 0)
            yield stamp != self._stamp
            self._stamp = f"{os.getpid()}.{uuid.uuid4().hex}".encode()
            os.pwrite(fd, self._stamp, 0)
            os.ftruncate(fd, len(self._stamp))
        finally:
            os.close(fd)  # and with it the lock

    def _make_room(self, size: int, others_wrote: bool = True) -> None:
        with self._lock:
            known = self._usage
            fresh = self._since_scan < RESCAN_EVERY and not others_wrote
        if known is not None and fresh and known + size <= self.budget:
            return
        files = self.scan()
        usage = sum(s for _, s, _ in files) + self._temp_bytes
        for path, s, _ in sorted(files, key=lambda f: f[2]):
            if usage + size <= self.budget:
                break
            if self._unlink(path):
                with self._lock:
                    self.counts["evicted"] += 1
            usage -= s
        with self._lock:
            self._usage = usage
            self._since_scan = 0

    def scan(self) -> list[tuple[Path, int, float]]:
        """Every block file: (path, bytes, last use). Removes temporary files a dead
        writer left behind."""
        files, temps = scan_folder(self.folder)
        now = time.time()
        live = 0
        for path, size, mtime in temps:
            if (now - mtime > STALE_TEMP or writer_gone(path)) and self._unlink(path):
                log.warning("prompt cache: removed %s, left by a writer that died", path)
                with self._lock:
                    self.counts["removed_temp"] += 1
            else:
                live += size
        self._temp_bytes = live
        return files

    def usage(self) -> int:
        return sum(s for _, s, _ in self.scan())

    def clear(self) -> int:
        """Remove every block file; the number removed."""
        n = 0
        for path, _, _ in self.scan():
            n += self._unlink(path)
        with self._lock:
            self._usage = 0
        return n

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False

    # -- the background writer --------------------------------------------------------------

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on the writer thread (started on first use). A job is counted as
        pending in the same step that queues it (`Queue.put`), so a signal landing in
        between loses the job rather than leaving a count no write will ever clear."""
        with self._starting:
            if self._thread is None or not self._thread.is_alive():
                if self._thread is None:
                    # A process that ends with writes pending finishes them first: a
                    # daemon thread killed inside MLX at exit aborts the process.
                    atexit.register(self.flush, EXIT_WAIT)
                self._thread = threading.Thread(
                    target=self._work, name="dflash-mlx-prompt-store", daemon=True
                )
                self._thread.start()
        self._queue.put(job)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted write is done; False on timeout."""
        done = self._queue.all_tasks_done
        with done:
            return done.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                job()
            except Exception as e:  # noqa: BLE001 - a failed write loses a block, nothing else
                log.warning("prompt cache: a block write failed (%s: %s)", type(e).__name__, e)
            finally:
                self._queue.task_done()


def writer_gone(temp: Path) -> bool:
    """Whether the process that wrote temporary file `temp` (`.KEY.PID.RANDOM.tmp`) is
    gone: no process here has its pid (one of another user's still counts as alive)."""
    try:
        pid = int(temp.name.split(".")[-3])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def scan_folder(folder: Path) -> tuple[list[tuple[Path, int, float]], list]:
    """Block files and temporary files under `folder`: (path, bytes, modification time)
    each (nothing when there is no such folder)."""
    files, temps = [], []
    try:
        subdirs = [d for d in os.scandir(folder) if d.is_dir()]
    except OSError:
        return files, temps
    for d in subdirs:
        try:
            entries = list(os.scandir(d.path))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat()
            except OSError:  # removed meanwhile (another process evicted it)
                continue
            if e.name.endswith(SUFFIX):
                files.append((Path(e.path), st.st_size, st.st_mtime))
            elif e.name.endswith(".tmp"):
                temps.append((Path(e.path), st.st_size, st.st_mtime))
    return files, temps


def summary(folder: str | Path) -> dict[str, Any]:
    """What a prompt-cache folder holds: block files, their bytes, first and last use."""
    files, temps = scan_folder(Path(folder))
    times = [t for _, _, t in files]
    return {
        "folder": str(folder),
        "exists": Path(folder).is_dir(),
        "blocks": len(files),
        "bytes": sum(s for _, s, _ in files),
        "oldest_use": min(times, default=None),
        "latest_use": max(times, default=None),
        "writing": len(temps),
    }


def clear_folder(folder: str | Path) -> tuple[int, int]:
    """Remove every block file (and leftover temporary file) under `folder`: (files, bytes)."""
    files, temps = scan_folder(Path(folder))
    n = size = 0
    for path, s, _ in files + [t for t in temps if time.time() - t[2] > STALE_TEMP]:
        if DiskTier._unlink(path):
            n += path.suffix == SUFFIX
            size += s
    return n, size


def write_all(f: Any, data: bytes, chunk: int = 1 << 22) -> None:
    """Write `data` to the open file `f` in chunks."""
    view = memoryview(data)
    for i in range(0, len(view), chunk):
        f.write(view[i : i + chunk])
