"""The never-slower floor in one table: every cell the promise covers, measured in one run.

    python benchmarks/floor.py [--contexts 128,1k,3k] [--replies 64,256] [--long-replies 128]
                               [--files 3] [--short-files 8] [--repeats 2] [--widths 4,8,16]
                               [--window 1024]
                               [--concurrent 4] [--regimes stock,openblas]
                               [--calibrations fresh,stale] [--strict]

One row per cell:
  * regime: MLX's stock wheel (a W-token verify costs about W plain steps: speculation
    cannot pay) and Debian's OpenBLAS preloaded (`apt-get install libopenblas0-pthread`:
    wide verifies cheap, as on a Mac's memory-bound GPU), each in its own processes;
  * calibration: `fresh`, measured in this run's regime; `stale`, the other regime's curves
    planted in the calibration cache under this regime's key (a calibration taken under
    other conditions), the product's own re-calibration left to act as it does;
  * draft: `demo`, the shipped pair (its draft declares the 256-position window it was
    trained with); `full`, the same draft without that declaration (its blocks see the whole
    context); `full+W`, that draft with `draft_window=W` (`--window`), on long prompts;
  * prompt length and reply length (`--replies` at short prompts, `--long-replies` beyond);
  * alone, and (short prompts, the demo pair) `--concurrent` requests decoded together
    (`batch_generate`) against the same requests one after another and against a batch at
    a fixed W=4.

Prompts are stretches of the pair's held-out standard-library files. In each cell the
script alternates, after a warm-up, mlx-lm's greedy decoding (`generate_step`, the plain
baseline), the engine's forced plain decoding (`verify_width=1`), the fixed widths
(`--widths`, at short prompts) and the automatic width (the default), whose chooser is
carried from request to request as a server carries it: for each prompt and repeat,
mlx-lm, then the engine's methods in an order rotated from one prompt to the next, then
mlx-lm again (the baseline is the geometric mean of its two runs). Every output is
checked against mlx-lm's tokens. Speeds are tokens after the first per second (aggregate tokens per
second of wall time, prefill included, for concurrent requests), TTFT is wall time from
the call to the first token (the engine's own `Stats`); each ratio is a geometric
mean paired by prompt and repeat with its 95% interval, and `worst` is the slowest
prompt's own mean. Short prompts take `--short-files` files (a request there lasts a
fraction of a second, within which this machine's speed moves by 3-4%: more requests, not
longer ones, narrow its interval), long ones `--files`. The last column says whether the
cell meets the issue's goal:
  * short prompts: auto >= 1.0x plain on the stock wheel (fresh), >= 0.97x the best fixed
    width with OpenBLAS (fresh), >= 0.95x the best fixed width on a stale calibration (the
    best fixed width: the one fastest over the cell, paired with auto request by request);
  * ~1k and ~3k prompts: auto >= 0.97x plain, worst prompt >= 0.90x;
  * concurrent: batched >= 1.5x serial and >= the fixed W=4 batch.
Below the table, the cells where auto decoded plainly throughout (no probe, τ 1.00) pooled
per regime: auto and forced plain against mlx-lm over all their requests, the plain path's
speed measured to within a percent where one cell's interval spans several; and each
request's whole time (first token and the rest) against mlx-lm's.
`--strict` exits 1 when a cell misses its goal (a guard for the floor; the decisions behind
each cell are tested on injected costs in tests/test_policy.py, test_adaptive.py, test_floor.py,
test_batch_floor.py and test_stretch.py). Ratios, not absolute numbers, carry over, and
only within one run.
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
from never_slower import from_logs, nowindow_pair, paired  # noqa: E402

REGIMES = ("stock", "openblas")


def regime_env(regime: str, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if regime == "openblas":
        env["LD_PRELOAD"] = str(OPENBLAS)
    env["DFLASH_MLX_CACHE"] = str(cache)
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,1k,3k")
    ap.add_argument("--replies", default="64,256", help="reply lengths at short prompts")
    ap.add_argument("--long-replies", default="128", help="reply lengths at long prompts")
    ap.add_argument("--files", type=int, default=3, help="held-out files (one prompt each)")
    ap.add_argument("--short-files", type=int, default=8, help="files at short prompts")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--widths", default="4,8,16", help="fixed widths, at short prompts")
    ap.add_argument("--window", type=int, default=1024, help="the full+W draft's window")
    ap.add_argument("--concurrent", type=int, default=4, help="requests at once (0: none)")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--calibrations", default="fresh,stale")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a cell misses its goal")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: REGIME:CALIBRATION:ROOT
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    regimes = [r for r in args.regimes.split(",") if r]
    calibrations = [c for c in args.calibrations.split(",") if c]
    if "openblas" in regimes and not OPENBLAS.exists():
        sys.exit(f"{OPENBLAS} is missing (apt-get install libopenblas0-pthread)")
    root = Path(tempfile.mkdtemp(prefix="dflash-floor-"))
    argv = [a for a in sys.argv[1:] if a != "--strict"]
    # Each regime's own curves first: a stale run decodes on the other regime's.
    need = set(regimes) | ({"stock", "openblas"} if "stale" in calibrations else set())
    for regime in sorted(need):
        code = subprocess.call(
            [sys.executable, __file__, *argv, "--child", f"{regime}:calibrate:{root}"],
            env=regime_env(regime, root / f"cache-{regime}"),
        )
        if code:
            sys.exit(code)
    for regime in regimes:
        for cal in calibrations:
            cache = root / f"cache-{regime}-{cal}"
            if cal == "fresh":  # this run's own measurement, not re-measured
                shutil.copytree(root / f"cache-{regime}", cache)
            code = subprocess.call(
                [sys.executable, __file__, *argv, "--child", f"{regime}:{cal}:{root}"],
                env=regime_env(regime, cache),
            )
            if code:
                sys.exit(code)
    rows = []
    for regime in regimes:
        for cal in calibrations:
            rows += json.loads((root / f"rows-{regime}-{cal}.json").read_text())
    missed = report(rows, args)
    shutil.rmtree(root, ignore_errors=True)
    if args.strict and missed:
        sys.exit(1)


def goal(row: dict) -> tuple[str, bool | None]:
    """The issue's goal for a cell and whether it is met (None: no goal there)."""
    if row["mode"] != "alone":
        ok = row["vs_serial"][0] >= 1.5 and row["vs_w4"][0] >= 1.0
        return ">= 1.5x serial, >= W=4", ok
    if row["prompt"] <= 256:
        best = row.get("vs_best")
        if row["calibration"] == "stale":
            return (">= 0.95x best W", best[0] >= 0.95) if best else ("", None)
        if row["regime"] == "stock":
            return ">= 1.0x mlx-lm", row["vs_plain"][0] >= 1.0
        return (">= 0.97x best W", best[0] >= 0.97) if best else ("", None)
    ok = row["vs_plain"][0] >= 0.97 and row["worst"] >= 0.90
    return ">= 0.97x mlx-lm, worst >= 0.90", ok


def fmt(r) -> str:
    return f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})" if r else "-"


def report(rows: list[dict], args) -> int:
    print(
        f"\n# The floor in one table ({args.short_files} prompts at short prompts, "
        f"{args.files} at long ones, x {args.repeats} repeats a cell; "
        "speed ratios, geometric means with 95% intervals)\n"
    )
    print(
        "| regime | calibration | draft | prompt | reply | requests | auto / mlx-lm | worst "
        "| forced plain / mlx-lm | auto / best W | TTFT forced plain / mlx-lm | TTFT auto / mlx-lm "
        "| τ | probes | batched / serial | batched / W=4 | goal | met |"
    )
    print("|" + "---|" * 18)
    missed = 0
    for r in rows:
        text, ok = goal(r)
        missed += ok is False
        alone = r["mode"] == "alone"
        print(
            f"| {r['regime']} | {r['calibration']}{' (re-calibrated)' if r['recal'] else ''} "
            f"| {r['draft']} | {r['prompt']} | {r['reply']} | {1 if alone else r['mode']} "
            f"| {fmt(r.get('vs_plain'))} | {r['worst']:.2f} | {fmt(r.get('plain'))} "
            f"| {fmt(r.get('vs_best'))}{' ' + r['best_width'] if r.get('best_width') else ''} "
            f"| {fmt(r.get('ttft_plain'))} | {fmt(r.get('ttft_auto'))} "
            f"| {r['tau']:.2f} | {r['probes']:.1f} "
            f"| {fmt(r.get('vs_serial'))} | {fmt(r.get('vs_w4'))} | {text} "
            f"| {'-' if ok is None else 'yes' if ok else '**no**'} |"
        )
    print(
        f"\n{len(rows) - missed} of {len(rows)} cells meet their goal; every output equalled "
        "mlx-lm's greedy tokens"
    )
    pooled(rows)
    return missed


def pooled(rows: list[dict]) -> None:
    """The cells where auto decoded plainly throughout, pooled per regime: each request's
    ratio to its own bracketed baseline, geometric means with 95% intervals."""

    def mean(logs: list[float]) -> str:
        return fmt(from_logs(logs))

    print(
        "\n| regime | plain cells | requests | auto / mlx-lm | forced plain / mlx-lm "
        "| auto / forced plain | whole request: auto / mlx-lm | forced plain / mlx-lm |"
        "\n|---|---:|---:|---|---|---|---|---|"
    )
    for regime in dict.fromkeys(r["regime"] for r in rows):
        cells = [
            r
            for r in rows
            if r["regime"] == regime and "logs" in r and r["probes"] == 0 and r["tau"] <= 1.0
        ]
        if not cells:
            continue
        auto = [x for r in cells for x in r["logs"]["auto"]]
        plain = [x for r in cells for x in r["logs"]["plain"]]
        both = [a - b for a, b in zip(auto, plain)]
        whole = {
            m: [x for r in cells for x in r.get("whole", {}).get(m, [])] for m in ("auto", "plain")
        }
        print(
            f"| {regime} | {len(cells)} | {len(auto)} | {mean(auto)} | {mean(plain)} "
            f"| {mean(both)} | {mean(whole['auto'])} | {mean(whole['plain'])} |"
        )


def child(args) -> None:
    regime, cal, root = args.child.split(":", 2)
    root = Path(root)
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from dflash_mlx import GenerateOptions, batch_generate, generate, load_pair
    from dflash_mlx.calibration import cache_path, calibration_key
    from dflash_mlx.demo import SHIPPED, demo_pair

    target_dir, draft_dir = demo_pair()
    full_dirs = nowindow_pair(target_dir, draft_dir)
    drafts = {"demo": (target_dir, draft_dir), "full": full_dirs}
    if cal == "calibrate":
        curves = {}
        for name, dirs in drafts.items():
            pair, _ = load_pair(*dirs)
            pair.costs()
            curves[name] = json.loads(cache_path(pair).read_text())
        (root / f"curves-{regime}.json").write_text(json.dumps(curves))
        return
    other = "openblas" if regime == "stock" else "stock"
    planted = json.loads((root / f"curves-{other}.json").read_text()) if cal == "stale" else {}
    files = json.loads((SHIPPED / "BUILD.json").read_text())["target"]["held_out_files"]
    widths = [int(w) for w in args.widths.split(",") if w]
    short_replies = [int(n) for n in args.replies.split(",") if n]
    long_replies = [int(n) for n in args.long_replies.split(",") if n]
    print(
        f"# {regime}, {cal} calibration; MLX {mx.__version__} {mx.default_device()}",
        flush=True,
    )

    def load(name: str):
        pair, tok = load_pair(*drafts["demo" if name == "demo" else "full"])
        if name in planted or (name.startswith("full") and "full" in planted):
            data = dict(planted["demo" if name == "demo" else "full"])
            data["key"] = calibration_key(pair)  # read as this regime's own curves
            path = cache_path(pair)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data))
        pair.costs()
        return pair, tok

    def mlx_lm(model, ids, n, ttft=None):
        out, tic, first = [], time.perf_counter(), 0.0
        for t, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=None):
            if not out:
                first = time.perf_counter()
            out.append(int(t))
        if ttft is not None:
            ttft.append(first - tic)
        return (n - 1) / (time.perf_counter() - first), out

    rows = []
    names = ["demo", "full", f"full+{args.window}"]
    for name in names:
        pair, tok = load(name)
        window = args.window if "+" in name else None
        opts = GenerateOptions(draft_window=window)
        warm = prompts_at(tok, files[:1], 128)[0]
        for _ in range(2):
            mlx_lm(pair.model, warm, 32)
            for w in (1, None):
                generate(pair, tok, warm, opts.replace(max_tokens=32, verify_width=w))
        for n_ctx in counts(args.contexts):
            short = n_ctx <= 256
            if window is not None and short:
                continue  # a window wider than the prompt changes nothing
            prompts = prompts_at(tok, files[: args.short_files if short else args.files], n_ctx)
            methods = ["plain", *(f"W={w}" for w in widths if short), "auto"]
            for n in short_replies if short else long_replies:
                speed = {m: [] for m in ["mlx-lm", *methods]}
                per_prompt: dict[int, list[float]] = {}
                taus, probes = [], []
                ttft: dict[str, list[float]] = {"mlx-lm": [], "plain": [], "auto": []}
                for rep in range(args.repeats):
                    for i, ids in enumerate(prompts):
                        k = (i + rep) % len(methods)
                        # mlx-lm before and after the group (its baseline their geometric
                        # mean): a drift over the group's seconds moves it as it moves the
                        # methods between, where one run before them all set every ratio
                        # by the group's first seconds alone.
                        first: list[float] = []  # the two runs' TTFT
                        before, ref = mlx_lm(pair.model, ids, n, first)
                        for m in methods[k:] + methods[:k]:
                            w = 1 if m == "plain" else None if m == "auto" else int(m[2:])
                            out = generate(
                                pair, tok, ids, opts.replace(max_tokens=n, verify_width=w)
                            )
                            if out.tokens != ref:
                                sys.exit(f"{regime} {cal} {name} {n_ctx}/{n} {m}: output differs")
                            speed[m].append(out.stats.generation_tps)
                            if m in ttft:
                                ttft[m].append(out.stats.time_to_first_token)
                            if m == "auto":
                                taus.append(out.stats.tau)
                                probes.append(out.stats.probes)
                                per_prompt.setdefault(i, []).append(
                                    math.log(out.stats.generation_tps)
                                )
                        tps, again = mlx_lm(pair.model, ids, n, first)
                        if again != ref:
                            sys.exit(f"{regime} {cal} {name} {n_ctx}/{n} mlx-lm: output differs")
                        tps = math.sqrt(before * tps)
                        speed["mlx-lm"].append(tps)
                        ttft["mlx-lm"].append(math.sqrt(first[0] * first[1]))
                        per_prompt[i][-1] -= math.log(tps)
                base = speed["mlx-lm"]
                fixed = [m for m in methods if m.startswith("W=")]
                # The best fixed width is the one width fastest over the cell (what a user
                # who fixed W would get), not each request's fastest: a maximum of three
                # noisy runs per request rides their noise (8% at +-10% per request).
                top = max(
                    fixed, key=lambda m: statistics.fmean(map(math.log, speed[m])), default=None
                )
                best = speed[top] if top else []
                row = {
                    "regime": regime,
                    "calibration": cal,
                    "recal": pair.recalibrated,
                    "draft": name,
                    "prompt": n_ctx,
                    "reply": n,
                    "mode": "alone",
                    "vs_plain": paired(speed["auto"], base),
                    "worst": min(math.exp(statistics.fmean(v)) for v in per_prompt.values()),
                    "plain": paired(speed["plain"], base),
                    "vs_best": paired(speed["auto"], best) if fixed else None,
                    "best_width": top,
                    "tau": statistics.fmean(taus),
                    "probes": statistics.fmean(probes),
                    "ttft_plain": paired(ttft["plain"], ttft["mlx-lm"]),
                    "ttft_auto": paired(ttft["auto"], ttft["mlx-lm"]),
                    # each request's log ratio against its baseline (pooled below the table)
                    "logs": {
                        m: [math.log(a / b) for a, b in zip(speed[m], base)]
                        for m in ("auto", "plain")
                    },
                    # each request's whole time (first token and the rest) against mlx-lm's,
                    # as a speed ratio: where one engine's first token waits for the launch
                    # of the next step and the other's does not, the two split the same
                    # seconds differently between TTFT and the rest
                    "whole": {
                        m: [
                            math.log((t0 + (n - 1) / b) / (t + (n - 1) / a))
                            for a, t, b, t0 in zip(speed[m], ttft[m], base, ttft["mlx-lm"])
                        ]
                        for m in ("auto", "plain")
                    },
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
            if name != "demo" or args.concurrent < 2 or not short:
                continue  # long prompts' prefills, which batching does not share, dominate
            # Concurrent requests: a batch against the same requests one after another.
            group = prompts_at(tok, files[: args.concurrent], n_ctx)
            n = (short_replies if short else long_replies)[-1]
            refs = [mlx_lm(pair.model, ids, n)[1] for ids in group]
            runs = {"batched": [], "serial": [], "W=4": []}
            taus = []
            for rep in range(args.repeats):
                order = list(runs)[rep % 3 :] + list(runs)[: rep % 3]
                for m in order:
                    o = GenerateOptions(max_tokens=n, verify_width=4 if m == "W=4" else None)
                    tic = time.perf_counter()
                    if m == "serial":
                        outs = [generate(pair, tok, ids, o) for ids in group]
                    else:
                        outs = batch_generate(pair, tok, group, o)
                    wall = time.perf_counter() - tic
                    if [x.tokens for x in outs] != refs:
                        sys.exit(f"{regime} {cal} {n_ctx}/{n} {m}: output differs")
                    runs[m].append(sum(len(x.tokens) for x in outs) / wall)
                    if m == "batched":
                        taus.append(statistics.fmean(x.stats.tau for x in outs))
            row = {
                "regime": regime,
                "calibration": cal,
                "recal": pair.recalibrated,
                "draft": name,
                "prompt": n_ctx,
                "reply": n,
                "mode": str(len(group)),
                "worst": min(a / b for a, b in zip(runs["batched"], runs["serial"])),
                "vs_serial": paired(runs["batched"], runs["serial"]),
                "vs_w4": paired(runs["batched"], runs["W=4"]),
                "tau": statistics.fmean(taus),
                "probes": 0.0,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    (root / f"rows-{regime}-{cal}.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
