"""The automatic verify width against every fixed width, where drafting pays and where not.

    python benchmarks/auto_width.py [--hidden 1024 --layers 8 --tokens 96 --repeats 2]
                                    [--accuracy 0,0.5,0.8,0.95] [--widths 1,2,4,8,16]

On a random Qwen3-style target, each draft proposes the target's own greedy continuation
with every block position right with probability `p` (a fixed pseudo-random pattern per
position), while running the real draft network, so its cost is a real draft's and only
its accuracy is set. For each `p` the script alternates, after a warm-up, between plain
mlx-lm greedy decoding, `dflash_mlx.generate` at every fixed width W (draft block L=16,
the engine's default), and W=auto (the engine's default: `verify_width=None`), checks every
output against the target's greedy tokens, and prints tok/s, speedups and the ratio of
auto to the best fixed choice (geometric mean over prompts and repeats, paired).

Where Debian's OpenBLAS is installed (`apt-get install libopenblas0-pthread`) the script
re-runs itself with it preloaded: a wide verify then costs little more than a plain step
(the regime of a Mac's memory-bound decoding), so drafting pays. `--stock-blas` keeps
MLX's reference BLAS, where a W-token verify costs about W plain steps and nothing pays.
Calibration is measured in this run (a fresh cache folder). Ratios, not absolute numbers,
are what carry over, and only within one run.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--accuracy", default="0,0.5,0.8,0.95")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--stock-blas", action="store_true", help="do not preload OpenBLAS")
    ap.add_argument(
        "--stale", action="store_true", help="decode on curves calibrated under stock BLAS"
    )
    ap.add_argument("--calibrate-to", help=argparse.SUPPRESS)  # internal: the stale curves
    ap.add_argument("--curves", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stale and args.curves is None and args.calibrate_to is None:
        out = Path(tempfile.mkdtemp(prefix="dflash-stale-")) / "curves.json"
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        cmd = [sys.executable, *sys.argv, "--stock-blas", "--calibrate-to", str(out)]
        if subprocess.call(cmd, env=env):
            sys.exit("stale calibration failed")
        sys.exit(subprocess.call([sys.executable, *sys.argv, "--curves", str(out)]))
    if not args.stock_blas and OPENBLAS.exists() and "LD_PRELOAD" not in os.environ:
        env = {**os.environ, "LD_PRELOAD": str(OPENBLAS)}
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
    os.environ["DFLASH_MLX_CACHE"] = tempfile.mkdtemp(prefix="dflash-calibration-")
    run(args)


def run(args) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from dflash_mlx import GenerateOptions, Pair, generate, load, load_draft
    from dflash_mlx.models.draft import DFlashDraft
    from dflash_mlx.models.tiny import (
        build_draft,
        build_target,
        draft_config,
        qwen3_config,
        write_tokenizer,
    )

    class OracleDraft(DFlashDraft):
        """The target's greedy continuation, each block position right with probability p."""

        def __init__(self, base: DFlashDraft, p: float):
            super().__init__(base.config)
            self.update(base.parameters())
            self.p = p
            self.script: list[int] = []

        def block_logits(self, anchor, length, rows, state):
            rows = length - 1 if rows is None else rows
            pos = state.context_end  # the anchor's position
            vocab = self.config.vocab_size
            want = []
            for i in range(1, rows + 1):
                t = self.script[pos + i] if pos + i < len(self.script) else 0
                if random.Random(pos * 131 + i).random() >= self.p:
                    t = (t + 1) % vocab
                want.append(t)
            want = mx.array(want)
            # The real draft pass, so the cost is a draft's; its output is then ignored.
            h = self.hidden(mx.concatenate([anchor.reshape(1), want])[None], state)
            real = self.logits(h[0, 1 : rows + 1], state.head).astype(mx.float32)
            return mx.eye(vocab)[want] * 30.0 + 0.0 * real

    def plain(model, ids, n):
        steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda x: x.argmax(-1))
        first = next(steps)
        tic = time.perf_counter()
        toks = [int(first[0])] + [int(t) for t, _ in steps]
        return toks, (len(toks) - 1) / (time.perf_counter() - tic)

    root = Path(tempfile.mkdtemp(prefix="dflash-auto-width-"))
    (root / "target").mkdir()
    write_tokenizer(root / "target")
    build_target(root / "target", qwen3_config(args.vocab, args.layers, args.hidden), seed=1)
    layer_ids = sorted({1, args.layers // 2})
    build_draft(root / "draft", draft_config(args.layers, layer_ids, hidden=args.hidden), seed=2)
    model, tok = load(root / "target")
    base = load_draft(root / "draft")
    prompts = [tok.encode(t) for t in ("def fibonacci(n):\n    ", "import os\nimport sys\n", "The")]
    refs = [plain(model, ids, args.tokens)[0] for ids in prompts]
    accuracies = [float(p) for p in args.accuracy.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    # One pair per draft, made once: its width choosers learn across its requests.
    pairs = {p: Pair(model, OracleDraft(base, p)) for p in accuracies}
    calibrated = Pair(model, base)

    if args.calibrate_to:
        from dflash_mlx.calibration import cache_path

        calibrated.costs()  # measured under stock BLAS, into this process's cache
        Path(args.calibrate_to).write_text(cache_path(calibrated).read_text())
        return
    if args.curves:
        import json

        from dflash_mlx.calibration import cache_path, calibration_key

        # The stock-BLAS curves planted in this run's calibration cache under this run's own
        # key: what the pairs read as their calibration, stale, until the product's own
        # check (measured plain steps far off the curves) re-calibrates.
        data = json.loads(Path(args.curves).read_text())
        data["key"] = calibration_key(calibrated)
        path = cache_path(calibrated)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
        print("decoding on a STALE calibration (measured under stock BLAS, planted in the cache)")
    tic = time.perf_counter()
    curves = calibrated.costs()  # the stale curves with --stale
    print(
        f"calibrated in {time.perf_counter() - tic:.1f} s: plain step "
        f"{curves.verify[0] * 1e3:.1f} ms, W=16 verify {curves.verify[15] * 1e3:.1f} ms "
        f"({curves.verify[15] / curves.verify[0]:.2f}x), 16-row draft "
        f"{curves.draft[15] * 1e3:.1f} ms",
        flush=True,
    )
    names = ["plain"] + [f"W={w}" for w in widths] + ["auto"]
    tps: dict[tuple[float, str], list[float]] = {}  # (p, run) -> per prompt and repeat
    taus: dict[tuple[float, str], list[float]] = {}
    for rep in range(args.repeats + 1):  # repeat 0 is the warm-up (the chooser learns too)
        for k, (ids, ref) in enumerate(zip(prompts, refs)):
            for p in accuracies:
                pair = pairs[p]
                pair.draft.script = ids + ref + [0] * 32
                order = names[(rep + k) % len(names) :] + names[: (rep + k) % len(names)]
                for name in order:
                    if name == "plain":
                        toks, speed, tau = *plain(model, ids, args.tokens), 1.0
                    else:
                        w = None if name == "auto" else int(name[2:])
                        options = GenerateOptions(max_tokens=args.tokens, verify_width=w)
                        out = generate(pair, tok, ids, options)
                        toks, speed, tau = out.tokens, out.stats.generation_tps, out.stats.tau
                    assert toks == ref, f"p={p} {name}: output differs from the target's greedy"
                    if rep:
                        tps.setdefault((p, name), []).append(speed)
                        taus.setdefault((p, name), []).append(tau)
            print(f"repeat {rep}/{args.repeats} prompt {k + 1}/{len(prompts)} done", flush=True)

    print(
        f"\ntarget: random qwen3 hidden={args.hidden} layers={args.layers} vocab={args.vocab}; "
        f"draft: 2 layers, block 16, reading layers {layer_ids}; {args.tokens} tokens; "
        f"{len(prompts)} prompts x {args.repeats} repeats after a warm-up; "
        f"{'OpenBLAS' if 'LD_PRELOAD' in os.environ else 'stock BLAS'}; {mx.default_device()}"
    )
    print("speedup = median tok/s over plain mlx-lm's; tau = mean tokens per verify")
    head = f"{'p':>5} {'plain tok/s':>11}"
    for name in names[1:]:
        head += f" {name:>12}"
    print(head + f" {'best fixed':>11} {'auto/best':>16}")
    for p in accuracies:
        base_tps = statistics.median(tps[(p, "plain")])
        line = f"{p:>5.2f} {base_tps:>11.1f}"
        for name in names[1:]:
            speed = statistics.median(tps[(p, name)]) / base_tps
            line += f" {speed:>6.2f}x/{statistics.mean(taus[(p, name)]):<4.1f}"
        fixed = names[:-1]
        best = max(fixed, key=lambda n: statistics.median(tps[(p, n)]))
        logs = [math.log(a / b) for a, b in zip(tps[(p, "auto")], tps[(p, best)])]
        ratio = math.exp(statistics.fmean(logs))
        lo, hi = min(logs), max(logs)
        line += f" {best:>11} {ratio:>6.2f}x [{math.exp(lo):.2f}-{math.exp(hi):.2f}]"
        print(line)
    print("every run produced the target's greedy tokens exactly")
    if args.curves:
        again = [p for p, pair in pairs.items() if pair.recalibrated] + (
            ["calibrated"] if calibrated.recalibrated else []
        )
        print(f"re-calibrated during the run: {again or 'never'}")


if __name__ == "__main__":
    main()
