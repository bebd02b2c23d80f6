"""Cache housekeeping (issue 63): a kill -9 during a prompt-store write left its temporary
file for an hour, outside the budget; two servers sharing a 5 MB budget reached 5.8 MB;
`serve --max-context` beyond the model's own context was accepted and advertised."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dflash_mlx.cache.prompt_store.disk import DiskTier, scan_folder

from .test_cli_serve import dflash
from .test_prompt_store_disk import block

WRITER = """
import os, sys, time
path = os.path.join(sys.argv[1], "ab", f".{'ab' * 32}.{os.getpid()}.0123abcd.tmp")
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "wb") as f:
    f.write(b"x" * 500_000)
    f.flush()
    print("writing", flush=True)
    time.sleep(600)
"""


def test_a_killed_writers_temporary_file_is_counted_and_removed_at_start(tmp_path):
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout.readline().strip() == "writing"
    # While its writer lives, the file is another process's write in progress: kept, and
    # counted against the budget (a 1 MB budget then holds one 0.5 MB block beside it).
    live = DiskTier(tmp_path, 1_000_000)
    assert len(scan_folder(tmp_path)[1]) == 1 and live.counts["removed_temp"] == 0
    big = b"y" * 450_000  # the tier writes bytes as given (reads verify them)
    assert live.write("1" * 64, big) and live.write("2" * 64, big)
    files, temps = scan_folder(tmp_path)
    assert sum(s for _, s, _ in files + temps) <= 1_000_000, (files, temps)
    writer.send_signal(signal.SIGKILL)  # killed mid-write
    writer.wait()
    restarted = DiskTier(tmp_path, 1_000_000)
    assert scan_folder(tmp_path)[1] == [], "the dead writer's temporary file is still there"
    assert restarted.counts["removed_temp"] == 1


def test_two_stores_sharing_a_folder_keep_its_budget(tmp_path):
    """Two servers (two tiers, each with its own count) writing in turn on one folder."""
    _, data = block(1)
    budget = 6 * len(data)
    a, b = DiskTier(tmp_path, budget), DiskTier(tmp_path, budget)
    n = 0
    for writer in [a, a, b, b, a, a, b, b, a, b, a, b]:
        n += 1
        assert writer.write(f"{n:064x}", data)
        files, temps = scan_folder(tmp_path)
        used = sum(s for _, s, _ in files + temps)
        assert used <= budget, f"write {n}: {used} bytes in a {budget}-byte budget"


def test_max_context_beyond_the_models_is_refused(models_dir):
    pair = ["-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft")]
    start = time.monotonic()
    done = dflash("serve", *pair, "--port", "0", "--max-context", "1000000", timeout=120)
    err = " ".join(done.stderr.decode().split())
    assert done.returncode == 2, err
    assert "--max-context 1000000 is more than this model holds" in err, err
    assert "context is 4096 tokens" in err and time.monotonic() - start < 120
    assert os.environ.get("DFLASH_MLX_CACHE")  # the session's own cache, never the user's
