"""Time to first token with the draft dormant or active, against plain mlx-lm's.

    python benchmarks/dormant_ttft.py [--contexts 128,1k,3k] [--repeats 3] [--openblas]

On the shipped demo pair, each prompt is a stretch of a held-out standard-library file
(as in `draft_window.py`). For every prompt the script alternates, after a warm-up,
between mlx-lm's `generate_step` (the baseline) and the engine's decode loop with a width
chooser built from this machine's calibrated costs that either expects to decode plainly
(acceptance prior 0: the draft is *dormant* at the prompt, as when speculation does not
pay) or to speculate (prior 0.95: *active*), and the engine with no draft (*plain*). It
prints, per context, the time to the first token of each and their ratios (geometric
means paired by prompt and repeat, with 95% intervals), and checks that the first tokens
agree. The engine prefills in chunks of 512 tokens, mlx-lm in chunks of 2048: at 1k
tokens and more that alone moves TTFT, which is why `dormant / plain` is shown too.

When dormant, prefill should cost what the target alone costs (issue 15: within 3%);
when active, the draft's context (the prompt's last `draft_window - 1` positions, 255 on
the demo pair) is built during prefill, all but what the prompt's last chunk holds: that
part is left to the first cycle, after the first token (issue 36), so that at prompts of
one chunk the active column should show the target's own time too.
The stock wheel is used unless `--openblas` (Debian's OpenBLAS preloaded).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from draft_window import OPENBLAS, counts, prompts_at  # noqa: E402


def ratio(xs: list[float], ys: list[float]) -> str:
    logs = [math.log(x / y) for x, y in zip(xs, ys)]
    m = statistics.fmean(logs)
    h = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return f"{math.exp(m):.3f} ({math.exp(m - h):.2f}-{math.exp(m + h):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,1k,3k")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--files", type=int, default=8, help="held-out files (one prompt each)")
    ap.add_argument("--openblas", action="store_true", help="preload Debian's OpenBLAS")
    args = ap.parse_args()
    if args.openblas and "LD_PRELOAD" not in os.environ:
        if not OPENBLAS.exists():
            sys.exit(f"--openblas: {OPENBLAS} is missing (apt-get install libopenblas0-pthread)")
        env = {**os.environ, "LD_PRELOAD": str(OPENBLAS)}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    run(args)


def run(args) -> None:
    import json

    os.environ.setdefault("DFLASH_MLX_CACHE", tempfile.mkdtemp(prefix="dflash-ttft-"))
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from dflash_mlx import GenerateOptions, load_pair
    from dflash_mlx.demo import SHIPPED, demo_pair
    from dflash_mlx.engine.batch import speculative_decode
    from dflash_mlx.speed.adaptive import WidthChooser

    target_dir, draft_dir = demo_pair()
    pair, tok = load_pair(target_dir, draft_dir)
    model = pair.model
    curves = pair.costs()
    block = pair.draft.config.block_size
    files = json.loads((SHIPPED / "BUILD.json").read_text())["target"]["held_out_files"]
    blas = "OpenBLAS" if "openblas" in os.environ.get("LD_PRELOAD", "") else "stock BLAS"
    print(f"demo pair, {blas}, MLX {mx.__version__} {mx.default_device()}, {args.repeats} repeats")

    def mlx_lm_first(ids: list[int]) -> tuple[float, int]:
        tic = time.perf_counter()
        for t, _ in generate_step(mx.array(ids), model, max_tokens=2, sampler=None):
            return time.perf_counter() - tic, int(t)

    def engine_first(ids: list[int], prior: float | None) -> tuple[float, int, bool]:
        """The engine's first token: with a chooser built for `prior`, or plain (None)."""
        chooser = None if prior is None else WidthChooser(curves, block, prior=prior)
        dormant = chooser is None or chooser.expects_plain(len(ids))
        tic = time.perf_counter()
        for cycle in speculative_decode(
            pair,
            ids,
            GenerateOptions(max_tokens=2),
            width=1 if chooser is None else block,
            draft_block=1 if chooser is None else block,
            chooser=chooser,
            speculate=chooser is not None,
        ):
            return time.perf_counter() - tic, cycle.tokens[0], dormant

    warm = prompts_at(tok, files[:1], 128)[0]
    for _ in range(2):
        mlx_lm_first(warm), engine_first(warm, None)
        engine_first(warm, 0.0), engine_first(warm, 0.95)
    print(
        "context  mlx-lm ms  plain ms  dormant ms  active ms  "
        "dormant / mlx-lm     dormant / plain      active / mlx-lm"
    )
    for n in counts(args.contexts):
        prompts = prompts_at(tok, files[: args.files], n)
        base, plain, dormant, active = [], [], [], []
        for _ in range(args.repeats):
            for ids in prompts:
                t0, ref = mlx_lm_first(ids)
                tp, tokp, _ = engine_first(ids, None)
                t1, tok1, was_dormant = engine_first(ids, 0.0)
                t2, tok2, was_dormant2 = engine_first(ids, 0.95)
                if not (was_dormant and not was_dormant2):
                    sys.exit(f"context {n}: the choosers did not expect what they were built for")
                if not ref == tokp == tok1 == tok2:
                    sys.exit(f"context {n}: first tokens differ ({ref}, {tokp}, {tok1}, {tok2})")
                base.append(t0), plain.append(tp), dormant.append(t1), active.append(t2)
        ms = lambda xs: 1000 * math.exp(statistics.fmean(math.log(x) for x in xs))  # noqa: E731
        print(
            f"{n:>7} {ms(base):10.1f} {ms(plain):9.1f} {ms(dormant):11.1f} {ms(active):10.1f}  "
            f"{ratio(dormant, base):<20} {ratio(dormant, plain):<20} {ratio(active, base)}"
        )
    print("every first token equals mlx-lm's")


if __name__ == "__main__":
    main()
