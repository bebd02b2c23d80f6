"""What speculation can gain over plain batching at each concurrency: each fixed width.

    python benchmarks/batch_widths.py [--concurrency 1,2,4,8] [--widths 2,3,4,6,8,16]
                                      [--blocks 0,4] [--requests 8] [--tokens 128]
                                      [--repeats 2] [--regimes stock,openblas] [--json OUT]

Issue 36 asks the batched engine for 1.3x the better plain batching server at every
concurrency c (OpenBLAS). Whatever chooses the widths, a batch can do no better than the
best fixed width chosen after the fact for that c (per-row widths aside: see below). This
script measures that ceiling in-process, without HTTP: `--requests` of the demo's held-out
prompts, `--tokens` greedy tokens each, sent in waves of c (each wave when the one before
has ended, as `concurrency.py` sends them), for
  * mlx-lm    - mlx-lm's own `batch_generate` (its `BatchGenerator`, what `mlx_lm.server`
                batches with): plain batching, the baseline;
  * plain     - the engine forced plain (`verify_width=1`);
  * auto      - the engine's default (`verify_width=None`), its chooser carried across the
                waves and repeats as a server carries it;
  * W=k/L     - the engine at each fixed verify width k (`--widths`), the draft running its
                trained block (L=16) or, with `--blocks 4`, a block of max(k, 4) rows.
Aggregate tokens per second over all the waves (prefill included), the median of
`--repeats`; each method's tokens are checked against mlx-lm's. It prints, per regime and
c, each method over mlx-lm, and `best W / mlx-lm` with the width that gave it, and per c
the mean τ of the best width. Both regimes by default, each in its own process with a fresh
`DFLASH_MLX_CACHE`; core pinning is left to the caller (`taskset -c 0 python ...`).

A row of a batch may verify fewer tokens than the others, but the target's pass pads every
row to the widest, so a narrow row saves nothing there; what a chooser can add over the
best fixed width is varying it over time (`auto` at c = 1 does) or passes split by width
(not built).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from draft_window import OPENBLAS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--widths", default="2,3,4,6,8,16")
    ap.add_argument("--blocks", default="0", help="draft blocks L: 0 = trained, k = max(W, k)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--regimes", default="stock,openblas")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    regimes = [r for r in args.regimes.split(",") if r]
    if "openblas" in regimes and not OPENBLAS.exists():
        sys.exit(f"{OPENBLAS} is missing (apt-get install libopenblas0-pthread)")
    root = Path(tempfile.mkdtemp(prefix="dflash-widths-"))
    results = {}
    try:
        for regime in regimes:
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            if regime == "openblas":
                env["LD_PRELOAD"] = str(OPENBLAS)
            env["DFLASH_MLX_CACHE"] = str(root / f"cache-{regime}")
            out = root / f"{regime}.json"
            argv = [a for a in sys.argv[1:]]
            code = subprocess.call(
                [sys.executable, __file__, *argv, "--child", f"{regime}:{out}"], env=env
            )
            if code:
                sys.exit(code)
            results[regime] = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def report(results: dict) -> None:
    for regime, res in results.items():
        print(f"\n## {regime}: aggregate tok/s over mlx-lm's batch_generate (median of repeats)\n")
        cs = sorted(res, key=int)
        methods = list(res[cs[0]]["tps"])
        print("| method | " + " | ".join(f"c = {c}" for c in cs) + " |")
        print("|---|" + "---:|" * len(cs))
        base = {c: res[c]["tps"]["mlx-lm"] for c in cs}
        print("| mlx-lm tok/s | " + " | ".join(f"{base[c]:.0f}" for c in cs) + " |")
        for m in methods[1:]:
            print(f"| {m} | " + " | ".join(f"{res[c]['tps'][m] / base[c]:.2f}" for c in cs) + " |")
        best = {}
        for c in cs:
            fixed = {m: v for m, v in res[c]["tps"].items() if m.startswith("W=")}
            best[c] = max(fixed, key=fixed.get) if fixed else None
        print(
            "| **best fixed width** | "
            + " | ".join(
                f"**{res[c]['tps'][best[c]] / base[c]:.2f}** "
                f"({best[c]}, τ {res[c]['tau'][best[c]]:.2f})"
                if best[c]
                else "-"
                for c in cs
            )
            + " |"
        )


def child(args) -> None:
    regime, out = args.child.split(":", 1)
    import mlx.core as mx
    from mlx_lm import batch_generate as lm_batch

    from dflash_mlx import GenerateOptions, batch_generate, load_pair
    from dflash_mlx.demo import SHIPPED, demo_pair

    pair, tok = load_pair(*demo_pair())
    pair.costs()
    lines = (SHIPPED / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(x)["prompt"] for x in lines if x.strip()][: args.requests]
    ids = [tok.encode(p) for p in prompts]
    n = args.tokens
    block = pair.draft.config.block_size
    methods: dict[str, GenerateOptions | None] = {
        "mlx-lm": None,
        "plain": GenerateOptions(max_tokens=n, verify_width=1),
        "auto": GenerateOptions(max_tokens=n),
    }
    for w in (int(x) for x in args.widths.split(",") if x):
        for b in (int(x) for x in args.blocks.split(",") if x):
            length = block if b == 0 else min(block, max(w, b))
            methods[f"W={w}/L={length}"] = GenerateOptions(
                max_tokens=n, verify_width=w, draft_block=length
            )
    print(f"# {regime}: MLX {mx.__version__} {mx.default_device()}", file=sys.stderr, flush=True)

    def run(name: str, c: int):
        """Tokens per second over every wave, each row's tokens, and each row's τ."""
        toks, taus = [], []
        tic = time.perf_counter()
        for start in range(0, len(ids), c):
            wave = ids[start : start + c]
            if methods[name] is None:
                r = lm_batch(pair.model, tok, wave, max_tokens=n, return_token_ids=True)
                toks += [list(t) for t in r.token_ids]
                taus += [1.0] * len(wave)
            else:
                outs = batch_generate(pair, tok, wave, methods[name])
                toks += [o.tokens for o in outs]
                taus += [o.stats.tau for o in outs]
        wall = time.perf_counter() - tic
        return sum(len(t) for t in toks) / wall, toks, taus

    for name in methods:  # warm-up: kernels, and the chooser's first look
        run(name, 2)
    res: dict[str, dict] = {}
    for c in (int(x) for x in args.concurrency.split(",") if x):
        tps: dict[str, list[float]] = {m: [] for m in methods}
        tau: dict[str, list[float]] = {m: [] for m in methods}
        names = list(methods)
        for rep in range(args.repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            ref = None
            got = {}
            for m in order:
                speed, toks, taus = run(m, c)
                got[m] = toks
                tps[m].append(speed)
                tau[m].append(statistics.fmean(taus))
            ref = got["mlx-lm"]
            for m, toks in got.items():
                # mlx-lm stops a row at its EOS token (kept in ours): compare up to it.
                if [t[: len(r)] for t, r in zip(toks, ref)] != ref:
                    sys.exit(f"{regime} c={c} {m}: tokens differ from mlx-lm's")
        res[str(c)] = {
            "tps": {m: statistics.median(v) for m, v in tps.items()},
            "tau": {m: statistics.fmean(v) for m, v in tau.items()},
            "runs": tps,
        }
        line = ", ".join(f"{m} {statistics.median(v):.0f}" for m, v in tps.items())
        print(f"# {regime} c={c}: {line}", file=sys.stderr, flush=True)
    Path(out).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
