"""The pass after a request's first token launched at admission, against launched by the
first decode cycle (the engine before 2026-12-05), in one process, alternated between
mlx-lm runs (the baseline the geometric mean of the two around each pair).

    python benchmarks/first_pass.py [--tokens 64] [--repeats 4] [--width 1]

Prints tokens after the first per second against mlx-lm's `generate_step` for both, their
ratio, median TTFTs, and each request's whole time (TTFT and the rest) with against
without. Run it pinned (`taskset -c 0`) on an idle machine, once per regime (the stock
wheel; `LD_PRELOAD` Debian's OpenBLAS with `OPENBLAS_NUM_THREADS=1`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from draft_window import prompts_at  # noqa: E402
from never_slower import interval  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--width", default="1", help="verify width, or auto")
    args = ap.parse_args()
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from dflash_mlx import GenerateOptions, generate, load_pair
    from dflash_mlx.demo import SHIPPED, demo_pair
    from dflash_mlx.engine import plain

    n = args.tokens
    width = None if args.width == "auto" else int(args.width)
    launch = plain.launch_first
    pair, tok = load_pair(*demo_pair())
    pair.costs()
    files = json.loads((SHIPPED / "BUILD.json").read_text())["target"]["held_out_files"]
    prompts = prompts_at(tok, files, 128)
    ttft: dict[str, list[float]] = {"mlx-lm": [], "with": [], "without": []}
    whole: dict[str, list[float]] = {"with": [], "without": []}

    def mlx_lm(ids) -> float:
        tic, first = time.perf_counter(), 0.0
        for i, _ in enumerate(generate_step(mx.array(ids), pair.model, max_tokens=n)):
            if i == 0:
                first = time.perf_counter()
        ttft["mlx-lm"].append(first - tic)
        return (n - 1) / (time.perf_counter() - first)

    def ours(name: str, ids) -> float:
        plain.launch_first = launch if name == "with" else lambda dec, row: None
        try:
            out = generate(pair, tok, ids, GenerateOptions(max_tokens=n, verify_width=width))
        finally:
            plain.launch_first = launch
        s = out.stats
        ttft[name].append(s.time_to_first_token)
        whole[name].append(s.time_to_first_token + (n - 1) / s.generation_tps)
        return s.generation_tps

    for ids in prompts[:2]:  # warm-up
        mlx_lm(ids), ours("with", ids), ours("without", ids)
    for v in (*ttft.values(), *whole.values()):
        v.clear()
    logs: dict[str, list[float]] = {"with": [], "without": []}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            before = mlx_lm(ids)
            order = ["with", "without"] if (i + rep) % 2 == 0 else ["without", "with"]
            got = {m: ours(m, ids) for m in order}
            base = math.sqrt(before * mlx_lm(ids))
            for m in logs:
                logs[m].append(math.log(got[m] / base))
    for m, v in logs.items():
        print(f"{m} / mlx-lm: {interval(v)}")
    print(f"with / without: {interval([a - b for a, b in zip(logs['with'], logs['without'])])}")
    med = {k: statistics.median(v) * 1e3 for k, v in ttft.items()}
    print("TTFT median: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()))
    ratios = [math.log(a / b) for a, b in zip(whole["with"], whole["without"])]
    print(f"whole request, time with / without: {interval(ratios)}")


if __name__ == "__main__":
    main()
