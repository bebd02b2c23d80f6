"""The automatic width where it decodes plainly, against forced plain (`verify_width=1`),
in one process, alternated between mlx-lm runs (the baseline the geometric mean of the two
around each pair), with what each request did: target passes, passes that captured
features for the draft, plain stretches, the chooser's decisions (`choose` calls, and
those not coasting), prompts whose draft context was built in prefill, probes.

    python benchmarks/auto_plain.py [--context 1024] [--tokens 128] [--files 3]
                                    [--repeats 4] [--draft full] [--teach 16]

`--draft demo` is the shipped pair, `full` its draft without its declared window (whose
dormant prefill keeps a deferred window of context that no probe may read). `--teach N`
first decodes N requests of 256 tokens at 128-token prompts with the automatic width, as a
server's chooser has decoded other requests before (where speculation paid there, the
chooser comes to long prompts with the acceptance it learnt). Prints tokens
after the first per second against mlx-lm's `generate_step` for both, auto against forced
plain (paired, 95% interval), and the counts per request. Outputs are checked against
mlx-lm's tokens. Run it pinned (`taskset -c 0`) on an idle machine, once per regime (the
stock wheel; `LD_PRELOAD` Debian's OpenBLAS with `OPENBLAS_NUM_THREADS=1`), with a fresh
`DFLASH_MLX_CACHE`.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from draft_window import prompts_at  # noqa: E402
from never_slower import interval, nowindow_pair  # noqa: E402


def counting(counts: collections.Counter) -> None:
    """Count, into `counts`, what each request does (patched into the engine's modules)."""
    from dflash_mlx.engine import batch_cycle, plain
    from dflash_mlx.speed.adaptive import WidthChooser

    run_pass, stretch, choose = batch_cycle.plain_pass, plain.stretch, WidthChooser.choose
    builds = WidthChooser.builds_context

    def counted_pass(target, rows, top, cache, caps, at):
        counts["passes"] += 1
        counts["captured"] += any(caps)
        return run_pass(target, rows, top, cache, caps, at)

    def counted_stretch(*a):
        counts["stretches"] += 1
        return stretch(*a)

    def counted_choose(self, *a, **k):
        counts["decisions"] += 1
        counts["not coasting"] += not self.coasting()
        return choose(self, *a, **k)

    def counted_builds(self, *a, **k):
        built = builds(self, *a, **k)
        counts["context built"] += built
        return built

    batch_cycle.plain_pass, plain.stretch = counted_pass, counted_stretch
    WidthChooser.choose, WidthChooser.builds_context = counted_choose, counted_builds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=128, help="reply tokens")
    ap.add_argument("--files", type=int, default=3, help="held-out files (one prompt each)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--draft", choices=("demo", "full"), default="full")
    ap.add_argument("--teach", type=int, default=0, help="short requests decoded first")
    args = ap.parse_args()
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from dflash_mlx import GenerateOptions, generate, load_pair
    from dflash_mlx.demo import SHIPPED, demo_pair

    n = args.tokens
    dirs = demo_pair() if args.draft == "demo" else nowindow_pair(*demo_pair())
    pair, tok = load_pair(*dirs)
    pair.costs()
    files = json.loads((SHIPPED / "BUILD.json").read_text())["target"]["held_out_files"]
    prompts = prompts_at(tok, files[: args.files], args.context)
    counts = {"plain": collections.Counter(), "auto": collections.Counter()}
    now: collections.Counter = collections.Counter()
    counting(now)

    def mlx_lm(ids) -> tuple[float, list[int]]:
        out, first = [], 0.0
        for t, _ in generate_step(mx.array(ids), pair.model, max_tokens=n, sampler=None):
            if not out:
                first = time.perf_counter()
            out.append(int(t))
        return (n - 1) / (time.perf_counter() - first), out

    def ours(name: str, ids, ref: list[int]) -> float:
        now.clear()
        width = 1 if name == "plain" else None
        out = generate(pair, tok, ids, GenerateOptions(max_tokens=n, verify_width=width))
        if out.tokens != ref:
            sys.exit(f"{name}: output differs from mlx-lm's")
        counts[name].update(now)
        counts[name]["probes"] += out.stats.probes
        return out.stats.generation_tps

    for ids in (prompts_at(tok, files, 128) * args.teach)[: args.teach]:
        generate(pair, tok, ids, GenerateOptions(max_tokens=256))
    for _ in range(2):  # warm-up
        ref = mlx_lm(prompts[0])[1]
        ours("plain", prompts[0], ref), ours("auto", prompts[0], ref)
    for c in counts.values():
        c.clear()
    logs: dict[str, list[float]] = {"plain": [], "auto": []}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            before, ref = mlx_lm(ids)
            order = ["plain", "auto"] if (i + rep) % 2 == 0 else ["auto", "plain"]
            got = {m: ours(m, ids, ref) for m in order}
            base = math.sqrt(before * mlx_lm(ids)[0])
            for m in logs:
                logs[m].append(math.log(got[m] / base))
    requests = args.repeats * len(prompts)
    for m, v in logs.items():
        per = ", ".join(f"{k} {c / requests:.1f}" for k, c in sorted(counts[m].items()))
        print(f"{m} / mlx-lm: {interval(v)}; per request: {per}")
    print(f"auto / plain: {interval([a - b for a, b in zip(logs['auto'], logs['plain'])])}")


if __name__ == "__main__":
    main()
