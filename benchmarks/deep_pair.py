"""The deep stand-in in real time: the demo pair's target padded with identity layers
(`dflash_mlx.models.deep`), so its 2-layer draft is the small share of a cycle it is in
published pairs, decoded at c concurrent requests by the automatic width, every fixed width
and plain decoding (the engine forced to W = 1), in one process, each cell's methods in both
orders. Prints tokens per second and auto against the best fixed width chosen in hindsight.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/deep_pair.py --layers 24 --concurrency 1,4,8
    python benchmarks/deep_pair.py --out DIR     # only write the padded pair to DIR
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", type=Path, help="write the padded pair here and stop")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--widths", default="2,4,8")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per cell")
    args = ap.parse_args()
    os.environ.setdefault("DFLASH_MLX_CACHE", tempfile.mkdtemp(prefix="dflash-deep-"))
    from dflash_mlx import GenerateOptions, batch_generate, generate, load_pair
    from dflash_mlx.demo import demo_pair
    from dflash_mlx.models.deep import pad_pair

    out = args.out or Path(tempfile.mkdtemp(prefix="dflash-deep-pair-"))
    target, draft = pad_pair(*demo_pair(), out, args.layers)
    print(f"padded pair: {target} {draft}", flush=True)
    if args.out:
        return
    from policy import prompts  # benchmarks/policy.py: held-out prompts at a context length

    pair, tok = load_pair(target, draft)
    tic = time.perf_counter()
    pair.costs()
    print(
        f"calibrated in {time.perf_counter() - tic:.1f} s (blas: LD_PRELOAD="
        f"{os.environ.get('LD_PRELOAD', 'none')})",
        flush=True,
    )
    widths = [int(w) for w in args.widths.split(",")]
    methods = ["plain", *(f"W={w}" for w in widths), "auto"]
    warm = prompts(tok, args.context, 1)
    for m in methods:  # kernels and the auto policy's first look, outside the clock
        generate(pair, tok, warm[0], option(GenerateOptions, m, 16))
    for c in (int(x) for x in args.concurrency.split(",")):
        ids = prompts(tok, args.context, args.prompts)
        speed = {m: [] for m in methods}
        for order in (methods, methods[::-1]):
            for m in order:
                opts = option(GenerateOptions, m, args.tokens)
                tic = time.perf_counter()
                res = batch_generate(pair, tok, ids, opts, max_batch=c)
                speed[m].append(
                    sum(r.stats.generation_tokens for r in res) / (time.perf_counter() - tic)
                )
        geo = {m: math.exp(sum(map(math.log, v)) / len(v)) for m, v in speed.items()}
        best = max((m for m in methods if m.startswith("W=")), key=geo.get)
        top = max(geo[best], geo["plain"])
        cells = " · ".join(f"{m} {geo[m]:.1f}" for m in methods)
        print(
            f"c={c}: {cells} tok/s · best fixed {best} · auto / best {geo['auto'] / top:.2f} · "
            f"auto / plain {geo['auto'] / geo['plain']:.2f}",
            flush=True,
        )


def option(cls, method: str, tokens: int):
    width = None if method == "auto" else 1 if method == "plain" else int(method[2:])
    return cls(max_tokens=tokens, verify_width=width)


if __name__ == "__main__":
    main()
