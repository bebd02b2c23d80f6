"""Decode speed of this checkout against an earlier git revision, on the demo pair.

For refactors of the engine: both trees run the same held-out prompts at a fixed verify
width of 16, plainly (W = 1), with the automatic width, as trees of 12 nodes (`tree12`), and
4 requests at once (`batch4`, `batch_generate`, automatic width: total tok/s over the wall
time). Speeds are a request's tokens over its wall time, prefill included (an engine
that hands out its first token sooner, before launching the next cycle, must not look
slower: decode-only rates start their clock at the first token). Each tree runs in a
worker process of its own; every measurement is taken in both
back to back, in alternating order, so that what else the machine does weighs on both
alike. It prints each tree's mean tok/s and the geometric mean of the paired ratios (this /
the revision) with a 95% interval. The revision is checked out into
a temporary git worktree (removed afterwards). Use a fresh `DFLASH_MLX_CACHE` per regime;
`--openblas` preloads Debian's OpenBLAS in both trees' processes.

    python benchmarks/vs_revision.py cc8c055 [--repeats 3] [--openblas]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
WIDTHS = ("16", "1", "auto", "tree12", "batch4")

# One tree's worker: it imports dflash_mlx from the tree given in argv[1] (old API or new),
# then runs one measurement per line read from stdin, `mode index`, and prints its tok/s.
CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import dflash_mlx
from dflash_mlx.demo import demo_pair
t, d = demo_pair()
model, tok = dflash_mlx.load(str(t))
draft = dflash_mlx.load_draft(str(d))
path = os.path.join(sys.argv[1], "dflash_mlx/demo_pair/heldout_prompts.jsonl")
prompts = [json.loads(line)["prompt"] for line in open(path)][: int(sys.argv[2])]
ids = [tok.encode(p)[:200] for p in prompts]
pair = dflash_mlx.Pair(model, draft) if hasattr(dflash_mlx, "Pair") else None

def one(mode, i):
    if mode == "batch4":  # 4 requests at once: total tok/s over the wall time
        group = [ids[(i + k) % len(ids)] for k in range(4)]
        opts = dflash_mlx.GenerateOptions(max_tokens=96)
        tic = time.perf_counter()
        rs = dflash_mlx.batch_generate(pair, tok, group, opts, max_batch=4)
        return sum(len(r.tokens) for r in rs) / (time.perf_counter() - tic)
    tree = mode == "tree12"
    w = 12 if tree else None if mode == "auto" else int(mode)
    extra = {"tree": True} if tree else {}
    tic = time.perf_counter()
    if pair is None:
        r = dflash_mlx.generate(model, draft, tok, ids[i], max_tokens=96, block_size=w)
    else:
        r = dflash_mlx.generate(pair, tok, ids[i], max_tokens=96, verify_width=w, **extra)
    return len(r.tokens) / (time.perf_counter() - tic)

print("ready", flush=True)
for line in sys.stdin:
    mode, i = line.split()
    print(json.dumps(one(mode, int(i))), flush=True)
"""


class Tree:
    """A worker process importing one tree's package."""

    def __init__(self, root: Path, prompts: int, openblas: bool):
        env = dict(os.environ)
        if openblas:
            env["LD_PRELOAD"] = OPENBLAS
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root), str(prompts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),  # never the checkout: the tree comes from argv[1]
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, mode: str, i: int) -> float:
        self.proc.stdin.write(f"{mode} {i}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the git revision to compare with, e.g. cc8c055")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--openblas", action="store_true", help=f"preload {OPENBLAS}")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(
            ["git", "-C", str(here), "worktree", "add", "-q", "--detach", str(old), args.revision],
            check=True,
        )
        try:
            trees = {"old": Tree(old, args.prompts, args.openblas)}
            trees["this"] = Tree(here, args.prompts, args.openblas)
            runs: dict[str, dict[str, list[float]]] = {"this": {}, "old": {}}
            for mode in WIDTHS:  # warm-up: compilation, calibration, the choosers' first lessons
                for t in trees.values():
                    t.run(mode, 0)
            for r in range(args.repeats):
                for i in range(args.prompts):
                    for mode in WIDTHS:
                        # Paired in time: the two trees back to back, in alternating order.
                        order = ("old", "this") if (r + i) % 2 == 0 else ("this", "old")
                        for name in order:
                            runs[name].setdefault(mode, []).append(trees[name].run(mode, i))
                print(f"round {r + 1} done", file=sys.stderr, flush=True)
            for t in trees.values():
                t.close()
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(old)])
    rev = args.revision + " tok/s"
    print(f"{'mode':>6} {'this tok/s':>11} {rev:>14} {'this/old':>9}  95% interval")
    for w in WIDTHS:
        this, before = runs["this"][w], runs["old"][w]
        logs = [math.log(a / b) for a, b in zip(this, before)]
        mean = statistics.fmean(logs)
        half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
        print(
            f"{w:>6} {statistics.fmean(this):11.1f} {statistics.fmean(before):14.1f} "
            f"{math.exp(mean):9.3f}  [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]"
        )


if __name__ == "__main__":
    main()
