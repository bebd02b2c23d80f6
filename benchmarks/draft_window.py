"""τ, speed and time to first token against the draft window, on long prompts.

    python benchmarks/draft_window.py [--contexts 512,1k,3k] [--windows none,64,256,1024]
                                      [--width 16] [--tokens 128] [--repeats 2] [--stock-blas]

On the shipped demo pair, each prompt is a stretch of real code: the last N tokens before a
line start in one of the pair's held-out standard-library files (never trained on), for
each context length N. For every prompt the script alternates, after a warm-up, between
the target alone (the engine's plain decoding) and DFlash at the fixed verify width
`--width` under each draft window (`none`: unlimited, the default for this draft), checks
every output against the target's tokens, and prints per context and window: τ, decode
tok/s, speedup over plain, TTFT, and the ratios to the unlimited window (geometric means
over prompts and repeats, paired by prompt).

Where Debian's OpenBLAS is installed (`apt-get install libopenblas0-pthread`) the script
re-runs itself with it preloaded (wide verifies cheap, as on a Mac); `--stock-blas` keeps
MLX's reference BLAS. Ratios, not absolute numbers, carry over, and only within one run.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")


def counts(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,1k,3k")
    ap.add_argument("--windows", default="none,64,256,1024")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--files", type=int, default=8, help="held-out files (one prompt each)")
    ap.add_argument("--stock-blas", action="store_true", help="do not preload OpenBLAS")
    args = ap.parse_args()
    if not args.stock_blas and OPENBLAS.exists() and "LD_PRELOAD" not in os.environ:
        env = {**os.environ, "LD_PRELOAD": str(OPENBLAS)}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    run(args)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def prompts_at(tok, files: list[str], n: int) -> list[list[int]]:
    """For each held-out file: its last `n` tokens before a line start near its middle."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in files:
        path = stdlib / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = tok.encode(text)
        if len(ids) < n + 16:
            ids = (ids * (-(-(n + 16) // len(ids))))[: n + 16]  # short files repeat
        end = max(n, len(ids) // 2)
        out.append(ids[end - n : end])
    return out


def run(args) -> None:
    import json
    import tempfile
    import time

    os.environ.setdefault("DFLASH_MLX_CACHE", tempfile.mkdtemp(prefix="dflash-window-"))
    import mlx.core as mx

    from dflash_mlx import GenerateOptions, Pair, generate, load_pair
    from dflash_mlx.demo import SHIPPED, demo_pair

    target_dir, draft_dir = demo_pair()
    pair, tok = load_pair(target_dir, draft_dir)
    alone = Pair(pair.model)  # the target without its draft: plain decoding
    files = json.loads((SHIPPED / "BUILD.json").read_text())["target"]["held_out_files"]
    windows = [None if w.strip() == "none" else int(w) for w in args.windows.split(",")]
    limit = pair.context_limit
    blas = "OpenBLAS" if "openblas" in os.environ.get("LD_PRELOAD", "") else "stock BLAS"
    print(
        f"demo pair, {blas}, MLX {mx.__version__} {mx.default_device()}, W={args.width}, "
        f"{args.tokens} tokens, {args.repeats} repeats"
    )
    print("context  window        τ   tok/s  vs plain   TTFT ms   τ/unl.  speed/unl.  TTFT/unl.")
    options = GenerateOptions(max_tokens=args.tokens, verify_width=args.width)
    generate(pair, tok, "def f(x):\n", options.replace(max_tokens=16))  # warm-up
    for n in counts(args.contexts):
        if n + args.tokens >= limit:
            print(f"{n:>7}  skipped: {n} + {args.tokens} tokens exceed the target's {limit}")
            continue
        prompts = prompts_at(tok, files[: args.files], n)
        rows: dict = {w: {"tau": [], "tps": [], "ttft": [], "vs": []} for w in windows}
        plain_rows = {"tps": [], "ttft": []}
        for _ in range(args.repeats):
            for ids in prompts:
                ref = generate(alone, tok, ids, options.replace(verify_width=None))
                plain = ref.stats
                plain_rows["tps"].append(plain.generation_tps)
                plain_rows["ttft"].append(plain.time_to_first_token)
                for w in windows:
                    r = generate(pair, tok, ids, options.replace(draft_window=w))
                    if r.tokens != ref.tokens:
                        sys.exit(f"NOT LOSSLESS at context {n}, window {w}")
                    s = r.stats
                    rows[w]["tau"].append(s.tau)
                    rows[w]["tps"].append(s.generation_tps)
                    rows[w]["ttft"].append(s.time_to_first_token)
                    rows[w]["vs"].append(s.generation_tps / plain.generation_tps)
                time.sleep(0)
        base = rows[windows[0]]
        print(
            f"{n:>7}  plain             {geomean(plain_rows['tps']):7.0f}     1.00x "
            f"{1000 * geomean(plain_rows['ttft']):9.1f}"
        )
        for w in windows:
            r = rows[w]
            ratio = [a / b for a, b in zip(r["tau"], base["tau"])]
            speed = [a / b for a, b in zip(r["tps"], base["tps"])]
            ttft = [a / b for a, b in zip(r["ttft"], base["ttft"])]
            label = "none" if w is None else str(w)
            print(
                f"{n:>7}  {label:>6}  {geomean(r['tau']):7.2f} {geomean(r['tps']):7.0f} "
                f"{geomean(r['vs']):8.2f}x {1000 * geomean(r['ttft']):9.1f} "
                f"{geomean(ratio):8.2f} {geomean(speed):11.2f} {geomean(ttft):10.2f}"
            )
    print("every DFlash run reproduced the target's greedy tokens")


if __name__ == "__main__":
    main()
