"""The prompt store's disk tier on synthetic blocks: atomic writes, verified reads, the byte
budget, and two processes on one folder."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from dflash_mlx.cache.prompt_store import disk as disk_mod
from dflash_mlx.cache.prompt_store.disk import DiskTier, decode, encode

ROWS = 64


def layers(seed: int, n: int = 2) -> list[KVCache]:
    out = []
    for i in range(n):
        c = KVCache()
        c.keys = mx.full((1, 2, ROWS, 8), float(seed * 10 + i))
        c.values = mx.full((1, 2, ROWS, 8), float(-seed))
        c.offset = ROWS
        out.append(c)
    return out


def block(seed: int) -> tuple[str, bytes]:
    key = f"{seed:064x}"
    return key, encode(layers(seed), {"key": key})


def seed_of(got) -> int:
    return -int(got[0][0].values[0, 0, 0, 0].item())


def test_a_round_trip_and_each_kind_of_bad_file(tmp_path, caplog):
    tier = DiskTier(tmp_path, 10**9)
    key, data = block(3)
    assert tier.write(key, data) and seed_of(tier.read(key)) == 3
    other_key, other = block(4)
    caplog.set_level(logging.WARNING, logger="dflash_mlx.cache.prompt_store")
    bad = {
        "truncated": data[: len(data) // 2],
        "garbage": bytes(len(data)),
        "a flipped byte": data[:-1] + bytes([data[-1] ^ 1]),
        "foreign": other,  # a whole block, of another key
        "not ours": b"hello",
    }
    for what, content in bad.items():
        tier.path(key).write_bytes(content)
        caplog.clear()
        assert tier.read(key) is None, what
        assert not tier.path(key).exists(), f"a {what} file was left in place"
        assert any("removed" in r.getMessage() for r in caplog.records), what
    assert tier.counts["removed_bad"] == len(bad)
    assert tier.read(other_key) is None  # missing: no error, no log
    assert tier.counts["removed_bad"] == len(bad)


def test_a_reader_never_sees_a_block_half_written(tmp_path, monkeypatch):
    """The writer stops half-way through a block; a reader looking then finds no block (or
    the previous whole one), never a torn file it would have to throw away."""
    tier = DiskTier(tmp_path, 10**9)
    key, old = block(1)
    assert tier.write(key, old)
    new = encode(layers(2), {"key": key})
    half_done, resume = threading.Event(), threading.Event()
    real = disk_mod.write_all

    def slow(f, data, chunk=1 << 22):
        real(f, data[: len(data) // 2])
        f.flush()
        half_done.set()
        assert resume.wait(30)
        real(f, data[len(data) // 2 :])

    monkeypatch.setattr(disk_mod, "write_all", slow)
    writer = threading.Thread(target=tier.write, args=(key, new))
    writer.start()
    assert half_done.wait(30)
    seen = tier.read(key)  # mid-write
    resume.set()
    writer.join(30)
    assert tier.counts["removed_bad"] == 0, "the reader met a torn block file"
    assert seen is not None and seed_of(seen) == 1, "the previous whole block was not readable"
    assert seed_of(tier.read(key)) == 2


def test_the_budget_holds_under_distinct_blocks_least_recently_used_first(tmp_path):
    size = len(block(0)[1])
    tier = DiskTier(tmp_path, 5 * size + size // 2)
    for seed in range(20):
        key, data = block(seed)
        assert tier.write(key, data)
        if seed == 2:
            kept = key
        if seed > 2:
            tier.touch(kept)  # in use: stays
        assert tier.usage() <= tier.budget
    assert tier.has(kept) and tier.has(block(19)[0])
    assert not tier.has(block(3)[0]) and tier.counts["evicted"] == 15
    # A block larger than the whole budget is not written.
    assert not DiskTier(tmp_path / "small", size - 1).write(*block(0))


def test_a_chain_is_evicted_from_its_end(tmp_path):
    size = len(block(0)[1])
    tier = DiskTier(tmp_path, 4 * size)
    chain = [block(s) for s in range(3)]
    for key, data in chain:
        tier.write(key, data)
    tier.touch_chain([k for k, _ in chain])
    tier.write(*block(10))
    tier.write(*block(11))  # one block of the chain must go: its last one
    assert [tier.has(k) for k, _ in chain] == [True, True, False]


WRITER = r"""
import sys, random
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_prompt_store_disk import block, seed_of
from dflash_mlx.cache.prompt_store.disk import DiskTier
tier = DiskTier(Path({folder!r}), {budget})
rng = random.Random({who})
for _ in range(150):
    seed = rng.randrange(12)
    key, data = block(seed)
    if rng.random() < 0.6:
        tier.write(key, data)
    else:
        got = tier.read(key)
        assert got is None or seed_of(got) == seed, "read another block's contents"
print("bad", tier.counts["removed_bad"], flush=True)
# Out without the interpreter's teardown: once, on a loaded machine, MLX's at exit aborted
# ("terminate called without an active exception") after this work was done and printed.
import os
os._exit(0)
"""


def test_two_processes_writing_and_reading_one_folder(tmp_path):
    """Two processes (servers) write, read and evict the same blocks under one budget at
    once: every read is whole or missing, nothing is ever thrown away as torn."""
    size = len(block(0)[1])
    folder = tmp_path / "store"
    tests = str(Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER.format(tests=tests, folder=str(folder), budget=6 * size, who=who),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for who in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == "bad 0", out + err
    tier = DiskTier(folder, 6 * size)
    files = tier.scan()
    assert files and not list(folder.rglob("*.tmp")), "a temporary file was left behind"
    for path, _, _ in files:
        decode(path.read_bytes(), path.name.split(".")[0])  # each one whole and valid
    # Each process kept the budget as it saw it; together at most one block over.
    assert sum(s for _, s, _ in files) <= 7 * size
