"""The automatic width against plain decoding at every prompt length, on two pairs.

    python benchmarks/never_slower.py [--contexts 128,1k,3k] [--replies 64,256]
                                      [--widths 4,8,16] [--files 3] [--repeats 2]
                                      [--regime both|stock|openblas] [--pairs demo,nowindow]

Two pairs, the same weights: the shipped demo pair, whose draft declares the window it was
trained with (`sliding_window: 256`), and the same pair with that declaration removed from
the draft's config (`nowindow`: its blocks see the whole context, as most published drafts
do; built in a temporary folder). Each prompt is a stretch of a held-out standard-library
file (the last N tokens before a line start near its middle). For every prompt, reply
length and repeat the script alternates, after a warm-up, between:
  * mlx-lm   - mlx-lm's own greedy decoding (`generate_step`), the baseline;
  * mlx-lm text - mlx-lm's `stream_generate` (what `mlx_lm.generate` runs: the same steps,
               detokenized as they come, as the engine's replies are); forced plain is
               also given against it, like for like;
  * plain    - the engine with `verify_width=1` (forced plain decoding);
  * W=k      - the engine at each fixed verify width k;
  * auto     - the engine's default (`verify_width=None`), with the width chooser carried
               from request to request, as a server or a chat session carries it;
  * before   - with `--before REV`: the automatic width of an earlier git revision, its
               package imported beside this one, on models of its own (paired in the run).
Every output is checked against mlx-lm's tokens. It prints decode speed (tokens after the
first, per second) as ratios to mlx-lm, geometric means paired by prompt and repeat with
95% intervals, the time to first token of auto against mlx-lm, auto against the best fixed
width, τ and probes per request of auto.

Both regimes by default, each in its own process with a fresh calibration folder: MLX's
stock wheel (a W-token verify costs about W plain steps) and Debian's OpenBLAS preloaded
(`apt-get install libopenblas0-pthread`: wide verifies cheap, as on a Mac's memory-bound
GPU). Ratios, not absolute numbers, carry over, and only within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from draft_window import OPENBLAS, counts, prompts_at  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,1k,3k")
    ap.add_argument("--replies", default="64,256")
    ap.add_argument("--widths", default="4,8,16")
    ap.add_argument(
        "--fixed-contexts", default="128", help="the prompt lengths the fixed widths run at"
    )
    ap.add_argument("--files", type=int, default=3, help="held-out files (one prompt each)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pairs", default="demo,nowindow")
    ap.add_argument("--regime", choices=["both", "stock", "openblas"], default="both")
    ap.add_argument("--verbose", action="store_true", help="what ran in each auto request")
    ap.add_argument(
        "--before",
        metavar="REV",
        help="also run an earlier revision's automatic width (git REV), in this process",
    )
    args = ap.parse_args()
    if args.regime == "both":
        for regime in ("stock", "openblas"):
            argv, rest = [], iter(sys.argv[1:])
            for a in rest:  # every argument but the regime (`--regime X` or `--regime=X`)
                if a == "--regime":
                    next(rest, None)
                elif not a.startswith("--regime="):
                    argv.append(a)
            code = subprocess.call([sys.executable, __file__, *argv, "--regime", regime])
            if code:
                sys.exit(code)
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if args.regime == "openblas" and "openblas" not in preload:
        if not OPENBLAS.exists():
            sys.exit(f"{OPENBLAS} is missing (apt-get install libopenblas0-pthread)")
        env = {**os.environ, "LD_PRELOAD": str(OPENBLAS)}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    if args.regime == "stock" and preload:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    os.environ["DFLASH_MLX_CACHE"] = tempfile.mkdtemp(prefix=f"dflash-never-{args.regime}-")
    run(args)


def nowindow_pair(target_dir: Path, draft_dir: Path) -> tuple[Path, Path]:
    """The demo draft with its declared window removed (same weights), in a temporary folder."""
    out = Path(tempfile.mkdtemp(prefix="dflash-nowindow-"))
    shutil.copytree(draft_dir, out / "draft")
    cfg = json.loads((out / "draft" / "config.json").read_text())
    cfg.pop("sliding_window", None)
    cfg["layer_types"] = ["full_attention"] * len(cfg.get("layer_types", []))
    (out / "draft" / "config.json").write_text(json.dumps(cfg, indent=1))
    return target_dir, out / "draft"


def earlier_package(rev: str):
    """The `dflash_mlx` package of git revision `rev`, importable beside this one (its
    imports are relative) as `dflash_mlx_before`."""
    import importlib

    root = Path(__file__).resolve().parent.parent
    out = Path(tempfile.mkdtemp(prefix="dflash-before-"))
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, "dflash_mlx"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    (out / "dflash_mlx").rename(out / "dflash_mlx_before")
    sys.path.insert(0, str(out))
    return importlib.import_module("dflash_mlx_before")


def paired(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Geometric mean of x/y and its 95% interval."""
    return from_logs([math.log(x / y) for x, y in zip(xs, ys)])


def from_logs(logs: list[float]) -> tuple[float, float, float]:
    """The geometric mean of ratios given as logs, and its 95% interval."""
    m = statistics.fmean(logs)
    h = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(m), math.exp(m - h), math.exp(m + h)


def interval(logs: list[float]) -> str:
    """`from_logs` as text: mean (low-high), n."""
    m, lo, hi = from_logs(logs)
    return f"{m:.3f} ({lo:.3f}-{hi:.3f}), n={len(logs)}"


def fmt(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f} [{r[1]:.2f}-{r[2]:.2f}]"


def run(args) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.generate import stream_generate as mlx_lm_stream

    from dflash_mlx import load_pair, stream_generate
    from dflash_mlx.demo import SHIPPED, demo_pair

    before = earlier_package(args.before) if args.before else None
    target_dir, draft_dir = demo_pair()
    files = json.loads((SHIPPED / "BUILD.json").read_text())["target"]["held_out_files"]
    widths = [int(w) for w in args.widths.split(",") if w]
    replies = [int(n) for n in args.replies.split(",")]
    blas = "OpenBLAS preloaded" if args.regime == "openblas" else "stock wheel"
    print(
        f"# {blas}; MLX {mx.__version__} {mx.default_device()}; {args.files} prompts x "
        f"{args.repeats} repeats; decode tok/s (after the first token) / mlx-lm's",
        flush=True,
    )
    for name in args.pairs.split(","):
        dirs = (target_dir, draft_dir) if name == "demo" else nowindow_pair(target_dir, draft_dir)
        pair, tok = load_pair(*dirs)
        tic = time.perf_counter()
        pair.costs()
        old = None
        if before is not None:
            # Its own models (the adapters patch layer instances) and calibration file.
            cache = os.environ["DFLASH_MLX_CACHE"]
            os.environ["DFLASH_MLX_CACHE"] = tempfile.mkdtemp(prefix="dflash-before-cal-")
            old = before.load_pair(*dirs)
            old[0].costs()
            os.environ["DFLASH_MLX_CACHE"] = cache
        window = pair.draft.windows()[0]
        print(
            f"\n## pair {name} (draft window: {window or 'none'}); calibrated in "
            f"{time.perf_counter() - tic:.0f} s",
            flush=True,
        )

        def mlx_lm(ids: list[int], n: int, model=pair.model) -> tuple[float, float, list[int]]:
            out, tic, first = [], time.perf_counter(), 0.0
            for t, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=None):
                if not out:
                    first = time.perf_counter()
                out.append(int(t))
            return (n - 1) / (time.perf_counter() - first), first - tic, out

        def mlx_text(ids: list[int], n: int, model=pair.model, tok=tok) -> float:
            k, first = 0, 0.0
            for _ in mlx_lm_stream(model, tok, mx.array(ids), max_tokens=n):
                if not k:
                    first = time.perf_counter()
                k += 1
            return (k - 1) / (time.perf_counter() - first)

        def engine(ids: list[int], n: int, width, pair=pair, tok=tok, old=old):
            out, gen = [], stream_generate
            if width == "before":
                (pair, tok), gen, width = old, before.stream_generate, None
            for r in gen(pair, tok, ids, max_tokens=n, verify_width=width):
                out += r.tokens
            s = r.stats
            return s.generation_tps, s.time_to_first_token, out, s

        every = ["plain", *(f"W={w}" for w in widths), *(["before"] if old else []), "auto"]
        methods = every
        width_of = {"plain": 1, "auto": None, "before": "before"} | {f"W={w}": w for w in widths}
        warm = prompts_at(tok, files[:1], 128)[0]
        for _ in range(2):
            mlx_lm(warm, 32)
            for m in methods:
                engine(warm, 32, width_of[m])
        head = (
            f"{'prompt':>6} {'reply':>5}  {'auto / mlx-lm':<18} {'plain / mlx-lm':<18} "
            + " ".join(f"{m + ' / mlx-lm':<18}" for m in methods[1:-1])
            + f" {'plain / mlx-lm text':<20}"
            + f" {'auto / best W':<18} {'TTFT auto / mlx-lm':<19} {'tau':>5} probes"
            + (" auto / before" if old else "")
        )
        print(head, flush=True)
        with_fixed = set(counts(args.fixed_contexts))
        for n_ctx in counts(args.contexts):
            prompts = prompts_at(tok, files[: args.files], n_ctx)
            for n in replies:
                run_fixed = n_ctx in with_fixed
                methods = [m for m in every if run_fixed or not m.startswith("W=")]
                speed = {m: [] for m in ["mlx-lm", "mlx-lm text", *every]}
                ttft_auto, ttft_base, taus, probes = [], [], [], []
                for rep in range(args.repeats):
                    for i, ids in enumerate(prompts):
                        k = (i + rep) % len(methods)
                        order = methods[k:] + methods[:k]
                        tps, ttft, ref = mlx_lm(ids, n)
                        speed["mlx-lm"].append(tps)
                        ttft_base.append(ttft)
                        speed["mlx-lm text"].append(mlx_text(ids, n))
                        for m in order:
                            tps, ttft, out, s = engine(ids, n, width_of[m])
                            if out != ref:
                                sys.exit(f"{name} {n_ctx}/{n} {m}: output differs from mlx-lm's")
                            speed[m].append(tps)
                            if m == "auto":
                                if args.verbose:
                                    print(
                                        f"    auto {tps / speed['mlx-lm'][-1]:.2f}x",
                                        s.tau,
                                        s.what_ran(),
                                        flush=True,
                                    )
                                ttft_auto.append(ttft)
                                taus.append(s.tau)
                                probes.append(s.probes)
                base = speed["mlx-lm"]
                fixed = [m for m in methods if m.startswith("W=")]
                best = [max(speed[m][k] for m in fixed) for k in range(len(base))] if fixed else []
                cells = [fmt(paired(speed[m], base)) if speed[m] else "-" for m in every]
                extra = f" {fmt(paired(speed['auto'], speed['before'])):<18}" if old else ""
                print(
                    f"{n_ctx:>6} {n:>5}  {cells[-1]:<18} "
                    + " ".join(f"{c:<18}" for c in cells[:-1])
                    + f" {fmt(paired(speed['plain'], speed['mlx-lm text'])):<20}"
                    + f" {fmt(paired(speed['auto'], best)) if best else '-':<18} "
                    f"{fmt(paired(ttft_auto, ttft_base)):<19} {statistics.fmean(taus):5.2f} "
                    f"{statistics.fmean(probes):6.1f}{extra}",
                    flush=True,
                )
    print("\nevery output equals mlx-lm's greedy tokens")


if __name__ == "__main__":
    main()
