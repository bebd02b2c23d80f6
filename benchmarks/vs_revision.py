"""Decode speed of this checkout against an earlier git revision, on the demo pair.

For refactors of the engine: both trees run the same held-out prompts at a fixed verify
width of 16, plainly (W = 1), with the automatic width, as trees of 12 nodes (`tree12`), and
4 requests at once (`batch4`, `batch_generate`, automatic width: total tok/s over the wall
time), each in its own process,
alternating tree by tree for `--repeats` rounds; it prints each tree's mean tok/s and the
geometric mean of the paired ratios (this / the revision). The revision is checked out into
a temporary git worktree (removed afterwards). Use a fresh `DFLASH_MLX_CACHE` per regime;
`--openblas` preloads Debian's OpenBLAS in both trees' processes.

    python benchmarks/vs_revision.py cc8c055 [--repeats 3] [--openblas]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
WIDTHS = ("16", "1", "auto", "tree12", "batch4")

# One tree's run: it imports dflash_mlx from the tree given in argv[1] (old API or new).
CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import dflash_mlx
from dflash_mlx.demo import demo_pair
t, d = demo_pair()
model, tok = dflash_mlx.load(str(t))
draft = dflash_mlx.load_draft(str(d))
path = os.path.join(sys.argv[1], "dflash_mlx/demo_pair/heldout_prompts.jsonl")
prompts = [json.loads(line)["prompt"] for line in open(path)][: int(sys.argv[2])]
pair = dflash_mlx.Pair(model, draft) if hasattr(dflash_mlx, "Pair") else None
out = {}
for name in ("16", "1", "auto"):
    w = None if name == "auto" else int(name)
    speeds = []
    for p in prompts:
        ids = tok.encode(p)[:200]
        if pair is not None:
            r = dflash_mlx.generate(pair, tok, ids, max_tokens=96, verify_width=w)
            speeds.append(r.stats.generation_tps)
        else:
            r = dflash_mlx.generate(model, draft, tok, ids, max_tokens=96, block_size=w)
            speeds.append(r.generation_tps)
    out[name] = sum(speeds) / len(speeds)
speeds = []
for p in prompts:
    ids = tok.encode(p)[:200]
    r = dflash_mlx.generate(pair, tok, ids, max_tokens=96, verify_width=12, tree=True)
    speeds.append(r.stats.generation_tps)
out["tree12"] = sum(speeds) / len(speeds)
import time
groups = [prompts[i : i + 4] for i in range(0, len(prompts) - 3, 4)] or [prompts[:4]]
tokens = seconds = 0.0
for g in groups:
    ids = [tok.encode(p)[:200] for p in g]
    opts = dflash_mlx.GenerateOptions(max_tokens=96)
    tic = time.perf_counter()
    rs = dflash_mlx.batch_generate(pair, tok, ids, opts, max_batch=4)
    seconds += time.perf_counter() - tic
    tokens += sum(len(r.tokens) for r in rs)
out["batch4"] = tokens / seconds
print(json.dumps(out))
"""


def run_tree(root: Path, prompts: int, openblas: bool) -> dict[str, float]:
    env = dict(os.environ)
    if openblas:
        env["LD_PRELOAD"] = OPENBLAS
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(prompts)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),  # never the checkout: the tree comes from argv[1]
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


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
            runs: dict[str, list[dict[str, float]]] = {"this": [], "old": []}
            for r in range(args.repeats):
                for name, root in (("old", old), ("this", here)):
                    runs[name].append(run_tree(root, args.prompts, args.openblas))
                    print(f"round {r + 1} {name}: {json.dumps(runs[name][-1])}", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(old)])
    print(f"{'width':>6} {'this tok/s':>11} {args.revision + ' tok/s':>14} {'this/old':>9}")
    for w in WIDTHS:
        this = [x[w] for x in runs["this"]]
        before = [x[w] for x in runs["old"]]
        ratio = math.exp(sum(math.log(a / b) for a, b in zip(this, before)) / len(this))
        print(
            f"{w:>6} {sum(this) / len(this):11.1f} {sum(before) / len(before):14.1f} {ratio:9.3f}"
        )


if __name__ == "__main__":
    main()
