"""DFlash's speedup over plain decoding with the target sharded over 2 ranks vs in one process.

    python benchmarks/distributed.py [--prompts 4] [--max-tokens 64] [--regimes stock,openblas]

On the shipped demo pair, for each BLAS regime (the stock wheel; Debian's OpenBLAS preloaded)
and each setup (one process; two ranks on 127.0.0.1 over MLX's ring backend, the target
tensor-parallel), in one run: a worker (this file with --worker, under `mlx.launch` for two
ranks) loads the pair, calibrates the automatic width (every rank in lockstep, a fresh
cache folder per regime and setup), warms up, then on each held-out prompt decodes with
mlx-lm's own greedy loop on the same (sharded) target (plain), DFlash at the automatic width
and DFlash at W=8, in a rotating order. Decode tok/s as each reports it (after the first
token); the speedup is DFlash / plain paired by prompt (geometric mean, 95% interval). Every
DFlash run's tokens are checked against plain decoding's.

Everything is pinned to cores 0 and 1 (`taskset -c 0,1`), every process with
OPENBLAS_NUM_THREADS=1: two ranks then hold one core each, one process two.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
MODES = ("plain", "auto", "W=8")


def worker(args) -> None:
    import dflash_mlx
    from dflash_mlx import distributed
    from dflash_mlx.demo import demo_pair
    from dflash_mlx.models.loading import load_sharded

    target, draft = demo_pair()
    cluster = distributed.start("tensor" if distributed.launched() else "none")
    if cluster is not None:
        model, tokenizer = load_sharded(target, "tensor", cluster.group)
    else:
        model, tokenizer = dflash_mlx.load(target)
    pair = dflash_mlx.Pair(model, dflash_mlx.load_draft(draft))
    distributed.lockstep_calibration(pair)
    tic = time.perf_counter()
    pair.calibrate()
    calibration = time.perf_counter() - tic
    from mlx_lm import stream_generate as mlx_lm_stream

    lines = (target.parent / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [tokenizer.encode(json.loads(ln)["prompt"]) for ln in lines[: args.prompts]]

    def run(mode: str, ids: list[int], n: int) -> tuple[float, list[int]]:
        if mode == "plain":
            last, tokens = None, []
            for last in mlx_lm_stream(model, tokenizer, ids, max_tokens=n):
                tokens.append(last.token)
            return last.generation_tps, tokens
        width = None if mode == "auto" else int(mode.split("=")[1])
        opts = dflash_mlx.GenerateOptions(max_tokens=n, verify_width=width)
        r = dflash_mlx.generate(pair, tokenizer, ids, opts)
        return r.stats.generation_tps, r.tokens

    for mode in MODES:  # warm-up: compile, allocate; not measured
        run(mode, prompts[0], 16)
    rows = []
    for i, ids in enumerate(prompts):
        order = MODES[i % 3 :] + MODES[: i % 3]
        got = {mode: run(mode, ids, args.max_tokens) for mode in order}
        rows.append(
            {
                "tps": {m: got[m][0] for m in MODES},
                "same": {m: got[m][1] == got["plain"][1] for m in MODES[1:]},
            }
        )
    if distributed.speaks():
        Path(args.out).write_text(json.dumps({"rows": rows, "calibration_s": calibration}))
    distributed.finish(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(regime: str, ranks: int, args) -> dict:
    out = Path(tempfile.mkdtemp()) / "result.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OPENBLAS_NUM_THREADS": "1",
        "DFLASH_MLX_CACHE": tempfile.mkdtemp(prefix=f"dflash-{regime}-{ranks}-"),
    }
    if regime == "openblas":
        env["LD_PRELOAD"] = str(OPENBLAS)
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out)]
    me += ["--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)]
    if ranks == 1:
        cmd = ["taskset", "-c", "0,1", *me]
    else:
        port = str(free_port())
        cmd = ["taskset", "-c", "0,1", sys.executable, "-c", LAUNCH, "--backend", "ring"]
        cmd += ["--hosts", "127.0.0.1", "-n", str(ranks), "--starting-port", port, "--", *me]
    tic = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0 or not out.exists():
        sys.exit(f"{regime}, {ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - tic
    return result


def paired(rows: list[dict], mode: str) -> tuple[float, float, float]:
    logs = [math.log(r["tps"][mode] / r["tps"]["plain"]) for r in rows]
    m = statistics.fmean(logs)
    h = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(m), math.exp(m - h), math.exp(m + h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--regimes", default="stock,openblas")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if "openblas" in args.regimes and not OPENBLAS.exists():
        sys.exit(f"{OPENBLAS} is missing (apt-get install libopenblas0-pthread)")
    results = {}
    print(
        "regime    setup      plain tok/s  auto tok/s  W=8 tok/s  auto/plain (95%)    "
        "W=8/plain (95%)    lossless  calib"
    )
    for regime in args.regimes.split(","):
        for ranks in (1, 2):
            r = measure(regime, ranks, args)
            results[f"{regime}/{ranks}"] = r
            rows = r["rows"]
            tps = {m: statistics.fmean(x["tps"][m] for x in rows) for m in MODES}
            a, w = paired(rows, "auto"), paired(rows, "W=8")
            same = all(all(x["same"].values()) for x in rows)
            setup = "1 process" if ranks == 1 else f"{ranks} ranks"
            print(
                f"{regime:<9} {setup:<10} {tps['plain']:>11.1f} {tps['auto']:>11.1f} "
                f"{tps['W=8']:>10.1f}  {a[0]:.2f}× ({a[1]:.2f}–{a[2]:.2f})  "
                f"{w[0]:.2f}× ({w[1]:.2f}–{w[2]:.2f})  {'yes' if same else 'NO':>8}  "
                f"{r['calibration_s']:.0f} s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
