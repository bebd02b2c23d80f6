"""This engine against z-lab's reference MLX implementation, on the same weights, in one run.

    pip install --no-deps dflash==0.1.0     # the reference: module dflash.model_mlx
    python benchmarks/vs_reference.py [--demo | --model DIR --draft DIR]
                                      [--tokens 128 --prompts 6 --repeats 3 --block N]
                                      [--blas both|stock|openblas]

Loads the pair twice (the reference wraps the target's layers in place, so each engine gets
its own target instance), then alternates, after a warm-up and in a rotating order per
prompt and repeat, between:
  * mlx-lm     - plain greedy decoding (`mlx_lm.generate.generate_step`), the baseline;
  * reference  - `dflash.model_mlx.stream_generate` at the draft's block size (its default);
  * W=<block>  - `dflash_mlx.generate` at the same fixed verify width;
  * W=auto     - `dflash_mlx.generate` with its default, automatic width.
Every output is checked token for token against the baseline's (greedy: all must be
identical), and tok/s (tokens after the first over their time), tau and the geometric mean
of the paired ratios are printed. With `--blas both` (the default where Debian's OpenBLAS is
installed) the whole comparison runs twice, in fresh processes: MLX's stock CPU BLAS, then
OpenBLAS preloaded, each with a fresh calibration folder. Ratios, not absolute numbers, are
what carry over, and only within one run.
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

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", action="store_true", help="the shipped demo pair (default)")
    ap.add_argument("--model", help="target folder")
    ap.add_argument("--draft", help="draft folder (z-lab checkpoint format)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=6, help="how many prompts")
    ap.add_argument(
        "--source",
        choices=["stdlib", "code"],
        default="stdlib",
        help="prompts: stretches of Python standard library files (the demo pair's domain), "
        "or the bench's code suite",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block", type=int, default=None, help="fixed width (default: the block)")
    ap.add_argument("--blas", choices=["both", "stock", "openblas"], default="both")
    args = ap.parse_args()
    if args.blas == "both":
        regimes = ["stock"] + (["openblas"] if OPENBLAS.exists() else [])
        for regime in regimes:
            argv = [a for a in sys.argv[1:]]
            if "--blas" in argv:
                i = argv.index("--blas")
                del argv[i : i + 2]
            code = subprocess.call([sys.executable, __file__, *argv, "--blas", regime])
            if code:
                sys.exit(code)
        return
    if args.blas == "openblas" and "LD_PRELOAD" not in os.environ:
        if not OPENBLAS.exists():
            sys.exit(f"{OPENBLAS} not found (apt-get install libopenblas0-pthread)")
        env = {**os.environ, "LD_PRELOAD": str(OPENBLAS)}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    os.environ["DFLASH_MLX_CACHE"] = tempfile.mkdtemp(prefix="dflash-calibration-")
    run(args)


def reference_draft(path: Path):
    """z-lab's draft model from a local folder (its loader only knows hub ids)."""
    import dflash.model_mlx as ref

    real = ref.snapshot_download
    ref.snapshot_download = lambda repo_id, **kw: str(repo_id)
    try:
        return ref.load_draft(str(path))
    finally:
        ref.snapshot_download = real


def stdlib_prompts(count: int, lines: int = 24) -> list[str]:
    """`count` stretches of `lines` lines from the middle of Python standard library files."""
    import os as _os

    root = Path(_os.__file__).parent
    names = [
        "textwrap",
        "shlex",
        "fractions",
        "calendar",
        "difflib",
        "ipaddress",
        "gettext",
        "pprint",
        "statistics",
        "string",
        "heapq",
        "bisect",
    ]
    out = []
    for name in names[:count]:
        text = (root / f"{name}.py").read_text().splitlines()
        mid = len(text) // 2
        out.append("\n".join(text[mid : mid + lines]) + "\n")
    return out


def run(args) -> None:
    import dflash.model_mlx as ref
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    from dflash_mlx import GenerateOptions, generate, load_pair
    from dflash_mlx.bench.prompts import load_suite
    from dflash_mlx.engine.text import encode_prompt
    from dflash_mlx.models.loading import cpu_float32

    if args.model or args.draft:
        if not (args.model and args.draft):
            sys.exit("--model and --draft go together")
        target_dir, draft_dir = Path(args.model), Path(args.draft)
    else:
        from dflash_mlx.demo import demo_pair

        target_dir, draft_dir = demo_pair()
    pair, tok = load_pair(str(target_dir), str(draft_dir))  # one pair for all its runs
    model, draft = pair.model, pair.draft
    ref_model, _ = mlx_lm.load(str(target_dir))  # its own instance: the reference patches it
    ref_draft = reference_draft(draft_dir)
    # The same compute dtype as this engine's (float32 for half weights on a CPU).
    cpu_float32(ref_model)
    cpu_float32(ref_draft)
    block = args.block or draft.config.block_size
    if args.source == "code":
        texts = [p.text or p.summary for p in load_suite("code")[: args.prompts]]
    else:
        texts = stdlib_prompts(args.prompts)
    prompts = [encode_prompt(tok, t) for t in texts]
    eos = set(getattr(tok, "eos_token_ids", None) or ())
    n = args.tokens

    def plain(ids):
        toks, first = [], None
        for t, _ in generate_step(mx.array(ids), model, max_tokens=n):
            toks.append(int(t))
            if first is None:
                first = time.perf_counter()
            if toks[-1] in eos:
                break
        return toks, time.perf_counter() - first, 1.0

    def reference(ids):
        toks, first, cycles = [], None, 0
        for r in ref.stream_generate(
            ref_model, ref_draft, tok, ids, block_size=block, max_tokens=n
        ):
            if first is None:
                first = time.perf_counter()
            elif r.tokens:
                cycles += 1
            toks.extend(r.tokens)
        end = time.perf_counter()
        return toks, end - first, (len(toks) - 1) / max(cycles, 1)

    def ours(width):
        options = GenerateOptions(max_tokens=n, verify_width=width)

        def go(ids):
            r = generate(pair, tok, ids, options)
            return r.tokens, r.stats.decode_seconds, r.stats.tau

        return go

    runs = {
        "mlx-lm": plain,
        "reference": reference,
        f"W={block}": ours(block),
        "W=auto": ours(None),
    }
    names = list(runs)
    regime = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "stock"
    print(
        f"\n== {regime} BLAS · mlx {mx.__version__} · block {block} · {n} tokens · "
        f"{len(prompts)} prompts x {args.repeats} repeats (after a warm-up) =="
    )
    for name in names:  # warm-up: compile, calibrate, fill caches
        runs[name](prompts[0])
    tps = {name: [] for name in names}
    taus = {name: [] for name in names}
    mismatches = 0
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            shift = (rep * len(prompts) + i) % len(names)
            out = {}
            for name in names[shift:] + names[:shift]:
                toks, seconds, tau = runs[name](ids)
                out[name] = toks
                tps[name].append((len(toks) - 1) / seconds if seconds > 0 else 0.0)
                taus[name].append(tau)
            for name in names[1:]:
                if out[name] != out["mlx-lm"]:
                    mismatches += 1
                    print(f"  MISMATCH {name} prompt {i} repeat {rep}")

    def ratio(a, b):  # geometric mean of paired ratios
        logs = [math.log(x / y) for x, y in zip(tps[a], tps[b]) if x > 0 and y > 0]
        return math.exp(statistics.fmean(logs)) if logs else float("nan")

    print(f"{'run':<10} {'tok/s':>8} {'tau':>6} {'vs mlx-lm':>10} {'vs reference':>13}")
    for name in names:
        print(
            f"{name:<10} {statistics.median(tps[name]):8.1f} {statistics.mean(taus[name]):6.2f} "
            f"{ratio(name, 'mlx-lm'):9.2f}x {ratio(name, 'reference'):12.2f}x"
        )
    runs_checked = (len(names) - 1) * len(prompts) * args.repeats
    verdict = "token-identical" if not mismatches else f"{mismatches} MISMATCHES"
    print(f"outputs: {verdict} ({runs_checked} DFlash runs against mlx-lm greedy)")
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
