"""PromptStore: the target's cache for prompt prefixes, in fixed blocks, shared by every
conversation and kept on disk across restarts.

A request's prompt is cut in blocks of `block_tokens` tokens, each keyed by a hash chain of
the tokens up to its end and what makes it valid (`keys.py`). When a request starts, it
takes the longest run of stored blocks its prompt begins with (from memory, else from
disk, one block file at a time), unless the conversation's own `PromptCache` already holds
more; when it ends, the blocks of its prompt not stored yet are kept in memory and, when
worth it, written to disk in the background (`disk.py`). Hybrid (recurrent) targets also
keep each recurrent layer's state at block boundaries where the prefill passed one (its
chunks end on block boundaries when `prefill_step` is a multiple of `block_tokens`), and
resume at the last block that has one. Blocks hold committed prompt positions only, so
the tokens a request generates are those of a request with no store (SPEC 1).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from ... import distributed
from ...errors import BadArgument
from . import checks
from . import keys as keys_mod
from .disk import DiskTier, encode

if TYPE_CHECKING:
    from ...models.target import TargetAdapter
    from ...pair import Pair

log = logging.getLogger("dflash_mlx.cache.prompt_store")

GB = 1_000_000_000
BLOCK_TOKENS = 256
MEMORY_BYTES = 2 * GB
DISK_BYTES = 10 * GB
# A prompt at least this long is written to disk the first time it is seen; a shorter
# one's blocks only once another request has used them again (SSD wear: one-off chats
# are not written). See docs/server.md for the measurement behind the figure.
WRITE_AFTER_TOKENS = 1024
SEEN_KEYS = 1 << 16  # block keys remembered as seen (for "seen twice"), oldest forgotten


@dataclass
class Block:
    """One block: an mlx-lm cache per layer (a `KVCache` holding the block's positions for
    attention layers; an `ArraysCache` holding the state at the block's end, or nothing,
    for recurrent ones)."""

    key: str
    layers: list[Any]
    snapshot: bool = False  # the recurrent layers' state at its end is kept
    # What its file says it is (model, previous key, first position, tokens), checked when
    # it is read back; empty for a block read from disk.
    claims: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        total = 0
        for c in self.layers:
            arrays = (c.keys, c.values) if isinstance(c, KVCache) else c.cache
            total += sum(a.nbytes for a in arrays if a is not None)
        return total


@dataclass
class Link:
    """One request's dealings with the store: where it resumed, what came from memory and
    from disk, and the recurrent states its prefill passed at block boundaries."""

    store: PromptStore
    target: TargetAdapter | None = None
    prompt: list[int] = field(default_factory=list)
    cache: list[Any] | None = None
    start: int = 0
    memory_tokens: int = 0
    disk_tokens: int = 0
    snapshots: dict[int, dict] = field(default_factory=dict)

    def restore(self, pair: Pair, prompt: list[int], cache: list[Any], bound: int) -> int:
        """Fill the fresh `cache` from the longest run of stored blocks `prompt` starts with,
        when it covers more than `bound` positions; the positions it holds (0: untouched)."""
        return self.store._restore(self, pair.target, prompt, cache, bound)

    def started(self, target: TargetAdapter, prompt: list[int], cache: list, start: int) -> None:
        self.target, self.prompt, self.cache, self.start = target, list(prompt), cache, start

    def progress(self, done: int) -> None:
        """After a prefill chunk: a recurrent target's state at a block boundary is kept."""
        target, block = self.target, self.store.block
        if target is not None and target.recurrent and done % block == 0 and done > self.start:
            self.snapshots[done] = target.snapshot(self.cache)


class PromptStore:
    """Prompt prefixes' target caches in blocks: memory (LRU within `memory_bytes`) and,
    with a `folder`, disk (LRU within `disk_bytes`, shared with other processes).

    Give it to `PromptCache(store=...)`: a request through that cache resumes from the
    longest stored prefix of its prompt and keeps its prompt's blocks afterwards.
    """

    def __init__(
        self,
        folder: str | Path | None = None,
        *,
        memory_bytes: int = MEMORY_BYTES,
        disk_bytes: int = DISK_BYTES,
        block_tokens: int = BLOCK_TOKENS,
        write_after_tokens: int = WRITE_AFTER_TOKENS,
    ):
        for name, value, least in [
            ("memory_bytes", memory_bytes, 0),
            ("disk_bytes", disk_bytes, 0),
            ("block_tokens", block_tokens, 1),
            ("write_after_tokens", write_after_tokens, 0),
        ]:
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise BadArgument(f"PromptStore {name}={value!r} must be an integer >= {least}")
        self.block = block_tokens
        self.memory_budget = memory_bytes
        self.write_after = write_after_tokens
        try:
            self.disk = DiskTier(folder, disk_bytes) if folder is not None else None
        except OSError as e:
            raise BadArgument(f"cannot use {folder} for the prompt cache: {e}") from None
        self._lock = threading.RLock()
        self._memory: OrderedDict[str, Block] = OrderedDict()
        self._memory_bytes = 0
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._roots: dict[tuple, bytes] = {}
        self._disk_snapshots: set[str] = set()  # keys this process wrote with a state
        self._layouts: dict[tuple, list[Any]] = {}
        self.counts = {
            "memory_tokens": 0,
            "disk_tokens": 0,
            "kept_blocks": 0,
            "rejected_blocks": 0,  # block files whose contents were not what they claimed
        }

    @property
    def folder(self) -> Path | None:
        return self.disk.folder if self.disk is not None else None

    def link(self) -> Link:
        return Link(self)

    # -- keys -------------------------------------------------------------------------------

    def root(self, target: TargetAdapter, cache: list[Any]) -> bytes:
        kinds = tuple(type(c).__name__ for c in cache)
        ident = (id(target.model), kinds)
        root = self._roots.get(ident)
        if root is None:
            root = keys_mod.root_key(keys_mod.validity(target.model, cache, self.block))
            self._roots[ident] = root
        return root

    def keys(self, target: TargetAdapter, cache: list[Any], tokens: list[int], blocks: int):
        return keys_mod.chain(self.root(target, cache), tokens, self.block, blocks)

    # -- the memory tier --------------------------------------------------------------------

    def _get(self, key: str) -> Block | None:
        with self._lock:
            b = self._memory.get(key)
            if b is not None:
                self._memory.move_to_end(key)
            return b

    def _put(self, block: Block) -> None:
        size = block.nbytes
        with self._lock:
            old = self._memory.pop(block.key, None)
            if old is not None:
                self._memory_bytes -= old.nbytes
            if size > self.memory_budget:
                return
            self._memory[block.key] = block
            self._memory_bytes += size

    def _evict(self) -> None:
        """Least recently used blocks out until the memory budget holds (after a chain's
        blocks were put and promoted: never its first ones for its last ones)."""
        with self._lock:
            while self._memory_bytes > self.memory_budget:
                _, gone = self._memory.popitem(last=False)
                self._memory_bytes -= gone.nbytes

    def _promote(self, keys: list[str]) -> None:
        """Mark a chain of blocks as just used, the first most recently: a block is useless
        without the blocks before it, so the last ones are evicted first."""
        with self._lock:
            for key in reversed(keys):
                if key in self._memory:
                    self._memory.move_to_end(key)

    def _seen_before(self, key: str) -> bool:
        with self._lock:
            seen = key in self._seen
            self._seen[key] = None
            self._seen.move_to_end(key)
            while len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)
            return seen

    # -- resume -----------------------------------------------------------------------------

    def _load(
        self,
        key: str,
        fresh: list[Any],
        target: TargetAdapter,
        parent: str,
        tokens: list[int],
        lo: int,
    ) -> Block | None:
        """A block from disk, checked against what it claims and what this request expects
        (None: missing, or bad and removed): the model, the positions `lo`.., the block
        before it (`parent`: its key, the root's for the first) and its `tokens`, the layer
        count and kinds, and each array's shape and dtype, as this target's own cache has
        them. A file whose checksum and key are right but whose contents are not (forged,
        or another model's) is never used."""
        got = self.disk.read(key)
        if got is None:
            return None
        layers, meta = got
        problem = self._problem(layers, meta, target, fresh, parent, tokens, lo)
        if problem is None:
            mx.eval([a for c in layers for a in checks.arrays(c)])
            if not all(mx.isfinite(a).all().item() for c in layers for a in checks.arrays(c)):
                problem = "it holds values that are not finite"
        if problem is not None:
            self.disk.remove_bad(self.disk.path(key), problem)
            with self._lock:
                self.counts["rejected_blocks"] += 1
            return None
        if meta.get("snapshot") == "1":
            self._disk_snapshots.add(key)
        return Block(key, layers, meta.get("snapshot") == "1")

    def _problem(self, layers, meta, target, fresh, parent, tokens, lo) -> str | None:
        """Why a block read from disk cannot serve this request, or None (`checks`)."""
        claims = dict(model=keys_mod.fingerprint(target.model), parent=parent, start=lo)
        expected = self._layout(target, fresh)
        return checks.block_problem(layers, meta, claims, tokens, fresh, expected, self.block)

    def _layout(self, target: TargetAdapter, fresh: list[Any]) -> list[Any]:
        """`checks.cache_layout` of this target's cache, once per model."""
        ident = (id(target.model), tuple(type(c).__name__ for c in fresh))
        with self._lock:
            known = self._layouts.get(ident)
        if known is None:
            known = checks.cache_layout(target)
            with self._lock:
                self._layouts[ident] = known
        return known

    def _restore(
        self, link: Link, target: TargetAdapter, prompt: list[int], cache: list, bound: int
    ) -> int:
        blocks = (len(prompt) - 1) // self.block  # one prompt token is always prefilled
        if blocks * self.block <= bound:
            return 0
        keys = self.keys(target, cache, prompt, blocks)
        run = 0
        for key in keys:
            if self._get(key) is None and not (self.disk is not None and self.disk.has(key)):
                break
            run += 1
        if run * self.block <= bound:
            run = 0  # (across ranks every rank still agrees below)
        found: list[tuple[Block, bool]] = []  # (block, from disk)
        root = self.root(target, cache).hex()
        for i, key in enumerate(keys[:run]):
            b = self._get(key)
            from_disk = b is None
            if from_disk and self.disk is not None:
                lo = i * self.block
                parent = keys[i - 1] if i else root
                b = self._load(key, cache, target, parent, prompt[lo : lo + self.block], lo)
                if b is not None:
                    self._put(b)
            if b is None:
                break
            found.append((b, from_disk))
        if target.recurrent:  # resume where the recurrent state is known
            last = max((i for i, (b, _) in enumerate(found) if b.snapshot), default=-1)
            found = found[: last + 1]
        # Across ranks: the longest run every rank holds (each holds its own shard's).
        found = found[: distributed.fewest("prompt store blocks", len(found))]
        start = len(found) * self.block
        if start <= bound:
            self._evict()
            return 0
        for i, c in enumerate(cache):
            if isinstance(c, KVCache):
                parts = [b.layers[i] for b, _ in found]
                c.keys = mx.concatenate([p.keys[..., : p.offset, :] for p in parts], axis=2)
                c.values = mx.concatenate([p.values[..., : p.offset, :] for p in parts], axis=2)
                c.offset = start
        if target.recurrent:
            end = found[-1][0].layers
            target.restore(
                cache,
                {i: (list(end[i].cache), *cache[i].state[1:]) for i in target.replay_ids},
            )
        used = [b.key for b, _ in found]
        self._promote(used)
        self._evict()
        if self.disk is not None and any(d for _, d in found):
            self.disk.touch_chain([k for k in used if self.disk.has(k)])
        disk_blocks = sum(d for _, d in found)
        link.disk_tokens = disk_blocks * self.block
        link.memory_tokens = start - link.disk_tokens
        with self._lock:
            self.counts["memory_tokens"] += link.memory_tokens
            self.counts["disk_tokens"] += link.disk_tokens
        return start

    # -- keep -------------------------------------------------------------------------------

    def keep(self, link: Link, cache: list[Any], snapshots: list[tuple[int, dict]] = ()) -> None:
        """After a request: its prompt's blocks into memory (those not there yet) and, when
        worth it, to disk in the background. `cache` holds at least the whole prompt."""
        target, prompt = link.target, link.prompt
        if target is None:
            return
        blocks = len(prompt) // self.block
        if not blocks:
            return
        states = dict(link.snapshots)
        states.update((n, s) for n, s in snapshots if n % self.block == 0)
        keys = self.keys(target, cache, prompt, blocks)
        worth = len(prompt) >= self.write_after
        fresh: list[Block] = []
        writes: list[Block] = []
        for i, key in enumerate(keys):
            end = (i + 1) * self.block
            snap = states.get(end) if target.recurrent else None
            b = self._get(key)
            if b is None or (snap is not None and not b.snapshot):
                b = self._cut(target, cache, key, i * self.block, end, snap)
                b.claims = {
                    "model": keys_mod.fingerprint(target.model),
                    "parent": keys[i - 1] if i else self.root(target, cache).hex(),
                    "start": str(i * self.block),
                    "tokens": checks.tokens_text(prompt[i * self.block : end]),
                }
                fresh.append(b)
                self._put(b)
            if self._seen_before(key) or worth:
                writes.append(b)
        self._promote(keys)
        self._evict()
        if fresh:
            mx.eval([a for b in fresh for c in b.layers for a in checks.arrays(c)])
            with self._lock:
                self.counts["kept_blocks"] += len(fresh)
        if self.disk is not None and writes:
            self.disk.submit(lambda: self._write(writes))

    def _cut(self, target, cache, key, lo, hi, snap) -> Block:
        layers: list[Any] = []
        for i, c in enumerate(cache):
            if isinstance(c, KVCache):
                part = KVCache()
                part.keys = mx.contiguous(c.keys[..., lo:hi, :])
                part.values = mx.contiguous(c.values[..., lo:hi, :])
                part.offset = hi - lo
                layers.append(part)
            else:
                arrays = list(snap[i][0]) if snap is not None else [None] * len(c.cache)
                part = ArraysCache(len(arrays))
                part.cache = arrays
                layers.append(part)
        return Block(key, layers, snap is not None)

    def _write(self, blocks: list[Block]) -> None:
        """On the writer thread, in order: a reader finds a prefix of them whenever it
        looks. A block already on disk is only marked used (unless this one adds the
        recurrent state at its end)."""
        disk = self.disk
        total = 0
        for i, b in enumerate(blocks):
            if disk.has(b.key) and (not b.snapshot or b.key in self._disk_snapshots):
                continue
            if not b.claims:  # read from disk: already written
                continue
            meta = {"key": b.key, "snapshot": "1" if b.snapshot else "0", **b.claims}
            data = encode(b.layers, meta)
            total += len(data)
            if total > disk.budget:  # the chain's start is worth more than its end
                blocks = blocks[:i]
                break
            if disk.write(b.key, data) and b.snapshot:
                self._disk_snapshots.add(b.key)
        disk.touch_chain([b.key for b in blocks])

    # -- upkeep -----------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the background writes; False on timeout."""
        return self.disk.flush(timeout) if self.disk is not None else True

    def clear(self, disk: bool = True) -> int:
        """Forget every block in memory and (`disk`) remove every block file; files removed."""
        with self._lock:
            self._memory.clear()
            self._memory_bytes = 0
            self._seen.clear()
        if disk and self.disk is not None:
            self.flush()
            return self.disk.clear()
        return 0

    def stats(self) -> dict[str, Any]:
        """Counters: prompt tokens restored from memory and from disk, blocks kept, bytes in
        memory; with a folder, bytes and blocks written, bad files removed, evictions."""
        with self._lock:
            out = {
                **self.counts,
                "memory_blocks": len(self._memory),
                "memory_bytes": self._memory_bytes,
            }
        if self.disk is not None:
            with self.disk._lock:
                out.update({f"disk_{k}": v for k, v in self.disk.counts.items()})
        return out
